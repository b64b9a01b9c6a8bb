"""Scores (inference/scoring.py): sacreBLEU's BLEU and chrF, cased, perfect on identical text, and the length ratio
that says how short the translations are."""

from __future__ import annotations

import pytest

from transformer.inference.scoring import bleu_chrf, length_ratio


def test_bleu_chrf_identity_is_perfect():
    scores = bleu_chrf(["A dog runs .", "Two cats"], ["A dog runs .", "Two cats"])
    assert scores["bleu"] == pytest.approx(100) and scores["chrf"] == pytest.approx(100)
    assert bleu_chrf(["a dog runs ."], ["A dog runs ."])["bleu"] < 100  # cased


def test_length_ratio_is_hypothesis_over_reference():
    assert length_ratio({"sys_len": 8, "ref_len": 10}) == 0.8  # below 1: too short, the brevity penalty applies
    assert length_ratio(bleu_chrf(["a dog"], ["a dog runs fast"])) == pytest.approx(0.5)
