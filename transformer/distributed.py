"""Data-parallel plumbing over torch.distributed: process-group set-up under torchrun, rank queries, reductions."""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import signal
import time
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
        # A finite timeout turns a rank stuck on a dead peer into an error instead of a hang.
        # Long enough for rank 0's solo work (SentencePiece training, validation BLEU) while the others wait.
        timeout = datetime.timedelta(seconds=int(os.environ.get("TRANSFORMER_DIST_TIMEOUT", "1800")))
        # device_id binds the NCCL communicator to this rank's GPU at once (torch >= 2.3), instead of guessing
        # it at the first collective; barrier() then knows its device too.
        bound = (
            {"device_id": device}
            if use_cuda and "device_id" in inspect.signature(dist.init_process_group).parameters
            else {}
        )
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timeout, **bound)
    return info, device


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
        text = str(e).lower()
        if (
            not info.enabled
            or is_out_of_memory(e)
            or not (isinstance(e, dist.DistError) or "peer" in text or "nccl" in text or "gloo" in text)
        ):
            raise
        set_stop_handlers(signal.SIG_IGN)
        raise UserError(
            f"rank {info.rank}: distributed training stopped, most likely because another rank "
            f"crashed or was killed ({first_line(e)[:300]}); continue from last.pt with --resume"
        ) from None


def all_reduce_sum(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.enabled:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


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
