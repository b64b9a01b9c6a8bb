"""The training loop, top to bottom: data, model, optimizer, updates, validation, checkpoints, resume."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from tqdm import tqdm

from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.config import Config, save_config, to_dict, from_dict
from transformer.data import BatchStream, encode_corpus, eval_batches, load_split
from transformer.errors import UserError
from transformer.model import Transformer, count_parameters
from transformer.optim import build_optimizer, label_smoothed_loss
from transformer.vocab import Vocab, train_vocab

log = logging.getLogger("transformer")

# Model and vocabulary cannot change under a resumed run; anything else in the config may.
FROZEN_ON_RESUME = ("model", "data.vocab_size", "data.spm_model_type", "data.src_lang", "data.tgt_lang")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device is 'cuda' but no CUDA device is available")
    return torch.device(name)


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def setup_logging(run_dir: Path) -> None:
    log.setLevel(logging.INFO)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    file_handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    console = logging.StreamHandler()
    console.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(file_handler)
    log.addHandler(console)
    log.propagate = False


def prepare_vocab(cfg: Config, run_dir: Path, src: list[str], tgt: list[str]) -> Vocab:
    """Reuse run_dir/spm.model, or train one on the training data and store it there."""
    path = run_dir / "spm.model"
    if path.is_file():
        log.info("vocab: reusing %s", path)
        return Vocab.load(path)
    d = cfg.data
    log.info("vocab: training a joint %s SentencePiece model of %d pieces on %d sentences",
             d.spm_model_type, d.vocab_size, len(src) + len(tgt))
    vocab = train_vocab((s for pair in zip(src, tgt) for s in pair), d.vocab_size, d.spm_model_type,
                        d.spm_character_coverage, d.spm_max_sentences, cfg.train.seed)
    vocab.save(path)
    return vocab


def load_pairs(cfg: Config, vocab: Vocab, split: str, limit: int):
    src, tgt = load_split(cfg.data, split)
    if limit:
        src, tgt = src[:limit], tgt[:limit]
    corpus = encode_corpus(vocab, src, tgt, cfg.data.max_len)
    log.info("data: %s: %d pairs kept, %d dropped as longer than data.max_len=%d, %d dropped with a blank side",
             split, len(corpus.pairs), corpus.dropped_long, cfg.data.max_len, corpus.dropped_blank)
    if not corpus.pairs:
        raise UserError(f"data: no usable pairs left in split {split!r}")
    return corpus.pairs


@torch.no_grad()
def evaluate_loss(model: Transformer, batches, device, precision: str, smoothing: float) -> dict:
    """Label-smoothed loss and NLL per target token; perplexity = exp(NLL)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, device=device, dtype=torch.float64)
    tokens = 0
    for batch in batches:
        batch = batch.to(device)
        with autocast_context(device, precision):
            logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        logits = logits.float()
        total[0] += label_smoothed_loss(logits, batch.tgt_out, smoothing)
        total[1] += label_smoothed_loss(logits, batch.tgt_out, 0.0)
        tokens += batch.n_tgt_tokens
    model.train(was_training)
    loss, nll = (total / max(tokens, 1)).tolist()
    return {"loss": loss, "nll": nll, "ppl": math.exp(min(nll, 50.0))}


@dataclass
class RunState:
    """Counters that must survive a restart."""

    step: int = 0
    best_valid_loss: float = float("inf")
    data: dict = field(default_factory=lambda: {"epoch": 0, "position": 0})


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag checked between updates, so the loop can save and exit."""

    def __init__(self):
        self.signal_name: Optional[str] = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame):
        if self.signal_name is not None:  # second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


def check_resume_config(saved: Config, new: Config) -> list[str]:
    """Refuse changes to frozen values; return descriptions of the changes that will apply."""
    old_d, new_d = to_dict(saved), to_dict(new)
    changes = []
    for section in new_d:
        for key, value in new_d[section].items():
            before = old_d[section][key]
            if before == value:
                continue
            if section in FROZEN_ON_RESUME or f"{section}.{key}" in FROZEN_ON_RESUME:
                raise UserError(f"resume: {section}.{key} was {before!r} in the checkpoint and is {value!r} now; "
                                "the model and vocabulary cannot change under a resumed run")
            changes.append(f"{section}.{key}: {before!r} -> {value!r}")
    return changes


def train(cfg: Config, resume: bool = False, config_path: Optional[str] = None, quiet: bool = False) -> Path:
    """Train according to cfg; returns the run directory."""
    t = cfg.train
    run_dir = Path(t.run_dir)
    last_path = run_dir / "last.pt"
    if last_path.exists() and not resume:
        raise UserError(f"{run_dir} already holds a run (last.pt); add --resume to continue it, "
                        "or set train.run_dir to a new directory")
    if resume and not last_path.exists():
        raise UserError(f"--resume: no checkpoint at {last_path}")
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_logging(run_dir)
    device = pick_device(t.device)
    if t.precision == "fp16" and device.type != "cuda":
        raise UserError("train.precision 'fp16' needs CUDA; use 'bf16' or 'fp32' on CPU")

    saved = load_checkpoint(last_path) if resume else None
    if saved is not None:
        for change in check_resume_config(from_dict(saved["config"]), cfg):
            log.info("resume: config change applies: %s", change)
    save_config(cfg, run_dir / "config.yaml")
    seed_everything(t.seed)

    # Data and vocabulary.
    train_src, train_tgt = load_split(cfg.data, cfg.data.train_split)
    if cfg.data.max_train_pairs:
        train_src, train_tgt = train_src[: cfg.data.max_train_pairs], train_tgt[: cfg.data.max_train_pairs]
    vocab = Vocab(saved["vocab"]) if saved is not None else prepare_vocab(cfg, run_dir, train_src, train_tgt)
    corpus = encode_corpus(vocab, train_src, train_tgt, cfg.data.max_len)
    log.info("data: %s: %d pairs kept, %d dropped as longer than data.max_len=%d, %d dropped with a blank side",
             cfg.data.train_split, len(corpus.pairs), corpus.dropped_long, cfg.data.max_len, corpus.dropped_blank)
    if not corpus.pairs:
        raise UserError("data: no usable training pairs left after filtering")
    valid = eval_batches(load_pairs(cfg, vocab, cfg.data.valid_split, cfg.data.max_valid_pairs),
                         cfg.data.max_tokens, cfg.data.pad_to_multiple)

    # Model, optimizer, schedule.
    model = Transformer(cfg.model, len(vocab)).to(device)
    optimizer, scheduler = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    state = RunState()
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        scaler.load_state_dict(saved["scaler"])
        state = RunState(**saved["run"])
        # The schedule is a pure function of the step under the *new* config, so a changed
        # train.lr / warmup applies from the next update on; unchanged, this recomputes the same value.
        scheduler.base_lrs = [t.lr for _ in optimizer.param_groups]
        for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = t.lr
            group["lr"] = t.lr * lr_lambda(scheduler.last_epoch)  # exactly as LambdaLR computes it
        set_rng_state(saved["rng"])
        log.info("resume: continuing %s at step %d", last_path, state.step)
    stream = BatchStream(corpus.pairs, cfg.data, t.seed, **state.data)
    step_fn = torch.compile(model) if t.compile else model
    log.info("model: %s parameters, device %s, precision %s", f"{count_parameters(model):,}", device, t.precision)

    def checkpoint(path: Path) -> None:
        save_checkpoint({
            "config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rng_state(),
            "run": {"step": state.step, "best_valid_loss": state.best_valid_loss, "data": stream.state()},
        }, path)

    metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8")

    def record(entry: dict) -> None:
        metrics.write(json.dumps(entry) + "\n")
        metrics.flush()

    def validate() -> dict:
        result = evaluate_loss(model, valid, device, t.precision, t.label_smoothing)
        improved = result["loss"] < state.best_valid_loss
        if improved:
            state.best_valid_loss = result["loss"]
        record({"step": state.step, "split": "valid", **result})
        checkpoint(last_path)
        if improved:
            checkpoint(run_dir / "best.pt")
        if t.keep_last:
            checkpoint(run_dir / f"step_{state.step:08d}.pt")
            for old in sorted(run_dir.glob("step_*.pt"))[: -t.keep_last]:
                old.unlink()
        log.info("step %d: valid loss %.4f nll %.4f ppl %.2f%s", state.step, result["loss"], result["nll"],
                 result["ppl"], " (best)" if improved else "")
        return result

    model.train()
    bar = tqdm(total=t.max_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
               disable=quiet or None)
    window = {"loss": torch.zeros((), device=device, dtype=torch.float64), "tokens": 0, "src_tokens": 0,
              "time": time.perf_counter()}
    skipped_in_a_row = 0
    with StopRequested() as stop:
        while state.step < t.max_steps and (not t.max_epochs or stream.epoch < t.max_epochs):
            micro = [next(stream) for _ in range(t.update_freq)]
            n_tokens = sum(b.n_tgt_tokens for b in micro)
            loss_sum = torch.zeros((), device=device, dtype=torch.float64)
            for batch in micro:
                batch = batch.to(device, non_blocking=True)
                with autocast_context(device, t.precision):
                    logits = step_fn(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
                    loss = label_smoothed_loss(logits, batch.tgt_out, t.label_smoothing)
                scaler.scale(loss / n_tokens).backward()
                loss_sum += loss.detach()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm or float("inf"))
            finite = bool(torch.isfinite(loss_sum) & torch.isfinite(grad_norm))  # the one sync per update
            if finite:
                scaler.step(optimizer)
                scheduler.step()
                state.step += 1
                skipped_in_a_row = 0
                window["loss"] += loss_sum
                window["tokens"] += n_tokens
                window["src_tokens"] += sum(b.n_src_tokens for b in micro)
                bar.update(1)
            else:
                skipped_in_a_row += 1
                log.warning("step %d: non-finite loss or gradient, update skipped", state.step + 1)
                if skipped_in_a_row >= 20:
                    raise UserError(f"training diverged: {skipped_in_a_row} updates in a row had a non-finite "
                                    f"loss or gradient; last.pt keeps the last good weights (step {state.step})")
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            if finite and (state.step % t.log_every == 0 or state.step == t.max_steps):
                elapsed = time.perf_counter() - window["time"]
                train_loss = window["loss"].item() / max(window["tokens"], 1)
                entry = {"step": state.step, "split": "train", "loss": train_loss,
                         "lr": scheduler.get_last_lr()[0], "tgt_tokens_per_s": window["tokens"] / elapsed,
                         "tokens_per_s": (window["tokens"] + window["src_tokens"]) / elapsed,
                         "epoch": stream.epoch, "grad_norm": float(grad_norm)}
                record(entry)
                bar.set_postfix(loss=f"{train_loss:.3f}", lr=f"{entry['lr']:.2e}",
                                tok_s=f"{entry['tokens_per_s']:.0f}", epoch=stream.epoch)
                window = {"loss": torch.zeros_like(window["loss"]), "tokens": 0, "src_tokens": 0,
                          "time": time.perf_counter()}
            if finite and state.step % t.valid_every == 0:
                validate()
            if stop.signal_name:
                bar.close()
                checkpoint(last_path)
                command = f"transformer train {config_path or 'CONFIG'} --resume"
                log.info("%s: saved %s at step %d; continue with: %s", stop.signal_name, last_path, state.step, command)
                metrics.close()
                raise SystemExit(130 if stop.signal_name == "SIGINT" else 143)
    bar.close()
    if state.step % t.valid_every != 0 or state.step == 0:
        validate()
    metrics.close()
    log.info("done: %d steps; checkpoints in %s", state.step, run_dir)
    return run_dir

