"""Learned and rotary positions through every verb: each kind trains, resumes bit-identically, averages, translates
with and without the KV cache, is refused in one line by the Hugging Face export (Marian has sinusoids only), and
plots its own positions (plot-positions --model)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_same_training_state, tiny_config, write_corpus
from transformer.config import from_dict
from transformer.errors import UserError
from transformer.model.checkpoint import load_model
from transformer.training.average import average
from transformer.training.loop import train
from transformer.visualize.plots import positional_encoding


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
    _, _, cfg = load_model(averaged)
    assert cfg.model.positions == kind  # (cached decoding equals uncached for every kind: test_kv_cache.py, on
    # seeded weights rather than on this barely trained model, whose near-ties another CPU may break otherwise)
    status, out, err = call("translate", averaged, "--device", "cpu", "--dtype", "fp32", stdin="der mann sitzt\n")
    assert status == 0 and len(out.splitlines()) == 1, err
    status, _, err = call("export", "hf", averaged, tmp_path / "hf")
    assert status == 2 and len(err.strip().splitlines()) == 1 and f"model.positions '{kind}'" in err, err
    assert not (tmp_path / "hf").exists()
    status, _, err = call("plot-positions", "--model", averaged, "--length", "20", "--out", tmp_path / "p.png")
    assert status == 0 and (tmp_path / "p.png").stat().st_size > 1000, err
    figure = positional_encoding(None, 20, model=str(averaged))
    assert len(figure.axes) == (3 if kind == "learned" else 2)  # its tables (source, target) and a colour bar
    # Without --length: 100 positions, or the model's 64 where it has fewer (a learned table holds no more).
    status, _, err = call("plot-positions", "--model", averaged, "--out", tmp_path / "all.png")
    assert status == 0, err
    assert positional_encoding(None, None, model=str(averaged)).axes[0].images[0].get_array().shape[0] == 64
    with pytest.raises(UserError, match="--model takes the kind"):
        positional_encoding(64, 20, model=str(averaged))
