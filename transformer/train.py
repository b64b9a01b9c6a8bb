"""The training loop, top to bottom: data, model, optimizer, updates, validation, checkpoints, resume."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from transformer.atomic import remove_stale_temporaries
from transformer.checkpoint import load_checkpoint, save_checkpoint
from transformer.config import Config, from_dict, save_config, to_dict
from transformer.data import BatchStream, encode_corpus, eval_batches, load_split
from transformer.distributed import (DistInfo, all_reduce_sum, barrier, gather_objects, init_distributed,
                                     shutdown_distributed)
from transformer.errors import UserError
from transformer.model import Transformer, count_parameters
from transformer.optim import build_optimizer, label_smoothed_loss
from transformer.resume import (DATA_ORDER, RunState, StopRequested, check_resume_config, rng_state,
                                set_rng_state)
from transformer.vocab import Vocab, train_vocab

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
        file_handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        log.addHandler(file_handler)
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


def read_split(cfg: Config, split: str, limit: int = 0) -> tuple[list[str], list[str]]:
    """Raw source and target sentences of a split, the first `limit` pairs when limit > 0."""
    src, tgt = load_split(cfg.data, split)
    return (src[:limit], tgt[:limit]) if limit else (src, tgt)


def encode_split(cfg: Config, vocab: Vocab, split: str, src: list[str], tgt: list[str]):
    """Encoded, length-filtered pairs of a split, and its kept raw target sentences (BLEU references)."""
    corpus = encode_corpus(vocab, src, tgt, cfg.data.max_len)
    log.info("data: %s: %d pairs kept, %d dropped as longer than data.max_len=%d, %d dropped with a blank side",
             split, len(corpus.pairs), corpus.dropped_long, cfg.data.max_len, corpus.dropped_blank)
    if not corpus.pairs:
        raise UserError(f"data: no usable pairs left in split {split!r} after filtering")
    return corpus.pairs, [t for t, i in zip(tgt, corpus.kept) if i]


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


def train(cfg: Config, resume: bool = False, config_path: Optional[str] = None, quiet: bool = False) -> Path:
    """Train according to cfg (data-parallel when launched by torchrun); returns the run directory."""
    info, device = init_distributed(cfg.train.device)
    try:
        return _train(cfg, info, device, resume, config_path, quiet)
    except RuntimeError as e:
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


def _train(cfg: Config, info: DistInfo, device: torch.device, resume: bool,
           config_path: Optional[str], quiet: bool) -> Path:
    t = cfg.train
    run_dir = Path(t.run_dir)
    last_path = run_dir / "last.pt"
    if last_path.exists() and not resume:
        raise UserError(f"{run_dir} already holds a run (last.pt); add --resume to continue it, "
                        "or set train.run_dir to a new directory")
    # A kill before the first save leaves nothing to continue from; a job script that always passes
    # --resume (as preemptible jobs do) must then simply start the run.
    resume_from_scratch = resume and not last_path.exists()
    resume = resume and not resume_from_scratch
    if t.precision == "fp16" and device.type != "cuda":
        raise UserError("train.precision 'fp16' needs CUDA; use 'bf16' or 'fp32' on CPU")
    if info.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(run_dir)
    barrier(info)
    setup_logging(run_dir, info)
    if resume_from_scratch:
        log.warning("resume: no checkpoint at %s yet (the run stopped before its first save); "
                    "starting from step 0", last_path)

    saved = load_checkpoint(last_path) if resume else None
    changes = check_resume_config(from_dict(saved["config"]), cfg) if saved is not None else []
    for change in changes:
        log.info("resume: config change applies: %s", change)
    if info.is_main:
        save_config(cfg, run_dir / "config.yaml")
    # Each rank gets its own dropout stream; a resumed run restores them below.
    random.seed(t.seed + info.rank)
    torch.manual_seed(t.seed + info.rank)

    # Data and vocabulary: rank 0 trains the SentencePiece model, the others wait and read it.
    train_src, train_tgt = read_split(cfg, cfg.data.train_split, cfg.data.max_train_pairs)
    if saved is not None:
        vocab = Vocab(saved["vocab"])
    else:
        if info.is_main:
            prepare_vocab(cfg, run_dir, train_src, train_tgt)
        barrier(info)
        vocab = Vocab.load(run_dir / "spm.model")
    train_pairs, _ = encode_split(cfg, vocab, cfg.data.train_split, train_src, train_tgt)
    valid_pairs, valid_refs = encode_split(cfg, vocab, cfg.data.valid_split,
                                           *read_split(cfg, cfg.data.valid_split, cfg.data.max_valid_pairs))
    valid = eval_batches(valid_pairs, cfg.data.max_tokens, cfg.data.pad_to_multiple)

    # Model, optimizer, schedule, and the state of an interrupted run.
    model = Transformer(cfg.model, len(vocab)).to(device)
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
    stream = BatchStream(train_pairs, cfg.data, t.seed, **state.data, rank=info.rank,
                         world_size=info.world_size, update_freq=t.update_freq)
    # broadcast_buffers=False: the only buffer is the constant sinusoid table.
    forward = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      broadcast_buffers=False) if info.enabled else model
    if t.compile:
        forward = torch.compile(forward, dynamic=True)
    log.info("model: %s parameters; device %s x %d; precision %s; %d updates per epoch",
             f"{count_parameters(model):,}", device, info.world_size, t.precision,
             stream.batches_per_epoch // t.update_freq)

    def checkpoint(path: Path, rngs: list) -> None:
        save_checkpoint({
            "config": to_dict(cfg), "vocab": vocab.proto, "model": model.state_dict(),
            "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(), "rng": rngs, "run": {**asdict(state), "data": stream.state()},
        }, path)

    def save_last() -> None:
        rngs = gather_objects(rng_state(), info)  # every rank takes part in the gather
        if info.is_main:
            checkpoint(last_path, rngs)

    metrics = (run_dir / "metrics.jsonl").open("a", encoding="utf-8") if info.is_main else None

    def record(entry: dict) -> None:
        if metrics is not None:
            metrics.write(json.dumps(entry) + "\n")
            metrics.flush()

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
                result["bleu"] = validation_bleu(model, vocab, valid_pairs, valid_refs, cfg, device)
                score += result["bleu"]
            score, higher_is_better = all_reduce_sum(score, info).item(), True
        improved = state.best is None or (score > state.best if higher_is_better else score < state.best)
        if improved:
            state.best, state.bad_validations = score, 0
        else:
            state.bad_validations += 1
        record({"step": state.step, "split": "valid", **result})
        rngs = gather_objects(rng_state(), info)
        if info.is_main:
            checkpoint(last_path, rngs)
            saved_step = state.step
            if improved:
                checkpoint(run_dir / "best.pt", rngs)
            if t.keep_last:
                checkpoint(run_dir / f"step_{state.step:08d}.pt", rngs)
                for old in sorted(run_dir.glob("step_*.pt"))[: -t.keep_last]:
                    old.unlink()
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
    window = {"loss": 0.0, "tokens": 0, "src_tokens": 0, "time": time.perf_counter()}
    skipped_in_a_row = 0
    stopped_early = False
    saved_step = state.step if saved is not None else None  # what last.pt holds
    with StopRequested() as stop:
        while state.step < t.max_steps and (not t.max_epochs or stream.epochs_done < t.max_epochs):
            micro, n_tokens, n_src_tokens = stream.next_update()
            loss_sum = torch.zeros((), device=device, dtype=torch.float64)
            for i, batch in enumerate(micro):
                if device.type == "cuda":  # pinned host memory lets the copy overlap the previous kernels
                    batch = batch.pin_memory()
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
                bar.update(1)
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
                entry = {"step": state.step, "split": "train", "loss": window["loss"] / max(window["tokens"], 1),
                         "lr": lr, "tgt_tokens_per_s": window["tokens"] / elapsed,
                         "tokens_per_s": (window["tokens"] + window["src_tokens"]) / elapsed,
                         "epoch": stream.epoch, "grad_norm": float(grad_norm)}
                record(entry)
                # The bar shows this on a terminal; a redirected console (nohup, a cluster job) and
                # train.log get a line, so progress between validations is never invisible.
                log.info("step %d: loss %.4f, lr %.3g, %.0f tokens/s, grad norm %.3g, epoch %d", state.step,
                         entry["loss"], entry["lr"], entry["tokens_per_s"], entry["grad_norm"], stream.epoch,
                         extra={"console": bool(bar.disable)})
                bar.set_postfix(loss=f"{entry['loss']:.3f}", lr=f"{entry['lr']:.2e}",
                                tok_s=f"{entry['tokens_per_s']:.0f}", epoch=stream.epoch)
                window = {"loss": 0.0, "tokens": 0, "src_tokens": 0, "time": time.perf_counter()}
            if not nonfinite and state.step % t.valid_every == 0:
                if validate():
                    stopped_early = True
                    break
            if stop_requested:
                bar.close()
                save_last()
                command = f"transformer train {config_path or 'CONFIG'} --resume"
                name = stop.signal_name or "stop requested on another rank"
                log.info("%s: saved %s at step %d; continue with: %s", name, last_path, state.step, command)
                raise SystemExit(130 if stop.signal_name == "SIGINT" else 143)
    bar.close()
    if not stopped_early and (state.step % t.valid_every != 0 or state.step == 0):
        validate()
    if metrics is not None:
        metrics.close()
    log.info("done: %d steps; checkpoints in %s", state.step, run_dir)
    return run_dir


def validation_bleu(model: Transformer, vocab: Vocab, pairs, refs: list[str], cfg: Config, device) -> float:
    """sacreBLEU of the model's translations of (a slice of) the validation set."""
    from transformer.evaluate import bleu_chrf
    from transformer.translate import translate_ids

    t, d = cfg.train, cfg.decode
    n = t.valid_bleu_pairs or len(pairs)
    was_training = model.training
    model.eval()
    ids = translate_ids(model, [s for s, _ in pairs[:n]], beam=t.valid_bleu_beam, lenpen=d.lenpen,
                        max_len_offset=d.max_len_offset, max_tokens=d.max_tokens, device=device, stop=d.stop)
    model.train(was_training)
    return bleu_chrf(vocab.decode(ids), refs[:n])["bleu"]
