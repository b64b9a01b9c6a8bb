"""The `evaluate` command: translate a split or files, score them (scoring.py), and keep the results by settings."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from transformer.errors import UserError
from transformer.files import atomic_write
from transformer.inference.scoring import SCORES, corpus_scores
from transformer.inference.settings import SearchFlags
from transformer.run_dir import RunDir


def _check_writable(eval_dir: Path) -> None:
    """eval_dir exists and takes new files; else a one-line error, before any translating."""
    try:
        eval_dir.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=eval_dir).close()
    except OSError as e:
        reason = e.strerror or str(e)
        if isinstance(e, FileExistsError):
            target = eval_dir.parent / os.readlink(eval_dir) if eval_dir.is_symlink() else None
            reason = (
                "it is a file, not a directory"
                if target is None or eval_dir.exists()
                else f"it is a link to {target}, which does not exist"
            )
        raise UserError(
            f"evaluate: cannot write the results to {eval_dir} ({reason}); evaluate a copy of the run "
            "or checkpoint in a directory you can write to"
        ) from None


def _read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _results_name(eval_dir: Path, name: str, settings: str, source: list | None, digest: str) -> str:
    """`name.settings`, so that evaluating with another beam does not overwrite the last result. Another source
    under a name already scored (wmt14/test.de, then wmt17/test.de) gets `name.DIGEST.settings`; the same files or
    split again (edited or not) replace their results, wherever they are. A pipe has no source to compare (None):
    its sentences do."""
    record = _read_record(eval_dir / f"{name}.{settings}.json")
    recorded = record.get("inputs_sha256")
    if recorded is None or recorded == digest or (source is not None and record.get("source") == source):
        return f"{name}.{settings}"  # the same, or an older record without the digest: replaced, as it always was
    if source is not None:  # this source's own results under a digest name, from before it was edited
        for path in sorted(eval_dir.glob(f"{glob.escape(name)}.{'[0-9a-f]' * 8}.{glob.escape(settings)}.json")):
            if _read_record(path).get("source") == source:
                return path.name[: -len(".json")]
    print(
        f"note: {eval_dir / name}.{settings}.json holds the scores of other sentences "
        f"({record.get('src') or record.get('split')}); these results get the name {name}.{digest[:8]}",
        file=sys.stderr,
    )
    return f"{name}.{digest[:8]}.{settings}"


def _check_inputs(split: str | None, src: str | None, ref: str | None) -> None:
    """A split or --src/--ref files, not both, and a split's name never a path out of the run."""
    from transformer.config import split_name_problem

    if (src is None) != (ref is None):
        raise UserError("evaluate: --src and --ref go together")
    if src is not None and split is not None:
        raise UserError("evaluate: give --split or --src/--ref, not both")
    problem = split_name_problem(split, "--split") if split is not None else None
    if problem is not None:
        raise UserError(f"evaluate: {problem}; for other files pass --src FILE --ref FILE")


def _read_split(data, split: str) -> tuple[list[str], list[str]]:
    """The sentences of a split of the run's corpus (train, valid and test stand for data.*_split); a split that is
    not there gets the hint, what is wrong inside one that is, its own message."""
    from transformer.data.corpus import load_split, resolve_split

    aliases = {"train": data.train_split, "valid": data.valid_split, "test": data.test_split}
    try:
        resolve_split(data, aliases.get(split, split))
    except UserError as e:
        if split in aliases or split in aliases.values():  # a split the run knows, whose files are not there
            raise UserError(f"evaluate: split {split!r}: {e}") from None
        raise UserError(
            f"evaluate: unknown split {split!r}: {e} (splits of this run are named by data.train_split, "
            "data.valid_split, data.test_split; or pass --src FILE --ref FILE)"
        ) from None
    return load_split(data, aliases.get(split, split))


def _source(data, split: str | None, src: str | None, ref: str | None) -> list | None:
    """What the results are of: the files (their absolute paths) or the split where it is read from; None for a
    pipe (on either side), which is only its sentences."""
    if src is None:
        return ["split", split, str(Path(data.dir).resolve()) if data.source == "local" else data.hub_name]
    if Path(src).is_file() and Path(ref).is_file():
        return ["files", str(Path(src).resolve()), str(Path(ref).resolve())]
    return None


def run_evaluate(
    run_dir: str | list[str],
    split: str | None,
    src: str | None,
    ref: str | None,
    device: str = "auto",
    flags: SearchFlags = SearchFlags(),
) -> dict:
    """The `evaluate` command: translate a split (or --src/--ref files) with the search `flags` over the
    checkpoint's decode section, score, write .hyp and .json. Several run directories or checkpoints: an ensemble,
    evaluated into the first one's eval/ (its data section and decode settings), named .ensembleN."""
    from transformer.data.corpus import read_parallel
    from transformer.inference.translator import Translator

    _check_inputs(split, src, ref)
    members = [run_dir] if isinstance(run_dir, str) else list(run_dir)
    run_dir = members[0]
    translator = Translator(members, device, flags)
    settings = translator.settings
    described = settings.describe() + (f".ensemble{len(members)}" if len(members) > 1 else "")
    if src is not None:
        sources, references = read_parallel(src, ref)
        # A pipe (`--src <(zcat test.de.gz)` is /dev/fd/63) would name the results "63"
        name = Path(src).name if Path(src).is_file() else "pipe"
    else:
        split = split or "test"
        sources, references = _read_split(translator.cfg.data, split)
        name = split
    if translator.note:
        print(translator.note, file=sys.stderr)
    checkpoint = Path(run_dir)
    eval_dir = RunDir(checkpoint if checkpoint.is_dir() else checkpoint.parent).eval
    if not checkpoint.is_dir():
        name = f"{checkpoint.stem}.{name}"
    text = "\n".join(sources) + "\0" + "\n".join(references)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    source = _source(translator.cfg.data, split, src, ref)
    name = _results_name(eval_dir, name, described, source, digest)
    _check_writable(eval_dir)  # before the translating, not after it
    start = time.perf_counter()
    hypotheses = translator.translate(sources)
    seconds = time.perf_counter() - start
    translator.report_truncation()
    scores = corpus_scores(hypotheses, references)
    for score in SCORES:
        print(f"{scores[f'{score.name}_detail']}\n  signature: {scores[f'{score.name}_signature']}", flush=True)
    hyp_path, json_path = eval_dir / f"{name}.hyp", eval_dir / f"{name}.json"
    text = "".join(h + "\n" for h in hypotheses)
    atomic_write(hyp_path, lambda f: f.write(text.encode("utf-8")))
    record = {
        "checkpoint": str(run_dir),
        "ensemble": members if len(members) > 1 else None,
        "sample": settings.sample,
        "temperature": settings.temperature if settings.sample else None,
        "seed": settings.seed if settings.sample else None,
        "split": split,
        "src": src,
        "ref": ref,
        "beam": settings.beam,
        "lenpen": settings.lenpen,
        "lenpen_kind": settings.lenpen_kind,
        "stop": settings.stop if settings.engine == "ours" else None,
        "dtype": settings.dtype,
        "engine": settings.engine,
        "seconds": round(seconds, 3),
        "hypotheses": str(hyp_path),
        "source": source,
        "inputs_sha256": digest,
        **scores,
    }
    summary = json.dumps(record, indent=2) + "\n"
    atomic_write(json_path, lambda f: f.write(summary.encode("utf-8")))
    print(f"{len(hypotheses)} sentences in {seconds:.1f}s ({described}); wrote {hyp_path} and {json_path}")
    return record
