"""The search settings: one typed `SearchSettings` (beam, length penalty, stop rule, length limit, batching,
workers, number format, engine, n-best, sampling, alignments), made by `search_settings` from the flags over the
checkpoint's decode section, and one table of the options (`OPTIONS`): each one's flag and help, its check, its
config key, and how CTranslate2 and transformers' `generate` take it. SearchFlags, the command line's search
options (cli/parser.py, cli/commands.py), the checks, evaluate's result names (`describe`) and both foreign
engines' keywords are read from the table: a new option is a field of SearchSettings and an entry here, and its
reader in search.py (docs/architecture.md, "Where a new thing goes").

Where a setting comes from, first found wins:
1. a flag (`SearchFlags`: what translate's, evaluate's and serve's options asked for; None = not given);
2. the checkpoint's `decode` section: in final.pt the beam and length penalty the end of training chose on the
   validation set, else the training config's;
3. config.py's `DecodeConfig` defaults, for a key the checkpoint predates (config.from_dict fills them in);
   an option without a config key (dtype, engine, n-best, sampling, alignments): SearchSettings' own default
   (fp32, ours, 1, beam search, none; a command's --dtype defaults to auto).

Imports no torch: the command line's --help reads the options from here.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal

from transformer.config import INT64, LENPEN_KINDS, STOP_RULES, DecodeConfig, LenpenKind, StopRule, lenpen_problem
from transformer.errors import UserError

__all__ = [
    "DTYPES",
    "FLOAT_DTYPES",
    "ENGINES",
    "SAMPLING_KINDS",
    "FLAGS",
    "LENPEN_KINDS",
    "OPTIONS",
    "STOP_RULES",
    "Dtype",
    "Engine",
    "LenpenKind",
    "Option",
    "SearchFlags",
    "SearchSettings",
    "StopRule",
    "Takes",
    "beam_above_vocabulary",
    "ctranslate2_keywords",
    "ctranslate2_rescores",
    "generate_keywords",
    "parse_sample",
    "search_settings",
]

# The allowed values, each defined once. Stop rules: config.py (decode.stop is checked against them there, and
# config.py imports nothing above it). Number formats and engines: here, since no config key holds them.
# auto: bf16 where it is native, else fp32; fp32 when sampling (translator.pick_dtype)
Dtype = Literal["auto", "fp32", "bf16", "int8"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
# The formats a model itself computes in (no quantized layers, nothing resolved): what `animate` draws the values of.
FloatDtype = Literal["fp32", "bf16"]
FLOAT_DTYPES: tuple[str, ...] = typing.get_args(FloatDtype)
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


@dataclass(frozen=True)
class SearchSettings:
    """How a search runs, every setting decided. Checked when made (dataclasses.replace included), so that a
    SearchSettings that exists is one a search can run with; a beam wider than the vocabulary is the one thing
    only a model can tell (search_settings with vocab_size). Each field has its entry in OPTIONS (a test keeps
    them in step)."""

    beam: int = DecodeConfig.beam  # 1 = greedy
    lenpen: float = DecodeConfig.lenpen  # the length penalty's alpha, 0 to MAX_LENPEN
    lenpen_kind: LenpenKind = DecodeConfig.lenpen_kind  # its form: GNMT's, or length ** lenpen
    stop: StopRule = DecodeConfig.stop  # beam search's stop rule (search.py); CTranslate2 has its own
    no_repeat_ngram_size: int = 0  # no n-gram of this many pieces occurs twice in an output; 0: off
    max_len_offset: int = DecodeConfig.max_len_offset  # an output may be source length + this many tokens
    max_tokens: int = DecodeConfig.max_tokens  # source tokens per batch (all workers together)
    workers: int = DecodeConfig.workers  # searches side by side on a CPU
    dtype: Dtype = "fp32"  # a Translator holds the one it picked, never auto
    engine: Engine = "ours"
    shortlist: bool = False  # score only the run's shortlist.txt candidates of a batch's sources (shortlist.py)
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
        """The settings that change outputs, for evaluate's file names: the search (beam4, or with sampling
        topk10[.t0.8][.seed1]), then each option's tag (Option.tag) in the table's order:
        beam4.lp0.6[.length][.early|.hf][.bf16|.int8][.ct2][.shortlist]."""
        if self.sample is not None:
            name = self.sample.replace(":", "")
            name += "" if self.temperature == 1 else f".t{self.temperature:g}"
            name += "" if self.seed is None else f".seed{self.seed}"
        else:
            name = f"beam{self.beam}"
        return name + "".join(option.tag(self) for option in OPTIONS.values() if option.tag is not None)


# --------------------------------------------------------------------------- the options table


@dataclass(frozen=True)
class Takes:
    """How a foreign engine (CTranslate2's translate_batch, transformers' generate) takes a search option: under a
    keyword of its own, the value as it is or through `values` (ours -> theirs; a value missing there is refused
    in one line); or under none, and `why` says in one line what stands for it (our code around the engine maps
    it, or it means nothing there). `refusal`: a value other than SearchSettings' default is refused, in this
    one line. `renormalises`: with a value other than the default the engine's search renormalises each step's
    probabilities over the tokens it leaves (CTranslate2's logits processors do), so that its scores are not ours:
    its hypotheses are scored again."""

    keyword: str = ""
    values: Mapping | None = None
    why: str = ""
    refusal: str = ""
    renormalises: bool = False

    def __post_init__(self) -> None:
        if sum(map(bool, (self.keyword, self.why, self.refusal))) != 1:
            raise ValueError("Takes: one of keyword, why or refusal")


def keyword(name: str, values: Mapping | None = None, renormalises: bool = False) -> Takes:
    return Takes(keyword=name, values=values, renormalises=renormalises)


def around(why: str) -> Takes:
    return Takes(why=why)


def refused(line: str) -> Takes:
    return Takes(refusal=line)


@dataclass(frozen=True)
class Option:
    """One search option: a field of SearchSettings (and of SearchFlags) and everything said about it once."""

    name: str  # the field
    check: Callable[[str, object], str | None]  # why a value cannot be (given the name it is called by), or None
    ctranslate2: Takes  # how CTranslate2's translate_batch (or its Translator) takes it
    generate: Takes  # how transformers' generate (generation_config.json) takes it
    flag: str = ""  # its command-line flag; "": none (decode.<name> or a library caller sets it)
    help: str = ""  # what --help says of it
    serve_help: str = ""  # what serve's --help says instead, where that differs
    cli: Mapping[str, object] = dataclasses.field(default_factory=dict)  # argparse's type, metavar, choices, default
    # True: one of every search verb's options (parser.add_search_options); False: a verb that outputs it declares
    # its own flag (translate's --nbest and --alignments, synthesize's --nbest).
    shared: bool = True
    config: bool = False  # the checkpoint's decode section holds it (decode.<name>)
    tag: Callable[[SearchSettings], str] | None = None  # what evaluate's result names add for a value (describe)

    @property
    def called(self) -> str:
        """What an error calls it: its flag, or its name where it has none."""
        return self.flag or self.name

    @property
    def dest(self) -> str:
        """Where argparse keeps its value."""
        return self.flag.removeprefix("--").replace("-", "_")


def _at_least_one(flag: str, value, note: str = "") -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{flag} must be a whole number, got {value!r}"
    return None if value >= 1 else f"{flag} must be at least 1{note}, got {value}"


def _at_least_zero(flag: str, value, note: str = "") -> str | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return f"{flag} must be a whole number, got {value!r}"
    return None if value >= 0 else f"{flag} must be at least 0{note}, got {value}"


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


NOT_SEARCH = "it sets how fast, not what is found"  # a setting no foreign engine needs to be told
_OPTIONS = (
    Option(
        "beam",
        lambda flag, value: _at_least_one(flag, value, " (1 = greedy)"),
        around("beam_size, 1 when sampling; with a length penalty num_hypotheses is the beam (ctranslate2_options)"),
        keyword("num_beams"),
        flag="--beam",
        help="beam size; 1 = greedy (default: decode.beam of the checkpoint's config)",
        serve_help="beam size when a request gives none (default: decode.beam)",
        cli={"type": int, "metavar": "N"},
        config=True,
    ),
    Option(
        "lenpen",
        lambda flag, value: lenpen_problem(value, flag),
        keyword("length_penalty"),
        keyword("length_penalty"),
        flag="--lenpen",
        help="length penalty alpha, 0 to 10: score = log p / ((5 + len) / 6)^A (GNMT's; with --lenpen-kind length "
        "log p / len^A) (default: decode.lenpen)",
        cli={"type": float, "metavar": "A"},
        config=True,
        tag=lambda s: f".lp{s.lenpen:g}",
    ),
    Option(
        "lenpen_kind",
        _one_of(LENPEN_KINDS),
        around("its penalty is len^A: its hypotheses are scored and ranked again by ours (ctranslate2_search)"),
        around("its length_penalty is len^A (lenpen_kind length); GNMT's form is exported as that (docs/opus-mt.md)"),
        flag="--lenpen-kind",
        help="the length penalty's form: gnmt ((5 + len) / 6)^A, or length (len^A, as transformers' generate "
        "and CTranslate2) (default: decode.lenpen_kind)",
        cli={"choices": LENPEN_KINDS},
        config=True,
        tag=lambda s: f".{s.lenpen_kind}" if s.lenpen_kind != DecodeConfig.lenpen_kind and s.lenpen > 0 else "",
    ),
    Option(
        "stop",
        _one_of(STOP_RULES),
        around("it has one rule of its own, as --stop early; a --stop exact given is warned about (Translator)"),
        # Our exact rule is their early_stopping "never", our early one their True, our hf their False.
        keyword("early_stopping", {"exact": "never", "early": True, "hf": False}),
        flag="--stop",
        help="when beam search ends a sentence: exact (once no live hypothesis can beat the n-best finished ones), "
        "early (fairseq's: once BEAM hypotheses have finished; fewer decoder steps) or hf (transformers' generate "
        "with early_stopping=False, a heuristic) (default: decode.stop)",
        cli={"choices": STOP_RULES},
        config=True,
        tag=lambda s: (
            f".{s.stop}"
            if s.stop != DecodeConfig.stop and s.beam > 1 and s.engine == "ours" and s.sample is None
            else ""
        ),
    ),
    Option(
        "no_repeat_ngram_size",
        lambda flag, value: _at_least_zero(flag, value, " (0 = off)"),
        keyword("no_repeat_ngram_size", renormalises=True),  # its beam ranks by renormalised scores
        keyword("no_repeat_ngram_size"),  # after the log-softmax, as ours
        flag="--no-repeat-ngram-size",
        help="no n-gram of N pieces occurs twice in an output: a token that would repeat one is never chosen "
        "(fairseq's, CTranslate2's and transformers' no_repeat_ngram_size; default 0: off)",
        cli={"type": int, "metavar": "N"},
        tag=lambda s: f".norepeat{s.no_repeat_ngram_size}" if s.no_repeat_ngram_size else "",
    ),
    Option(
        "max_len_offset",
        _at_least_one,
        around("max_decoding_length, each call's from our limits (ctranslate2_search)"),
        around("it has no limit per source: max_length is the model's own (hf_export)"),
        config=True,
    ),
    Option(
        "max_tokens",
        _at_least_one,
        around("max_batch_size in tokens, of our batches (ctranslate2_search)"),
        around(NOT_SEARCH),
        flag="--max-tokens",
        help="source tokens per batch (default: decode.max_tokens)",
        serve_help="source tokens per batched search; also ends a batching window early (default: decode.max_tokens)",
        cli={"type": int, "metavar": "N"},
        config=True,
    ),
    Option(
        "workers",
        _at_least_one,
        around("inter_threads of its Translator (ctranslate2_engine.load)"),
        around(NOT_SEARCH),
        flag="--workers",
        help="searches run side by side on a CPU, each on its own batches of max-tokens / N tokens with torch's "
        "threads / N threads (CTranslate2: its inter_threads); 1 = one search on all threads, the lowest "
        "latency for one batch with CTranslate2 (default: decode.workers, 2)",
        serve_help="searches side by side on a CPU when a batched search holds several batches, as for translate "
        "(default: decode.workers)",
        cli={"type": int, "metavar": "N"},
        config=True,
    ),
    Option(
        "dtype",
        _one_of(DTYPES),
        around("compute_type of its Translator (CT2_COMPUTE_TYPES)"),
        around("the torch_dtype a caller loads the model in"),
        flag="--dtype",
        help="number format: fp32 (on CUDA full fp32, TF32 tensor cores off, as in torch's default: exact but "
        "several times slower than bf16 there); bf16 (fast on CUDA and on CPUs with avx512_bf16/amx_bf16, "
        "emulated and slow elsewhere); int8 (CPU: linear layers quantized, faster at a small cost in "
        "accuracy); auto (default): bf16 where it is native, else fp32, printed on stderr; with --sample fp32 "
        "(in bf16 a sentence's samples would depend on its batch). `evaluate` measures what a choice costs",
        serve_help="number format (default auto: fp32, so that each answer is what its request would get alone; "
        "in bf16 or int8 an answer may depend on the other requests batched with it)",
        # No default: commands.py tells "--dtype X --int8" (refused) from "--int8" alone, then makes it auto.
        cli={"choices": DTYPES},
        tag=lambda s: "" if s.dtype == "fp32" else f".{s.dtype}",
    ),
    Option(
        "engine",
        _one_of(ENGINES),
        around("the choice of engine itself"),
        around("the choice of engine itself"),
        flag="--engine",
        help="ours (PyTorch search, default) or ctranslate2: the checkpoint is converted once (kept in "
        "CHECKPOINT_DIR/ct2/, rebuilt when the checkpoint changes) and run by CTranslate2 (pip install "
        "'transformer[ctranslate2]'), with its own stop rule (like --stop early) and length penalty "
        "(length^A rather than GNMT's; scores are still reported in ours); it samples, forces prefixes and gives "
        "alignments, but has no constraints or ensembles",
        serve_help="what runs /translate: ours (default) or ctranslate2, as for translate (pip install "
        "'transformer[ctranslate2]'; on a CPU it answers sooner). The page's attention maps and beam traces "
        "always come from our model, so with beam > 1 they may show a different translation (CTranslate2 "
        "has its own stop rule and length penalty)",
        cli={"choices": ENGINES, "default": "ours"},
        tag=lambda s: ".ct2" if s.engine == "ctranslate2" else "",
    ),
    Option(
        "shortlist",
        lambda flag, value: None if isinstance(value, bool) else f"{flag} is on or off, got {value!r}",
        keyword("use_vmap"),  # the list is written into the conversion as its vmap.txt (ctranslate2_export)
        refused("--shortlist: transformers' generate has no lexical shortlist; export without it"),
        flag="--shortlist",
        help="score only the pieces the run's shortlist.txt lists for a sentence's source pieces, and the most "
        "frequent ones (`transformer shortlist RUN` writes it), instead of the whole vocabulary at each step: "
        "faster, at a cost in BLEU that `evaluate` with and without it measures (CTranslate2: its use_vmap, "
        "over the batch's sources together)",
        cli={"action": "store_const", "const": True},
        tag=lambda s: ".shortlist" if s.shortlist else "",
    ),
    Option(
        "nbest",
        _at_least_one,
        around("num_hypotheses: the beam with a length penalty, its best ranked again by ours (ctranslate2_search)"),
        keyword("num_return_sequences"),
        flag="--nbest",
        shared=False,
    ),
    Option(
        "sample",
        _sample_problem,
        around("sampling_topk or sampling_topp, and beam_size 1 (ctranslate2_options)"),
        around("do_sample with top_k or top_p"),
        flag="--sample",
        help="sample instead of searching: topk:K draws each token from the K most probable, topp:P from the "
        "fewest whose probabilities add up to P (nucleus); --nbest N gives N samples per line, best first",
        serve_help='sample when a /translate request asks for nothing else (a request\'s "sample" overrides '
        "it); as for translate",
        cli={"metavar": "topk:K|topp:P"},
    ),
    Option(
        "temperature",
        _temperature_problem,
        around("sampling_temperature, when sampling (ctranslate2_options)"),
        keyword("temperature"),
        flag="--temperature",
        help="with --sample: draw from p^(1/T), renormalised (default 1: the model's own; lower is more "
        "conservative, and near 0 greedy search)",
        cli={"type": float, "metavar": "T"},
    ),
    Option(
        "seed",
        _seed_problem,
        around("set_random_seed when its Translator is made: a random stream per worker (ctranslate2_engine.load)"),
        around("torch.manual_seed before generate: another random stream than ours"),
        flag="--seed",
        help="with --sample: the random seed (default: a new one each run, printed on stderr); a sentence's "
        "samples depend only on the seed and the sentence, not on its batch",
        serve_help="the seed of a request that sends none (default: a new one per request)",
        cli={"type": int, "metavar": "S"},
    ),
    Option(
        "alignments",
        lambda flag, value: None if isinstance(value, bool) else f"{flag} is on or off, got {value!r}",
        keyword("return_attention"),
        around("output_attentions gives the weights; the alignments are ours (alignment.py)"),
        flag="--alignments",
        shared=False,
    ),
    Option(
        "alignment_layer",
        lambda flag, value: None if value is None else _at_least_one(flag, value),
        around("the conversion asks for the last decoder layer's; another is refused (Translator)"),
        around("output_attentions gives every layer's"),
        flag="--alignment-layer",
        shared=False,
    ),
)
OPTIONS: dict[str, Option] = {option.name: option for option in _OPTIONS}
# How each setting is named in an error: its flag, or its name where it has none.
FLAGS: dict[str, str] = {name: option.called for name, option in OPTIONS.items()}


def _check(values: dict) -> None:
    for name, value in values.items():
        option = OPTIONS[name]
        problem = option.check(option.called, value)
        if problem is not None:
            raise UserError(problem)
    if values.get("sample") is not None and values.get("nbest", 1) > MAX_SAMPLES:
        raise UserError(
            f"{FLAGS['nbest']} with {FLAGS['sample']} draws at most {MAX_SAMPLES} samples per sentence, got "
            f"{values['nbest']}; for more, run again with another {FLAGS['seed']}"
        )


def _flags_post_init(self) -> None:
    _check(self.given())


def _given(self) -> dict:
    return {name: value for name, value in asdict(self).items() if value is not None}


# What a command's search options asked for (or a library caller's: `Translator(path, "cpu", SearchFlags(beam=5))`):
# every field of SearchSettings, None when not given (the checkpoint decides). Each given value is checked when
# this is made, before any checkpoint loads.
SearchFlags = dataclasses.make_dataclass(
    "SearchFlags",
    [
        (f.name, f.type if "None" in f.type else f"{f.type} | None", dataclasses.field(default=None))
        for f in dataclasses.fields(SearchSettings)
    ],
    frozen=True,
    namespace={
        "__module__": __name__,
        "__doc__": "What a command's search options asked for: a field of SearchSettings each, None = not given.",
        "__post_init__": _flags_post_init,
        "given": _given,
    },
)


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SearchSettings)}


NO_FLAGS = SearchFlags()  # nothing asked for: the checkpoint decides everything


def _foreign_keywords(settings: SearchSettings, engine: str, names) -> dict:
    """{its keyword: the value} of each option of `names` that `engine` ("ctranslate2" or "generate") takes under
    a keyword; a value it refuses (Takes.refusal, Takes.values) raises its one line."""
    found = {}
    for name in names:
        option, value = OPTIONS[name], getattr(settings, name)
        takes: Takes = getattr(option, engine)
        if takes.refusal and value != _DEFAULTS[name]:
            raise UserError(takes.refusal)
        if not takes.keyword:
            continue
        if takes.values is not None:
            if value not in takes.values:
                known = ", ".join(map(repr, takes.values))
                raise UserError(f"{engine} has no equivalent of {name} {value!r} (its {takes.keyword} takes {known})")
            value = takes.values[value]
        found[takes.keyword] = value
    return found


def ctranslate2_keywords(settings: SearchSettings) -> dict:
    """translate_batch's keyword arguments for the options it takes as they are (the others are ctranslate2_engine's
    to map, Option.ctranslate2.why); a setting it refuses raises its one line."""
    return _foreign_keywords(settings, "ctranslate2", OPTIONS)


def ctranslate2_rescores(settings: SearchSettings) -> bool:
    """Whether CTranslate2's search scores are not ours under `settings` (Takes.renormalises): its hypotheses are
    then scored again by its scorer, which is ours."""
    return any(
        option.ctranslate2.renormalises and getattr(settings, name) != _DEFAULTS[name]
        for name, option in OPTIONS.items()
    )


def generate_keywords(settings: SearchSettings, config_only: bool = False) -> dict:
    """generate's keyword arguments (generation_config.json's keys) for the options it takes; config_only: those a
    checkpoint's decode section holds (what an export writes). A setting it refuses raises its one line."""
    names = [name for name, option in OPTIONS.items() if option.config or not config_only]
    return _foreign_keywords(settings, "generate", names)


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
    flags: SearchFlags = NO_FLAGS,
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
