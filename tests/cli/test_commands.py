"""What each verb does with what it is given (cli/commands.py, through `main` in this process): bad input of every
kind is one line, an exit status, no traceback, and nothing lost (mostly a table); resume, prepare, average and
evaluate keep to their own files."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.helpers import tiny_config, write_config
from transformer.config import from_dict
from transformer.model.checkpoint import load_checkpoint, save_checkpoint
from transformer.training.average import average_checkpoints
from transformer.training.loop import train


def alias_bomb(levels: int = 8) -> str:
    """YAML of a few hundred bytes whose aliases stand for 9^levels values."""
    rows = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    rows += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(rows) + f"\nmodel: *a{levels}\n"


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict:
    """A trained run and the files the bad inputs point at, made once."""
    root = tmp_path_factory.mktemp("bad")
    raw = tiny_config(root, "run", train={"max_steps": 2, "valid_every": 1, "keep_last": 2})
    run = train(from_dict(raw), quiet=True)
    tiny = write_config(root / "tiny.yaml", raw)
    (root / "same.txt").write_text("ein hund\nzwei katzen\n", encoding="utf-8")
    (run / "eval").mkdir()  # what the end of training writes (train.finish is off in tiny configs)
    (run / "eval" / "test.final.hyp").write_text("the final translations\n", encoding="utf-8")
    shutil.copy(run / "last.pt", root / "copy.pt")  # a training checkpoint outside its run directory
    save_checkpoint(average_checkpoints([run / "step_00000001.pt", run / "step_00000002.pt"]), root / "avg.pt")
    (root / "user").mkdir()  # someone's own directory
    (root / "user" / "notes.txt").write_text("mine\n")
    (root / "user" / "config.yaml").write_text("# my own config, with comments\ntrain: {}\n")
    (root / "afile").write_text("a file\n")
    (root / "walk.gif").write_bytes(b"GIF89a someone's")
    weights_run = root / "weights_run"  # a run whose last.pt was replaced by an average
    weights_run.mkdir()
    shutil.copy(run / "config.yaml", weights_run / "config.yaml")
    shutil.copy(root / "avg.pt", weights_run / "last.pt")
    for name in ("lost_last", "torn_last"):  # a run whose last.pt was deleted, or torn
        (root / name).mkdir()
        for f in ("config.yaml", "best.pt", "step_00000001.pt", "step_00000002.pt"):
            shutil.copy(run / f, root / name / f)
    shutil.copy(root / "avg.pt", root / "lost_last" / "averaged.pt")  # what the end of training writes
    (root / "only_average").mkdir()  # nothing with training state to continue from
    shutil.copy(run / "config.yaml", root / "only_average" / "config.yaml")
    for name in ("averaged.pt", "final.pt"):
        shutil.copy(root / "avg.pt", root / "only_average" / name)
    (root / "torn_last" / "last.pt").write_bytes((run / "last.pt").read_bytes()[:5000])
    other_version = root / "other_version"  # last.pt's counters as another version of transformer writes them
    other_version.mkdir()
    shutil.copy(run / "config.yaml", other_version / "config.yaml")
    state = load_checkpoint(run / "last.pt")
    del state["run"]["tokens"]
    state["run"]["ema_decay"] = 0.999
    save_checkpoint(state, other_version / "last.pt")
    (root / "bomb.yaml").write_text(alias_bomb())
    (root / "self.yaml").write_text("model: &a [*a]\n")
    (root / "nan.yaml").write_text("decode:\n  lenpen: .nan\n")
    (root / "spm_corrupt").mkdir()
    (root / "spm_corrupt" / "spm.model").write_bytes(b"\x00garbage" * 50)
    (root / "spm_big").mkdir()  # a reused spm.model of 64 pieces where data.vocab_size is now 32
    shutil.copy(run / "spm.model", root / "spm_big" / "spm.model")
    return {"root": root, "run": run, "tiny": tiny}


@dataclass
class Case:
    name: str
    argv: Callable[[Path, Path], list]  # (root, run) -> arguments
    message: str  # in the one line, after "error: "; {root} and {run} filled in
    status: int = 2
    after: Callable[[Path, Path], None] | None = None  # what must still hold afterwards


def _untouched(root: Path, run: Path) -> None:
    assert (root / "same.txt").read_text() == "ein hund\nzwei katzen\n"
    assert load_checkpoint(run / "last.pt")["run"]["step"] == 2 and "optimizer" in load_checkpoint(run / "last.pt")
    assert "optimizer" in load_checkpoint(root / "copy.pt") and "model" in load_checkpoint(root / "avg.pt")
    assert (root / "user" / "notes.txt").read_text() == "mine\n"
    assert (root / "user" / "config.yaml").read_text().startswith("# my own config")
    assert sorted(p.name for p in (root / "user").iterdir()) == ["config.yaml", "notes.txt"]


def _no_image_beside(root: Path) -> None:
    assert not list(root.glob("*.png")) and not (root / "newdir").exists()


def _their_gif_kept(root: Path, run: Path) -> None:
    assert (root / "walk.gif").read_bytes() == b"GIF89a someone's"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")]


def _final_hyp_kept(run: Path) -> None:
    assert (run / "eval" / "test.final.hyp").read_text(encoding="utf-8") == "the final translations\n"


def _nothing_started(run_dir: Path) -> None:
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "spm.model").exists()
    assert "optimizer" not in load_checkpoint(run_dir / "last.pt")  # left as it was


def _left_as_it_was(run_dir: Path) -> None:
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "spm.model").exists()
    assert load_checkpoint(run_dir / "last.pt")["run"]["ema_decay"] == 0.999


def _checkpoints_kept(run_dir: Path) -> None:
    """Nothing started over the checkpoints (a run starting from step 0 would write over them)."""
    assert load_checkpoint(run_dir / "step_00000002.pt")["run"]["step"] == 2
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "store").exists()


def _no_run_started(run_dir: Path) -> None:
    assert not run_dir.exists()


def _train(*sets: str, config: str = "{tiny}"):
    return lambda root, run: [
        "train",
        config.format(tiny=root / "tiny.yaml"),
        *[w for s in sets for w in ("--set", s.format(root=root))],
    ]


BIG = 10**14
CASES = [
    # Outputs never overwrite an input or a checkpoint (issue 11, items 1-3).
    Case(
        "translate output is its input",
        lambda r, run: ["translate", run, "--input", r / "same.txt", "--output", r / "same.txt"],
        "translate: the output {root}/same.txt is also an input ({root}/same.txt); write to another file",
    ),
    Case(
        "translate over its own checkpoint",
        lambda r, run: ["translate", run / "best.pt", "Ein Hund.", "--output", run / "best.pt"],
        "translate: the output {run}/best.pt is also an input",
    ),
    Case(
        "translate over a run's last.pt",
        lambda r, run: ["translate", run, "x", "--output", run / "last.pt"],
        "translate: refusing to overwrite {run}/last.pt: it belongs to the training run in {run}",
    ),
    Case(
        "translate over a training checkpoint",
        lambda r, run: ["translate", run, "x", "--output", r / "copy.pt"],
        "translate: refusing to overwrite {root}/copy.pt: it is a training checkpoint (what --resume needs)",
    ),
    Case(
        "translate over an averaged checkpoint",
        lambda r, run: ["translate", run, "x", "--output", r / "avg.pt"],
        "translate: refusing to overwrite {root}/avg.pt: it is a checkpoint; write to another file",
    ),
    Case(
        "average over last.pt",
        lambda r, run: ["average", run / "step_00000001.pt", run / "step_00000002.pt", "--output", run / "last.pt"],
        "average: refusing to overwrite {run}/last.pt: it belongs to the training run in {run}",
    ),
    Case(
        "average over a training checkpoint",
        lambda r, run: ["average", run / "step_00000001.pt", run / "step_00000002.pt", "--output", r / "copy.pt"],
        "average: refusing to overwrite {root}/copy.pt: it is a training checkpoint",
    ),
    # An image path that is a directory is no file name: never a sibling DIR.png instead.
    Case(
        "plot into a directory",
        lambda r, run: ["plot", run, "--out", f"{r}/user/"],
        "plot: the output {root}/user/ is a directory; give a file name",
        after=lambda r, run: _no_image_beside(r),
    ),
    Case(
        "plot into a new directory",
        lambda r, run: ["plot", run, "--out", f"{r}/newdir/"],
        "plot: the output {root}/newdir/ names a directory; give a file name",
        after=lambda r, run: _no_image_beside(r),
    ),
    Case(
        "plot-positions into a directory",
        lambda r, run: ["plot-positions", "--out", r / "user"],
        "plot-positions: the output {root}/user is a directory",
        after=lambda r, run: _no_image_beside(r),
    ),
    Case(
        "animate over an existing file",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "walk.gif"],
        "animate: {root}/walk.gif exists; add --force to replace it",
        after=_their_gif_kept,
    ),
    Case(
        "animate over a checkpoint",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "copy.pt", "--force"],
        "animate: cannot write {root}/copy.pt: give FILE.gif, FILE.mp4, or a folder name for PNG frames",
    ),
    Case(
        "animate into someone's folder",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "user", "--force"],
        "animate: {root}/user holds files that are not an animation's frames (",
    ),
    Case(
        "animate a layer the model lacks",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "w.gif", "--layer", "2"],
        "--layer 2 is out of range: the encoder has 1 layer, numbered 1..1",
        after=_their_gif_kept,
    ),
    Case(
        "animate a head the model lacks",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "w.gif", "--head", "0"],
        "--head 0 is out of range: the encoder has 2 heads, numbered 1..2",
    ),
    Case(
        "animate nothing",
        lambda r, run: ["animate", run, " ", "--out", r / "w.gif"],
        "animate: the source sentence is empty; give a sentence to animate",
    ),
    Case(
        "animate too fast",
        lambda r, run: ["animate", run, "ein hund", "--out", r / "w.gif", "--fps", "100"],
        "animate: --fps must be between 0.1 and 50, got 100",
    ),
    Case(
        "attention into a directory",
        lambda r, run: ["attention", run, "x", "--out", r / "user"],
        "attention: the output {root}/user is a directory",
        after=lambda r, run: _no_image_beside(r),
    ),
    # Nor any file of a run below its top level: the store, the end of training's test translations.
    Case(
        "average over the store's manifest",
        lambda r, run: ["average", run, "--last", "2", "--output", run / "store" / "manifest.json"],
        "average: refusing to overwrite {run}/store/manifest.json: it belongs to the training run in {run}",
        after=lambda r, run: json.loads((run / "store" / "manifest.json").read_text()),
    ),
    Case(
        "translate over the final test translations",
        lambda r, run: ["translate", run, "--input", r / "same.txt", "--output", run / "eval" / "test.final.hyp"],
        "translate: refusing to overwrite {run}/eval/test.final.hyp: it belongs to the training run in {run}",
        after=lambda r, run: _final_hyp_kept(run),
    ),
    # The run directory (item 4) and resume (items 8, 9).
    Case(
        "run_dir empty",
        _train('train.run_dir=""'),
        "config: train.run_dir must name a directory for the run (it is empty)",
    ),
    Case(
        "run_dir someone's directory",
        _train("train.run_dir={root}/user"),
        "train.run_dir {root}/user holds files that are not a run's (config.yaml, notes.txt); a new run needs a "
        "new or empty directory: set train.run_dir",
    ),
    Case(
        "fp16 on a CPU",
        _train("train.precision=fp16", "train.run_dir={root}/fp16", "train.device=cpu"),
        "train.precision 'fp16' needs CUDA; use 'bf16' or 'fp32' on CPU",
        after=lambda r, run: _no_run_started(r / "fp16"),
    ),  # refused before a vocabulary or a store is built
    Case(
        "run_dir a file", _train("train.run_dir={root}/afile"), "train.run_dir {root}/afile is a file, not a directory"
    ),
    Case(
        "run_dir inside a file",
        _train("train.run_dir={root}/afile/run"),
        "train.run_dir {root}/afile/run: cannot create it (Not a directory)",
    ),
    Case(
        "new run over a run without last.pt",
        _train("train.run_dir={root}/lost_last"),
        "train.run_dir {root}/lost_last holds checkpoints (averaged.pt, best.pt, step_00000001.pt and 1 more) but "
        "no last.pt; add --resume to continue from step_00000002.pt; to start a new run, set train.run_dir to a "
        "new directory",
        after=lambda r, run: _checkpoints_kept(r / "lost_last"),
    ),
    Case(
        "resume with only an average",
        lambda r, run: ["train", "--resume", r / "only_average"],
        "train.run_dir {root}/only_average holds checkpoints (averaged.pt, final.pt) but no last.pt; to start a new "
        "run, set train.run_dir to a new directory",
    ),
    Case(
        "resume a torn last.pt",
        lambda r, run: ["train", "--resume", r / "torn_last"],
        "checkpoint: {root}/torn_last/last.pt is not a checkpoint, or is truncated or corrupt; to continue from "
        "step_00000002.pt instead: cp {root}/torn_last/step_00000002.pt {root}/torn_last/last.pt",
        after=lambda r, run: _checkpoints_kept(r / "torn_last"),
    ),
    Case(
        "resume weights only",
        lambda r, run: ["train", "--resume", r / "weights_run"],
        "resume: {root}/weights_run/last.pt cannot be resumed: it holds weights only, as `transformer average` "
        "writes (no optimizer, scaler, rng, run); put the run's own last.pt back, or start a new run "
        "in another train.run_dir",
        after=lambda r, run: _nothing_started(r / "weights_run"),
    ),
    Case(
        "resume another version's checkpoint",
        lambda r, run: ["train", "--resume", r / "other_version"],
        "resume: {root}/other_version/last.pt cannot be resumed by this version of transformer: its run "
        "counters differ (unknown: ema_decay; missing: tokens); resume with the version that wrote it, or start "
        "a new run in another train.run_dir",
        after=lambda r, run: _left_as_it_was(r / "other_version"),
    ),
    Case(
        "resume a directory that is no run",
        lambda r, run: ["train", "--resume", r],
        "train --resume: {root} holds no config.yaml, so it is not a run directory (start a run there with: "
        "transformer train CONFIG --set train.run_dir={root})",
    ),
    Case(
        "resume someone's directory",
        lambda r, run: ["train", "--resume", r / "user"],
        "train.run_dir {root}/user holds files that are not a run's (config.yaml, notes.txt)",
    ),
    Case(
        "resume a missing directory",
        lambda r, run: ["train", "--resume", r / "nowhere"],
        "train --resume: no such run directory: {root}/nowhere",
    ),
    Case(
        "resume moved by --set",
        lambda r, run: ["train", "--resume", run, "--set", "train.run_dir=x"],
        "train: --resume {run} continues the run in {run}; --set train.run_dir cannot move it",
    ),
    Case(
        "config and run directory",
        lambda r, run: ["train", r / "tiny.yaml", "--resume", run],
        "train: give CONFIG --resume (the run in the config's train.run_dir) or --resume RUN_DIR",
    ),
    Case("no config", lambda r, run: ["train"], "train: give a config file, or --resume RUN_DIR to continue a run"),
    # Numbers the libraries below cannot take.
    Case(
        "seed negative",
        _train("train.seed=-1"),
        "config: train.seed must be in [0, 4294967295] (SentencePiece and NumPy take 32-bit seeds), got -1",
    ),
    Case("seed 2^32", _train("train.seed=4294967296"), "config: train.seed must be in [0, 4294967295]"),
    Case(
        "seed past int64",
        _train("train.seed=18446744073709551616"),
        "config: train.seed is out of range: 18446744073709551616 (at most 2^63 - 1 in size)",
    ),
    Case(
        "spm_max_sentences negative",
        _train("data.spm_max_sentences=-1"),
        "config: data.spm_max_sentences must not be negative (0 = every sentence)",
    ),
    Case(
        "vocab_size past int32",
        _train("data.vocab_size=2147483648"),
        "config: data.vocab_size must be in [8, 2147483647] (SentencePiece's range)",
    ),
    Case(
        "d_model in the trillions",
        _train("model.d_model=1000000000000", "model.n_heads=1", "train.run_dir={root}/r_dmodel"),
        "GiB of weights do not fit in this machine's",
    ),
    Case(
        "max_positions in the trillions",
        _train(f"model.max_positions={BIG}", "train.run_dir={root}/r_maxpos"),
        f"the largest part is the positions table (model.max_positions {BIG} x model.d_model 32)",
    ),
    Case("d_model past int64", _train("model.d_model=100000000000000000000"), "config: model.d_model is out of range"),
    Case(
        "lenpen nan in a config",
        lambda r, run: ["train", r / "nan.yaml"],
        "config: decode.lenpen must be a finite number, got nan",
    ),
    # A beam wider than the vocabulary is refused before searching: one in the millions took all memory.
    Case(
        "beam in the trillions",
        lambda r, run: ["translate", run, "ein hund", "--beam", BIG],
        "beam must be at most the vocabulary size (",
    ),
    Case(
        "beam above the vocabulary",
        lambda r, run: ["translate", run, "ein hund", "--beam", 2_000_000],
        "pieces), got 2000000",
    ),
    Case(
        "attention beam above the vocabulary",
        lambda r, run: ["attention", run, "ein hund", "--beam", 2_000_000, "--out", r / "a.png"],
        "beam must be at most the vocabulary size (",
    ),
    Case(
        "lenpen nan",
        lambda r, run: ["translate", run, "x", "--lenpen", "nan"],
        "--lenpen must be a number from 0 to 10 (the GNMT length penalty's alpha; the paper's is 0.6), got nan",
    ),
    Case(
        "evaluate lenpen -inf",
        lambda r, run: ["evaluate", run, "--lenpen=-inf"],
        "--lenpen must be a number from 0 to 10 (the GNMT length penalty's alpha; the paper's is 0.6), got -inf",
    ),
    # A length penalty of 400 overflowed a float (OverflowError) from about 30 tokens on: bounded everywhere.
    Case(
        "lenpen 400",
        lambda r, run: ["translate", run, "ein hund " * 20, "--lenpen", "400", "--beam", "2"],
        "--lenpen must be a number from 0 to 10 (the GNMT length penalty's alpha; the paper's is 0.6), got 400.0",
    ),
    Case(
        "evaluate lenpen 400",
        lambda r, run: ["evaluate", run, "--lenpen", "400"],
        "--lenpen must be a number from 0 to 10",
    ),
    Case(
        "serve lenpen 400",
        lambda r, run: ["serve", run, "--lenpen", "400", "--port", "0"],
        "--lenpen must be a number from 0 to 10",
    ),
    Case(
        "lenpen 400 in a config",
        _train("decode.lenpen=400"),
        "config: decode.lenpen must be a number from 0 to 10 (the GNMT length penalty's alpha; the paper's is 0.6), "
        "got 400",
    ),
    Case(
        "a split that is a path in a config",
        _train("data.test_split=../x"),
        "config: data.test_split must be a split's name, such as test or newstest2014 (no path, no '/'), got '../x'",
    ),
    Case(
        "max-tokens 0",
        lambda r, run: ["translate", run, "x", "--max-tokens", "0"],
        "--max-tokens must be at least 1, got 0",
    ),
    Case("workers 0", lambda r, run: ["evaluate", run, "--workers", "0"], "--workers must be at least 1, got 0"),
    Case("serve workers -1", lambda r, run: ["serve", run, "--workers=-1"], "--workers must be at least 1, got -1"),
    Case(
        "attention beam 0",
        lambda r, run: ["attention", run, "x", "--beam", "0", "--out", r / "a.png"],
        "--beam must be at least 1 (1 = greedy), got 0",
    ),
    Case(
        "plot-positions length",
        lambda r, run: ["plot-positions", "--length", BIG, "--out", r / "p.png"],
        f"--length x --d-model is {BIG:,} x 512; the plotted table may hold at most 50,000,000 values",
    ),
    Case(
        "plot-positions d-model",
        lambda r, run: ["plot-positions", "--d-model", BIG, "--out", r / "p.png"],
        f"--length x --d-model is 100 x {BIG:,}",
    ),
    Case(
        "export hf to an empty name",
        lambda r, run: ["export", "hf", run, ""],
        "export: the output directory is an empty name; give the directory to write",
    ),
    Case(
        "export ctranslate2 to an empty name",
        lambda r, run: ["export", "ctranslate2", run, ""],
        "export: the output directory is an empty name; give the directory to write",
    ),
    # Options that contradict each other: neither wins.
    Case(
        "int8 and dtype fp32",
        lambda r, run: ["translate", run, "x", "--int8", "--dtype", "fp32"],
        "--int8 means --dtype int8; it cannot go with --dtype fp32",
    ),
    Case(
        "dtype bf16 and int8",
        lambda r, run: ["evaluate", run, "--dtype", "bf16", "--int8"],
        "--int8 means --dtype int8; it cannot go with --dtype bf16",
    ),
    # Configs that are not files, or are bombs.
    Case(
        "alias bomb",
        lambda r, run: ["train", r / "bomb.yaml"],
        "config: {root}/bomb.yaml: YAML aliases expand it to 926,177,115 values (at most 10,000); write the "
        "values out instead of nesting aliases",
    ),
    Case(
        "alias bomb in --set",
        _train(
            "model.d_model=[&a [1,1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a],"
            " &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]]"
        ),
        "config: --set model.d_model: YAML aliases expand it to",
    ),
    Case(
        "alias to itself",
        lambda r, run: ["train", r / "self.yaml"],
        "config: {root}/self.yaml: a YAML alias refers to the value that contains it",
    ),
    Case("config a directory", lambda r, run: ["train", r], "config: {root} is a directory, not a YAML file"),
    Case(
        "config endless",
        lambda r, run: ["train", "/dev/zero"],
        "config: /dev/zero is larger than 1 MiB; that is not a config",
    ),
    # The vocabulary and the disk.
    Case(
        "corrupt spm.model",
        _train("train.run_dir={root}/spm_corrupt"),
        "vocab: {root}/spm_corrupt/spm.model: not a valid SentencePiece model (",
    ),
    Case(
        "reused spm.model larger than vocab_size",
        _train("train.run_dir={root}/spm_big", "data.vocab_size=32"),
        "vocab: {root}/spm_big/spm.model has 64 pieces but data.vocab_size is 32; delete it to train a new "
        "vocabulary, or set data.vocab_size to 64",
    ),
    Case(
        "full disk",
        lambda r, run: ["translate", run, "ein hund", "--output", "/dev/full"],
        "/dev/full: No space left on device",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_line_and_loses_nothing(env, case, call):
    root, run = env["root"], env["run"]
    status, _, err = call(*case.argv(root, run))
    lines = err.strip().splitlines()
    assert status == case.status, err
    assert "Traceback" not in err
    # train logs its progress before it finds some problems; the error is always the last line, and alone.
    assert lines and lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, err
    assert case.message.format(root=root, run=run) in lines[-1]
    _untouched(root, run)
    if case.after is not None:
        case.after(root, run)


def test_cuda_asked_for_without_one_names_the_setting(env, monkeypatch, call):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    root, run = env["root"], env["run"]
    status, _, err = call(*_train("train.device=cuda", "train.run_dir={root}/on_cuda")(root, run))
    assert (status, err) == (2, "error: train.device is 'cuda' but no CUDA device is available\n")
    assert not (root / "on_cuda").exists()
    status, _, err = call("translate", run, "--device", "cuda", "ein hund")
    assert (status, err) == (2, "error: --device is 'cuda' but no CUDA device is available\n")


def test_resume_without_last_pt_continues_from_the_newest_step_checkpoint(env, tmp_path, call):
    """What a kill at the first validation leaves (step checkpoint written, last.pt not yet): --resume continues
    from it exactly as from a last.pt holding the same state, instead of starting over at step 0."""
    lost, kept = tmp_path / "lost", tmp_path / "kept"
    for d in (lost, kept):
        shutil.copytree(env["root"] / "lost_last", d)
    shutil.copy(kept / "step_00000002.pt", kept / "last.pt")
    outputs, logs = {}, {}
    for d in (lost, kept):
        status, _, logs[d] = call("train", "--resume", d, "--set", "train.max_steps=3")
        assert status == 0, logs[d]
        outputs[d] = load_checkpoint(d / "last.pt")
    assert f"resume: {lost}/last.pt is missing; continuing from step_00000002.pt" in logs[lost]
    assert "is missing" not in logs[kept]
    assert outputs[lost]["run"]["step"] == outputs[kept]["run"]["step"] == 3
    for name, weight in outputs[kept]["model"].items():
        assert torch.equal(outputs[lost]["model"][name], weight), name


def test_resume_without_last_pt_and_nothing_left_to_train_puts_it_back(env, tmp_path, call):
    """Killed at the last validation after the step checkpoint: nothing is left to train, so no later save
    would write last.pt (which finish and every later resume need), nor best.pt if that step was the best."""
    lost = tmp_path / "lost"
    shutil.copytree(env["root"] / "lost_last", lost)
    (lost / "best.pt").unlink()
    status, _, err = call("train", "--resume", lost)
    assert status == 0, err
    saved = load_checkpoint(lost / "step_00000002.pt")
    assert load_checkpoint(lost / "last.pt")["run"] == saved["run"]
    assert (lost / "best.pt").exists() == (saved["run"]["bad_validations"] == 0)
    assert "resume: step_00000002.pt copied to last.pt" in err


def test_prepare_works_in_a_run_directory_that_resume_can_continue(env, tmp_path, call):
    """prepare starts no run, and has no --resume to be told about."""
    lost = tmp_path / "lost"
    shutil.copytree(env["root"] / "lost_last", lost)
    status, _, err = call("prepare", env["root"] / "tiny.yaml", "--set", f"train.run_dir={lost}")
    assert status == 0, err
    assert (lost / "store" / "manifest.json").is_file() and not (lost / "last.pt").exists()


def test_average_may_replace_an_earlier_average(env, call):
    root, run = env["root"], env["run"]
    target = root / "again.pt"
    for _ in range(2):
        status, _, err = call("average", run, "--last", "2", "--output", target)
        assert status == 0, err
    assert "optimizer" not in load_checkpoint(target)


def test_resume_with_an_empty_config_yaml_is_refused_not_compared_with_defaults(env, tmp_path, call):
    """An emptied config.yaml under `--resume RUN_DIR` was read as all defaults, and refused as a model change
    (d_model 32 -> 512) or, worse, resumed with default settings."""
    run_dir = tmp_path / "run"
    shutil.copytree(env["run"], run_dir)
    for text in ("", "# nothing but a comment\n", "{}\n"):
        (run_dir / "config.yaml").write_text(text, encoding="utf-8")
        status, _, err = call("train", "--resume", run_dir)
        assert (status, err) == (
            2,
            f"error: train --resume: {run_dir}/config.yaml is empty, so the run's settings "
            "are not known; restore it (transformer train writes it), or resume with the "
            "config the run was started with: transformer train CONFIG --set "
            f"train.run_dir={run_dir} --resume\n",
        )


def test_evaluate_split_never_reads_or_writes_outside_the_run(env, call):
    """`evaluate --split ../x` read DATA_DIR/../x.{de,en} and wrote RUN/eval/../x.*.hyp and .json into the run
    directory itself (`--split ../../x`: anywhere)."""
    root, run = env["root"], env["run"]
    for side in ("de", "en"):  # beside data.dir (root/corpus): what ../outside reaches
        (root / f"outside.{side}").write_text("ein hund\n", encoding="utf-8")
    before = sorted(p.name for p in run.rglob("*"))
    try:
        for split in ("../outside", "a/b", ".."):
            status, _, err = call("evaluate", run, "--split", split)
            assert (status, err) == (
                2,
                f"error: evaluate: --split must be a split's name, such as test or "
                f"newstest2014 (no path, no '/'), got {split!r}; for other files pass --src "
                "FILE --ref FILE\n",
            )
        assert sorted(p.name for p in run.rglob("*")) == before
    finally:
        for side in ("de", "en"):
            (root / f"outside.{side}").unlink()
