"""Raw parallel corpora: local files streamed line by line (UTF-8 checked, line numbers in errors), Hugging Face
`datasets` splits, split names and their aliases; what the store encodes and `evaluate` reads."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, islice
from pathlib import Path

from transformer.config import DataConfig
from transformer.errors import UserError, first_line

Chunk = tuple[list[str], list[str]]  # source lines, target lines

CHUNK_LINES = 50_000  # pairs read and encoded at a time: memory stays flat whatever the corpus size
# Where a config says "valid", a dataset may call the split "validation" or "dev" (and so on).
SPLIT_ALIASES = {
    "valid": ("validation", "dev", "val"),
    "validation": ("valid", "dev", "val"),
    "dev": ("validation", "valid"),
    "test": ("testing",),
}


# --------------------------------------------------------------------------- reading local files


def _decode(raw: bytes, path: Path, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start)
        raise UserError(f"data: {path} line {line} is not valid UTF-8 (byte {raw[e.start]:#04x})") from None


# Byte-order marks of the encodings a text editor or Windows tool may have saved a corpus in, instead of UTF-8.
_OTHER_ENCODINGS = (
    (b"\xff\xfe\x00\x00", "UTF-32"),
    (b"\x00\x00\xfe\xff", "UTF-32"),
    (b"\xff\xfe", "UTF-16"),
    (b"\xfe\xff", "UTF-16"),
)


def _check_text_start(path: Path, head: bytes) -> None:
    """A one-line error when the first block of `path` is plainly not UTF-8 text: a UTF-16/32 byte-order mark, or
    NUL bytes in a quarter of it or more (UTF-16 without a mark, a binary file; a stray NUL in text is left alone).
    Counting its lines would otherwise count bytes 0x0a, and report a line-count mismatch between the sides
    instead of the encoding."""
    encoding = next((name for mark, name in _OTHER_ENCODINGS if head.startswith(mark)), None)
    if encoding is None and not (head and head.count(b"\0") * 4 >= len(head)):
        return
    what = (
        f"{encoding} text (it starts with a {encoding} byte-order mark)"
        if encoding
        else "NUL bytes (UTF-16 or UTF-32 text, or not text at all)"
    )
    raise UserError(
        f"data: {path} is not UTF-8: it holds {what}; convert it, e.g. iconv -f "
        f"{encoding or 'UTF-16'} -t UTF-8 {path} > {path.name}.utf8, and use that"
    )


def iter_lines(path: str | Path, block_bytes: int = 1 << 24) -> Iterator[str]:
    """The lines of a UTF-8 file, streamed, read once: a pipe (`<(zcat x.gz)`), a FIFO or a device works as well
    as a regular file. Only '\\n' ends a line (str.splitlines would also split on U+2028, form feeds and other
    characters that occur inside real sentences); a final '\\r' and a leading BOM go."""
    path = _readable(path)
    line_no, pending, first = 1, b"", True
    with path.open("rb") as f:
        while True:
            block = f.read(block_bytes)
            if not block:
                break
            if first and not pending:
                _check_text_start(path, block[:4096])
            data = pending + block
            cut = data.rfind(b"\n")
            if cut < 0:
                pending = data
                continue
            complete, pending = data[:cut], data[cut + 1 :]
            text = _decode(complete, path, line_no)
            if first and text.startswith("\ufeff"):
                text = text[1:]
            first = False
            lines = text.split("\n")
            line_no += len(lines)
            yield from (line[:-1] if line.endswith("\r") else line for line in lines)
    if pending:
        text = _decode(pending, path, line_no)
        if first and text.startswith("\ufeff"):
            text = text[1:]
        if text:
            yield text[:-1] if text.endswith("\r") else text


def _readable(path: str | Path) -> Path:
    path = Path(path)
    if path.is_dir():
        raise UserError(f"data: {path} is a directory, not a file")
    if not path.exists():
        raise UserError(f"data: no such file: {path}")
    return path


def read_lines(path: str | Path) -> list[str]:
    """All lines of a (small) UTF-8 file: translation inputs, test sets."""
    return list(iter_lines(path))


def count_lines(path: str | Path) -> int:
    """Lines of a regular file as iter_lines yields them, counted on bytes (fast: no decoding)."""
    path = _readable(path)
    if not path.is_file():  # counting would consume a pipe before anything could read its lines
        raise UserError(f"data: {path} is not a regular file (a pipe or a device); it is read twice, so give a file")
    count, last = 0, b"\n"
    with path.open("rb") as f:
        _check_text_start(path, f.read(4096))
        f.seek(0)
        while block := f.read(1 << 24):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


def read_parallel(src_path: str | Path, tgt_path: str | Path) -> tuple[list[str], list[str]]:
    """Both sides of a (small) parallel file pair, checked like a training corpus. Each is read once, so
    either may be a pipe."""
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    _check_counts(src_path, len(src), tgt_path, len(tgt))
    return src, tgt


def _check_parallel(src_path: str | Path, tgt_path: str | Path) -> int:
    return _check_counts(src_path, count_lines(src_path), tgt_path, count_lines(tgt_path))


def _check_counts(src_path: str | Path, n_src: int, tgt_path: str | Path, n_tgt: int) -> int:
    if n_src != n_tgt:
        raise UserError(
            f"data: {src_path} has {n_src} lines but {tgt_path} has {n_tgt}; "
            "line N of one side must translate line N of the other"
        )
    if not n_src:
        raise UserError(f"data: {src_path} and {tgt_path} are empty")
    return n_src


def _chunks_of(pairs: Iterator[tuple[str, str]], size: int) -> Iterator[Chunk]:
    while batch := list(islice(pairs, size)):
        src, tgt = zip(*batch)
        yield list(src), list(tgt)


# --------------------------------------------------------------------------- splits: local or hub


@dataclass(frozen=True)
class RawSplit:
    """One split of a parallel corpus, ready to be streamed (possibly more than once) in chunks of pairs."""

    name: str  # the split's name in the corpus ("validation" for a "valid" key)
    chunks: Callable[[], Iterator[Chunk]]  # a new stream of (source lines, target lines) chunks per call
    fingerprint: dict  # what identifies the input: paths, sizes, mtimes / dataset files
    count: Callable[[], int]  # pairs the stream yields; checks that the sides agree (reads
    # the files: called before streaming, never for a reused store)

    @cached_property
    def n_pairs(self) -> int:
        return self.count()


def split_paths(cfg: DataConfig, split: str) -> tuple[Path, Path]:
    base = Path(cfg.dir)
    return base / f"{split}.{cfg.src_lang}", base / f"{split}.{cfg.tgt_lang}"


def _candidates(split: str) -> tuple[str, ...]:
    return (split,) + SPLIT_ALIASES.get(split, ())


def resolve_split(cfg: DataConfig, split: str, log: Callable[[str], None] | None = None) -> str:
    """The corpus's own name for `split`: the name itself, else an alias ("valid" -> "validation" or "dev").
    Cheap (no data is read), so every split can be checked before any expensive work."""
    if cfg.source == "hub":
        available = _hub_split_names(cfg)
    else:
        available = [s for s in _candidates(split) if all(p.is_file() for p in split_paths(cfg, s))]
    for name in _candidates(split):
        if name in available:
            if name != split and log is not None:
                log(f"data: split '{split}' not found; using '{name}'")
            return name
    if cfg.source == "hub":
        raise UserError(
            f"data: {cfg.hub_name!r} has no split {split!r} (its splits: {', '.join(available)}); "
            "set data.train_split / data.valid_split / data.test_split"
        )
    src, tgt = split_paths(cfg, split)
    missing = src if not src.is_file() else tgt
    if missing.is_dir():
        raise UserError(f"data: {missing} is a directory, not a file (split {split!r} in data.dir {cfg.dir!r})")
    if missing.exists():  # a FIFO or a device: counted first, then read, a corpus must be readable twice
        raise UserError(
            f"data: {missing} is not a regular file (a pipe or a device); a corpus is read more than "
            "once (counted, then encoded), so give a file"
        )
    where = "" if Path(cfg.dir).is_absolute() else f", relative to {Path.cwd()}, where this runs"
    raise UserError(f"data: no such file: {missing} (split {split!r} in data.dir {cfg.dir!r}{where})")


def has_split(cfg: DataConfig, split: str) -> bool:
    """Whether the corpus has `split` at all, under its name or an alias: False when no file of it exists (or the
    hub dataset lists no such split). Half a split, one side's file without the other, is resolve_split's error,
    not an absent split; so is a hub that cannot be asked."""
    if cfg.source == "hub":
        available = _hub_split_names(cfg)
        return any(name in available for name in _candidates(split))
    if not any(path.exists() for name in _candidates(split) for path in split_paths(cfg, name)):
        return False
    resolve_split(cfg, split)
    return True


def open_split(cfg: DataConfig, split: str, limit: int = 0, log: Callable[[str], None] | None = None) -> RawSplit:
    """A split by its config name (resolved through aliases), its first `limit` pairs when limit > 0."""
    name = resolve_split(cfg, split, log)
    if cfg.source == "hub":
        return _open_hub_split(cfg, name, limit)
    src_path, tgt_path = split_paths(cfg, name)

    def count() -> int:
        n = _check_parallel(src_path, tgt_path)
        return min(n, limit) if limit else n

    def chunks() -> Iterator[Chunk]:
        src_lines, tgt_lines = iter_lines(src_path), iter_lines(tgt_path)
        pairs = zip(src_lines, tgt_lines)
        yield from _chunks_of(islice(pairs, limit) if limit else pairs, CHUNK_LINES)

    files = [
        {"path": str(p.resolve()), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
        for p in (src_path, tgt_path)
    ]
    return RawSplit(name, chunks, {"source": "local", "files": files, "limit": limit}, count)


def load_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """All raw sentences of a (small) split, e.g. the test set that `evaluate` translates."""
    raw = open_split(cfg, split)
    raw.count()  # refuses sides of different lengths before anything is read
    src, tgt = [], []
    for s, t in raw.chunks():
        src += s
        tgt += t
    return src, tgt


def _datasets():
    try:
        import datasets
    except ImportError:
        raise UserError(
            "data.source 'hub' needs the `datasets` package: pip install 'transformer[hub]' (or pip install datasets)"
        ) from None
    return datasets


def _hub_error(cfg: DataConfig, what: str, e: Exception) -> UserError:
    cause = e.__cause__ or e.__context__  # `datasets` wraps what went wrong ("An error occurred while generating")
    why = f" ({first_line(cause, None)})" if cause is not None and str(cause).strip() else ""
    return UserError(f"data: cannot load {what} of {cfg.hub_name!r} through `datasets`: {first_line(e, None)}{why}")


def _hub_split_names(cfg: DataConfig) -> list[str]:
    datasets = _datasets()
    try:
        return list(datasets.get_dataset_split_names(cfg.hub_name, cfg.hub_config))
    except Exception as e:  # network, unknown name or config: all reach the user as one line
        raise _hub_error(cfg, "the split names", e) from None


def _open_hub_split(cfg: DataConfig, name: str, limit: int) -> RawSplit:
    """A `datasets` split (rows {src: .., tgt: ..} or {"translation": {..}}); `datasets` caches it on disk as
    memory-mapped Arrow, which is streamed here in chunks."""
    datasets = _datasets()
    try:
        ds = datasets.load_dataset(cfg.hub_name, cfg.hub_config, split=name)
    except Exception as e:
        raise _hub_error(cfg, f"split {name!r}", e) from None
    columns = ds.column_names
    if "translation" not in columns and not {cfg.src_lang, cfg.tgt_lang} <= set(columns):
        raise UserError(
            f"data: {cfg.hub_name!r} has columns {columns}; expected '{cfg.src_lang}' and "
            f"'{cfg.tgt_lang}' or a 'translation' column"
        )
    if "translation" in columns and len(ds):
        # The languages of the first rows (one row may lack one, or be null): which pair the dataset holds.
        languages = set().union(
            *(t for t in ds.select(range(min(len(ds), 1000)))["translation"] if isinstance(t, dict))
        )
        if not {cfg.src_lang, cfg.tgt_lang} <= languages:
            raise UserError(
                f"data: {cfg.hub_name!r} translations have languages {sorted(languages)}, not "
                f"{cfg.src_lang!r} and {cfg.tgt_lang!r}; check data.src_lang, data.tgt_lang and "
                "data.hub_config"
            )
    if not len(ds):
        raise UserError(f"data: {cfg.hub_name!r} split {name!r} is empty")
    n = min(len(ds), limit) if limit else len(ds)

    def texts(values: list, language: str, start: int) -> list[str]:
        """One language's sentences of a chunk: null (a row without it) counts as blank; a value that is not text
        (an integer column, a list) is an error naming the row, not a traceback from SentencePiece."""
        for i, value in enumerate(values):
            if value is not None and not isinstance(value, str):
                raise UserError(
                    f"data: {cfg.hub_name!r} split {name!r} row {start + i}: {language!r} holds "
                    f"{value!r} ({type(value).__name__}), not text; check data.src_lang and "
                    "data.tgt_lang, or the dataset"
                )
        return [value or "" for value in values]

    def chunks() -> Iterator[Chunk]:
        part = ds.select(range(n)) if n < len(ds) else ds
        start = 0
        for rows in part.iter(batch_size=CHUNK_LINES):
            if "translation" in rows:  # a row may lack a language, or be null: that side is blank
                pairs = [p if isinstance(p, dict) else {} for p in rows["translation"]]
                src, tgt = [p.get(cfg.src_lang) for p in pairs], [p.get(cfg.tgt_lang) for p in pairs]
            else:
                src, tgt = rows[cfg.src_lang], rows[cfg.tgt_lang]
            yield texts(src, cfg.src_lang, start), texts(tgt, cfg.tgt_lang, start)
            start += len(src)

    files = []
    for entry in ds.cache_files:
        p = Path(entry["filename"])
        files.append({"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns})
    fingerprint = {
        "source": "hub",
        "hub_name": cfg.hub_name,
        "hub_config": cfg.hub_config,
        "split": name,
        "rows": len(ds),
        "files": files,
        "limit": limit,
    }
    return RawSplit(name, chunks, fingerprint, lambda: n)


def chain_lines(chunks: Iterator[Chunk]) -> Iterator[str]:
    """Every sentence of a stream of chunks, source and target of a pair in turn (SentencePiece's input)."""
    return chain.from_iterable(chain.from_iterable(zip(src, tgt)) for src, tgt in chunks)
