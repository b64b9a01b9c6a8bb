"""Validation during training (training/validation.py): the label-smoothed loss, NLL and perplexity per target
token, as cross entropy computes them over the same batches; the scores train.valid_scores names."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import random_pairs, read_metrics, tiny_config
from transformer.config import ModelConfig, from_dict
from transformer.data.batch import Batch
from transformer.data.vocab import PAD_ID
from transformer.errors import UserError
from transformer.inference.scoring import NAMES
from transformer.model.checkpoint import load_checkpoint
from transformer.model.transformer import Transformer
from transformer.training.loop import train
from transformer.training.validation import evaluate_loss


def test_validation_loss_nll_and_perplexity_per_target_token():
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, max_positions=64), 100
    )
    pairs = random_pairs(12, seed=3, max_len=10, vocab=100)
    batches = [Batch.from_pairs(pairs[:5]), Batch.from_pairs(pairs[5:])]
    result = evaluate_loss(model, batches, torch.device("cpu"), "fp32", 0.1)
    model.eval()
    with torch.no_grad():
        logits = torch.cat([model(b.src, b.tgt_in, b.src_mask, b.tgt_mask).flatten(0, 1) for b in batches])
    targets = torch.cat([b.tgt_out.flatten() for b in batches])
    nll = F.cross_entropy(logits, targets, ignore_index=PAD_ID).item()
    smoothed = F.cross_entropy(logits, targets, ignore_index=PAD_ID, label_smoothing=0.1).item()
    assert result["nll"] == pytest.approx(nll, rel=1e-5) and result["loss"] == pytest.approx(smoothed, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_validation_computes_the_scores_train_valid_scores_names(tmp_path):
    """Each of them in metrics.jsonl's validation lines, TensorBoard's valid/ scalars and the validation line of
    train.log; best.pt still follows BLEU."""
    raw = tiny_config(
        tmp_path,
        train={"max_steps": 2, "valid_every": 2, "valid_bleu": True, "valid_scores": ["chrf", "bleu"]},
    )
    run_dir = train(from_dict(raw), quiet=True)
    (valid,) = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert set(valid) >= {"bleu", "chrf", "length_ratio"} and set(valid) & set(NAMES) == {"bleu", "chrf"}
    line = next(x for x in (run_dir / "train.log").read_text().splitlines() if "step 2: valid loss" in x)
    assert line.index(" bleu ") < line.index(" chrf ")  # in SCORES' order
    assert load_checkpoint(run_dir / "best.pt")["run"]["best_metric"] == "bleu"


def test_an_unknown_score_is_refused_before_the_run_directory_is_made(tmp_path):
    raw = tiny_config(tmp_path, train={"valid_bleu": True, "valid_scores": ["bleu", "meteor"]})
    with pytest.raises(UserError, match=r"^config: train.valid_scores: unknown score 'meteor' \(the scores are bleu"):
        train(from_dict(raw), quiet=True)
    assert not (tmp_path / "run").exists()
