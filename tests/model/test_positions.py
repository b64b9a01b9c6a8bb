"""Positions behind one interface (model/positions.py): every reader gets the same table, the config admits only
the kinds positions.py knows, and a checkpoint written before model.positions existed loads as sinusoidal and
translates exactly as it did then."""

from __future__ import annotations

import ast
import lzma
import pickletools
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers import ROOT, tiny_config
from transformer.config import from_dict, to_dict
from transformer.errors import UserError
from transformer.model import positions
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.model.transformer import Transformer
from transformer.training.run_state import load_resumable

OLD_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "old_run"


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory) -> Path:
    """last.pt of a 4-step run trained by the code before issue 34's layout (tests/fixtures/make_old_run.py)."""
    path = tmp_path_factory.mktemp("old_run") / "last.pt"
    path.write_bytes(lzma.decompress((OLD_RUN / "last.pt.xz").read_bytes()))
    return path


def test_the_config_admits_only_known_kinds_and_defaults_to_sinusoidal(tmp_path):
    cfg = tiny_config(tmp_path)
    assert from_dict(cfg).model.positions == "sinusoidal"
    cfg["model"]["positions"] = "rotary"
    with pytest.raises(UserError, match="model.positions.*'sinusoidal'"):
        from_dict(cfg)


def test_every_reader_gets_the_same_table(tmp_path):
    cfg = from_dict(tiny_config(tmp_path, model={"max_positions": 24}))
    model = Transformer(cfg.model, 50)
    expected = positions.sinusoid_table(cfg.model.d_model, 24)
    assert torch.equal(model.positions(24), expected)
    assert torch.equal(model.positions(5, offset=3), expected[3:8])
    assert torch.equal(positions.table("sinusoidal", cfg.model.d_model, 24), expected)
    assert np.array_equal(positions.ctranslate2_encodings(model), expected.numpy())
    # the paper's formula, spelled out once more: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    pos, i, d = 7, 3, cfg.model.d_model
    assert expected[pos, 2 * i].item() == pytest.approx(np.sin(pos / 10000 ** (2 * i / d)), abs=1e-6)
    assert expected[pos, 2 * i + 1].item() == pytest.approx(np.cos(pos / 10000 ** (2 * i / d)), abs=1e-6)
    with pytest.raises(UserError, match="model.positions 'learned'"):
        positions.table("learned", 8, 4)


def test_only_positions_py_builds_or_reads_the_table():
    """A new kind must not have to chase readers: outside model/positions.py nothing in the package names the
    sinusoid table or the embedding's `.positions.table`."""
    offenders = []
    for path in sorted((ROOT / "transformer").rglob("*.py")):
        if path.name == "positions.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name in ("sinusoid_table", "PositionalEncoding") or (
                isinstance(node, ast.Attribute)
                and node.attr == "table"
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "positions"
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_a_checkpoint_holds_no_class_paths(old_checkpoint):
    """Checkpoints are plain containers of tensors: moving a module can never break loading one."""
    with zipfile.ZipFile(old_checkpoint) as z:
        pickle = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    ops = list(pickletools.genops(pickle))
    globals_ = {arg for op, arg, _ in ops if op.name in ("GLOBAL", "INST")}
    globals_ |= {f"{ops[k - 2][1]} {ops[k - 1][1]}" for k, (op, _, _) in enumerate(ops) if op.name == "STACK_GLOBAL"}
    assert globals_ and all(g.split()[0] in ("torch", "torch._utils", "collections", "_codecs") for g in globals_), (
        globals_
    )
    torch.load(old_checkpoint, weights_only=True)


def test_a_checkpoint_from_before_the_layout_loads_resumes_and_translates_as_then(old_checkpoint, call):
    state = load_checkpoint(old_checkpoint)
    assert "positions" not in state["config"]["model"]  # written before the key existed
    model, vocab, cfg = model_from_checkpoint(state)
    assert cfg.model.positions == "sinusoidal" and to_dict(cfg)["model"]["positions"] == "sinusoidal"
    assert load_resumable(old_checkpoint)["run"]["step"] == 4
    status, out, err = call(
        "translate",
        old_checkpoint,
        "--beam",
        "3",
        "--nbest",
        "2",
        "--dtype",
        "fp32",
        "--device",
        "cpu",
        stdin="der mann hund\ndie frau\n",
    )
    assert status == 0, err
    # What the code before the relayout printed for the same command (scores to 4 decimals).
    assert out == (
        "-25.3851\tooooooooooooooooooooooooooooooo\n-25.4802\to chooooooooooooooooooooooooooooo\n"
        "-25.3854\tooooooooooooooooooooooooooooooo\n-25.4805\to chooooooooooooooooooooooooooooo\n"
    )
