"""RunDir: one owner for the names in a run directory; what a run directory means; which files a run owns."""

from __future__ import annotations

import ast
import os
import time

import pytest

from tests.helpers import ROOT
from transformer.errors import UserError
from transformer.model.checkpoint import resolve_checkpoint
from transformer.run_dir import RunDir


def test_paths_and_step_checkpoints_in_step_order(tmp_path):
    run = RunDir(tmp_path)
    assert (run.last, run.best, run.final, run.config, run.vocab) == tuple(
        tmp_path / n for n in ("last.pt", "best.pt", "final.pt", "config.yaml", "spm.model")
    )
    assert run.step(120) == tmp_path / "step_00000120.pt"
    assert run.final_hyp("test") == tmp_path / "eval" / "test.final.hyp"
    for step in (100_000_000, 5, 40):  # names outgrow 8 digits: order by step, not by name
        run.step(step).touch()
    (tmp_path / "step_x.pt").touch()
    assert [p.name for p in run.step_checkpoints()] == ["step_00000005.pt", "step_00000040.pt", "step_100000000.pt"]


def test_a_run_directory_means_final_then_best_then_last(tmp_path):
    with pytest.raises(UserError, match="holds no final.pt, best.pt or last.pt"):
        resolve_checkpoint(tmp_path)
    for name, expected in (("last.pt", "last.pt"), ("best.pt", "best.pt"), ("final.pt", "final.pt")):
        (tmp_path / name).touch()
        assert resolve_checkpoint(tmp_path) == tmp_path / expected
    assert resolve_checkpoint(tmp_path / "last.pt") == tmp_path / "last.pt"
    with pytest.raises(UserError, match="no such file"):
        resolve_checkpoint(tmp_path / "nothing.pt")


def test_newest_resumable_is_the_newer_of_the_last_step_checkpoint_and_best(tmp_path):
    run = RunDir(tmp_path)
    assert run.newest_resumable() is None
    run.step(8).touch()
    run.best.touch()
    now = time.time()
    os.utime(run.step(8), (now, now))
    os.utime(run.best, (now - 10, now - 10))
    assert run.newest_resumable() == run.step(8)
    os.utime(run.best, (now + 10, now + 10))
    assert run.newest_resumable() == run.best


def test_a_run_owns_its_files_only_once_it_has_a_marker(tmp_path):
    run = RunDir(tmp_path / "run")
    (run.store / "x").mkdir(parents=True)
    run.eval.mkdir()
    run.final_hyp("test").touch()
    (run.eval / "mine.txt").touch()
    assert RunDir.owning(run.last) is None  # no marker yet: a plain directory
    run.vocab.touch()
    assert RunDir.owning(run.last) == run.path.resolve()
    assert RunDir.owning(run.store / "x" / "deep.bin") == run.path.resolve()
    assert RunDir.owning(run.final_hyp("test")) == run.path.resolve()
    assert RunDir.owning(run.eval / "mine.txt") is None  # evaluate's own results may be replaced
    assert RunDir.owning(run.path / "notes.txt") is None


def test_no_other_module_spells_a_run_file_name():
    """The names are RunDir's: a string constant equal to one of them elsewhere in the package is a second owner."""
    names = set(RunDir.FILES) | {RunDir.AVERAGED, RunDir.EVAL}
    offenders = []
    for path in sorted((ROOT / "transformer").rglob("*.py")):
        if path.name == "run_dir.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
        }
        offenders += [
            f"{path.relative_to(ROOT)}:{n.lineno}: {n.value!r}"
            for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and n.value in names and id(n) not in docstrings
        ]
    assert not offenders, offenders
