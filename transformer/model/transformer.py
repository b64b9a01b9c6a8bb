"""The encoder-decoder Transformer of Vaswani et al. (2017): one module per box of the paper's figure.

Tensors are batch-first: (B, T, C). Masks are boolean with True = "may attend" and have
shape (B or 1, 1, T_query or 1, T_key) so they broadcast over heads; they are built in transformer/data/batch.py
(`padding_mask`, `causal_mask`, `target_mask`) and nowhere else. Two other forms, also from batch.py, go where the
attention kernels run faster with them: `attention_bias`, the additive form a boolean mask is turned into once per
forward pass (encode, decode), in the dtype of attention's queries; and `CAUSAL`, the decoder's self-attention mask
in a teacher-forced pass (Batch.tgt_mask), which SDPA applies as is_causal.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from transformer.config import ModelConfig
from transformer.data.batch import CAUSAL, Causal, attention_bias, causal_mask
from transformer.data.vocab import OURS, Specials
from transformer.errors import UserError, out_of_memory_names
from transformer.model import positions
from transformer.model.kv_cache import DecoderCache, KVCache, by_row, by_source
from transformer.model.positions import Rotation


class TokenPacking:
    """Where the real tokens of a padded (B, S) batch sit, so that position-wise layers (projections, feed-forward,
    LayerNorm) run on those N tokens alone, (N, C), and only attention sees them padded, (B, S, C). Batches of
    sentences sorted by length are still much padding: a translation batch of Multi30k test sources is about a
    third padding. CTranslate2 skips padding the same way."""

    def __init__(self, keep: torch.Tensor):  # (B, S) bool, True on real tokens
        self.shape = keep.shape
        self.index = keep.reshape(-1).nonzero().squeeze(1)  # (N,) flat positions of the real tokens

    @staticmethod
    def of(mask: torch.Tensor) -> TokenPacking | None:
        """The packing for a padding mask (B, 1, 1, S), boolean or additive, or None where it does not pay: without
        padding; on CUDA, where padded positions cost little and the nonzero() would stall the host every batch; and
        inside torch.compile, where that data-dependent nonzero() would split the graph."""
        if mask.device.type != "cpu" or torch.compiler.is_compiling():
            return None
        keep = mask[:, 0, 0, :]
        keep = keep == 0 if keep.is_floating_point() else keep
        return None if bool(keep.all()) else TokenPacking(keep)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.size(-1)).index_select(0, self.index)  # (B, S, C) -> (N, C)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        padded = x.new_zeros(self.shape.numel(), x.size(-1)).index_copy(0, self.index, x)  # zeros at padding
        return padded.view(*self.shape, x.size(-1))  # (N, C) -> (B, S, C)


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over n_heads subspaces, with Q, K, V and output projections."""

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.d_head = d_model // n_heads
        self.q_proj = nn.Linear(d_model, d_model)
        self.k_proj = nn.Linear(d_model, d_model)
        self.v_proj = nn.Linear(d_model, d_model)
        self.out_proj = nn.Linear(d_model, d_model)
        self.attention_dropout = attention_dropout
        # When set to a list, forward() appends its attention probabilities (B, H, Tq, Tk)
        # computed by the explicit (slower) path; None keeps the fused SDPA kernel.
        self.record: list | None = None

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, self.d_head).transpose(1, 2)  # (B, T, C) -> (B, H, T, Dh)

    def _project(self, proj: nn.Linear, x: torch.Tensor, packing: TokenPacking | None) -> torch.Tensor:
        """(B, T, C), or (N, C) packed tokens -> (B, H, T, Dh)."""
        y = proj(x)
        return self._split(packing.unpack(y) if packing is not None else y)

    def static_kv(self, key_value: torch.Tensor) -> KVCache:
        """K/V of a fixed input (B, Tk, C), e.g. the encoder output for cross-attention, computed once."""
        return KVCache(self._split(self.k_proj(key_value)), self._split(self.v_proj(key_value)))

    def forward(
        self,
        query: torch.Tensor,  # (B, Tq, C)
        key_value: torch.Tensor | None,  # (B, Tk, C); None when a static cache holds its K/V
        mask: torch.Tensor | Causal | None,  # (B|1, 1, Tq|1, Tk_total): bool (True = may attend) or additive; CAUSAL
        cache: KVCache | None = None,
        static_kv: bool = False,  # cross-attention: K/V depend only on the encoder output
        packing: TokenPacking | None = None,  # self-attention over packed tokens: query is (N, C)
        rotation: Rotation | None = None,  # self-attention under rotary positions: turns the new queries and keys
    ) -> torch.Tensor:
        q = self._project(self.q_proj, query, packing)
        if rotation is not None:
            q = rotation(q)
        group = 1
        if cache is not None and static_kv:
            k, v = cache.k, cache.v  # the encoder's K/V, once per source, computed once by static_kv()
            group = q.size(0) // k.size(0)  # rows per source (DecoderCache)
            if group * k.size(0) != q.size(0):
                raise ValueError(f"{q.size(0)} decoder rows do not split into groups for {k.size(0)} sources")
        else:
            k = self._project(self.k_proj, key_value, packing)
            v = self._project(self.v_proj, key_value, packing)
            if rotation is not None:
                k = rotation(k)  # once, before the cache keeps it: a cached key is never turned again
            if cache is not None:  # self-attention while decoding: append the new positions
                cache.append(k, v)
                k, v = cache.k, cache.v
        if group > 1:
            q = by_source(q, group)  # (B*g, H, Tq, Dh) -> (B, H, g*Tq, Dh)
        dropout = self.attention_dropout if self.training else 0.0
        if mask is CAUSAL and q.size(2) != k.size(2):
            raise ValueError(f"CAUSAL needs square attention, got {q.size(2)} queries and {k.size(2)} keys")
        if self.record is None:
            causal = mask is CAUSAL  # no mask tensor: the flash kernel stays possible
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if causal else mask, dropout_p=dropout, is_causal=causal
            )
        else:
            out, probs = attention_reference(q, k, v, mask, dropout, self.training)
            self.record.append((by_row(probs, group) if group > 1 else probs).detach())
        if group > 1:
            out = by_row(out, group)
        b, _, tq, _ = out.shape
        out = out.transpose(1, 2).reshape(b, tq, self.n_heads * self.d_head)  # (B, H, Tq, Dh) -> (B, Tq, C)
        return self.out_proj(packing.pack(out) if packing is not None else out)


def attention_reference(q, k, v, mask, dropout: float = 0.0, training: bool = False):
    """softmax(QK^T / sqrt(d)) V written out, returning the probabilities too; `mask` in any of its forms."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, Tq, Tk)
    if mask is CAUSAL:
        mask = causal_mask(q.size(2), q.device)
    if mask is not None and mask.is_floating_point():
        scores = scores + mask  # -inf where it may not attend: the same as masked_fill below
    elif mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    dropped = F.dropout(probs, dropout, training) if dropout > 0 else probs
    return dropped @ v, probs


# model.activation -> the function: the paper's ReLU, or swish (SiLU, x * sigmoid(x)) as OPUS-MT's models use.
ACTIVATIONS = {"relu": F.relu, "swish": F.silu}


class FeedForward(nn.Module):
    """Position-wise FFN(x) = act(x W1 + b1) W2 + b2, act the paper's max(0, .) or swish (model.activation)."""

    def __init__(self, d_model: int, d_ff: int, activation_dropout: float, activation: str = "relu"):
        super().__init__()
        self.fc1 = nn.Linear(d_model, d_ff)
        self.fc2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(activation_dropout)
        self.activation = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(self.fc1(x))
        return self.fc2(self.dropout(h) if self.training else h)  # a no-op call a layer less per decoding step


class SublayerConnection(nn.Module):
    """Residual around a sub-layer with dropout; LayerNorm after the add (post) or before the sub-layer (pre)."""

    def __init__(self, d_model: int, dropout: float, norm: str, eps: float = 1e-5):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = norm == "pre"

    def forward(self, x: torch.Tensor, sublayer) -> torch.Tensor:
        # Dropout only while training: in eval it returns its input, after a module call and an operator call
        # (a decoding step made 25 of them).
        if self.pre_norm:
            y = sublayer(self.norm(x))
            return x + (self.dropout(y) if self.training else y)
        y = sublayer(x)
        return self.norm(x + (self.dropout(y) if self.training else y))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a SublayerConnection."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.sub_attn = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm, cfg.layer_norm_eps)
        self.sub_ffn = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm, cfg.layer_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        src_mask: torch.Tensor,
        packing: TokenPacking | None = None,
        rotation: Rotation | None = None,
    ) -> torch.Tensor:
        """x (B, S, C), or (N, C) real tokens with their `packing`."""
        x = self.sub_attn(x, lambda h: self.self_attn(h, h, src_mask, packing=packing, rotation=rotation))
        return self.sub_ffn(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.activation_dropout, cfg.activation)
        self.sub_self = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm, cfg.layer_norm_eps)
        self.sub_cross = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm, cfg.layer_norm_eps)
        self.sub_ffn = SublayerConnection(cfg.d_model, cfg.dropout, cfg.norm, cfg.layer_norm_eps)

    def forward(self, x, memory, tgt_mask, memory_mask, self_cache=None, cross_cache=None, rotation=None):
        x = self.sub_self(x, lambda h: self.self_attn(h, h, tgt_mask, self_cache, rotation=rotation))
        x = self.sub_cross(x, lambda h: self.cross_attn(h, memory, memory_mask, cross_cache, static_kv=True))
        return self.sub_ffn(x, self.ffn)


class Transformer(nn.Module):
    """Embeddings, N encoder layers, N decoder layers and the output projection to the vocabulary. `specials`: the
    vocabulary's special ids (vocab.Specials: ours, or a Marian vocabulary's), which batches and searches use."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, specials: Specials = OURS):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.specials = specials
        self.pad_id = pad_id = specials.pad
        self.src_embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        self.tgt_embed = (
            self.src_embed if cfg.share_embeddings else nn.Embedding(vocab_size, cfg.d_model, padding_idx=pad_id)
        )
        # How positions are told apart (the kind model.positions names): added to the embeddings, or a rotation.
        self.position_encoding = positions.module(cfg)
        self.embed_dropout = nn.Dropout(cfg.dropout)
        self.encoder_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers))
        self.decoder_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers))
        # Pre-norm leaves the residual stream un-normalised, so it needs one last LayerNorm.
        eps = cfg.layer_norm_eps
        self.encoder_norm = nn.LayerNorm(cfg.d_model, eps=eps) if cfg.norm == "pre" else nn.Identity()
        self.decoder_norm = nn.LayerNorm(cfg.d_model, eps=eps) if cfg.norm == "pre" else nn.Identity()
        self.output = nn.Linear(cfg.d_model, vocab_size, bias=cfg.output_bias)
        self._init_weights()
        if cfg.tie_output:
            self.output.weight = self.tgt_embed.weight
        # A search's lexical shortlist (inference/shortlist.py's ShortlistOutput), set by the Translator: the
        # decoder side of a search then projects onto a batch's candidates only. Not a module: never saved.
        self.shortlist = None

    def _init_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        # N(0, d^-1/2) so that embeddings scaled by sqrt(d) have unit variance and tied logits stay O(1).
        for emb in {id(self.src_embed): self.src_embed, id(self.tgt_embed): self.tgt_embed}.values():
            nn.init.normal_(emb.weight, mean=0.0, std=self.cfg.d_model**-0.5)
            with torch.no_grad():
                emb.weight[self.pad_id].zero_()

    def _embed(
        self, embedding: nn.Embedding, tokens: torch.Tensor, side: positions.Side, offset: int = 0
    ) -> tuple[torch.Tensor, Rotation | None]:
        """-> the embeddings (B, T, C) with their positions, and the rotation self-attention applies (or None)."""
        x = embedding(tokens) * math.sqrt(self.cfg.d_model)  # (B, T, C)
        x, rotation = self.position_encoding(x, side, offset)
        return (self.embed_dropout(x) if self.training else x), rotation

    def attention_dtype(self, device: torch.device) -> torch.dtype:
        """The dtype of attention's queries, which an additive mask must have: autocast's where autocast is on,
        else the model's own (its embeddings'; the linear layers of every weight format give that dtype too)."""
        if torch.is_autocast_enabled(device.type):
            return torch.get_autocast_dtype(device.type)
        return self.src_embed.weight.dtype

    def encode(self, src: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        """src (B, S) token ids, src_mask (B, 1, 1, S), boolean or additive -> memory (B, S, C); zeros at padding
        on a CPU."""
        x, rotation = self._embed(self.src_embed, src, "source")
        packing = TokenPacking.of(src_mask)
        if packing is not None:
            x = packing.pack(x)  # (B, S, C) -> (N, C): the layers skip padding
        src_mask = attention_bias(src_mask, self.attention_dtype(src.device))  # once for every layer
        for layer in self.encoder_layers:
            x = layer(x, src_mask, packing, rotation)
        x = self.encoder_norm(x)
        return packing.unpack(x) if packing is not None else x

    def decode(
        self,
        tgt: torch.Tensor,  # (B, T) ids; with a cache, only the new positions
        memory: torch.Tensor | None = None,  # (B, S, C); None with a cache
        memory_mask: torch.Tensor | None = None,  # (B, 1, 1, S), boolean or additive; None with a cache
        tgt_mask: torch.Tensor | Causal | None = None,  # (B|1, 1, T, cache.length + T) or CAUSAL; None: none
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """-> logits (B, T, V). Without a cache, attends to `memory` under `memory_mask`. With one (from
        new_cache), earlier positions' keys/values are reused and extended, and cross-attention reads the
        encoder K/V and memory mask the cache holds: its rows are the only truth, so no memory is passed."""
        return self.output(self.decode_states(tgt, memory, memory_mask, tgt_mask, cache))

    def decode_states(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        tgt_mask: torch.Tensor | Causal | None = None,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """decode's states (B, T, C) before the output projection (a shortlist projects them onto fewer rows)."""
        offset = 0
        if cache is not None:
            if memory is not None or memory_mask is not None:
                raise ValueError("decode with a cache takes no memory: the cache holds the encoder K/V and mask")
            offset, memory_mask = cache.length, cache.memory_mask
        dtype = self.attention_dtype(tgt.device)  # the masks once for every layer
        memory_mask = attention_bias(memory_mask, dtype) if memory_mask is not None else None
        if tgt_mask is not None and tgt_mask is not CAUSAL:
            tgt_mask = attention_bias(tgt_mask, dtype)
        x, rotation = self._embed(self.tgt_embed, tgt, "target", offset)  # offset: the positions the cache holds
        for i, layer in enumerate(self.decoder_layers):
            self_cache = cache.self_attn[i] if cache is not None else None
            cross_cache = cache.cross_attn[i] if cache is not None else None
            x = layer(x, memory, tgt_mask, memory_mask, self_cache, cross_cache, rotation)
        if cache is not None:
            cache.length += tgt.size(1)
        return self.decoder_norm(x)

    def new_cache(self, memory: torch.Tensor, memory_mask: torch.Tensor) -> DecoderCache:
        """A decoding cache for encoder output `memory` (B, S, C) under `memory_mask` (B, 1, 1, S): each
        decoder layer's cross-attention K/V are computed here, once; self-attention K/V start empty."""
        cross = [layer.cross_attn.static_kv(memory) for layer in self.decoder_layers]
        return DecoderCache([KVCache() for _ in self.decoder_layers], cross, memory_mask)

    def forward(self, src, tgt_in, src_mask, tgt_mask) -> torch.Tensor:
        """Teacher-forced training pass: logits (B, T, V) for every target position. tgt_mask: Batch.tgt_mask
        (CAUSAL) for right-padded targets, or a mask tensor."""
        return self.forward_with_memory(src, tgt_in, src_mask, tgt_mask)[0]

    def forward_with_memory(self, src, tgt_in, src_mask, tgt_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's logits (B, T, V) and the encoder output (B, S, C) they were read from (validation measures it)."""
        src_mask = attention_bias(src_mask, self.attention_dtype(src.device))  # once, for encoder and decoder
        memory = self.encode(src, src_mask)
        return self.decode(tgt_in, memory, src_mask, tgt_mask), memory

    def attention_modules(self) -> dict[str, list[MultiHeadAttention]]:
        """The attention blocks by kind, layer order: for inspecting attention weights."""
        return {
            "encoder": [layer.self_attn for layer in self.encoder_layers],
            "decoder": [layer.self_attn for layer in self.decoder_layers],
            "cross": [layer.cross_attn for layer in self.decoder_layers],
        }


@contextlib.contextmanager
def evaluating(model: nn.Module, inference: bool = True) -> Iterator[nn.Module]:
    """Eval mode (dropout off) inside the block and the caller's mode back after it, also on an error: for
    validating, searching or inspecting a model that may be in the middle of training. inference=True also
    runs the block under torch.inference_mode (no autograd; tensors made inside can never join a backward
    pass); False leaves autograd to the caller. The modules that were training are set back, each: a model
    in eval mode is left alone (setting every module's mode twice is a cost a short serve request notices)."""
    training = [m for m in model.modules() if m.training]
    for m in training:
        m.training = False
    try:
        with torch.inference_mode() if inference else contextlib.nullcontext():
            yield model
    finally:
        for m in training:
            m.training = True


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a shared matrix counts once)."""
    return sum(p.numel() for p in model.parameters())


def matmul_weights(cfg: ModelConfig, vocab_size: int) -> tuple[int, int]:
    """Weights of the matrix multiplications one source token (encoder) and one target token (decoder and the
    output projection) pass through: what model FLOPs are counted from."""
    d, attention, ffn = cfg.d_model, 4 * cfg.d_model**2, 2 * cfg.d_model * cfg.d_ff
    return cfg.n_encoder_layers * (attention + ffn), cfg.n_decoder_layers * (2 * attention + ffn) + d * vocab_size


def training_flops(
    cfg: ModelConfig, vocab_size: int, n_src: int, n_tgt: int, shapes: Sequence[tuple[int, int, int]]
) -> float:
    """Model FLOPs of a forward and backward pass over n_src source and n_tgt target tokens: 6 x matmul weights x
    tokens, plus attention's QK^T and AV (2 matmuls x 2 FLOPs per multiply-add x 3 for forward and backward) over
    batches of padded shapes (sentences, source length, target length)."""
    encoder, decoder = matmul_weights(cfg, vocab_size)
    attention = sum(b * (cfg.n_encoder_layers * s * s + cfg.n_decoder_layers * (t * t + t * s)) for b, s, t in shapes)
    return float(6 * (encoder * n_src + decoder * n_tgt) + 12 * cfg.d_model * attention)


def _physical_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def build_model(cfg: ModelConfig, vocab_size: int, specials: Specials = OURS) -> Transformer:
    """A new Transformer, or a UserError naming the settings whose tensors cannot be allocated."""
    d, f = cfg.d_model, cfg.d_ff
    embeddings = (1 if cfg.share_embeddings else 2) + (0 if cfg.tie_output else 1)
    parts = {  # elements, by the settings that size them
        f"the positions table (model.max_positions {cfg.max_positions} x model.d_model {d})": cfg.max_positions * d,
        f"the embeddings (vocabulary {vocab_size} x model.d_model {d})": embeddings * vocab_size * d,
        f"the layers (model.n_encoder_layers {cfg.n_encoder_layers}, model.n_decoder_layers "
        f"{cfg.n_decoder_layers}, model.d_model {d}, model.d_ff {f})": cfg.n_encoder_layers * (4 * d * d + 2 * d * f)
        + cfg.n_decoder_layers * (8 * d * d + 2 * d * f),
    }
    largest = max(parts, key=parts.get)
    total_bytes, memory = 4 * sum(parts.values()), _physical_memory()
    if memory and total_bytes > memory:  # refuse before the allocator commits memory the machine lacks
        raise UserError(
            f"model: {total_bytes / 2**30:,.1f} GiB of weights do not fit in this machine's "
            f"{memory / 2**30:,.1f} GiB of memory; the largest part is {largest}"
        )
    with out_of_memory_names(largest):
        return Transformer(cfg, vocab_size, specials)
