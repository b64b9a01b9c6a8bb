"""Systems compared on one test set as MT papers do: sacreBLEU's paired bootstrap resampling (`sacrebleu
--paired-bs`: PairedTest, 1000 resamples, a fixed seed) over every score of scoring.SCORES. Each system gets its
score with a 95% confidence interval; each system after the first (the baseline) its difference to the baseline,
with that difference's 95% confidence interval (over the same resamples) and the p-value; `table` prints them."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from transformer.errors import UserError
from transformer.inference.scoring import SCORES

RESAMPLES = 1000  # sacreBLEU's default for the paired bootstrap
SEED = 12345  # sacreBLEU's default seed: the same resamples, so the same figures, on every run
SIGNIFICANT = 0.05  # the level the table marks with *


@contextmanager
def _seeded() -> Iterator[None]:
    """sacreBLEU reads its seed from SACREBLEU_SEED only: pinned for the test (a user's `none` would make it
    unrepeatable, and the difference's interval would pair unrelated resamples), then put back."""
    before = os.environ.get("SACREBLEU_SEED")
    os.environ["SACREBLEU_SEED"] = str(SEED)
    try:
        yield
    finally:
        if before is None:
            del os.environ["SACREBLEU_SEED"]
        else:
            os.environ["SACREBLEU_SEED"] = before


def _resampled(metric, hypotheses: Sequence[str], references: Sequence[str]):
    """The system's score on each of sacreBLEU's resamples: the same seed draws the same sentences for every
    system (as PairedTest does), so two systems' arrays are paired, resample by resample."""
    import numpy as np
    from sacrebleu.significance import _bootstrap_resample

    stats = metric._extract_corpus_statistics(list(hypotheses), [list(references)])
    return np.array([s.score for s in _bootstrap_resample(stats, metric, RESAMPLES)[1]])


def _difference(baseline, system, p: float) -> dict:
    """The system's resampled scores minus the baseline's: the 95% interval of the difference, and the p-value."""
    import numpy as np

    delta = np.sort(system - baseline)
    # The order statistics sacreBLEU's estimate_ci takes (1/40 in from each end), as they are: estimate_ci makes
    # them mean ± half their spread, which for a skewed difference (a few sentences changed) reaches below 0
    # where no resample does.
    low, high = delta[len(delta) // 40], delta[len(delta) - len(delta) // 40 - 1]
    # Systems that score the same on every resample differ nowhere: sacreBLEU's p counts resamples strictly
    # above the observed difference and reports 1/(n+1) for none at all, which reads as significant.
    return {"delta_ci": [float(low), float(high)], "p": 1.0 if not delta.any() else float(p)}


def compare(systems: Sequence[tuple[str, Sequence[str]]], references: Sequence[str]) -> dict:
    """systems: (name, translations), the baseline first, each line N translating the source of references[N].
    -> {test, resamples, seed, baseline, signatures: {score: sacreBLEU's}, systems: [{system, SCORE: {score,
    mean, ci (the 95% interval's half width around mean), and after the baseline delta, delta_ci, p}}]}."""
    from sacrebleu.significance import PairedTest

    if len(systems) < 2:
        raise UserError("evaluate: a comparison needs a baseline and at least one other system")
    for name, hypotheses in systems:
        if len(hypotheses) != len(references):
            raise UserError(
                f"evaluate: {name} has {len(hypotheses)} translations but the test set {len(references)} "
                "sentences; line N must translate line N of the source"
            )
    metrics = {score.name: score.sacrebleu() for score in SCORES}
    named = [(name, list(hypotheses)) for name, hypotheses in systems]
    with _seeded():
        signatures, results = PairedTest(named, metrics, [list(references)], test_type="bs", n_samples=RESAMPLES)()
        resampled = {s.name: [_resampled(metrics[s.name], h, references) for _, h in named] for s in SCORES}
    keys = [key for key in results if key != "System"]  # sacreBLEU's names of the scores, in SCORES' order
    rows = [{"system": name} for name, _ in named]
    for score, key in zip(SCORES, keys, strict=True):
        for i, result in enumerate(results[key]):
            rows[i][score.name] = {"score": result.score, "mean": float(result.mean), "ci": float(result.ci)}
            if i:
                rows[i][score.name]["delta"] = result.score - results[key][0].score
                rows[i][score.name].update(
                    _difference(resampled[score.name][0], resampled[score.name][i], result.p_value)
                )
    return {
        "test": "paired bootstrap resampling (sacreBLEU)",
        "resamples": RESAMPLES,
        "seed": SEED,
        "baseline": named[0][0],
        "signatures": {score.name: str(signatures[key]) for score, key in zip(SCORES, keys)},
        "systems": rows,
    }


def table(comparison: dict) -> str:
    """The comparison as a table, a score's systems together: each score with its 95% interval, and after the
    baseline the difference, its interval and p (* below SIGNIFICANT)."""
    worse = [s.label for s in SCORES if not s.higher_is_better]
    lines = [
        f"paired bootstrap resampling (sacreBLEU, {comparison['resamples']} resamples, seed {comparison['seed']}) "
        f"against the baseline, {comparison['baseline']}:",
        f"95% confidence intervals; * p < {SIGNIFICANT:g}"
        + (f"; lower is better for {', '.join(worse)}" if worse else ""),
    ]
    width = max(len(row["system"]) for row in comparison["systems"])
    lines.append(
        f"{'metric':<7} {'system':<{width}}  {'score':>6}  {'mean ± 95% CI':<15}  {'diff':>6}  {'95% CI of diff':<18}  p"
    )
    for score in SCORES:
        for row in comparison["systems"]:
            r = row[score.name]
            line = f"{score.label:<7} {row['system']:<{width}}  {r['score']:6.2f}  {r['mean']:6.2f} ± {r['ci']:<6.2f}"
            if "delta" in r:
                low, high = r["delta_ci"]
                star = " *" if r["p"] < SIGNIFICANT else ""
                line += f"  {r['delta']:+6.2f}  [{low:+6.2f}, {high:+6.2f}]  {r['p']:.4f}{star}"
            lines.append(line.rstrip())
    return "\n".join(lines)
