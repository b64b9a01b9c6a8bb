"""The `transformer` command's entry point (`transformer.cli:main`, `python -m transformer`): the arguments parsed
(parser.py), the verb run (commands.py), its errors as one line with exit status 2, a reader that went away ended
quietly, and torchrun's workers ended without finalizing."""

from __future__ import annotations

import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import NoReturn

from transformer.cli.parser import build_parser
from transformer.errors import UserError


def _fill_closed_outputs() -> None:
    """Put /dev/null on a closed stdout/stderr (`>&-`), so that no file we open later (a checkpoint) takes
    descriptor 1 or 2 and receives what a library prints there. Python has set sys.stdout to None already.
    A closed stdin stays closed: reading it is refused (sys.stdin is None), and /dev/stdin stays absent."""
    for fd in (1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_WRONLY)
            if null != fd:  # 0 was free as well
                os.dup2(null, fd)
                os.close(null)


def _error(message: str) -> None:
    # One write, flushed: torchrun's ranks share one stderr, and print's separate write of the newline let two
    # ranks' errors run together on one line.
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    if os.environ.get("TORCHELASTIC_ERROR_FILE"):  # under torchrun: its failure summary shows this line
        from transformer.distributed import report_to_launcher

        report_to_launcher(f"error: {message}")
    sys.exit(2)


def main(argv: Sequence[str] | None = None) -> None:
    if os.environ.get("WORLD_SIZE", "1") != "1":  # one of torchrun's workers
        _exit_without_finalizing(argv)
    _main(argv)


def _exit_without_finalizing(argv: Sequence[str] | None) -> NoReturn:
    """Run the command, flush what it wrote, and end the process with its exit status through os._exit.
    Why: DistributedDataParallel keeps the process group, and with it gloo's worker threads, alive until the
    process ends (torch keeps references to it that are never dropped). A worker that lets go of the last
    reference to a tensor Python has already released must take the GIL; if the interpreter is finalizing
    by then, the thread is unwound and C++ aborts the process ('terminate called without an active
    exception', SIGABRT) after a run that succeeded. Skipping finalization leaves no moment for that."""
    code = 0
    try:
        _main(argv)
    except SystemExit as e:
        code = e.code
    except BaseException:  # what the interpreter would print on its way out
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message"): printed, status 1
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()  # the log files' last lines
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _main(argv: Sequence[str] | None) -> None:
    _fill_closed_outputs()
    args = build_parser().parse_args(argv)
    from transformer.device import bounded_onednn_caches, default_cuda_allocator  # torch: not imported for --help

    default_cuda_allocator()  # before any command allocates on a GPU
    bounded_onednn_caches()  # before any command builds a oneDNN primitive on the CPU
    try:
        args.func(args)
        if sys.stdout is not None:
            sys.stdout.flush()  # a reader that went away shows here, not at exit
    except UserError as e:
        _error(str(e))
    except BrokenPipeError:
        # The reader of our output went away (`| head -1`): stop quietly, as Unix tools do (128 + SIGPIPE).
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        except (AttributeError, OSError, ValueError):
            pass
        sys.exit(141)
    except OSError as e:  # an unwritable output path, a full disk, a directory where a file should be
        _error(f"{e.filename}: {e.strerror}" if e.filename and e.strerror else str(e))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
