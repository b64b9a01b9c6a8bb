"""The `transformer` command line: one subcommand per step of the pipeline, errors as one line."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from transformer.errors import UserError


def cmd_train(args: argparse.Namespace) -> None:
    from transformer.config import load_config
    from transformer.train import train

    cfg = load_config(args.config, args.set)
    train(cfg, resume=args.resume, config_path=args.config)


def cmd_attention(args: argparse.Namespace) -> None:
    from transformer.checkpoint import load_model
    from transformer.inspect import KINDS, inspect_attention
    from transformer.plots import output_path, write_attention_figures

    output_path(args.out)  # a bad suffix fails before the model is loaded
    model, vocab, cfg = load_model(args.checkpoint)
    beam = cfg.decode.beam if args.beam is None else args.beam
    maps = inspect_attention(model, vocab, args.source, args.target, beam=beam, lenpen=cfg.decode.lenpen,
                             max_len_offset=cfg.decode.max_len_offset)
    if args.target is None:
        print(f"translation: {maps.target}", file=sys.stderr)
    kinds = KINDS if args.kind == "all" else (args.kind,)
    for path in write_attention_figures(maps, args.out, kinds, args.layer, args.head):
        print(path)


def cmd_plot_positions(args: argparse.Namespace) -> None:
    from transformer.plots import positional_encoding, save

    print(save(positional_encoding(args.d_model, args.length), args.out))


def cmd_plot(args: argparse.Namespace) -> None:
    from transformer.plots import read_metrics, save, training_curves

    print(save(training_curves(read_metrics(args.run), title=f"Training: {args.run}"), args.out))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer",
        description="Train encoder-decoder Transformer translation models from YAML configs, "
                    "translate with beam search, and score with sacreBLEU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    p = sub.add_parser(
        "train", help="train a model from a YAML config",
        description="Train a model from a YAML config. The run directory (train.run_dir) receives the "
                    "effective config, the SentencePiece model, metrics.jsonl, train.log, last.pt and best.pt.",
    )
    p.add_argument("config", help="YAML config file, e.g. configs/multi30k.yaml")
    p.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                   help="override one config value (repeatable), e.g. --set train.max_steps=500")
    p.add_argument("--resume", action="store_true",
                   help="continue the run in train.run_dir from its last.pt at the saved step")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser(
        "attention", help="plot the attention weights of every layer and head for one sentence",
        description="Run one sentence through a trained model and plot its attention weights: encoder "
                    "self-attention, masked decoder self-attention and encoder-decoder (cross) attention, "
                    "one figure per kind with a grid of layers (rows) x heads (columns). Without --target the "
                    "decoder reads the model's own translation (beam search with the checkpoint's decode "
                    "settings). Rows are queries, columns are keys, both labelled with SentencePiece pieces "
                    "(U+2581 marks a word start); every row sums to 1.",
    )
    p.add_argument("checkpoint", metavar="RUN_DIR_OR_CHECKPOINT",
                   help="a run directory (its best.pt, else last.pt) or a checkpoint file")
    p.add_argument("source", help='the source sentence, e.g. "Ein Hund rennt durch den Schnee."')
    p.add_argument("--target", metavar="SENTENCE",
                   help="force-decode this translation instead of the model's own")
    p.add_argument("--layer", type=int, metavar="L", help="only layer L (numbered from 1, as in the figures)")
    p.add_argument("--head", type=int, metavar="H",
                   help="only head H (numbered from 1); with --layer, one large map with the weights printed")
    p.add_argument("--kind", choices=("all", "encoder", "decoder", "cross"), default="all",
                   help="which attention to plot (default: all three, one file each)")
    p.add_argument("--beam", type=int, metavar="N",
                   help="beam size for the model's own translation (default: the checkpoint's decode.beam; 1 = greedy)")
    p.add_argument("--out", required=True, metavar="FILE",
                   help="image file; .png (default) or .svg/.pdf. With several kinds the files are FILE's stem "
                        "+ _encoder, _decoder, _cross; the written paths are printed")
    p.set_defaults(func=cmd_attention)

    p = sub.add_parser(
        "plot-positions", help="plot the sinusoidal positional-encoding table",
        description="Plot the sinusoidal positional encodings as a heat map: one row per position, "
                    "one column per dimension, values in -1..1.",
    )
    p.add_argument("--d-model", type=int, default=512, help="model width (even; default 512)")
    p.add_argument("--length", type=int, default=100, help="number of positions (default 100)")
    p.add_argument("--out", required=True, metavar="FILE", help="image file: .png (default), .svg or .pdf")
    p.set_defaults(func=cmd_plot_positions)

    p = sub.add_parser(
        "plot", help="plot training curves from a run's metrics.jsonl",
        description="Plot a run's training curves from its metrics.jsonl: train and valid loss, valid "
                    "perplexity, valid BLEU (when logged) and the learning rate against steps. Works on a "
                    "run that is still training.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory (or its metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE", help="image file: .png (default), .svg or .pdf")
    p.set_defaults(func=cmd_plot)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
