"""`transformer export hf`: a checkpoint as a Hugging Face `transformers` MarianMTModel directory (config, safetensors
weights, tokenizer files, generation settings), converted exactly or refused with the setting that differs."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from transformer.config import Config
from transformer.data.batch import source_limit
from transformer.data.vocab import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Vocab
from transformer.errors import UserError
from transformer.inference.ctranslate2_engine import write_export
from transformer.model import positions
from transformer.model.checkpoint import load_model, resolve_checkpoint
from transformer.model.transformer import Transformer

HF_EXPORT_FORMAT = "transformer-hf-export-v1"
INSTALL = "pip install 'transformer[hf]' (or pip install transformers safetensors)"
# What a MarianMTModel directory holds besides our record: MarianTokenizer reads the vocabulary from vocab.json and
# splits text with source.spm (and target.spm for targets): ours is one joint model, written twice.
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "source.spm",
    "target.spm",
    "vocab.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)


def require_transformers() -> None:
    """A one-line error naming the optional extra, unless transformers and safetensors import."""
    for name in ("transformers", "safetensors"):
        try:
            __import__(name)
        except ImportError:
            raise UserError(f"export hf needs the 'hf' extra ({name} is not installed): {INSTALL}") from None


def residual_permutation(d_model: int) -> torch.Tensor:
    """Our model dimension -> Marian's: Marian's sinusoids put the sines in the first half and the cosines in the
    second (MarianSinusoidalPositionalEmbedding), ours interleave them (sin at 2i, cos at 2i + 1) at the same
    frequencies. Indexing every residual-stream vector with this order gives Marian's layout: marian = ours[perm]."""
    return torch.cat([torch.arange(0, d_model, 2), torch.arange(1, d_model, 2)])


def refusal(cfg: Config) -> str | None:
    """Why a model of this config cannot become a MarianMTModel that computes the same function, or None. Every key of
    model.* was checked: d_model, n_heads, the layer counts, d_ff, the dropouts and max_positions map to Marian's
    settings one to one; the feed-forward's ReLU is Marian's "relu"; post-norm is Marian's only layout (LayerNorm after
    each residual add, no final LayerNorm); the embeddings are scaled by sqrt(d_model) (scale_embedding); shared or
    separate source and target embeddings and a tied or separate output projection all exist in Marian."""
    m = cfg.model
    if m.norm != "post":
        return (
            f"model.norm is {m.norm!r}: MarianMTModel is post-norm only (a LayerNorm after each residual add, no "
            "final LayerNorm), so a pre-norm model has no Marian equivalent"
        )
    return None


def marian_config(cfg: Config, vocab_size: int) -> dict:
    """config.json: MarianConfig's keys for our model (token ids: ours; decoding starts with our BOS, not pad)."""
    m = cfg.model
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
        "activation_function": "relu",
        "dropout": m.dropout,
        "attention_dropout": m.attention_dropout,
        "activation_dropout": m.activation_dropout,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "max_position_embeddings": m.max_positions,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": m.share_embeddings,
        "tie_word_embeddings": m.tie_output,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
        "forced_eos_token_id": EOS_ID,
        "decoder_start_token_id": BOS_ID,
        "is_encoder_decoder": True,
        "use_cache": True,
        "init_std": 0.02,
    }


def generation_config(cfg: Config) -> dict:
    """generation_config.json: our decode settings in `generate`'s terms. Their length penalty divides a hypothesis's
    summed log-probability by length ** length_penalty where ours divides by ((5 + length) / 6) ** lenpen (both count
    the tokens with EOS): the same alpha, but not the same normalisation unless it is 0 (docs/fine-tuning.md). Our
    exact stop rule is their early_stopping "never", our early one their True. generate has no per-source limit
    (ours: source length + decode.max_len_offset): max_length is the model's own, BOS and EOS included."""
    d = cfg.decode
    return {
        "decoder_start_token_id": BOS_ID,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "forced_eos_token_id": EOS_ID,
        "num_beams": d.beam,
        "length_penalty": d.lenpen,
        "early_stopping": "never" if d.stop == "exact" else True,
        "max_length": cfg.model.max_positions + 1,
        # Our search never emits PAD or BOS (their -inf comes after the log-softmax there too).
        "bad_words_ids": [[PAD_ID], [BOS_ID]],
        "do_sample": False,
    }


def marian_weights(model: Transformer) -> dict[str, torch.Tensor]:
    """Our weights under MarianMTModel's names, with the residual stream permuted (residual_permutation): rows of
    what writes into it (out_proj, fc2), columns of what reads from it (q/k/v, fc1, the output projection), the
    embeddings' columns, every LayerNorm; the positions table written too (Marian recomputes its own when absent)."""
    c = model.cfg
    perm = residual_permutation(c.d_model)
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
    table = positions.marian_encodings(model)[:, perm]
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
    out["final_logits_bias"] = torch.zeros(1, model.vocab_size)
    # safetensors stores each tensor on its own: contiguous fp32 copies, none sharing memory with another.
    return {name: t.float().contiguous().clone() for name, t in out.items()}


def tokenizer_files(vocab: Vocab, cfg: Config) -> dict[str, bytes]:
    """source.spm and target.spm (our joint model twice), vocab.json (piece -> our id), the tokenizer's config."""
    pieces = {vocab.sp.id_to_piece(i): i for i in range(len(vocab))}
    special = {
        "unk_token": vocab.sp.id_to_piece(UNK_ID),
        "eos_token": vocab.sp.id_to_piece(EOS_ID),
        "pad_token": vocab.sp.id_to_piece(PAD_ID),
    }
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

    def text(value) -> bytes:
        return (json.dumps(value, ensure_ascii=False, indent=2) + "\n").encode("utf-8")

    return {
        "source.spm": vocab.proto,
        "target.spm": vocab.proto,
        "vocab.json": text(pieces),
        "tokenizer_config.json": text(tokenizer),
        "special_tokens_map.json": text(special),
    }


def write_marian(checkpoint: Path, out_dir: Path) -> None:
    """Every file of FILES into out_dir (an empty directory) for the model in `checkpoint`."""
    from safetensors.torch import save

    model, vocab, cfg = load_model(checkpoint, "cpu")
    problem = refusal(cfg)
    if problem is not None:
        raise UserError(f"export hf: {checkpoint}: {problem}")
    files = {"config.json": marian_config(cfg, len(vocab)), "generation_config.json": generation_config(cfg)}
    for name, value in files.items():
        (out_dir / name).write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    for name, data in tokenizer_files(vocab, cfg).items():
        (out_dir / name).write_bytes(data)
    # As bytes, written like the other files: save_file would create the file readable by its owner alone.
    (out_dir / "model.safetensors").write_bytes(save(marian_weights(model), metadata={"format": "pt"}))


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
