"""Scores (inference/scoring.py): SCORES, the one list of sacreBLEU's scores (BLEU, chrF, chrF++, TER), each perfect
on identical text and worse on garbled text in its own direction, with its signature; the length ratio that says
how short the translations are; and no other module naming a score but BLEU."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from transformer.errors import UserError
from transformer.inference.scoring import NAMES, SCORES, corpus_scores, describe, length_ratio, named

REFERENCES = ["A dog runs across the green field .", "Two cats sleep on a red sofa .", "A man rides a bike ."]
GARBLED = ["field the dog .", "sofa cats red", "bike man"]


def test_every_score_is_perfect_on_identical_text_and_worse_on_garbled_text():
    perfect, garbled = corpus_scores(REFERENCES, REFERENCES), corpus_scores(GARBLED, REFERENCES)
    for score in SCORES:
        best = 100.0 if score.higher_is_better else 0.0
        assert perfect[score.name] == pytest.approx(best), score.name
        assert (garbled[score.name] < best) if score.higher_is_better else (garbled[score.name] > best), score.name
        assert perfect[f"{score.name}_signature"].startswith("nrefs:1|") and perfect[f"{score.name}_detail"]
    assert perfect["sentences"] == 3 and corpus_scores(["a dog runs ."], ["A dog runs ."])["bleu"] < 100  # cased


def test_the_scores_are_sacrebleus_as_named():
    signatures = {name: value for name, value in corpus_scores(REFERENCES, REFERENCES).items() if "signature" in name}
    assert "tok:13a" in signatures["bleu_signature"] and "case:mixed" in signatures["bleu_signature"]
    assert "nw:0" in signatures["chrf_signature"] and "nw:2" in signatures["chrfpp_signature"]  # chrF++: word bigrams
    assert "tok:tercom" in signatures["ter_signature"]
    assert len(set(NAMES)) == len(NAMES) == len(SCORES) and all(name == name.lower() for name in NAMES)


def test_only_the_scores_asked_for_are_computed_and_an_unknown_one_is_a_one_line_error():
    scores = corpus_scores(REFERENCES, REFERENCES, ("chrf",))
    assert set(scores) & set(NAMES) == {"chrf"} and "bleu_signature" not in scores
    assert [s.name for s in named(("chrf", "bleu"))] == ["bleu", "chrf"]  # SCORES' order
    with pytest.raises(UserError, match=r"^config: train.valid_scores: unknown score 'meteor' \(the scores are bleu,"):
        named(("bleu", "meteor"), "config: train.valid_scores")
    with pytest.raises(UserError, match="2 hypotheses but 3 references"):
        corpus_scores(REFERENCES[:2], REFERENCES)


def test_describe_prints_each_score_held_in_order_with_the_length_ratio_beside_bleu():
    scores = corpus_scores(GARBLED, REFERENCES)
    text = describe(scores)
    assert text.startswith(f"BLEU {scores['bleu']:.2f} (length ratio {length_ratio(scores):.3f}), chrF ")
    assert [text.index(s.label + " ") for s in SCORES] == sorted(text.index(s.label + " ") for s in SCORES)
    assert describe({"bleu": 12.0, "length_ratio": 0.9}, lower=True) == "bleu 12.00 (length ratio 0.900)"
    assert describe({"loss": 1.0}) == ""


def test_length_ratio_is_hypothesis_over_reference():
    assert length_ratio({"sys_len": 8, "ref_len": 10}) == 0.8  # below 1: too short, the brevity penalty applies
    assert length_ratio(corpus_scores(["a dog"], ["a dog runs fast"])) == pytest.approx(0.5)


def test_no_module_but_scoring_names_a_score_other_than_bleu():
    """Every reader (evaluate, the end of training, validation, the metrics log, TensorBoard, serve, plots) goes
    through SCORES: a new score is an entry there, not a string in five modules. BLEU alone is named elsewhere, as
    what chooses best.pt and the search settings."""
    package = Path(__file__).resolve().parents[2] / "transformer"
    others = set(NAMES) - {"bleu"}
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "scoring.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in others:
                found.append(f"{path.relative_to(package)}:{node.lineno}: {node.value!r}")
    assert not found, found
