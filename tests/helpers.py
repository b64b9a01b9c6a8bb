"""Helpers the tests import (`from tests.helpers import tiny_config`): synthetic sentences and pairs, a tiny corpus
and config, a model that copies by construction, checkpoints for translation, OPUS-MT-like directories, the command
line in a child process, training stand-ins and training-state checks. Fixtures, which reach tests by name, are in
conftest.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import struct
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
import yaml

from transformer.config import ModelConfig, from_dict, to_dict
from transformer.data.batch import Batch
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, train_vocab
from transformer.model.checkpoint import load_checkpoint, save_checkpoint
from transformer.model.transformer import Transformer

ROOT = Path(__file__).resolve().parent.parent
# A run directory trained by the code before issue 34's layout (tests/fixtures/make_old_run.py): its last.pt.xz.
OLD_RUN = ROOT / "tests" / "fixtures" / "old_run"
WORDS = (
    "der die das ein eine mann frau kind hund katze haus auf dem im spielt läuft sitzt "
    "the a man woman child dog cat house on in plays runs sits red blue green big small"
).split()


# --------------------------------------------------------------------------- models by construction, training stand-ins


def copying_model(
    vocab_size: int,
    max_positions: int,
    n_decoder_layers: int = 2,
    ending_early: float = 13.0,
    sure: float = 9.0,
    seed: int = 0,
    **settings,
) -> Transformer:
    """A model that copies its source by construction, not by training: its weights are set, so that what it
    outputs is the same on every CPU and in every precision. Each target position attends to the source position
    of the same index and emits the piece there; the source ends in EOS, so every output is the source, then EOS.
    The paper's layout (post-norm, sinusoidal positions, one embedding matrix for both sides and the output), so
    that every engine and export takes it; `settings`: other model.* values that keep the weights' meaning
    (share_embeddings, tie_output: the same matrix, copied).

    One head; the residual stream holds the sinusoids' 20 highest frequencies (`raw`: only the first layer reads
    them), the pieces as one-hot codes minus their mean (`piece`), the positions again as +PE and -PE (`plus`,
    `minus`), and EOS's own dimension with its counterweight (`eos`, `balance`). The first self-attention of each
    side attends to its own position and moves the positions into `plus` and `minus` (the decoder's also takes the
    previous piece out), so that the stream sums to zero and every LayerNorm after it only scales; cross-attention
    matches `plus`/`minus` at equal positions and copies the piece (and, for EOS, its dimension). Every later
    sub-layer adds nothing. The logits, as costs below the copied piece (u, u' seeded draws in [0, 2), each within
    about 3 %): any other piece `sure` + u' - u; BOS about 10.5 (about e^-10: what a search that suppresses it
    renormalises away); EOS `ending_early` (default: more than any one other piece; below 7: the cheapest choice
    after the copy, so that a search meets short hypotheses first); at the last source position, skipping EOS about
    25; PAD and UNK never. The draws are Python's: the same weights everywhere."""
    rng = random.Random(seed)
    V, Pd = vocab_size, 20 * 2  # the 20 highest frequencies tell the positions of a sentence apart
    d = 3 * Pd + V + 2
    cfg = ModelConfig(
        **{
            "d_model": d,
            "n_heads": 1,
            "n_encoder_layers": 1,
            "n_decoder_layers": n_decoder_layers,
            "d_ff": 8,
            "dropout": 0.0,
            "max_positions": max_positions,
            "norm": "post",
            "positions": "sinusoidal",
            "output_bias": True,
            **settings,
        }
    )
    model = Transformer(cfg, V).eval()
    raw, piece = slice(0, Pd), slice(Pd, Pd + V)
    plus, minus = slice(Pd + V, 2 * Pd + V), slice(2 * Pd + V, 3 * Pd + V)
    eos, balance = 3 * Pd + V, 3 * Pd + V + 1
    width = sure / 0.68  # the copy's margin is about 0.68 x the pieces' scale in this layout (measured)
    eos_width = (25.0 - sure + ending_early + 1.0) / 0.98  # skipping EOS costs about 25
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        for m in model.modules():
            if isinstance(m, torch.nn.LayerNorm):
                m.weight.fill_(1.0)
        emb = torch.zeros(V, d)
        emb[:, piece] = (torch.eye(V) - 1.0 / V) * width / d**0.5  # the model multiplies by sqrt(d)
        emb[EOS_ID, eos] = eos_width / d**0.5
        emb[PAD_ID] = 0.0
        for table in {id(e): e for e in (model.src_embed, model.tgt_embed, model.output)}.values():
            table.weight.copy_(emb)

        def on_its_own_position(attention, keep_piece: bool) -> None:
            attention.q_proj.weight[raw, raw] = torch.eye(Pd) * 30.0  # scores about 25 apart: one-hot
            attention.k_proj.weight[raw, raw] = torch.eye(Pd)
            moved = -torch.eye(d)  # out of the stream: the sinusoids, and the previous piece unless kept
            moved[piece, piece] = -torch.ones(V, V) / V if keep_piece else -torch.eye(V)  # kept: minus its mean
            moved[plus, raw] += torch.eye(Pd)
            moved[minus, raw] -= torch.eye(Pd)
            attention.v_proj.weight.copy_(moved)
            attention.out_proj.weight.copy_(torch.eye(d))

        on_its_own_position(model.encoder_layers[0].self_attn, keep_piece=True)
        on_its_own_position(model.decoder_layers[0].self_attn, keep_piece=False)
        both = torch.cat([torch.arange(plus.start, plus.stop), torch.arange(minus.start, minus.stop)])
        for i, layer in enumerate(model.decoder_layers):
            x = layer.cross_attn  # every layer's looks at the source piece of its own index (alignments)
            x.q_proj.weight[both, both] = 30.0
            x.k_proj.weight[both, both] = 1.0
            if i == 0:  # the first copies it
                x.v_proj.weight[piece, piece] = torch.eye(V)
                x.v_proj.weight[eos, Pd + EOS_ID] = 1.0
                x.v_proj.weight[balance, Pd + EOS_ID] = -1.0
                x.out_proj.weight[piece, piece] = torch.eye(V)
                x.out_proj.weight[[eos, balance], [eos, balance]] = 1.0
        bias = torch.tensor([-2.0 * rng.random() for _ in range(V)])  # -u: the mean copy costs 1 less than `sure`
        bias[EOS_ID] = sure - ending_early - 1.0
        bias[BOS_ID] = sure - 10.5 - 1.0
        bias[[PAD_ID, UNK_ID]] = -100.0
        model.output.bias.copy_(bias)
    return model


def change_training_loss(monkeypatch, change) -> list:
    """Route every training micro-batch's loss through `change(n, loss)` (n counts calls from 1) in the training
    loop: how tests inject a NaN, an fp16 overflow or a signal at a chosen update. Returns the list of the losses
    the real function computed, one per call."""
    from transformer.training import update

    real, seen = update.label_smoothed_loss, []

    def changed(logits, target, smoothing, pad_id=PAD_ID):
        loss = real(logits, target, smoothing, pad_id)
        seen.append(loss)
        return change(len(seen), loss)

    monkeypatch.setattr(update, "label_smoothed_loss", changed)
    return seen


# --------------------------------------------------------------------------- processes


def subprocess_env(**extra: str) -> dict:
    """The environment of a child Python: single-threaded, so that parallel runs do not fight over 2 cores, and
    importing this checkout's package."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **extra}


def cli(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    """`python -m transformer ARGS` in a child process (each costs ~2 s of importing torch: prefer `call`)."""
    kwargs.setdefault("env", subprocess_env())
    return subprocess.run(
        [sys.executable, "-m", "transformer", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        **kwargs,
    )


# --------------------------------------------------------------------------- data


def sentences(rng: random.Random | int, n: int, lo: int = 2, hi: int = 8) -> list[str]:
    """n sentences of lo..hi words from WORDS; rng is a random.Random to draw from, or a seed."""
    rng = rng if isinstance(rng, random.Random) else random.Random(rng)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def random_pairs(
    n: int = 0, seed: int = 0, max_len: int = 30, vocab: int = 100, lengths: Sequence[tuple[int, int]] | None = None
) -> list[tuple[list[int], list[int]]]:
    """Pairs of random ids in [4, vocab) (never a special id): n pairs of 1..max_len ids a side, or one pair per
    (source, target) length given in `lengths`."""
    rng = random.Random(seed)

    def ids(length: int) -> list[int]:
        return [rng.randint(4, vocab - 1) for _ in range(length)]

    if lengths is not None:
        return [(ids(s), ids(t)) for s, t in lengths]
    return [(ids(rng.randint(1, max_len)), ids(rng.randint(1, max_len))) for _ in range(n)]


def batches_equal(a: Batch, b: Batch) -> bool:
    return torch.equal(a.src, b.src) and torch.equal(a.tgt_in, b.tgt_in) and torch.equal(a.tgt_out, b.tgt_out)


def write_corpus(directory: Path, n_train: int = 200, n_valid: int = 20, seed: int = 0) -> Path:
    """{train,valid}.{de,en}: a reversal task over WORDS (the target is the source's words reversed)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for split, n in (("train", n_train), ("valid", n_valid)):
        src = sentences(rng, n)
        (directory / f"{split}.de").write_text("".join(s + "\n" for s in src), encoding="utf-8")
        (directory / f"{split}.en").write_text(
            "".join(" ".join(reversed(s.split())) + "\n" for s in src), encoding="utf-8"
        )
    return directory


def shared_data_dir() -> Path:
    """The real corpora: $TRANSFORMER_DATA (set by the Makefile) or ../shared/data beside the repo."""
    return Path(os.environ.get("TRANSFORMER_DATA", ROOT.parent / "shared" / "data"))


def write_hub_folder(
    directory: Path, layout: str, pairs: dict[str, list[tuple[str, str]]], languages: tuple[str, str] = ("de", "en")
) -> Path:
    """A folder that `datasets.load_dataset` reads as a dataset: {split}.jsonl with rows {"de": .., "en": ..}
    (layout "columns") or {"translation": {"de": .., "en": ..}} (layout "translation")."""
    directory.mkdir()
    for name, rows in pairs.items():
        if layout == "columns":
            lines = [dict(zip(languages, pair)) for pair in rows]
        else:
            lines = [{"translation": dict(zip(languages, pair))} for pair in rows]
        (directory / f"{name}.jsonl").write_text(
            "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in lines), encoding="utf-8"
        )
    return directory


# --------------------------------------------------------------------------- training runs


def tiny_config(tmp_path: Path, run: str = "run", data_dir: Path | None = None, **sections) -> dict:
    """A model of a few thousand parameters that trains in seconds; sections override key by key. It trains in
    fp32 on every CPU (`precision: auto` would be bf16 on one with AVX512-BF16 or AMX, and the numbers the tests
    compare would differ from machine to machine); a test of another precision says so."""
    cfg = {
        "model": {
            "d_model": 32,
            "n_heads": 2,
            "n_encoder_layers": 1,
            "n_decoder_layers": 1,
            "d_ff": 64,
            "dropout": 0.1,
            "max_positions": 64,
        },
        "data": {
            "dir": str(data_dir or write_corpus(tmp_path / "corpus")),
            "vocab_size": 64,
            "max_len": 20,
            "max_tokens": 200,
        },
        "train": {
            "run_dir": str(tmp_path / run),
            "max_steps": 12,
            "lr_schedule": "noam",
            "lr": 2.0,
            "warmup_steps": 10,
            "log_every": 1,
            "valid_every": 4,
            "seed": 3,
            "precision": "fp32",
            "finish": False,  # the end-of-training summary has tests of its own (test_finish.py)
            # MFU against a given peak: measuring one costs every run half a second; test_loop.py's CLI run and
            # test_cuda_paths.py test the measurement.
            "peak_tflops": 1.0,
        },
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def built_run(cfg, device: torch.device | None = None):
    """A training run of `cfg` built as `train` builds it (prepared, its store and vocabulary loaded, model and
    optimizer on `device`, the CPU by default), without training: for tests of one update -> (run, store)."""
    import time

    from transformer.data.mixture import Mixture
    from transformer.data.prepare import open_prepared
    from transformer.data.vocab import Vocab
    from transformer.distributed import DistInfo
    from transformer.training import loop as train_module

    train_module.prepare_only(cfg)
    run_dir = Path(cfg.train.run_dir)
    vocab = Vocab.load(run_dir / "spm.model")
    store = open_prepared(cfg, run_dir, vocab)
    args = (cfg, DistInfo(), device or torch.device("cpu"), run_dir, "resume", vocab, store)
    return train_module.build(*args, Mixture.of(store.corpus("train")), None, time.perf_counter()), store


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg), encoding="utf-8")
    return path


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_training_state(a_path: Path, b_path: Path) -> None:
    """Two checkpoints hold the same run, bit for bit: counters and data position (wall-clock time aside),
    weights, and the optimizer's state where they have one."""
    a, b = load_checkpoint(a_path), load_checkpoint(b_path)
    wall_clock = {"elapsed"}  # the one thing two runs never share
    assert {k: v for k, v in a["run"].items() if k not in wall_clock} == {
        k: v for k, v in b["run"].items() if k not in wall_clock
    }, (a_path, a["run"], b["run"])
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), f"{a_path}: {key} differs"
    assert ("optimizer" in a) == ("optimizer" in b)
    optimizer_states = (state.get("optimizer", {}).get("state", {}).values() for state in (a, b))
    for sa, sb in zip(*optimizer_states):
        for key in sa:
            assert torch.equal(torch.as_tensor(sa[key]), torch.as_tensor(sb[key])), f"{a_path}: optimizer {key}"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) in pixels of a PNG file, read from its header."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


# --------------------------------------------------------------------------- checkpoints for translation

SENTENCES = ["ein hund spielt im park", "zwei katzen", "der mann sitzt auf einem roten haus vor dem baum"]
LINES = sentences(random.Random(5), 40)


def small_vocab() -> bytes:
    """A SentencePiece model: what a checkpoint must hold besides its weights for load_checkpoint to take it."""
    return train_vocab(sentences(0, 300), vocab_size=80).proto


def translation_config(data_dir: Path, run_dir: Path, d_ff: int = 64) -> dict:
    """The config of the translation tests' checkpoints: a tiny model, short outputs (max_len_offset 4)."""
    return {
        "model": {
            "d_model": 32,
            "n_heads": 4,
            "n_encoder_layers": 1,
            "n_decoder_layers": 2,
            "d_ff": d_ff,
            "dropout": 0.0,
            "max_positions": 40,
        },
        "data": {
            "dir": str(data_dir),
            "src_lang": "de",
            "tgt_lang": "en",
            "vocab_size": 80,
            "max_len": 30,
            "max_tokens": 64,
        },
        "train": {"run_dir": str(run_dir)},
        "decode": {"beam": 3, "lenpen": 0.6, "max_len_offset": 4, "max_tokens": 64},
    }


def write_checkpoint(path: Path, raw: dict, vocab, seed: int) -> None:
    """An untrained model with peaky outputs (so that sentences get different translations), weights only."""
    cfg = from_dict(raw)
    torch.manual_seed(seed)
    model = Transformer(cfg.model, len(vocab))
    with torch.no_grad():
        model.output.weight.mul_(3.0)
    # Deliberately only what translation needs: no optimizer, scheduler or step.
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, path)


def write_copying_checkpoint(path: Path, **settings) -> Path:
    """A checkpoint of copying_model (80 pieces of WORDS, translation_config's 40 positions and search settings);
    `settings`: other model.* values (share_embeddings, tie_output)."""
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    raw = translation_config(path.parent, path.parent)
    model = copying_model(len(vocab), raw["model"]["max_positions"], **settings)
    cfg = from_dict({**raw, "model": dataclasses.asdict(model.cfg)})
    save_checkpoint({"config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict()}, path)
    return path


# --------------------------------------------------------------------------- Hugging Face MarianMTModel directories

MARIAN_SOURCE_WORDS, MARIAN_TARGET_WORDS = WORDS[:17], WORDS[17:]  # the German-like and the English-like words


def marian_sentences(seed: int, n: int, target: bool = False) -> list[str]:
    rng = random.Random(seed)
    words = MARIAN_TARGET_WORDS if target else MARIAN_SOURCE_WORDS
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 8))) for _ in range(n)]


def write_marian_dir(directory: Path, seed: int = 0, **config) -> Path:
    """A small OPUS-MT-like MarianMTModel directory, made as scripts/make_marian_dir.py makes the real-size one (a
    SentencePiece model per side trained here, vocab.json of both sides' pieces and two >>xx<< codes, swish, a
    non-zero final_logits_bias with EOS's raised so that about half the outputs end before the length limit, wide
    random weights). `config`: MarianConfig keys that differ from these tiny ones."""
    from scripts.make_marian_dir import write_marian_dir as write

    tiny = {
        "d_model": 32,
        "encoder_layers": 2,
        "decoder_layers": 2,
        "encoder_attention_heads": 4,
        "decoder_attention_heads": 4,
        "encoder_ffn_dim": 64,
        "decoder_ffn_dim": 64,
        "max_position_embeddings": 64,
    }
    sources, targets = marian_sentences(seed, 400), marian_sentences(seed + 1, 400, target=True)
    return write(directory, sources, targets, seed=seed, **{**tiny, **config})


# --------------------------------------------------------------------------- small models for the model's own tests

SMALL_VOCAB = 50


def small_config(**kw) -> ModelConfig:
    """Two layers a side, 32 wide, every dropout 0.1; keyword arguments override."""
    base = dict(
        d_model=32,
        n_heads=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=64,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        max_positions=64,
    )
    base.update(kw)
    return ModelConfig(**base)


def small_model(seed: int = 0, **kw) -> Transformer:
    """A Transformer of small_config(**kw) and SMALL_VOCAB pieces, seeded, in eval mode."""
    torch.manual_seed(seed)
    return Transformer(small_config(**kw), SMALL_VOCAB).eval()


def random_ids(*shape: int) -> torch.Tensor:
    return torch.randint(4, SMALL_VOCAB, shape)  # never a special id


def positions_model(kind: str) -> Transformer:
    """An untrained model of SMALL_VOCAB ids and 40 positions of the kind (model.positions), built through the
    config's checks, seeded, in eval mode."""
    torch.manual_seed(0)
    shape = {"d_model": 32, "n_heads": 2, "n_encoder_layers": 1, "n_decoder_layers": 2, "d_ff": 64, "dropout": 0.0}
    cfg = from_dict({"model": {**shape, "max_positions": 40, "positions": kind}, "data": {"max_len": 20}})
    return Transformer(cfg.model, SMALL_VOCAB).eval()


def sampling_settings(sampler, nbest: int = 1, **settings):
    """SearchSettings that draw as `sampler` (sampling.Sampler) does, `nbest` samples per source; `settings`:
    the others (lenpen, max_len_offset...)."""
    from transformer.inference.settings import SearchSettings

    value = int(sampler.value) if sampler.kind == "topk" else sampler.value
    return SearchSettings(
        beam=1,
        nbest=nbest,
        sample=f"{sampler.kind}:{value}",
        temperature=sampler.temperature,
        seed=sampler.seed,
        **settings,
    )
