"""A new run that starts from a trained model (train.init_from): the checkpoint it names, the settings that must be
that model's, its weights and vocabulary, the record of where the run started from, and how well the vocabulary fits."""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from transformer.config import Config, DataConfig, from_dict, to_dict
from transformer.data.corpus import open_split
from transformer.data.vocab import AnyVocab, save_vocab_files, vocab_from_stored, vocab_in
from transformer.errors import UserError, first_line
from transformer.files import file_sha256
from transformer.model.checkpoint import check_finite, load_checkpoint, resolve_checkpoint
from transformer.model.transformer import Transformer

log = logging.getLogger("transformer")

# model.* keys that change no weight: the checkpoint's model with other dropouts, or a longer positions table (a pure
# function of its length; a learned one is weights, whose shape check_settings compares). Every other model key, and
# the keys that made the vocabulary, must be the checkpoint's.
MAY_CHANGE = ("model.dropout", "model.attention_dropout", "model.activation_dropout", "model.max_positions")
VOCABULARY = ("data.vocab_size", "data.spm_model_type")
PROVENANCE = ("train.init_from", "train.init_from_sha256")  # where a run started: no setting to compare
FIT_PAIRS = 10_000  # pairs of a training split that the vocabulary-fit figures read (its first ones)
LONG_WORD = 4  # pieces from which a word counts as split into many


@dataclass
class Origin:
    """The trained model a run starts from."""

    path: Path  # the checkpoint file (a run directory resolved to its final.pt, best.pt or last.pt)
    sha256: str
    config: Config  # the config it was trained with
    vocab: AnyVocab
    weights: dict  # its state_dict
    fit: dict = field(default_factory=dict)  # the vocabulary-fit figures, once measured (fit_report)

    def record(self) -> dict:
        return {"path": str(self.path), "sha256": self.sha256}


def load_origin(cfg: Config) -> Origin:
    """The checkpoint train.init_from names, checked against train.init_from_sha256 when that is set."""
    t = cfg.train
    try:
        path = resolve_checkpoint(t.init_from)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    sha256 = file_sha256(path)
    if t.init_from_sha256 and sha256 != t.init_from_sha256:
        raise UserError(
            f"train.init_from: {path} has sha256 {sha256}, not {t.init_from_sha256} "
            "(train.init_from_sha256): it is another checkpoint than the one this config started from; "
            "set train.init_from_sha256 to '' to start from it as it is now"
        )
    try:
        state = load_checkpoint(path)
    except UserError as e:
        raise UserError(f"train.init_from: {e}") from None
    try:
        config = from_dict(state["config"])
    except UserError as e:
        raise UserError(f"train.init_from: {path}: its own {e}") from None
    check_finite(state["model"], f"train.init_from: {path}")  # before a store is built and updates are skipped
    return Origin(path, sha256, config, vocab_from_stored(state["vocab"]), state["model"])


def check_settings(origin: Origin, cfg: Config) -> list[str]:
    """Refuse, naming each key and both values, a model or vocabulary setting that is not the checkpoint's (MAY_CHANGE
    aside); return the other settings that differ from its run's ("key: before -> now"), for the log."""
    before, now = to_dict(origin.config), to_dict(cfg)
    refused, changed = [], []
    for section, values in now.items():
        for key, value in values.items():
            name, old = f"{section}.{key}", before[section][key]
            if old == value or name in PROVENANCE:
                continue
            if (section == "model" and name not in MAY_CHANGE) or name in VOCABULARY:
                refused.append(f"{name} is {value!r} here but {old!r} there")
            else:
                changed.append(f"{name}: {old!r} -> {value!r}")
    if refused:
        raise UserError(
            f"train.init_from: the model and its vocabulary come from {origin.path}, so their settings "
            f"must be its own: {'; '.join(refused)} (its config.yaml has them all)"
        )
    with torch.device("meta"):  # shapes only: nothing is allocated
        shapes = Transformer(cfg.model, len(origin.vocab), origin.vocab.specials).state_dict()
    for name, weight in origin.weights.items():
        if name in shapes and tuple(shapes[name].shape) != tuple(weight.shape):
            sizing = [c.split(": ")[0] for c in changed if c.split(": ")[0] in MAY_CHANGE]
            raise UserError(
                f"train.init_from: {origin.path}: its weight {name} is {tuple(weight.shape)}, this model's would be "
                f"{tuple(shapes[name].shape)}: set {' or '.join(sizing)} as it was there (a learned table of "
                "positions is sized by model.max_positions)"
            )
    return changed


def with_tags(origin: Origin, cfg: Config) -> Origin:
    """The origin with the pieces data.tags asks for and its vocabulary lacks (a back-translation run's <bt>, a
    multilingual run's >>fr<<) appended to its vocabulary, and a row for each to its embeddings and output layer:
    drawn as a new model's are (seeded by train.seed), so the pieces start untrained and everything else as it was."""
    vocab = origin.vocab
    if not hasattr(vocab, "with_pieces") or not cfg.data.tags:
        return origin
    grown = vocab.with_pieces(cfg.data.tags)
    added = len(grown) - len(vocab)
    if not added:
        return origin
    generator = torch.Generator().manual_seed(cfg.train.seed)
    weights, new_rows = dict(origin.weights), {}
    for name in ("src_embed.weight", "tgt_embed.weight", "output.weight", "output.bias"):
        if name not in weights or weights[name].shape[0] != len(vocab):
            continue
        old = weights[name]
        key = old.data_ptr()  # a matrix shared by several names (tied, shared embeddings) grows once, the same
        if key not in new_rows:
            if old.dim() == 2:
                new_rows[key] = (
                    torch.randn(added, old.shape[1], generator=generator).to(old.dtype) * old.shape[1] ** -0.5
                )
            else:
                new_rows[key] = torch.zeros(added, dtype=old.dtype)
        weights[name] = torch.cat([old, new_rows[key]])
    log.info(
        "init_from: the vocabulary gains %s (ids %d to %d), with new embedding rows: a model keeps every piece it had",
        ", ".join(cfg.data.tags),
        len(vocab),
        len(grown) - 1,
    )
    return dataclasses.replace(origin, vocab=grown, weights=weights)


def start(cfg: Config) -> tuple[Config, Origin]:
    """A new run's start from train.init_from: the checkpoint, loaded and checked (with the pieces data.tags needs
    added: with_tags), and cfg with the exact file and its sha256 in place of what the user named (config.yaml, the
    checkpoints and the summary carry them)."""
    origin = with_tags(load_origin(cfg), cfg)
    changed = check_settings(origin, cfg)
    log.info(
        "init_from: starting from %s (sha256 %s): its weights and vocabulary; step, optimizer, learning-rate "
        "schedule and data start afresh",
        origin.path,
        origin.sha256,
    )
    if changed:
        log.info("init_from: settings that differ from that model's run: %s", "; ".join(changed))
    provenance = {"init_from": str(origin.path), "init_from_sha256": origin.sha256}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **provenance)), origin


def on_resume(saved: Config, cfg: Config) -> Config:
    """A resumed run continues from its own checkpoint, never from train.init_from again: where it started is the
    checkpoint's record, whatever the config now says."""
    named, started = cfg.train.init_from, saved.train.init_from
    if named and (not started or Path(named) not in (Path(started), Path(started).parent)):
        log.warning(
            "init_from: train.init_from (%s) applies to a new run only; this run continues from its own checkpoint%s",
            named,
            f" (it started from {started})" if started else "",
        )
    provenance = {"init_from": started, "init_from_sha256": saved.train.init_from_sha256}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **provenance))


def copy_weights(model: torch.nn.Module, origin: Origin) -> None:
    """The model's weights become the checkpoint's, exactly (the model was built from the same settings)."""
    try:
        model.load_state_dict(origin.weights)
    except RuntimeError as e:
        raise UserError(
            f"train.init_from: {origin.path}: its weights do not fit this model ({first_line(e)})"
        ) from None


def install_vocab(run_dir: Path, vocab: AnyVocab) -> None:
    """The run directory's vocabulary (spm.model, or a Marian vocabulary's files) becomes the checkpoint's (one that
    `prepare` trained there before is replaced)."""
    there = vocab_in(run_dir)
    if there is not None:
        if there.stored == vocab.stored:
            return
        log.warning("init_from: replacing the vocabulary in %s with that of the model the run starts from", run_dir)
        if type(there) is not type(vocab):  # the other kind's files would be read first
            for name in there.files:
                (Path(run_dir) / name).unlink(missing_ok=True)
    save_vocab_files(vocab, run_dir)


# --------------------------------------------------------------------------- how well the vocabulary fits


def measure(vocab: AnyVocab, lines: list[str], target: bool = False) -> dict:
    """Over the whitespace-separated words of `lines` (target: split as targets are): pieces per word, the share of
    unknown pieces and the share of words in LONG_WORD or more pieces (SentencePiece never joins words, so each word
    is encoded on its own, once)."""
    words = Counter(word for line in lines for word in line.split())
    unique = list(words)
    pieces = unknown = long = 0
    unk = vocab.specials.unk
    for word, ids in zip(unique, (vocab.encode_target if target else vocab.encode)(unique)):
        n = words[word]
        pieces += n * len(ids)
        unknown += n * sum(1 for i in ids if i == unk)
        long += n * (len(ids) >= LONG_WORD)
    total = sum(words.values())
    return {
        "words": total,
        "pieces_per_word": round(pieces / max(total, 1), 3),
        "unknown_pieces_pct": round(100 * unknown / max(pieces, 1), 3),
        "long_words_pct": round(100 * long / max(total, 1), 2),
    }


def measure_split(vocab: AnyVocab, data: DataConfig, limit: int) -> dict[str, dict]:
    """measure() for each side of data's training split (its first `limit` pairs)."""
    raw = open_split(data, data.train_split, limit)
    sides: dict[str, list[str]] = {"src": [], "tgt": []}
    for src, tgt in raw.chunks():
        sides["src"] += src
        sides["tgt"] += tgt
    return {side: measure(vocab, lines, side == "tgt") for side, lines in sides.items()}


def _at_hand(data: DataConfig) -> bool:
    """Whether a model's own training data can be read here without fetching anything."""
    return data.source == "local" and Path(data.dir).is_dir()


def fit_report(cfg: Config, origin: Origin) -> dict:
    """Log how the checkpoint's vocabulary splits the new training data, beside the same figures on the data it was
    trained on where that is at hand; returns the figures (origin.fit too)."""
    limit = min(FIT_PAIRS, cfg.data.max_train_pairs or FIT_PAIRS)
    new = measure_split(origin.vocab, cfg.data, limit)
    old: dict | None = None
    first = origin.config.data
    if _at_hand(first):
        try:
            old = measure_split(origin.vocab, first, min(FIT_PAIRS, first.max_train_pairs or FIT_PAIRS))
        except UserError as e:
            log.info("vocab fit: the original training data cannot be read (%s)", e)
    origin.fit = {"pairs": limit, "new": new, **({"original": old} if old is not None else {})}
    log.info(
        "vocab fit: the vocabulary of %s on (up to) the first %s training pairs%s",
        origin.path,
        f"{limit:,}",
        f" (beside the same on its own training data, {first.dir})"
        if old is not None
        else " (its own training data is not at hand: no comparison)",
    )
    for side, lang in (("src", cfg.data.src_lang), ("tgt", cfg.data.tgt_lang)):
        f = new[side]
        line = (
            f"vocab fit: {'source' if side == 'src' else 'target'} ({lang}): {f['pieces_per_word']:.2f} pieces "
            f"per word, {f['unknown_pieces_pct']:.2f}% unknown pieces, {f['long_words_pct']:.1f}% of words in "
            f"{LONG_WORD}+ pieces"
        )
        if old is not None:
            o = old[side]
            line += (
                f" (its own data: {o['pieces_per_word']:.2f}, {o['unknown_pieces_pct']:.2f}%, "
                f"{o['long_words_pct']:.1f}%)"
            )
        log.info(line)
    if any(new[side]["unknown_pieces_pct"] > 0 for side in new):
        log.info(
            "vocab fit: unknown pieces are characters the vocabulary lacks: the model reads them as <unk> and "
            "can never write them"
        )
    return origin.fit
