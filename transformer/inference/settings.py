"""The search settings: one typed `SearchSettings` (beam, length penalty, stop rule, length limit, batching,
workers, number format, engine, n-best), made by `search_settings` from the flags over the checkpoint's decode
section, and the values each may take, checked in one place.

Where a setting comes from, first found wins:
1. a flag (`SearchFlags`: what translate's, evaluate's and serve's options asked for; None = not given);
2. the checkpoint's `decode` section: in final.pt the beam and length penalty the end of training chose on the
   validation set, else the training config's;
3. config.py's `DecodeConfig` defaults, for a key the checkpoint predates (config.from_dict fills them in);
   dtype, engine and n-best have no config key: SearchSettings' own defaults (fp32, ours, 1; a command's
   --dtype defaults to auto).

Imports no torch: the command line's --help reads the choices from here.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from transformer.config import LENPEN_KINDS, STOP_RULES, DecodeConfig, LenpenKind, StopRule, lenpen_problem
from transformer.errors import UserError

__all__ = [
    "DTYPES",
    "ENGINES",
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
    "search_settings",
]

# The allowed values, each defined once. Stop rules: config.py (decode.stop is checked against them there, and
# config.py imports nothing above it). Number formats and engines: here, since no config key holds them.
Dtype = Literal["auto", "fp32", "bf16", "int8"]  # auto: bf16 where it is native, else fp32 (translator.pick_dtype)
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
Engine = Literal["ours", "ctranslate2"]
ENGINES: tuple[str, ...] = typing.get_args(Engine)

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
}


def _at_least_one(flag: str, value, note: str = "") -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{flag} must be a whole number, got {value!r}"
    return None if value >= 1 else f"{flag} must be at least 1{note}, got {value}"


def _one_of(allowed: tuple[str, ...]) -> Callable[[str, object], str | None]:
    return lambda flag, value: (
        None if value in allowed else f"{flag} must be one of {', '.join(allowed)}, got {value!r}"
    )


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
}


def _check(values: dict) -> None:
    for name, value in values.items():
        problem = _PROBLEMS[name](FLAGS[name], value)
        if problem is not None:
            raise UserError(problem)


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
    nbest: int = 1  # hypotheses kept per sentence, best first

    def __post_init__(self) -> None:
        _check(asdict(self))
        if self.nbest > self.beam:
            raise UserError(f"--nbest ({self.nbest}) cannot exceed the beam size ({self.beam}); raise --beam")

    def describe(self) -> str:
        """The settings that change outputs, for evaluate's file names:
        beam4.lp0.6[.length][.early|.hf][.bf16|.int8][.ct2]."""
        name = f"beam{self.beam}.lp{self.lenpen:g}"
        if self.lenpen_kind != "gnmt" and self.lenpen > 0:
            name += f".{self.lenpen_kind}"
        if self.stop != "exact" and self.beam > 1 and self.engine == "ours":
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

    def __post_init__(self) -> None:
        _check(self.given())

    def given(self) -> dict:
        return {name: value for name, value in asdict(self).items() if value is not None}


def beam_above_vocabulary(beam: int, vocab_size: int) -> str:
    """The message for a beam wider than the vocabulary: it cannot be filled at the first step, and a search
    that tried would hold beam x vocabulary scores per sentence (a beam in the millions takes all memory)."""
    return f"beam must be at most the vocabulary size ({vocab_size} pieces), got {beam}"


def search_settings(
    decode: DecodeConfig, flags: SearchFlags = SearchFlags(), vocab_size: int | None = None
) -> SearchSettings:
    """The settings a search runs with: each flag given, else the checkpoint's decode section (defaults filled
    by config.py), else SearchSettings' own (module docstring). With vocab_size, a beam wider than the
    vocabulary is refused too."""
    settings = SearchSettings(**{**asdict(decode), **flags.given()})
    if vocab_size is not None and settings.beam > vocab_size:
        raise UserError(beam_above_vocabulary(settings.beam, vocab_size))
    return settings
