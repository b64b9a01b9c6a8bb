#!/usr/bin/env python
"""Build a transformers MarianMTModel directory the way OPUS-MT's are made, with random weights: a SentencePiece model
per side trained on a corpus, vocab.json numbering both sides' pieces (</s> 0, <unk> 1, <pad> last), swish, a
non-zero final_logits_bias, saved with save_pretrained (model, tokenizer, generation_config as OPUS-MT's). For
`transformer import hf` without the hub, and for scripts/bench_decode.py --hf-dir at OPUS-MT's real size:

    python scripts/make_marian_dir.py runs/opus-mt-size --src data/multi30k/train.de --tgt data/multi30k/train.en

The defaults are opus-mt-de-en's dimensions: 6+6 layers, d_model 512, 8 heads, d_ff 2048, 512 positions, a vocabulary
of 58,101 (filled up with pieces no text produces where the corpus gives fewer). Needs the 'hf' extra.
"""

from __future__ import annotations

import argparse
import io
import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

CODES = (">>fra<<", ">>deu<<")  # target-language codes, as a multilingual model's vocab.json holds them


def train_spm(sentences: Sequence[str], size: int):
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=size,
        model_type="unigram",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return model.getvalue()


def write_marian_dir(
    directory: Path,
    source_sentences: Sequence[str],
    target_sentences: Sequence[str],
    spm_size: int = 40,
    vocab_size: int = 0,
    seed: int = 0,
    init_std: float = 0.3,
    eos_bias: float = 3.5,
    **config,
) -> Path:
    """The directory, with SentencePiece models of up to spm_size pieces per side; vocab_size: fill vocab.json up to
    this many pieces (0: as many as the two models give); init_std: the weights' spread (wide: peaky outputs);
    final_logits_bias N(0, 1) with EOS's raised by eos_bias; `config`: MarianConfig keys."""
    import sentencepiece as spm
    import transformers

    directory.mkdir(parents=True, exist_ok=True)
    pieces = ["</s>", "<unk>", *CODES]
    for name, sentences in (("source.spm", source_sentences), ("target.spm", target_sentences)):
        proto = train_spm(sentences, spm_size)
        (directory / name).write_bytes(proto)
        sp = spm.SentencePieceProcessor(model_proto=proto)
        known = set(pieces)
        for piece in (sp.id_to_piece(i) for i in range(sp.get_piece_size())):
            if piece not in known and not piece.startswith("<"):
                pieces.append(piece)
                known.add(piece)
    pieces += [f"\u2581filler{i}" for i in range(max(0, vocab_size - len(pieces) - 1))]
    pieces.append("<pad>")
    (directory / "vocab.json").write_text(json.dumps({p: i for i, p in enumerate(pieces)}, ensure_ascii=False))
    pad = len(pieces) - 1
    settings = {
        "vocab_size": len(pieces),
        "decoder_vocab_size": len(pieces),
        "activation_function": "swish",
        "pad_token_id": pad,
        "eos_token_id": 0,
        "bos_token_id": 0,
        "forced_eos_token_id": 0,
        "decoder_start_token_id": pad,
        "scale_embedding": True,
        "init_std": init_std,
        **config,
    }
    torch.manual_seed(seed)
    model = transformers.MarianMTModel(transformers.MarianConfig(**settings)).eval()
    with torch.no_grad():
        model.final_logits_bias.normal_(0.0, 1.0)
        model.final_logits_bias[0, 0] += eos_bias
    model.generation_config = transformers.GenerationConfig(
        bad_words_ids=[[pad]],
        bos_token_id=0,
        decoder_start_token_id=pad,
        eos_token_id=0,
        forced_eos_token_id=0,
        max_length=settings.get("max_position_embeddings", 512),
        num_beams=4,
        pad_token_id=pad,
        renormalize_logits=True,
    )
    model.save_pretrained(directory)
    tokenizer = transformers.MarianTokenizer(
        source_spm=str(directory / "source.spm"),
        target_spm=str(directory / "target.spm"),
        vocab=str(directory / "vocab.json"),
        source_lang="de",
        target_lang="en",
    )
    tokenizer.save_pretrained(directory)
    return directory


def read_sentences(path: str | None, limit: int, seed: int) -> list[str]:
    """The first `limit` lines of a file, or as many random sentences of 2-12 made-up words."""
    if path:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for _, line in zip(range(limit), f) if line.strip()]
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(2, 12))) for _ in range(limit)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the directory to write (new or empty)")
    ap.add_argument("--src", help="source-language text to train source.spm on (default: made-up sentences)")
    ap.add_argument("--tgt", help="target-language text to train target.spm on (default: made-up sentences)")
    ap.add_argument("--sentences", type=int, default=100_000, help="lines read per side (default 100000)")
    ap.add_argument("--spm-size", type=int, default=8000, help="SentencePiece pieces per side, at most (default 8000)")
    ap.add_argument("--vocab-size", type=int, default=58_101, help="vocab.json's size (default 58101: opus-mt-de-en)")
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6, help="encoder and decoder layers each (default 6)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--d-ff", type=int, default=2048)
    ap.add_argument("--positions", type=int, default=512, help="max_position_embeddings (default 512)")
    ap.add_argument("--init-std", type=float, default=0.3, help="the random weights' spread (default 0.3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"error: {args.out} exists and is not empty; choose a new directory")
    write_marian_dir(
        args.out,
        read_sentences(args.src, args.sentences, args.seed),
        read_sentences(args.tgt, args.sentences, args.seed + 1),
        spm_size=args.spm_size,
        vocab_size=args.vocab_size,
        seed=args.seed,
        init_std=args.init_std,
        d_model=args.d_model,
        encoder_layers=args.layers,
        decoder_layers=args.layers,
        encoder_attention_heads=args.heads,
        decoder_attention_heads=args.heads,
        encoder_ffn_dim=args.d_ff,
        decoder_ffn_dim=args.d_ff,
        max_position_embeddings=args.positions,
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
