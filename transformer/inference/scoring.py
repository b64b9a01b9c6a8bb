"""Scores of translations: sacreBLEU's BLEU and chrF (with signatures), the length ratio, and a model in memory
translating and scored in one call."""

from __future__ import annotations

from collections.abc import Sequence

from transformer.errors import UserError
from transformer.inference.settings import SearchSettings
from transformer.inference.translator import translate_ids


def length_ratio(scores: dict) -> float:
    """Hypothesis length over reference length, as sacreBLEU counts them (below 1: translations too short, and
    the brevity penalty takes its share of BLEU)."""
    return scores["sys_len"] / max(scores["ref_len"], 1)


def bleu_chrf(hypotheses: Sequence[str], references: Sequence[str]) -> dict:
    """Corpus BLEU and chrF with sacreBLEU defaults (13a tokenisation, cased), with their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hypotheses) != len(references):
        raise UserError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(list(hypotheses), [list(references)])
    c = chrf.corpus_score(list(hypotheses), [list(references)])
    return {
        "bleu": b.score,
        "chrf": c.score,
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b),
        "chrf_detail": str(c),
        "bp": b.bp,
        "sys_len": b.sys_len,
        "ref_len": b.ref_len,
        "sentences": len(hypotheses),
    }


def translate_and_score(
    model, vocab, sources: Sequence[Sequence[int]], references: Sequence[str], settings: SearchSettings, device
) -> tuple[dict, list[str]]:
    """BLEU and chrF (bleu_chrf) of a model in memory translating `sources` (subword ids) with `settings`; and
    the translations."""
    hypotheses = vocab.decode(translate_ids(model, sources, settings, device))
    return bleu_chrf(hypotheses, references), hypotheses
