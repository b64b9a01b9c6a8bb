"""CUDA-only behaviour (skipped on machines without a GPU; scripts/gpu_report.py runs this file first): single-GPU
training gets past its first update, mixed precision, TF32, the allocator, GPU memory in the logs, a CUDA-trained
run translated and resumed on a CPU (and the other way round), resume on CUDA, int8 refused, the attention
kernels the model's masks get, one host sync per update and per decoder step, bf16 translation, and a compiled
training step. tests/integration/test_cuda_paths.py proves the same paths on a CPU with stand-ins."""

from __future__ import annotations

import subprocess
import sys
import traceback
import warnings
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    LINES,
    ROOT,
    built_run,
    change_training_loss,
    random_pairs,
    read_metrics,
    subprocess_env,
    tiny_config,
)
from transformer.config import DataConfig, ModelConfig, from_dict
from transformer.data.batch import Batch, prepare_sources
from transformer.data.loader import BatchStream, Prefetcher
from transformer.data.store import Corpus
from transformer.device import autocast_context
from transformer.distributed import init_distributed
from transformer.errors import UserError
from transformer.inference.search import search
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.model import transformer as model_module
from transformer.model.checkpoint import load_checkpoint, model_from_checkpoint
from transformer.model.transformer import Transformer
from transformer.peak import datasheet_tflops
from transformer.signals import StopRequested
from transformer.training import loop as train_module
from transformer.training import update as update_module
from transformer.training import validation as validation_module
from transformer.training.loop import train
from transformer.training.update import TrainingLoss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MATH = 0  # torch._fused_sdp_choice's number for the math kernel (SDPBackend.MATH)


def cuda_config(tmp_path, run: str = "run", **train_settings) -> dict:
    return tiny_config(tmp_path, run, train={"device": "cuda", **train_settings})


def test_a_single_gpu_run_has_an_indexed_device_and_gets_past_its_first_update(tmp_path):
    info, device = init_distributed("cuda")
    assert not info.enabled and device.index == torch.cuda.current_device()
    stream = BatchStream(Corpus.from_pairs(random_pairs(60, max_len=10)), DataConfig(max_tokens=100), seed=1)
    prefetch = Prefetcher(stream, pin_memory=True, device=torch.device("cuda"))
    try:
        update = prefetch.next()  # the thread's set_device and pinning: the blocker of issue 32
    finally:
        prefetch.close()
    assert all(b.src.is_pinned() for b in update.batches)
    run_dir = train(from_dict(cuda_config(tmp_path, max_steps=3, valid_every=3, precision="bf16")), quiet=True)
    assert load_checkpoint(run_dir / "last.pt")["run"]["step"] == 3


def test_fp16_overflow_lowers_the_loss_scale_and_skips_the_update(tmp_path, monkeypatch):
    # finite in fp32, inf once scaled into fp16 gradients
    change_training_loss(monkeypatch, lambda n, loss: loss * 1e8 if n == 5 else loss)
    run_dir = train(from_dict(cuda_config(tmp_path, max_steps=8, valid_every=100, precision="fp16")), quiet=True)
    state = load_checkpoint(run_dir / "last.pt")
    assert state["run"]["step"] == 8
    assert state["scaler"]["scale"] < 2.0**7  # lowered from the initial 128 (fairseq's and NVIDIA's)
    assert "non-finite loss or gradient; skipped" in (run_dir / "train.log").read_text()
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_cuda_training_learns_and_logs_gpu_memory_and_mfu(tmp_path, precision):
    run_dir = train(
        from_dict(
            cuda_config(
                tmp_path,
                max_steps=30,
                valid_every=10,
                precision=precision,
                lr_schedule="inverse_sqrt",
                lr=3e-3,
                peak_tflops=0.0,  # tiny_config's given peak would be logged as given: this checks the datasheet's
            )
        ),
        quiet=True,
    )
    metrics = read_metrics(run_dir)
    valid = [m["loss"] for m in metrics if m.get("split") == "valid"]
    assert valid[-1] < valid[0]
    assert all(0 < m["mfu"] <= 1 for m in metrics if m.get("split") == "train")
    done = [m for m in metrics if m.get("event") == "done"][-1]
    assert 0 < done["peak_cuda_allocated_mib"][0] <= done["peak_cuda_reserved_mib"][0]
    log = (run_dir / "train.log").read_text()
    assert "GPU peak" in log
    if datasheet_tflops(torch.cuda.get_device_name(), precision) is not None:
        assert "datasheet" in log.split("MFU below is against", 1)[1].splitlines()[0]


def test_tf32_is_on_while_training_in_fp32_and_off_after(tmp_path, monkeypatch):
    seen = set()
    real = validation_module.label_smoothed_loss

    def spy(*args, **kwargs):
        seen.add(torch.backends.cuda.matmul.allow_tf32)
        return real(*args, **kwargs)

    monkeypatch.setattr(update_module, "label_smoothed_loss", spy)
    monkeypatch.setattr(validation_module, "label_smoothed_loss", spy)
    before = torch.backends.cuda.matmul.allow_tf32
    train(from_dict(cuda_config(tmp_path, max_steps=4, valid_every=2, precision="fp32")), quiet=True)
    assert seen == {True} and torch.backends.cuda.matmul.allow_tf32 == before


def test_the_allocator_uses_expandable_segments_unless_told_otherwise():
    code = (
        "from transformer.device import default_cuda_allocator\ndefault_cuda_allocator()\nimport torch\n"
        "x = torch.zeros(1 << 20, device='cuda')\n"
        "print(all(s.get('is_expandable', False) for s in torch.cuda.memory._snapshot()['segments']))\n"
    )
    env = {k: v for k, v in subprocess_env().items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["True"], result.stderr
    env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0 and result.stdout.split() == ["False"], result.stderr


def _fused_flags(monkeypatch) -> list:
    flags = []
    real = train_module.restore_training

    def restore(saved, model, optimizer, scaler):
        real(saved, model, optimizer, scaler)
        flags.append(optimizer.param_groups[0]["fused"])

    monkeypatch.setattr(train_module, "restore_training", restore)
    return flags


def test_a_cuda_trained_run_translates_and_resumes_on_a_cpu_and_back(tmp_path, monkeypatch):
    raw = cuda_config(tmp_path, max_steps=6, valid_every=3, precision="bf16")
    run_dir = train(from_dict(raw), quiet=True)
    saved = load_checkpoint(run_dir / "last.pt")
    assert isinstance(saved["rng"][0]["cuda"], torch.Tensor)  # the run's own GPU's stream, not a list of all
    on_cpu = Translator(run_dir / "last.pt", "cpu", SearchFlags(dtype="fp32")).translate(LINES)
    on_gpu = Translator(run_dir / "last.pt", "cuda", SearchFlags(dtype="fp32")).translate(LINES)
    assert len(on_cpu) == len(LINES) and sum(a == b for a, b in zip(on_cpu, on_gpu)) >= 0.5 * len(LINES)
    flags = _fused_flags(monkeypatch)
    raw["train"].update(device="cpu", precision="fp32", max_steps=9)
    train(from_dict(raw), resume=True, quiet=True)  # the CPU's optimizer, not CUDA's fused kernels
    raw["train"].update(device="cuda", max_steps=12)
    train(from_dict(raw), resume=True, quiet=True)  # and back: fused again
    assert flags == [None, True]
    assert load_checkpoint(run_dir / "last.pt")["run"]["step"] == 12


def test_resume_on_cuda_continues_the_run_within_tolerance(tmp_path):
    # GPU kernels (atomics in the embedding's backward) are not bit-reproducible: close, not equal.
    whole = train(from_dict(cuda_config(tmp_path, "whole", max_steps=8, valid_every=4, precision="fp32")), quiet=True)
    raw = cuda_config(tmp_path, "split", max_steps=4, valid_every=4, precision="fp32")
    train(from_dict(raw), quiet=True)
    raw["train"]["max_steps"] = 8
    split = train(from_dict(raw), resume=True, quiet=True)
    a, b = load_checkpoint(whole / "last.pt"), load_checkpoint(split / "last.pt")
    assert a["run"]["step"] == b["run"]["step"] == 8
    for key in a["model"]:
        torch.testing.assert_close(b["model"][key], a["model"][key], rtol=1e-3, atol=1e-4)


def test_int8_on_cuda_is_refused_with_the_fix(copy_model):
    with pytest.raises(UserError, match="int8 is a CPU path: use --device cpu"):
        Translator(copy_model, "cuda", SearchFlags(dtype="int8"))


def test_auto_dtype_on_cuda_is_bf16_and_close_to_fp32(copy_model):
    auto = Translator(copy_model, "cuda", SearchFlags(beam=3, dtype="auto"))
    assert auto.settings.dtype == ("bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32")
    assert next(auto.model.parameters()).dtype == (torch.bfloat16 if auto.settings.dtype == "bf16" else torch.float32)
    fp32 = Translator(copy_model, "cuda", SearchFlags(beam=3, dtype="fp32")).translate(LINES)
    assert sum(a == b for a, b in zip(fp32, auto.translate(LINES))) >= 0.75 * len(LINES)
    cpu = Translator(copy_model, "cpu", SearchFlags(beam=3, dtype="fp32")).translate(LINES)
    assert sum(a == b for a, b in zip(fp32, cpu)) >= 0.9 * len(LINES)  # the same search on either device


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_the_models_masks_never_get_the_math_kernel(monkeypatch, precision):
    chosen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        chosen.append(
            (
                tuple(q.shape),
                attn_mask is not None,
                is_causal,
                dropout_p,
                int(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal)),
            )
        )
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(model_module.F, "scaled_dot_product_attention", spy)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    # Multi30k's dimensions: heads of 64, attention dropout 0.1; lengths not multiples of 8.
    model = Transformer(
        ModelConfig(d_model=256, n_heads=4, n_encoder_layers=2, n_decoder_layers=2, d_ff=512, attention_dropout=0.1),
        300,
    ).to(device)
    batch = Batch.from_pairs([([5] * 13, [6] * 11), ([7] * 5, [8] * 17), ([9] * 9, [4] * 3)]).to(device)
    with autocast_context(device, precision):
        TrainingLoss(model.train(), 0.1)(
            batch.src, batch.tgt_in, batch.tgt_out, batch.src_mask, batch.tgt_mask
        ).backward()
        with torch.no_grad():
            model.eval()(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)  # validation
    src, _ = prepare_sources([[5] * 13, [7] * 5, [9] * 9], model.cfg.max_positions)
    search(
        model.float(), src.to(device), SearchSettings(beam=4, max_len_offset=3)
    )  # decoding: cached steps, beams per source
    assert any(dropout == 0.1 for *_, dropout, _ in chosen) and any(causal for *_, causal, _, _ in chosen)
    assert [c for c in chosen if c[-1] == MATH] == []


def _syncs(fn) -> list[str]:
    """Where fn makes synchronizing CUDA calls (torch.cuda.set_sync_debug_mode's warnings): file:line of the
    Python frame that triggered each, so that a failure names the sites (torch's own kernels among them)."""
    torch.cuda.synchronize()
    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            # the innermost frame of this repository that led to it, then the library's frames down to the sync
            stack = traceback.extract_stack()[:-1]
            ours = [i for i, f in enumerate(stack) if str(ROOT) in f.filename and f.filename != __file__]
            frames = stack[ours[-1] :] if ours else stack[-3:]
            sites.append(" > ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames) + f" ({filename}:{lineno})")

    # Set outside the recording: torch 2.11 warns about syncs once when the mode is first set, from the setter.
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sites


def test_an_update_synchronizes_once(tmp_path):
    cfg = from_dict(cuda_config(tmp_path, update_freq=2, clip_norm=1.0, precision="bf16"))
    run, store = built_run(cfg, torch.device("cuda", torch.cuda.current_device()))
    stream = BatchStream(store.corpus("train"), cfg.data, seed=1, update_freq=2)

    def update():
        u = stream.next_update()
        u.batches = [b.pin_memory() for b in u.batches]  # as the batch thread hands them over
        return u

    for _ in range(2):  # optimizer state, cuBLAS workspaces, autocast caches
        train_module.train_update(run, update(), StopRequested())
    ready = update()
    sites = _syncs(lambda: train_module.train_update(run, ready, StopRequested()))
    assert len(sites) <= 1, sites


@pytest.mark.parametrize("beam", [1, 4])
def test_a_decoder_step_synchronizes_once(copy_model, beam):
    device = torch.device("cuda", torch.cuda.current_device())
    model, vocab, _ = model_from_checkpoint(load_checkpoint(copy_model), device)
    src, _ = prepare_sources(vocab.encode(LINES[:16]), model.cfg.max_positions)
    src = src.to(device)
    search(model, src, SearchSettings(beam=beam, max_len_offset=8))  # warm
    found = []
    sites = _syncs(lambda: found.append(search(model, src, SearchSettings(beam=beam, max_len_offset=8))))
    assert len(sites) <= found[0].steps + 1, sorted(set(sites))  # the length limits once, then one per step


def test_a_compiled_training_step_runs(tmp_path):
    raw = cuda_config(tmp_path, max_steps=3, valid_every=3, precision="bf16", compile=True)
    raw["data"]["pad_to_multiple"] = 8
    run_dir = train(from_dict(raw), quiet=True)
    assert load_checkpoint(run_dir / "last.pt")["run"]["step"] == 3
