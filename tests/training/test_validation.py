"""Validation during training (training/validation.py): the label-smoothed loss, NLL and perplexity per target
token, as cross entropy computes them over the same batches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import random_pairs
from transformer.config import ModelConfig
from transformer.data.batch import Batch
from transformer.data.vocab import PAD_ID
from transformer.model.transformer import Transformer
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
