"""`transformer synthesize`: a training corpus written from a model's translations of monolingual text
(back-translation, forward translation, sequence-level distillation). The input is translated in parts of
--chunk-lines lines, each written whole (its two files, then its record) before the next starts: stopped by Ctrl-C,
`kill -9` or a crash, the same command continues after the last part written, redoing nothing written and losing
no line, and ends with the very bytes an uninterrupted run writes (every part is searched as it would be; a seeded
sample depends on its source alone). Degenerate outputs are left out and counted. The directory it writes:

  train.{input language}, train.{output language}   the pairs, line for line (the input side as it was read)
  synthesis.json                                    what made them: the models' sha256, the input, the settings,
                                                    the counts (written first as `running`, last as `done`)
  parts/                                            the parts while it runs (removed once the pairs are whole)
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from transformer.data.corpus import read_lines
from transformer.errors import UserError
from transformer.files import atomic_write, check_output_path, file_sha256
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator
from transformer.model.checkpoint import resolve_checkpoint

log = logging.getLogger("transformer")

RECORD = "synthesis.json"
PARTS = "parts"
FORMAT = "transformer-synthesis-v1"
CHUNK_LINES = 10_000  # what translate --input translates at a time: length batching leaves little padding
# The filters' bounds (--no-filter keeps every output): an output over MAX_RATIO times longer or shorter than its
# source (in characters, each side + RATIO_SLACK so that short lines are not judged on a few letters), or one that
# repeats a word REPEATED_WORD times or a phrase of 2 to 4 words REPEATED_PHRASE times in a row.
MAX_RATIO = 3.0
RATIO_SLACK = 5
REPEATED_WORD, REPEATED_PHRASE = 4, 3
REASONS = ("empty", "copy", "length_ratio", "repetition")


def degenerate(source: str, output: str) -> str | None:
    """Why `output` is no translation of `source` worth training on (one of REASONS), or None."""
    if not output.strip():
        return "empty"
    if " ".join(output.lower().split()) == " ".join(source.lower().split()):
        return "copy"
    ratio = (len(output) + RATIO_SLACK) / (len(source) + RATIO_SLACK)
    if not 1 / MAX_RATIO <= ratio <= MAX_RATIO:
        return "length_ratio"
    words = output.split()
    if any(_repeats(words, n, REPEATED_WORD if n == 1 else REPEATED_PHRASE) for n in (1, 2, 3, 4)):
        return "repetition"
    return None


def _repeats(words: list[str], n: int, times: int) -> bool:
    """Whether some n words follow themselves, `times` in a row."""
    span = n * times
    for start in range(len(words) - span + 1):
        gram = words[start : start + n]
        if all(words[start + k * n : start + (k + 1) * n] == gram for k in range(1, times)):
            return True
    return False


@dataclass
class Counts:
    """What a part (or the whole synthesis) read, wrote and left out."""

    sources: int = 0  # input lines
    outputs: int = 0  # translations made (sources x outputs per source, blank lines aside)
    kept: int = 0
    left_out: dict = field(default_factory=lambda: dict.fromkeys(REASONS, 0))

    def add(self, other: Counts) -> None:
        self.sources += other.sources
        self.outputs += other.outputs
        self.kept += other.kept
        for reason in REASONS:
            self.left_out[reason] += other.left_out[reason]


def _what(checkpoints: Sequence[str], input_path: Path, lines: int, translator: Translator, flags: dict) -> dict:
    """What a synthesis is of: two runs of the same command agree on it, and a resume must find it unchanged."""
    settings = asdict(translator.settings)
    return {
        "models": [{"path": str(Path(c).resolve()), "sha256": file_sha256(c)} for c in checkpoints],
        "input": {
            "path": str(input_path.resolve()),
            "size": input_path.stat().st_size,
            "sha256": file_sha256(input_path),
            "lines": lines,
        },
        "languages": {
            "input": translator.cfg.data.src_lang,
            "output": translator.target_lang or translator.cfg.data.tgt_lang,
        },
        "settings": {k: v for k, v in settings.items() if k not in ("workers", "max_tokens")},  # speed only
        "filter": flags,
    }


def _differences(earlier: dict, what: dict) -> list[str]:
    """The keys of `what` an earlier record disagrees on. Files count by content, not by where they lie: a corpus
    copied or mounted afresh (a new path, a new modification time) is the same input, and a run directory moved
    holds the same models."""
    differ = []
    for key, value in what.items():
        old = earlier.get(key)
        if key == "models":
            same = [m.get("sha256") for m in old or []] == [m["sha256"] for m in value]
        elif key == "input":
            # A record from before content hashes holds the input's size and modification time; the time changes
            # with every copy, so such a record is matched on size and lines.
            fields = ("sha256", "lines") if "sha256" in (old or {}) else ("size", "lines")
            same = isinstance(old, dict) and all(old.get(f) == value[f] for f in fields)
        else:
            same = old == value
        if not same:
            differ.append(key)
    return differ


class Synthesis:
    """One output directory's synthesis: its record, its parts, and the final pair files."""

    def __init__(self, out_dir: Path, chunk_lines: int):
        self.out_dir, self.chunk_lines = out_dir, chunk_lines
        self.parts = out_dir / PARTS

    def record(self) -> dict | None:
        path = self.out_dir / RECORD
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            record = None
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            raise UserError(f"synthesize: {path} is not a record of ours; use another --out")
        return record

    def write_record(self, record: dict) -> None:
        text = json.dumps(record, indent=2, ensure_ascii=False) + "\n"
        atomic_write(self.out_dir / RECORD, lambda f: f.write(text.encode("utf-8")))

    def part_files(self, index: int, languages: dict) -> tuple[Path, Path, Path]:
        stem = self.parts / f"{index:06d}"
        return (
            stem.with_suffix(f".{languages['input']}"),
            stem.with_suffix(f".{languages['output']}"),
            stem.with_suffix(".json"),
        )

    def done_parts(self, count: int, languages: dict) -> dict[int, Counts]:
        """The parts written whole (their record is written last), by index."""
        done = {}
        for i in range(count):
            _, _, record = self.part_files(i, languages)
            if record.is_file():
                saved = json.loads(record.read_text(encoding="utf-8"))
                done[i] = Counts(**saved)
        return done

    def write_part(self, index: int, languages: dict, pairs: list[tuple[str, str]], counts: Counts) -> None:
        src, tgt, record = self.part_files(index, languages)
        for path, side in ((src, 0), (tgt, 1)):
            text = "".join(pair[side] + "\n" for pair in pairs)
            atomic_write(path, lambda f, text=text: f.write(text.encode("utf-8")))
        atomic_write(record, lambda f: f.write(json.dumps(asdict(counts)).encode("utf-8")))

    def join(self, count: int, languages: dict) -> None:
        """train.{input}, train.{output}: the parts in order, each file written whole (the parts stay until the
        record says done: remove_parts)."""
        for side, language in ((0, languages["input"]), (1, languages["output"])):

            def write(f, side=side):
                for i in range(count):
                    with open(self.part_files(i, languages)[side], "rb") as part:
                        while block := part.read(1 << 20):
                            f.write(block)

            atomic_write(self.out_dir / f"train.{language}", write)

    def remove_parts(self, count: int, languages: dict) -> None:
        if not self.parts.is_dir():
            return
        for i in range(count):
            src, tgt, record = self.part_files(i, languages)
            for path in (record, src, tgt):  # the record first: a part without one is redone, never half read
                path.unlink(missing_ok=True)
        if not any(self.parts.iterdir()):
            self.parts.rmdir()


def synthesize(
    checkpoints: Sequence[str],
    input_path: str,
    out_dir: str,
    device: str = "auto",
    flags: SearchFlags = SearchFlags(),
    chunk_lines: int = CHUNK_LINES,
    filtered: bool = True,
    target_lang: str | None = None,
) -> Path:
    """The `synthesize` command: every line of `input_path` translated by the model (several: an ensemble; into
    `target_lang`, for a model of several), the pairs written to `out_dir` (module docstring); resumed where a
    stopped run of the same command left off."""
    paths = [resolve_checkpoint(c) for c in checkpoints]
    out, source = Path(out_dir), Path(input_path)
    _check_arguments(input_path, out, chunk_lines)
    synthesis = Synthesis(out, chunk_lines)
    earlier = synthesis.record()
    if (
        earlier is not None
        and earlier.get("settings", {}).get("seed") is not None
        and flags.sample
        and flags.seed is None
    ):
        flags = SearchFlags(**{**asdict(flags), "seed": earlier["settings"]["seed"]})  # the same draws again
    lines = read_lines(source)
    translator = Translator([str(p) for p in paths], device, flags, target_lang=target_lang)
    if translator.note:
        print(translator.note, file=sys.stderr)
    what = _what(paths, source, len(lines), translator, {"filtered": filtered, "chunk_lines": chunk_lines})
    languages = what["languages"]
    for language in languages.values():  # never the input, a checkpoint or a training run's file
        check_output_path(out / f"train.{language}", [str(source), *map(str, paths)], command="synthesize")
    if earlier is not None:
        if differ := _differences(earlier, what):
            raise UserError(
                f"synthesize: {out} holds a synthesis of other {', '.join(differ)} ({out / RECORD}); "
                "give another --out, or delete it to start over"
            )
        if earlier.get("status") == "done":
            synthesis.remove_parts(-(-len(lines) // chunk_lines), languages)  # a stop just after the end left them
            print(f"synthesize: {out} is complete ({earlier['counts']['kept']} pairs); nothing to do", file=sys.stderr)
            return out
    out.mkdir(parents=True, exist_ok=True)
    synthesis.parts.mkdir(exist_ok=True)
    count = -(-len(lines) // chunk_lines)
    done = synthesis.done_parts(count, languages)
    record = {"format": FORMAT, "status": "running", **what, "command": " ".join(sys.argv)}
    synthesis.write_record(record)
    if done:
        log.info("synthesize: continuing after %d of %d parts", len(done), count)
    start = time.perf_counter()
    totals = _translate_parts(synthesis, translator, lines, languages, done, filtered)
    synthesis.join(count, languages)
    record.update(status="done", counts=asdict(totals), seconds=round(time.perf_counter() - start, 1))
    synthesis.write_record(record)
    synthesis.remove_parts(count, languages)
    left = ", ".join(f"{n} {reason}" for reason, n in totals.left_out.items() if n) or "none"
    print(
        f"synthesize: {totals.kept} pairs in {out} ({totals.outputs} translations of {totals.sources} lines; left "
        f"out: {left})",
        file=sys.stderr,
    )
    return out


def _check_arguments(input_path: str, out: Path, chunk_lines: int) -> None:
    """What can be refused before a model loads."""
    if not Path(input_path).is_file():
        raise UserError(f"synthesize: --input {input_path} is not a file (the monolingual text to translate)")
    if chunk_lines < 1:
        raise UserError(f"synthesize: --chunk-lines must be at least 1, got {chunk_lines}")
    if out.exists() and not out.is_dir():
        raise UserError(f"synthesize: --out {out} is a file; give a directory")


def _kept_pairs(chunk: list[str], results, per_source: int, filtered: bool) -> tuple[list[tuple[str, str]], Counts]:
    """A part's pairs (each line with each of its per_source translations; an empty line gives none), degenerate
    ones left out and counted unless not `filtered`."""
    pairs, counts = [], Counts(sources=len(chunk))
    for line, hyps in zip(chunk, results):
        for t in hyps[:per_source]:
            if not line.strip():
                continue
            counts.outputs += 1
            reason = degenerate(line, t.text) if filtered else None
            if reason is None:
                pairs.append((line, t.text))
            else:
                counts.left_out[reason] += 1
    counts.kept = len(pairs)
    return pairs, counts


def _translate_parts(
    synthesis: Synthesis, translator: Translator, lines: list[str], languages: dict, done: dict, filtered: bool
) -> Counts:
    """Every part not `done` translated and written whole, in order, with a progress bar on a terminal (a line per
    part elsewhere) -> the counts of all parts, those done before included."""
    chunk_lines, start = synthesis.chunk_lines, time.perf_counter()
    count = -(-len(lines) // chunk_lines)
    totals = Counts()
    for counts in done.values():
        totals.add(counts)
    written = before = totals.sources
    with tqdm(
        total=len(lines),
        initial=before,
        desc="synthesize",
        unit=" lines",
        dynamic_ncols=True,
        disable=None,  # a bar on a terminal; a log line per part elsewhere
    ) as bar:
        for i in range(count):
            if i in done:
                continue
            chunk = lines[i * chunk_lines : (i + 1) * chunk_lines]
            pairs, counts = _kept_pairs(chunk, translator.translate_lines(chunk), translator.settings.nbest, filtered)
            synthesis.write_part(i, languages, pairs, counts)
            totals.add(counts)
            written += len(chunk)
            bar.update(len(chunk))
            if bar.disable:  # a disabled bar counts nothing, so the line counts for itself
                print(
                    _progress_line(written, len(lines), written - before, time.perf_counter() - start), file=sys.stderr
                )
    return totals


def _progress_line(written: int, total: int, written_now: int, seconds: float) -> str:
    """What a log shows after each part: the lines written of all, this command's rate, the time left at that rate."""
    rate = written_now / max(seconds, 1e-9)
    return (
        f"synthesize: {written:,} of {total:,} lines, {rate:.0f} lines/s, {(total - written) / rate / 60:.0f} min left"
    )
