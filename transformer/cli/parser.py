"""The `transformer` command line: one subcommand per step of the pipeline, errors as one line.

Each verb's options are built by its `_add_<verb>` function here; what the verb does is `commands.cmd_<verb>`.
The search options of translate, evaluate, synthesize and serve are inference/settings.py's table (OPTIONS), added
by `add_search_options`."""

from __future__ import annotations

import argparse

from transformer.cli import commands, help_text
from transformer.config import POSITION_KINDS
from transformer.inference.scoring import SCORES  # no torch either
from transformer.inference.settings import (  # no torch: --help stays fast
    FLOAT_DTYPES,
    MAX_SAMPLES,
    OPTIONS,
)


def _add_target_lang(p, what: str = "each line") -> None:
    p.add_argument(
        "--target-lang",
        metavar="LANG",
        help=f"the language to translate {what} into, for a model of several (its token, e.g. >>fr<<, before each "
        "source); a line that starts with a language's token asks for that one (default: that, or the model's one)",
    )


class _IntermixedParser(argparse.ArgumentParser):
    """Lets sentences follow options (`translate RUN --beam 5 "ein Satz"`), which plain argparse rejects."""

    _inside = False

    def parse_known_args(self, args=None, namespace=None):
        if self._inside:  # parse_known_intermixed_args calls back here for its two passes
            return super().parse_known_args(args, namespace)
        self._inside = True
        try:
            return self.parse_known_intermixed_args(args, namespace)
        finally:
            self._inside = False


def _sentence(argument: str) -> str:
    """A sentence given as an argument: a byte the locale cannot decode reaches Python as a lone surrogate,
    which neither SentencePiece nor a figure's title can take; it becomes U+FFFD, as in a stream."""
    from transformer.data.vocab import valid_text  # here: `transformer --help` imports nothing heavy

    return valid_text(argument)


def _add_train(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a model from a YAML config",
        description=help_text.TRAIN,
        epilog="To continue a stopped run: `transformer train CONFIG --resume` (the config file again, with the "
        "same --set overrides) or `transformer train --resume RUN_DIR` (the run's own config.yaml, which "
        "holds the overrides it was started with; --set on top applies like a changed config).",
    )
    p.add_argument("config", nargs="?", help="YAML config file, e.g. configs/multi30k.yaml")
    p.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one config value (repeatable), e.g. --set train.max_steps=500",
    )
    p.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=False,
        metavar="RUN_DIR",
        help="continue the run in train.run_dir (or in RUN_DIR, with its own config.yaml) from its "
        "last.pt at the saved step",
    )
    p.set_defaults(func=commands.cmd_train)


def _add_prepare(sub) -> None:
    p = sub.add_parser(
        "prepare",
        help="build the vocabulary and the memory-mapped token store, without training",
        description=help_text.PREPARE,
    )
    p.add_argument("config", help="YAML config file, e.g. configs/base.yaml")
    p.add_argument(
        "--set",
        metavar="SECTION.KEY=VALUE",
        action="append",
        default=[],
        help="override one config value (repeatable), e.g. --set data.dir=data/wmt14",
    )
    p.set_defaults(func=commands.cmd_prepare)


def _add_finish(sub) -> None:
    p = sub.add_parser(
        "finish",
        help="the end of training again: average, choose on validation, score the test split",
        description=help_text.FINISH,
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory holding last.pt and best.pt")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to translate (default auto: CUDA when available)",
    )
    p.set_defaults(func=commands.cmd_finish)


def _add_model_and_sentence(p) -> None:
    """attention's and animate's first two arguments: a model, and one source sentence."""
    p.add_argument(
        "checkpoint",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a checkpoint file",
    )
    p.add_argument("source", type=_sentence, help='the source sentence, e.g. "Ein Hund rennt durch den Schnee."')
    _add_target_lang(p, "the sentence")


def _add_attention(sub) -> None:
    p = sub.add_parser(
        "attention",
        help="plot the attention weights of every layer and head for one sentence",
        description=help_text.ATTENTION,
    )
    _add_model_and_sentence(p)
    p.add_argument(
        "--target", type=_sentence, metavar="SENTENCE", help="force-decode this translation instead of the model's own"
    )
    p.add_argument("--layer", type=int, metavar="L", help="only layer L (numbered from 1, as in the figures)")
    p.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="only head H (numbered from 1); with --layer, one large map with the weights printed",
    )
    p.add_argument(
        "--kind",
        choices=("all", "encoder", "decoder", "cross"),
        default="all",
        help="which attention to plot (default: all three, one file each)",
    )
    p.add_argument(
        "--beam",
        type=int,
        metavar="N",
        help="beam size for the model's own translation (default: the checkpoint's decode.beam; 1 = greedy)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="FILE",
        help="image file; .png (default) or .svg/.pdf. With several kinds the files are FILE's stem "
        "+ _encoder, _decoder, _cross; the written paths are printed",
    )
    p.set_defaults(func=commands.cmd_attention)


def _add_animate(sub) -> None:
    p = sub.add_parser(
        "animate",
        help="an animated walk through one sentence: what the model computes, with its own values",
        description=help_text.ANIMATE,
    )
    _add_model_and_sentence(p)
    p.add_argument(
        "--out",
        required=True,
        metavar="PATH",
        help="FILE.gif, FILE.mp4 (needs ffmpeg on PATH), or a folder name without a suffix for PNG frames",
    )
    p.add_argument(
        "--layer",
        type=int,
        metavar="L",
        help="the layer followed, numbered from 1, in the encoder and the decoder (default: each one's last)",
    )
    p.add_argument(
        "--head",
        type=int,
        metavar="H",
        help="the head followed, numbered from 1 (default: the layer's head whose rows point at the most "
        "different pieces, most sharply; the decoder's chosen on its attention over the source)",
    )
    p.add_argument("--only", choices=("encoder", "decoder"), help="animate one part (default: both)")
    p.add_argument("--fps", type=float, default=1.0, metavar="F", help="frames per second (default 1)")
    p.add_argument(
        "--beam",
        type=int,
        metavar="N",
        help="beam size of the search whose best translation the decoder part follows (default: the "
        "checkpoint's decode.beam; 1 = greedy)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where to run the model (default auto: CUDA when available)",
    )
    p.add_argument(
        "--dtype",
        choices=FLOAT_DTYPES,
        default="fp32",
        help="the model's number format (default fp32); the values drawn are those it computes in it",
    )
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.set_defaults(func=commands.cmd_animate)


def _add_plot_positions(sub) -> None:
    p = sub.add_parser(
        "plot-positions",
        help="plot a kind of position (the sinusoid table by default)",
        description="Plot what a kind of position (model.positions) shows, as a heat map: one row per position. "
        "sinusoidal and marian: the table added to the embeddings (values in -1..1); rotary: the cosine of the "
        "angle each pair of a head's dimensions turns by; learned: a trained model's tables (--model).",
    )
    p.add_argument("--kind", choices=POSITION_KINDS, default=None, help="the kind of position (default sinusoidal)")
    p.add_argument("--d-model", type=int, default=None, help="model width (default 512; even for the sinusoids)")
    p.add_argument(
        "--n-heads", type=int, default=None, help="attention heads: rotary's head size is d_model / n_heads (default 8)"
    )
    p.add_argument(
        "--length", type=int, default=None, help="number of positions (default 100, or a --model's positions if fewer)"
    )
    p.add_argument(
        "--model",
        metavar="RUN_OR_CHECKPOINT",
        help="plot this model's own positions (its kind and sizes; a learned table exists only in a model)",
    )
    p.add_argument("--out", required=True, metavar="FILE", help="image file: .png (default), .svg or .pdf")
    p.set_defaults(func=commands.cmd_plot_positions)


def _add_plot(sub) -> None:
    p = sub.add_parser(
        "plot",
        help="plot training curves from a run's metrics.jsonl",
        description="Plot a run's training curves from its metrics.jsonl: train and valid loss, valid "
        "perplexity, valid BLEU (when logged) and the learning rate against steps, or against training "
        "wall time with --x time. Works on a run that is still training.",
    )
    p.add_argument("run", metavar="RUN_DIR", help="a run directory (or its metrics.jsonl)")
    p.add_argument("--out", required=True, metavar="FILE", help="image file: .png (default), .svg or .pdf")
    p.add_argument(
        "--x",
        choices=("step", "time"),
        default="step",
        help="against optimizer updates (default) or training wall time in minutes (time to quality)",
    )
    p.set_defaults(func=commands.cmd_plot)


def _add_synthesize(sub) -> None:
    p = sub.add_parser(
        "synthesize",
        help="write a training corpus from a model's translations (back-translation, distillation)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=help_text.SYNTHESIZE,
    )
    p.add_argument(
        "checkpoints",
        nargs="+",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a .pt file; several: an ensemble",
    )
    p.add_argument("--input", required=True, metavar="FILE", help="the text to translate, one sentence per line")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory of the pairs (created; resumed)")
    p.add_argument(
        "--nbest",
        type=int,
        default=1,
        metavar="N",
        help=f"outputs per input line: the N best (N <= beam), or N samples with --sample (N <= {MAX_SAMPLES})",
    )
    p.add_argument(
        "--chunk-lines",
        type=int,
        default=10_000,
        metavar="N",
        help="lines per part written whole (what a stop may redo; default 10000, as translate --input batches)",
    )
    p.add_argument("--no-filter", action="store_true", help="keep every output, degenerate ones too")
    add_search_options(p)
    _add_target_lang(p, "the input")
    p.set_defaults(func=commands.cmd_synthesize)


def _add_translate(sub) -> None:
    p = sub.add_parser(
        "translate",
        help="translate sentences with a trained model",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=help_text.TRANSLATE,
    )
    p.add_argument(
        "checkpoint",
        nargs="?",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a .pt file; more of them, before "
        "the sentences, make an ensemble",
    )
    p.add_argument(
        "sentences",
        nargs="*",
        type=_sentence,
        metavar="SENTENCE",
        help="sentences to translate (default: --input or stdin)",
    )
    p.add_argument(
        "--input",
        metavar="FILE",
        help="UTF-8 file, one sentence per line; a pipe such as <(zcat x.gz) works too, - is stdin",
    )
    p.add_argument(
        "--output",
        metavar="FILE",
        help="write translations here instead of stdout: into FILE.partial, renamed over FILE once all is "
        "translated (after a stop FILE is unchanged and FILE.partial keeps what was done; an existing "
        "FILE.partial is never written over: move it away first)",
    )
    p.add_argument(
        "--nbest",
        type=int,
        default=1,
        metavar="N",
        help="print the N best translations per line as SCORE<TAB>TEXT (N <= beam; with --sample, N samples, "
        f"N <= {MAX_SAMPLES})",
    )
    _add_checkpoints(p)
    _add_line_options(p)
    add_search_options(p)
    _add_target_lang(p, "each line")
    p.set_defaults(func=commands.cmd_translate)
    p.__class__ = _IntermixedParser  # same parser, intermixed positionals


def _add_line_options(p) -> None:
    """translate's options for what each input line asks beyond the search settings, and its alignments."""
    p.add_argument(
        "--prefix-file",
        metavar="FILE",
        help="one target prefix per input line (an empty line: none): each translation of that line starts with "
        "it, and the search continues from there; the output keeps it",
    )
    p.add_argument(
        "--constraints-file",
        metavar="FILE",
        help="per input line, target phrases separated by tabs (an empty line: none): each translation of that "
        "line contains every one (constrained beam search); a line whose phrases cannot all fit gets a warning "
        "and its best unconstrained translation",
    )
    p.add_argument(
        "--alignments",
        action="store_true",
        default=None,
        help="print each translation's word alignment after a tab: i-j pairs, source word i to output word j "
        "(from 0), read from a decoder layer's cross-attention averaged over its heads",
    )
    p.add_argument(
        "--alignment-layer",
        type=int,
        metavar="L",
        help="the decoder layer alignments come from, from 1 (default: the last)",
    )


def _add_evaluate(sub) -> None:
    labels = ", ".join(score.label for score in SCORES)
    p = sub.add_parser(
        "evaluate",
        help=f"translate a test set and score it with sacreBLEU ({labels}); compare systems",
        description=help_text.EVALUATE,
    )
    p.add_argument(
        "run",
        nargs="*",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a .pt file; several make an "
        "ensemble (its results go to the first one's eval/, named .ensembleN)",
    )
    _add_checkpoints(p)
    p.add_argument(
        "--split", help="train, valid, test (mapped through data.*_split) or another split name (default: test)"
    )
    p.add_argument("--src", metavar="FILE", help="source sentences to translate instead of a split (with --ref)")
    p.add_argument("--ref", metavar="FILE", help="reference translations of --src (or --hyp), line by line")
    p.add_argument(
        "--compare",
        action="append",
        default=[],
        metavar="RUN_OR_FILE",
        help="another system to compare with the first one (the baseline) on the same sentences: a run directory "
        "or checkpoint (translated with the same search options, its results kept in its own eval/) or a file "
        "of its translations, line by line; repeat it for more. The table is printed and kept in the "
        "baseline's JSON",
    )
    p.add_argument(
        "--hyp",
        metavar="FILE",
        help="translations already made, scored against --ref instead of a model's (nothing is written: there is "
        "no run directory); the baseline of --compare FILE",
    )
    add_search_options(p)
    _add_target_lang(p, "the test set")
    p.add_argument(
        "--source-lang",
        metavar="LANG",
        help="the pair of a run of several source languages to evaluate, by its source (many-to-one: --source-lang "
        "fr reads the fr-en corpus's split; with --target-lang, the pair of both); default: data.src_lang's pair",
    )
    p.add_argument(
        "--pair",
        metavar="NAME",
        help="the pair to evaluate by the name validation and the end of training give it: de-en, fr-en, or a "
        "corpus's name for a second test set of a pair (a corpus of data.dir's languages with its own test_split); "
        "its results are named after it (test.NAME.*), as the end of training names each pair's where a run has several",
    )
    p.set_defaults(func=commands.cmd_evaluate)


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model: a JSON API and a page that shows its attention and beam search",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=help_text.SERVE,
    )
    p.add_argument(
        "checkpoint",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a .pt file",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1: this machine only; 0.0.0.0 opens it to the network)",
    )
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    add_search_options(p, serve=True)
    p.add_argument(
        "--batch-window-ms",
        type=float,
        default=5.0,
        metavar="MS",
        help="how long a /translate request waits for others to share its search, while another "
        "connection is open (one on the only open connection goes at once) (default 5; 0: only requests "
        "that queued while the model was busy are merged)",
    )
    _add_request_limits(p)
    _add_connection_limits(p)
    _add_target_lang(p, 'a request\'s sentences (its "target_lang" field wins)')
    p.set_defaults(func=commands.cmd_serve)


def _add_request_limits(p) -> None:
    """serve's bounds on what one request may ask and cost."""
    p.add_argument("--max-sentences", type=int, default=64, metavar="N", help="sentences per request (default 64)")
    p.add_argument(
        "--max-chars",
        type=int,
        default=10_000,
        metavar="N",
        help="characters per request, all sentences together (default 10000)",
    )
    p.add_argument(
        "--max-beam", type=int, default=16, metavar="N", help="largest beam a request may ask for (default 16)"
    )
    p.add_argument(
        "--max-samples",
        type=int,
        default=MAX_SAMPLES,
        metavar="N",
        help=f"most samples per sentence a sampling request may ask for (its nbest; default and at most {MAX_SAMPLES}, "
        "as for translate --nbest)",
    )
    p.add_argument(
        "--max-constraints",
        type=int,
        default=8,
        metavar="N",
        help="most target phrases a request may constrain one sentence with (default 8)",
    )
    p.add_argument(
        "--max-prefix",
        type=int,
        default=128,
        metavar="N",
        help="most pieces of a sentence's forced target prefix (default 128, and never more than the model takes)",
    )
    p.add_argument(
        "--max-pending",
        type=int,
        default=1024,
        metavar="N",
        help="sentences that may wait for the model, an /attention, /beam or /positions request "
        "counting one; more are refused with 503 (default 1024)",
    )
    p.add_argument(
        "--max-answer-values",
        type=int,
        default=2_000_000,
        metavar="N",
        help="attention weights an /attention answer, or pieces a /beam trace, may hold, counted from "
        "the longest translation the search may give before anything runs (413 above it; "
        "default 2000000, about 15 MB of JSON)",
    )


def _add_connection_limits(p) -> None:
    """serve's bounds on connections below the API: how many, how slow, how long a drain waits, which Host names."""
    p.add_argument(
        "--max-connections",
        type=int,
        default=512,
        metavar="N",
        help="open connections; a new one past it gets 503 and is closed (default 512)",
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds for a request's line and headers to arrive, and as many again for its body "
        "(408 and closed after); a client that takes none of an answer for as long is dropped "
        "(default 10)",
    )
    p.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="an idle connection between requests is closed after this many seconds (default 5)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="on SIGTERM or Ctrl-C, seconds the requests in flight may take; the rest get 503 (default 10)",
    )
    p.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer besides localhost, 127.0.0.1, [::1], --host and the address a client "
        "reached (repeat for more; '*' for any): others get 421, so that no page elsewhere reads "
        "the API through DNS rebinding",
    )


def _add_average(sub) -> None:
    p = sub.add_parser(
        "average",
        help="average the weights of several checkpoints into one",
        description=help_text.AVERAGE,
    )
    p.add_argument(
        "inputs", nargs="+", metavar="RUN_DIR_OR_CHECKPOINT", help="one run directory (with --last) or checkpoint files"
    )
    p.add_argument("--last", type=int, metavar="N", help="average the N latest step checkpoints of RUN_DIR")
    p.add_argument("--output", metavar="FILE", help="where to write the averaged checkpoint")
    p.set_defaults(func=commands.cmd_average)


def _add_shortlist(sub) -> None:
    p = sub.add_parser(
        "shortlist",
        help="write a run's lexical shortlist (shortlist.txt), which --shortlist searches with",
        description=help_text.SHORTLIST,
    )
    p.add_argument("run", metavar="RUN_DIR_OR_CHECKPOINT", help="the run (its vocabulary; the list goes beside it)")
    p.add_argument("--src", metavar="FILE", help="source sentences to count instead of the run's training split")
    p.add_argument("--tgt", metavar="FILE", help="their translations, line by line (with --src)")
    p.add_argument(
        "--frequent", type=int, default=100, metavar="N", help="target pieces every batch scores (default: 100)"
    )
    p.add_argument("--per-piece", type=int, default=50, metavar="K", help="candidates per source piece (default: 50)")
    p.set_defaults(func=commands.cmd_shortlist)


def _add_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="write a checkpoint as a CTranslate2 or Hugging Face (MarianMTModel) model directory",
        description=help_text.EXPORT,
    )
    p.add_argument("format", choices=("ctranslate2", "hf"), help="the target format")
    p.add_argument(
        "checkpoint",
        metavar="RUN_DIR_OR_CHECKPOINT",
        help="a run directory (its final.pt, else best.pt, else last.pt) or a .pt file",
    )
    p.add_argument("out", metavar="OUT_DIR", help="the model directory to write")
    p.add_argument(
        "--quantization",
        choices=("int8", "int8_float32", "int8_float16", "int8_bfloat16", "float16", "bfloat16"),
        help="ctranslate2 only: store the weights quantized (default: float32; CTranslate2 can also convert "
        "when it loads a model, with compute_type)",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace OUT_DIR if it is an earlier export (its transformer-export.json lists every file "
        "in it, none changed since), never any other directory",
    )
    p.set_defaults(func=commands.cmd_export)


def _add_import(sub) -> None:
    p = sub.add_parser(
        "import",
        help="make a run directory of a Hugging Face MarianMTModel (an OPUS-MT model), for every command",
        description=help_text.IMPORT,
    )
    p.add_argument("format", choices=("hf",), help="the source format")
    p.add_argument("source", metavar="HF_DIR", help="the MarianMTModel directory to read")
    p.add_argument("run", metavar="RUN_DIR", help="the run directory to write (new, or empty)")
    p.add_argument(
        "--force",
        action="store_true",
        help="replace RUN_DIR if it is an earlier import (its transformer-import.json lists every file in it, "
        "none changed since), never any other directory",
    )
    p.set_defaults(func=commands.cmd_import)


def _add_checkpoints(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        metavar="PATH",
        dest="checkpoints",
        help="a run directory or checkpoint to search with (repeat it for an ensemble: the models' "
        "log-probabilities averaged at each step; one vocabulary); instead of the positional one",
    )


def add_search_options(p: argparse.ArgumentParser, serve: bool = False) -> None:
    """The search options, the same for translate, evaluate, synthesize and serve (commands._search_flags reads
    them), in a group of their own: the options inference/settings.py's table shares among them (OPTIONS), with
    where to run and --int8 beside --dtype. serve: serve's wording, where it has its own."""
    g = p.add_argument_group("search options")
    for option in OPTIONS.values():
        if not (option.flag and option.shared):
            continue
        if option.name == "dtype":
            g.add_argument(
                "--device",
                choices=("auto", "cpu", "cuda"),
                default="auto",
                help="where to run (default auto: CUDA when available)",
            )
        g.add_argument(option.flag, **option.cli, help=(serve and option.serve_help) or option.help)
        if option.name == "dtype":
            g.add_argument("--int8", action="store_true", help="the same as --dtype int8")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="transformer",
        description="Train encoder-decoder Transformer translation models from YAML configs, "
        "translate with beam search, and score with sacreBLEU.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    _add_train(sub)
    _add_prepare(sub)
    _add_finish(sub)
    _add_attention(sub)
    _add_animate(sub)
    _add_plot_positions(sub)
    _add_plot(sub)
    _add_translate(sub)
    _add_synthesize(sub)
    _add_evaluate(sub)
    _add_serve(sub)
    _add_average(sub)
    _add_shortlist(sub)
    _add_export(sub)
    _add_import(sub)
    return parser
