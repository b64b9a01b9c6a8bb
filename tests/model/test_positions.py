"""Positions behind one interface (model/positions.py): each kind (sinusoidal, marian, learned, rotary) does what
it says; every reader gets it through the interface and nothing outside positions.py and config.py reads a kind, so
that a new kind is those 2 files (a stand-in kind proves it); each kind trains, resumes, averages, translates with
and without the KV cache, and exports where it can; a checkpoint written before model.positions existed loads as
sinusoidal and translates exactly as it did then."""

from __future__ import annotations

import ast
import lzma
import pickletools
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import ROOT, assert_same_training_state, random_pairs, tiny_config, write_corpus
from transformer import config as config_module
from transformer.config import POSITION_KINDS, from_dict, to_dict
from transformer.data.batch import Batch, prepare_sources
from transformer.errors import UserError
from transformer.inference.ctranslate2_engine import build_spec
from transformer.inference.search import search
from transformer.model import positions
from transformer.model.checkpoint import load_checkpoint, load_model, model_from_checkpoint
from transformer.model.transformer import Transformer
from transformer.serve.app import Service
from transformer.training.average import average
from transformer.training.loop import train
from transformer.training.run_state import load_resumable
from transformer.visualize.plots import positional_encoding

OLD_RUN = Path(__file__).resolve().parents[1] / "fixtures" / "old_run"
INTERFACE = ("transformer/model/positions.py", "transformer/config.py")  # the 2 files a kind of position is


SMALL = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 2, "d_ff": 64, "dropout": 0.0}


def small_model(kind: str) -> Transformer:
    """An untrained model of 50 ids, 40 positions of the kind, through the config's checks."""
    torch.manual_seed(0)
    cfg = from_dict({"model": {**SMALL, "max_positions": 40, "positions": kind}, "data": {"max_len": 20}})
    return Transformer(cfg.model, 50).eval()


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


@pytest.mark.parametrize(
    "kind, d_model, n_heads, problem",
    [
        ("sinusoidal", 27, 3, "model.d_model must be a positive even number for sinusoidal positions"),
        ("marian", 27, 3, "even number for marian"),
        ("rotary", 30, 10, r"rotary positions need an even head size \(model.d_model / model.n_heads"),
        ("rotary", 30, 3, None),  # d_model need not be a multiple of 4: the head size (10) is even
        ("learned", 27, 3, None),  # a table of any width
    ],
)
def test_each_kind_asks_what_it_needs_of_the_models_shape(tmp_path, kind, d_model, n_heads, problem):
    raw = tiny_config(tmp_path, model={"positions": kind, "d_model": d_model, "n_heads": n_heads})
    if problem is None:
        Transformer(from_dict(raw).model, 20)  # builds
    else:
        with pytest.raises(UserError, match=problem):
            from_dict(raw)


def test_every_reader_gets_the_same_sinusoid_table():
    model = small_model("sinusoidal")
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


def test_rotary_scores_depend_on_the_distance_alone_and_nothing_is_added():
    rotary = small_model("rotary").position_encoding
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
    model = small_model("learned")
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


@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_cached_decoding_equals_uncached_for_every_kind(kind):
    """The decoding offset reaches each kind: a step at position t adds row t (or turns by angle t), and rotary's
    keys are turned once as the cache keeps them."""
    model = small_model(kind)
    src, _ = prepare_sources([[5, 9, 13, 7], [21, 4, 8], [33, 6, 11, 12, 30, 31]], 40)
    with torch.no_grad():
        for beam in (1, 3):
            cached = search(model, src, beam=beam, max_len_offset=6, use_cache=True).best()
            full = search(model, src, beam=beam, max_len_offset=6, use_cache=False).best()
            assert [h.tokens for h in cached] == [h.tokens for h in full], (kind, beam)
            for a, b in zip(cached, full):
                assert a.score == pytest.approx(b.score, abs=1e-4)


# --------------------------------------------------------------------------- the readers: view, plot, exports


@pytest.mark.parametrize("kind", POSITION_KINDS)
def test_each_kind_shows_what_it_has(kind):
    view = small_model(kind).position_encoding.view(12)
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
            small_model(kind).position_encoding.view(41)
        with pytest.raises(UserError, match="only a trained model's own"):
            small_model(kind).position_encoding.view(12, d_model=64)  # another width: no such table


def test_plot_positions_draws_each_kind_and_a_models_own(tmp_path, call):
    for kind in ("rotary", "marian"):
        status, out, err = call(
            "plot-positions", "--kind", kind, "--d-model", "64", "--length", "20", "--out", tmp_path / f"{kind}.png"
        )
        assert status == 0 and (tmp_path / f"{kind}.png").stat().st_size > 1000, err
    status, _, err = call(
        "plot-positions", "--kind", "rotary", "--d-model", "64", "--n-heads", "64", "--out", tmp_path / "x.png"
    )
    assert status == 2 and "rotary positions need an even head size (--d-model / --n-heads" in err
    status, _, err = call("plot-positions", "--kind", "learned", "--out", tmp_path / "x.png")
    assert status == 2 and "a table a model learns" in err
    # A learned table exists only in a model: --model (tests below)


def test_serve_answers_with_the_view():
    service = SimpleNamespace(model=small_model("rotary"))
    got = Service.position_view(service, 32, 10)
    assert got["kind"] == "rotary" and not got["adds_table"] and "add no table" in got["note"]
    assert len(got["table"]) == 10 and got["tables"]["cos"] == got["table"]
    other = Service.position_view(service, 64, 10)  # another width: rotary's view for 64 / 2 heads
    assert len(other["table"][0]) == 16


def test_exports_take_what_they_can_express_and_refuse_the_rest_in_one_line():
    ctranslate2 = pytest.importorskip("ctranslate2")
    del ctranslate2
    pieces = [f"p{i}" for i in range(50)]
    rotary = build_spec(small_model("rotary"), pieces)
    assert int(rotary.decoder.layer[0].self_attention.rotary_dim) == 16  # the head size, all of it
    assert not hasattr(rotary.decoder, "position_encodings")
    for kind in ("learned", "rotary"):
        with pytest.raises(UserError, match=rf"^export hf: model.positions '{kind}' has no MarianMTModel equivalent"):
            small_model(kind).position_encoding.marian_order()


# --------------------------------------------------------------------------- each kind through the whole pipeline


@pytest.mark.parametrize("kind", ["learned", "rotary"])
def test_a_kind_trains_resumes_averages_and_translates(tmp_path, kind, call):
    corpus = write_corpus(tmp_path / "corpus")
    settings = {"model": {"positions": kind}, "train": {"max_steps": 8, "keep_last": 2}}
    straight = tiny_config(tmp_path, "straight", corpus, **settings)
    train(from_dict(straight), quiet=True)
    split = tiny_config(tmp_path, "split", corpus, **settings)
    split["train"]["max_steps"] = 4  # stopped at a validation, resumed
    train(from_dict(split), quiet=True)
    split["train"]["max_steps"] = 8
    train(from_dict(split), resume=True, quiet=True)
    assert_same_training_state(tmp_path / "straight" / "last.pt", tmp_path / "split" / "last.pt")

    averaged, inputs = average([tmp_path / "straight"], last=2, output=tmp_path / "avg.pt")
    assert len(inputs) == 2
    model, vocab, cfg = load_model(averaged)
    assert cfg.model.positions == kind
    src, _ = prepare_sources(vocab.encode(["der mann sitzt", "eine katze im haus"]), cfg.model.max_positions)
    cached = search(model, src, beam=2, max_len_offset=5, use_cache=True).best()
    full = search(model, src, beam=2, max_len_offset=5, use_cache=False).best()
    assert [h.tokens for h in cached] == [h.tokens for h in full]
    status, out, err = call("translate", averaged, "--device", "cpu", "--dtype", "fp32", stdin="der mann sitzt\n")
    assert status == 0 and len(out.splitlines()) == 1, err
    status, _, err = call("export", "hf", averaged, tmp_path / "hf")
    assert status == 2 and len(err.strip().splitlines()) == 1 and f"model.positions '{kind}'" in err, err
    assert not (tmp_path / "hf").exists()
    status, _, err = call("plot-positions", "--model", averaged, "--length", "20", "--out", tmp_path / "p.png")
    assert status == 0 and (tmp_path / "p.png").stat().st_size > 1000, err
    figure = positional_encoding(None, 20, model=str(averaged))
    assert len(figure.axes) == (3 if kind == "learned" else 2)  # its tables (source, target) and a colour bar
    with pytest.raises(UserError, match="--model takes the kind"):
        positional_encoding(64, 20, model=str(averaged))


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
    model = small_model("unordered")
    assert isinstance(model.position_encoding, Unordered)
    src, _ = prepare_sources([[5, 9, 13], [21, 4]], 40)
    with torch.no_grad():
        cached = search(model, src, beam=2, max_len_offset=4, use_cache=True).best()
        full = search(model, src, beam=2, max_len_offset=4, use_cache=False).best()
    assert [h.tokens for h in cached] == [h.tokens for h in full]
    got = Service.position_view(SimpleNamespace(model=model), 32, 5)
    assert got["table"] is None and got["tables"] == {} and "has none to show" in got["note"]
    figure = positional_encoding(32, 5, kind="unordered")
    assert "has none to show" in figure.texts[0].get_text()
    with pytest.raises(UserError, match="^export hf: model.positions 'unordered' has no MarianMTModel equivalent"):
        model.position_encoding.marian_order()
    pytest.importorskip("ctranslate2")
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
    # What the code before the relayout printed for the same command (scores to 4 decimals).
    assert out == (
        "-25.3851\tooooooooooooooooooooooooooooooo\n-25.4802\to chooooooooooooooooooooooooooooo\n"
        "-25.3854\tooooooooooooooooooooooooooooooo\n-25.4805\to chooooooooooooooooooooooooooooo\n"
    )
