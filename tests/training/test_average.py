"""Checkpoint averaging: the mean of the weights, a checkpoint translate loads, RUN_DIR --last N."""

import lzma
import os

import pytest
import torch

from tests.helpers import OLD_RUN, SENTENCES, sentences
from transformer.config import from_dict, to_dict
from transformer.data.vocab import train_vocab
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint, load_model, save_checkpoint
from transformer.training.average import average_checkpoints


def test_average_two_files_is_the_mean_and_loads(run, tmp_path, call):
    a, b = run / "step_00000100.pt", run / "step_00000200.pt"
    status, _, _ = call("average", a, b, "--output", tmp_path / "avg.pt")
    assert status == 0
    avg = torch.load(tmp_path / "avg.pt", weights_only=True)
    wa, wb = (torch.load(p, weights_only=True)["model"] for p in (a, b))
    assert avg["model"].keys() == wa.keys()
    for k in wa:
        torch.testing.assert_close(avg["model"][k], (wa[k] + wb[k]) / 2)
    assert "optimizer" not in avg
    load_model(tmp_path / "avg.pt")
    status, out, _ = call("translate", tmp_path / "avg.pt", SENTENCES[0])
    assert status == 0 and len(out.splitlines()) == 1


def test_average_last_n_of_run_dir(run, call):
    status, out, _ = call("average", run, "--last", "2")
    assert status == 0 and (run / "averaged.pt").is_file()
    assert out.startswith("averaged 2 checkpoints (step_")
    status, out, _ = call("average", run, "--last", "1", "--output", run.parent / "one.pt")
    assert status == 0 and out.startswith("averaged 1 checkpoint (step_") and ".pt: its weights alone) into" in out
    status, _, err = call("average", run, "--last", "3")
    assert status == 2 and "holds 2" in err


def test_average_records_the_step_of_the_last_input(run, tmp_path):
    paths = []
    for step, name in ((200, "step_00000200.pt"), (100, "step_00000100.pt")):  # the order given counts
        state = load_checkpoint(run / name)
        state["run"] = {"step": step}
        save_checkpoint(state, tmp_path / name)
        paths.append(tmp_path / name)
    assert average_checkpoints(paths)["averaged_at_step"] == 100
    assert "averaged_at_step" not in average_checkpoints([run / "step_00000100.pt", run / "step_00000200.pt"])


def test_the_mean_of_three_and_the_newest_two_of_three(run, tmp_path, call):
    # Weights 1, 2 and 4 everywhere: a mean of all three is 7/3, of the newest two 3.
    base = load_checkpoint(run / "step_00000100.pt")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for step, value in ((5, 1.0), (10, 2.0), (40, 4.0)):
        state = dict(base, model={k: torch.full_like(v, value) for k, v in base["model"].items()})
        save_checkpoint(state, run_dir / f"step_{step:08d}.pt")
    three = average_checkpoints(sorted(run_dir.glob("step_*.pt")))["model"]
    assert all(torch.allclose(v, torch.full_like(v, 7 / 3)) for v in three.values())
    status, _, _ = call("average", run_dir, "--last", "2")
    assert status == 0
    newest_two = torch.load(run_dir / "averaged.pt", weights_only=True)["model"]
    assert all(torch.equal(v, torch.full_like(v, 3.0)) for v in newest_two.values())


def test_last_zero_is_refused_not_every_checkpoint(run, call):
    """found[-0:] is the whole list: without the check, --last 0 would average every step checkpoint."""
    target = run / "averaged.pt"
    before = target.stat().st_mtime_ns if target.exists() else None  # the run is shared with other tests
    status, _, err = call("average", run, "--last", "0")
    assert (status, err) == (2, "error: average: --last must be at least 1\n")
    assert (target.stat().st_mtime_ns if target.exists() else None) == before


def test_checkpoints_with_other_vocabularies_are_not_averaged(run, tmp_path):
    state = torch.load(run / "step_00000100.pt", weights_only=True)
    other = dict(state, vocab=train_vocab(sentences(9, 300), vocab_size=80).proto)  # same config and shapes
    save_checkpoint(other, tmp_path / "other.pt")
    with pytest.raises(UserError, match="use different vocabularies"):
        average_checkpoints([run / "step_00000100.pt", tmp_path / "other.pt"])


def test_a_pytorch_file_that_is_no_checkpoint_is_not_overwritten(run, tmp_path, call):
    """A whole pickled module (what torch.save(model) writes) cannot be read as weights only; it is someone's
    file all the same, not an earlier average to replace."""
    target = tmp_path / "model.pt"
    torch.save(torch.nn.Linear(2, 2), target)
    before = target.read_bytes()
    status, _, err = call("average", run / "step_00000100.pt", run / "step_00000200.pt", "--output", target)
    assert status == 2 and f"refusing to overwrite {target}: it is a checkpoint" in err
    assert target.read_bytes() == before


def test_the_same_checkpoint_named_twice_is_refused(run, tmp_path, call):
    a, b = run / "step_00000100.pt", run / "step_00000200.pt"
    (tmp_path / "link.pt").symlink_to(a)
    for inputs in ((a, b, a), (a, tmp_path / "link.pt")):
        status, _, err = call("average", *inputs, "--output", tmp_path / "avg.pt")
        assert status == 2 and "named twice" in err and "counts once" in err, err
        assert not (tmp_path / "avg.pt").exists()


def test_a_hard_link_or_a_copy_of_the_same_weights_is_refused(run, tmp_path, call):
    a, b = run / "step_00000100.pt", run / "step_00000200.pt"
    os.link(a, tmp_path / "hard.pt")
    state = load_checkpoint(a)
    state["run"] = {"step": 100, "note": "a copy saved elsewhere"}  # other bytes, the same weights
    save_checkpoint(state, tmp_path / "copy.pt")
    status, _, err = call("average", a, b, tmp_path / "hard.pt", "--output", tmp_path / "avg.pt")
    assert status == 2 and "are the same file" in err, err
    status, _, err = call("average", a, b, tmp_path / "copy.pt", "--output", tmp_path / "avg.pt")
    assert status == 2 and f"{a} and {tmp_path / 'copy.pt'} hold the same weights" in err, err
    assert not (tmp_path / "avg.pt").exists()


def test_a_checkpoint_of_an_older_revision_averages_with_todays(tmp_path, call):
    """A run resumed across revisions holds step checkpoints whose configs were written with other keys (the old
    fixture's lacks positions, activation, output_bias and layer_norm_eps): they mean the same model, so they average;
    a setting that really differs is still named."""
    old = tmp_path / "run" / "step_00000004.pt"
    old.parent.mkdir()
    old.write_bytes(lzma.decompress((OLD_RUN / "last.pt.xz").read_bytes()))
    state = load_checkpoint(old)
    assert "layer_norm_eps" not in state["config"]["model"]
    today = {**state, "config": to_dict(from_dict(state["config"]))}  # as today's code writes it
    today["model"] = {k: v + 1.0 if v.is_floating_point() else v for k, v in state["model"].items()}
    save_checkpoint(today, tmp_path / "run" / "step_00000008.pt")
    averaged = average_checkpoints([old, tmp_path / "run" / "step_00000008.pt"])
    key = "encoder_layers.0.ffn.fc1.weight"
    torch.testing.assert_close(averaged["model"][key], state["model"][key] + 0.5)
    assert call("average", "--last", "2", tmp_path / "run", "--out", tmp_path / "avg.pt")[0] == 0
    other = {**today, "config": {**today["config"], "model": {**today["config"]["model"], "norm": "pre"}}}
    save_checkpoint(other, tmp_path / "other.pt")
    with pytest.raises(UserError, match=r"different model configs \(differing: norm\)"):
        average_checkpoints([old, tmp_path / "other.pt"])
