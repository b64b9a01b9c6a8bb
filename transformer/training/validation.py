"""Validation during training: the label-smoothed loss and NLL over every rank's share, and BLEU (with the other
scores of train.valid_scores) on a slice."""

from __future__ import annotations

import math

import torch

from transformer.device import autocast_context
from transformer.distributed import DistInfo, all_reduce_sum
from transformer.inference.scoring import length_ratio, mean_scores, named, translate_and_score
from transformer.inference.settings import SearchFlags, search_settings
from transformer.model.transformer import evaluating
from transformer.training.optim import label_smoothed_loss


@torch.no_grad()
def evaluate_loss(model, batches, device, precision: str, smoothing: float, info: DistInfo = DistInfo()) -> dict:
    """Label-smoothed loss and NLL per target token, summed over all ranks' shares; ppl = exp(NLL)."""
    total = torch.zeros(3, device=device, dtype=torch.float64)  # loss, nll, tokens
    with evaluating(model, inference=False):  # no_grad above; total is updated in place
        for batch in batches[info.rank :: info.world_size]:
            batch = batch.to(device)
            with autocast_context(device, precision):
                logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
            logits = logits.float()
            total[0] += label_smoothed_loss(logits, batch.tgt_out, smoothing, batch.pad_id)
            total[1] += label_smoothed_loss(logits, batch.tgt_out, 0.0, batch.pad_id)
            total[2] += batch.n_tgt_tokens
    loss, nll, tokens = all_reduce_sum(total, info).tolist()
    nll = nll / max(tokens, 1)
    return {"loss": loss / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50.0))}


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
