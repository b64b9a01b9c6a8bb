"""Inference weight formats (transformer/quantize.py): input-major float linears compute what nn.Linear does, and
a model converted to them searches the same hypotheses; the Translator uses them for fp32 on a CPU."""

import copy
import sys

import pytest
import torch
from torch import nn

from tests.conftest import LINES
from transformer.batch import prepare_sources
from transformer.checkpoint import load_model
from transformer.quantize import InputMajorLinear, input_major
from transformer.search import search
from transformer.translate import Translator


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


def test_input_major_model_searches_the_same(copy_model):
    model, vocab, _ = load_model(copy_model)
    converted = input_major(copy.deepcopy(model))
    assert not any(isinstance(m, nn.Linear) for m in converted.modules())
    # The tied output projection gets its own matrix; the embedding it was tied to stays.
    torch.testing.assert_close(converted.output.weight_t, model.tgt_embed.weight.t())
    assert converted.tgt_embed.weight.data_ptr() != converted.output.weight_t.data_ptr()
    src, _ = prepare_sources(vocab.encode(LINES), model.cfg.max_positions)
    for beam in (1, 3):
        with torch.inference_mode():
            a = search(model, src, beam=beam, nbest=beam)
            b = search(converted, src, beam=beam, nbest=beam)
        assert [[h.tokens for h in hyps] for hyps in a.hypotheses] == [[h.tokens for h in hyps] for hyps in b.hypotheses]
        for x, y in zip(a.hypotheses, b.hypotheses):
            assert [h.score for h in x] == pytest.approx([h.score for h in y], abs=1e-4)
    assert len({tuple(h[0].tokens) for h in a.hypotheses}) > len(LINES) // 2  # varied outputs: the check means something


def test_translator_uses_input_major_weights_for_fp32_on_a_cpu(run):
    assert isinstance(Translator(run, device="cpu").model.output, InputMajorLinear)
    bf16 = Translator(run, device="cpu", dtype="bf16").model
    assert isinstance(bf16.output, nn.Linear) and bf16.output.weight.dtype == torch.bfloat16  # measured for fp32 only


def test_int8_without_torch_dynamic_quantization_is_a_one_line_error(run, monkeypatch, call):
    """torch has deprecated eager dynamic quantization; where it is gone, --dtype int8 says what to use instead."""
    monkeypatch.setitem(sys.modules, "torch.ao.quantization", None)  # importing it now fails
    status, _, err = call("translate", run, "--dtype", "int8", "--device", "cpu", "ein hund")
    assert status == 2 and len(err.splitlines()) == 1, err
    assert "--dtype int8 needs torch's dynamic quantization" in err and "--engine ctranslate2" in err
