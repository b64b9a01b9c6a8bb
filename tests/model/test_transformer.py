"""Properties of the Transformer modules (model/transformer.py): shapes, masking, attention, positions, sharing,
size, dropout, the training FLOPs (incremental decoding: test_kv_cache.py)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import ROOT, SMALL_VOCAB, random_ids, random_pairs, small_config, small_model
from transformer.config import ModelConfig, load_config
from transformer.data.batch import Batch, causal_mask, padding_mask, target_mask
from transformer.data.vocab import PAD_ID
from transformer.model.transformer import (
    MultiHeadAttention,
    TokenPacking,
    Transformer,
    count_parameters,
    evaluating,
    training_flops,
)

TOL = dict(atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- shapes


def test_shapes_of_encode_decode_forward():
    model = small_model()
    src, tgt = random_ids(3, 7), random_ids(3, 5)
    src_mask = padding_mask(src)
    tgt_mask = target_mask(tgt)
    memory = model.encode(src, src_mask)
    assert memory.shape == (3, 7, 32)
    logits = model.decode(tgt, memory, src_mask, tgt_mask)
    assert logits.shape == (3, 5, SMALL_VOCAB)
    full = model(src, tgt, src_mask, tgt_mask)
    assert full.shape == (3, 5, SMALL_VOCAB)
    torch.testing.assert_close(full, logits, **TOL)


def test_too_long_sequence_is_rejected():
    model = small_model(max_positions=8)
    src = random_ids(1, 9)
    with pytest.raises(ValueError, match="max_positions"):
        model.encode(src, padding_mask(src))


# --------------------------------------------------------------------------- masking


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_decoder_is_causal(norm):
    model = small_model(norm=norm)
    src, tgt = random_ids(2, 6), random_ids(2, 8)
    src_mask = padding_mask(src)
    mask = causal_mask(8)
    memory = model.encode(src, src_mask)
    before = model.decode(tgt, memory, src_mask, mask)
    for k in (0, 3, 6):
        changed = tgt.clone()
        changed[:, k + 1 :] = random_ids(2, 8 - k - 1)
        assert not torch.equal(changed[:, k + 1 :], tgt[:, k + 1 :])
        after = model.decode(changed, memory, src_mask, mask)
        torch.testing.assert_close(after[:, : k + 1], before[:, : k + 1], **TOL)
        # ... and the future positions do see the change.
        assert not torch.allclose(after[:, k + 1 :], before[:, k + 1 :])


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_padding_invariance(norm):
    """A pair alone gives the same encoder output and logits as inside a batch padded by longer pairs."""
    model = small_model(norm=norm)
    # The first pair is short on both sides; the others force source and target padding.
    pairs = random_pairs(lengths=[(3, 4), (9, 2), (2, 10), (6, 6)], seed=1, vocab=SMALL_VOCAB)
    batch = Batch.from_pairs(pairs)
    assert batch.src.size(1) == 10 and batch.tgt_in.size(1) == 11
    memory = model.encode(batch.src, batch.src_mask)
    logits = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    for i, pair in enumerate(pairs):
        alone = Batch.from_pairs([pair])
        s, t = alone.src.size(1), alone.tgt_in.size(1)
        assert s == len(pair[0]) + 1 and t == len(pair[1]) + 1
        mem_alone = model.encode(alone.src, alone.src_mask)
        logits_alone = model(alone.src, alone.tgt_in, alone.src_mask, alone.tgt_mask)
        torch.testing.assert_close(memory[i : i + 1, :s], mem_alone, **TOL)
        torch.testing.assert_close(logits[i : i + 1, :t], logits_alone, **TOL)


def test_encoder_skips_padding_with_the_same_result(monkeypatch):
    """On a CPU the encoder runs its position-wise layers on the real tokens only (TokenPacking): outputs and
    gradients at real positions are those of the padded computation, and memory is zero at padding."""
    batch = Batch.from_pairs(random_pairs(lengths=[(3, 4), (9, 2), (6, 6)], seed=2, vocab=SMALL_VOCAB))
    assert TokenPacking.of(batch.src_mask) is not None
    real = batch.src_mask[:, 0, 0, :, None]  # (B, S, 1)

    def run():
        model = small_model(seed=3)  # dropout 0: training mode is deterministic
        memory = model.encode(batch.src, batch.src_mask)
        (memory * real).square().sum().backward()
        return memory, [p.grad for p in model.parameters()]

    packed, packed_grads = run()
    monkeypatch.setattr(TokenPacking, "of", staticmethod(lambda mask: None))  # every position computed
    padded, padded_grads = run()
    torch.testing.assert_close(packed * real, padded * real, **TOL)
    assert torch.count_nonzero(packed * ~real) == 0
    for a, b in zip(packed_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- attention


def reference_attention(mha: MultiHeadAttention, query, key_value, mask):
    """softmax(Q K^T / sqrt(d_head) masked) V per head, written out independently of the model."""
    b, tq, c = query.shape
    tk = key_value.size(1)
    h = mha.n_heads
    dh = c // h
    q = (query @ mha.q_proj.weight.T + mha.q_proj.bias).view(b, tq, h, dh).permute(0, 2, 1, 3)
    k = (key_value @ mha.k_proj.weight.T + mha.k_proj.bias).view(b, tk, h, dh).permute(0, 2, 1, 3)
    v = (key_value @ mha.v_proj.weight.T + mha.v_proj.bias).view(b, tk, h, dh).permute(0, 2, 1, 3)
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) / math.sqrt(dh)
    if mask is not None:
        scores = torch.where(mask, scores, torch.full_like(scores, -1e30))
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    out = torch.einsum("bhqk,bhkd->bhqd", probs, v).permute(0, 2, 1, 3).reshape(b, tq, c)
    return out @ mha.out_proj.weight.T + mha.out_proj.bias, probs


def attention_inputs():
    torch.manual_seed(3)
    mha = MultiHeadAttention(32, 4, attention_dropout=0.0).eval()
    for p in mha.parameters():  # non-zero biases so they are checked too
        torch.nn.init.normal_(p, std=0.3)
    query, key_value = torch.randn(2, 5, 32), torch.randn(2, 7, 32)
    key_pad = torch.tensor([[True] * 7, [True] * 4 + [False] * 3])[:, None, None, :]  # (B, 1, 1, Tk)
    random_mask = torch.rand(2, 1, 5, 7) > 0.5
    random_mask[..., 0] = True  # every query keeps at least one key
    return mha, query, key_value, {"none": None, "padding": key_pad, "full": random_mask}


@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
def test_attention_matches_reference(mask_kind):
    mha, query, key_value, masks = attention_inputs()
    mask = masks[mask_kind]
    expected, _ = reference_attention(mha, query, key_value, mask)
    torch.testing.assert_close(mha(query, key_value, mask), expected, **TOL)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "full"])
def test_attention_record_path(mask_kind):
    mha, query, key_value, masks = attention_inputs()
    mask = masks[mask_kind]
    fused = mha(query, key_value, mask)
    mha.record = []
    recorded = mha(query, key_value, mask)
    torch.testing.assert_close(recorded, fused, **TOL)
    assert len(mha.record) == 1
    probs = mha.record[0]
    assert probs.shape == (2, 4, 5, 7)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 4, 5), **TOL)
    _, expected_probs = reference_attention(mha, query, key_value, mask)
    torch.testing.assert_close(probs, expected_probs, **TOL)
    if mask is not None:
        assert torch.all(probs.masked_select(~mask.expand_as(probs)) == 0)
    mha(query, key_value, mask)
    assert len(mha.record) == 2


def test_model_record_path_matches_fused():
    model = small_model()
    batch = Batch.from_pairs(random_pairs(lengths=[(4, 5), (7, 3)], vocab=SMALL_VOCAB))
    fused = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    modules = [m for ms in model.attention_modules().values() for m in ms]
    assert len(modules) == 6
    for m in modules:
        m.record = []
    recorded = model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    torch.testing.assert_close(recorded, fused, **TOL)
    for m in modules:
        assert len(m.record) == 1
        torch.testing.assert_close(m.record[0].sum(-1), torch.ones(m.record[0].shape[:-1]), **TOL)


# --------------------------------------------------------------------------- embeddings


def test_embeddings_scaled_by_sqrt_d_model():
    model = small_model()
    seen = {}

    def capture(module, args):
        seen["x"] = args[0]

    model.encoder_layers[0].register_forward_pre_hook(capture)
    src = random_ids(2, 6)
    model.encode(src, padding_mask(src))
    expected = model.src_embed.weight[src] * math.sqrt(32) + model.position_encoding.table[:6]
    torch.testing.assert_close(seen["x"], expected, **TOL)


def test_pad_embedding_is_zero():
    model = small_model()
    assert torch.all(model.src_embed.weight[PAD_ID] == 0)
    assert torch.all(model.tgt_embed.weight[PAD_ID] == 0)


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("tie", [True, False])
def test_weight_sharing(share, tie):
    model = small_model(share_embeddings=share, tie_output=tie)
    assert (model.src_embed.weight is model.tgt_embed.weight) == share
    assert (model.output.weight is model.tgt_embed.weight) == tie
    assert (model.output.weight is model.src_embed.weight) == (share and tie)
    distinct = {id(model.src_embed.weight), id(model.tgt_embed.weight), id(model.output.weight)}
    reference = count_parameters(small_model(share_embeddings=True, tie_output=True))
    assert count_parameters(model) == reference + (len(distinct) - 1) * SMALL_VOCAB * 32
    # Parameters are counted once however they are shared.
    assert count_parameters(model) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    # A tied matrix receives gradient from all its uses.
    batch = Batch.from_pairs(random_pairs(lengths=[(4, 4)], vocab=SMALL_VOCAB))
    model(batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask).sum().backward()
    assert model.output.weight.grad is not None


def expected_parameter_count(cfg: ModelConfig, vocab: int) -> int:
    d, f = cfg.d_model, cfg.d_ff
    attention = 4 * (d * d + d)  # Q, K, V, output projections with biases
    ffn = d * f + f + f * d + d  # two linears with biases
    layer_norm = 2 * d  # gain and bias
    encoder_layer = attention + ffn + 2 * layer_norm
    decoder_layer = 2 * attention + ffn + 3 * layer_norm
    matrices = 1 if cfg.share_embeddings and cfg.tie_output else (3 - cfg.share_embeddings - cfg.tie_output)
    final_norms = 2 * layer_norm if cfg.norm == "pre" else 0
    return (
        vocab * d * matrices + cfg.n_encoder_layers * encoder_layer + cfg.n_decoder_layers * decoder_layer + final_norms
    )


def test_base_config_parameter_count():
    cfg = load_config(ROOT / "configs" / "base.yaml").model
    with torch.device("meta"):  # no memory, no init cost
        model = Transformer(cfg, 37000)
    n = count_parameters(model)
    assert n == expected_parameter_count(cfg, 37000)
    assert abs(n - 65e6) / 65e6 < 0.05
    assert 62e6 < n < 64e6


@pytest.mark.parametrize(
    "kw",
    [
        dict(norm="pre"),
        dict(share_embeddings=False),
        dict(tie_output=False),
        dict(share_embeddings=False, tie_output=False, n_decoder_layers=3),
    ],
)
def test_small_parameter_count_formula(kw):
    cfg = small_config(**kw)
    assert count_parameters(Transformer(cfg, SMALL_VOCAB)) == expected_parameter_count(cfg, SMALL_VOCAB)


# --------------------------------------------------------------------------- dropout


def test_dropout_train_vs_eval():
    model = small_model(dropout=0.3, attention_dropout=0.3, activation_dropout=0.3)
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 5), (3, 6)], vocab=SMALL_VOCAB))
    args = (batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    model.train()
    a, b = model(*args), model(*args)
    assert not torch.allclose(a, b)
    model.eval()
    c, d = model(*args), model(*args)
    assert torch.equal(c, d)
    # Dropout off is the same as dropout 0 (same weights).
    plain = small_model(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    plain.load_state_dict(model.state_dict())
    plain.train()
    torch.testing.assert_close(plain(*args), c, **TOL)


@pytest.mark.parametrize("which", ["dropout", "attention_dropout", "activation_dropout"])
def test_each_dropout_is_used_in_training(which):
    kw = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    kw[which] = 0.5
    model = small_model(**kw)
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 5)], vocab=SMALL_VOCAB))
    args = (batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    model.train()
    assert not torch.allclose(model(*args), model(*args))
    model.eval()
    assert torch.equal(model(*args), model(*args))


def test_attention_dropout_only_in_training():
    mha, query, key_value, _ = attention_inputs()
    mha.attention_dropout = 0.5
    mha.train()
    assert not torch.allclose(mha(query, key_value, None), mha(query, key_value, None))
    mha.eval()
    expected, _ = reference_attention(mha, query, key_value, None)
    torch.testing.assert_close(mha(query, key_value, None), expected, **TOL)


@pytest.mark.parametrize("inference", [True, False])
def test_evaluating_turns_dropout_off_and_gives_the_mode_back(inference):
    model = small_model(dropout=0.3, attention_dropout=0.3, activation_dropout=0.3).train()
    batch = Batch.from_pairs(random_pairs(lengths=[(5, 5), (3, 6)], vocab=SMALL_VOCAB))
    args = (batch.src, batch.tgt_in, batch.src_mask, batch.tgt_mask)
    with evaluating(model, inference=inference):
        assert not any(m.training for m in model.modules())
        assert torch.equal(model(*args), model(*args))  # no dropout
        assert torch.is_inference_mode_enabled() == inference and torch.is_grad_enabled() != inference
    assert all(m.training for m in model.modules())
    with pytest.raises(RuntimeError, match="boom"):
        with evaluating(model, inference=inference):
            raise RuntimeError("boom")
    assert model.training  # also after an error
    model.eval()
    with evaluating(model, inference=inference):
        pass
    assert not model.training  # a model in eval mode stays there
    model.encoder_layers[0].train()  # a part in training mode: given back as it was, the rest left alone
    with evaluating(model, inference=inference):
        assert not any(m.training for m in model.modules())
    assert {m for m in model.modules() if m.training} == set(model.encoder_layers[0].modules())


@pytest.mark.parametrize("norm", ["post", "pre"])
def test_encoder_layer_is_the_papers_residual_and_layer_norm(norm):
    # Post-norm (the paper): LayerNorm(x + Sublayer(x)) after each sub-layer. Pre-norm: x + Sublayer(LayerNorm(x)).
    import torch.nn.functional as F

    from transformer.model.transformer import EncoderLayer

    torch.manual_seed(0)
    layer = EncoderLayer(ModelConfig(d_model=16, n_heads=2, d_ff=32, dropout=0.0, norm=norm)).eval()
    for p in layer.parameters():  # LayerNorm's gain and bias away from 1 and 0, so that they count
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(2, 5, 16)
    mask = padding_mask(torch.tensor([[5, 6, 7, 8, 9], [5, 6, 7, 0, 0]]))

    def ln(h, sub):
        return F.layer_norm(h, (16,), sub.norm.weight, sub.norm.bias)

    def attention(h):
        return layer.self_attn(h, h, mask)

    with torch.no_grad():
        if norm == "post":
            h = ln(x + attention(x), layer.sub_attn)
            want = ln(h + layer.ffn(h), layer.sub_ffn)
        else:
            h = x + attention(ln(x, layer.sub_attn))
            want = h + layer.ffn(ln(h, layer.sub_ffn))
        torch.testing.assert_close(layer(x, mask), want)


def test_training_flops_count_the_matmuls():
    cfg = ModelConfig(d_model=8, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=16)
    encoder = 4 * 64 + 2 * 8 * 16  # Q, K, V, O and the two feed-forward matrices
    decoder = 2 * (8 * 64 + 2 * 8 * 16) + 8 * 100  # self- and cross-attention, feed-forward; output projection
    dense = 6 * (encoder * 30 + decoder * 20)
    attention = 12 * 8 * 3 * (1 * 10 * 10 + 2 * (7 * 7 + 7 * 10))
    assert training_flops(cfg, 100, 30, 20, [(3, 10, 7)]) == dense + attention
