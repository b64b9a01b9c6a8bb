"""The training loop as named phases: start (run directory, lock, the checkpoint to resume), data (vocabulary and
the memory-mapped store), model, restore, the updates (with validation and checkpoints), and the end."""

from __future__ import annotations

import contextlib
import logging
import random
import resource
import socket
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from transformer.config import Config, from_dict, save_config, to_dict
from transformer.data.batch import Batch
from transformer.data.loader import BatchStream, Prefetcher, eval_batches
from transformer.data.mixture import Mixture
from transformer.data.prepare import (
    open_prepared,
    open_prepared_corpora,
    prepare,
    prepare_corpora,
    training_mixture,
    valid_sets,
)
from transformer.data.store import Store
from transformer.data.vocab import AnyVocab, run_vocab, vocab_from_stored
from transformer.device import (
    bounded_onednn_caches,
    cuda_memory_peaks,
    default_cuda_allocator,
    pick_precision,
    tf32_matmuls,
)
from transformer.distributed import (
    DistInfo,
    all_or_none,
    all_reduce_sum,
    gather_objects,
    init_distributed,
    peer_failure_explained,
    shutdown_distributed,
    wrap_ddp,
)
from transformer.errors import UserError, first_line, is_out_of_memory
from transformer.files import remove_stale_temporaries

# The translator the end of training scores with (finish.end_of_training, imported below too) loaded now rather than
# hours from now: a package upgraded under a running training would otherwise meet its new modules half loaded.
from transformer.inference import translator as _translator  # noqa: F401
from transformer.inference.scoring import describe
from transformer.model.checkpoint import load_checkpoint, save_checkpoint
from transformer.model.transformer import Transformer, build_model, count_parameters
from transformer.peak import Peak, mfu_peak
from transformer.run_dir import RunDir
from transformer.signals import StopRequested, stop_at_once
from transformer.training import init_from
from transformer.training.finish import end_of_training
from transformer.training.init_from import Origin
from transformer.training.lock import RunLock
from transformer.training.metrics import MetricsLog, Progress, setup_logging
from transformer.training.optim import build_optimizer
from transformer.training.run_state import (
    ConfigChange,
    RunState,
    check_resume_config,
    check_run_dir,
    continue_hint,
    load_resumable,
    make_run_dir,
    put_back,
    restore_training,
    resume_command,
    rng_state,
    set_rng_state,
    training_checkpoint,
)
from transformer.training.update import TrainingLoss, make_grad_scaler, skipped_update, train_update
from transformer.training.validation import check_valid_scores, collapse_warning, evaluate_loss, validation_scores

log = logging.getLogger("transformer")


@dataclass
class Run:
    """What one training process holds once set up: settings, data, model and optimizer, and the run's counters."""

    cfg: Config
    info: DistInfo
    device: torch.device
    precision: str  # fp32, bf16 or fp16: train.precision with `auto` resolved for this device
    run_dir: Path
    command: str  # what continues the run after a stop
    vocab: AnyVocab
    store: Store  # data.dir's
    train: Mixture  # the training pairs: data.dir's and data.corpora's
    valid_sets: list[tuple]  # (name, corpus, references) per language pair scored (prepare.valid_sets)
    valid: list[Batch]  # every validation set's, for the loss
    model: Transformer
    forward: torch.nn.Module  # TrainingLoss as updates call it: wrapped by DDP and/or torch.compile
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    state: RunState
    metrics: MetricsLog
    peak: Peak  # what MFU divides by, and where that figure comes from
    saved_step: int | None  # the step last.pt holds

    @property
    def last_path(self) -> Path:
        return RunDir(self.run_dir).last


# --------------------------------------------------------------------------- the command's entry points


def prepare_only(cfg: Config) -> Path:
    """The `prepare` command: the run directory's vocabulary and store, built or checked, without training."""
    run_dir = Path(cfg.train.run_dir)
    check_run_dir(run_dir, resume=True)  # it starts no run: a directory that --resume may continue is fine
    make_run_dir(run_dir)
    with RunLock(run_dir, "prepare"):  # never rebuild a store under a training process
        setup_logging(run_dir, DistInfo())
        saved = RunDir(run_dir).last
        # A run in progress keeps the vocabulary its checkpoint carries; a new run from a trained model takes its.
        vocab, origin = None, None
        if saved.is_file():
            vocab = vocab_from_stored(load_checkpoint(saved)["vocab"])
        elif cfg.train.init_from:
            cfg, origin = init_from.start(cfg)
            vocab = origin.vocab
            init_from.install_vocab(run_dir, vocab)
        directory = prepare(cfg, run_dir, vocab).directory
        prepare_corpora(cfg, run_dir, vocab or run_vocab(run_dir))
        if origin is not None:
            init_from.fit_report(cfg, origin)
        return directory


def train(
    cfg: Config,
    resume: bool = False,
    config_path: str | None = None,
    quiet: bool = False,
    overrides: Sequence[str] = (),
) -> Path:
    """Train according to cfg (data-parallel when launched by torchrun); returns the run directory.
    config_path and overrides (the --set items) make the printed resume command; without a config_path
    it is `transformer train --resume RUN_DIR`."""
    default_cuda_allocator()  # before anything allocates on a GPU
    bounded_onednn_caches()  # and before any CPU work builds a oneDNN primitive
    info, device = init_distributed(cfg.train.device)
    command = resume_command(config_path, overrides, cfg.train.run_dir)
    try:
        # The run-directory lock and signal handlers, until the end; a failed collective explained before
        # they are undone (the update loop explains its own, inside its stop handler).
        with contextlib.ExitStack() as scope, peer_failure_explained(info):
            run_dir = _train(cfg, info, device, resume, command, quiet, scope)
    except (RuntimeError, MemoryError) as e:
        if is_out_of_memory(e):
            raise UserError(
                f"out of memory while training ({first_line(e)}); lower data.max_tokens (raise "
                f"train.update_freq to keep the batch) or the model's sizes, then: {command}"
            ) from None
        raise
    # Only after a normal end: on NCCL, destroy_process_group waits for every rank's collectives to complete,
    # so after an error (a peer that died, a rank out of memory) it could hang instead of letting the error
    # out. The process ends right after an error anyway (under torchrun without finalizing: cli.main).
    shutdown_distributed()
    return run_dir


def _train(
    cfg: Config,
    info: DistInfo,
    device: torch.device,
    resume: bool,
    command: str,
    quiet: bool,
    scope: contextlib.ExitStack,
) -> Path:
    metrics_since = time.perf_counter()
    precision, _ = pick_precision(cfg.train.precision, device)  # fp16 on a CPU refused before any data is built
    same_on_every_rank(cfg, resume, info, precision)
    check_compile(cfg, device)
    check_valid_scores(cfg)
    # Training, validation and the end of training compute fp32 products in TF32 on a GPU (device.tf32_matmuls).
    scope.enter_context(tf32_matmuls(device))
    run_dir, saved, changes, cfg, origin = start(cfg, info, resume, command, scope)
    vocab, store, mixture, sets = load_data(cfg, info, run_dir, saved, quiet, origin)
    run = build(cfg, info, device, run_dir, command, vocab, store, mixture, saved, metrics_since, sets)
    restore(run, saved, changes)
    if saved is not None:
        run.metrics.record({"step": run.state.step, "event": "resume"})
    if origin is not None:
        init_from.copy_weights(run.model, origin)
        run.metrics.record({"step": 0, "event": "init_from", **origin.record(), "vocab_fit": origin.fit})
        del origin  # its weights: not held for the whole run
    # Dropped before training: the checkpoint's weights (and on CUDA its optimizer moments, copied to the GPU)
    # would otherwise stay in host memory for the whole run, about 3x the model's size.
    del saved
    update_loop(run, quiet)
    end(run)
    return run_dir


# --------------------------------------------------------------------------- phases


def start(
    cfg: Config, info: DistInfo, resume: bool, command: str, scope: contextlib.ExitStack
) -> tuple[Path, dict | None, list[ConfigChange], Config, Origin | None]:
    """The run directory (checked, created, locked), logging, the checkpoint to continue from with the config
    changes that apply to it, the config (with where the run started from) and, for a new run from a trained
    model (train.init_from), that model."""
    run_dir = Path(cfg.train.run_dir)
    last_path = RunDir(run_dir).last
    check_run_dir(run_dir, resume)
    if last_path.exists() and not resume:
        raise UserError(
            f"{run_dir} already holds a run (last.pt); add --resume to continue it, "
            "or set train.run_dir to a new directory"
        )
    # A kill before the first save leaves nothing to continue from; a job script that always passes
    # --resume (as preemptible jobs do) must then simply start the run. A kill at the first validation after
    # its step checkpoint was written but before last.pt leaves that step checkpoint: continue from it.
    source = last_path if last_path.exists() else RunDir(run_dir).newest_resumable() if resume else None
    from_scratch = resume and source is None
    held = {"step": None}  # what `source` holds, for the message of a signal that arrives before the updates

    def stop_message(name: str) -> str:
        where = f"{source} holds step {held['step']}" if held["step"] is not None else "no checkpoint yet"
        return f"{name}: stopped ({where}); continue with: {command}"

    scope.enter_context(stop_at_once(stop_message))  # until the update loop, which saves before it stops
    lock, new_dir = None, not run_dir.exists()
    # Only global rank 0 writes (on every node of a shared filesystem), so only it locks; a refusal there (the
    # run directory in use) stops every rank with it, where the others would wait for it at their next collective.
    with all_or_none(info, "lock the run directory"):
        if info.is_main:
            make_run_dir(run_dir)
            lock = scope.enter_context(RunLock(run_dir))
            remove_stale_temporaries(run_dir)
    setup_logging(run_dir, info)
    if lock is not None and lock.took_over:
        log.warning(lock.took_over)
    if info.is_main:  # said once (another rank may look after rank 0 made the directory)
        log_resume_source(run_dir, source, resume, from_scratch, new_dir)
    origin, changes = None, []
    with all_or_none(info, "read the checkpoint the run continues or starts from"):
        try:
            saved = load_resumable(source) if resume and source is not None else None
        except UserError as e:
            raise UserError(f"{e}{continue_hint(run_dir) if source == last_path else ''}") from None
        if saved is not None and source != last_path and info.is_main:
            put_back(source, run_dir, saved)
        if saved is not None:
            cfg = init_from.on_resume(from_dict(saved["config"]), cfg)
        elif cfg.train.init_from:
            cfg, origin = init_from.start(cfg)
        changes = check_resume_config(from_dict(saved["config"]), cfg) if saved is not None else []
    if saved is not None:
        held["step"] = saved["run"]["step"]
    for change in changes:
        log.info("resume: config change applies: %s", change)
    if info.is_main:
        save_config(cfg, RunDir(run_dir).config)
    return run_dir, saved, changes, cfg, origin


def log_resume_source(run_dir: Path, source: Path | None, resume: bool, from_scratch: bool, new_dir: bool) -> None:
    """What --resume found to continue from, when it is not simply last.pt."""
    last_path = RunDir(run_dir).last
    if from_scratch and new_dir:  # the first start of a job that always passes --resume (as `make train` does)
        log.info("resume: %s did not exist; starting a new run there from step 0", run_dir)
    elif from_scratch:
        log.warning(
            "resume: no checkpoint at %s yet (the run stopped before its first save); starting from step 0", last_path
        )
    if resume and source not in (None, last_path):
        log.warning(
            "resume: %s is missing; continuing from %s, the newest checkpoint with training state",
            last_path,
            source.name,
        )


def same_on_every_rank(cfg: Config, resume: bool, info: DistInfo, precision: str) -> None:
    """Every rank must train the same run: a node started with another config (another file, --set) or without
    --resume, or whose machine resolves train.precision `auto` otherwise (bf16 where its CPU has native bf16), is
    refused in one line on every rank, before anything is written."""
    if not info.enabled:
        return
    mine = {"config": to_dict(cfg), "resume": resume, "precision": precision}
    everyone = gather_objects((socket.gethostname(), mine), info)
    first_host, first = everyone[0]
    for rank, (host, theirs) in enumerate(everyone):
        if theirs == first:
            continue
        differ = [
            f"{section}.{key} is {value!r} there, {first['config'][section][key]!r} on rank 0"
            for section, values in theirs["config"].items()
            for key, value in values.items()
            if value != first["config"][section][key]
        ]
        if theirs["resume"] != first["resume"]:
            differ.append(f"--resume is {'given' if theirs['resume'] else 'missing'} there, not on rank 0")
        if theirs["precision"] != first["precision"] and not differ:
            raise UserError(
                f"rank {info.rank}: train.precision {cfg.train.precision} is {theirs['precision']} on rank {rank} "
                f"(on {host}) but {first['precision']} on rank 0 (on {first_host}): every rank must train in one "
                "precision; set train.precision to one that every node has (fp32 always is)"
            )
        raise UserError(
            f"rank {info.rank}: rank {rank} (on {host}) was started with another config than rank 0 (on "
            f"{first_host}): {'; '.join(differ)}; every node must run the same command (config file, --set, --resume)"
        )


def load_data(
    cfg: Config, info: DistInfo, run_dir: Path, saved: dict | None, quiet: bool, origin: Origin | None = None
) -> tuple[AnyVocab, Store, Mixture, list[tuple]]:
    """Rank 0 trains or reuses the SentencePiece model (takes the one of the model the run starts from) and builds or
    reuses the memory-mapped stores; the other ranks wait, then map the same files, checked against their own view of
    the inputs (a node whose data differs stops every rank). -> the vocabulary, data.dir's store (validation) and
    the mixture of every corpus training draws from, and the validation sets."""
    saved_vocab = (
        vocab_from_stored(saved["vocab"]) if saved is not None else origin.vocab if origin is not None else None
    )
    with all_or_none(info, "prepare the data"):
        if info.is_main:
            if origin is not None:
                init_from.install_vocab(run_dir, origin.vocab)
            store = prepare(cfg, run_dir, saved_vocab, quiet)
            corpora = prepare_corpora(cfg, run_dir, saved_vocab or run_vocab(run_dir), quiet)
            if origin is not None:
                init_from.fit_report(cfg, origin)
    vocab = saved_vocab or run_vocab(run_dir)
    with all_or_none(info, "read the prepared data"):
        if not info.is_main:
            store = open_prepared(cfg, run_dir, vocab)
            corpora = open_prepared_corpora(cfg, run_dir, vocab)
    if info.is_main and len(vocab) != cfg.data.vocab_size:  # so that config.yaml does not misstate it
        save_config(cfg, RunDir(run_dir).config, pieces=len(vocab))
    return vocab, store, training_mixture(cfg, store, corpora), valid_sets(cfg, store, corpora)


def check_compile(cfg: Config, device: torch.device) -> None:
    """train.compile on CUDA needs lengths padded to a multiple of 8: inside the compiled graph, the memory-efficient
    attention kernel takes a key-padding mask only with its key length aligned to 8 (eager SDPA pads a copy of
    the mask instead; the compiled one cannot)."""
    if cfg.train.compile and device.type == "cuda" and cfg.data.pad_to_multiple % 8:
        raise UserError(
            f"train.compile on CUDA needs data.pad_to_multiple to be a multiple of 8 (it is "
            f"{cfg.data.pad_to_multiple}): add --set data.pad_to_multiple=8, or set train.compile: false"
        )


def build(
    cfg: Config,
    info: DistInfo,
    device: torch.device,
    run_dir: Path,
    command: str,
    vocab: AnyVocab,
    store: Store,
    mixture: Mixture,
    saved: dict | None,
    started: float,
    sets: list[tuple] | None = None,
) -> Run:
    """The model (seeded per rank, so each rank has its own dropout stream), its loss with the DDP / compiled
    wrapper, the optimizer, the fp16 grad scaler, the validation batches, the metrics log, the precision and the
    peak for MFU."""
    t = cfg.train
    precision, why = pick_precision(t.precision, device)
    random.seed(t.seed + info.rank)
    torch.manual_seed(t.seed + info.rank)
    model = build_model(cfg.model, len(vocab), vocab.specials).to(device)
    forward = TrainingLoss(model, t.label_smoothing)
    if info.enabled:
        forward = wrap_ddp(forward, device)
    if t.compile:
        forward = torch.compile(forward, dynamic=True)
    state = (
        RunState(**saved["run"])
        if saved is not None
        else RunState(best_metric="bleu" if cfg.train.valid_bleu else "loss")
    )
    peak = mfu_peak(device, precision, t.peak_tflops)
    log.info("precision: %s (%s); MFU below is against %s", precision, why, peak.describe())
    sets = sets or valid_sets(cfg, store, [])
    d = cfg.data
    valid = [b for _, c, _ in sets for b in eval_batches(c, d.max_tokens, d.pad_to_multiple, vocab.specials)]
    return Run(
        cfg,
        info,
        device,
        precision,
        run_dir,
        command,
        vocab,
        store,
        mixture,
        sets,
        valid,
        model,
        forward,
        build_optimizer(model, cfg),
        make_grad_scaler(device, precision),
        state,
        MetricsLog(run_dir, info.is_main, state.elapsed, started, t.tensorboard),
        peak,
        state.step if saved is not None else None,
    )


def restore(run: Run, saved: dict | None, changes: list[ConfigChange]) -> None:
    """Continue an interrupted run: weights, optimizer and scaler, RNG streams, and the data position (the epoch
    restarts when the batches no longer line up with the updates or the data order changed)."""
    if saved is None:
        return
    t, state = run.cfg.train, run.state
    restore_training(saved, run.model, run.optimizer, run.scaler)
    metric = "bleu" if t.valid_bleu else "loss"
    if state.best_metric != metric:
        log.info("resume: best checkpoint now chosen by %s instead of %s", metric, state.best_metric)
        state.best, state.best_metric, state.bad_validations = None, metric, 0
    group_size = run.info.world_size * t.update_freq
    reordered = any(c.reorders_data for c in changes)
    # Checkpoints written before train_order was saved have none: their position is kept, as it was.
    corpus_changed = (
        bool(state.data["batches_done"]) and saved.get("train_order", run.train.train_order) != run.train.train_order
    )
    if state.data["batches_done"] and (reordered or corpus_changed or state.data["batches_done"] % group_size):
        why = (
            "the data order changed"
            if reordered
            else "the training corpus changed"
            if corpus_changed
            else f"{state.data['batches_done']} batches done do not split into updates of {group_size}"
        )
        log.warning("resume: %s; epoch %d restarts from its first batch", why, state.data["epoch"])
        state.data = {"epoch": state.data["epoch"], "batches_done": 0}
    rngs = saved["rng"]
    if len(rngs) == run.info.world_size:
        set_rng_state(rngs[run.info.rank], run.device)
    else:
        log.warning(
            "resume: the checkpoint holds RNG states of %d ranks, this run has %d; "
            "dropout streams restart from the seed",
            len(rngs),
            run.info.world_size,
        )
    log.info("resume: continuing %s at step %d", run.last_path, state.step)


def save(run: Run, path: Path, rngs: list) -> None:
    run.state.elapsed = run.metrics.elapsed()
    save_checkpoint(
        training_checkpoint(
            to_dict(run.cfg),
            run.vocab.stored,
            run.model,
            run.optimizer,
            run.scaler,
            rngs,
            asdict(run.state),
            run.train.train_order,
        ),
        path,
    )


def validate_and_save(run: Run) -> bool:
    """Validate, log, write this step's checkpoints; returns True when early stopping says stop."""
    t, state = run.cfg.train, run.state
    result = evaluate_loss(run.model, run.valid, run.device, run.precision, t.label_smoothing, run.info)
    score, higher_is_better = result["loss"], False
    if t.valid_bleu:
        score = torch.zeros(1, dtype=torch.float64, device=run.device)
        if run.info.is_main:
            result.update(validation_scores(run.model, run.vocab, run.valid_sets, run.cfg, run.device))
            score += result["bleu"]
        score, higher_is_better = all_reduce_sum(score, run.info).item(), True
    improved = state.best is None or (score > state.best if higher_is_better else score < state.best)
    if improved:
        state.best, state.bad_validations = score, 0
    else:
        state.bad_validations += 1
    run.metrics.record({"step": state.step, "split": "valid", **result})
    warning = collapse_warning(result["encoder_similarity"], state.step)
    if warning and run.info.is_main:
        log.warning("%s", warning)
    state.last_validation = state.step
    rngs = gather_objects(rng_state(run.device), run.info)
    if run.info.is_main:
        # last.pt last: a kill between these writes leaves last.pt at the previous validation, so that
        # --resume redoes the updates since and writes this step's files again, the same, before last.pt.
        if t.keep_last:
            save(run, RunDir(run.run_dir).step(state.step), rngs)
        if improved:
            save(run, RunDir(run.run_dir).best, rngs)
        save(run, run.last_path, rngs)
        if t.keep_last:
            for old in RunDir(run.run_dir).step_checkpoints()[: -t.keep_last]:
                old.unlink()
    run.saved_step = state.step
    scores = describe(result, lower=True)  # "" without valid_bleu
    best = f" (best, {run.metrics.elapsed() / 60:.1f} min into training)" if improved else ""
    log.info(
        "step %d: valid loss %.4f nll %.4f ppl %.2f%s%s",
        state.step,
        result["loss"],
        result["nll"],
        result["ppl"],
        f" {scores}" if scores else "",
        best,
    )
    if out_of_patience(run):
        log.info("early stopping: %d validations without improvement", state.bad_validations)
        return True
    return False


def out_of_patience(run: Run) -> bool:
    """train.patience validations in a row without improvement: early stopping ends the run."""
    return bool(run.cfg.train.patience) and run.state.bad_validations >= run.cfg.train.patience


def update_loop(run: Run, quiet: bool) -> None:
    """Updates until train.max_steps or train.max_epochs (or early stopping), validating and saving every
    train.valid_every updates and at the end; SIGINT/SIGTERM save last.pt after the current update and exit."""
    t, state, info = run.cfg.train, run.state, run.info
    if out_of_patience(run):  # resuming a run that stopped early: it stays stopped
        log.info(
            "early stopping: this run stopped at step %d after %d validations without improvement; raise "
            "train.patience to train on",
            state.step,
            state.bad_validations,
        )
        return
    stream = batch_stream(run)
    run.model.train()
    bar = tqdm(
        total=t.max_steps,
        initial=state.step,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        disable=True if (quiet or not info.is_main) else None,
    )
    prefetch = Prefetcher(stream, pin_memory=run.device.type == "cuda", device=run.device)
    progress = Progress(run.metrics, bar, prefetch, run.model, t.log_every, t.max_steps, state.step, run.peak)
    skipped_in_a_row, stopped_early = 0, False

    def more_to_train() -> bool:
        return state.step < t.max_steps and (not t.max_epochs or prefetch.epochs_done < t.max_epochs)

    if run.saved_step is not None and info.is_main and more_to_train():
        drop_stale_final(run)
    with StopRequested() as stop, peer_failure_explained(info), contextlib.closing(prefetch), contextlib.closing(bar):
        while more_to_train():
            update = prefetch.next()
            state.data = update.data_state  # the stream after this update: what a checkpoint saves
            result = train_update(run, update, stop)
            if result.nonfinite:
                skipped_in_a_row += 1
                skipped_update(run, skipped_in_a_row)
            else:
                skipped_in_a_row = 0
                progress.add(update, result.loss)
                if progress.first_step + 1 == state.step:  # how long a start or resume takes before training proper
                    first_update(run, bar)
                if progress.due(state.step):
                    progress.write(state.step, state.data["epoch"], result.lr, result.grad_norm)
                if state.step % t.valid_every == 0 and validate_and_save(run):
                    stopped_early = True
                    break
            if result.stop_requested:
                bar.close()
                rngs = gather_objects(rng_state(run.device), info)  # every rank takes part in the gather
                if info.is_main:
                    save(run, run.last_path, rngs)
                stopped(run, stop.signal_name or "stop requested on another rank")
        # The last validation, unless the loop's last step had one (or a finished run was resumed).
        if not stopped_early and state.last_validation != state.step:
            validate_and_save(run)
        if stop.signal_name is not None:  # asked to stop during it: it has saved last.pt at this step
            stopped(run, stop.signal_name)


def batch_stream(run: Run) -> BatchStream:
    """This rank's training batches from where the run's state left them, and the log line that starts training."""
    t, info = run.cfg.train, run.info
    stream = BatchStream(
        run.train,
        run.cfg.data,
        t.seed,
        epoch=run.state.data["epoch"],
        batches_done=run.state.data["batches_done"],
        rank=info.rank,
        world_size=info.world_size,
        update_freq=t.update_freq,
        specials=run.vocab.specials,
    )
    log.info(
        "model: %s parameters; device %s x %d; precision %s; %d updates per epoch",
        f"{count_parameters(run.model):,}",
        run.device,
        info.world_size,
        run.precision,
        stream.batches_per_epoch // t.update_freq,
    )
    return stream


def drop_stale_final(run: Run) -> None:
    """final.pt was chosen at the end of the run being continued: stale once it trains on."""
    final = RunDir(run.run_dir).final
    if not final.is_file():
        return
    final.unlink()
    log.info(
        "resume: removed final.pt; %s",
        "the end of this training chooses again"
        if run.cfg.train.finish
        else f"train.finish is off: `transformer finish {run.run_dir}` chooses again",
    )


def first_update(run: Run, bar: tqdm) -> None:
    seconds = time.perf_counter() - run.metrics.started
    run.metrics.record(
        {"step": run.state.step, "event": "first_update", "seconds": round(seconds, 3), "time": time.time()}
    )
    log.info("first update %.1f s after start", seconds, extra={"console": bool(bar.disable)})


def stopped(run: Run, name: str) -> None:
    log.info("%s: saved %s at step %d; continue with: %s", name, run.last_path, run.state.step, run.command)
    raise SystemExit(130 if name == "SIGINT" else 143)


def end(run: Run) -> None:
    """Each rank's peak memory in the log (host, and GPU where there is one); then, on rank 0 and unless
    train.finish is off, the end of training: averaging, choosing the checkpoint and search settings on
    validation, the test score, the summary."""
    # ru_maxrss is in KiB on Linux; memory-mapped store pages count in it (they are shared between ranks).
    peak = [
        round(kib / 1024, 1) for kib in gather_objects(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, run.info)
    ]
    gpu = gather_objects(cuda_memory_peaks(run.device), run.info)  # per rank: {} on a CPU
    by_key = {key: [rank[key] for rank in gpu] for key in gpu[0]}
    run.metrics.record({"step": run.state.step, "event": "done", "peak_rss_mib": peak, **by_key, "time": time.time()})
    run.metrics.close()

    def mib(values: list) -> str:
        return " / ".join(f"{v:.0f}" for v in values) + " MiB"

    gpu_line = (
        f"; GPU peak {mib(by_key['peak_cuda_allocated_mib'])} allocated, "
        f"{mib(by_key['peak_cuda_reserved_mib'])} reserved"
        if by_key
        else ""
    )
    log.info("done: %d steps; checkpoints in %s; peak memory %s%s", run.state.step, run.run_dir, mib(peak), gpu_line)
    if run.cfg.train.finish and run.info.is_main:
        end_of_training(run.run_dir, run.cfg, run.state.step, run.device)
