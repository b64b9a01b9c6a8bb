"""What each verb of the `transformer` command does with its parsed arguments (parser.py parses them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from transformer.errors import UserError, out_of_memory_names

if TYPE_CHECKING:
    from transformer.inference.settings import SearchFlags


def cmd_train(args: argparse.Namespace) -> None:
    from transformer.config import load_config
    from transformer.training.loop import train
    from transformer.training.run_state import run_config

    config, resume = args.config, args.resume
    if isinstance(resume, str) and config is None and Path(resume).is_file():
        config, resume = resume, True  # `train --resume CONFIG` is `train CONFIG --resume`
    if isinstance(resume, str):  # --resume RUN_DIR: the run's own config.yaml, --set on top
        if config is not None:
            raise UserError(
                "train: give CONFIG --resume (the run in the config's train.run_dir) or --resume "
                "RUN_DIR (the run's own config.yaml), not both"
            )
        train(run_config(resume, args.set), resume=True, overrides=args.set)
        return
    if config is None:
        raise UserError("train: give a config file, or --resume RUN_DIR to continue a run")
    train(load_config(config, args.set), resume=resume, config_path=config, overrides=args.set)


def _search_flags(args: argparse.Namespace) -> SearchFlags:
    """The search options a verb has (parser.add_search_options; translate's --nbest and --alignments too) as
    SearchFlags, checked there before anything loads: every option of inference/settings.py's table with a flag,
    None where the verb has no such option. --int8 is --dtype int8: not with another --dtype (no last flag wins);
    no --dtype is auto."""
    from transformer.inference.settings import OPTIONS, SearchFlags

    if args.int8 and args.dtype not in (None, "int8"):
        raise UserError(f"--int8 means --dtype int8; it cannot go with --dtype {args.dtype}")
    given = {name: getattr(args, option.dest, None) for name, option in OPTIONS.items() if option.flag}
    return SearchFlags(**{**given, "dtype": "int8" if args.int8 else args.dtype or "auto"})


def _is_checkpoint(item: str) -> bool:
    """Whether a positional argument names a checkpoint (a .pt file, or a directory holding one) rather than a
    sentence."""
    from transformer.model.checkpoint import resolve_checkpoint

    path = Path(item)
    try:
        if path.is_file():
            return path.suffix == ".pt"
        if not path.is_dir():
            return False
        resolve_checkpoint(path)
    except (UserError, OSError, ValueError):  # no checkpoint there; a name too long or with a NUL byte
        return False
    return True


def _checkpoints(verb: str, args: argparse.Namespace, items: list[str]) -> tuple[list[str], list[str]]:
    """(checkpoints, the rest): --checkpoint's if given (then every positional is the rest), else the first
    positional and every checkpoint right after it (an ensemble)."""
    if args.checkpoints:
        return args.checkpoints, items
    if not items:
        raise UserError(f"{verb}: give a run directory or checkpoint (or --checkpoint PATH)")
    count = 1
    while count < len(items) and _is_checkpoint(items[count]):
        count += 1
    return items[:count], items[count:]


def cmd_prepare(args: argparse.Namespace) -> None:
    from transformer.config import load_config
    from transformer.training.loop import prepare_only

    cfg = load_config(args.config, args.set)
    print(prepare_only(cfg))


def cmd_finish(args: argparse.Namespace) -> None:
    from transformer.device import pick_device
    from transformer.distributed import DistInfo
    from transformer.run_dir import RunDir
    from transformer.training.finish import finish
    from transformer.training.lock import RunLock
    from transformer.training.metrics import setup_logging

    run_dir = Path(args.run)
    if not RunDir(run_dir).last.is_file():
        raise UserError(f"finish: {run_dir} is not a run directory with a last.pt")
    with RunLock(run_dir, "finish"):  # not while a training process owns the directory
        setup_logging(run_dir, DistInfo())
        finish(run_dir, pick_device(args.device))


def cmd_attention(args: argparse.Namespace) -> None:
    from transformer.inference.settings import SearchFlags
    from transformer.inference.translator import Translator
    from transformer.visualize.attention import KINDS, inspect_attention
    from transformer.visualize.plots import output_path, write_attention_figures

    output_path(args.out, "attention")  # a bad suffix or a directory fails before the model is loaded
    translator = Translator(args.checkpoint, "cpu", SearchFlags(beam=args.beam, dtype="fp32"))
    (source,), (prefix,) = translator.asking([args.source], args.target_lang)
    settings = translator.settings
    with out_of_memory_names(f"the attention maps with beam {settings.beam} (lower --beam)"):
        maps = inspect_attention(translator.model, translator.vocab, source, args.target, settings, prefix)
    if args.target is None:
        print(f"translation: {maps.target}", file=sys.stderr)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for path in write_attention_figures(maps, args.out, kinds, args.layer, args.head):
        print(path)


def cmd_animate(args: argparse.Namespace) -> None:
    from transformer.inference.settings import SearchFlags
    from transformer.inference.translator import Translator
    from transformer.visualize.animation import check_fps, check_output, write_animation
    from transformer.visualize.walkthrough import frames, walk

    check_fps(args.fps)
    check_output(args.out, args.force)  # before the model loads
    if not args.source.strip():
        raise UserError("animate: the source sentence is empty; give a sentence to animate")
    translator = Translator(args.checkpoint, args.device, SearchFlags(beam=args.beam, dtype=args.dtype))
    if translator.note:
        print(translator.note, file=sys.stderr)
    (source,), (prefix,) = translator.asking([args.source], args.target_lang)
    model, vocab, settings = translator.model, translator.vocab, translator.settings
    with out_of_memory_names(f"the animation with beam {settings.beam} (lower --beam)"):
        shown = walk(model, vocab, source, settings, args.layer, args.head, args.only, prefix)
    if shown.decoder is not None:
        print(f"translation: {shown.decoder.translation}", file=sys.stderr)
    print(write_animation(frames(shown), args.out, args.fps, args.force))


def cmd_plot_positions(args: argparse.Namespace) -> None:
    from transformer.visualize.plots import positional_encoding, save

    figure = positional_encoding(args.d_model, args.length, args.kind, args.n_heads, args.model)
    print(save(figure, args.out, "plot-positions"))


def cmd_plot(args: argparse.Namespace) -> None:
    from transformer.training.metrics import read_metrics
    from transformer.visualize.plots import save, training_curves

    x = "elapsed" if args.x == "time" else "step"
    print(save(training_curves(read_metrics(args.run), title=f"Training: {args.run}", x=x), args.out))


def cmd_synthesize(args: argparse.Namespace) -> None:
    from transformer.inference.synthesis import synthesize

    flags = _search_flags(args)
    with out_of_memory_names("the search (lower --beam or --max-tokens)"):
        synthesize(
            args.checkpoints,
            args.input,
            args.out,
            args.device,
            flags,
            args.chunk_lines,
            filtered=not args.no_filter,
            target_lang=args.target_lang,
        )


def cmd_translate(args: argparse.Namespace) -> None:
    from transformer.cli.translate_io import run_translate

    flags = _search_flags(args)
    positional = ([args.checkpoint] if args.checkpoint is not None else []) + list(args.sentences)
    checkpoints, sentences = _checkpoints("translate", args, positional)
    with out_of_memory_names("the search (lower --beam or --max-tokens)"):
        run_translate(
            checkpoints,
            sentences,
            args.input,
            args.output,
            args.device,
            flags,
            prefix_file=args.prefix_file,
            constraints_file=args.constraints_file,
            target_lang=args.target_lang,
        )


def cmd_evaluate(args: argparse.Namespace) -> None:
    from transformer.inference.evaluation import run_evaluate

    flags = _search_flags(args)
    if args.hyp is not None:  # nothing to translate: run_evaluate refuses a run or checkpoint given with it
        unasked = {"dtype": "auto", "engine": "ours"}  # the options' defaults
        searched = [name for name, value in flags.given().items() if unasked.get(name) != value]
        if searched:
            flag = "--" + searched[0].replace("_", "-")
            raise UserError(f"evaluate: --hyp scores translations already made; {flag} has nothing to search")
        run_evaluate(
            [*args.checkpoints, *args.run],
            args.split,
            args.src,
            args.ref,
            compared=args.compare,
            hyp=args.hyp,
            target_lang=args.target_lang,
            source_lang=args.source_lang,
            pair=args.pair,
        )
        return
    checkpoints, rest = _checkpoints("evaluate", args, list(args.run))
    if rest:
        raise UserError(f"evaluate: {rest[0]} is not a run directory or checkpoint file")
    with out_of_memory_names("the search (lower --beam or --max-tokens)"):
        run_evaluate(
            checkpoints,
            args.split,
            args.src,
            args.ref,
            args.device,
            flags,
            args.compare,
            target_lang=args.target_lang,
            source_lang=args.source_lang,
            pair=args.pair,
        )


def cmd_export(args: argparse.Namespace) -> None:
    if args.format == "hf":
        if args.quantization is not None:
            raise UserError(
                "export hf: --quantization is for ctranslate2 only (the hf export writes float32 weights; "
                "from_pretrained converts them when it loads, with its dtype argument)"
            )
        from transformer.inference.hf_export import run_export_hf

        run_export_hf(args.checkpoint, args.out, args.force)
        return
    from transformer.inference.ctranslate2_export import run_export

    run_export(args.checkpoint, args.out, args.quantization, args.force)


def cmd_import(args: argparse.Namespace) -> None:
    from transformer.inference.hf_import import run_import_hf

    run_import_hf(args.source, args.run, args.force)


SERVE_MODULES = ("fastapi", "uvicorn", "starlette", "pydantic")


def cmd_serve(args: argparse.Namespace) -> None:
    flags = _search_flags(args)
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port must be between 0 and 65535, got {args.port}")
    try:
        from transformer.serve.server import run_serve
        from transformer.serve.service import ServeSettings
    except ModuleNotFoundError as e:
        if e.name not in SERVE_MODULES:
            raise
        raise UserError(
            f"serve needs the 'serve' extra ({e.name} is not installed): pip install 'transformer[serve]'"
        ) from None
    settings = ServeSettings(
        batch_window_ms=args.batch_window_ms,
        max_sentences=args.max_sentences,
        max_chars=args.max_chars,
        max_beam=args.max_beam,
        max_samples=args.max_samples,
        max_constraints=args.max_constraints,
        max_prefix=args.max_prefix,
        max_pending=args.max_pending,
        max_answer_values=args.max_answer_values,
        max_connections=args.max_connections,
        read_timeout_s=args.read_timeout,
        keep_alive_s=args.keep_alive_timeout,
        drain_s=args.drain_timeout,
        allow_hosts=tuple(args.allow_host),
    )
    run_serve(args.checkpoint, args.host, args.port, settings, args.device, flags, args.target_lang)


def cmd_average(args: argparse.Namespace) -> None:
    from transformer.training.average import average

    target, paths = average(args.inputs, args.last, args.output)
    names = ", ".join(p.name for p in paths)
    what = f"1 checkpoint ({names}: its weights alone)" if len(paths) == 1 else f"{len(paths)} checkpoints ({names})"
    print(f"averaged {what} into {target}")


def cmd_shortlist(args: argparse.Namespace) -> None:
    from transformer.inference.shortlist import write_shortlist

    for name in ("frequent", "per_piece"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    write_shortlist(args.run, args.src, args.tgt, args.frequent, args.per_piece)
