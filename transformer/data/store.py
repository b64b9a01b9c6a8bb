"""The prepared corpus: SentencePiece-encoded splits in flat numpy files, built once (streaming), checked against a
manifest, and memory-mapped by every run start, resume and rank. What to prepare, and when: prepare.py.

Layout of RUN_DIR/store/ (all little-endian; `fairseq`'s .bin/.idx idea); a corpus of data.corpora has a store of
the same layout with its train split alone:
  {split}.{side}.bin   every sentence's token ids back to back, no EOS (uint16 when the vocabulary fits, else int32)
  {split}.{side}.idx   int64 offsets, one more than the sentences: sentence i is bin[idx[i]:idx[i+1]]
  valid.refs.json      the raw target lines of the kept validation pairs (BLEU references)
  manifest.json        format, dtype, counts, file sizes and the fingerprint of the inputs; written last
  building.json        written first and removed after the manifest: a store without a manifest but with this
                       record is one whose build was stopped (a kill), and is rebuilt
A directory is a store of ours only when one of those two records says so (never by its file names): anything
else found at RUN_DIR/store is a user's, and is refused, never deleted.
split is train or valid, side src or tgt. Training reads only offsets up front; tokens are paged in as batches need
them, and ranks on one machine share those pages.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain
from pathlib import Path

import numpy as np
from tqdm import tqdm

from transformer.config import Config
from transformer.data.corpus import RawSplit
from transformer.data.vocab import AnyVocab
from transformer.errors import UserError
from transformer.files import atomic_write, remove_stale_temporaries

log = logging.getLogger("transformer")

FORMAT_FAMILY = "transformer-store"  # every version's manifest format starts so: a store of ours, to rebuild
FORMAT = f"{FORMAT_FAMILY}-v1"
MANIFEST = "manifest.json"
BUILDING = "building.json"
SPLITS = ("train", "valid")
SIDES = ("src", "tgt")
PROGRESS_LOG_SECONDS = 30.0  # how often encoding logs how far it is when no progress bar shows it


def keep_mask(src_len: np.ndarray, tgt_len: np.ndarray, max_len: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, dropped as blank, dropped as too long), boolean per pair: the training filter."""
    blank = (src_len == 0) | (tgt_len == 0)
    long = ~blank & ((src_len > max_len) | (tgt_len > max_len))
    return ~blank & ~long, blank, long


@dataclass(frozen=True)
class Corpus:
    """Encoded pairs as flat token arrays and offsets (memory-mapped when they come from a store)."""

    src_tokens: np.ndarray  # (total source tokens,)
    src_offsets: np.ndarray  # (pairs + 1,) int64: pair i's source is src_tokens[src_offsets[i]:src_offsets[i + 1]]
    tgt_tokens: np.ndarray
    tgt_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    # int32: a sentence is far shorter than 2^31 tokens, and at millions of pairs half the bytes of int64 matter.
    @cached_property
    def src_lengths(self) -> np.ndarray:
        return np.diff(self.src_offsets).astype(np.int32)

    @cached_property
    def tgt_lengths(self) -> np.ndarray:
        return np.diff(self.tgt_offsets).astype(np.int32)

    def source(self, i: int) -> list[int]:
        return self.src_tokens[self.src_offsets[i] : self.src_offsets[i + 1]].tolist()

    def pair(self, i: int) -> tuple[list[int], list[int]]:
        return self.source(i), self.tgt_tokens[self.tgt_offsets[i] : self.tgt_offsets[i + 1]].tolist()

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], dtype=np.int32) -> Corpus:
        """An in-memory corpus (tests, small data)."""

        def flat(side: int) -> tuple[np.ndarray, np.ndarray]:
            lengths = np.fromiter((len(p[side]) for p in pairs), dtype=np.int64, count=len(pairs))
            tokens = np.fromiter(chain.from_iterable(p[side] for p in pairs), dtype=dtype, count=int(lengths.sum()))
            return tokens, np.r_[0, np.cumsum(lengths)].astype(np.int64)

        return cls(*flat(0), *flat(1))


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


# --------------------------------------------------------------------------- fingerprint and checks


def fingerprint(raw: dict[str, RawSplit], encoding: dict) -> dict:
    """Everything that changes the store's contents: the inputs, and how their text became tokens (encoding())."""
    return {"inputs": {split: r.fingerprint for split, r in raw.items()}, **encoding}


PREFIX_KEYS = ("target_token", "tag")  # the pieces before each source, in this order, where there are any


def encoding(
    vocab: AnyVocab, src_lang: str, tgt_lang: str, max_len: int, tag: str = "", target_token: str = ""
) -> dict:
    """The fingerprint's keys besides the input files: the vocabulary, the languages, the length filter, and the
    pieces before each source: the target language's token (a multilingual run's), the corpus's tag (a key only
    where there is one: the stores built before them stay current)."""
    keys = {"vocab_sha256": vocab.sha256, "src_lang": src_lang, "tgt_lang": tgt_lang, "max_len": max_len}
    prefix = {"target_token": target_token, "tag": tag}
    return {**keys, **{k: v for k, v in prefix.items() if v}}


def prefix_ids(vocab: AnyVocab, fingerprint: dict) -> tuple[int, ...]:
    """The ids of the pieces a store's fingerprint puts before each source."""
    pieces = [fingerprint[k] for k in PREFIX_KEYS if k in fingerprint]
    return tuple(vocab.piece_ids(pieces)) if pieces else ()


def main_encoding(cfg: Config, vocab: AnyVocab) -> dict:
    """encoding() of the run's own corpus (data.dir's)."""
    d = cfg.data
    return encoding(vocab, d.src_lang, d.tgt_lang, d.max_len, d.tag, d.target_tokens.get(d.tgt_lang, ""))


def _differences(old: dict, new: dict) -> list[str]:
    """Why a store built for `old` does not fit `new`, in words."""
    reasons = []
    for split in new["inputs"]:
        a, b = old["inputs"].get(split, {}), new["inputs"][split]
        if a == b:
            continue
        if a.get("limit") != b.get("limit"):
            reasons.append(f"data.max_{split}_pairs changed ({a.get('limit')} -> {b.get('limit')})")
        elif a.get("source") != b.get("source") or len(a.get("files", [])) != len(b["files"]):
            reasons.append(f"the {split} corpus is another one")
        else:
            before = len(reasons)
            for fa, fb in zip(a["files"], b["files"]):
                if fa["path"] != fb["path"]:
                    reasons.append(f"{split}: {fb['path']} instead of {fa['path']}")
                elif fa != fb:
                    reasons.append(f"{fb['path']} changed (size or modification time)")
            if len(reasons) == before:  # the same files, something else differs (a hub split's rows)
                reasons.append(f"the {split} corpus changed")
    if old["vocab_sha256"] != new["vocab_sha256"]:
        reasons.append("the vocabulary changed")
    for key in ("src_lang", "tgt_lang", "max_len", *PREFIX_KEYS):
        if old.get(key) != new.get(key):
            reasons.append(f"data.{key} changed ({old.get(key)} -> {new.get(key)})")
    return reasons


def _files(manifest: dict) -> dict[str, int]:
    """Expected size in bytes of every data file of a store."""
    itemsize = np.dtype(manifest["dtype"]).itemsize
    sizes = {}
    for split in manifest["splits"]:
        counts = manifest["splits"][split]
        for side in SIDES:
            sizes[f"{split}.{side}.bin"] = counts[f"{side}_tokens"] * itemsize
            sizes[f"{split}.{side}.idx"] = (counts["pairs"] + 1) * 8
    return sizes


def _read_record(path: Path) -> object:
    """The JSON in `path`, or None when it cannot be read or parsed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def is_ours(directory: Path) -> bool:
    """Whether `directory` may be written over as a store: it does not exist, is empty, or holds a record that
    build() wrote (a manifest of any transformer-store format, or the building record). File names alone prove
    nothing: a user's own store/ may hold files called train.src.bin."""
    if not directory.exists():
        return True
    if not directory.is_dir():
        return False
    if not any(directory.iterdir()):
        return True
    for name in (MANIFEST, BUILDING):
        record = _read_record(directory / name)
        if isinstance(record, dict) and str(record.get("format", "")).startswith(FORMAT_FAMILY):
            return True
    return False


def refuse_foreign(directory: Path) -> None:
    """A one-line error unless `directory` is ours (is_ours): a store is rebuilt only where we built one."""
    if not is_ours(directory):
        what = (
            "holds files that `transformer prepare` did not write (no manifest.json of a store)"
            if directory.is_dir()
            else "is not a directory"
        )
        raise UserError(
            f"store: {directory} {what}; it is never deleted: move it away (or delete it yourself if it "
            "is what an earlier version left when a prepare was stopped), then run again"
        )


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(manifest, splits: tuple[str, ...]) -> str | None:
    """What is missing from, or mistyped in, a parsed manifest of a store of `splits` (None: every key that is read
    is there)."""
    if not isinstance(manifest, dict):
        return f"it holds {type(manifest).__name__ if manifest is not None else 'null'}, not a JSON object"
    if manifest.get("format") != FORMAT:
        return f"it has format {manifest.get('format')!r}, this version reads {FORMAT!r}"
    if manifest.get("dtype") not in ("uint16", "int32") or not _is_count(manifest.get("vocab_size")):
        return "its dtype or vocab_size is missing or wrong"
    counts, built = manifest.get("splits"), manifest.get("fingerprint")
    keys = ("pairs", "src_tokens", "tgt_tokens")
    if (
        not isinstance(counts, dict)
        or set(counts) != set(splits)
        or not all(isinstance(counts.get(s), dict) and all(_is_count(counts[s].get(k)) for k in keys) for s in splits)
    ):
        return "its split counts are missing or wrong"
    if (
        not isinstance(built, dict)
        or not isinstance(built.get("inputs"), dict)
        or not all(isinstance(built["inputs"].get(s), dict) for s in splits)
    ):
        return "it has no fingerprint of its inputs"
    for split in splits:
        files = built["inputs"][split].get("files", [])
        if not isinstance(files, list) or not all(
            isinstance(f, dict) and isinstance(f.get("path"), str) for f in files
        ):
            return f"its fingerprint of the {split} input is malformed"
    if not _is_count(built.get("max_len")) or not isinstance(built.get("vocab_sha256"), str):
        return "its fingerprint has no vocabulary hash or max_len"
    return None


def _blocks(path: Path, dtype: np.dtype, items: int = 1 << 20) -> Iterator[np.ndarray]:
    """The values of a store file, read a block at a time: a check over a corpus of any size holds one block
    (memory-mapping it would count every page of it in the process's memory)."""
    with open(path, "rb") as f:
        while len(block := np.fromfile(f, dtype=dtype, count=items)):
            yield block


def _offsets_problem(path: Path, n_tokens: int, max_len: int) -> str | None:
    """Why the offsets in `path` cannot index `n_tokens` tokens as build() wrote them: from 0 to n_tokens, each
    sentence between 1 and max_len tokens long (blank and longer pairs were dropped). One pass."""
    first, last, done = None, None, 0  # done: sentences checked so far
    for block in _blocks(path, np.dtype(np.int64)):
        if first is None:
            first = int(block[0])
        lengths = np.diff(block if last is None else np.r_[last, block])
        bad = (lengths < 1) | (lengths > max_len)
        if first == 0 and bad.any():
            i = int(np.argmax(bad))
            starts = block if last is None else np.r_[last, block]
            return (
                f"sentence {done + i} spans offsets {int(starts[i])}..{int(starts[i + 1])}, not 1 to {max_len} "
                "tokens (data.max_len)"
            )
        done += len(lengths)
        last = int(block[-1])
    if first != 0 or last != n_tokens:
        return f"its offsets run from {first} to {last}, not from 0 to its {n_tokens} tokens"
    return None


def _tokens_problem(path: Path, dtype: np.dtype, vocab_size: int) -> str | None:
    """Why the ids in `path` cannot be of a vocabulary of `vocab_size` pieces (one pass)."""
    for block in _blocks(path, dtype, 1 << 22):
        low, high = int(block.min()), int(block.max())
        if low < 0 or high >= vocab_size:
            return f"it holds id {low if low < 0 else high}, outside the vocabulary's 0..{vocab_size - 1}"
    return None


def _contents_problem(directory: Path, manifest: dict) -> str | None:
    """Why files of the sizes the manifest gives cannot be used: offsets out of order or past the tokens, ids
    outside the vocabulary, unreadable references. What training would otherwise meet as an IndexError hours in."""
    dtype, max_len = np.dtype(manifest["dtype"]), manifest["fingerprint"]["max_len"]
    max_len += sum(k in manifest["fingerprint"] for k in PREFIX_KEYS)  # the pieces before each source
    for split in manifest["splits"]:
        for side in SIDES:
            bin_path, idx_path = directory / f"{split}.{side}.bin", directory / f"{split}.{side}.idx"
            reason = _offsets_problem(idx_path, manifest["splits"][split][f"{side}_tokens"], max_len)
            if reason is not None:
                return f"{idx_path}: {reason}: corrupt"
            reason = _tokens_problem(bin_path, dtype, manifest["vocab_size"])
            if reason is not None:
                return f"{bin_path}: {reason}: corrupt"
    if "valid" not in manifest["splits"]:
        return None
    refs = _read_record(directory / "valid.refs.json")
    if (
        not isinstance(refs, list)
        or len(refs) != manifest["splits"]["valid"]["pairs"]
        or not all(isinstance(r, str) for r in refs)
    ):
        return f"{directory / 'valid.refs.json'} is missing or does not hold the validation references: corrupt"
    return None


def problem(
    directory: Path, expected: dict | None = None, contents: bool = True, splits: tuple[str, ...] = SPLITS
) -> str | None:
    """Why the store of `splits` in `directory` cannot be used (for `expected` inputs), or None when it can.
    contents: also read the data once (offsets and ids, with numpy): what "reusing" promises; off only for a store
    just built."""
    path = directory / MANIFEST
    if not path.is_file():
        if not directory.exists():
            return "no prepared store yet"
        stopped = isinstance(_read_record(directory / BUILDING), dict)
        return "the store is incomplete (its build was stopped)" if stopped else "the store is incomplete (no manifest)"
    manifest = _read_record(path)
    reason = _manifest_problem(manifest, splits)
    if reason is not None:
        return f"{path} is not a store manifest this version reads ({reason})"
    for name, size in _files(manifest).items():
        file = directory / name
        actual = file.stat().st_size if file.is_file() else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            return f"{file} is {found}, the manifest says {size} bytes: truncated or corrupt"
    if expected is not None and manifest["fingerprint"] != expected:
        return "; ".join(_differences(manifest["fingerprint"], expected))
    return _contents_problem(directory, manifest) if contents else None


def _map(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # np.memmap cannot map an empty file
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r")


# --------------------------------------------------------------------------- reading


class Store:
    """A prepared store, opened read-only: memory-mapped corpora per split, and the validation references."""

    def __init__(self, directory: str | Path, checked: bool = False, splits: tuple[str, ...] = SPLITS):
        """checked: the caller has just had problem() read it all (or built it): only the cheap checks again.
        splits: what it must hold (a corpus of data.corpora: train alone)."""
        self.directory = Path(directory)
        reason = problem(self.directory, contents=not checked, splits=splits)
        if reason is not None:
            raise UserError(f"store: {reason}; run `transformer prepare CONFIG` (or train) to rebuild it")
        self.manifest = json.loads((self.directory / MANIFEST).read_text(encoding="utf-8"))
        self.dtype = np.dtype(self.manifest["dtype"])

    def corpus(self, split: str) -> Corpus:
        arrays = []
        for side in SIDES:
            tokens = self._map(f"{split}.{side}.bin", self.dtype)
            offsets = self._map(f"{split}.{side}.idx", np.dtype(np.int64))
            if len(offsets) == 0 or offsets[-1] != len(tokens) or offsets[0] != 0:
                raise UserError(
                    f"store: {self.directory}/{split}.{side}.idx does not match its tokens: "
                    "corrupt; delete the store directory to rebuild it"
                )
            arrays += [tokens, offsets]
        return Corpus(*arrays)

    def _map(self, name: str, dtype: np.dtype) -> np.ndarray:
        return _map(self.directory / name, dtype)

    def references(self, split: str) -> list[str]:
        return json.loads((self.directory / f"{split}.refs.json").read_text(encoding="utf-8"))

    def stats(self, split: str) -> dict:
        return self.manifest["splits"][split]

    @cached_property
    def train_order(self) -> str:
        """What the training batches are made from: every pair's lengths (the .idx files), hashed. A resumed run
        whose corpus changed (grown, shrunk, edited) sees another value and restarts its epoch."""
        digest = hashlib.sha256()
        for side in SIDES:
            with open(self.directory / f"train.{side}.idx", "rb") as f:
                for block in iter(lambda: f.read(1 << 24), b""):
                    digest.update(block)
        return digest.hexdigest()


# --------------------------------------------------------------------------- building


class _Appender:
    """Appends numpy chunks to a raw binary file; synced to disk when its `with` block ends normally."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.file, self.dtype = path.open("wb"), dtype

    def write(self, values: np.ndarray) -> None:
        np.asarray(values, dtype=self.dtype).tofile(self.file)

    def __enter__(self) -> _Appender:
        return self

    def __exit__(self, error_type, *_) -> None:
        with self.file:  # closed on an error too, with nothing synced: the manifest is not written then
            if error_type is None:
                self.file.flush()
                os.fsync(self.file.fileno())


def _writers(files: contextlib.ExitStack, directory: Path, split: str, dtype: np.dtype) -> dict[str, _Appender]:
    """The split's token files ({side}.bin) and offsets ({side}.idx, from 0), open until `files` closes."""
    writers = {
        f"{side}.{kind}": files.enter_context(_Appender(directory / f"{split}.{side}.{kind}", t))
        for side in SIDES
        for kind, t in (("bin", dtype), ("idx", np.dtype(np.int64)))
    }
    for side in SIDES:
        writers[f"{side}.idx"].write(np.zeros(1, dtype=np.int64))
    return writers


def _encode_chunk(vocab: AnyVocab, src_lines: list[str], tgt_lines: list[str], max_len: int, prefix: tuple[int, ...]):
    """A chunk of pairs split into ids (each source after the `prefix` pieces) -> (ids by side, lengths by side, the
    rows kept, the blank ones, the long ones: keep_mask's, max_len counting the text alone)."""
    ids = {"src": vocab.encode(src_lines), "tgt": vocab.encode_target(tgt_lines)}
    if prefix:  # a blank source stays blank (dropped below), not a prefix alone
        ids["src"] = [[*prefix, *s] if s else s for s in ids["src"]]
    lengths = {side: np.fromiter(map(len, ids[side]), dtype=np.int64, count=len(ids[side])) for side in SIDES}
    text_lengths = lengths["src"] - len(prefix) * (lengths["src"] > 0)
    kept, blank, long = keep_mask(text_lengths, lengths["tgt"], max_len)
    return ids, lengths, np.flatnonzero(kept), blank, long


def _encode_split(
    vocab: AnyVocab,
    raw: RawSplit,
    split: str,
    max_len: int,
    directory: Path,
    dtype: np.dtype,
    keep_references: bool,
    quiet: bool,
    prefix: tuple[int, ...] = (),
) -> dict:
    """Stream one split through SentencePiece into directory/{split}.{side}.bin/.idx, each source after the
    `prefix` pieces (prefix_ids); return its counts."""
    totals = {"src": 0, "tgt": 0}
    counts = {"read": 0, "pairs": 0, "dropped_long": 0, "dropped_blank": 0}
    references: list[str] = []
    start = logged = time.perf_counter()
    with contextlib.ExitStack() as files:
        writers = _writers(files, directory, split, dtype)
        bar = files.enter_context(
            tqdm(
                total=raw.n_pairs,
                desc=f"prepare {split}",
                unit=" pairs",
                unit_scale=True,
                dynamic_ncols=True,
                disable=True if quiet else None,
            )
        )
        for src_lines, tgt_lines in raw.chunks():
            ids, lengths, rows, blank, long = _encode_chunk(vocab, src_lines, tgt_lines, max_len, prefix)
            for side in SIDES:
                kept_lengths = lengths[side][rows]
                n_tokens = int(kept_lengths.sum())
                tokens = np.fromiter(chain.from_iterable(ids[side][i] for i in rows), dtype=dtype, count=n_tokens)
                writers[f"{side}.bin"].write(tokens)
                writers[f"{side}.idx"].write(totals[side] + np.cumsum(kept_lengths))
                totals[side] += n_tokens
            if keep_references:
                references += [tgt_lines[i] for i in rows]
            counts["read"] += len(src_lines)
            counts["pairs"] += len(rows)
            counts["dropped_blank"] += int(blank.sum())
            counts["dropped_long"] += int(long.sum())
            bar.update(len(src_lines))
            # No bar where stderr is a log file (nohup, a batch job): a line now and then.
            if (
                bar.disable
                and not quiet
                and counts["read"] < raw.n_pairs
                and time.perf_counter() - logged >= PROGRESS_LOG_SECONDS
            ):
                logged = time.perf_counter()
                log.info(
                    "store: %s: %d of %d pairs encoded (%.0f%%)",
                    split,
                    counts["read"],
                    raw.n_pairs,
                    100 * counts["read"] / max(raw.n_pairs, 1),
                )
    if keep_references:
        text = json.dumps(references, ensure_ascii=False)
        atomic_write(directory / f"{split}.refs.json", lambda f: f.write(text.encode("utf-8")))
    seconds = time.perf_counter() - start
    log.info(
        "store: %s: encoded %d pairs in %.1f s (%.0f pairs/s)",
        split,
        counts["read"],
        seconds,
        counts["read"] / max(seconds, 1e-9),
    )
    return {**counts, "src_tokens": totals["src"], "tgt_tokens": totals["tgt"], "seconds": round(seconds, 3)}


def _data_files() -> list[str]:
    """The names build() may write besides the two records."""
    return [f"{split}.{side}.{kind}" for split in SPLITS for side in SIDES for kind in ("bin", "idx")] + [
        f"{split}.refs.json" for split in SPLITS
    ]


def _clear(directory: Path) -> None:
    """Make `directory` an empty store being built: the building record first (so that a kill from here on leaves a
    store known to be ours), then the old manifest and data files, by name; anything else there is left alone."""
    refuse_foreign(directory)
    directory.mkdir(parents=True, exist_ok=True)
    record = json.dumps({"format": FORMAT}) + "\n"
    atomic_write(directory / BUILDING, lambda f: f.write(record.encode("utf-8")))
    for name in [MANIFEST, *_data_files()]:
        (directory / name).unlink(missing_ok=True)
    remove_stale_temporaries(directory)


def build(
    directory: Path,
    vocab: AnyVocab,
    raw: dict[str, RawSplit],
    expected: dict,
    max_len: int,
    quiet: bool = False,
) -> None:
    """Write a new store of the splits in `raw` into `directory`, replacing the store that is there (never a
    directory that is not a store of ours: refuse_foreign); the manifest goes last."""
    count_pairs(raw)
    _clear(directory)
    dtype = token_dtype(len(vocab))
    prefix = prefix_ids(vocab, expected)
    splits = {
        split: _encode_split(
            vocab, r, split, max_len, directory, dtype, keep_references=split == "valid", quiet=quiet, prefix=prefix
        )
        for split, r in raw.items()
    }
    manifest = {
        "format": FORMAT,
        "dtype": dtype.name,
        "vocab_size": len(vocab),
        "splits": splits,
        "fingerprint": expected,
    }
    text = json.dumps(manifest, indent=2) + "\n"
    atomic_write(directory / MANIFEST, lambda f: f.write(text.encode("utf-8")))
    (directory / BUILDING).unlink()


def count_pairs(raw: dict[str, RawSplit]) -> None:
    """Count every split's pairs, which checks that its sides exist, agree and are not empty: before the
    minutes of work that training a vocabulary or encoding a large training split takes."""
    for split in raw.values():
        _ = split.n_pairs  # cached: counted once
