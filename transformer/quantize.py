"""Optional int8 CPU inference: dynamic quantization of the model's Linear layers (weights int8, activations
quantized on the fly), for faster `translate`/`evaluate` on CPUs."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from transformer.errors import UserError


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose nn.Linear layers compute in int8 (CPU only; the original is untouched).

    The embeddings stay float; a tied output projection gets its own int8 copy of the shared matrix.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UserError("--dtype int8 is a CPU path: use --device cpu (on CUDA, bf16 is the fast path)")
    if "fbgemm" in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = "fbgemm"  # x86 int8 GEMM
    with warnings.catch_warnings():
        # torch marks eager-mode quantization deprecated in favour of torchao; it still works and needs no extra package.
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, dtype=torch.qint8)
    return quantized
