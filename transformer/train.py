"""The training loop, top to bottom: data, model, optimizer, updates, validation, checkpoints, resume."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import resource
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transformer.atomic import remove_stale_temporaries
from transformer.checkpoint import load_checkpoint, load_resumable, save_checkpoint
from transformer.config import Config, from_dict, save_config, to_dict
from transformer.data import BatchStream, Prefetcher, eval_batches
from transformer.distributed import (DistInfo, all_reduce_sum, barrier, gather_objects, init_distributed,
                                     shutdown_distributed)
from transformer.errors import UserError, first_line, is_out_of_memory
from transformer.model import Transformer, build_model, count_parameters
from transformer.optim import build_optimizer, label_smoothed_loss
from transformer.resume import (DATA_ORDER, RunLock, RunState, StopRequested, check_resume_config, check_run_dir,
                                make_run_dir, resume_command, rng_state, set_rng_state, stop_at_once)
from transformer.store import open_prepared, prepare
from transformer.vocab import Vocab

log = logging.getLogger("transformer")

MAX_SKIPPED_IN_A_ROW = 20


def autocast_context(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


class _TqdmHandler(logging.StreamHandler):
    """Console logging that prints above the progress bar instead of through it; records logged with
    extra={"console": False} (what the bar already shows) go to train.log only."""

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", True):
            return
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


class _LogFile(logging.FileHandler):
    """train.log; a write that fails (a full disk) stops the run with the file named, not a traceback per line."""

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            raise OSError(error.errno, error.strerror, self.baseFilename) from None
        super().handleError(record)


def setup_logging(run_dir: Optional[Path], info: DistInfo) -> None:
    log.setLevel(logging.INFO if info.is_main else logging.WARNING)
    for handler in list(log.handlers):
        log.removeHandler(handler)
        handler.close()
    prefix = f"[rank {info.rank}] " if info.enabled else ""
    console = _TqdmHandler()
    console.setFormatter(logging.Formatter(prefix + "%(message)s"))
    log.addHandler(console)
    if run_dir is not None and info.is_main:
        file_handler = _LogFile(run_dir / "train.log", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file_handler)
    log.propagate = False


@torch.no_grad()
def evaluate_loss(model, batches, device, precision: str, smoothing: float, info: DistInfo = DistInfo()) -> dict:
    """Label-smoothed loss and NLL per target token, summed over all ranks' shares; ppl = exp(NLL)."""
    was_training = model.training
    model.eval()
    total = torch.zeros(3, device=device, dtype=torch.float64)  # loss, nll, tokens
    for batch in batches[info.rank::info.world_size]:
        batch = batch.to(device)
        with autocast_context(device, precision):
            logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
        logits = logits.float()
        total[0] += label_smoothed_loss(logits, batch.tgt_out, smoothing)
        total[1] += label_smoothed_loss(logits, batch.tgt_out, 0.0)
        total[2] += batch.n_tgt_tokens
    model.train(was_training)
    loss, nll, tokens = all_reduce_sum(total, info).tolist()
    nll = nll / max(tokens, 1)
    return {"loss": loss / max(tokens, 1), "nll": nll, "ppl": math.exp(min(nll, 50.0))}


def prepare_only(cfg: Config) -> Path:
    """The `prepare` command: the run directory's vocabulary and store, built or checked, without training."""
    run_dir = Path(cfg.train.run_dir)
    check_run_dir(run_dir)
    make_run_dir(run_dir)
    with RunLock(run_dir):  # never rebuild a store under a training process
        setup_logging(run_dir, DistInfo())
        saved = run_dir / "last.pt"
        # A run in progress keeps the vocabulary its checkpoint carries.
        vocab = Vocab(load_checkpoint(saved)["vocab"]) if saved.is_file() else None
        return prepare(cfg, run_dir, vocab).directory


def train(cfg: Config, resume: bool = False, config_path: Optional[str] = None, quiet: bool = False,
          overrides: Sequence[str] = ()) -> Path:
    """Train according to cfg (data-parallel when launched by torchrun); returns the run directory.
    config_path and overrides (the --set items) make the printed resume command; without a config_path
    it is `transformer train --resume RUN_DIR`."""
    info, device = init_distributed(cfg.train.device)
    command = resume_command(config_path, overrides, cfg.train.run_dir)
    try:
        with contextlib.ExitStack() as scope:  # the run-directory lock and signal handlers, until the end
            return _train(cfg, info, device, resume, command, quiet, scope)
    except (RuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            raise UserError(f"out of memory while training ({first_line(e)}); lower data.max_tokens (raise "
                            f"train.update_freq to keep the batch) or the model's sizes, then: {command}") from None
        if isinstance(e, MemoryError):
            raise
        text = str(e).lower()
        if not info.enabled or not (isinstance(e, torch.distributed.DistError) or "peer" in text or "nccl" in text
                                    or "gloo" in text):
            raise
        # Under torchrun the usual cause is a peer that died: say so in one line; torchrun stops the rest.
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise UserError(f"rank {info.rank}: distributed training stopped, most likely because another rank "
                        f"crashed or was killed ({first}); continue from last.pt with --resume") from None
    finally:
        shutdown_distributed()


def _train(cfg: Config, info: DistInfo, device: torch.device, resume: bool, command: str, quiet: bool,
           scope: contextlib.ExitStack) -> Path:
    started = time.perf_counter()
    t = cfg.train
    run_dir = Path(t.run_dir)
    last_path = run_dir / "last.pt"
    check_run_dir(run_dir)
    if last_path.exists() and not resume:
        raise UserError(f"{run_dir} already holds a run (last.pt); add --resume to continue it, "
                        "or set train.run_dir to a new directory")
    # A kill before the first save leaves nothing to continue from; a job script that always passes
    # --resume (as preemptible jobs do) must then simply start the run.
    resume_from_scratch = resume and not last_path.exists()
    resume = resume and not resume_from_scratch
    if t.precision == "fp16" and device.type != "cuda":
        raise UserError("train.precision 'fp16' needs CUDA; use 'bf16' or 'fp32' on CPU")
    saved_step = None  # the step last.pt holds

    def stop_message(name: str) -> str:
        where = f"{last_path} holds step {saved_step}" if saved_step is not None else "no checkpoint yet"
        return f"{name}: stopped ({where}); continue with: {command}"

    scope.enter_context(stop_at_once(stop_message))  # until the update loop, which saves before it stops
    lock, new_dir = None, not run_dir.exists()
    if info.is_main:  # only the main process writes, so only it locks
        make_run_dir(run_dir)
        lock = scope.enter_context(RunLock(run_dir))
        remove_stale_temporaries(run_dir)
    barrier(info)
    setup_logging(run_dir, info)
    if lock is not None and lock.took_over:
        log.warning(lock.took_over)
    if resume_from_scratch and new_dir:
        log.warning("resume: %s did not exist; starting a new run there from step 0", run_dir)
    elif resume_from_scratch:
        log.warning("resume: no checkpoint at %s yet (the run stopped before its first save); "
                    "starting from step 0", last_path)

    saved = load_resumable(last_path) if resume else None
    saved_step = saved["run"]["step"] if saved is not None else None
    changes = check_resume_config(from_dict(saved["config"]), cfg) if saved is not None else []
    for change in changes:
        log.info("resume: config change applies: %s", change)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
    # Each rank gets its own dropout stream; a resumed run restores them below.
    random.seed(t.seed + info.rank)
    torch.manual_seed(t.seed + info.rank)

    # Vocabulary and prepared store: rank 0 trains or reuses the SentencePiece model and builds or reuses the
    # memory-mapped store; the other ranks wait, then map the same files.
    saved_vocab = Vocab(saved["vocab"]) if saved is not None else None
    if info.is_main:
        store = prepare(cfg, run_dir, saved_vocab, quiet)
    barrier(info)
    vocab = saved_vocab or Vocab.load(run_dir / "spm.model")
    if not info.is_main:
        store = open_prepared(cfg, run_dir, vocab)
    train_corpus, valid_corpus = store.corpus("train"), store.corpus("valid")
    if info.is_main and len(vocab) != cfg.data.vocab_size:  # so that config.yaml does not misstate it
        save_config(cfg, run_dir / "config.yaml", note=f"The vocabulary has {len(vocab)} pieces (data.vocab_size "
                    f"{cfg.data.vocab_size} is an upper bound; train.log says why).")
    valid = eval_batches(valid_corpus, cfg.data.max_tokens, cfg.data.pad_to_multiple)

    # Model, optimizer, schedule, and the state of an interrupted run.
    model = build_model(cfg.model, len(vocab)).to(device)
    optimizer, scheduler = build_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type, enabled=t.precision == "fp16")
    state = RunState()
    if saved is not None:
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        for group in optimizer.param_groups:  # load_state_dict brought back the old values; the config rules
            group.update(betas=t.adam_betas, eps=t.adam_eps, weight_decay=t.weight_decay)
        scheduler.load_state_dict(saved["scheduler"])
        if saved["scaler"]:  # empty when the run was saved without fp16
            scaler.load_state_dict(saved["scaler"])
        state = RunState(**saved["run"])
        metric = "bleu" if t.valid_bleu else "loss"
        if state.best_metric != metric:
            log.info("resume: best checkpoint now chosen by %s instead of %s", metric, state.best_metric)
            state.best, state.best_metric, state.bad_validations = None, metric, 0
        group_size = info.world_size * t.update_freq
        order_changed = [c for c in changes if c.split(":")[0] in DATA_ORDER]
        if state.data["batches_done"] and (order_changed or state.data["batches_done"] % group_size):
            log.warning("resume: %s; epoch %d restarts from its first batch",
                        "the data order changed" if order_changed else
                        f"{state.data['batches_done']} batches done do not split into updates of {group_size}",
                        state.data["epoch"])
            state.data = {"epoch": state.data["epoch"], "batches_done": 0}
        # The schedule is a pure function of the step under the *new* config, so a changed
        # train.lr / warmup applies from the next update on; unchanged, this recomputes the same value.
        scheduler.base_lrs = [t.lr for _ in optimizer.param_groups]
        for group, lr_lambda in zip(optimizer.param_groups, scheduler.lr_lambdas):
            group["initial_lr"] = t.lr
            group["lr"] = t.lr * lr_lambda(scheduler.last_epoch)  # exactly as LambdaLR computes it
        rngs = saved["rng"]
        if len(rngs) == info.world_size:
            set_rng_state(rngs[info.rank])
        else:
            log.warning("resume: the checkpoint holds RNG states of %d ranks, this run has %d; "
                        "dropout streams restart from the seed", len(rngs), info.world_size)
        log.info("resume: continuing %s at step %d", last_path, state.step)
    stream = BatchStream(train_corpus, cfg.data, t.seed, **state.data, rank=info.rank,
                         world_size=info.world_size, update_freq=t.update_freq)
    data_position = stream.state()  # what a checkpoint saves: the stream after the last update taken
    # broadcast_buffers=False: the only buffer is the constant sinusoid table.
    forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      broadcast_buffers=False) if info.enabled else model
    if t.compile:
        forward = torch.compile(forward, dynamic=True)
    log.info("model: %s parameters; device %s x %d; precision %s; %d updates per epoch",
             f"{count_parameters(model):,}", device, info.world_size, t.precision,
             stream.batches_per_epoch // t.update_freq)

    def checkpoint(path: Path, rngs: list) -> None:
        state.elapsed = elapsed_before + time.perf_counter() - started
        save_checkpoint({
            "config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rngs, "run": {**asdict(state), "data": data_position},
        }, path)

    def save_last() -> None:
        rngs = gather_objects(rng_state(), info)  # every rank takes part in the gather
        if info.is_main:
            checkpoint(last_path, rngs)

    metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8") if info.is_main else None

    def record(entry: dict) -> None:
        state.elapsed = elapsed_before + time.perf_counter() - started  # time to quality survives resumes
        if metrics is not None:
            try:
                metrics.write(json.dumps({**entry, "elapsed": round(state.elapsed, 3)}) + "\n")
                metrics.flush()
            except OSError as e:  # a full disk: name the file
                raise OSError(e.errno, e.strerror, str(run_dir / "metrics.jsonl")) from None

    elapsed_before = state.elapsed  # what earlier runs of this training took, from the checkpoint
    if saved is not None:
        record({"step": state.step, "event": "resume"})

    def validate() -> bool:
        """Validate, log, checkpoint; returns True when early stopping says stop."""
        nonlocal saved_step
        result = evaluate_loss(model, valid, device, t.precision, t.label_smoothing, info)
        score, higher_is_better = result["loss"], False
        if t.valid_bleu:
            score = torch.zeros(1, dtype=torch.float64, device=device)
            if info.is_main:
                result["bleu"] = validation_bleu(model, vocab, valid_corpus, store.references("valid"), cfg,
                                                 device)
                score += result["bleu"]
            score, higher_is_better = all_reduce_sum(score, info).item(), True
        improved = state.best is None or (score > state.best if higher_is_better else score < state.best)
        if improved:
            state.best, state.bad_validations = score, 0
        else:
            state.bad_validations += 1
        record({"step": state.step, "split": "valid", **result})
        state.last_validation = state.step
        rngs = gather_objects(rng_state(), info)
        if info.is_main:
            # last.pt last: a kill between these writes leaves last.pt at the previous validation, so that
            # --resume redoes the updates since and writes this step's files again, the same, before last.pt.
            if t.keep_last:
                checkpoint(run_dir / f"step_{state.step:08d}.pt", rngs)
            if improved:
                checkpoint(run_dir / "best.pt", rngs)
            checkpoint(last_path, rngs)
            if t.keep_last:
                for old in sorted(run_dir.glob("step_*.pt"))[: -t.keep_last]:
                    old.unlink()
        saved_step = state.step
        bleu = f" bleu {result['bleu']:.2f}" if "bleu" in result else ""
        log.info("step %d: valid loss %.4f nll %.4f ppl %.2f%s%s", state.step, result["loss"], result["nll"],
                 result["ppl"], bleu, " (best)" if improved else "")
        if t.patience and state.bad_validations >= t.patience:
            log.info("early stopping: %d validations without improvement", state.bad_validations)
            return True
        return False

    model.train()
    bar = tqdm(total=t.max_steps, initial=state.step, desc="train", unit="step", dynamic_ncols=True,
               disable=True if (quiet or not info.is_main) else None)
    prefetch = Prefetcher(stream, pin_memory=device.type == "cuda")
    window = {"loss": 0.0, "tokens": 0, "src_tokens": 0, "time": time.perf_counter(), "wait": 0.0}
    skipped_in_a_row = 0
    stopped_early = False
    first_update = True
    with StopRequested() as stop, contextlib.closing(prefetch):
        while state.step < t.max_steps and (not t.max_epochs or prefetch.epochs_done < t.max_epochs):
            update = prefetch.next()
            micro, n_tokens, n_src_tokens = update.batches, update.n_tgt_tokens, update.n_src_tokens
            data_position = update.data_state
            loss_sum = torch.zeros((), device=device, dtype=torch.float64)
            for i, batch in enumerate(micro):
                batch = batch.to(device, non_blocking=True)
                # DDP averages gradients over ranks; scaling by world_size / (tokens of the whole update)
                # makes the result the per-token mean of one big batch. Sync gradients once per update.
                sync = i == len(micro) - 1 or not info.enabled
                with (contextlib.nullcontext() if sync else forward.no_sync()):
                    with autocast_context(device, t.precision):
                        logits = forward(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
                        loss = label_smoothed_loss(logits, batch.tgt_out, t.label_smoothing)
                    scaler.scale(loss * (info.world_size / n_tokens)).backward()
                loss_sum += loss.detach()
            scaler.unscale_(optimizer)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm or float("inf"))
            # One small reduction and one host sync per update: the update's loss, whether any rank saw
            # a non-finite value, and whether any rank was asked to stop (so all ranks stop together).
            flags = torch.stack([loss_sum, (~torch.isfinite(grad_norm) | ~torch.isfinite(loss_sum)).double(),
                                 torch.tensor(float(stop.signal_name is not None), device=device,
                                              dtype=torch.float64)])
            update_loss, nonfinite, stop_requested = all_reduce_sum(flags, info).tolist()
            lr = optimizer.param_groups[0]["lr"]  # the rate this update uses
            if not nonfinite:
                scaler.step(optimizer)
                scheduler.step()
                state.step += 1
                skipped_in_a_row = 0
                window["loss"] += update_loss
                window["tokens"] += n_tokens
                window["src_tokens"] += n_src_tokens
                state.tokens += n_tokens + n_src_tokens
                bar.update(1)
                if first_update:  # how long a start or resume takes before training proper
                    first_update = False
                    seconds = time.perf_counter() - started
                    record({"step": state.step, "event": "first_update", "seconds": round(seconds, 3),
                            "time": time.time()})
                    log.info("first update %.1f s after start", seconds, extra={"console": bool(bar.disable)})
            else:
                skipped_in_a_row += 1
                log.warning("update %d: non-finite loss or gradient; skipped, the weights are unchanged",
                            state.step + 1)
                if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                    held = f"last.pt holds step {saved_step}" if saved_step is not None else "no last.pt was written"
                    raise UserError(f"training diverged: {skipped_in_a_row} updates in a row had a non-finite "
                                    f"loss or gradient; stopping without saving them ({held})")
            scaler.update()
            optimizer.zero_grad(set_to_none=True)

            if not nonfinite and (state.step % t.log_every == 0 or state.step == t.max_steps):
                elapsed = time.perf_counter() - window["time"]
                epoch = data_position["epoch"]
                entry = {"step": state.step, "split": "train", "loss": window["loss"] / max(window["tokens"], 1),
                         "lr": lr, "tgt_tokens_per_s": window["tokens"] / elapsed,
                         "tokens_per_s": (window["tokens"] + window["src_tokens"]) / elapsed,
                         "epoch": epoch, "grad_norm": float(grad_norm),
                         "data_wait": (prefetch.wait_seconds - window["wait"]) / elapsed}
                record(entry)
                # The bar shows this on a terminal; a redirected console (nohup, a cluster job) and
                # train.log get a line, so progress between validations is never invisible.
                log.info("step %d: loss %.4f, lr %.3g, %.0f tokens/s, grad norm %.3g, epoch %d, waiting for data "
                         "%.1f%%", state.step, entry["loss"], entry["lr"], entry["tokens_per_s"], entry["grad_norm"],
                         epoch, 100 * entry["data_wait"], extra={"console": bool(bar.disable)})
                bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.2e}",
                                tok_s=f"{entry['tokens_per_s']:.0f}", epoch=epoch)
                window = {"loss": 0.0, "tokens": 0, "src_tokens": 0, "time": time.perf_counter(),
                          "wait": prefetch.wait_seconds}
            if not nonfinite and state.step % t.valid_every == 0:
                if validate():
                    stopped_early = True
                    break
            if stop_requested:
                bar.close()
                save_last()
                name = stop.signal_name or "stop requested on another rank"
                log.info("%s: saved %s at step %d; continue with: %s", name, last_path, state.step, command)
                raise SystemExit(130 if stop.signal_name == "SIGINT" else 143)
        # The last validation, unless the loop's last step had one (or a finished run was resumed).
        if not stopped_early and state.last_validation != state.step:
            validate()
        if stop.signal_name is not None:  # asked to stop during it: it has saved last.pt at this step
            bar.close()
            log.info("%s: saved %s at step %d; continue with: %s", stop.signal_name, last_path, state.step, command)
            raise SystemExit(130 if stop.signal_name == "SIGINT" else 143)
    bar.close()
    # ru_maxrss is in KiB on Linux; memory-mapped store pages count in it (they are shared between ranks).
    peak = [round(kib / 1024, 1) for kib in gather_objects(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, info)]
    record({"step": state.step, "event": "done", "peak_rss_mib": peak, "time": time.time()})
    log.info("done: %d steps; checkpoints in %s; peak memory %s MiB", state.step, run_dir,
             " / ".join(f"{p:.0f}" for p in peak))
    if metrics is not None:
        metrics.close()
    return run_dir


def validation_bleu(model: Transformer, vocab: Vocab, corpus, refs: list[str], cfg: Config, device) -> float:
    """sacreBLEU of the model's translations of (a slice of) the validation set."""
    from transformer.evaluate import bleu_chrf
    from transformer.translate import translate_ids

    t, d = cfg.train, cfg.decode
    n = min(t.valid_bleu_pairs or len(corpus), len(corpus))
    was_training = model.training
    model.eval()
    ids = translate_ids(model, [corpus.source(i) for i in range(n)], beam=t.valid_bleu_beam, lenpen=d.lenpen,
                        max_len_offset=d.max_len_offset, max_tokens=d.max_tokens, device=device, stop=d.stop)
    model.train(was_training)
    return bleu_chrf(vocab.decode(ids), refs[:n])["bleu"]
