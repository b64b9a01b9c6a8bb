"""Data-parallel plumbing over torch.distributed: process-group set-up under torchrun, rank queries, reductions."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from transformer.device import device_type
from transformer.errors import UserError, first_line, is_out_of_memory
from transformer.signals import set_stop_handlers


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_name: str) -> tuple[DistInfo, torch.device]:
    """Join the process group torchrun describes in the environment (WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR/PORT); without torchrun, a single process. NCCL on CUDA, gloo on CPU. A CUDA device always comes
    with its index (the rank's GPU; a single process's current one), since the batch thread's set_device needs one."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_type(device_name, "train.device") == "cuda"  # nothing touches a GPU before set_device
    if world_size == 1:
        return DistInfo(), torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    info = DistInfo(int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0")), world_size)
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=peer_timeout())
        # device_id binds the NCCL communicator to this rank's GPU at once (torch >= 2.3), instead of guessing
        # it at the first collective; a barrier then knows its device too.
        bound = (
            {"device_id": device}
            if use_cuda and "device_id" in inspect.signature(dist.init_process_group).parameters
            else {}
        )
        store = group_store(info, timeout)
        if store is not None:
            bound.update(store=store, rank=info.rank, world_size=info.world_size)
        try:
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, **bound)
        except (RuntimeError, ValueError) as e:  # a peer that never came, or left: gloo's connect errors
            raise UserError(
                f"rank {info.rank}: could not form the group of {info.world_size} ranks ({first_line(e)[:300]})"
            ) from None
    return info, device


TIMEOUT_VARIABLE = "TRANSFORMER_DIST_TIMEOUT"
MAX_PEER_TIMEOUT = 7 * 24 * 3600  # a week: far beyond any wait, and within what the C++ side's clocks can hold


def peer_timeout() -> int:
    """Seconds a rank waits for its peers at any one point (joining, a barrier, a collective) before it stops with
    a one-line error: TRANSFORMER_DIST_TIMEOUT, 1800 by default. Long enough for rank 0's solo work (SentencePiece
    training, the store, validation BLEU) while the others wait."""
    value = os.environ.get(TIMEOUT_VARIABLE, "1800")
    seconds = int(value) if value.strip().isdecimal() else 0
    if not 1 <= seconds <= MAX_PEER_TIMEOUT:
        raise UserError(
            f"{TIMEOUT_VARIABLE} is {value!r}: it must be a whole number of seconds from 1 to {MAX_PEER_TIMEOUT:,} "
            "(how long a rank waits for its peers; 1800 if unset)"
        )
    return seconds


# Where a group's keys go in torchrun's store: transformer/<nonce of this start's rank 0>/...
HANDSHAKE = "transformer/handshake"


def group_store(info: DistInfo, timeout: datetime.timedelta):
    """The store this start's process group meets in, or None for init_process_group's own (env://).

    torchrun's c10d rendezvous hands every worker group it starts, a restarted one too, the same store (its agent's,
    TORCHELASTIC_USE_AGENT_STORE), with no prefix per start (torch issue #135712: the restart count it would use
    is not the same on every node). A restarted group then reads what the dead one left there, a peer's old
    address, and waits for ever or fails: `--max-restarts` never resumed. Here each start's keys go under a prefix
    that its rank 0 draws and every other rank confirms through a handshake that old keys cannot pass: rank r
    writes a nonce of its own, rank 0 answers it with its nonce, and rank r's confirmation must carry both."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"], port=int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    deadline = time.monotonic() + timeout.total_seconds()
    mine = uuid.uuid4().hex
    if info.rank == 0:
        waiting, answered = set(range(1, info.world_size)), {}
        while waiting:
            for rank in sorted(waiting):
                hello = _read(store, f"{HANDSHAKE}/hello/{rank}")
                if hello is None:
                    continue
                if _read(store, f"{HANDSHAKE}/ready/{rank}") == f"{hello} {mine}":
                    waiting.discard(rank)
                elif answered.get(rank) != hello:
                    store.set(f"{HANDSHAKE}/answer/{rank}", f"{hello} {mine}")
                    answered[rank] = hello
            _wait_a_little(deadline, info, lambda: f"rank(s) {', '.join(map(str, sorted(waiting)))} did not join")
        leader = mine
    else:
        store.set(f"{HANDSHAKE}/hello/{info.rank}", mine)
        while True:
            answer = _read(store, f"{HANDSHAKE}/answer/{info.rank}") or ""
            if answer.startswith(mine + " "):
                leader = answer.split(" ", 1)[1]
                store.set(f"{HANDSHAKE}/ready/{info.rank}", answer)
                break
            _wait_a_little(deadline, info, lambda: "rank 0 did not answer")
    return dist.PrefixStore(f"transformer/{leader}/", store)


def _read(store, key: str) -> str | None:
    return store.get(key).decode() if store.check([key]) else None


def _wait_a_little(deadline: float, info: DistInfo, what) -> None:
    if time.monotonic() > deadline:
        raise UserError(
            f"rank {info.rank}: {what()} within {peer_timeout()} s (TRANSFORMER_DIST_TIMEOUT); every rank must "
            "start: check the other nodes' torchrun"
        )
    time.sleep(0.02)


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel:
    """The module under DistributedDataParallel: gradients averaged over ranks in buckets during backward.
    gradient_as_bucket_view: the gradients are views of the buckets, so DDP neither copies them in and out of the
    buckets nor keeps a second copy (a model's gradient size less memory). broadcast_buffers=False: the only
    buffer is the constant sinusoid table."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        broadcast_buffers=False,
        gradient_as_bucket_view=True,
    )


def shutdown_distributed() -> None:
    """Leave the process group after a normal end (not after an error: train())."""
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def peer_failure_explained(info: DistInfo) -> Iterator[None]:
    """Under torchrun, turn a failed collective (the usual cause: a peer that died) into a one-line UserError,
    and ignore SIGINT/SIGTERM from then on. torchrun sends SIGTERM to the surviving ranks when one dies; one
    that arrived while this error unwinds would end the rank (by the default action, or as a stop request)
    before the message is printed. Blocking it in this thread would not do: any of the process's threads
    (gloo's, OpenMP's) may receive it. The rank ends with this error anyway, and the handlers entered before
    (resume.stop_at_once, StopRequested) leave the ignoring in place as they exit."""
    try:
        yield
    except RuntimeError as e:
        if not is_peer_failure(e, info):
            raise
        set_stop_handlers(signal.SIG_IGN)
        raise UserError(f"{peer_failure(e, info)}; continue from last.pt with --resume") from None


def is_peer_failure(e: BaseException, info: DistInfo) -> bool:
    """Whether `e` is a collective that failed (a peer that died, or one that kept the others waiting too long)."""
    text = str(e).lower()
    return (
        info.enabled
        and isinstance(e, RuntimeError)
        and not is_out_of_memory(e)
        and (isinstance(e, dist.DistError) or "peer" in text or "nccl" in text or "gloo" in text)
    )


def peer_failure(e: BaseException, info: DistInfo) -> str:
    """A failed collective in words: a wait past TRANSFORMER_DIST_TIMEOUT, or (the usual cause) a peer gone."""
    if "timed out" in str(e).lower() or "timeout" in str(e).lower():
        return (
            f"rank {info.rank}: distributed training stopped: another rank kept this one waiting for more than "
            f"{peer_timeout()} s ({TIMEOUT_VARIABLE}; {first_line(e)[:200]})"
        )
    return (
        f"rank {info.rank}: distributed training stopped, most likely because another rank "
        f"crashed or was killed ({first_line(e)[:300]})"
    )


@contextlib.contextmanager
def all_or_none(info: DistInfo, what: str) -> Iterator[None]:
    """Run the block on every rank and let every rank know how it went there: a UserError on any rank becomes a
    one-line error on all of them (this rank's own, or one naming the rank that failed, its host and why), where the
    others would wait at their next collective for a peer that had gone, and then blame a crash. The block must
    hold no collective; `what` says what it does ("prepare the data"), for the messages."""
    error: UserError | None = None
    try:
        yield
    except UserError as e:
        error = e
    if not info.enabled:
        if error is not None:
            raise error
        return
    try:
        outcomes = gather_objects(None if error is None else (socket.gethostname(), str(error)), info)
    except RuntimeError as e:
        if not is_peer_failure(e, info):
            raise
        if error is not None:
            raise error from None
        raise UserError(f"{peer_failure(e, info)}, while the ranks were to {what}") from None
    if error is not None:
        raise error
    failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        rank, (host, message) = failed[0]
        raise UserError(f"rank {info.rank}: stopped, since rank {rank} (on {host}) could not {what}: {message}")


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def gather_objects(obj, info: DistInfo) -> list:
    """Every rank's `obj`, in rank order (on every rank)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def report_to_launcher(message: str) -> None:
    """Under torchrun, write a worker's one-line error where the launcher looks for it (the error file of
    torch.distributed.elastic), so that its failure summary shows this line instead of a pointer to the docs.
    torchrun still ends with its own ChildFailedError traceback: torch gives a worker no way to avoid it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": message, "timestamp": int(time.time())}, f)
    except OSError:
        pass
