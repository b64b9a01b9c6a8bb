"""YAML config -> frozen, type-checked dataclasses; unknown keys and bad values are errors."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from transformer.errors import UserError
from transformer.files import atomic_write


def round_up(n, multiple: int):
    """n rounded up to a multiple (ints or numpy arrays)."""
    return -(-n // multiple) * multiple


# model.positions: how the model tells positions apart, each kind a class in model/positions.py. "sinusoidal": the
# paper's sines and cosines interleaved; "marian": the same sinusoids as transformers' MarianMTModel lays them out
# (all sines, then all cosines); "learned": a trained table per side (the paper's Table 3, row E); "rotary": RoPE,
# queries and keys rotated inside self-attention (Su et al. 2021). A type and its values in one, as StopRule.
PositionKind = Literal["sinusoidal", "marian", "learned", "rotary"]
POSITION_KINDS: tuple[str, ...] = typing.get_args(PositionKind)
DEFAULT_POSITIONS: PositionKind = "sinusoidal"  # the paper's


def positions_problem(kind: str, d_model: int, n_heads: int, names: tuple[str, str]) -> str | None:
    """Why a model of this width and head count cannot have positions of this kind, or None: the one check of what
    each kind needs of the model's shape, which validate, serve's /positions and plot-positions all go through.
    `names`: how the caller's user gives d_model and n_heads (model.d_model, --d-model...)."""
    width, heads = names
    if kind in ("sinusoidal", "marian") and (d_model < 2 or d_model % 2):
        return f"{width} must be a positive even number for {kind} positions (a sine and a cosine per frequency), got {d_model}"
    if kind == "rotary" and (d_model < 2 or n_heads < 1 or d_model % n_heads or (d_model // n_heads) % 2):
        return (
            f"rotary positions need an even head size ({width} / {heads}: each head's dimensions are rotated in "
            f"pairs), got {width} {d_model} and {heads} {n_heads}"
        )
    if d_model < 1:
        return f"{width} must be positive, got {d_model}"
    return None


@dataclass(frozen=True)
class ModelConfig:
    d_model: int = 512  # width of every residual stream
    n_heads: int = 8
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    d_ff: int = 2048  # inner width of the position-wise feed-forward
    dropout: float = 0.1  # on embeddings+positions and on each sub-layer output
    attention_dropout: float = 0.0  # on the attention probabilities
    activation_dropout: float = 0.0  # after the activation inside the feed-forward
    max_positions: int = 1024  # longest sequence the model accepts (and the sinusoid table's length)
    # How positions are told apart (PositionKind above; each kind is a class in model/positions.py).
    positions: PositionKind = DEFAULT_POSITIONS
    norm: Literal["post", "pre"] = "post"  # post: the paper's Add&Norm; pre: LayerNorm before each sub-layer
    share_embeddings: bool = True  # one embedding matrix for source and target (joint vocabulary)
    tie_output: bool = True  # output projection reuses the target embedding matrix
    # The feed-forward's non-linearity: the paper's "relu", or "swish" (SiLU, x * sigmoid(x): OPUS-MT's).
    activation: Literal["relu", "swish"] = "relu"
    # A bias on the output projection (Marian's final_logits_bias), trained like every other weight; the paper has none.
    output_bias: bool = False
    layer_norm_eps: float = 1e-5  # every LayerNorm's epsilon (torch's default, and MarianMTModel's)


@dataclass(frozen=True)
class CorpusConfig:
    """One more corpus of training pairs for a run (an entry of data.corpora): its files, how often its pairs are
    drawn and the tag that marks its sources."""

    name: str = ""  # what logs and the store call it: letters, digits, '-', '_' (required)
    dir: str = ""  # files {dir}/{split}.{src_lang} and {dir}/{split}.{tgt_lang} (required)
    split: str = "train"
    src_lang: str = ""  # "" = data.src_lang
    tgt_lang: str = ""  # "" = data.tgt_lang
    # Pairs drawn per epoch as a multiple of its size: 2 = each pair twice, 0.5 = a random half (another each epoch).
    weight: float = 1.0
    # A reserved piece put before each of its source sentences ("" = none), e.g. "<bt>" for back-translations
    # (Caswell et al. 2019): one piece of the vocabulary, added to it where the vocabulary lacks it.
    tag: str = ""
    max_pairs: int = 0  # use only its first N pairs (0 = all)
    # Its own validation and test splits ("" = none): validation and the end of training score each pair of a
    # multilingual run on its own, and report their mean.
    valid_split: str = ""
    test_split: str = ""


@dataclass(frozen=True)
class DataConfig:
    source: Literal["local", "hub"] = "local"
    dir: str = "data/multi30k"  # local: files {dir}/{split}.{lang}
    hub_name: str = "bentrevett/multi30k"  # hub: datasets.load_dataset(hub_name, hub_config)
    hub_config: str | None = None
    src_lang: str = "de"
    tgt_lang: str = "en"
    train_split: str = "train"
    valid_split: str = "valid"  # also finds a split named "validation", "dev" or "val"
    test_split: str = "test"
    vocab_size: int = 8000  # joint SentencePiece vocabulary, special tokens included
    spm_model_type: Literal["bpe", "unigram"] = "bpe"
    spm_character_coverage: float = 1.0
    spm_max_sentences: int = 2_000_000  # sentences sampled to train SentencePiece
    max_len: int = 128  # training pairs with a side longer than this (subwords) are dropped
    max_tokens: int = 4096  # per batch: batch size x longest padded sequence (src or tgt)
    pad_to_multiple: int = 1  # pad lengths up to a multiple (8 helps tensor cores)
    max_train_pairs: int = 0  # use only the first N training pairs (0 = all)
    max_valid_pairs: int = 0  # use only the first N validation pairs (0 = all)
    # Several corpora: the pairs above (data.dir's) are drawn `weight` times per epoch (0: none, its validation and
    # test splits alone are read) and marked with `tag`, as each of `corpora` is with its own (CorpusConfig).
    # docs/more-data.md says how to use them.
    weight: float = 1.0
    tag: str = ""
    corpora: tuple[CorpusConfig, ...] = ()
    # How an epoch's pairs, and the vocabulary's training text, are shared among corpora of different sizes: each
    # corpus's share goes as its size^(1/temperature) (1 = in proportion to size; larger = flatter, so that a small
    # language pair is not crowded out), on top of its weight.
    temperature: float = 1.0
    # A run directory or spm.model whose vocabulary a new run takes (tags it lacks added), instead of training one.
    vocab_from: str = ""
    # Where the corpora's encoded stores are kept, each reused by every run that names it with the same vocabulary:
    # "" = a folder `stores` beside the run directory.
    corpora_store: str = ""

    @property
    def target_languages(self) -> tuple[str, ...]:
        """The languages the run translates into: data.tgt_lang's, then each corpus's, once each."""
        return tuple(dict.fromkeys([self.tgt_lang, *(c.tgt_lang or self.tgt_lang for c in self.corpora)]))

    @property
    def target_tokens(self) -> dict[str, str]:
        """Language -> the token before every source that asks for it (OPUS-MT's >>fr<<), where the run translates
        into more than one language; {} where it translates into one (no token: as every run before them)."""
        languages = self.target_languages
        return {lang: language_token(lang) for lang in languages} if len(languages) > 1 else {}

    @property
    def tags(self) -> tuple[str, ...]:
        """Every piece the run puts before sources (the target languages' tokens, the corpora's tags), once each."""
        tags = (*self.target_tokens.values(), self.tag, *(c.tag for c in self.corpora))
        return tuple(dict.fromkeys(t for t in tags if t))


def language_token(language: str) -> str:
    """The piece that asks a multilingual model for `language`: >>fr<<, as OPUS-MT's models and their users write it."""
    return f">>{language}<<"


@dataclass(frozen=True)
class TrainConfig:
    run_dir: str = "runs/default"  # config, tokenizer, checkpoints and logs go here
    seed: int = 1
    max_steps: int = 100_000  # optimizer updates
    max_epochs: int = 0  # 0 = no limit
    update_freq: int = 1  # micro-batches accumulated per update
    lr_schedule: Literal["noam", "inverse_sqrt", "constant"] = "noam"
    lr: float = 1.0  # noam: the factor; inverse_sqrt and constant: the peak rate
    warmup_steps: int = 4000
    label_smoothing: float = 0.1
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    weight_decay: float = 0.0
    clip_norm: float = 0.0  # max gradient norm; 0 = no clipping
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 where the hardware has it, else fp32
    device: Literal["auto", "cpu", "cuda"] = "auto"
    compile: bool = False  # torch.compile the model
    log_every: int = 100  # steps between training-metric lines in metrics.jsonl
    valid_every: int = 1000  # steps between validations and checkpoints
    keep_last: int = 0  # also keep this many step checkpoints (for averaging)
    valid_bleu: bool = False  # also translate the validation set and score BLEU at each validation
    valid_bleu_beam: int = 1  # 1 = greedy (fast); the paper's 4 for the real score
    valid_bleu_pairs: int = 0  # translate only the first N validation pairs (0 = all)
    # What those translations are scored with: names of inference/scoring.py's SCORES (what evaluate reports),
    # checked when training starts; bleu among them, as best.pt and early stopping follow it.
    valid_scores: tuple[str, ...] = ("bleu",)
    patience: int = 0  # stop after this many validations without improvement (0 = never)
    finish: bool = True  # at the end: average, choose checkpoint and lenpen on valid, score test
    tensorboard: bool = False  # also log to run_dir/tensorboard (needs the tensorboard extra)
    peak_tflops: float = 0.0  # the device's peak for MFU; 0 = measure it with a short matmul probe
    # A new run from a trained model (fine-tuning): its weights and vocabulary, from a run directory (its final.pt,
    # else best.pt, else last.pt) or a checkpoint file; step, optimizer, schedule and data start afresh. The model
    # and vocabulary settings must be the checkpoint's. "" = a model of its own.
    init_from: str = ""
    # The sha256 of the checkpoint init_from names; "" = not checked. Training writes it (config.yaml), so that the
    # run records where it started from, and a copy of that config starts from the same bytes or not at all.
    init_from_sha256: str = ""


# Beam search's stop rules, defined here once: decode.stop is checked against them, and
# transformer/inference/settings.py (--stop's choices, SearchSettings) re-exports them; the rules themselves are in
# inference/search.py. A type and its values in one: STOP_RULES is read from the Literal.
StopRule = Literal["exact", "early", "hf"]
STOP_RULES: tuple[str, ...] = typing.get_args(StopRule)
# The forms of the length penalty (search.length_penalty): GNMT's ((5 + len) / 6) ** lenpen, or len ** lenpen
# (transformers' and CTranslate2's), defined here once as the stop rules are.
LenpenKind = Literal["gnmt", "length"]
LENPEN_KINDS: tuple[str, ...] = typing.get_args(LenpenKind)


@dataclass(frozen=True)
class DecodeConfig:
    beam: int = 4
    # The length penalty's alpha (GNMT's unless lenpen_kind says otherwise; inference/search.py's length_penalty).
    # The end of training overrides it: final.pt's decode.lenpen (and config.yaml's) is whichever of
    # training/finish.py's LENPENS (or this value) scored best on the validation set, and translate, evaluate and
    # serve read a finished run's final.pt.
    lenpen: float = 0.6
    # The length penalty's form: "gnmt", ((5 + len) / 6) ** lenpen; "length", len ** lenpen (transformers' generate,
    # which an imported OPUS-MT model's config keeps).
    lenpen_kind: LenpenKind = "gnmt"
    max_len_offset: int = 50  # output may be source length + this many tokens
    max_tokens: int = 8192  # source tokens per translation batch
    # When beam search ends a sentence (search.py): "exact" (no live hypothesis can still win) or "early"
    # (fairseq's: once `beam` hypotheses have finished; faster), or "hf" (transformers' generate with
    # early_stopping=False: a heuristic bound at the current length). Exact stays the default: early loses more
    # BLEU on Multi30k than a default may (docs/performance.md, "Which setting where").
    stop: StopRule = "exact"
    # Searches run side by side on a CPU, each on its own batches with threads / workers of torch's threads
    # (CTranslate2's inter_threads): serial work in one overlaps the other's matrix products, so 2 translate
    # more sentences/s than 1 on a 2-core CPU (docs/performance.md, "Which setting where"). 1: one search on all
    # threads. A single batch, and CUDA, always run as one search.
    workers: int = 2


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)


# Section name -> its dataclass. Under `from __future__ import annotations` the fields' types are strings:
# resolved once, here.
SECTIONS: dict[str, type] = typing.get_type_hints(Config)

INT64 = 2**63
SEED_LIMIT = 2**32  # SentencePiece and NumPy take 32-bit unsigned seeds (torch takes 64-bit)
SPM_INT32 = 2**31  # SentencePiece's vocab_size is a signed 32-bit integer
MAX_YAML_NODES = 10_000  # values a config may expand to through YAML aliases; a real one has < 200
MAX_CONFIG_BYTES = 1 << 20

# The most decode.lenpen / --lenpen may be: the GNMT length penalty's alpha. Wu et al. (2016) tuned it in [0, 1] (0.6
# is this project's default, after the paper), and fairseq's and Sockeye's users set it up to about 2; far above, a
# length bonus outweighs every log-probability. The bound also keeps ((5 + length) / 6) ** alpha finite: at 400 it
# overflowed a float from about 30 tokens on (OverflowError in translate, evaluate, validation BLEU and serve);
# at 10 it stays below 1e23 for every length up to 1,000 tokens.
MAX_LENPEN = 10.0

# Decimal numbers in exponent notation without a dot, which YAML 1.1 does not count as floats.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _check_value(section: str, key: str, hint: Any, value: Any) -> Any:
    """Return value converted to the field's type, or raise a UserError naming section.key."""
    where = f"{section}.{key}"
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            choices = ", ".join(repr(c) for c in typing.get_args(hint))
            raise UserError(f"config: {where} must be one of {choices}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):  # X | None
        if value is None:
            return None
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _check_value(section, key, inner, value)
    if origin is tuple and len(typing.get_args(hint)) == 2 and typing.get_args(hint)[1] is Ellipsis:
        (item,) = typing.get_args(hint)[:1]
        if not isinstance(value, (list, tuple)):
            raise UserError(f"config: {where} must be a list, got {value!r}")
        return tuple(_check_value(section, f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if dataclasses.is_dataclass(hint):
        return _build_section(where, hint, value)
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"config: {where} must be a list of {len(args)} numbers, got {value!r}")
        return tuple(_check_value(section, key, a, v) for a, v in zip(args, value))
    if hint is bool:
        if not isinstance(value, bool):
            raise UserError(f"config: {where} must be true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"config: {where} must be an integer, got {value!r}")
        if not -INT64 <= value < INT64:  # what torch and numpy can hold
            raise UserError(f"config: {where} is out of range: {value} (at most 2^63 - 1 in size)")
        return value
    if hint is float:
        if isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 (PyYAML) reads 1e-9 and 5e-4 as strings
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"config: {where} must be a number, got {value!r}")
        try:
            value = float(value)
        except OverflowError:
            value = math.inf
        if not math.isfinite(value):
            raise UserError(f"config: {where} must be a finite number, got {value}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise UserError(f"config: {where} must be a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {hint!r} for {where}")


def _build_section(section: str, cls: type, values: Any):
    if values is None:
        values = {}
    if not isinstance(values, dict):
        what = f"section '{section}'" if section in SECTIONS else section
        raise UserError(f"config: {what} must be a mapping of keys to values")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise UserError(
                f"config: unknown key '{key}' in section '{section}' ({hint}known keys: {', '.join(sorted(known))})"
            )
    kwargs = {k: _check_value(section, k, hints[k], v) for k, v in values.items()}
    return cls(**kwargs)


def lenpen_problem(value: float, name: str) -> str | None:
    """Why `value` cannot be the length penalty's alpha (`name` is how the user gave it), or None: the one check
    that decode.lenpen, --lenpen and a Translator's lenpen all go through."""
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= MAX_LENPEN
    ):
        return None
    return (
        f"{name} must be a number from 0 to {MAX_LENPEN:g} (the GNMT length penalty's alpha; the paper's is 0.6), "
        f"got {value}"
    )


def split_name_problem(value: str, name: str) -> str | None:
    """Why `value` cannot name a split (`name` is how the user gave it), or None. A split names files in data.dir
    ({split}.{lang}) and results in the run's eval/: a path (../x, a/b) would read and write outside them."""
    if value and value not in (".", "..") and not any(c in value for c in ("/", "\\", "\0", os.sep)):
        return None
    return f"{name} must be a split's name, such as test or newstest2014 (no path, no '/'), got {value!r}"


CORPUS_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAIN_CORPUS = "main"  # how logs and records call the pairs of data.dir among several corpora
SPECIAL_PIECES = ("<pad>", "<unk>", "<s>", "</s>")


def tag_problem(tag: str, name: str) -> str | None:
    """Why `tag` cannot mark a corpus's sources (`name`: where the user gave it), or None."""
    if tag == "" or (re.fullmatch(r"\S{1,64}", tag) and tag not in SPECIAL_PIECES):
        return None
    return f"{name} must be one piece of text without spaces (e.g. <bt>), not a special piece, got {tag!r}"


def corpora_problems(d: DataConfig) -> list[str | None]:
    """What is wrong with data.corpora and the main corpus's weight and tag (None for each thing that is fine)."""
    problems = [
        None if d.weight >= 0 else f"data.weight must not be negative, got {d.weight}",
        None
        if d.weight > 0 or d.corpora
        else "data.weight 0 leaves no training pairs: name other corpora (data.corpora) or give it a weight",
        tag_problem(d.tag, "data.tag"),
        None if d.temperature > 0 else f"data.temperature must be positive, got {d.temperature}",
        *(
            None
            if re.fullmatch(r"[A-Za-z0-9_-]{1,32}", lang)
            else f"data: a language must be a code such as fr, got {lang!r}"
            for lang in d.target_languages
            if len(d.target_languages) > 1
        ),
    ]
    names = [MAIN_CORPUS]
    for i, c in enumerate(d.corpora):
        where = f"data.corpora[{i}]"
        src, tgt = c.src_lang or d.src_lang, c.tgt_lang or d.tgt_lang
        problems += [
            None
            if CORPUS_NAME.fullmatch(c.name)
            else f"{where}.name must be 1 to 64 letters, digits, '-' or '_', got {c.name!r}",
            None if c.name not in names else f"{where}.name {c.name!r} is taken ('main' is data.dir's corpus)",
            None if c.dir.strip() else f"{where}.dir must name the directory of its files",
            split_name_problem(c.split, f"{where}.split"),
            None if src != tgt else f"{where}: its source and target languages must differ, got {src!r} for both",
            None if c.weight > 0 else f"{where}.weight must be positive, got {c.weight}",
            None if c.max_pairs >= 0 else f"{where}.max_pairs must not be negative",
            *(
                split_name_problem(v, f"{where}.{k}")
                for k, v in (("valid_split", c.valid_split), ("test_split", c.test_split))
                if v
            ),
            tag_problem(c.tag, f"{where}.tag"),
        ]
        names.append(c.name)
    return problems


def _model_checks(m: ModelConfig) -> list[tuple[bool, str | None]]:
    """(whether it holds, what it says otherwise) for model.*'s shape: validate's first checks."""
    position_problem = positions_problem(m.positions, m.d_model, m.n_heads, ("model.d_model", "model.n_heads"))
    return [
        (
            m.d_model > 0 and m.n_heads > 0 and m.d_model % m.n_heads == 0,
            f"model.d_model ({m.d_model}) must be a positive multiple of model.n_heads ({m.n_heads})",
        ),
        (position_problem is None, position_problem),
        (m.n_encoder_layers >= 1 and m.n_decoder_layers >= 1, "model needs at least one encoder and one decoder layer"),
        (m.d_ff >= 1, "model.d_ff must be positive"),
        (m.max_positions >= 2, "model.max_positions must be at least 2"),
        (0 < m.layer_norm_eps < 1, f"model.layer_norm_eps must be in (0, 1), got {m.layer_norm_eps}"),
    ]


def validate(cfg: Config) -> None:
    """Reject combinations that would fail later or train nonsense."""
    m, d, t, dec = cfg.model, cfg.data, cfg.train, cfg.decode
    splits = [split_name_problem(getattr(d, f"{s}_split"), f"data.{s}_split") for s in ("train", "valid", "test")]
    checks = [
        *_model_checks(m),
        (8 <= d.vocab_size < SPM_INT32, f"data.vocab_size must be in [8, {SPM_INT32 - 1}] (SentencePiece's range)"),
        (d.spm_max_sentences >= 0, "data.spm_max_sentences must not be negative (0 = every sentence)"),
        (d.max_len >= 1, "data.max_len must be positive"),
        (
            d.max_len + 2 <= m.max_positions,
            f"data.max_len ({d.max_len}) + 2 special tokens exceeds model.max_positions ({m.max_positions})",
        ),
        (
            d.pad_to_multiple < 1 or round_up(d.max_len + 1, d.pad_to_multiple) <= m.max_positions,
            f"data.max_len ({d.max_len}) + 1, padded to a multiple of data.pad_to_multiple ({d.pad_to_multiple}), "
            f"exceeds model.max_positions ({m.max_positions})",
        ),
        (
            d.max_tokens >= d.max_len + 2,
            f"data.max_tokens ({d.max_tokens}) must hold at least one pair of max_len ({d.max_len}) + 2",
        ),
        (d.pad_to_multiple >= 1, "data.pad_to_multiple must be at least 1"),
        (0 < d.spm_character_coverage <= 1, "data.spm_character_coverage must be in (0, 1]"),
        (d.max_train_pairs >= 0 and d.max_valid_pairs >= 0, "data.max_*_pairs must not be negative"),
        (d.src_lang != d.tgt_lang, "data.src_lang and data.tgt_lang must differ"),
        (t.run_dir.strip() != "", "train.run_dir must name a directory for the run (it is empty)"),
        (
            0 <= t.seed < SEED_LIMIT,
            f"train.seed must be in [0, {SEED_LIMIT - 1}] (SentencePiece and NumPy take 32-bit seeds), got {t.seed}",
        ),
        (t.max_steps >= 1, "train.max_steps must be at least 1"),
        (t.max_epochs >= 0, "train.max_epochs must not be negative"),
        (t.update_freq >= 1, "train.update_freq must be at least 1"),
        (t.lr > 0, "train.lr must be positive"),
        (t.warmup_steps >= 0, "train.warmup_steps must not be negative"),
        (
            t.lr_schedule == "constant" or t.warmup_steps > 0,
            f"train.warmup_steps must be positive with lr_schedule '{t.lr_schedule}'",
        ),
        (0 <= t.label_smoothing < 1, "train.label_smoothing must be in [0, 1)"),
        (all(0 <= b < 1 for b in t.adam_betas), "train.adam_betas must be in [0, 1)"),
        (t.adam_eps > 0, "train.adam_eps must be positive"),
        (t.weight_decay >= 0, "train.weight_decay must not be negative"),
        (t.clip_norm >= 0, "train.clip_norm must not be negative"),
        (t.log_every >= 1 and t.valid_every >= 1, "train.log_every and train.valid_every must be at least 1"),
        (t.keep_last >= 0, "train.keep_last must not be negative"),
        (t.valid_bleu_beam >= 1, "train.valid_bleu_beam must be at least 1"),
        (
            "bleu" in t.valid_scores and len(set(t.valid_scores)) == len(t.valid_scores),
            f"train.valid_scores must name bleu (best.pt follows it), each score once, got {list(t.valid_scores)}",
        ),
        (t.valid_bleu_pairs >= 0 and t.patience >= 0, "train.valid_bleu_pairs and train.patience must not be negative"),
        (t.peak_tflops >= 0, "train.peak_tflops must not be negative (0 = measure it)"),
        (
            not t.init_from_sha256 or re.fullmatch(r"[0-9a-f]{64}", t.init_from_sha256) is not None,
            f"train.init_from_sha256 must be 64 lowercase hexadecimal digits or empty, got {t.init_from_sha256!r}",
        ),
        (
            not t.init_from_sha256 or t.init_from.strip() != "",
            "train.init_from_sha256 is set but train.init_from is empty: name the checkpoint it is the hash of",
        ),
        (dec.beam >= 1, "decode.beam must be at least 1"),
        (lenpen_problem(dec.lenpen, "decode.lenpen") is None, lenpen_problem(dec.lenpen, "decode.lenpen")),
        *((problem is None, problem) for problem in splits),
        (dec.max_len_offset >= 1, "decode.max_len_offset must be at least 1"),
        (dec.max_tokens >= 1, "decode.max_tokens must be positive"),
        (dec.workers >= 1, "decode.workers must be at least 1"),
    ]
    for p in ("dropout", "attention_dropout", "activation_dropout"):
        value = getattr(m, p)
        checks.append((0 <= value < 1, f"model.{p} must be in [0, 1), got {value}"))
    checks += [(problem is None, problem) for problem in corpora_problems(d)]
    for ok, message in checks:
        if not ok:
            raise UserError(f"config: {message}")


def from_dict(raw: Any) -> Config:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError("config: the top level must be a mapping with sections " + ", ".join(SECTIONS))
    for name in raw:
        if name not in SECTIONS:
            raise UserError(f"config: unknown section '{name}' (known sections: {', '.join(SECTIONS)})")
    cfg = Config(**{name: _build_section(name, cls, raw.get(name)) for name, cls in SECTIONS.items()})
    validate(cfg)
    # The shell expands ~ only at the start of a word, never in `--set train.run_dir=~/runs/x`.
    return dataclasses.replace(
        cfg,
        data=dataclasses.replace(cfg.data, dir=os.path.expanduser(cfg.data.dir)),
        train=dataclasses.replace(
            cfg.train, run_dir=os.path.expanduser(cfg.train.run_dir), init_from=os.path.expanduser(cfg.train.init_from)
        ),
    )


def to_dict(cfg: Config) -> dict:
    out = dataclasses.asdict(cfg)
    out["train"]["adam_betas"] = list(cfg.train.adam_betas)  # YAML-friendly
    out["data"]["corpora"] = list(out["data"]["corpora"])
    out["train"]["valid_scores"] = list(cfg.train.valid_scores)
    return out


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `section.key=value` strings; values are parsed as YAML (so 0.1, true, [1, 2] work)."""
    if raw is not None and not isinstance(raw, dict):
        raise UserError("config: the top level must be a mapping with sections " + ", ".join(SECTIONS))
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (raw or {}).items()}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise UserError(f"--set expects section.key=value, got {item!r}")
        path, text = item.split("=", 1)
        section, key = path.split(".", 1)
        try:
            value = parse_yaml(text, f"--set {path}")
        except yaml.YAMLError:
            value = text
        if not isinstance(raw.get(section), dict):
            raw[section] = {}
        raw[section][key] = value
    return raw


def _expanded_size(node: yaml.Node, where: str, memo: dict, active: set) -> int:
    """How many values `node` stands for once every alias is expanded (counted without expanding them)."""
    key = id(node)
    if key in memo:
        return memo[key]
    if key in active:
        raise UserError(f"config: {where}: a YAML alias refers to the value that contains it")
    active.add(key)
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    else:
        children = []
    size = 1 + sum(_expanded_size(child, where, memo, active) for child in children)
    active.discard(key)
    memo[key] = size
    return size


def parse_yaml(text: str, where: str) -> Any:
    """yaml.safe_load, except that a document whose aliases (&a ... *a) expand past MAX_YAML_NODES values is
    refused: a few hundred bytes of nested aliases stand for billions of values."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, where, {}, set())
        if size > MAX_YAML_NODES:
            raise UserError(
                f"config: {where}: YAML aliases expand it to {size:,} values (at most "
                f"{MAX_YAML_NODES:,}); write the values out instead of nesting aliases"
            )
        return loader.construct_document(node)
    except RecursionError:
        raise UserError(f"config: {where} is nested too deeply") from None
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> Any:
    """A YAML file, or anything readable at a path (a pipe, /dev/stdin), up to MAX_CONFIG_BYTES."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"config: {path} is a directory, not a YAML file")
    if not path.exists():
        raise UserError(f"config: no such file: {path}")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise UserError(f"config: cannot read {path}: {e.strerror}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise UserError(f"config: {path} is larger than {MAX_CONFIG_BYTES >> 20} MiB; that is not a config")
    try:
        return parse_yaml(data.decode("utf-8"), str(path))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise UserError(f"config: invalid YAML in {path}{where}: {problem}") from None
    except UnicodeDecodeError:
        raise UserError(f"config: {path} is not UTF-8 text") from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> Config:
    return from_dict(apply_overrides(read_yaml(path), overrides or []))


# The first line of every config.yaml that `transformer train` writes; a run directory's config.yaml
# without it is the user's own file, which a new run must not overwrite.
SAVED_HEADER = "# The effective config of the run in this directory (file + --set), written by transformer train."


def save_config(cfg: Config, path: str | Path, pieces: int | None = None, header: str = SAVED_HEADER) -> None:
    """config.yaml of a run; pieces: the vocabulary's size, noted when SentencePiece made fewer than asked (the
    setting stays as asked: a resume compares it). header: the first line(s), `# ...` (another writer's)."""
    comments = [header]
    if pieces is not None and pieces != cfg.data.vocab_size:
        comments.append(
            f"# The vocabulary has {pieces} pieces (data.vocab_size {cfg.data.vocab_size} is an upper "
            "bound; train.log says why)."
        )
    text = "\n".join(comments) + "\n" + yaml.safe_dump(to_dict(cfg), sort_keys=False)
    atomic_write(path, lambda f: f.write(text.encode("utf-8")))


def written_by_train(path: str | Path) -> bool:
    """True when `path` is a config.yaml that save_config wrote."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\n") == SAVED_HEADER
    except OSError:
        return False
