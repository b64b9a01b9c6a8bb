"""YAML configs: every shipped file loads; unknown keys, wrong types and impossible values are errors."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest
import yaml

from tests.helpers import ROOT, tiny_config, write_config
from transformer.config import (
    SECTIONS,
    Config,
    DataConfig,
    DecodeConfig,
    ModelConfig,
    TrainConfig,
    apply_overrides,
    from_dict,
    load_config,
    save_config,
    to_dict,
)
from transformer.errors import UserError
from transformer.model.transformer import Transformer

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_there_are_configs():
    assert {"base.yaml", "big.yaml", "multi30k.yaml", "tiny.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    # Every value written in the file arrives in the dataclass.
    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    built = to_dict(cfg)
    for section, values in raw.items():
        for key, value in (values or {}).items():
            if key == "corpora":  # a list of mappings: each written key arrives in its entry
                assert [{k: c[k] for k in written} for c, written in zip(built[section][key], value)] == value
                continue
            assert built[section][key] == value, f"{section}.{key}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_save_and_reload_round_trip(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg
    assert from_dict(to_dict(cfg)) == cfg


def test_paper_base_config_values():
    cfg = load_config(ROOT / "configs" / "base.yaml")
    m, t = cfg.model, cfg.train
    assert (m.d_model, m.n_heads, m.n_encoder_layers, m.n_decoder_layers, m.d_ff) == (512, 8, 6, 6, 2048)
    assert m.dropout == 0.1 and t.label_smoothing == 0.1
    assert t.adam_betas == (0.9, 0.98) and t.adam_eps == 1e-9
    assert t.lr_schedule == "noam" and t.warmup_steps == 4000


def test_sections_are_the_config_dataclasses():
    assert SECTIONS == {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "decode": DecodeConfig}
    assert list(SECTIONS) == [f.name for f in dataclasses.fields(Config)]


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "")) == Config()
    assert load_config(write(tmp_path, "model:\ntrain:\n")) == Config()


def test_unknown_key_names_key_and_section(tmp_path):
    path = write(tmp_path, "model:\n  d_model: 64\n  n_head: 4\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    message = str(e.value)
    assert "n_head" in message and "model" in message
    assert "n_heads" in message  # the known keys are listed


def test_unknown_section(tmp_path):
    with pytest.raises(UserError, match="unknown section 'optimizer'"):
        load_config(write(tmp_path, "optimizer:\n  lr: 1.0\n"))


def test_top_level_and_section_must_be_mappings(tmp_path):
    with pytest.raises(UserError, match="top level"):
        load_config(write(tmp_path, "- 1\n- 2\n"))
    with pytest.raises(UserError, match="section 'model'"):
        load_config(write(tmp_path, "model: 5\n"))


@pytest.mark.parametrize(
    "text, where",
    [
        ('model:\n  d_model: "big"\n', "model.d_model"),
        ("model:\n  d_model: 64.0\n", "model.d_model"),
        ("model:\n  n_heads: true\n", "model.n_heads"),
        ("model:\n  dropout: high\n", "model.dropout"),
        ("model:\n  share_embeddings: 1\n", "model.share_embeddings"),
        ("model:\n  norm: middle\n", "model.norm"),
        ("data:\n  dir: 3\n", "data.dir"),
        ("train:\n  adam_betas: [0.9]\n", "train.adam_betas"),
        ("train:\n  adam_betas: [0.9, fast]\n", "train.adam_betas"),
        ("train:\n  valid_scores: bleu\n", "train.valid_scores must be a list"),
        ("train:\n  valid_scores: [bleu, 3]\n", "train.valid_scores"),
        ("train:\n  lr_schedule: cosine\n", "train.lr_schedule"),
    ],
)
def test_wrong_type_names_key(tmp_path, text, where):
    with pytest.raises(UserError) as e:
        load_config(write(tmp_path, text))
    assert where in str(e.value)


def test_types_are_converted(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "model:\n  dropout: 0\ntrain:\n  adam_betas: [0.9, 0.99]\n"
            "  adam_eps: 1e-8\n  lr: 5e-4\n  valid_scores: [bleu, chrf]\ndata:\n  hub_config: null\n",
        )
    )
    assert cfg.train.valid_scores == ("bleu", "chrf") and to_dict(cfg)["train"]["valid_scores"] == ["bleu", "chrf"]
    assert isinstance(cfg.model.dropout, float) and cfg.model.dropout == 0.0
    assert cfg.train.adam_betas == (0.9, 0.99) and isinstance(cfg.train.adam_betas, tuple)
    assert cfg.train.adam_eps == 1e-8 and cfg.train.lr == 5e-4
    assert cfg.data.hub_config is None


@pytest.mark.parametrize(
    "raw, needle",
    [
        ({"model": {"d_model": 30, "n_heads": 4}}, "n_heads"),
        ({"model": {"d_model": 0}}, "d_model"),
        ({"model": {"d_model": 6, "n_heads": 2}}, None),  # valid: 6 is a multiple of 2 and even
        ({"model": {"d_model": 9, "n_heads": 3}}, "even"),
        ({"model": {"dropout": -0.1}}, "model.dropout"),
        ({"model": {"attention_dropout": 1.0}}, "model.attention_dropout"),
        ({"model": {"n_encoder_layers": 0}}, "layer"),
        ({"train": {"warmup_steps": 0, "lr_schedule": "noam"}}, "warmup_steps"),
        ({"train": {"warmup_steps": 0, "lr_schedule": "inverse_sqrt"}}, "warmup_steps"),
        ({"train": {"warmup_steps": 0, "lr_schedule": "constant"}}, None),
        ({"train": {"lr": 0.0}}, "train.lr"),
        ({"train": {"label_smoothing": 1.0}}, "label_smoothing"),
        ({"train": {"adam_betas": [0.9, 1.0]}}, "adam_betas"),
        ({"train": {"update_freq": 0}}, "update_freq"),
        ({"train": {"valid_scores": ["chrf"]}}, "train.valid_scores must name bleu (best.pt follows it)"),
        ({"train": {"valid_scores": ["bleu", "bleu"]}}, "each score once"),
        ({"data": {"src_lang": "en", "tgt_lang": "en"}}, "src_lang"),
        ({"data": {"max_len": 300}, "model": {"max_positions": 256}}, "max_positions"),
        ({"data": {"max_tokens": 10}}, "max_tokens"),
        ({"decode": {"beam": 0}}, "beam"),
        ({"decode": {"workers": 0}}, "decode.workers"),
    ],
)
def test_impossible_values(raw, needle):
    if needle is None:
        from_dict(raw)
        return
    with pytest.raises(UserError) as e:
        from_dict(raw)
    assert needle in str(e.value)


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


def test_overrides_parse_values_as_yaml(tmp_path):
    path = write(tmp_path, "model:\n  d_model: 64\n  n_heads: 4\ntrain:\n  max_steps: 10\n")
    cfg = load_config(
        path,
        [
            "train.max_steps=500",
            "model.dropout=0.25",
            "model.norm=pre",
            "train.adam_betas=[0.8, 0.9]",
            "model.tie_output=false",
            "train.lr=3e-4",
            "data.dir=some/where=odd",
            "data.hub_config=null",
        ],
    )
    assert cfg.train.max_steps == 500
    assert cfg.model.dropout == 0.25 and cfg.model.norm == "pre"
    assert cfg.train.adam_betas == (0.8, 0.9)
    assert cfg.model.tie_output is False
    assert cfg.train.lr == 3e-4
    assert cfg.data.dir == "some/where=odd"  # only the first '=' separates key from value
    assert cfg.data.hub_config is None
    assert cfg.model.d_model == 64  # untouched values stay


def test_overrides_do_not_modify_input_and_later_wins():
    raw = {"model": {"d_model": 64}}
    out = apply_overrides(raw, ["model.d_model=128", "model.d_model=256", "train.seed=3"])
    assert raw == {"model": {"d_model": 64}}
    assert out["model"]["d_model"] == 256 and out["train"]["seed"] == 3


@pytest.mark.parametrize("item", ["max_steps=5", "train.max_steps", "train", "=5"])
def test_override_bad_syntax(item):
    with pytest.raises(UserError) as e:
        apply_overrides({}, [item])
    assert "section.key=value" in str(e.value) and item in str(e.value)


def test_override_errors_name_the_key():
    with pytest.raises(UserError, match="train.max_steps"):
        from_dict(apply_overrides({}, ["train.max_steps=many"]))
    with pytest.raises(UserError, match="unknown key 'max_step' in section 'train'"):
        from_dict(apply_overrides({}, ["train.max_step=5"]))
    with pytest.raises(UserError, match="unknown section 'trian'"):
        from_dict(apply_overrides({}, ["trian.max_steps=5"]))


def test_invalid_yaml_reports_line(tmp_path):
    path = write(tmp_path, "model:\n  d_model: 64\n  n_heads: [4\ntrain:\n  seed: 1\n")
    with pytest.raises(UserError) as e:
        load_config(path)
    message = str(e.value)
    assert str(path) in message and "invalid YAML" in message
    line = int(re.search(r"line (\d+)", message).group(1))
    assert 3 <= line <= 4  # the unclosed bracket on line 3 is noticed at or right after it

    path = write(tmp_path, "model:\n  d_model: 64\n\tn_heads: 4\n", "tab.yaml")
    with pytest.raises(UserError, match="line 3"):
        load_config(path)


def test_not_utf8_config(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("data:\n  dir: d\xe9j\xe0\n".encode("latin-1"))
    with pytest.raises(UserError, match="UTF-8|invalid YAML"):
        load_config(path)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.yaml"
    with pytest.raises(UserError, match="no such file") as e:
        load_config(path)
    assert str(path) in str(e.value)
    with pytest.raises(UserError, match="is a directory, not a YAML file"):
        load_config(tmp_path)  # a directory is not a config file, and the message says so


@pytest.mark.parametrize("cls", [Config, ModelConfig, DataConfig, TrainConfig, DecodeConfig])
def test_dataclasses_are_frozen(cls):
    obj = cls()
    field = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(obj, field, getattr(obj, field))


def test_loaded_config_is_frozen_and_hashable():
    cfg = load_config(ROOT / "configs" / "tiny.yaml")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.d_model = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = TrainConfig()
    assert hash(cfg) == hash(load_config(ROOT / "configs" / "tiny.yaml"))


def test_padding_multiple_must_fit_max_positions():
    from transformer.config import from_dict
    from transformer.errors import UserError

    with pytest.raises(UserError, match="padded to a multiple of data.pad_to_multiple"):
        from_dict({"model": {"max_positions": 130}, "data": {"max_len": 128, "pad_to_multiple": 8}})
    from_dict({"model": {"max_positions": 136}, "data": {"max_len": 128, "pad_to_multiple": 8}})


def test_a_home_directory_in_a_path_is_expanded(monkeypatch, tmp_path):
    # `--set train.run_dir=~/runs/x` reaches us with the ~: the shell expands it only at the start of a word.
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = from_dict(apply_overrides({}, ["train.run_dir=~/runs/x", "data.dir=~/data"]))
    assert (cfg.train.run_dir, cfg.data.dir) == (f"{tmp_path}/runs/x", f"{tmp_path}/data")


def test_a_missing_relative_data_dir_says_where_it_was_looked_for(monkeypatch, tmp_path):
    from transformer.data.corpus import resolve_split

    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        UserError,
        match=r"^data: no such file: data/multi30k/train.de \(split 'train' in data.dir "
        rf"'data/multi30k', relative to {tmp_path}, where this runs\)$",
    ):
        resolve_split(from_dict({"data": {"dir": "data/multi30k"}}).data, "train")


def test_the_length_penalty_is_bounded_where_it_cannot_overflow():
    """decode.lenpen of 400 overflowed ((5 + length) / 6) ** alpha from about 30 tokens on (OverflowError in every
    search); the bound, MAX_LENPEN, keeps it finite at every length a model takes, and is checked once for all."""
    from transformer.config import MAX_LENPEN, lenpen_problem
    from transformer.inference.search import length_penalty

    assert from_dict({"decode": {"lenpen": MAX_LENPEN}}).decode.lenpen == MAX_LENPEN
    assert from_dict({"decode": {"lenpen": 0}}).decode.lenpen == 0
    for bad in (MAX_LENPEN + 0.01, 400.0, -0.1):
        with pytest.raises(UserError, match=f"decode.lenpen must be a number from 0 to 10 .*, got {bad}"):
            from_dict({"decode": {"lenpen": bad}})
    assert length_penalty(1000 + 1, MAX_LENPEN) < 1e23  # a float32 score divided by it is still a number
    with pytest.raises(OverflowError):
        length_penalty(31, 400.0)  # what the bound prevents
    assert lenpen_problem(float("inf"), "--lenpen") and lenpen_problem(True, "x") and not lenpen_problem(0.6, "x")


@pytest.mark.parametrize("name", ["../x", "a/b", "..", ".", "", "x\0y"])
def test_a_split_name_is_never_a_path(name):
    with pytest.raises(UserError, match=r"config: data.test_split must be a split's name"):
        from_dict({"data": {"test_split": name}})


def test_config_from_a_pipe_like_dev_stdin(tmp_path):
    raw = tiny_config(tmp_path)
    read_end, write_end = os.pipe()
    os.write(write_end, write_config(tmp_path / "tiny.yaml", raw).read_bytes())
    os.close(write_end)
    try:
        cfg = load_config(f"/dev/fd/{read_end}")  # what /dev/stdin is when stdin is a pipe: not a regular file
    finally:
        os.close(read_end)
    assert cfg.train.run_dir == raw["train"]["run_dir"]
