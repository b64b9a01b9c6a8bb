"""What each verb of the `transformer` command does with its parsed arguments (cli.py parses them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from transformer.errors import UserError, out_of_memory_names


def cmd_train(args: argparse.Namespace) -> None:
    from transformer.config import load_config
    from transformer.resume import run_config
    from transformer.train import train

    config, resume = args.config, args.resume
    if isinstance(resume, str) and config is None and Path(resume).is_file():
        config, resume = resume, True  # `train --resume CONFIG` is `train CONFIG --resume`
    if isinstance(resume, str):  # --resume RUN_DIR: the run's own config.yaml, --set on top
        if config is not None:
            raise UserError("train: give CONFIG --resume (the run in the config's train.run_dir) or --resume "
                            "RUN_DIR (the run's own config.yaml), not both")
        train(run_config(resume, args.set), resume=True, overrides=args.set)
        return
    if config is None:
        raise UserError("train: give a config file, or --resume RUN_DIR to continue a run")
    train(load_config(config, args.set), resume=resume, config_path=config, overrides=args.set)


def _check_beam(beam: Optional[int]) -> None:
    if beam is not None and beam < 1:
        raise UserError(f"--beam must be at least 1 (1 = greedy), got {beam}")


def _check_search_args(args: argparse.Namespace) -> None:
    """Ranges argparse's types do not check, reported in one line like every other error (translate, evaluate,
    serve)."""
    from transformer.config import lenpen_problem

    _check_beam(args.beam)
    if args.lenpen is not None and lenpen_problem(args.lenpen, "--lenpen") is not None:
        raise UserError(lenpen_problem(args.lenpen, "--lenpen"))
    if args.max_tokens is not None and args.max_tokens < 1:
        raise UserError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.workers is not None and args.workers < 1:
        raise UserError(f"--workers must be at least 1, got {args.workers}")


def _dtype(args: argparse.Namespace) -> str:
    """translate's and evaluate's --dtype, or --int8: not both unless they agree (no last flag wins)."""
    if args.int8 and args.dtype not in (None, "int8"):
        raise UserError(f"--int8 means --dtype int8; it cannot go with --dtype {args.dtype}")
    return "int8" if args.int8 else args.dtype or "auto"


def cmd_prepare(args: argparse.Namespace) -> None:
    from transformer.config import load_config
    from transformer.train import prepare_only

    cfg = load_config(args.config, args.set)
    print(prepare_only(cfg))


def cmd_finish(args: argparse.Namespace) -> None:
    from transformer.device import pick_device
    from transformer.finish import finish
    from transformer.resume import RunLock
    from transformer.runlog import setup_logging
    from transformer.distributed import DistInfo

    run_dir = Path(args.run)
    if not (run_dir / "last.pt").is_file():
        raise UserError(f"finish: {run_dir} is not a run directory with a last.pt")
    with RunLock(run_dir, "finish"):  # not while a training process owns the directory
        setup_logging(run_dir, DistInfo())
        finish(run_dir, pick_device(args.device))


def cmd_attention(args: argparse.Namespace) -> None:
    from transformer.checkpoint import load_model
    from transformer.attention_maps import KINDS, inspect_attention
    from transformer.plots import output_path, write_attention_figures
    from transformer.search import beam_above_vocabulary

    output_path(args.out, "attention")  # a bad suffix or a directory fails before the model is loaded
    _check_beam(args.beam)
    model, vocab, cfg = load_model(args.checkpoint)
    beam = cfg.decode.beam if args.beam is None else args.beam
    if beam > len(vocab):
        raise UserError(f"attention: {beam_above_vocabulary(beam, len(vocab))}")
    with out_of_memory_names(f"the attention maps with beam {beam} (lower --beam)"):
        maps = inspect_attention(model, vocab, args.source, args.target, beam=beam, lenpen=cfg.decode.lenpen,
                                 max_len_offset=cfg.decode.max_len_offset, stop=cfg.decode.stop)
    if args.target is None:
        print(f"translation: {maps.target}", file=sys.stderr)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for path in write_attention_figures(maps, args.out, kinds, args.layer, args.head):
        print(path)


def cmd_plot_positions(args: argparse.Namespace) -> None:
    from transformer.plots import positional_encoding, save

    print(save(positional_encoding(args.d_model, args.length), args.out, "plot-positions"))


def cmd_plot(args: argparse.Namespace) -> None:
    from transformer.plots import save, training_curves
    from transformer.runlog import read_metrics

    x = "elapsed" if args.x == "time" else "step"
    print(save(training_curves(read_metrics(args.run), title=f"Training: {args.run}", x=x), args.out))


def cmd_translate(args: argparse.Namespace) -> None:
    from transformer.translate_io import run_translate

    _check_search_args(args)
    with out_of_memory_names("the search (lower --beam or --max-tokens)"):
        run_translate(args.checkpoint, args.sentences, args.input, args.output, args.beam, args.lenpen, args.nbest,
                      args.max_tokens, args.device, _dtype(args), args.stop, args.engine, args.workers)


def cmd_evaluate(args: argparse.Namespace) -> None:
    from transformer.evaluate import run_evaluate

    _check_search_args(args)
    with out_of_memory_names("the search (lower --beam or --max-tokens)"):
        run_evaluate(args.run, args.split, args.src, args.ref, args.beam, args.lenpen, args.max_tokens, args.device,
                     _dtype(args), args.stop, args.engine, args.workers)


def cmd_export(args: argparse.Namespace) -> None:
    if args.format == "hf":
        if args.quantization is not None:
            raise UserError("export hf: --quantization is for ctranslate2 only (the hf export writes float32 weights; "
                            "from_pretrained converts them when it loads, with its dtype argument)")
        from transformer.hf_export import run_export_hf

        run_export_hf(args.checkpoint, args.out, args.force)
        return
    from transformer.export import run_export

    run_export(args.checkpoint, args.out, args.quantization, args.force)


SERVE_MODULES = ("fastapi", "uvicorn", "starlette", "pydantic")


def cmd_serve(args: argparse.Namespace) -> None:
    _check_search_args(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        from transformer.serve import ServeSettings, run_serve
    except ModuleNotFoundError as e:
        if e.name not in SERVE_MODULES:
            raise
        raise UserError(f"serve needs the 'serve' extra ({e.name} is not installed): "
                        "pip install 'transformer[serve]'") from None
    settings = ServeSettings(batch_window_ms=args.batch_window_ms, max_sentences=args.max_sentences,
                             max_chars=args.max_chars, max_beam=args.max_beam, max_pending=args.max_pending,
                             max_answer_values=args.max_answer_values, max_connections=args.max_connections,
                             read_timeout_s=args.read_timeout, keep_alive_s=args.keep_alive_timeout,
                             drain_s=args.drain_timeout, allow_hosts=tuple(args.allow_host))
    run_serve(args.checkpoint, args.host, args.port, settings, args.device, args.dtype, args.beam, args.lenpen,
              args.stop, args.max_tokens, args.workers, args.engine)


def cmd_average(args: argparse.Namespace) -> None:
    from transformer.average import average

    target, paths = average(args.inputs, args.last, args.output)
    names = ", ".join(p.name for p in paths)
    what = f"1 checkpoint ({names}: its weights alone)" if len(paths) == 1 else f"{len(paths)} checkpoints ({names})"
    print(f"averaged {what} into {target}")
