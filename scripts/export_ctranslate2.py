#!/usr/bin/env python
"""Export a trained checkpoint to a CTranslate2 model directory (for deployment, and to time CTranslate2
beside our own search in scripts/bench_decode.py).

    .venv/bin/python scripts/export_ctranslate2.py runs/multi30k exported/multi30k_ct2 [--quantization int8] \
        [--evaluate data/multi30k/test.de data/multi30k/test.en [--beam 4] [--compute-type int8]]

Needs `pip install ctranslate2` (not a dependency of the package). The directory holds model.bin, the
vocabularies and our spm.model; CTranslate2 takes SentencePiece pieces and appends </s> to the source
itself, as our model was trained:

    import ctranslate2, sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file="exported/multi30k_ct2/spm.model")
    translator = ctranslate2.Translator("exported/multi30k_ct2", device="cpu", compute_type="int8")
    out = translator.translate_batch([sp.encode("Ein Hund läuft.", out_type=str)], beam_size=4)
    print(sp.decode(out[0].hypotheses[0]))

One difference remains: CTranslate2's length penalty divides the score by length**alpha, ours by
((5 + length) / 6)**alpha (Wu et al. 2016), so beam search with alpha > 0 can rank hypotheses
differently; greedy search and scoring agree (tests/test_export_ctranslate2.py).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from transformer.checkpoint import load_model  # noqa: E402
from transformer.errors import UserError  # noqa: E402

LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which our model uses


def _linear(spec, *linears) -> None:
    """Set a CTranslate2 LinearSpec from one nn.Linear, or from several fused along the output axis."""
    spec.weight = torch.cat([m.weight.detach() for m in linears]).float().numpy()  # (out, in)
    if linears[0].bias is not None:
        spec.bias = torch.cat([m.bias.detach() for m in linears]).float().numpy()


def _norm(spec, norm) -> None:
    spec.gamma = norm.weight.detach().float().numpy()
    spec.beta = norm.bias.detach().float().numpy()


def build_spec(model, pieces: list[str]):
    """A ctranslate2 TransformerSpec holding our model's weights and vocabulary."""
    from ctranslate2.specs import common_spec, transformer_spec

    c = model.cfg
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers), c.n_heads, pre_norm=c.norm == "pre",
        no_final_norm=c.norm == "post", activation=common_spec.Activation.RELU)
    table = model.positions.table.float().numpy()  # (P, C): our interleaved sin/cos, not CTranslate2's own
    for side, embedding, final_norm in ((spec.encoder, model.src_embed, model.encoder_norm),
                                        (spec.decoder, model.tgt_embed, model.decoder_norm)):
        embeddings = side.embeddings[0] if isinstance(side.embeddings, list) else side.embeddings
        embeddings.weight = embedding.weight.detach().float().numpy()
        side.scale_embeddings = True  # x * sqrt(d_model), as in _embed
        side.position_encodings.encodings = table
        if c.norm == "pre":
            _norm(side.layer_norm, final_norm)
    for layer_spec, layer in zip(spec.encoder.layer, model.encoder_layers):
        a = layer.self_attn
        _linear(layer_spec.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
        _linear(layer_spec.self_attention.linear[1], a.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sub_attn.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _norm(layer_spec.ffn.layer_norm, layer.sub_ffn.norm)
    for layer_spec, layer in zip(spec.decoder.layer, model.decoder_layers):
        a, x = layer.self_attn, layer.cross_attn
        _linear(layer_spec.self_attention.linear[0], a.q_proj, a.k_proj, a.v_proj)
        _linear(layer_spec.self_attention.linear[1], a.out_proj)
        _norm(layer_spec.self_attention.layer_norm, layer.sub_self.norm)
        _linear(layer_spec.attention.linear[0], x.q_proj)
        _linear(layer_spec.attention.linear[1], x.k_proj, x.v_proj)
        _linear(layer_spec.attention.linear[2], x.out_proj)
        _norm(layer_spec.attention.layer_norm, layer.sub_cross.norm)
        _linear(layer_spec.ffn.linear_0, layer.ffn.fc1)
        _linear(layer_spec.ffn.linear_1, layer.ffn.fc2)
        _norm(layer_spec.ffn.layer_norm, layer.sub_ffn.norm)
    _linear(spec.decoder.projection, model.output)

    spec.config.add_source_eos = True  # our encoder always saw the source followed by </s>
    spec.config.decoder_start_token = "<s>"
    spec.config.layer_norm_epsilon = LAYER_NORM_EPS
    spec.register_source_vocabulary(pieces)
    spec.register_target_vocabulary(pieces)
    return spec


def export(checkpoint: str | Path, out_dir: str | Path, quantization: str | None = None) -> Path:
    """Write a CTranslate2 model directory for `checkpoint` (a run directory or .pt file); returns it."""
    model, vocab, _ = load_model(checkpoint, "cpu")
    pieces = vocab.pieces(range(len(vocab)))
    spec = build_spec(model.eval(), pieces)
    spec.validate()
    spec.optimize(quantization=quantization)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    spec.save(str(out_dir))
    (out_dir / "spm.model").write_bytes(vocab.proto)
    return out_dir


def evaluate(model_dir: Path, src_path: str, ref_path: str, beam: int, lenpen: float,
             compute_type: str) -> str:
    """Translate src_path with the exported model on CPU and score it against ref_path with sacreBLEU."""
    import ctranslate2
    import sacrebleu
    import sentencepiece as spm

    from transformer.data import read_lines

    sp = spm.SentencePieceProcessor(model_file=str(model_dir / "spm.model"))
    lines, refs = read_lines(src_path), read_lines(ref_path)
    translator = ctranslate2.Translator(str(model_dir), device="cpu", compute_type=compute_type,
                                        intra_threads=torch.get_num_threads())
    results = translator.translate_batch([sp.encode(line, out_type=str) for line in lines], beam_size=beam,
                                         length_penalty=lenpen if beam > 1 else 0.0, max_batch_size=4096,
                                         batch_type="tokens")
    hyps = [sp.decode(r.hypotheses[0]) for r in results]
    bleu_metric = sacrebleu.BLEU()
    bleu, chrf = bleu_metric.corpus_score(hyps, [refs]), sacrebleu.CHRF().corpus_score(hyps, [refs])
    return (f"CTranslate2 {compute_type}, beam {beam}: BLEU {bleu.score:.2f}, chrF2 {chrf.score:.2f} "
            f"({bleu_metric.get_signature()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", help="run directory (its best.pt) or checkpoint file")
    ap.add_argument("out_dir", help="CTranslate2 model directory to write")
    ap.add_argument("--quantization", choices=("int8", "int8_float32", "float16", "bfloat16", "int8_float16"),
                    help="store the weights quantized (default: float32; CTranslate2 can also quantize at load time "
                         "with compute_type)")
    ap.add_argument("--force", action="store_true", help="replace out_dir if it exists")
    ap.add_argument("--evaluate", nargs=2, metavar=("SRC", "REF"),
                    help="then translate SRC on the CPU with the exported model and print BLEU/chrF against REF")
    ap.add_argument("--beam", type=int, default=4, help="beam size for --evaluate (default 4)")
    ap.add_argument("--lenpen", type=float, default=0.6,
                    help="CTranslate2's length penalty alpha for --evaluate (score / length**alpha; default 0.6)")
    ap.add_argument("--compute-type", default="float32", help="CTranslate2 compute type for --evaluate")
    args = ap.parse_args()
    try:
        import ctranslate2  # noqa: F401
    except ImportError:
        sys.exit("error: ctranslate2 is not installed (pip install ctranslate2)")
    out = Path(args.out_dir)
    if out.exists():
        if not args.force:
            sys.exit(f"error: {out} exists; add --force to replace it")
        shutil.rmtree(out)
    try:
        export(args.checkpoint, out, args.quantization)
    except UserError as e:
        sys.exit(f"error: {e}")
    print(f"wrote {out}")
    if args.evaluate:
        print(evaluate(out, *args.evaluate, args.beam, args.lenpen, args.compute_type))


if __name__ == "__main__":
    main()
