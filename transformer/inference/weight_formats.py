"""How the linear layers hold their weights for CPU inference: int8 (dynamic quantization: weights int8,
activations quantized on the fly), fp32 stored input-major, (in, out), for MKL's faster untransposed product, with
the output projection packed once into oneDNN's blocked layout, or bf16 packed so for CPUs with native bf16
(AMX / AVX512-BF16)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from transformer.device import mkl_without_avx512
from transformer.errors import UserError


def quantize_int8(model: nn.Module) -> nn.Module:
    """A copy of `model` whose nn.Linear layers compute in int8 (CPU only; the original is untouched).

    The embeddings stay float; a tied output projection gets its own int8 copy of the shared matrix.
    """
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise UserError("--dtype int8 is a CPU path: use --device cpu (on CUDA, bf16 is the fast path)")
    # torch marks eager-mode quantization deprecated in favour of torchao; it still works (torch 2.4-2.13) and
    # needs no extra package. A torch that has dropped it gets a one-line error, not a traceback.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from torch.ao.quantization import quantize_dynamic
        except ImportError:
            raise UserError(
                f"--dtype int8 needs torch's dynamic quantization, which this torch ({torch.__version__}) "
                "does not have: use --dtype fp32, or --engine ctranslate2 --dtype int8"
            ) from None
        if "fbgemm" in torch.backends.quantized.supported_engines:
            torch.backends.quantized.engine = "fbgemm"  # x86 int8 GEMM
        quantized = quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, dtype=torch.qint8)
    return _replace_linears(quantized, Int8Linear, "int8 weights", kind=torch.ao.nn.quantized.dynamic.Linear)


class Int8Linear(nn.Module):
    """torch's dynamically quantized linear layer (its packed int8 weight and its operator, so the same products)
    without the Python its module runs around the operator at every call: a dtype and version check, the
    operator's overload resolution and its argument scan (a decoding step calls dozens of them). The packed weight is
    not in its state_dict: like PackedLinear, an inference-only layer that is multiplied, never saved."""

    def __init__(self, dynamic: nn.Module):
        super().__init__()
        self.in_features, self.out_features = dynamic.in_features, dynamic.out_features
        self.packed = dynamic._packed_params._packed_params  # fbgemm's packed weight and bias
        overload = torch.ops.quantized.linear_dynamic.default
        # The C++ operator itself: the overload object first searches every call's arguments for torch.compile's
        # fake script objects, which eager inference never passes (a cost paid at every call of every layer).
        self.linear = getattr(overload, "_op", overload)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: activations in 7 bits, as torch's module (version 4) quantizes them
        return self.linear(x, self.packed, True)


class InputMajorLinear(nn.Module):
    """nn.Linear for CPU inference with its weight stored transposed and contiguous, (in, out): x @ W_t is the
    product MKL runs fastest. F.linear's x @ W^T reads the (out, in) weight transposed, which is slower at
    decoding's few rows when the weight is not in cache (docs/benchmarks/log.md, "Input-major weights")."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())  # (in, out)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # (..., in) -> (N, in)
        y = flat @ self.weight_t if self.bias is None else torch.addmm(self.bias, flat, self.weight_t)
        return y.view(*x.shape[:-1], self.out_features)  # (N, out) -> (..., out)


def input_major(model: nn.Module) -> nn.Module:
    """`model`, changed in place for CPU inference: every nn.Linear becomes an InputMajorLinear. A tied output
    projection gets its own transposed copy of the shared matrix; the embeddings keep theirs."""
    return _replace_linears(model, InputMajorLinear, "input-major weights")


def cpu_fp32(model: nn.Module, every_layer: bool | None = None) -> nn.Module:
    """`model`, changed in place for fp32 inference on a CPU: the output projection packed for oneDNN (PackedLinear)
    where this torch can (can_pack), every other nn.Linear input-major (InputMajorLinear), or packed too where
    `every_layer` (None: where MKL leaves this CPU's AVX512 unused, device.mkl_without_avx512). The output
    projection is the widest weight (vocabulary x d_model), the one decoding multiplies most rows by, and at a
    decoding step's few rows MKL's product with it costs several times oneDNN's on a packed copy; on AVX2-only
    CPUs the narrower layers run as fast or faster through MKL, on AMD CPUs with AVX512 faster through oneDNN
    (device.mkl_without_avx512)."""
    if not can_pack(torch.float32):
        return input_major(model)
    if every_layer is None:
        every_layer = mkl_without_avx512()
    if every_layer:
        return _replace_linears(model, lambda linear: PackedLinear(linear, torch.float32), "packed fp32 weights")
    model.output = PackedLinear(model.output, torch.float32)
    return input_major(model)


def _replace_linears(model: nn.Module, make, layout: str, kind: type[nn.Module] = nn.Linear) -> nn.Module:
    """`model` in eval mode with every linear layer of `kind` replaced, in place, by make(linear): a CPU-only
    layout."""
    if any(p.device.type != "cpu" for p in model.parameters()):
        raise ValueError(f"{layout} are a CPU layout")
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, kind):
                setattr(module, name, make(child))
    return model.eval()


def can_pack(dtype: torch.dtype) -> bool:
    """Whether PackedLinear runs here in `dtype`: a torch with oneDNN's linear ops, and for bf16 a CPU that oneDNN
    runs bf16 on (AVX512-BF16/AMX; on others oneDNN has no bf16 kernel and a plain cast is all there is)."""
    mkldnn = torch.ops.mkldnn
    if not torch.backends.mkldnn.is_available() or not all(
        hasattr(mkldnn, op) for op in ("_reorder_linear_weight", "_linear_pointwise", "_is_mkldnn_bf16_supported")
    ):
        return False
    return dtype == torch.float32 or bool(mkldnn._is_mkldnn_bf16_supported())


class PackedLinear(nn.Module):
    """nn.Linear for CPU inference in `dtype` (bf16 or fp32): the weight reordered once into oneDNN's blocked layout.
    A plain bf16 F.linear reorders it again at every call, reading and writing the whole weight for decoding's few
    rows, which a search feels end to end (docs/benchmarks/log.md, "bf16 on a CPU with AMX"); the product is the
    same oneDNN kernel, so outputs are identical to F.linear in bf16. The packed weight is an opaque oneDNN
    tensor: it cannot be copied, saved or moved, only multiplied."""

    def __init__(self, linear: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(dtype)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight)  # (out, in), blocked
        self.bias = None if linear.bias is None else linear.bias.detach().to(dtype).clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_bf16(model: nn.Module) -> nn.Module:
    """`model` in bf16, changed in place for CPU inference: every nn.Linear becomes a PackedLinear where this
    torch can pack (can_pack); otherwise only cast. A tied output projection gets its own packed copy."""
    model = model.to(torch.bfloat16)
    if not can_pack(torch.bfloat16):
        return model.eval()
    return _replace_linears(model, lambda linear: PackedLinear(linear, torch.bfloat16), "packed bf16 weights")
