"""Preparing a run's data: its vocabulary (reused, taken from another run, or trained on its corpora, with the tags
they put before their sources) and the encoded stores of its corpora: data.dir's in the run directory, each of
data.corpora's in a folder of stores shared by the runs that name it with the same vocabulary. Each store is reused
while its inputs are unchanged, and rebuilt (saying why) when they change. The store format itself: store.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from transformer.config import MAIN_CORPUS, Config, CorpusConfig, DataConfig
from transformer.data.corpus import SPLIT_ALIASES, RawSplit, chain_lines, has_split, open_split
from transformer.data.mixture import Mixture, Part
from transformer.data.store import (
    BUILDING,
    SPLITS,
    Store,
    build,
    count_pairs,
    encoding,
    fingerprint,
    is_ours,
    main_encoding,
    problem,
    refuse_foreign,
)
from transformer.data.vocab import AnyVocab, Vocab, sample_sentences, train_vocab, vocab_in
from transformer.errors import UserError
from transformer.run_dir import RunDir

log = logging.getLogger("transformer")

CORPUS_SPLITS = ("train",)  # what a store of data.corpora holds: training pairs alone (validation is data.dir's)
STORES = "stores"  # the folder beside the run directory that keeps data.corpora's stores (data.corpora_store: "")


# --------------------------------------------------------------------------- the raw corpora


def open_raw_splits(cfg: Config) -> dict[str, RawSplit]:
    """Both splits of data.dir that training reads, checked to exist before anything expensive happens."""
    d = cfg.data
    return {
        "train": open_split(d, d.train_split, d.max_train_pairs, log.info),
        "valid": open_split(d, d.valid_split, d.max_valid_pairs, log.info),
    }


def corpus_data(d: DataConfig, c: CorpusConfig) -> DataConfig:
    """A corpus of data.corpora as the data settings that read it: local files of its directory and languages."""
    return dataclasses.replace(
        d, source="local", dir=c.dir, src_lang=c.src_lang or d.src_lang, tgt_lang=c.tgt_lang or d.tgt_lang
    )


def open_corpus(d: DataConfig, c: CorpusConfig) -> RawSplit:
    """The training pairs of one corpus of data.corpora."""
    return open_split(corpus_data(d, c), c.split, c.max_pairs, log.info)


# --------------------------------------------------------------------------- the vocabulary


def tag_ids(vocab: AnyVocab, tags: tuple[str, ...], whose: str) -> dict[str, int]:
    """Each tag's piece id, or a one-line error naming the first tag `whose` vocabulary lacks."""
    ids = dict(zip(tags, vocab.piece_ids(list(tags))))
    for tag, i in ids.items():
        if i == vocab.specials.unk:
            raise UserError(
                f"data: the tag {tag!r} is not a piece of {whose}, and a run's vocabulary cannot change once it has "
                "trained: start a new run to use it (another train.run_dir; train.init_from takes a trained model "
                "with the tag added), or drop the tag"
            )
    return ids


def prepare_vocab(cfg: Config, run_dir: Path, raw: dict[str, RawSplit]) -> AnyVocab:
    """The run's vocabulary: run_dir's own (spm.model, or the Marian vocabulary there), else data.vocab_from's with
    the tags it lacks, else one trained on (a sample of) every corpus's training pairs with the tags reserved; stored
    in run_dir."""
    d, path = cfg.data, RunDir(run_dir).vocab
    if path.is_file():
        log.info("vocab: reusing %s", path)
        vocab = Vocab.load(path).check_reuse(path, d.vocab_size)
        tag_ids(vocab, d.tags, f"this run's vocabulary ({path})")
        return vocab
    marian = vocab_in(run_dir)
    if marian is not None:
        log.info("vocab: reusing the Marian vocabulary in %s", run_dir)
        tag_ids(marian, d.tags, f"the Marian vocabulary in {run_dir}")
        return marian
    if d.vocab_from:
        vocab = vocab_from(d.vocab_from).with_pieces(d.tags)
        log.info("vocab: taking %s's vocabulary (%d pieces)", d.vocab_from, len(vocab))
    else:
        vocab = _train_vocab(cfg, raw)
    vocab.save(path)
    return vocab


def vocab_from(source: str) -> Vocab:
    """data.vocab_from: a run directory (its spm.model) or a SentencePiece model file."""
    path = Path(source)
    path = RunDir(path).vocab if path.is_dir() else path
    if not path.is_file():
        raise UserError(f"data.vocab_from: no SentencePiece model at {path} (give a run directory or an spm.model)")
    return Vocab.load(path)


def _train_vocab(cfg: Config, raw: dict[str, RawSplit]) -> Vocab:
    d = cfg.data
    if 0 < d.spm_max_sentences <= 100:  # checked here, not in the config: a run that reuses its vocabulary may keep it
        raise UserError(
            f"data.spm_max_sentences must be 0 (every sentence) or above 100 (SentencePiece's smallest "
            f"sample) to train a vocabulary, got {d.spm_max_sentences}"
        )
    corpora = [(d, raw["train"]), *((corpus_data(d, c), open_corpus(d, c)) for c in d.corpora)]
    languages = {lang for data, _ in corpora for lang in (data.src_lang, data.tgt_lang)}
    sentences = 2 * sum(split.n_pairs for _, split in corpora)
    sampled = 0 < d.spm_max_sentences < sentences  # 0: all of them
    sample = f"a sample of {d.spm_max_sentences} of the" if sampled else "the"
    log.info(
        "vocab: training a joint %s SentencePiece model of %d pieces on %s %d training sentences%s",
        d.spm_model_type,
        d.vocab_size,
        sample,
        sentences,
        f" of {len(corpora)} corpora" if len(corpora) > 1 else "",
    )
    start = time.perf_counter()
    if len(languages) > 2 or d.temperature != 1.0:
        lines, limit = language_sample(corpora, d.spm_max_sentences, d.temperature, cfg.train.seed), 0
    else:  # one language pair: every sentence (or a uniform sample), as runs always had
        lines, limit = (line for _, split in corpora for line in chain_lines(split.chunks())), d.spm_max_sentences
    vocab = train_vocab(lines, d.vocab_size, d.spm_model_type, d.spm_character_coverage, limit, cfg.train.seed, d.tags)
    log.info("vocab: trained in %.1f s", time.perf_counter() - start)
    return vocab


def language_sample(
    corpora: list[tuple[DataConfig, RawSplit]], max_sentences: int, temperature: float, seed: int
) -> list[str]:
    """The vocabulary's training text across several languages: each language's sentences (a file named by several
    corpora counted once) drawn so that its share goes as its size^(1/temperature), `max_sentences` in all (0: as
    many as there are). A language drawn more than it has repeats its sentences; less, a uniform sample of them."""
    by_language: dict[str, dict[str, tuple[RawSplit, int]]] = {}
    for data, split in corpora:
        files = [f.get("path", str(i)) for i, f in enumerate(split.fingerprint.get("files", []))] or [split.name]
        for side, lang in enumerate((data.src_lang, data.tgt_lang)):
            key = files[side] if len(files) > side else f"{id(split)}.{side}"
            by_language.setdefault(lang, {})[key] = (split, side)
    sizes = {lang: sum(split.n_pairs for split, _ in sources.values()) for lang, sources in by_language.items()}
    total = sum(sizes.values())
    budget = min(total, max_sentences) if max_sentences else total
    weights = {lang: n ** (1.0 / temperature) for lang, n in sizes.items()}
    drawn: list[str] = []
    for i, (lang, sources) in enumerate(sorted(by_language.items())):
        want = round(budget * weights[lang] / sum(weights.values()))
        text = (s for split, side in sources.values() for chunk in split.chunks() for s in chunk[side] if s.strip())
        pool = sample_sentences(text, want, seed + i)
        drawn += (pool * -(-want // max(len(pool), 1)))[:want]
        log.info("vocab: %s: %d of its %d sentences", lang, want, sizes[lang])
    return drawn


# --------------------------------------------------------------------------- data.dir's store


def log_counts(store: Store, max_len: int, splits: tuple[str, ...] = SPLITS, name: str = "") -> None:
    for split in splits:
        s = store.stats(split)
        log.info(
            "data: %s%s: %d pairs kept, %d dropped as longer than data.max_len=%d, %d dropped with a blank side",
            f"{name} " if name else "",
            split,
            s["pairs"],
            s["dropped_long"],
            max_len,
            s["dropped_blank"],
        )
        if not s["pairs"]:
            raise UserError(
                f"data: no usable pairs left in {f'{name} ' if name else ''}split {split!r} after filtering"
            )


def prepare(cfg: Config, run_dir: Path, vocab: AnyVocab | None = None, quiet: bool = False) -> Store:
    """The vocabulary (given, reused from run_dir, taken from data.vocab_from or trained) and the store of data.dir in
    run_dir/store (reused when its inputs are unchanged, else rebuilt with a log line saying why). One process only:
    under torchrun rank 0. Without the raw corpus, a complete store that fits is used as it is
    (_store_without_corpus). data.corpora's stores: prepare_corpora, with the vocabulary this leaves in run_dir."""
    try:
        raw = open_raw_splits(cfg)
    except UserError as missing:
        store = _store_without_corpus(cfg, run_dir, vocab, missing)
        log_counts(store, cfg.data.max_len)
        return store
    if cfg.train.finish:  # half a test split stops the end of training: said now, not hours from now
        has_split(cfg.data, cfg.data.test_split)
    if vocab is None:
        if vocab_in(run_dir) is None:
            count_pairs(raw)  # a bad validation split found before the vocabulary is trained, not after
        vocab = prepare_vocab(cfg, run_dir, raw)
    tag_ids(vocab, cfg.data.tags, "the vocabulary of the model the run continues or starts from")
    directory = RunDir(run_dir).store
    expected = fingerprint(raw, main_encoding(cfg, vocab))
    reason = problem(directory, expected)
    if reason is None:
        log.info("store: reusing %s (its offsets and ids checked)", directory)
    else:
        refuse_foreign(directory)
        log.info(
            "store: %s %s%s",
            "rebuilding" if directory.exists() else "preparing",
            directory,
            f": {reason}" if directory.exists() else "",
        )
        build(directory, vocab, raw, expected, cfg.data.max_len, quiet)
    store = Store(directory, checked=True)
    log_counts(store, cfg.data.max_len)
    return store


def open_prepared(cfg: Config, run_dir: Path, vocab: AnyVocab) -> Store:
    """The store rank 0 prepared, checked against this rank's view of the inputs (other ranks)."""
    directory = RunDir(run_dir).store
    try:
        raw = open_raw_splits(cfg)
    except UserError as missing:
        return _store_without_corpus(cfg, run_dir, vocab, missing)
    reason = problem(directory, fingerprint(raw, main_encoding(cfg, vocab)))
    if reason is not None:
        raise UserError(f"store: {directory} does not match this rank's data: {reason}")
    return Store(directory, checked=True)


def _store_without_corpus(cfg: Config, run_dir: Path, vocab: AnyVocab | None, missing: UserError) -> Store:
    """run_dir's complete store when data.dir is not there at all (a machine given only the run directory, or a
    corpus directory moved away): usable if it was encoded from files of these split names and languages, with
    this vocabulary, these filtering keys and pair limits. Otherwise `missing` is raised as it was: a data.dir
    that exists but lacks a file is a mistake to report, not a reason to train on something else."""
    directory, d = RunDir(run_dir).store, cfg.data
    if vocab is None:
        vocab = vocab_in(run_dir)
    if d.source != "local" or Path(d.dir).exists() or vocab is None or problem(directory) is not None:
        raise missing
    store = Store(directory, checked=True)
    built = store.manifest["fingerprint"]
    limits = {"train": d.max_train_pairs, "valid": d.max_valid_pairs}
    names = {"train": d.train_split, "valid": d.valid_split}
    for split in SPLITS:
        recorded = built["inputs"][split]
        allowed = {
            f"{name}.{lang}"
            for name in (names[split], *SPLIT_ALIASES.get(names[split], ()))
            for lang in (d.src_lang, d.tgt_lang)
        }
        if (
            recorded.get("limit") != limits[split]
            or not recorded.get("files")
            or not {Path(f["path"]).name for f in recorded["files"]} <= allowed
        ):
            raise missing
    if {k: v for k, v in built.items() if k != "inputs"} != main_encoding(cfg, vocab):
        raise missing
    source = Path(built["inputs"]["train"]["files"][0]["path"]).parent
    later = (
        (
            f"; the end of training reads the test split as text, so set train.finish=false and run `transformer "
            f"finish {run_dir}` where the corpus is"
        )
        if cfg.train.finish
        else ""
    )
    log.warning(
        "%s; using the prepared store %s, encoded from %s with this vocabulary and these data settings%s",
        missing,
        directory,
        source,
        later,
    )
    return store


# --------------------------------------------------------------------------- data.corpora's stores


def corpora_root(cfg: Config, run_dir: Path) -> Path:
    """The folder of data.corpora's stores: data.corpora_store, or `stores` beside the run directory."""
    return Path(cfg.data.corpora_store) if cfg.data.corpora_store else Path(run_dir).resolve().parent / STORES


def corpus_splits(c: CorpusConfig) -> tuple[str, ...]:
    """What a corpus's store holds: its training pairs, and its validation pairs where it names a split of them."""
    return ("train", "valid") if c.valid_split else CORPUS_SPLITS


def _corpus_store(
    cfg: Config, run_dir: Path, c: CorpusConfig, vocab: AnyVocab
) -> tuple[Path, dict[str, RawSplit], dict]:
    """(its store's directory, its raw splits, the fingerprint the store must have): the directory is named by the
    corpus and a hash of that fingerprint, so that runs naming the same files with the same vocabulary share it."""
    d = cfg.data
    data = corpus_data(d, c)
    raw = {"train": open_corpus(d, c)}
    if c.valid_split:
        raw["valid"] = open_split(data, c.valid_split, 0, log.info)
    token = d.target_tokens.get(data.tgt_lang, "")
    expected = fingerprint(raw, encoding(vocab, data.src_lang, data.tgt_lang, d.max_len, c.tag, token))
    key = hashlib.sha256(json.dumps(expected, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return corpora_root(cfg, run_dir) / f"{c.name}-{key}", raw, expected


def prepare_corpora(
    cfg: Config, run_dir: Path, vocab: AnyVocab, quiet: bool = False
) -> list[tuple[CorpusConfig, Store]]:
    """Each corpus of data.corpora with its store: reused where a run has built it (for these files and this
    vocabulary), else built in a staging folder and moved into place whole, so that a kill leaves no half store
    and two runs building the same one both end with it. One process only: under torchrun rank 0."""
    tag_ids(vocab, cfg.data.tags, "the run's vocabulary")
    prepared = []
    for c in cfg.data.corpora:
        directory, raw, expected = _corpus_store(cfg, run_dir, c, vocab)
        splits = corpus_splits(c)
        if problem(directory, expected, splits=splits) is None:
            log.info("store: %s: reusing %s", c.name, directory)
        else:
            _build_corpus_store(directory, vocab, raw, expected, cfg.data.max_len, quiet, c.name)
        store = Store(directory, checked=True, splits=splits)
        log_counts(store, cfg.data.max_len, splits, c.name)
        prepared.append((c, store))
    return prepared


def open_prepared_corpora(cfg: Config, run_dir: Path, vocab: AnyVocab) -> list[tuple[CorpusConfig, Store]]:
    """The stores rank 0 prepared for data.corpora, checked against this rank's view of their files."""
    opened = []
    for c in cfg.data.corpora:
        directory, _, expected = _corpus_store(cfg, run_dir, c, vocab)
        reason = problem(directory, expected, splits=corpus_splits(c))
        if reason is not None:
            raise UserError(f"store: {c.name}: {directory} does not match this rank's data: {reason}")
        opened.append((c, Store(directory, checked=True, splits=corpus_splits(c))))
    return opened


def _build_corpus_store(
    directory: Path, vocab: AnyVocab, raw: dict[str, RawSplit], expected: dict, max_len: int, quiet: bool, name: str
) -> None:
    refuse_foreign(directory)
    directory.parent.mkdir(parents=True, exist_ok=True)
    _remove_stopped_builds(directory)
    staging = directory.parent / f".{directory.name}.building-{os.getpid()}"
    log.info("store: %s: preparing %s", name, directory)
    try:
        build(staging, vocab, raw, expected, max_len, quiet)
        if directory.exists():  # ours (refuse_foreign) and unusable: replaced whole
            shutil.rmtree(directory)
        os.rename(staging, directory)
    except OSError:
        if problem(directory, expected, splits=tuple(raw)) is not None:  # another run's move came first: fine
            raise
    finally:
        if staging.exists() and is_ours(staging):
            shutil.rmtree(staging)


def _remove_stopped_builds(directory: Path) -> None:
    """Staging folders of `directory` left by a build whose process is gone (a kill): ours by their record."""
    for staging in directory.parent.glob(f".{directory.name}.building-*"):
        pid = staging.name.rsplit("-", 1)[-1]
        if pid.isdecimal() and not _alive(int(pid)) and (staging / BUILDING).is_file() and is_ours(staging):
            shutil.rmtree(staging)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tempered(parts: list[Part], temperature: float) -> list[Part]:
    """The parts with their weights times what data.temperature asks: each corpus's share of an epoch going as its
    size^(1/temperature), the epoch as large as the corpora together (1: as they are)."""
    drawn = [p for p in parts if p.weight > 0]
    if temperature == 1.0 or len(drawn) < 2:
        return parts
    sizes = {p.name: len(p.corpus) for p in drawn}
    scale = sum(sizes.values()) / sum(n ** (1.0 / temperature) for n in sizes.values())
    return [
        dataclasses.replace(p, weight=p.weight * scale * sizes[p.name] ** (1.0 / temperature) / sizes[p.name])
        if p.weight > 0
        else p
        for p in parts
    ]


def training_mixture(cfg: Config, store: Store, corpora: list[tuple[CorpusConfig, Store]]) -> Mixture:
    """The pairs training draws from: data.dir's with data.weight, then each of data.corpora with its own; logged
    per corpus where there are several (or a weight)."""
    d = cfg.data
    parts = [Part(MAIN_CORPUS, store.corpus("train"), d.weight, store.train_order)]
    parts += [Part(c.name, s.corpus("train"), c.weight, s.train_order) for c, s in corpora]
    mixture = Mixture(tempered(parts, d.temperature))
    if len(parts) > 1 or not mixture.every_pair_once:
        for row in mixture.shares():
            log.info(
                "data: corpus %s: %s pairs, %s tokens, weight %g: %s pairs an epoch (%.1f%% of an epoch's pairs, "
                "%.1f%% of its target tokens)",
                row["name"],
                f"{row['pairs']:,}",
                f"{row['tokens']:,}",
                row["weight"],
                f"{round(row['drawn']):,}",
                100 * row["share"],
                100 * row["tgt_share"],
            )
    return mixture


def pair_name(src_lang: str, tgt_lang: str) -> str:
    return f"{src_lang}-{tgt_lang}"


@dataclasses.dataclass(frozen=True)
class EvalPair:
    """One language pair a run is validated or tested on: data.dir's, or a corpus of data.corpora with its own
    validation or test split (a multilingual run's other pairs, or another test set of the same pair)."""

    name: str  # its languages ("fr-en"), or its corpus's name where an earlier pair has those languages
    data: DataConfig  # the settings that read its files
    corpus: CorpusConfig | None  # None: data.dir's
    valid_split: str  # "" = none
    test_split: str  # "" = none


def eval_pairs(d: DataConfig) -> list[EvalPair]:
    """The pairs of a run that have a validation or test split, data.dir's first, each named once: validation, the
    end of training and `evaluate` all take a run's pairs from here, so a name means the same pair in each."""
    pairs = [EvalPair(pair_name(d.src_lang, d.tgt_lang), d, None, d.valid_split, d.test_split)]
    langs = {lang for c in d.corpora for lang in (c.src_lang, c.tgt_lang) if lang} | {d.src_lang, d.tgt_lang}
    for c in d.corpora:
        if c.valid_split or c.test_split:
            data = corpus_data(d, c)
            name, taken = pair_name(data.src_lang, data.tgt_lang), [p.name for p in pairs]
            if name in taken and (c.name in taken or c.name in {pair_name(a, b) for a in langs for b in langs}):
                # a second set goes by its corpus's name: one already taken would overwrite the other set's scores
                # and translations, and one that reads as another pair (fr-en holding de-en) would mislabel them
                raise UserError(
                    f"data.corpora: {c.name!r} holds a second validation or test set of {name}, named by its "
                    f"corpus, and {c.name!r} is already the name of another of the run's sets or of a pair of its "
                    f"languages: rename the corpus (e.g. {name}_2)"
                )
            pairs.append(EvalPair(c.name if name in taken else name, data, c, c.valid_split, c.test_split))
    return pairs


def valid_sets(cfg: Config, store: Store, corpora: list[tuple[CorpusConfig, Store]]) -> list[tuple]:
    """The validation sets a run is scored on, (name, corpus, references): data.dir's, then each corpus's with a
    validation split among `corpora` (eval_pairs names them)."""
    stores = {c.name: s for c, s in corpora}
    sets = []
    for p in eval_pairs(cfg.data):
        s = store if p.corpus is None else stores.get(p.corpus.name)
        if s is not None and p.valid_split:
            sets.append((p.name, s.corpus("valid"), s.references("valid")))
    return sets


def pair_data(
    d: DataConfig, target_lang: str | None, source_lang: str | None = None, name: str | None = None
) -> DataConfig:
    """The data settings of one language pair of a run, the one from `source_lang` into `target_lang` (either None:
    any) or the one eval_pairs calls `name`: data.dir's, or the first of eval_pairs that matches, with its own
    validation and test splits (evaluate on one pair of a multilingual run: into French of one-to-many, from French
    of many-to-one, or a second test set of a pair by its corpus's name). A pair no corpus with a validation or test
    split matches: a one-line error that names the run's pairs."""
    pairs = eval_pairs(d)
    for p in pairs:
        langs = target_lang in (None, p.data.tgt_lang) and source_lang in (None, p.data.src_lang)
        if langs and name in (None, p.name):
            if p.corpus is None:
                return d
            return dataclasses.replace(
                p.data, valid_split=p.valid_split or d.valid_split, test_split=p.test_split or d.test_split
            )
    wanted = name if name is not None else pair_name(source_lang or "*", target_lang or "*")
    raise UserError(
        f"evaluate: no pair of this run with a validation or test split is {wanted} (its pairs: "
        f"{', '.join(p.name for p in pairs)}); give the files with --src and --ref"
    )
