"""Validation during training: the label-smoothed loss and NLL over every rank's share, how alike the encoder's
outputs are across a sentence's positions, and BLEU (with the other scores of train.valid_scores) on a slice."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from transformer.device import autocast_context
from transformer.distributed import DistInfo, all_reduce_sum
from transformer.inference.scoring import length_ratio, mean_scores, named, translate_and_score
from transformer.inference.settings import SearchFlags, search_settings
from transformer.model.transformer import evaluating
from transformer.training.optim import label_smoothed_loss

# Above it, an encoder gives (nearly) one vector for every position of a sentence: the decoder can no longer tell
# its source's words apart and learns a language model (a deep post-norm encoder at a high learning rate does this).
# Trained models measure 0.15 to 0.45 here (base, back-translation and pre-norm student runs); a collapsed one, 1.0.
COLLAPSED_SIMILARITY = 0.95


@torch.no_grad()
def evaluate_loss(model, batches, device, precision: str, smoothing: float, info: DistInfo = DistInfo()) -> dict:
    """Label-smoothed loss and NLL per target token, summed over all ranks' shares; ppl = exp(NLL); and
    encoder_similarity, the mean cosine between the encoder's outputs at two positions of one source sentence."""
    total = torch.zeros(5, device=device, dtype=torch.float64)  # loss, nll, tokens, similarity, sentences
    with evaluating(model, inference=False):  # no_grad above; total is updated in place
        for batch in batches[info.rank :: info.world_size]:
            batch = batch.to(device)
            with autocast_context(device, precision):
                logits, memory = model.forward_with_memory(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
            logits = logits.float()
            total[0] += label_smoothed_loss(logits, batch.tgt_out, smoothing, batch.pad_id)
            total[1] += label_smoothed_loss(logits, batch.tgt_out, 0.0, batch.pad_id)
            total[2] += batch.n_tgt_tokens
            total[3:] += position_similarity(memory, batch.src_mask)
    loss, nll, tokens, similarity, sentences = all_reduce_sum(total, info).tolist()
    nll = nll / max(tokens, 1)
    return {
        "loss": loss / max(tokens, 1),
        "nll": nll,
        "ppl": math.exp(min(nll, 50.0)),
        "encoder_similarity": similarity / max(sentences, 1),
    }


def position_similarity(memory: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
    """memory (B, S, C), src_mask (B, 1, 1, S) -> [sum over sentences of the mean cosine between the outputs at
    two different real positions, number of sentences with two or more positions]. With unit vectors u_i, the
    sum over pairs i != j of u_i . u_j is |sum u_i|^2 - n: no (S, S) matrix is needed."""
    real = src_mask[:, 0, 0, :]  # (B, S)
    units = F.normalize(memory.double(), dim=-1) * real[..., None]
    n = real.sum(-1).double()
    pairs = n * (n - 1)
    mean_cos = (units.sum(1).pow(2).sum(-1) - n) / pairs.clamp(min=1)
    counted = pairs > 0
    return torch.stack([mean_cos[counted].sum(), counted.sum().double()])


def collapse_warning(similarity: float, step: int) -> str | None:
    """One line naming the fix when the encoder's outputs have become alike across positions, else None."""
    if similarity <= COLLAPSED_SIMILARITY:
        return None
    return (
        f"step {step}: the encoder's outputs are nearly the same at every position of a sentence (mean cosine "
        f"{similarity:.3f}; trained models: 0.15 to 0.45), so the decoder cannot read its source and will learn a "
        f"language model: train again with a lower train.lr, a longer train.warmup_steps, or model.norm: pre"
    )


def check_valid_scores(cfg) -> None:
    """train.valid_scores names scores there are (config.py, which knows none of them, checks the rest), before
    anything of the run is written."""
    named(cfg.train.valid_scores, "config: train.valid_scores")


def validation_scores(model, vocab, sets: list[tuple[str, object, list[str]]], cfg, device) -> dict:
    """sacreBLEU's scores (train.valid_scores) of the model's translations of (a slice of) each validation set
    (name, corpus, references: a multilingual run has one per language pair), their mean where there are several
    (scoring.mean_scores; each pair's BLEU as bleu_{name}), and the length ratio."""
    settings = search_settings(cfg.decode, SearchFlags(beam=cfg.train.valid_bleu_beam))
    per_pair = {}
    for name, corpus, refs in sets:
        n = min(cfg.train.valid_bleu_pairs or len(corpus), len(corpus))
        sources = [corpus.source(i) for i in range(n)]
        per_pair[name] = translate_and_score(model, vocab, sources, refs[:n], settings, device, cfg.train.valid_scores)[
            0
        ]
    scores = mean_scores(per_pair)
    by_pair = {f"bleu_{name}": s["bleu"] for name, s in scores.get("pairs", {}).items()}
    return {
        **{s.name: scores[s.name] for s in named(cfg.train.valid_scores)},
        **by_pair,
        "length_ratio": length_ratio(scores),
    }
