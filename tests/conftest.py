"""Shared fixtures, which reach tests by name: one thread per test, the command line in this process, a seed to
explore with, an offline hub, checkpoints for translation and their sentences translated one by one, an OPUS-MT-like
directory, the optional ctranslate2.
Helpers that tests import are in helpers.py (`from tests.helpers import tiny_config`).
"""

from __future__ import annotations

import io
import os
import random
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    SENTENCES,
    sentences,
    translation_config,
    write_checkpoint,
    write_copying_checkpoint,
    write_corpus,
    write_marian_dir,
)
from transformer import cli as cli_module
from transformer import device as device_module
from transformer.data.vocab import train_vocab
from transformer.inference.settings import SearchFlags
from transformer.inference.translator import Translator

# --------------------------------------------------------------------------- processes

# The modules that run for tens of seconds (training runs in child processes, torchrun, servers), heaviest first,
# as measured with `pytest --durations` on 2 cores. `make test` hands modules to its processes in collection order
# (--no-loadscope-reorder): the long ones go first, and the many short ones fill the gaps at the end, so that both
# processes end together. A module missing here only runs later; nothing else depends on the order.
HEAVIEST_FIRST = [
    "integration/test_torchrun.py",
    "integration/test_gpu_report.py",
    "integration/test_data_parallel.py",
    "serve/test_http_guard.py",
    "integration/test_bench.py",
    "serve/test_app.py",
    "training/test_loop.py",
    "inference/test_synthesis.py",
    "integration/test_crash.py",
    "training/test_finish.py",
    "inference/test_hf_export.py",
    "cli/test_translate_io.py",
    "inference/test_search.py",
    "cli/test_parser.py",
    "data/test_store.py",
    "visualize/test_animation.py",
]


def pytest_collection_modifyitems(items):
    rank = {f"tests/{name}": i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """One intra-op thread for every test and the fixtures it sets up: every model here is tiny, and a second
    thread only adds spin-waiting, badly so on a loaded 2-core machine. Set before each test, not once, because
    a library may change it for the whole process (a ctranslate2.Translator with its default intra_threads sets
    it to the number of cores). Children get the same from subprocess_env()."""
    torch.set_num_threads(1)


@pytest.fixture
def two_threads():
    """Two intra-op threads for this test (pytest_runtest_setup sets one before each test): searches side by side."""
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(1)


@pytest.fixture
def cpu_with_bf16_flags(monkeypatch):
    """Sets the native bf16 flags this CPU seems to have (e.g. ["amx_bf16"], or [] for none), whatever the CPU at
    hand and whatever TRANSFORMER_NATIVE_BF16 the suite runs under."""
    monkeypatch.delenv(device_module.NATIVE_BF16_VARIABLE, raising=False)

    def seem_to_have(flags: list[str]) -> None:
        monkeypatch.setattr(device_module, "cpu_bf16_flags", lambda: flags)

    return seem_to_have


@pytest.fixture
def call(capsys, monkeypatch):
    """`transformer ARGV` in this process -> (exit status, stdout, stderr); stdin="..." feeds standard input."""

    def run(*argv, stdin: str | None = None) -> tuple[int, str, str]:
        if stdin is not None:
            monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
        status = 0
        try:
            cli_module.main([str(a) for a in argv])
        except SystemExit as e:
            status = e.code
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def random_seed() -> int:
    """A new seed every run, for a test meant to explore (a kill at any step). It is printed, so a failure's
    report shows it; TEST_SEED=N gives it again."""
    seed = int(os.environ.get("TEST_SEED") or random.SystemRandom().randrange(2**32))
    print(f"random seed {seed}: TEST_SEED={seed} repeats this run")
    return seed


# --------------------------------------------------------------------------- data


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """`datasets` without a network: folders of jsonl files stand in for hub datasets."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache", raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    return tmp_path


@pytest.fixture
def corpus(tmp_path):
    """A corpus to prepare: 300 training and 30 validation pairs of the reversal task, each split ending in a blank
    side and a whitespace-only line (dropped and counted)."""
    directory = write_corpus(tmp_path / "corpus", n_train=300, n_valid=30, seed=4)
    for split in ("train", "valid"):
        with (directory / f"{split}.de").open("a", encoding="utf-8") as f:
            f.write("\n   \nder hund\n")
        with (directory / f"{split}.en").open("a", encoding="utf-8") as f:
            f.write("the dog\nthe cat\n\n")
    return directory


# --------------------------------------------------------------------------- checkpoints for translation


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    """A run directory as translate, evaluate and average see it: best.pt, two step checkpoints (untrained,
    different seeds) and a 12-pair test split in data.dir; beside it other_shape.pt (another d_ff)."""
    root = tmp_path_factory.mktemp("translate")
    rng = random.Random(0)
    data_dir, run_dir = root / "data", root / "run"
    data_dir.mkdir()
    (data_dir / "test.de").write_text("\n".join(sentences(rng, 12)) + "\n", encoding="utf-8")
    (data_dir / "test.en").write_text("\n".join(sentences(rng, 12)) + "\n", encoding="utf-8")
    vocab = train_vocab(sentences(rng, 300), vocab_size=80)
    raw = translation_config(data_dir, run_dir)
    write_checkpoint(run_dir / "best.pt", raw, vocab, seed=1)
    write_checkpoint(run_dir / "step_00000100.pt", raw, vocab, seed=2)
    write_checkpoint(run_dir / "step_00000200.pt", raw, vocab, seed=3)
    write_checkpoint(root / "other_shape.pt", translation_config(data_dir, run_dir, d_ff=48), vocab, seed=4)
    return run_dir


@pytest.fixture(scope="session")
def untrained_checkpoint(tmp_path_factory) -> Path:
    """model.pt: an untrained model (as in `run`) with a vocabulary of WORDS."""
    root = tmp_path_factory.mktemp("untrained")
    vocab = train_vocab(sentences(0, 300), vocab_size=80)
    write_checkpoint(root / "model.pt", translation_config(root, root), vocab, seed=1)
    return root / "model.pt"


@pytest.fixture(scope="session")
def copy_model(tmp_path_factory) -> Path:
    """A checkpoint that copies its input by construction (helpers.copying_model): the same outputs on every CPU
    and in every precision, each choice far from a tie, and every hypothesis ends at or before the source's EOS."""
    return write_copying_checkpoint(tmp_path_factory.mktemp("copy") / "model.pt")


# --------------------------------------------------------------------------- Hugging Face MarianMTModel directories


@pytest.fixture
def hf_offline(monkeypatch):
    """transformers and the hub client read local files alone: a request to the hub fails the test."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def marian_dir(tmp_path_factory) -> Path:
    """write_marian_dir's directory (shared: read, never written)."""
    return write_marian_dir(tmp_path_factory.mktemp("marian") / "opus-mt-tiny")


@pytest.fixture(scope="session")
def ctranslate2():
    """The ctranslate2 module; the test is skipped where it is not installed (an optional extra)."""
    return pytest.importorskip("ctranslate2")


@pytest.fixture(scope="session")
def singles(run):
    """Each sentence translated alone, in fp32: what any batching and ordering must reproduce (in bf16, which `auto`
    is on some CPUs, a batch's shape changes the sums enough to flip a random model's near-ties)."""
    translator = Translator(run, "cpu", SearchFlags(dtype="fp32"))
    return [translator.translate([s])[0] for s in SENTENCES]
