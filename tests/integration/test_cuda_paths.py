"""The CUDA code paths on a CPU, with stand-ins for the CUDA calls they make (issue 32): the GPU index every thread
and process gets, TF32 where training computes, the allocator setting, GPU memory in the logs, the masks the
attention kernels receive, one host read per update and per decoder step, resume across machines, the fp16 scaler,
DDP's settings and train.compile's alignment, the peak MFU divides by on a GPU (on a CPU: tests/core/test_peak.py).
tests/integration/test_cuda.py runs the same paths on a GPU, where there is one."""

from __future__ import annotations

import ast
import contextlib
import functools
import gc
import inspect
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.helpers import (
    LINES,
    ROOT,
    built_run,
    random_pairs,
    read_metrics,
    sampling_settings,
    subprocess_env,
    tiny_config,
)
from transformer import device as device_module
from transformer import peak as peak_module
from transformer.config import DataConfig, ModelConfig, from_dict
from transformer.data.batch import CAUSAL, Batch, prepare_sources, target_mask
from transformer.data.loader import BatchStream, Prefetcher
from transformer.data.store import Corpus
from transformer.data.vocab import PAD_ID
from transformer.device import (
    ALLOC_CONF_VARIABLES,
    DEFAULT_ALLOC_CONF,
    autocast_context,
    cuda_memory_peaks,
    default_cuda_allocator,
    pick_device,
    tf32_matmuls,
)
from transformer.distributed import DistInfo, init_distributed, wrap_ddp
from transformer.errors import UserError
from transformer.inference import constraints as constraints_module
from transformer.inference import search as search_module
from transformer.inference.constraints import constrained_search
from transformer.inference.sampling import Sampler, sample_search
from transformer.inference.search import search
from transformer.inference.settings import SearchSettings
from transformer.model import transformer as model_module
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.model.kv_cache import KVCache
from transformer.model.transformer import TokenPacking, Transformer
from transformer.peak import datasheet_tflops, mfu_peak
from transformer.signals import StopRequested
from transformer.training import finish as finish_module
from transformer.training import loop as train_module
from transformer.training import update as update_module
from transformer.training import validation as validation_module
from transformer.training.loop import check_compile, train
from transformer.training.optim import build_optimizer
from transformer.training.run_state import restore_training, rng_state, set_rng_state
from transformer.training.update import TrainingLoss, make_grad_scaler


class FakeCuda:
    """What torch.cuda answers on a machine with GPUs, for code that only asks: the current device, and
    set_device with torch's own argument check, recorded per thread."""

    def __init__(self):
        self.current = 0
        self.set_calls: list[tuple[str, int]] = []

    def set_device(self, device) -> None:
        index = torch.cuda._utils._get_device_index(device)  # raises for torch.device("cuda"), as torch does
        self.set_calls.append((threading.current_thread().name, index))


@pytest.fixture
def fake_cuda(monkeypatch) -> FakeCuda:
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.current)
    monkeypatch.setattr(torch.cuda, "set_device", fake.set_device)
    return fake


# --------------------------------------------------------------------------- the GPU index (the blocker)


@pytest.mark.parametrize("device, index", [(torch.device("cuda"), 1), (torch.device("cuda", 0), 0)])
def test_the_batch_thread_gets_the_gpu_as_an_index_resolved_in_the_main_thread(fake_cuda, monkeypatch, device, index):
    # Every single-GPU run stopped here: init_distributed gave torch.device("cuda") and the thread's
    # set_device refused it ("Expected a torch.device with a specified index").
    fake_cuda.current = 1
    pinned = []
    monkeypatch.setattr(Batch, "pin_memory", lambda self: pinned.append(self) or self)  # pinning needs a GPU
    stream = BatchStream(Corpus.from_pairs(random_pairs(60, max_len=10)), DataConfig(max_tokens=100), seed=1)
    prefetch = Prefetcher(stream, pin_memory=True, device=device)
    try:
        update = prefetch.next()
    finally:
        prefetch.close()
    assert update.batches and pinned
    assert fake_cuda.set_calls == [("batch-prefetch", index)]


@pytest.mark.parametrize("name", ["cuda", "auto"])
def test_a_single_process_on_cuda_gets_its_current_gpu_with_its_index(fake_cuda, monkeypatch, name):
    monkeypatch.setenv("WORLD_SIZE", "1")
    fake_cuda.current = 1
    info, device = init_distributed(name)
    assert not info.enabled and device == torch.device("cuda", 1)
    assert pick_device(name) == torch.device("cuda", 1)  # translate, evaluate, serve, finish
    fake_cuda.set_device(device)  # what the batch thread does with it: accepted


def test_a_torchrun_rank_binds_its_own_gpu_before_anything_touches_one(fake_cuda, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    asked = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append("current_device") or 0)  # GPU 0's context
    joined = {}

    @functools.wraps(dist.init_process_group)  # the real signature, which init_distributed reads
    def init_process_group(backend, **kwargs):
        joined.update(backend=backend, **kwargs)

    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    info, device = init_distributed("cuda")
    assert (info.rank, info.world_size, device) == (1, 2, torch.device("cuda", 1))
    assert fake_cuda.set_calls == [("MainThread", 1)] and not asked
    assert joined["backend"] == "nccl"
    if "device_id" in inspect.signature(init_process_group).parameters:  # torch >= 2.3
        assert joined["device_id"] == torch.device("cuda", 1)


def test_no_cuda_device_without_an_index_is_built_anywhere_in_the_package():
    found = []
    for path in sorted((ROOT / "transformer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) == "torch.device"
                and len(node.args) == 1
                and "'cuda'" in ast.unparse(node.args[0])
            ):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert not found


# --------------------------------------------------------------------------- TF32


def test_tf32_is_on_inside_the_block_on_cuda_and_put_back_after():
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    with tf32_matmuls(torch.device("cuda", 0)):
        assert matmul.allow_tf32
    assert matmul.allow_tf32 == before
    with pytest.raises(KeyError), tf32_matmuls(torch.device("cuda", 0)):
        raise KeyError("an error inside")
    assert matmul.allow_tf32 == before
    with tf32_matmuls(torch.device("cpu")):
        assert matmul.allow_tf32 == before


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch < 2.9")
def test_tf32_leaves_a_choice_made_through_torchs_newer_setting_alone():
    code = (
        "import torch\nfrom transformer.device import tf32_matmuls\nm = torch.backends.cuda.matmul\n"
        "m.allow_tf32 = True\nm.fp32_precision = 'ieee'\n"  # the user's choice, in the newer setting
        "with tf32_matmuls(torch.device('cuda', 0)):\n    print(m.fp32_precision)\nprint(m.fp32_precision)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ieee", "ieee"]


def test_training_validation_and_the_end_of_training_compute_with_tf32_on(tmp_path, monkeypatch):
    # On a CPU the block changes nothing: the stand-in opens it as for a GPU.
    as_gpu = lambda device: device_module.tf32_matmuls(torch.device("cuda", 0))  # noqa: E731
    monkeypatch.setattr(train_module, "tf32_matmuls", as_gpu)
    monkeypatch.setattr(finish_module, "tf32_matmuls", as_gpu)
    seen: dict[str, set] = {"train": set(), "valid": set(), "finish": set()}

    def spy(where, fn):
        def wrapped(*args, **kwargs):
            seen[where].add(torch.backends.cuda.matmul.allow_tf32)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(update_module, "label_smoothed_loss", spy("train", update_module.label_smoothed_loss))
    monkeypatch.setattr(validation_module, "label_smoothed_loss", spy("valid", validation_module.label_smoothed_loss))
    monkeypatch.setattr(finish_module, "translate_and_score", spy("finish", finish_module.translate_and_score))
    before = torch.backends.cuda.matmul.allow_tf32
    train(from_dict(tiny_config(tmp_path, train={"max_steps": 4, "valid_every": 2, "finish": True})), quiet=True)
    assert seen == {"train": {True}, "valid": {True}, "finish": {True}}
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_translate_help_says_what_fp32_means_on_cuda(call):
    status, out, _ = call("translate", "--help")
    assert status == 0 and "on CUDA full fp32, TF32 tensor cores off" in " ".join(out.split())


# --------------------------------------------------------------------------- memory


def test_the_allocator_gets_expandable_segments_unless_the_user_chose(monkeypatch):
    environ: dict = {}
    assert default_cuda_allocator(environ) and environ == {"PYTORCH_CUDA_ALLOC_CONF": DEFAULT_ALLOC_CONF}
    for name in ALLOC_CONF_VARIABLES:
        environ = {name: "max_split_size_mb:128"}
        assert not default_cuda_allocator(environ) and environ == {name: "max_split_size_mb:128"}
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # too late: the allocator has read it
    environ = {}
    assert not default_cuda_allocator(environ) and environ == {}


def test_the_command_line_and_train_set_it_before_they_start(call, monkeypatch, tmp_path):
    for name in ALLOC_CONF_VARIABLES:
        monkeypatch.setenv(name, "")  # recorded, so that the teardown removes what the code sets
        monkeypatch.delenv(name)
    status, _, err = call("translate", str(tmp_path / "missing.pt"))
    assert status == 2 and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == DEFAULT_ALLOC_CONF
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")

    def stop(name):
        raise KeyError(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))

    monkeypatch.setattr(train_module, "init_distributed", stop)  # the first thing that could touch a GPU
    with pytest.raises(KeyError, match=DEFAULT_ALLOC_CONF):
        train(from_dict(tiny_config(tmp_path)), quiet=True)


def test_gpu_peak_memory_goes_to_metrics_the_log_and_the_summary(tmp_path, monkeypatch):
    assert cuda_memory_peaks(torch.device("cpu")) == {}
    peaks = {"peak_cuda_allocated_mib": 1234.4, "peak_cuda_reserved_mib": 2048.0}
    monkeypatch.setattr(train_module, "cuda_memory_peaks", lambda device: peaks)
    run_dir = train(
        from_dict(tiny_config(tmp_path, train={"max_steps": 2, "valid_every": 2, "finish": True})), quiet=True
    )
    done = [m for m in read_metrics(run_dir) if m.get("event") == "done"][-1]
    assert done["peak_cuda_allocated_mib"] == [1234.4] and done["peak_cuda_reserved_mib"] == [2048.0]
    assert done["peak_rss_mib"][0] > 0
    assert "GPU peak 1234 MiB allocated, 2048 MiB reserved" in (run_dir / "train.log").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["peak_cuda_allocated_mib"] == [1234.4] and summary["peak_cuda_reserved_mib"] == [2048.0]
    assert summary["peak_rss_mib"] == done["peak_rss_mib"]


# --------------------------------------------------------------------------- attention masks


def padded_batch(seed: int = 0) -> Batch:
    return Batch.from_pairs(random_pairs(lengths=[(7, 9), (3, 2), (5, 6)], vocab=50, seed=seed))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_kernels_get_one_additive_mask_per_forward_in_the_queries_dtype_and_is_causal(monkeypatch, precision):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        calls.append((q.dtype, attn_mask, is_causal, dropout_p))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(d_model=32, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=64, attention_dropout=0.1), 50
    ).train()
    batch = padded_batch()
    with autocast_context(torch.device("cpu"), precision):
        loss = TrainingLoss(model, 0.1)(batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask)
    loss.backward()
    assert len(calls) == 6 and all(dropout == 0.1 for *_, dropout in calls)
    encoder, decoder_self, cross = calls[:2], calls[2::2], calls[3::2]
    for _, mask, is_causal, _ in decoder_self:
        assert mask is None and is_causal  # no mask tensor: the flash kernel may run
    masks = [mask for _, mask, _, _ in encoder + cross]
    assert all(mask is masks[0] for mask in masks)  # built once for the forward pass
    for dtype, mask, is_causal, _ in encoder + cross:
        assert not is_causal and mask.dtype == dtype == (torch.bfloat16 if precision == "bf16" else torch.float32)
        assert all(stride % 8 == 0 for stride in mask.stride()[:-1])


def test_causal_alone_gives_real_target_positions_what_causal_and_padding_give():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=64), 50)
    batch = padded_batch(1)
    with torch.no_grad():
        explicit = model.eval()(batch.src, batch.tgt_in, batch.src_mask, target_mask(batch.tgt_in))
        causal = model(batch.src, batch.tgt_in, batch.src_mask, CAUSAL)
    real = batch.tgt_out != PAD_ID
    assert not real.all()  # padded rows, whose padded positions alone may differ
    torch.testing.assert_close(causal[real], explicit[real], rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- host reads


class HostReads:
    """Counts what makes the host wait for a GPU: reading a tensor's values on the host, and building a device
    tensor from host data (torch.tensor(..., device=...), or indexing with a list or array, which torch copies to
    the device as an index tensor: a copy from pageable memory)."""

    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy", "nonzero", "cpu")

    def __init__(self, monkeypatch):
        self.reads: list[str] = []
        self.copies = 0
        self.paused = False
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counting(name, real))
        real_tensor = torch.tensor

        def tensor(*args, **kwargs):
            if kwargs.get("device") is not None and not self.paused:
                self.copies += 1
            return real_tensor(*args, **kwargs)

        monkeypatch.setattr(torch, "tensor", tensor)
        for name in ("__getitem__", "__setitem__"):
            monkeypatch.setattr(torch.Tensor, name, self._indexing(getattr(torch.Tensor, name)))

    def _indexing(self, real):
        def method(tensor, key, *args):
            parts = key if isinstance(key, tuple) else (key,)
            if not self.paused and any(isinstance(k, (list, np.ndarray)) for k in parts):
                self.copies += 1
            return real(tensor, key, *args)

        return method

    def _counting(self, name, real):
        def method(tensor, *args, **kwargs):
            if not self.paused:
                self.reads.append(name)
            return real(tensor, *args, **kwargs)

        return method

    @contextlib.contextmanager
    def pause(self):
        self.paused, before = True, self.paused
        try:
            yield
        finally:
            self.paused = before


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Token packing and the cache's row reordering as on CUDA (the CPU-only paths read the mask and the rows that
    move on the host by design)."""
    monkeypatch.setattr(TokenPacking, "of", staticmethod(lambda mask: None))
    monkeypatch.setattr(KVCache, "_in_place", lambda self, index: False)


def test_an_update_reads_the_device_once_and_copies_nothing_from_pageable_memory(tmp_path, monkeypatch, as_on_cuda):
    cfg = from_dict(
        tiny_config(tmp_path, train={"update_freq": 2, "clip_norm": 1.0, "peak_tflops": 1.0, "precision": "fp32"})
    )
    run, store = built_run(cfg)
    # The optimizer as on CUDA: fused (the CPU's default per-tensor Adam reads its step counts on the host).
    run.optimizer = torch.optim.Adam(run.model.parameters(), lr=1e-4, fused=True)
    stream = BatchStream(store.corpus("train"), cfg.data, seed=1, update_freq=2)
    train_module.train_update(run, stream.next_update(), StopRequested())  # the first: optimizer state created
    counter = HostReads(monkeypatch)
    stop = StopRequested()
    stop.signal_name = "SIGTERM"
    result = train_module.train_update(run, stream.next_update(), stop)
    assert counter.reads == ["tolist"] and counter.copies == 0  # loss, flags and gradient norm in one read
    assert result.stop_requested and not result.nonfinite and result.grad_norm > 0


@pytest.mark.parametrize("beam", [1, 4])
def test_a_decoder_step_reads_the_device_once(copy_model, monkeypatch, as_on_cuda, beam):
    model, vocab, _ = model_from_checkpoint(load_checkpoint(copy_model))
    src, _ = prepare_sources(vocab.encode(LINES[:12]), model.cfg.max_positions)
    expected = search(model, src, SearchSettings(beam=beam, max_len_offset=8))
    transfers = []
    counter = HostReads(monkeypatch)
    real = search_module.to_host

    def to_host(*tensors):
        transfers.append(len(tensors))
        with counter.pause():  # one copy on CUDA (the CPU reads each tensor's own memory)
            return real(*tensors)

    monkeypatch.setattr(search_module, "to_host", to_host)
    found = search(model, src, SearchSettings(beam=beam, max_len_offset=8))
    assert [h.tokens for h in found.best()] == [h.tokens for h in expected.best()]
    assert counter.reads == [] and counter.copies == 0
    assert len(transfers) == found.steps + 1  # the length limits once, then one read per decoder step


def test_a_forced_prefix_and_sampling_read_the_device_no_more(copy_model, monkeypatch, as_on_cuda):
    """A forced prefix goes to the device once, without waiting, and its steps read nothing more; sampling reads
    the sources once (the keys of its random streams), then draws without a read: its random numbers are made on
    the host and go to the device without waiting; the constrained search reads once a step too."""
    model, vocab, _ = model_from_checkpoint(load_checkpoint(copy_model))
    ids = vocab.encode(LINES[:12])
    src, _ = prepare_sources(ids, model.cfg.max_positions)
    prefixes = [s[:2] for s in ids]
    sampler = Sampler("topp", 0.9, seed=1)
    expected = [
        search(model, src, SearchSettings(beam=4, max_len_offset=8), prefixes=prefixes),
        sample_search(model, src, sampling_settings(sampler)),
    ]
    counter = HostReads(monkeypatch)
    transfers = []
    real = search_module.to_host

    def to_host(*tensors):
        transfers.append(len(tensors))
        with counter.pause():  # the step's one read, counted here
            return real(*tensors)

    monkeypatch.setattr(search_module, "to_host", to_host)
    monkeypatch.setattr(constraints_module, "to_host", to_host)
    found = search(model, src, SearchSettings(beam=4, max_len_offset=8), prefixes=prefixes)
    assert counter.reads == [] and counter.copies == 0 and len(transfers) == found.steps + 1
    transfers.clear()
    drawn = sample_search(model, src, sampling_settings(sampler))
    assert counter.reads == ["tolist"] and counter.copies == 0 and len(transfers) == drawn.steps + 1
    counter.reads.clear()
    transfers.clear()
    kept = constrained_search(
        model,
        src,
        [[tuple(s[-2:])] for s in ids],
        SearchSettings(beam=4, lenpen=0.6, max_len_offset=8, nbest=1, stop="exact"),
        prefixes=prefixes,
    )
    assert counter.reads == [] and counter.copies == 0 and len(transfers) == kept.steps + 1
    assert all(h.tokens[:2] == p for h, p in zip(kept.best(), prefixes))
    assert [[h.tokens for h in r.best()] for r in (found, drawn)] == [[h.tokens for h in r.best()] for r in expected]


# --------------------------------------------------------------------------- the peak MFU divides by on a GPU


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 80GB HBM3", "fp32", 494.7),
        ("NVIDIA H100 PCIe", "bf16", 756.5),
        ("NVIDIA H100 NVL", "fp16", 835.5),
        ("NVIDIA H200", "bf16", 989.4),
        ("NVIDIA H200 NVL", "fp32", 417.5),
        ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
        ("NVIDIA A100 80GB PCIe", "fp32", 156.0),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA A10", "fp32", 62.5),
        ("NVIDIA A10G", "bf16", None),
        ("NVIDIA GeForce RTX 4090", "bf16", None),
        ("NVIDIA H100", "bf16", None),
    ],
)  # a variant the table cannot tell apart: measured instead
def test_the_datasheet_peak_of_known_gpus(name, precision, tflops):
    found = datasheet_tflops(name, precision)
    assert (found[0] if found else None) == tflops
    if found:
        assert ("TF32" if precision == "fp32" else precision) in found[1]


def test_mfu_divides_by_the_config_then_the_datasheet_then_a_measurement(monkeypatch):
    probes = []
    monkeypatch.setattr(peak_module, "matmul_tflops", lambda device, precision: probes.append(precision) or 7.0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    gpu = torch.device("cuda", 0)
    assert mfu_peak(gpu, "bf16", 100.0).describe() == "100 TFLOP/s (train.peak_tflops)"
    assert mfu_peak(gpu, "bf16").describe() == "989 TFLOP/s (H100 SXM datasheet, dense bf16)" and not probes
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    peak = mfu_peak(gpu, "bf16")
    assert peak.tflops == 7.0 and probes == ["bf16"] and "measured" in peak.describe()
    assert mfu_peak(torch.device("cpu"), "fp32").tflops == 7.0


# --------------------------------------------------------------------------- resume across machines


class FakeGpuRng:
    """torch.cuda's RNG functions on a machine with `count` GPUs: get/set per device; the _all variants as torch's,
    which fail where a state names a GPU this machine lacks."""

    def __init__(self, count: int):
        self.count = count
        self.states = {i: torch.full((4,), i, dtype=torch.uint8) for i in range(count)}

    def get_rng_state(self, device="cuda"):
        return self.states[torch.device(device).index or 0].clone()

    def set_rng_state(self, state, device="cuda"):
        index = torch.device(device).index or 0
        if index >= self.count:
            raise RuntimeError(f"invalid device ordinal {index}")
        self.states[index] = state.clone()

    def get_rng_state_all(self):
        return [self.states[i].clone() for i in range(self.count)]

    def set_rng_state_all(self, states):
        for i, state in enumerate(states):
            self.set_rng_state(state, torch.device("cuda", i))


def test_the_checkpoint_holds_the_runs_own_gpu_stream_and_older_ones_restore_on_fewer_gpus(monkeypatch):
    big, small = FakeGpuRng(4), FakeGpuRng(1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, getattr(big, name))
    saved = rng_state(torch.device("cuda", 2))
    assert torch.equal(saved["cuda"], big.states[2])
    older = {**saved, "cuda": big.get_rng_state_all()}  # what a checkpoint held before: every visible GPU's
    assert "cuda" not in rng_state(torch.device("cpu"))

    for name in ("get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, getattr(small, name))  # resumed on a machine with one GPU
    set_rng_state(saved, torch.device("cuda", 0))
    assert torch.equal(small.states[0], big.states[2])
    set_rng_state(older, torch.device("cuda", 0))
    assert torch.equal(small.states[0], big.states[0])
    small.states[0] = torch.zeros(4, dtype=torch.uint8)
    set_rng_state(saved, torch.device("cpu"))  # resumed on a CPU: the CUDA stream is not the run's any more
    assert not small.states[0].any()


@pytest.mark.parametrize("saved_fused, fresh_fused", [(None, True), (True, None)])
def test_a_resumed_optimizer_keeps_the_implementation_of_the_device_it_runs_on(tmp_path, saved_fused, fresh_fused):
    # fused=True stands for a run on CUDA (build_optimizer), None for one on a CPU.
    torch.manual_seed(0)
    model = Transformer(ModelConfig(d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32), 50)
    batch = padded_batch()
    first = torch.optim.Adam(model.parameters(), lr=1e-3, fused=saved_fused)
    for _ in range(2):
        TrainingLoss(model, 0.1)(batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask).backward()
        first.step()
        first.zero_grad()
    torch.save({"model": model.state_dict(), "optimizer": first.state_dict(), "scaler": {}}, tmp_path / "c.pt")
    saved = torch.load(tmp_path / "c.pt", weights_only=True)
    fresh = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fresh_fused)
    restore_training(saved, model, fresh, make_grad_scaler(torch.device("cpu"), "fp32"))
    assert fresh.param_groups[0]["fused"] == fresh_fused
    assert (
        fresh.param_groups[0]["foreach"] == torch.optim.Adam(model.parameters(), fused=fresh_fused).defaults["foreach"]
    )
    state = next(iter(fresh.state.values()))
    assert float(state["step"]) == 2.0
    TrainingLoss(model, 0.1)(batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask).backward()
    fresh.step()  # the implementation of this device runs on the restored moments
    assert float(next(iter(fresh.state.values()))["step"]) == 3.0


def test_build_optimizer_asks_for_fused_kernels_only_on_cuda():
    model = torch.nn.Linear(2, 2)
    assert build_optimizer(model, from_dict({})).param_groups[0]["fused"] is None


def test_the_fp16_loss_scale_starts_at_2_to_the_7():
    scaler = make_grad_scaler(torch.device("cpu"), "fp16")
    assert scaler.is_enabled() and scaler.get_scale() == 2.0**7
    assert not make_grad_scaler(torch.device("cpu"), "bf16").is_enabled()


# --------------------------------------------------------------------------- DDP and compile


def test_ddp_hands_the_gradients_over_as_views_of_its_buckets(tmp_path):
    def backward_through_ddp() -> None:
        model = Transformer(ModelConfig(d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32), 50)
        ddp = wrap_ddp(TrainingLoss(model, 0.1), torch.device("cpu"))
        assert ddp.gradient_as_bucket_view and not ddp.broadcast_buffers
        batch = padded_batch()
        ddp(batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask).backward()
        assert all(p.grad is not None for p in model.parameters())

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        backward_through_ddp()
    finally:
        # DDP's reducer freed while its process group lives: freed after destroy_process_group (as the test's
        # locals were, before), gloo's destructor at times hung joining its threads under load.
        gc.collect()
        dist.destroy_process_group()


def test_compile_on_cuda_needs_lengths_padded_to_a_multiple_of_8(tmp_path, monkeypatch):
    raw = tiny_config(tmp_path, train={"compile": True, "precision": "fp32"})
    gpu = torch.device("cuda", 0)
    with pytest.raises(
        UserError,
        match=r"needs data.pad_to_multiple to be a multiple of 8 \(it is 1\): add --set "
        r"data.pad_to_multiple=8",
    ):
        check_compile(from_dict(raw), gpu)
    check_compile(from_dict({**raw, "data": {**raw["data"], "pad_to_multiple": 16}}), gpu)
    check_compile(from_dict(raw), torch.device("cpu"))
    # In train(), before a vocabulary or a store is built:
    monkeypatch.setattr(train_module, "init_distributed", lambda name: (DistInfo(), gpu))
    with pytest.raises(UserError, match="pad_to_multiple"):
        train(from_dict(raw), quiet=True)
    assert not (tmp_path / "run").exists()
