"""Scores of translations: SCORES, the one list of sacreBLEU's corpus scores (each with its name in the logs and the
JSON, its sacreBLEU class, its direction and its signature) that evaluate, the end of training, validation, the
metrics log and TensorBoard go through; the length ratio; a model in memory translating and scored in one call.

Imports no torch, and sacreBLEU only to score: the command line's --help names the scores from here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from transformer.errors import UserError
from transformer.inference.settings import SearchSettings


@dataclass(frozen=True)
class Score:
    """A corpus score of sacreBLEU's. name: its key in metrics.jsonl, eval/*.json and summary.json, beside
    `{name}_signature` (and `{name}_detail`, sacreBLEU's line); label: how it is printed; metric and options: the
    class in sacrebleu.metrics and its arguments (sacreBLEU's defaults otherwise: cased, 13a tokenisation); keep:
    what else of sacreBLEU's result the JSON keeps."""

    name: str
    label: str
    metric: str
    options: tuple[tuple[str, object], ...] = ()
    higher_is_better: bool = True
    keep: tuple[str, ...] = ()

    def sacrebleu(self):
        """A new sacreBLEU metric object (its signature is the record of how the score was computed)."""
        from sacrebleu import metrics

        return getattr(metrics, self.metric)(**dict(self.options))


# Adding a score is a line here (docs/architecture.md, "Where a new thing goes"); every reader iterates over these.
SCORES: tuple[Score, ...] = (
    Score("bleu", "BLEU", "BLEU", keep=("bp", "sys_len", "ref_len")),  # the lengths give the length ratio
    Score("chrf", "chrF", "CHRF"),
    Score("chrfpp", "chrF++", "CHRF", (("word_order", 2),)),  # chrF with word uni- and bigrams (Popović, 2017)
    Score("ter", "TER", "TER", higher_is_better=False),  # edits per reference word, in percent
)
NAMES: tuple[str, ...] = tuple(s.name for s in SCORES)


def named(names: Sequence[str] = NAMES, where: str = "scores") -> tuple[Score, ...]:
    """The scores `names` asks for, in SCORES' order; a name that is none of them, a one-line error (`where`:
    what gave the names)."""
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise UserError(f"{where}: unknown score {unknown[0]!r} (the scores are {', '.join(NAMES)})")
    return tuple(s for s in SCORES if s.name in names)


def length_ratio(scores: dict) -> float:
    """Hypothesis length over reference length, as sacreBLEU counts them (below 1: translations too short, and
    the brevity penalty takes its share of BLEU)."""
    return scores["sys_len"] / max(scores["ref_len"], 1)


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], names: Sequence[str] = NAMES) -> dict:
    """The corpus scores `names` (all of SCORES by default) of `hypotheses` against one reference each:
    {name: score, name_signature, name_detail, what the score keeps, sentences}."""
    if len(hypotheses) != len(references):
        raise UserError(f"{len(hypotheses)} hypotheses but {len(references)} references")
    out: dict = {}
    for score in named(names):
        metric = score.sacrebleu()
        result = metric.corpus_score(list(hypotheses), [list(references)])
        out[score.name] = result.score
        out[f"{score.name}_signature"] = str(metric.get_signature())
        out[f"{score.name}_detail"] = str(result)
        out.update({key: getattr(result, key) for key in score.keep})
    return {**out, "sentences": len(hypotheses)}


def mean_scores(per_pair: dict[str, dict]) -> dict:
    """The scores of several language pairs (each corpus_scores') as one: each score their mean, which chooses
    checkpoints and search settings as one pair's score does; the length ratio over all of them; each pair's own
    scores under "pairs". One pair: its scores as they are."""
    if len(per_pair) == 1:
        return next(iter(per_pair.values()))
    first = next(iter(per_pair.values()))
    out = {
        **{s.name: sum(p[s.name] for p in per_pair.values()) / len(per_pair) for s in SCORES if s.name in first},
        **{f"{s.name}_signature": first[f"{s.name}_signature"] for s in SCORES if s.name in first},
        **{key: sum(p[key] for p in per_pair.values()) for key in ("sys_len", "ref_len", "sentences") if key in first},
    }
    return {**out, "pairs": {name: {s.name: p[s.name] for s in SCORES if s.name in p} for name, p in per_pair.items()}}


def describe(scores: dict, lower: bool = False) -> str:
    """The scores `scores` holds, in SCORES' order, as printed: BLEU with the length ratio beside it (the brevity
    penalty is where short translations lose), e.g. `BLEU 41.17 (length ratio 0.969), chrF 60.37`; lower: the
    labels in lower case, as the validation lines have them."""
    parts = []
    for score in SCORES:
        if score.name not in scores:
            continue
        label = score.label.lower() if lower else score.label
        text = f"{label} {scores[score.name]:.2f}"
        if score.name == "bleu":  # the length ratio is BLEU's own count of lengths
            ratio = scores["length_ratio"] if "length_ratio" in scores else length_ratio(scores)
            text += f" (length ratio {ratio:.3f})"
        parts.append(text)
    if "pairs" in scores:  # a multilingual run's: each pair's BLEU beside the mean
        parts.append(
            "BLEU by pair " + ", ".join(f"{n} {p['bleu']:.2f}" for n, p in scores["pairs"].items() if "bleu" in p)
        )
    return ", ".join(parts)


def translate_and_score(
    model,
    vocab,
    sources: Sequence[Sequence[int]],
    references: Sequence[str],
    settings: SearchSettings,
    device,
    names: Sequence[str] = NAMES,
) -> tuple[dict, list[str]]:
    """The scores `names` (corpus_scores) of a model in memory translating `sources` (subword ids) with
    `settings`; and the translations."""
    from transformer.inference.translator import translate_ids  # torch: only where a model translates

    hypotheses = vocab.decode(translate_ids(model, sources, settings, device))
    return corpus_scores(hypotheses, references, names), hypotheses
