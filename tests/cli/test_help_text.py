"""The verbs' --help prose (help_text.py): every description is printed by its verb's --help, and names no score
by hand (the scores' labels come from scoring.SCORES)."""

from __future__ import annotations

import re

import pytest

from transformer.cli import help_text
from transformer.inference.scoring import SCORES

DESCRIPTIONS = {
    name: value
    for name, value in vars(help_text).items()
    if re.fullmatch(r"[A-Z_]+", name) and isinstance(value, str) and name != "SCORE_LABELS"
}


@pytest.mark.parametrize("name", sorted(DESCRIPTIONS))
def test_each_description_is_what_its_verb_prints(name, call):
    verb = name.lower().replace("_", "-")
    status, out, err = call(verb, "--help")
    assert status == 0, err
    first_words = " ".join(DESCRIPTIONS[name].split()[:8])
    assert first_words in " ".join(out.split()), verb


def test_evaluate_names_every_score():
    assert all(score.label in help_text.EVALUATE for score in SCORES)
