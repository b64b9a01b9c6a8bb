"""The `evaluate` command: translate a split or files, score them (scoring.py), keep the results by settings, and
compare systems on the same sentences (comparison.py)."""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from transformer.errors import UserError
from transformer.files import atomic_write
from transformer.inference import comparison
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


def _check_inputs(
    split: str | None,
    src: str | None,
    ref: str | None,
    hyp: str | None,
    runs: list[str],
    target_lang: str | None = None,
    source_lang: str | None = None,
    pair: str | None = None,
) -> None:
    """A split or --src/--ref files, not both, and a split's name never a path out of the run; --hyp with --ref
    and nothing to translate or pick; --source-lang and --pair only for a split of the run's own data, and a pair
    picked by its name or by its languages, not both."""
    from transformer.config import split_name_problem

    if hyp is not None:
        if ref is None:
            raise UserError("evaluate: --hyp needs --ref, the reference translations of its lines")
        if src is not None or split is not None or runs:
            raise UserError(
                "evaluate: --hyp scores translations already made: give no run, checkpoint, --split or --src with it"
            )
        for flag, value in (("--target-lang", target_lang), ("--source-lang", source_lang), ("--pair", pair)):
            if value is not None:
                raise UserError(f"evaluate: --hyp scores translations already made against --ref; {flag} picks nothing")
        return
    for flag, value in (("--source-lang", source_lang), ("--pair", pair)):
        if value is not None and src is not None:
            raise UserError(f"evaluate: {flag} picks a pair of the run's own data: give it a --split, not --src")
    if pair is not None and (source_lang or target_lang) is not None:
        flag = "--source-lang" if source_lang is not None else "--target-lang"
        raise UserError(f"evaluate: --pair names the pair and its languages; give it or {flag}, not both")
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


@dataclass(frozen=True)
class _TestSet:
    """The sentences each system of one evaluate translates and is scored on, and what results are named after."""

    name: str  # the split, --src's file name, or "pipe"
    split: str | None
    src: str | None
    ref: str | None
    sources: list[str]
    references: list[str]
    source: list | None  # _source
    digest: str  # of the sentences: _results_name


def _test_set(data, split: str | None, src: str | None, ref: str | None) -> _TestSet:
    from transformer.data.corpus import read_parallel

    if src is not None:
        sources, references = read_parallel(src, ref)
        # A pipe (`--src <(zcat test.de.gz)` is /dev/fd/63) would name the results "63"
        name = Path(src).name if Path(src).is_file() else "pipe"
    else:
        split = split or "test"
        sources, references = _read_split(data, split)
        name = split
    text = "\n".join(sources) + "\0" + "\n".join(references)
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return _TestSet(name, split, src, ref, sources, references, _source(data, split, src, ref), digest)


def _eval_dir(checkpoint: str) -> Path:
    """Where a run directory's or checkpoint's results go: the run's eval/, or eval/ next to the file."""
    path = Path(checkpoint)
    return RunDir(path if path.is_dir() else path.parent).eval


def _print_scores(scores: dict) -> None:
    for score in SCORES:
        print(f"{scores[f'{score.name}_detail']}\n  signature: {scores[f'{score.name}_signature']}", flush=True)


def _write_record(path: Path, record: dict) -> None:
    summary = json.dumps(record, indent=2) + "\n"
    atomic_write(path, lambda f: f.write(summary.encode("utf-8")))


def _translations(path: str, sentences: int, option: str) -> list[str]:
    """The lines of a file of translations (--hyp, --compare), as many as the test set's sentences."""
    from transformer.data.corpus import read_lines

    if not Path(path).exists():
        raise UserError(f"evaluate: {option} {path}: no such file")
    lines = read_lines(path)
    if len(lines) != sentences:
        raise UserError(
            f"evaluate: {option} {path} has {len(lines)} lines but the references have {sentences}; "
            "line N must translate the source of reference N"
        )
    return lines


def _comparand(path: str, sentences: int) -> list[str] | None:
    """--compare PATH, checked before any translating: a run directory or .pt checkpoint -> None (translated as
    the baseline is, its results kept in its own eval/); else a file of translations -> its lines."""
    from transformer.model.checkpoint import resolve_checkpoint

    if Path(path).is_dir() or Path(path).suffix == ".pt":
        try:
            resolve_checkpoint(path)
        except UserError as e:
            raise UserError(f"evaluate: --compare {path}: {e}") from None
        _check_writable(_eval_dir(path))
        return None
    if not Path(path).exists():
        raise UserError(f"evaluate: --compare {path}: no such run directory, checkpoint or file of translations")
    return _translations(path, sentences, "--compare")


def _evaluate_system(translator, members: list[str], test: _TestSet) -> tuple[dict, list[str], Path]:
    """Translate the test set with `translator` (made of `members`), score, print the scores, write .hyp and .json
    into the first member's eval/. -> the record, the translations, the .json."""
    settings = translator.settings
    described = settings.describe() + (f".ensemble{len(members)}" if len(members) > 1 else "")
    if translator.note:
        print(translator.note, file=sys.stderr)
    checkpoint, eval_dir = Path(members[0]), _eval_dir(members[0])
    name = test.name if checkpoint.is_dir() else f"{checkpoint.stem}.{test.name}"
    name = _results_name(eval_dir, name, described, test.source, test.digest)
    _check_writable(eval_dir)  # before the translating, not after it
    start = time.perf_counter()
    hypotheses = translator.translate(test.sources)
    seconds = time.perf_counter() - start
    translator.report_truncation()
    scores = corpus_scores(hypotheses, test.references)
    _print_scores(scores)
    hyp_path, json_path = eval_dir / f"{name}.hyp", eval_dir / f"{name}.json"
    text = "".join(h + "\n" for h in hypotheses)
    atomic_write(hyp_path, lambda f: f.write(text.encode("utf-8")))
    record = {
        "checkpoint": members[0],
        "ensemble": members if len(members) > 1 else None,
        "sample": settings.sample,
        "temperature": settings.temperature if settings.sample else None,
        "seed": settings.seed if settings.sample else None,
        "split": test.split,
        "src": test.src,
        "ref": test.ref,
        "beam": settings.beam,
        "lenpen": settings.lenpen,
        "lenpen_kind": settings.lenpen_kind,
        "stop": settings.stop if settings.engine == "ours" else None,
        "dtype": settings.dtype,
        "engine": settings.engine,
        "seconds": round(seconds, 3),
        "hypotheses": str(hyp_path),
        "source": test.source,
        "inputs_sha256": test.digest,
        **scores,
    }
    _write_record(json_path, record)
    print(f"{len(hypotheses)} sentences in {seconds:.1f}s ({described}); wrote {hyp_path} and {json_path}")
    return record, hypotheses, json_path


def _evaluate_files(hyp: str, ref: str, compared: Sequence[str]) -> dict:
    """--hyp: translations already made, scored against --ref (and compared with --compare's files) without a
    model; printed only, as there is no run directory to keep them in."""
    from transformer.data.corpus import read_lines

    if not Path(ref).exists():
        raise UserError(f"evaluate: --ref {ref}: no such file")
    references = read_lines(ref)
    if not references:
        raise UserError(f"evaluate: --ref {ref} is empty")
    for path in compared:
        if Path(path).is_dir() or Path(path).suffix == ".pt":
            raise UserError(
                f"evaluate: --compare {path}: with --hyp, --compare takes files of translations (a model needs "
                "sources: evaluate RUN --src FILE --ref FILE --compare ...)"
            )
    systems = [(hyp, _translations(hyp, len(references), "--hyp"))]
    systems += [(path, _translations(path, len(references), "--compare")) for path in compared]
    scored = [corpus_scores(hypotheses, references) for _, hypotheses in systems]
    for (name, _), scores in zip(systems, scored):
        print(f"{name}:")
        _print_scores(scores)
    record = {"hyp": hyp, "ref": ref, **scored[0]}
    if compared:
        record["comparison"] = comparison.compare(systems, references)
        print(comparison.table(record["comparison"]), flush=True)
    return record


def run_evaluate(
    run_dir: str | list[str] | None,
    split: str | None,
    src: str | None,
    ref: str | None,
    device: str = "auto",
    flags: SearchFlags = SearchFlags(),
    compared: Sequence[str] = (),
    hyp: str | None = None,
    target_lang: str | None = None,
    source_lang: str | None = None,
    pair: str | None = None,
) -> dict:
    """The `evaluate` command: translate a split (or --src/--ref files) with the search `flags` over the
    checkpoint's decode section, score, write .hyp and .json. Several run directories or checkpoints: an ensemble,
    evaluated into the first one's eval/ (its data section and decode settings), named .ensembleN. `compared`: the
    other systems (run directories, checkpoints, files of translations), compared with this one, the baseline, by
    paired bootstrap resampling (comparison.py): printed, and kept in the baseline's .json. `hyp`: a file of
    translations, scored (and compared) in place of a model's. `target_lang`: the language pair of a multilingual
    run to evaluate (its corpus's split, its token before each source; data.dir's pair by default); `source_lang`
    picks it by its source language too (a many-to-one run's pairs share their target); `pair` by the name
    validation and the end of training give it (eval_pairs: de-en, or a second test set's corpus name)."""
    from transformer.data.prepare import pair_data, pair_name
    from transformer.inference.translator import Translator

    members = [] if run_dir is None else [run_dir] if isinstance(run_dir, str) else list(run_dir)
    _check_inputs(split, src, ref, hyp, members, target_lang, source_lang, pair)
    if hyp is not None:
        return _evaluate_files(hyp, ref, compared)
    translator = Translator(members, device, flags, target_lang=target_lang)
    if translator.token_required and pair is None:  # a multilingual run: one pair at a time
        translator.target_lang = translator.target_lang or translator.cfg.data.tgt_lang
    d = translator.cfg.data
    data = d if src is not None else pair_data(d, translator.target_lang, source_lang, pair)
    if pair is not None and translator.token_required:  # asked for the named pair's target language
        translator.target_lang = data.tgt_lang
    test = _test_set(data, split, src, ref)
    if pair is not None or source_lang is not None:  # named as the end of training names a pair's translations
        test = replace(test, name=f"{test.name}.{pair or pair_name(data.src_lang, data.tgt_lang)}")
    elif translator.token_required:
        test = replace(test, name=f"{test.name}.{translator.target_lang}")
    others = [_comparand(path, len(test.references)) for path in compared]  # a typo fails before the searching
    record, hypotheses, json_path = _evaluate_system(translator, members, test)
    if not compared:
        return record
    target_lang = translator.target_lang
    del translator  # one model in memory at a time
    systems = [("+".join(members), hypotheses)]
    for path, translations in zip(compared, others):
        if translations is None:
            other = Translator([path], device, flags, target_lang=target_lang)
            translations = _evaluate_system(other, [path], test)[1]
        systems.append((path, translations))
    record["comparison"] = comparison.compare(systems, test.references)
    print(comparison.table(record["comparison"]), flush=True)
    _write_record(json_path, record)
    print(f"wrote the comparison to {json_path}")
    return record
