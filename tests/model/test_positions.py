"""Positions behind one interface (model/positions.py): each kind (sinusoidal, marian, learned, rotary) does what
it says and shows what it has; every reader gets it through the interface and nothing outside positions.py and
config.py reads a kind, so that a new kind is those 2 files (a stand-in kind proves it); a checkpoint written before
model.positions existed loads as sinusoidal and translates exactly as it did then. What each reader does with each
kind is tested with the reader: tests/model/test_kv_cache.py, tests/core/test_config.py (what a kind needs of the
model's shape), tests/inference/test_ctranslate2_engine.py, tests/serve/test_app.py, tests/visualize/test_plots.py,
tests/training/test_init_from.py; each kind through every verb: tests/integration/test_position_kinds.py."""

from __future__ import annotations

import ast
import lzma
import math
import pickletools
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.helpers import OLD_RUN, ROOT, positions_model, random_pairs, tiny_config
from transformer import config as config_module
from transformer.config import POSITION_KINDS, ModelConfig, from_dict, to_dict
from transformer.data.batch import Batch, prepare_sources
from transformer.errors import UserError
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.model import positions
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.model.positions import Sinusoidal
from transformer.training.run_state import load_resumable

INTERFACE = ("transformer/model/positions.py", "transformer/config.py")  # the 2 files a kind of position is


@pytest.fixture(scope="module")
def old_checkpoint(tmp_path_factory) -> Path:
    """last.pt of a 4-step run trained by the code before issue 34's layout (tests/fixtures/make_old_run.py)."""
    path = tmp_path_factory.mktemp("old_run") / "last.pt"
    path.write_bytes(lzma.decompress((OLD_RUN / "last.pt.xz").read_bytes()))
    return path


# --------------------------------------------------------------------------- the config and each kind


def test_the_config_admits_exactly_the_kinds_positions_py_defines(tmp_path):
    assert set(POSITION_KINDS) == set(positions.KINDS)
    cfg = tiny_config(tmp_path)
    assert from_dict(cfg).model.positions == "sinusoidal"
    cfg["model"]["positions"] = "alibi"
    with pytest.raises(UserError, match="model.positions.*'rotary'"):
        from_dict(cfg)


def test_every_reader_gets_the_same_sinusoid_table():
    model = positions_model("sinusoidal")
    table = model.position_encoding.table
    expected = positions.sinusoid_table(32, 40)
    assert torch.equal(table, expected)
    x = torch.zeros(1, 5, 32)
    added, rotation = model.position_encoding(x, "target", offset=3)
    assert torch.equal(added[0], expected[3:8]) and rotation is None
    assert torch.equal(model.position_encoding.view(40).tables["source and target"], expected)
    for side in ("source", "target"):
        assert np.array_equal(model.position_encoding.ctranslate2_encodings(side), expected.numpy())
    assert torch.equal(model.position_encoding.marian_encodings(), expected)
    # the paper's formula, spelled out once more: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    pos, i, d = 7, 3, 32
    assert expected[pos, 2 * i].item() == pytest.approx(np.sin(pos / 10000 ** (2 * i / d)), abs=1e-6)
    assert expected[pos, 2 * i + 1].item() == pytest.approx(np.cos(pos / 10000 ** (2 * i / d)), abs=1e-6)


def test_positional_encoding_formula():
    d = 16
    pe = Sinusoidal(ModelConfig(d_model=d, n_heads=2, max_positions=128))
    table = pe.table
    assert table.shape == (128, d)
    for pos in (0, 1, 7, 100):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)
    x = torch.zeros(1, 3, d)
    added, rotation = pe(x, "target", offset=5)
    torch.testing.assert_close(added[0], table[5:8])
    assert rotation is None
    with pytest.raises(ValueError):
        pe(torch.zeros(1, 10, d), "target", offset=120)
    assert "table" not in pe.state_dict()  # derived, not saved


def test_rotary_scores_depend_on_the_distance_alone_and_nothing_is_added():
    rotary = positions_model("rotary").position_encoding
    x = torch.randn(1, 6, 32)
    added, rotation = rotary(x, "source")
    assert torch.equal(added, x)  # no table
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16)  # (B, H, T, Dh)

    def score(m: int, n: int) -> torch.Tensor:
        return (rotary.rotation(1, m)(q) * rotary.rotation(1, n)(k)).sum(-1)

    torch.testing.assert_close(score(3, 1), score(20, 18), atol=1e-5, rtol=0)  # the same distance
    assert not torch.allclose(score(3, 1), score(3, 2), atol=1e-3)  # another distance
    turned = rotary.rotation(1, 7)(q)
    torch.testing.assert_close(turned.norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    # Su et al.'s pairs: dimensions (0, 1) turn by angle pos * 10000^0 = pos.
    c, s = np.cos(7.0), np.sin(7.0)
    expected = torch.stack([q[..., 0] * c - q[..., 1] * s, q[..., 0] * s + q[..., 1] * c], -1)
    torch.testing.assert_close(turned[..., :2], expected.float(), atol=1e-6, rtol=0)
    assert rotary.state_dict() == {}  # derived, not saved: old checkpoints and averages need nothing new


def test_learned_positions_are_a_trained_table_per_side():
    model = positions_model("learned")
    learned = model.position_encoding
    assert set(model.state_dict()) >= {"position_encoding.source.weight", "position_encoding.target.weight"}
    assert learned.source.weight.shape == (40, 32) and not torch.equal(learned.source.weight, learned.target.weight)
    x = torch.zeros(2, 3, 32)
    assert torch.equal(learned(x, "target", offset=4)[0][1], learned.target.weight[4:7].detach())
    assert torch.equal(learned(x, "source")[0][0], learned.source.weight[:3].detach())
    model.train()
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 4), (3, 6)], vocab=50))
    model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask).sum().backward()
    grads = learned.source.weight.grad, learned.target.weight.grad
    assert all(g is not None and g[:3].abs().sum() > 0 for g in grads)  # trained through both sides
    assert learned.target.weight.grad[7:].abs().sum() == 0  # positions no batch reached stay as they were


# --------------------------------------------------------------------------- the readers: view, plot, exports


@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_each_kind_shows_what_it_has(kind):
    view = positions_model(kind).position_encoding.view(12)
    assert view.kind == kind and view.tables and view.note and view.values
    for table in view.tables.values():
        assert table.shape[0] == 12 and torch.isfinite(table).all()
    assert view.adds_table == (kind != "rotary")
    if kind == "rotary":
        assert "add no table" in view.note and view.tables["cos"].shape == (12, 8)  # d_head 16: 8 pairs
        torch.testing.assert_close(view.tables["cos"][:, 0], torch.cos(torch.arange(12.0)))
    if kind == "learned":
        assert list(view.tables) == ["source", "target"]
        with pytest.raises(UserError, match="learned tables hold 40 positions, not 41"):
            positions_model(kind).position_encoding.view(41)
        with pytest.raises(UserError, match="only a trained model's own"):
            positions_model(kind).position_encoding.view(12, d_model=64)  # another width: no such table


def test_the_hf_export_refuses_what_marian_cannot_express_in_one_line():
    for kind in ("learned", "rotary"):
        with pytest.raises(UserError, match=rf"^export hf: model.positions '{kind}' has no MarianMTModel equivalent"):
            positions_model(kind).position_encoding.marian_order()


# --------------------------------------------------------------------------- a new kind is 2 files


class Unordered(positions.Positions):
    """A stand-in kind that tells no positions apart (a bag of words): the interface's defaults alone."""

    name = "unordered"


@pytest.fixture
def unordered(monkeypatch):
    """Unordered added as a new kind would be: a class in positions.KINDS, its name in config.PositionKind."""
    monkeypatch.setitem(positions.KINDS, Unordered.name, Unordered)
    monkeypatch.setattr(config_module, "PositionKind", typing.Literal[(*POSITION_KINDS, Unordered.name)])
    monkeypatch.setattr(config_module, "POSITION_KINDS", (*POSITION_KINDS, Unordered.name))


def test_a_new_kind_reaches_every_reader_through_the_interface(unordered, tmp_path):
    """The model and its KV cache, the Hugging Face export, the plot, serve's view and the CTranslate2 export (the
    last three from optional extras, imported here so that this file runs without them)."""
    model = positions_model("unordered")
    assert isinstance(model.position_encoding, Unordered)
    src, _ = prepare_sources([[5, 9, 13], [21, 4]], 40)
    with torch.no_grad():
        cached = search(model, src, SearchSettings(beam=2, max_len_offset=4), use_cache=True).best()
        full = search(model, src, SearchSettings(beam=2, max_len_offset=4), use_cache=False).best()
    assert [h.tokens for h in cached] == [h.tokens for h in full]
    with pytest.raises(UserError, match="^export hf: model.positions 'unordered' has no MarianMTModel equivalent"):
        model.position_encoding.marian_order()
    pytest.importorskip("matplotlib")
    from transformer.visualize.plots import positional_encoding

    figure = positional_encoding(32, 5, kind="unordered")
    assert "has none to show" in figure.texts[0].get_text()
    pytest.importorskip("fastapi")
    from transformer.serve.service import Service

    got = Service.position_view(SimpleNamespace(model=model), 32, 5)
    assert got["table"] is None and got["tables"] == {} and "has none to show" in got["note"]
    pytest.importorskip("ctranslate2")
    from transformer.inference.ctranslate2_export import build_spec

    with pytest.raises(UserError, match="^export ctranslate2: model.positions 'unordered' has no CTranslate2"):
        build_spec(model, [f"p{i}" for i in range(50)])


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, nodes)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_no_module_outside_the_interface_reads_a_kind_of_position():
    """A new kind must not have to chase readers. Outside positions.py and config.py nothing in the package reads
    model.positions (an attribute, a ["positions"] item or getattr), compares a kind's name, names a kind's class
    or its table, or reaches past the interface into a model's position_encoding. inference/hf_import.py alone
    names the Marian kind: it makes models of it."""
    kind_names = set(positions.KINDS) - {"marian"}  # "marian" is also a model_type and a vocabulary kind
    public = {name for name in dir(positions.Positions) if not name.startswith("_")} - set(dir(torch.nn.Module))
    private = {"table", "cos", "sin", "source", "target", "make_table", "show", "angles"}
    offenders = []
    for path in sorted((ROOT / "transformer").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        if where in INTERFACE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            bad = None
            if isinstance(node, ast.Attribute) and node.attr == "positions" and isinstance(node.ctx, ast.Load):
                bad = "reads .positions"
            elif (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value == "positions"
            ):
                bad = 'reads ["positions"]'
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "id", None) == "getattr"
                and any(isinstance(a, ast.Constant) and a.value == "positions" for a in node.args)
            ):
                bad = "getattr positions"
            elif isinstance(node, ast.Constant) and node.value in kind_names and id(node) not in docstrings:
                bad = f"names the kind {node.value!r}"
            elif isinstance(node, (ast.Name, ast.Attribute)):
                name = node.id if isinstance(node, ast.Name) else node.attr
                allowed = {"Marian"} if where == "transformer/inference/hf_import.py" else set()
                kinds = {cls.__name__ for cls in positions.KINDS.values()} | {"FixedTable"}
                if name in (kinds | {"sinusoid_table", "marian_table"}) - allowed or (
                    name == "KINDS"
                    and getattr(node, "value", None) is not None
                    and getattr(node.value, "id", "") == "positions"
                ):
                    bad = f"names {name}"
                elif (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "position_encoding"
                    and (node.attr in private or node.attr not in public | {"d_model", "n_heads", "max_positions"})
                ):
                    bad = f"reaches position_encoding.{node.attr}"
            if bad:
                offenders.append(f"{where}:{node.lineno}: {bad}")
    assert not offenders, offenders


# --------------------------------------------------------------------------- checkpoints from before


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
    # What the code before the relayout printed for the same command: the texts, and the scores it printed to 4
    # decimals (another CPU's fp32 sums may round the last one otherwise).
    then = [(-25.3851, "o" * 31), (-25.4802, "o ch" + "o" * 29), (-25.3854, "o" * 31), (-25.4805, "o ch" + "o" * 29)]
    now = [(float(score), text) for score, text in (line.split("\t") for line in out.splitlines())]
    assert [text for _, text in now] == [text for _, text in then]
    assert [score for score, _ in now] == pytest.approx([score for score, _ in then], abs=2e-4)
