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
from transformer.training.validation import COLLAPSED_SIMILARITY, collapse_warning, evaluate_loss


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


def _model(norm: str = "post") -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(
        d_model=16, n_heads=2, n_encoder_layers=2, n_decoder_layers=1, d_ff=32, max_positions=64, norm=norm
    )
    return Transformer(cfg, 100)


def test_encoder_similarity_is_the_mean_cosine_between_two_positions_of_a_sentence():
    """Against the (S, S) cosine matrix of each sentence, pairs of one position with itself and padding left out."""
    model = _model()
    pairs = random_pairs(8, seed=5, max_len=10, vocab=100)
    batches = [Batch.from_pairs(pairs[:4]), Batch.from_pairs(pairs[4:])]
    result = evaluate_loss(model, batches, torch.device("cpu"), "fp32", 0.1)
    model.eval()
    expected = []
    with torch.no_grad():
        for b in batches:
            memory = model.encode(b.src, b.src_mask)
            for row, real in zip(memory, b.src_mask[:, 0, 0, :]):
                x = F.normalize(row[real].double(), dim=-1)
                if len(x) > 1:
                    cos = x @ x.T
                    expected.append((cos.sum() - cos.diagonal().sum()).item() / (len(x) * (len(x) - 1)))
    assert len(expected) == 8  # each source has its EOS beside its words: two positions at least
    assert result["encoder_similarity"] == pytest.approx(sum(expected) / len(expected), rel=1e-6)


def test_an_encoder_that_gives_one_vector_for_every_position_is_named_with_its_fix():
    """Built to collapse: a pre-norm encoder's final LayerNorm with no gain and a fixed bias outputs the bias at
    every position, whatever the source; the same model before the change is not flagged."""
    model = _model(norm="pre")
    batches = [Batch.from_pairs(random_pairs(6, seed=2, max_len=10, vocab=100))]
    healthy = evaluate_loss(model, batches, torch.device("cpu"), "fp32", 0.1)["encoder_similarity"]
    with torch.no_grad():
        model.encoder_norm.weight.zero_()
        model.encoder_norm.bias.copy_(torch.linspace(-1.0, 1.0, 16))
    collapsed = evaluate_loss(model, batches, torch.device("cpu"), "fp32", 0.1)["encoder_similarity"]
    assert collapsed == pytest.approx(1.0, abs=1e-9) and healthy < COLLAPSED_SIMILARITY
    assert collapse_warning(healthy, 600) is None
    warning = collapse_warning(collapsed, 600)
    assert warning.startswith("step 600: the encoder's outputs are nearly the same at every position")
    assert "lower train.lr" in warning and "model.norm: pre" in warning


def test_validation_lines_record_the_encoder_similarity(tmp_path):
    run_dir = train(from_dict(tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 2})), quiet=True)
    (valid,) = [m for m in read_metrics(run_dir) if m.get("split") == "valid"]
    assert -1.0 <= valid["encoder_similarity"] <= 1.0
