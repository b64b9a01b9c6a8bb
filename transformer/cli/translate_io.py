"""The `translate` command's lines in and out: stdin streamed as lines arrive, an --input file in chunks with a
progress bar, a prefix or constraints file read beside them line for line, and --output written as FILE.partial,
renamed over FILE once every line is translated."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

from tqdm import tqdm

from transformer.errors import UserError
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import MAX_LINE_CHARS, Translation, Translator

# An --input file is translated and written this many lines at a time: a stop keeps what was done, and each
# chunk is still large enough for length batching to leave little padding.
CHUNK_LINES = 10_000
PARTIAL_SUFFIX = ".partial"
# What is kept of one line of stdin: enough UTF-8 for MAX_LINE_CHARS characters and one more, so that a line cut
# here is still longer than Translator.encode reads, and is named in its warning.
LINE_BYTES = 4 * (MAX_LINE_CHARS + 1)


def stdin_chunks(stream: TextIO | None = None, fallback_lines: int = 512) -> Iterator[list[str]]:
    """Lines of stdin in chunks of whatever has arrived: a whole piped file comes in large chunks,
    an interactive line comes alone, as soon as Enter is pressed."""
    stream = sys.stdin if stream is None else stream
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        fd = None
    if fd is None:  # not a real file (e.g. a StringIO in tests): fixed-size chunks
        chunk = []
        for line in stream:
            chunk.append(line.rstrip("\n").rstrip("\r"))
            if len(chunk) >= fallback_lines:
                yield chunk
                chunk = []
        if chunk:
            yield chunk
        return
    yield from _fd_chunks(fd)


def _fd_chunks(fd: int, line_bytes: int = LINE_BYTES) -> Iterator[list[str]]:
    # os.read returns what is available now (blocking only while nothing is), unlike a buffered readline loop.
    # The unfinished line is kept in pieces and only the new data is searched for a newline: joining and
    # splitting it again on every read takes quadratic time on a long line (seconds at megabytes). Of a line, only its
    # first line_bytes are kept: the rest is read and dropped, so a line of any length costs bounded memory.
    pending: list[bytes] = []
    kept = 0  # bytes of the unfinished line in `pending`, at most line_bytes
    while True:
        data = os.read(fd, 1 << 16)
        if not data:
            break
        cut = data.rfind(b"\n")
        if cut < 0:
            if kept < line_bytes:
                pending.append(data[: line_bytes - kept])
                kept += len(pending[-1])
            continue
        first = data.find(b"\n")
        complete = [b"".join(pending) + data[:first][: line_bytes - kept]]  # the line that was pending ends here
        if cut > first:  # lines wholly inside this read
            complete += [line[:line_bytes] for line in data[first + 1 : cut].split(b"\n")]
        pending = [data[cut + 1 :][:line_bytes]]
        kept = len(pending[0])
        yield [_decode_line(raw) for raw in complete]
    rest = b"".join(pending)
    if rest:
        yield [_decode_line(rest)]


def _decode_line(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")  # one bad byte should not stop a stream
    return text[:-1] if text.endswith("\r") else text


def file_chunks(lines: Sequence[str], size: int | None = None, progress: bool = True) -> Iterator[list[str]]:
    """`lines` in chunks of `size` (CHUNK_LINES), with a progress bar on stderr when it is a terminal."""
    size = size or CHUNK_LINES
    with tqdm(
        total=len(lines), desc="translate", unit=" lines", dynamic_ncols=True, disable=None if progress else True
    ) as bar:
        for start in range(0, len(lines), size):
            chunk = list(lines[start : start + size])
            yield chunk
            bar.update(len(chunk))


def in_place(path: str) -> bool:
    """Whether --output is written where it is instead of beside it and renamed: a device or a FIFO, or the
    file this process's stdout or stderr already writes to (`--output /dev/stdout` under `>> LOG`, or a link
    to it), which a rename would take away from the shell that opened it."""
    try:
        target = os.stat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(target.st_mode):
        return True
    for fd in (1, 2):
        try:
            ours = os.fstat(fd)
        except OSError:
            continue
        if (ours.st_dev, ours.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def partial_path(output: str) -> Path:
    """FILE.partial, beside the file that --output names (a link followed)."""
    final = Path(os.path.realpath(output))
    return final.with_name(final.name + PARTIAL_SUFFIX)


def check_partial(output: str, input: str | None = None) -> Path:
    """FILE.partial, refused in one line when something is there already: the input itself (`--input X.partial
    --output X` would truncate it, then rename it over X), a user's own file of that name, or the lines a stopped
    translation kept. It is created new (O_EXCL) and only that file is renamed or removed, so nothing that was
    there before is ever written over."""
    partial = partial_path(output)
    if input is not None and os.path.lexists(partial) and Path(input).exists() and os.path.samefile(partial, input):
        raise UserError(
            f"translate: --input {input} is {partial}, where --output {output} is written as lines are "
            "translated; rename the input, or write to another file"
        )
    if os.path.lexists(partial):
        raise _partial_exists(partial, output)
    return partial


def _partial_exists(partial: Path, output: str) -> UserError:
    return UserError(
        f"translate: {partial} exists (what a stopped translation kept, or a file of yours); it is "
        f"never written over: move it away or delete it, then translate into {output} again"
    )


def _create(partial: Path, output: str) -> TextIO:
    """FILE.partial, new, for writing text: never a file that is there already, nor a link's target."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(partial, flags, 0o666)
    except FileExistsError:  # it appeared since check_partial
        raise _partial_exists(partial, output) from None
    return os.fdopen(fd, "w", encoding="utf-8")


@contextlib.contextmanager
def output_lines(output: str | None) -> Iterator[TextIO]:
    """Where translations go: stdout; in place, appended (in_place); else FILE.partial, created new (check_partial)
    and renamed over FILE (its permissions kept, a link followed) when the block ends. On an error or Ctrl-C,
    FILE is unchanged and FILE.partial keeps the lines translated so far."""
    if output is None:
        yield sys.stdout
        return
    if in_place(output):
        with open(output, "a", encoding="utf-8") as f:
            yield f
        return
    final = Path(os.path.realpath(output))
    partial = check_partial(output)
    final.parent.mkdir(parents=True, exist_ok=True)
    with _create(partial, output) as f, _terminate_as_exit():
        try:
            yield f
            f.flush()
            os.fsync(f.fileno())
        except BaseException:
            f.close()
            if partial.stat().st_size:
                print(
                    f"translate: stopped; {output} is unchanged, and what was translated is in {partial} (move it "
                    "away before translating into the same file again)",
                    file=sys.stderr,
                )
            else:
                partial.unlink()
            raise
    if final.exists():
        os.chmod(partial, stat.S_IMODE(final.stat().st_mode))
    os.replace(partial, final)


@contextlib.contextmanager
def _terminate_as_exit() -> Iterator[None]:
    """SIGTERM (`kill`, a job scheduler) raises SystemExit(143) as Ctrl-C raises KeyboardInterrupt, so that
    output_lines says where the translated lines are; by default it would end the process on the spot."""
    from transformer.signals import restore_handlers, set_stop_handlers

    def handle(signum, frame):
        raise KeyboardInterrupt if signum == signal.SIGINT else SystemExit(143)

    previous = set_stop_handlers(handle)  # the main thread's only, as training's stop handlers
    try:
        yield
    finally:
        restore_handlers(previous, handle)


def write_translations(out: TextIO, results: list[list[Translation]], nbest: int, alignments: bool = False) -> None:
    """One line per translation: TEXT (nbest 1) or SCORE<TAB>TEXT, and <TAB>ALIGNMENT with alignments."""
    for hyps in results:
        for t in hyps[:1] if nbest == 1 else hyps:
            line = t.text if nbest == 1 else f"{t.score:.4f}\t{t.text}"
            out.write(f"{line}\t{t.alignment_text()}\n" if alignments else line + "\n")
    out.flush()


class LineFile:
    """A --prefix-file or --constraints-file: one line per input line, handed out in step with the input's chunks;
    its line count is checked against the input's (before anything is translated where the input is known)."""

    def __init__(self, flag: str, path: str):
        from transformer.data.corpus import read_lines

        self.flag, self.path, self.lines, self.used = flag, path, read_lines(path), 0

    def check_count(self, count: int) -> None:
        if len(self.lines) != count:
            raise UserError(
                f"translate: {self.flag} {self.path} has {len(self.lines)} lines for {count} input lines; it needs "
                "one per input line (an empty line where a sentence has none)"
            )

    def take(self, count: int) -> list[str]:
        if self.used + count > len(self.lines):
            raise UserError(
                f"translate: {self.flag} {self.path} has {len(self.lines)} lines, and the input goes on past them; "
                "it needs one per input line"
            )
        self.used += count
        return self.lines[self.used - count : self.used]


def _per_line(files: dict[str, LineFile], count: int) -> tuple[list[str] | None, list[list[str]] | None]:
    """The prefixes and constraints of the next `count` input lines (None where no file gives them)."""
    prefixes = files["prefix"].take(count) if "prefix" in files else None
    constraints = [line.split("\t") for line in files["constraints"].take(count)] if "constraints" in files else None
    return prefixes, constraints


def run_translate(
    checkpoint: str | Sequence[str],
    sentences: Sequence[str],
    input: str | None,
    output: str | None,
    device: str = "auto",
    flags: SearchFlags = SearchFlags(),
    prefix_file: str | None = None,
    constraints_file: str | None = None,
    target_lang: str | None = None,
) -> None:
    """The `translate` command: sentences from arguments, a file, or stdin (streamed), one result per line (or
    flags.nbest), searched with `flags` over the checkpoint's decode section; `checkpoint` several: an ensemble.
    prefix_file, constraints_file: one line per input line (LineFile)."""
    from transformer.data.corpus import read_lines
    from transformer.files import check_output_path

    checkpoints = [checkpoint] if isinstance(checkpoint, str) else list(checkpoint)
    if sentences and input:
        raise UserError("translate: give sentences as arguments or --input FILE, not both")
    if constraints_file and flags.sample is not None:
        raise UserError("translate: --constraints-file needs beam search; it cannot go with --sample")
    if constraints_file and flags.engine == "ctranslate2":
        raise UserError("translate: --engine ctranslate2 has no terminology constraints; use --engine ours")
    input = None if input == "-" else input  # standard input, streamed as without --input
    if output is None and sys.stdout is None:
        raise UserError("translate: standard output is closed; give --output FILE")
    if not sentences and not input and sys.stdin is None:
        raise UserError("translate: standard input is closed; give sentences as arguments or --input FILE")
    if output:  # before anything is opened: never truncate an input or a checkpoint
        check_output_path(output, [input, prefix_file, constraints_file, *checkpoints], command="translate")
        if not in_place(output):
            check_partial(output, input)
    # Read once (a pipe cannot be read again), before the model loads and before the output is opened.
    lines = list(sentences) if sentences else read_lines(input) if input else None
    files = {}
    for name, flag, path in (
        ("prefix", "--prefix-file", prefix_file),
        ("constraints", "--constraints-file", constraints_file),
    ):
        if path is not None:
            files[name] = LineFile(flag, path)
            if lines is not None:
                files[name].check_count(len(lines))
    translator = Translator(checkpoints, device, flags, target_lang=target_lang)  # --nbest above the beam is refused
    nbest, alignments = translator.settings.nbest, translator.settings.alignments
    if translator.note:
        print(translator.note, file=sys.stderr)
    # Every line's prefix and phrases taken or refused (text the vocabulary lacks) before anything is written.
    if "prefix" in files:
        translator.sentence_options(len(files["prefix"].lines), files["prefix"].lines, warn=False)
    if "constraints" in files:
        phrases = [line.split("\t") for line in files["constraints"].lines]
        translator.sentence_options(len(phrases), constraints=phrases, warn=False)
    if output is None and hasattr(sys.stdout, "reconfigure"):
        try:  # a translation may hold characters the terminal's encoding lacks: never crash on printing
            sys.stdout.reconfigure(errors="replace")
        except (ValueError, OSError):
            pass
    try:
        with output_lines(output) as out:
            # A progress bar for a file; sentences given as arguments come back at once.
            chunks = file_chunks(lines, progress=input is not None) if lines is not None else stdin_chunks()
            for chunk in chunks:
                prefixes, constraints = _per_line(files, len(chunk))
                write_translations(out, translator.translate_lines(chunk, prefixes, constraints), nbest, alignments)
            for line_file in files.values():  # stdin: the input ended; the file must have ended too
                line_file.check_count(line_file.used)
        translator.report_truncation()
    except OSError as e:
        if isinstance(e, BrokenPipeError) or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, output or "standard output") from None  # e.g. a full disk: say where
