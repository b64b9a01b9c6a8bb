"""Inference weight formats (transformer/inference/weight_formats.py): input-major float linears, packed fp32 and
bf16 linears compute what nn.Linear does, and a model converted to them searches the same hypotheses; the
Translator uses them for fp32 (the output projection packed) and bf16 on a CPU."""

import copy
import sys

import pytest
import torch
from torch import nn

from tests.helpers import LINES
from transformer.data.batch import prepare_sources
from transformer.inference import weight_formats
from transformer.inference.search import search
from transformer.inference.settings import SearchFlags, SearchSettings
from transformer.inference.translator import Translator
from transformer.inference.weight_formats import (
    InputMajorLinear,
    Int8Linear,
    PackedLinear,
    can_pack,
    cpu_fp32,
    input_major,
    pack_bf16,
    quantize_int8,
)
from transformer.model.checkpoint import load_model


@pytest.mark.parametrize("bias", [True, False])
def test_input_major_linear_computes_what_linear_does(bias):
    torch.manual_seed(0)
    linear = nn.Linear(16, 24, bias=bias)
    fast = InputMajorLinear(linear)
    assert fast.weight_t.shape == (16, 24) and fast.weight_t.is_contiguous()
    for shape in [(5, 16), (3, 7, 16), (2, 1, 16)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(fast(x), linear(x))
    # A copy, not a view: training the original later does not change a converted model.
    with torch.no_grad():
        linear.weight.add_(1.0)
    x = torch.randn(4, 16)
    assert not torch.allclose(fast(x), linear(x))


def assert_searches_the_same(model, converted, vocab) -> None:
    """`converted` finds the hypotheses `model` finds, greedy and at beam 3, with scores equal to float rounding."""
    src, _ = prepare_sources(vocab.encode(LINES), model.cfg.max_positions)
    for beam in (1, 3):
        with torch.inference_mode():
            a = search(model, src, SearchSettings(beam=beam, nbest=beam))
            b = search(converted, src, SearchSettings(beam=beam, nbest=beam))
        assert [[h.tokens for h in hyps] for hyps in a.hypotheses] == [
            [h.tokens for h in hyps] for hyps in b.hypotheses
        ]
        for x, y in zip(a.hypotheses, b.hypotheses):
            assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-4)
    assert (
        len({tuple(h[0].tokens) for h in a.hypotheses}) > len(LINES) // 2
    )  # varied outputs: the check means something


def test_input_major_model_searches_the_same(copy_model):
    model, vocab, _ = load_model(copy_model)
    converted = input_major(copy.deepcopy(model))
    assert not any(isinstance(m, nn.Linear) for m in converted.modules())
    # The tied output projection gets its own matrix; the embedding it was tied to stays.
    torch.testing.assert_close(converted.output.weight_t, model.tgt_embed.weight.t())
    assert converted.tgt_embed.weight.data_ptr() != converted.output.weight_t.data_ptr()
    assert_searches_the_same(model, converted, vocab)


@pytest.mark.parametrize("bias", [True, False])
def test_int8_linear_computes_exactly_what_torchs_dynamic_quantized_linear_does(bias):
    torch.manual_seed(0)
    dynamic = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(16, 300, bias=bias)), {nn.Linear})[0]
    assert isinstance(dynamic, torch.ao.nn.quantized.dynamic.Linear)
    fast = Int8Linear(dynamic)
    for shape in [(4, 16), (3, 7, 16), (2, 1, 16)]:
        x = torch.randn(*shape) * 3
        assert fast(x).shape == (*shape[:-1], 300)
        assert torch.equal(fast(x), dynamic(x))  # the same operator on the same packed weight: bit for bit


def test_int8_model_has_only_int8_linears_and_searches_the_same_as_torchs_modules(copy_model, monkeypatch):
    model, vocab, _ = load_model(copy_model)
    int8 = quantize_int8(model)
    assert isinstance(int8.output, Int8Linear) and isinstance(int8.decoder_layers[0].self_attn.q_proj, Int8Linear)
    assert not any(isinstance(m, (nn.Linear, torch.ao.nn.quantized.dynamic.Linear)) for m in int8.modules())
    assert any(isinstance(m, nn.Linear) for m in model.modules())  # the original is untouched
    monkeypatch.setattr(weight_formats, "Int8Linear", lambda dynamic: dynamic)  # torch's own modules kept
    plain = quantize_int8(model)
    assert isinstance(plain.output, torch.ao.nn.quantized.dynamic.Linear)
    src, _ = prepare_sources(vocab.encode(LINES), model.cfg.max_positions)
    with torch.inference_mode():
        a, b = search(plain, src, SearchSettings(beam=3, nbest=3)), search(int8, src, SearchSettings(beam=3, nbest=3))
    assert [[(h.tokens, h.score) for h in hyps] for hyps in a.hypotheses] == [
        [(h.tokens, h.score) for h in hyps] for hyps in b.hypotheses
    ]  # exactly: tokens and scores


needs_onednn = pytest.mark.skipif(not can_pack(torch.float32), reason="this torch has no oneDNN linear ops")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_packed_fp32_linear_computes_what_linear_does(bias):
    torch.manual_seed(0)
    linear = nn.Linear(16, 300, bias=bias)
    packed = PackedLinear(linear, torch.float32)
    for shape in [(4, 16), (3, 7, 16), (2, 1, 16)]:
        x = torch.randn(*shape)
        torch.testing.assert_close(packed(x), linear(x))  # another kernel: equal to float rounding
    with torch.no_grad():  # a copy: training the original later does not change a converted model
        linear.weight.add_(1.0)
    x = torch.randn(4, 16)
    assert not torch.allclose(packed(x), linear(x))


@needs_onednn
def test_cpu_fp32_model_packs_the_output_projection_and_searches_the_same(copy_model):
    model, vocab, _ = load_model(copy_model)
    converted = cpu_fp32(copy.deepcopy(model), every_layer=False)
    assert isinstance(converted.output, PackedLinear)
    layer = converted.decoder_layers[0]
    assert isinstance(layer.ffn.fc1, InputMajorLinear) and isinstance(layer.self_attn.q_proj, InputMajorLinear)
    assert not any(isinstance(m, nn.Linear) for m in converted.modules())
    assert converted.tgt_embed.weight.dtype == torch.float32  # the tied embedding stays as it was
    assert_searches_the_same(model, converted, vocab)


@needs_onednn
def test_cpu_fp32_model_packs_every_layer_where_asked_and_searches_the_same(copy_model):
    model, vocab, _ = load_model(copy_model)
    converted = cpu_fp32(copy.deepcopy(model), every_layer=True)
    layer = converted.decoder_layers[0]
    assert all(isinstance(m, PackedLinear) for m in (converted.output, layer.ffn.fc1, layer.self_attn.q_proj))
    assert not any(isinstance(m, (nn.Linear, InputMajorLinear)) for m in converted.modules())
    assert_searches_the_same(model, converted, vocab)


def test_translator_uses_input_major_weights_for_fp32_and_packed_ones_for_bf16_on_a_cpu(run, monkeypatch):
    monkeypatch.setattr(weight_formats, "mkl_without_avx512", lambda: False)  # as on AVX2 and Intel CPUs
    fp32 = Translator(run, "cpu").model
    assert isinstance(fp32.output, PackedLinear if can_pack(torch.float32) else InputMajorLinear)
    assert isinstance(fp32.decoder_layers[0].ffn.fc1, InputMajorLinear)
    # Where MKL leaves the CPU's AVX512 unused (AMD Zen 4/5), every fp32 layer goes through oneDNN.
    monkeypatch.setattr(weight_formats, "mkl_without_avx512", lambda: True)
    packed = Translator(run, "cpu").model.decoder_layers[0].ffn.fc1
    assert isinstance(packed, PackedLinear if can_pack(torch.float32) else InputMajorLinear)
    bf16 = Translator(run, "cpu", SearchFlags(dtype="bf16")).model
    assert isinstance(bf16.output, PackedLinear if can_pack(torch.bfloat16) else nn.Linear)
    assert bf16.tgt_embed.weight.dtype == torch.bfloat16
    # Where oneDNN has no bf16 kernel (CPUs without AVX512-BF16/AMX), the weights are only cast.
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False)
    plain = Translator(run, "cpu", SearchFlags(dtype="bf16")).model
    assert isinstance(plain.output, nn.Linear) and plain.output.weight.dtype == torch.bfloat16
    # A torch without oneDNN: every fp32 projection input-major, the output one too.
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert isinstance(Translator(run, "cpu").model.output, InputMajorLinear)


@pytest.mark.skipif(not can_pack(torch.bfloat16), reason="oneDNN runs no bf16 on this CPU (no AVX512-BF16/AMX)")
def test_packed_bf16_search_equals_the_plain_bf16_one(copy_model):
    model, vocab, _ = load_model(copy_model)
    plain = copy.deepcopy(model).to(torch.bfloat16)
    packed = pack_bf16(copy.deepcopy(model))
    assert isinstance(packed.output, PackedLinear)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())  # every projection packed
    src, _ = prepare_sources(vocab.encode(LINES), model.cfg.max_positions)
    for beam in (1, 3):
        with torch.inference_mode():
            a = search(plain, src, SearchSettings(beam=beam, nbest=beam))
            b = search(packed, src, SearchSettings(beam=beam, nbest=beam))
        # The same oneDNN product, only without the per-call weight reorder: the same numbers, not merely close.
        assert [[(h.tokens, h.score) for h in hyps] for hyps in a.hypotheses] == [
            [(h.tokens, h.score) for h in hyps] for hyps in b.hypotheses
        ]
    assert len({tuple(h[0].tokens) for h in a.hypotheses}) > len(LINES) // 2


def test_int8_without_torch_dynamic_quantization_is_a_one_line_error(run, monkeypatch, call):
    """torch has deprecated eager dynamic quantization; where it is gone, --dtype int8 says what to use instead."""
    monkeypatch.setitem(sys.modules, "torch.ao.quantization", None)  # importing it now fails
    status, _, err = call("translate", run, "--dtype", "int8", "--device", "cpu", "ein hund")
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "--dtype int8 needs torch's dynamic quantization" in err and "--engine ctranslate2" in err
