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
