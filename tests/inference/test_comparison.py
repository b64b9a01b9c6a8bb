"""Systems compared (inference/comparison.py): sacreBLEU's paired bootstrap resampling over every score, a real gain
significant with an interval that excludes 0, identical systems p = 1, the same figures on every run, and the
table."""

from __future__ import annotations

import os
import random

import pytest

from transformer.errors import UserError
from transformer.inference.comparison import RESAMPLES, SEED, compare, table
from transformer.inference.scoring import NAMES, SCORES

WORDS = "a the dog cat man woman child runs sits jumps on in under red green big small park street water ball".split()


def sentences(n: int = 80, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + " ." for _ in range(n)]


def garbled(lines: list[str], seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    out = []
    for line in lines:
        words = line.split()
        rng.shuffle(words)
        out.append(" ".join(words[: len(words) // 2]))
    return out


def test_a_system_equal_to_the_reference_beats_a_garbled_one_significantly():
    references = sentences()
    result = compare([("garbled", garbled(references)), ("perfect", references)], references)
    assert [row["system"] for row in result["systems"]] == ["garbled", "perfect"] and result["baseline"] == "garbled"
    assert (result["resamples"], result["seed"]) == (RESAMPLES, SEED) == (1000, 12345)
    for score in SCORES:
        base, better = result["systems"][0][score.name], result["systems"][1][score.name]
        assert "delta" not in base and base["ci"] > 0  # the baseline has its interval, no difference to itself
        low, high = better["delta_ci"]
        assert better["p"] < 0.05, score.name
        if score.higher_is_better:
            assert better["delta"] > 0 and 0 < low <= high, (score.name, better)
        else:  # fewer edits (TER) are better: the difference is below 0
            assert better["delta"] < 0 and low <= high < 0, (score.name, better)
        assert f"bs:{RESAMPLES}|seed:{SEED}" in result["signatures"][score.name]


def test_identical_systems_have_p_1_and_no_difference():
    """sacreBLEU's own p would be 1/1001 here (no resample lies strictly above a difference of 0)."""
    references = sentences()
    hypotheses = garbled(references)
    result = compare([("a", hypotheses), ("b", list(hypotheses))], references)
    for name in NAMES:
        same = result["systems"][1][name]
        assert same["p"] == 1.0 and same["delta"] == 0 and same["delta_ci"] == [0.0, 0.0]
        assert same["score"] == result["systems"][0][name]["score"] and same["ci"] == result["systems"][0][name]["ci"]


def test_the_resamples_are_paired_and_the_same_on_every_run(monkeypatch):
    """A system that only fixes one sentence of the baseline scores at least as well on every resample of the same
    sentences (never below 0, as unpaired resamples would), so the difference's interval starts at 0 and is
    narrower than either score's. A seed in the environment changes nothing, and is put back."""
    references = sentences()
    baseline = garbled(references)
    one_fixed = [references[0], *baseline[1:]]
    first = compare([("base", baseline), ("one", one_fixed)], references)
    for score in SCORES:
        row = first["systems"][1][score.name]
        low, high = row["delta_ci"] if score.higher_is_better else [-d for d in reversed(row["delta_ci"])]
        assert 0 == low < high < 2 * row["ci"], (score.name, row)
    monkeypatch.setenv("SACREBLEU_SEED", "none")
    assert compare([("base", baseline), ("one", one_fixed)], references) == first
    assert os.environ["SACREBLEU_SEED"] == "none"


def test_bad_input_is_one_line():
    references = sentences(10)
    with pytest.raises(UserError, match=r"^evaluate: b has 9 translations but the test set 10 sentences; line N"):
        compare([("a", references), ("b", references[:9])], references)
    with pytest.raises(UserError, match="a baseline and at least one other system"):
        compare([("a", references)], references)


def test_the_table_has_a_line_per_score_and_system_with_the_differences_after_the_baseline():
    references = sentences()
    result = compare([("runs/base", garbled(references)), ("runs/bt", references)], references)
    text = table(result)
    lines = text.splitlines()
    assert "1000 resamples, seed 12345" in lines[0] and "runs/base" in lines[0]
    assert all(f"lower is better for {s.label}" in text for s in SCORES if not s.higher_is_better)
    rows = [line for line in lines if line.split()[0] in {s.label for s in SCORES}]
    assert len(rows) == 2 * len(SCORES)
    for score in SCORES:
        base, bt = [line for line in rows if line.split()[0] == score.label]
        assert "runs/base" in base and "*" not in base and "runs/bt" in bt and bt.endswith(" *")
        p = result["systems"][1][score.name]["p"]
        assert f"{p:.4f}" in bt
