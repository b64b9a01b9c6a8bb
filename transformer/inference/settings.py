"""The search settings: one typed `SearchSettings` (beam, length penalty, stop rule, length limit, batching,
workers, number format, engine, n-best, sampling, alignments), made by `search_settings` from the flags over the
checkpoint's decode section, and the values each may take, checked in one place.

Where a setting comes from, first found wins:
1. a flag (`SearchFlags`: what translate's, evaluate's and serve's options asked for; None = not given);
2. the checkpoint's `decode` section: in final.pt the beam and length penalty the end of training chose on the
   validation set, else the training config's;
3. config.py's `DecodeConfig` defaults, for a key the checkpoint predates (config.from_dict fills them in);
   dtype, engine, n-best, sampling and alignments have no config key: SearchSettings' own defaults (fp32, ours,
   1, beam search, none; a command's --dtype defaults to auto).

Imports no torch: the command line's --help reads the choices from here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from transformer.config import INT64, LENPEN_KINDS, STOP_RULES, DecodeConfig, LenpenKind, StopRule, lenpen_problem
from transformer.errors import UserError

__all__ = [
    "DTYPES",
    "ENGINES",
    "SAMPLING_KINDS",
    "FLAGS",
    "LENPEN_KINDS",
    "STOP_RULES",
    "Dtype",
    "Engine",
    "LenpenKind",
    "SearchFlags",
    "SearchSettings",
    "StopRule",
    "beam_above_vocabulary",
    "parse_sample",
    "search_settings",
]

# The allowed values, each defined once. Stop rules: config.py (decode.stop is checked against them there, and
# config.py imports nothing above it). Number formats and engines: here, since no config key holds them.
# auto: bf16 where it is native, else fp32; fp32 when sampling (translator.pick_dtype)
Dtype = Literal["auto", "fp32", "bf16", "int8"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
Engine = Literal["ours", "ctranslate2"]
ENGINES: tuple[str, ...] = typing.get_args(Engine)
# --sample KIND:VALUE: topk:K draws from the K most probable tokens, topp:P from the fewest whose probabilities
# add up to P (nucleus sampling, Holtzman et al. 2020).
SamplingKind = Literal["topk", "topp"]
SAMPLING_KINDS: tuple[str, ...] = typing.get_args(SamplingKind)
MAX_TEMPERATURE = 100.0
# Samples per sentence (--nbest with --sample; serve's --max-samples at most): each is a row of the search, its
# source encoded again, so an unbounded --nbest could fill the machine's memory. More: other seeds.
MAX_SAMPLES = 16

# How each setting is named in an error: its flag (max_len_offset has none: decode.max_len_offset or a library
# caller sets it).
FLAGS = {
    "beam": "--beam",
    "lenpen": "--lenpen",
    "lenpen_kind": "--lenpen-kind",
    "stop": "--stop",
    "max_len_offset": "max_len_offset",
    "max_tokens": "--max-tokens",
    "workers": "--workers",
    "dtype": "--dtype",
    "engine": "--engine",
    "nbest": "--nbest",
    "sample": "--sample",
    "temperature": "--temperature",
    "seed": "--seed",
    "alignments": "--alignments",
    "alignment_layer": "--alignment-layer",
}


def _at_least_one(flag: str, value, note: str = "") -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{flag} must be a whole number, got {value!r}"
    return None if value >= 1 else f"{flag} must be at least 1{note}, got {value}"


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, object], str | None]:
    return lambda flag, value: (
        None if value in allowed else f"{flag} must be one of {', '.join(allowed)}, got {value!r}"
    )


def parse_sample(text: str) -> tuple[SamplingKind, float]:
    """--sample's value as (kind, K or P); the value is one that passed _sample_problem."""
    kind, _, value = text.partition(":")
    return kind, (int(value) if kind == "topk" else float(value))  # type: ignore[return-value]


def _sample_problem(flag: str, value) -> str | None:
    if value is None:
        return None
    usage = f"{flag} takes topk:K (K a whole number >= 1) or topp:P (0 < P <= 1), got {value!r}"
    if not isinstance(value, str):
        return usage
    kind, _, number = value.partition(":")
    try:
        if kind == "topk" and number.strip().isdigit() and int(number) >= 1:
            return None
        if kind == "topp" and 0 < float(number) <= 1:
            return None
    except ValueError:
        pass
    return usage


def _temperature_problem(flag: str, value) -> str | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= MAX_TEMPERATURE:
        return None
    return f"{flag} must be a number above 0 and at most {MAX_TEMPERATURE:g} (1 = the model's own), got {value}"


def _seed_problem(flag: str, value) -> str | None:
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < INT64):
        return None
    return f"{flag} must be a whole number from 0 to {INT64 - 1}, got {value!r}"


# Why a value cannot be a setting (given the flag that names it), or None: the one check every value goes through.
_PROBLEMS: dict[str, Callable[[str, object], str | None]] = {
    "beam": lambda flag, value: _at_least_one(flag, value, " (1 = greedy)"),
    "lenpen": lambda flag, value: lenpen_problem(value, flag),
    "lenpen_kind": _one_of(LENPEN_KINDS),
    "stop": _one_of(STOP_RULES),
    "max_len_offset": _at_least_one,
    "max_tokens": _at_least_one,
    "workers": _at_least_one,
    "dtype": _one_of(DTYPES),
    "engine": _one_of(ENGINES),
    "nbest": _at_least_one,
    "sample": _sample_problem,
    "temperature": _temperature_problem,
    "seed": _seed_problem,
    "alignments": lambda flag, value: None if isinstance(value, bool) else f"{flag} is on or off, got {value!r}",
    "alignment_layer": lambda flag, value: None if value is None else _at_least_one(flag, value),
}


def _check(values: dict) -> None:
    for name, value in values.items():
        problem = _PROBLEMS[name](FLAGS[name], value)
        if problem is not None:
            raise UserError(problem)
    if values.get("sample") is not None and values.get("nbest", 1) > MAX_SAMPLES:
        raise UserError(
            f"{FLAGS['nbest']} with {FLAGS['sample']} draws at most {MAX_SAMPLES} samples per sentence, got "
            f"{values['nbest']}; for more, run again with another {FLAGS['seed']}"
        )


@dataclass(frozen=True)
class SearchSettings:
    """How a search runs, every setting decided. Checked when made (dataclasses.replace included), so that a
    SearchSettings that exists is one a search can run with; a beam wider than the vocabulary is the one thing
    only a model can tell (search_settings with vocab_size)."""

    beam: int = DecodeConfig.beam  # 1 = greedy
    lenpen: float = DecodeConfig.lenpen  # the length penalty's alpha, 0 to MAX_LENPEN
    lenpen_kind: LenpenKind = DecodeConfig.lenpen_kind  # its form: GNMT's, or length ** lenpen
    stop: StopRule = DecodeConfig.stop  # beam search's stop rule (search.py); CTranslate2 has its own
    max_len_offset: int = DecodeConfig.max_len_offset  # an output may be source length + this many tokens
    max_tokens: int = DecodeConfig.max_tokens  # source tokens per batch (all workers together)
    workers: int = DecodeConfig.workers  # searches side by side on a CPU
    dtype: Dtype = "fp32"  # a Translator holds the one it picked, never auto
    engine: Engine = "ours"
    nbest: int = 1  # hypotheses kept per sentence, best first (with `sample`: samples drawn per sentence)
    sample: str | None = None  # "topk:K" or "topp:P": sampling (sampling.py) instead of beam search; None: search
    temperature: float = 1.0  # sampling draws from p ** (1 / temperature), renormalised
    seed: int | None = None  # sampling's seed; None: the Translator draws one (and says which)
    alignments: bool = False  # word alignments from cross-attention with each hypothesis (alignment.py)
    alignment_layer: int | None = None  # the decoder layer they come from, from 1; None: alignment.default_layer

    def __post_init__(self) -> None:
        _check(asdict(self))
        if self.nbest > self.beam and self.sample is None:
            raise UserError(f"--nbest ({self.nbest}) cannot exceed the beam size ({self.beam}); raise --beam")

    @property
    def sampling(self) -> bool:
        return self.sample is not None

    @property
    def rows_per_source(self) -> int:
        """The rows a source takes in a batch that max_tokens bounds: with sampling one per sample, each encoding
        the source again (a beam search encodes a source once: its beam is not counted)."""
        return self.nbest if self.sample is not None else 1

    def describe(self) -> str:
        """The settings that change outputs, for evaluate's file names:
        beam4.lp0.6[.length][.early|.hf][.bf16|.int8][.ct2], or with sampling topk10[.t0.8][.seed1].lp0.6[...]."""
        if self.sample is not None:
            name = self.sample.replace(":", "")
            name += "" if self.temperature == 1 else f".t{self.temperature:g}"
            name += "" if self.seed is None else f".seed{self.seed}"
            name += f".lp{self.lenpen:g}"
        else:
            name = f"beam{self.beam}.lp{self.lenpen:g}"
        if self.lenpen_kind != "gnmt" and self.lenpen > 0:
            name += f".{self.lenpen_kind}"
        if self.stop != "exact" and self.beam > 1 and self.engine == "ours" and self.sample is None:
            name += f".{self.stop}"
        if self.dtype != "fp32":
            name += f".{self.dtype}"
        return name + (".ct2" if self.engine == "ctranslate2" else "")


@dataclass(frozen=True)
class SearchFlags:
    """What a command's search options asked for (or a library caller: `Translator(path, "cpu",
    SearchFlags(beam=5))`); None: not given, the checkpoint decides. Each given value is checked when this is
    made, before any checkpoint loads."""

    beam: int | None = None
    lenpen: float | None = None
    lenpen_kind: LenpenKind | None = None
    stop: StopRule | None = None
    max_len_offset: int | None = None
    max_tokens: int | None = None
    workers: int | None = None
    dtype: Dtype | None = None
    engine: Engine | None = None
    nbest: int | None = None
    sample: str | None = None
    temperature: float | None = None
    seed: int | None = None
    alignments: bool | None = None
    alignment_layer: int | None = None

    def __post_init__(self) -> None:
        _check(self.given())

    def given(self) -> dict:
        return {name: value for name, value in asdict(self).items() if value is not None}


def beam_above_vocabulary(beam: int, vocab_size: int) -> str:
    """The message for a beam wider than the vocabulary: it cannot be filled at the first step, and a search
    that tried would hold beam x vocabulary scores per sentence (a beam in the millions takes all memory)."""
    return f"beam must be at most the vocabulary size ({vocab_size} pieces), got {beam}"


def _combination_problem(flags: SearchFlags) -> str | None:
    """Flags that cannot go together (what the checkpoint says is never refused: its beam under --sample)."""
    if flags.sample is not None and flags.beam is not None and flags.beam > 1:
        return f"--sample draws each token; it cannot go with --beam {flags.beam} (use --nbest N for N samples)"
    if flags.sample is not None and flags.stop is not None:
        return "--stop is beam search's; a sample ends at its first end of sentence"
    for name in ("temperature", "seed"):
        if getattr(flags, name) is not None and flags.sample is None:
            return f"{FLAGS[name]} goes with --sample topk:K or --sample topp:P"
    if flags.alignment_layer is not None and not flags.alignments:
        return "--alignment-layer goes with --alignments"
    return None


def search_settings(
    decode: DecodeConfig,
    flags: SearchFlags = SearchFlags(),
    vocab_size: int | None = None,
    decoder_layers: int | None = None,
) -> SearchSettings:
    """The settings a search runs with: each flag given, else the checkpoint's decode section (defaults filled
    by config.py), else SearchSettings' own (module docstring). With vocab_size, a beam wider than the
    vocabulary is refused too; with decoder_layers, an alignment layer the model does not have."""
    problem = _combination_problem(flags)
    if problem is not None:
        raise UserError(problem)
    values = {**asdict(decode), **flags.given()}
    if flags.sample is not None:
        values["beam"] = 1  # the checkpoint's beam does not apply
    settings = SearchSettings(**values)
    if vocab_size is not None and settings.beam > vocab_size:
        raise UserError(beam_above_vocabulary(settings.beam, vocab_size))
    if decoder_layers is not None and (settings.alignment_layer or 1) > decoder_layers:
        raise UserError(
            f"--alignment-layer must be at most the model's decoder layers ({decoder_layers}), "
            f"got {settings.alignment_layer}"
        )
    return settings
