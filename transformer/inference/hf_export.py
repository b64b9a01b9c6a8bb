"""`transformer export hf`: a checkpoint as a Hugging Face `transformers` MarianMTModel directory (config, safetensors
weights, tokenizer files, generation settings), converted exactly or refused with the setting that differs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from transformer.config import Config
from transformer.data.batch import source_limit
from transformer.data.vocab import (
    MARIAN_FILES,
    SOURCE_SPM,
    TARGET_SPM,
    TOKENIZER_CONFIG,
    VOCAB_JSON,
    AnyVocab,
    MarianVocab,
)
from transformer.errors import UserError
from transformer.inference.ctranslate2_export import write_export
from transformer.inference.settings import generate_keywords, search_settings
from transformer.model.checkpoint import load_model, resolve_checkpoint
from transformer.model.transformer import Transformer

HF_EXPORT_FORMAT = "transformer-hf-export-v1"
INSTALL = "pip install 'transformer[hf]' (or pip install transformers safetensors)"
# What a MarianMTModel directory holds besides our record: MarianTokenizer reads the vocabulary from vocab.json and
# splits text with source.spm (and target.spm for targets): ours is one joint model, written twice; an imported
# Marian vocabulary's files go back as they came.
FILES = ("config.json", "generation_config.json", "model.safetensors", *MARIAN_FILES, "special_tokens_map.json")


def require_transformers() -> None:
    """A one-line error naming the optional extra, unless transformers and safetensors import."""
    for name in ("transformers", "safetensors"):
        try:
            __import__(name)
        except ImportError:
            raise UserError(f"export hf needs the 'hf' extra ({name} is not installed): {INSTALL}") from None


# Our model.activation -> MarianConfig's activation_function (transformers' ACT2FN: "swish" is SiLU).
ACTIVATIONS = {"relu": "relu", "swish": "swish"}
LAYER_NORM_EPS = 1e-5  # MarianMTModel's LayerNorms take torch's default; its config has no key for it


def refusal(cfg: Config) -> str | None:
    """Why a model of this config cannot become a MarianMTModel that computes the same function, or None. Every key of
    model.* was checked: d_model, n_heads, the layer counts, d_ff, the dropouts and max_positions map to Marian's
    settings one to one; the feed-forward's activation is Marian's activation_function; the output bias its
    final_logits_bias; either kind of sinusoids is Marian's table once the residual stream is permuted
    (Positions.marian_order: other kinds of position are refused there); post-norm is Marian's only layout (LayerNorm after each residual add, no final
    LayerNorm), with LayerNorm's default epsilon; the embeddings are scaled by sqrt(d_model) (scale_embedding); shared
    or separate source and target embeddings and a tied or separate output projection all exist in Marian."""
    m = cfg.model
    if m.norm != "post":
        return (
            f"model.norm is {m.norm!r}: MarianMTModel is post-norm only (a LayerNorm after each residual add, no "
            "final LayerNorm), so a pre-norm model has no Marian equivalent"
        )
    if m.layer_norm_eps != LAYER_NORM_EPS:
        return f"model.layer_norm_eps is {m.layer_norm_eps:g}: MarianMTModel's LayerNorms use {LAYER_NORM_EPS:g}"
    return None


def marian_config(cfg: Config, vocab: AnyVocab) -> dict:
    """config.json: MarianConfig's keys for our model (token ids: the vocabulary's; decoding starts with its BOS: ours,
    or a Marian vocabulary's <pad>)."""
    m, specials, vocab_size = cfg.model, vocab.specials, len(vocab)
    return {
        "architectures": ["MarianMTModel"],
        "model_type": "marian",
        "vocab_size": vocab_size,
        "decoder_vocab_size": vocab_size,
        "d_model": m.d_model,
        "encoder_layers": m.n_encoder_layers,
        "decoder_layers": m.n_decoder_layers,
        "encoder_attention_heads": m.n_heads,
        "decoder_attention_heads": m.n_heads,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": ACTIVATIONS[m.activation],
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": m.activation_dropout,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "max_position_embeddings": m.max_positions,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": m.share_embeddings,
        "tie_word_embeddings": m.tie_output,
        "pad_token_id": specials.pad,
        "eos_token_id": specials.eos,
        "bos_token_id": specials.bos,
        "forced_eos_token_id": specials.eos,
        "decoder_start_token_id": specials.bos,
        "is_encoder_decoder": True,
        "use_cache": True,
        "init_std": 0.02,
    }


def generation_config(cfg: Config, vocab: AnyVocab) -> dict:
    """generation_config.json: our decode settings in `generate`'s terms, each as settings.py's table says
    (settings.generate_keywords: num_beams, length_penalty, early_stopping; a value generate has no equivalent of
    is refused in one line). Their length penalty divides a hypothesis's summed log-probability by
    length ** length_penalty, which is ours with decode.lenpen_kind "length"; GNMT's ((5 + length) / 6) ** lenpen
    (both count the tokens with EOS) has the same alpha but not the same normalisation unless it is 0
    (docs/opus-mt.md). generate has no per-source limit (ours: source length + decode.max_len_offset): max_length
    is the model's own, BOS and EOS included."""
    specials = vocab.specials
    try:
        decode = generate_keywords(search_settings(cfg.decode), config_only=True)
    except UserError as e:
        raise UserError(f"export hf: {e}") from None
    return {
        "decoder_start_token_id": specials.bos,
        "bos_token_id": specials.bos,
        "eos_token_id": specials.eos,
        "pad_token_id": specials.pad,
        "forced_eos_token_id": specials.eos,
        **decode,
        "max_length": cfg.model.max_positions + 1,
        # Our search never emits PAD or BOS (their -inf comes after the log-softmax there too).
        "bad_words_ids": [[i] for i in sorted({specials.pad, specials.bos})],
        "do_sample": False,
    }


def marian_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under MarianMTModel's names, with the residual stream permuted (Positions.marian_order): rows of
    what writes into it (out_proj, fc2), columns of what reads from it (q/k/v, fc1, the output projection), the
    embeddings' columns, every LayerNorm; the positions table written too (Marian recomputes its own when absent);
    the output bias as final_logits_bias (zeros without one)."""
    c = model.cfg
    perm = model.position_encoding.marian_order()  # or a one-line refusal: a kind Marian has no equivalent of
    out: dict[str, torch.Tensor] = {}

    def reads(name: str, linear) -> None:
        out[f"{name}.weight"] = linear.weight.detach()[:, perm]
        out[f"{name}.bias"] = linear.bias.detach()

    def writes(name: str, linear) -> None:
        out[f"{name}.weight"] = linear.weight.detach()[perm]
        out[f"{name}.bias"] = linear.bias.detach()[perm]

    def norm(name: str, layer_norm) -> None:
        out[f"{name}.weight"] = layer_norm.weight.detach()[perm]
        out[f"{name}.bias"] = layer_norm.bias.detach()[perm]

    def attention(name: str, a) -> None:
        for proj in ("q_proj", "k_proj", "v_proj"):
            reads(f"{name}.{proj}", getattr(a, proj))
        writes(f"{name}.out_proj", a.out_proj)

    src = model.src_embed.weight.detach()[:, perm]
    tgt = model.tgt_embed.weight.detach()[:, perm]
    if c.share_embeddings:
        out["model.shared.weight"] = src
    out["model.encoder.embed_tokens.weight"] = src
    out["model.decoder.embed_tokens.weight"] = tgt
    table = model.position_encoding.marian_encodings()[:, perm]
    out["model.encoder.embed_positions.weight"] = table
    out["model.decoder.embed_positions.weight"] = table
    for i, layer in enumerate(model.encoder_layers):
        p = f"model.encoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.sub_attn.norm)
        reads(f"{p}.fc1", layer.ffn.fc1)
        writes(f"{p}.fc2", layer.ffn.fc2)
        norm(f"{p}.final_layer_norm", layer.sub_ffn.norm)
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.decoder.layers.{i}"
        attention(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.sub_self.norm)
        attention(f"{p}.encoder_attn", layer.cross_attn)
        norm(f"{p}.encoder_attn_layer_norm", layer.sub_cross.norm)
        reads(f"{p}.fc1", layer.ffn.fc1)
        writes(f"{p}.fc2", layer.ffn.fc2)
        norm(f"{p}.final_layer_norm", layer.sub_ffn.norm)
    out["lm_head.weight"] = model.output.weight.detach()[:, perm]
    bias = model.output.bias
    out["final_logits_bias"] = bias.detach()[None] if bias is not None else torch.zeros(1, model.vocab_size)
    # safetensors stores each tensor on its own: contiguous fp32 copies, none sharing memory with another.
    return {name: t.float().contiguous().clone() for name, t in out.items()}


def tokenizer_files(vocab: AnyVocab, cfg: Config) -> dict[str, bytes]:
    """source.spm and target.spm (our joint model twice), vocab.json (piece -> our id), the tokenizer's config; an
    imported Marian vocabulary's own four files, verbatim."""
    specials = vocab.specials
    special = {
        "unk_token": vocab.pieces([specials.unk])[0],
        "eos_token": vocab.pieces([specials.eos])[0],
        "pad_token": vocab.pieces([specials.pad])[0],
    }

    def text(value) -> bytes:
        return (json.dumps(value, ensure_ascii=False, indent=2) + "\n").encode("utf-8")

    if isinstance(vocab, MarianVocab):
        return {**vocab.files, "special_tokens_map.json": text(special)}
    pieces = {vocab.sp.id_to_piece(i): i for i in range(len(vocab))}
    tokenizer = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": cfg.data.src_lang,
        "target_lang": cfg.data.tgt_lang,
        # truncation=True keeps what our translate reads of a long source: max_positions - 2 pieces and EOS.
        "model_max_length": source_limit(cfg.model.max_positions) + 1,
        "separate_vocabs": False,
        # A literal "</s>", "<unk>" or "<pad>" in a sentence is text to our tokenizer, not a special id.
        "split_special_tokens": True,
        **special,
    }
    return {
        SOURCE_SPM: vocab.proto,
        TARGET_SPM: vocab.proto,
        VOCAB_JSON: text(pieces),
        TOKENIZER_CONFIG: text(tokenizer),
        "special_tokens_map.json": text(special),
    }


def write_marian(checkpoint: Path, out_dir: Path) -> None:
    """Every file of FILES into out_dir (an empty directory) for the model in `checkpoint`."""
    from safetensors.torch import save

    model, vocab, cfg = load_model(checkpoint, "cpu")
    problem = refusal(cfg)
    if problem is not None:
        raise UserError(f"export hf: {checkpoint}: {problem}")
    weights = marian_weights(model)  # before any file: refuses positions Marian cannot express
    files = {"config.json": marian_config(cfg, vocab), "generation_config.json": generation_config(cfg, vocab)}
    for name, value in files.items():
        (out_dir / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    for name, data in tokenizer_files(vocab, cfg).items():
        (out_dir / name).write_bytes(data)
    # As bytes, written like the other files: save_file would create the file readable by its owner alone.
    (out_dir / "model.safetensors").write_bytes(save(weights, metadata={"format": "pt"}))


def export_hf(checkpoint: str | Path, out_dir: str | Path, force: bool = False) -> Path:
    """Write a MarianMTModel directory for `checkpoint` (a run directory or .pt file); returns it. force: replace an
    earlier export of ours (its record lists every file there) or an empty directory, nothing else."""
    require_transformers()
    source = resolve_checkpoint(checkpoint)

    def write(staging: Path) -> dict:
        write_marian(source, staging)
        return {"checkpoint": str(source)}

    return write_export(out_dir, force, HF_EXPORT_FORMAT, write)


def run_export_hf(checkpoint: str, out_dir: str, force: bool) -> None:
    """The `export hf` command."""
    print(f"wrote {export_hf(checkpoint, out_dir, force)}")
