#!/usr/bin/env python
"""A model shape's translation cost before it is trained: the work of a beam search replayed with random weights.

    python scripts/bench_shapes.py data/multi30k/test.de --ref data/multi30k/test.en \\
        --shape teacher runs/multi30k \\
        --shape d192 runs/multi30k model.d_model=192 model.d_ff=768 model.n_encoder_layers=6 \\
            model.n_decoder_layers=1 model.norm=pre vocab=runs/other/spm.model \\
        [--beam 4] [--threads 2] [--limit 500] [--rounds 3] [--json shapes.json]

A trained model's speed depends on its shape and on how long its outputs are, not on its weights; so a shape
(a run's or checkpoint's config with `--set`-style overrides, and its vocabulary or a SentencePiece model
`vocab=FILE`) is priced
by replaying what a search does for it: the sources encoded, the cross-attention K/V projected once, then per step
each live row decoded one position with the cache, projected onto the vocabulary, log-softmaxed in place and its
2*beam best ranked, each sentence's 2*beam best of those ranked, and the cache reordered; a sentence leaves the
batch after as many steps as its reference has pieces (+ EOS) in that shape's vocabulary. Batches are length
batches of decode.max_tokens source tokens, one search at a time on --threads threads (as
scripts/bench_phases.py times a trained model). The first shape is the baseline: each one's speed relative to
it is the median over rounds of the ratio within a round (every shape once a round, the order reversed every
other round). What it leaves out: a trained search's own stop rule (hypotheses end where the model puts EOS,
not at the reference's length), tokenising, and searches side by side; so compare its ratios with each other, and
check a trained student with scripts/bench_models.py. Against two trained students it was within about 15%, in
either direction (docs/more-data.md, "Pricing a shape before training it").
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import asdict
from pathlib import Path

import torch
from common import interleaved, write_json

from transformer.config import apply_overrides, from_dict
from transformer.data.batch import padding_mask, prepare_sources
from transformer.data.corpus import read_lines
from transformer.data.loader import source_batches
from transformer.data.vocab import Vocab, vocab_from_stored
from transformer.device import cpu_description
from transformer.errors import UserError
from transformer.model.checkpoint import load_checkpoint, resolve_checkpoint
from transformer.model.transformer import Transformer, count_parameters, evaluating


class Shape:
    """A model of one shape with random weights, and the work a search of it does on the test set."""

    def __init__(self, name: str, run: str, overrides: list[str], sources: list[str], refs: list[str], beam: int):
        vocab_files = [o.split("=", 1)[1] for o in overrides if o.startswith("vocab=")]
        state = load_checkpoint(resolve_checkpoint(run))  # its config and vocabulary; its weights are not used
        self.cfg = from_dict(apply_overrides(state["config"], [o for o in overrides if not o.startswith("vocab=")]))
        vocab = Vocab(Path(vocab_files[-1]).read_bytes()) if vocab_files else vocab_from_stored(state["vocab"])
        self.name, self.beam, self.vocab_size = name, beam, len(vocab)
        self.model = Transformer(self.cfg.model, self.vocab_size, vocab.specials).eval()
        positions = self.cfg.model.max_positions
        src_ids, ref_ids = vocab.encode(sources), vocab.encode_target(refs)
        self.batches = [
            (
                prepare_sources([src_ids[i] for i in batch], positions, vocab.specials)[0],
                [len(ref_ids[i]) + 1 for i in batch],  # + EOS
            )
            for batch in source_batches(src_ids, positions, self.cfg.decode.max_tokens, 1)
        ]
        self.steps = sum(max(lengths) for _, lengths in self.batches)
        self.tokens = sum(sum(lengths) for _, lengths in self.batches)

    def search(self) -> None:
        """Every batch replayed: encoder once, then a step per output position of its longest reference."""
        with evaluating(self.model):
            for src, lengths in self.batches:
                self._batch(src, lengths)

    def _batch(self, src: torch.Tensor, lengths: list[int]) -> None:
        model, k = self.model, self.beam
        mask = padding_mask(src, model.pad_id)
        cache = model.new_cache(model.encode(src, mask), mask)
        live = list(range(src.size(0)))  # positions in the batch of the sentences still searched
        n, tokens = 1, torch.full((src.size(0), 1), model.specials.bos, dtype=torch.long)
        for t in range(max(lengths)):
            rows = model.output(model.decode_states(tokens, cache=cache)[:, -1]).float()
            lprobs = torch.log_softmax(rows, dim=-1, out=rows)
            row_lprobs, row_tokens = lprobs.topk(2 * k, dim=1)  # (B*n, 2k)
            b = len(live)
            _, best = row_lprobs.view(b, -1).topk(2 * k, dim=1)  # (B, 2k) among the sentence's n*2k
            parent = torch.arange(b)[:, None] * n + (best[:, :k] // (2 * k)).clamp(max=n - 1)  # (B, k)
            new = row_tokens.view(b, -1).gather(1, best[:, :k])  # (B, k)
            stay = [s for s, pos in enumerate(live) if lengths[pos] > t + 1]
            if not stay:
                break
            sources = None
            if len(stay) < b:
                sources = torch.tensor(stay)
                parent, new, live = parent[sources], new[sources], [live[s] for s in stay]
            cache.keep_rows(parent.reshape(-1), sources)
            tokens, n = new.reshape(-1, 1), k


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="source sentences, one per line")
    ap.add_argument("--ref", required=True, help="references: each output is as long as its reference")
    ap.add_argument(
        "--shape",
        nargs="+",
        action="append",
        required=True,
        metavar="NAME RUN [KEY=VALUE ...]",
        help="a name, a run directory or checkpoint (its config and vocabulary; not its weights), and overrides as train's --set takes "
        "them (model.d_model=192) or vocab=FILE.model; the first --shape is the baseline",
    )
    ap.add_argument("--beam", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=500, help="the first N sentences (0: all; default 500)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after an untimed one")
    ap.add_argument("--seed", type=int, default=0, help="for the random weights")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    for shape in args.shape:
        if len(shape) < 2:
            ap.error(f"--shape {' '.join(shape)}: give a name and a run directory (--shape teacher runs/multi30k)")
    names = [shape[0] for shape in args.shape]
    if len(set(names)) < len(names):
        ap.error(f"--shape: give each shape its own name (got {' '.join(names)})")
    if args.beam < 1 or args.rounds < 1:
        ap.error("--beam and --rounds must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    sources, refs = read_lines(args.source), read_lines(args.ref)
    if len(sources) != len(refs):
        raise SystemExit(f"{args.source} has {len(sources)} lines and {args.ref} {len(refs)}: give aligned files")
    if args.limit:
        sources, refs = sources[: args.limit], refs[: args.limit]
    try:
        shapes = [Shape(s[0], s[1], s[2:], sources, refs, args.beam) for s in args.shape]
    except UserError as e:
        raise SystemExit(f"bench_shapes: {e}") from None
    with torch.inference_mode():
        times = interleaved({shape.name: shape.search for shape in shapes}, args.rounds)
    base = shapes[0].name
    rows = []
    cpu = cpu_description()
    print(
        f"{cpu.get('model_name')} (family {cpu.get('family')} model {cpu.get('model')}), {len(sources)} sentences, beam {args.beam}, {args.threads} thread(s), random weights"
    )
    print(f"{'shape':16} {'params':>10} {'vocab':>6} {'steps':>6} {'out tokens':>10} {'median s':>9} {'speed':>7}")
    for shape in shapes:
        ratio = statistics.median(b / t for b, t in zip(times[base], times[shape.name]))
        row = {
            "shape": shape.name,
            "model": asdict(shape.cfg.model),
            "parameters": count_parameters(shape.model),
            "vocab_size": shape.vocab_size,
            "decoder_steps": shape.steps,
            "output_tokens": shape.tokens,
            "seconds": times[shape.name],
            "median_s": statistics.median(times[shape.name]),
            "speed_vs_first": ratio,
        }
        rows.append(row)
        print(
            f"{shape.name:16} {row['parameters']:>10,} {shape.vocab_size:>6} {shape.steps:>6} {shape.tokens:>10} "
            f"{row['median_s']:>9.3f} {ratio:>6.2f}x"
        )
    record = {
        "cpu": cpu_description(),
        "sentences": len(sources),
        "beam": args.beam,
        "threads": args.threads,
        "rounds": args.rounds,
        "shapes": rows,
    }
    if args.json:
        write_json(args.json, record)
    return record


if __name__ == "__main__":
    main()
