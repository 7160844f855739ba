"""LLM.int8 base weights (``--quant int8``): a fake-tensor stand-in for bitsandbytes' Linear8bitLt.

transformers' ``load_in_8bit=True`` (``integrations/bitsandbytes.py`` replace_with_bnb_linear) replaces every
linear layer but those ``get_keys_to_not_convert`` / ``llm_int8_skip_modules`` name (the output head) with
``bnb.nn.Linear8bitLt(has_fp16_weights=False, threshold=6.0)`` (``BitsAndBytesConfig`` defaults
``llm_int8_has_fp16_weight=False``, ``llm_int8_threshold=6.0``). bitsandbytes' Int8Params quantize real data
with real kernels, so memest replaces each such layer with :class:`Linear8bitModel`, whose storages and
forward / backward allocations are those of bitsandbytes 0.50 (installed and read for this; paths below are
``bitsandbytes/...`` of github.com/bitsandbytes-foundation/bitsandbytes, 0.50.x):

Stored, per layer of N x K weights (``nn/modules.py`` Int8Params._quantize -> ``functional.int8_vectorwise_quant``
of the weight cast to float16): ``CB`` int8 ``[N, K]`` (it *is* the parameter's data: ``self.data = CB``),
``SCB`` float32 ``[N]`` (one absmax per output row), the bias in its dtype. 1 + 4/K bytes per parameter.

Forward, CUDA (``autograd/_functions.py`` MatMul8bitLt.forward, the frozen-weight "fast path"): the input
reshaped to ``[M, K]`` and cast to float16 (a copy unless it is float16); ``int8_vectorwise_quant``
(``backends/cuda/ops.py``): row scales float32 ``[M]``, ``CA`` int8 ``[M, K]``, and with the threshold the
mask ``A.abs() >= 6.0`` (a float16 ``[M, K]`` temporary, then a bool ``[M, K]``), freed on return with the
float16 copy; ``int8_mixed_scaled_mm`` (``backends/default/ops.py``) -> ``int8_scaled_mm`` -> the int32
``[M, N]`` product (``int8_linear_matmul``), ``int8_mm_dequant`` to float16 ``[M, N]`` then ``.to`` the
input's dtype (a copy unless float16). Kept for backward, not through save_for_backward:
``ctx.tensors = (CAt, subA, A)`` — ``CAt`` is None (frozen weight), ``A`` is the layer's input itself, and
``subA`` its outlier columns (``A[:, outlier_cols]``). Because they are ctx attributes, not saved tensors,
activation checkpointing does not drop them: the input of every quantized layer stays alive until its
backward.

Outliers are data-dependent (columns where some ``|x| >= 6.0`` this step): memest traces none. Each outlier
column adds ``M`` values of the input's dtype to what is held until backward (``subA``), and short-lived
``[N, c]`` columns of the weight (int8, float32, input dtype) and a second ``[M, N]`` output
(``output.addmm``) below the int32 product's peak. Bounds per layer: 0 to one more copy of its input.

Forward, CPU (``autograd/_functions.py`` ``matmul``: in training on CPU bitsandbytes runs MatMul8bitFp instead):
the weight dequantised to the input's dtype (``CB.to(A.dtype).mul_(SCB.unsqueeze(1).mul(1 / 127))``: the
``[N, K]`` copy and a float32 ``[N, 1]``), ``F.linear``, the input kept (``ctx.A``).

Backward, both (MatMul8bitLt / MatMul8bitFp.backward, input gradient only): the whole weight dequantised in the
input's dtype, ``state.CB.to(dtype_A, copy=True).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))``
(``[N, K]`` + a float32 ``[N, 1]``), then ``grad_output @ CB``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memest.features.quant import replace_linears

THRESHOLD = 6.0  # transformers BitsAndBytesConfig(llm_int8_threshold=6.0) -> Linear8bitLt(threshold=...)


def stored_layout(out_features: int, in_features: int, bias_bytes: int = 0) -> dict[str, int]:
    """Bytes bitsandbytes stores for one int8 weight, by tensor (the unit test checks these against
    Int8Params' own quantisation of a real tensor)."""
    out = {"weight": out_features * in_features, "SCB": 4 * out_features}
    if bias_bytes:
        out["bias"] = bias_bytes
    return out


class Linear8bitModel(nn.Linear):
    """bitsandbytes' Linear8bitLt (has_fp16_weights=False) as memest traces it: an ``nn.Linear`` (as
    Linear8bitLt is) holding only what bitsandbytes stores. ``cuda_kernels``: MatMul8bitLt with bitsandbytes'
    CUDA ops (``--target cuda``), else MatMul8bitFp (what bitsandbytes runs when training on CPU)."""

    def __init__(self, linear: nn.Module, cuda_kernels: bool):
        nn.Module.__init__(self)
        if isinstance(linear, nn.Linear):
            self.in_features, self.out_features = linear.in_features, linear.out_features
        else:  # transformers' Conv1D: weight [in, out], transposed before quantisation (Bnb8bitQuantize)
            self.in_features, self.out_features = linear.weight.shape
        self.cuda_kernels = cuda_kernels
        device = linear.weight.device
        weight = torch.zeros((self.out_features, self.in_features), dtype=torch.int8, device=device)
        self.weight = nn.Parameter(weight, requires_grad=False)  # Int8Params(requires_grad=False): data is CB
        self.register_buffer("SCB", torch.zeros(self.out_features, dtype=torch.float32, device=device))
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8, threshold={THRESHOLD}"

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """``CB.to(dtype, copy=True).mul_(SCB.unsqueeze(1).mul(1.0 / 127.0))``: the [N, K] copy and, while it is
        scaled, a float32 [N, 1]."""
        w = self.weight.to(dtype, copy=True)
        return w.mul_(self.SCB.unsqueeze(1).mul(1.0 / 127.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Linear8bitLt.forward: "the bias has to be cast manually" -- in place, for good
        if self.bias is not None and self.bias.dtype != x.dtype:
            self.bias.data = self.bias.data.to(x.dtype)
        fn = _MatMul8bitLt if self.cuda_kernels else _MatMul8bitFp
        return fn.apply(x, self.weight, self.bias, self)


def _input_gradient(ctx, grad_output: torch.Tensor) -> torch.Tensor:
    """MatMul8bitLt / MatMul8bitFp.backward's ``req_gradA`` branch."""
    if grad_output.dim() == 3:
        grad_output = grad_output.reshape(-1, grad_output.shape[-1]).contiguous()
    cb = ctx.layer.dequantized(ctx.dtype_A)
    return torch.matmul(grad_output.to(ctx.dtype_A), cb).view(ctx.grad_shape)


def _keep_for_backward(ctx, layer: Linear8bitModel, input_shape, dtype, bias) -> None:
    """What both matmuls' backward reads (the frozen base: the input gradient, and the bias's)."""
    ctx.layer, ctx.grad_shape, ctx.dtype_A = layer, input_shape, dtype
    ctx.bias_grad = bias is not None and bias.requires_grad


def _frozen_backward(ctx, grad_output):
    """Both matmuls' backward: the input's gradient through the dequantised weight, the bias's, none for the weight."""
    grad_bias = grad_output.sum(0) if ctx.bias_grad else None
    grad_a = _input_gradient(ctx, grad_output) if ctx.needs_input_grad[0] else None
    return grad_a, None, grad_bias, None


class _MatMul8bitLt(torch.autograd.Function):
    """MatMul8bitLt.forward with a frozen weight (bitsandbytes' CUDA ops), no outlier column traced."""

    @staticmethod
    def forward(ctx, A, weight, bias, layer: Linear8bitModel):
        input_shape = A.shape
        if A.dim() == 3:
            A = A.reshape(-1, A.shape[-1])
        ca, sca = _int8_vectorwise_quant(A.to(torch.float16))
        sub_a = torch.empty(0, dtype=A.dtype, device=A.device)  # int8_mixed_scaled_mm: no outlier columns
        output = _int8_scaled_mm(ca, layer, sca, bias, A.dtype)
        del ca, sca
        _keep_for_backward(ctx, layer, input_shape, A.dtype, bias)
        ctx.tensors = (None, sub_a, A)  # held by the node, not saved: checkpointing leaves them alive
        if len(input_shape) == 3:
            return output.reshape(*input_shape[:-1], layer.out_features)
        return output

    backward = staticmethod(_frozen_backward)


def _int8_vectorwise_quant(a16: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """backends/cuda/ops.py int8_vectorwise_quant: row_stats, out_row, then the outlier mask (freed on return)."""
    row_stats = torch.empty(a16.numel() // a16.shape[-1], dtype=torch.float32, device=a16.device)
    out_row = torch.empty(a16.shape, dtype=torch.int8, device=a16.device)
    outliers = a16.abs() >= THRESHOLD
    outliers.any()  # `if outliers.any():` -- the branch taken with no outlier is traced
    del outliers
    return out_row, row_stats


def _int8_scaled_mm(ca, layer: Linear8bitModel, sca, bias, dtype) -> torch.Tensor:
    """backends/default/ops.py int8_scaled_mm: the int32 product (cuda int8_linear_matmul), then cuda
    int8_mm_dequant: float16 out (+ bias in place), ``out.to(dtype)``; the int32 freed on return."""
    out_i32 = torch.empty((*ca.shape[:-1], layer.out_features), dtype=torch.int32, device=ca.device)
    out = torch.empty_like(out_i32, dtype=torch.float16)
    if bias is not None and bias.dtype != torch.float16:
        out.add_(bias)
    return out.to(dtype)


class _MatMul8bitFp(torch.autograd.Function):
    """MatMul8bitFp (bitsandbytes' training path on CPU): dequantise, F.linear, keep the input."""

    @staticmethod
    def forward(ctx, A, weight, bias, layer: Linear8bitModel):
        cb = layer.dequantized(A.dtype)
        output = F.linear(A, cb, bias)
        _keep_for_backward(ctx, layer, A.shape, A.dtype, bias)
        ctx.A = A
        return output

    backward = staticmethod(_frozen_backward)


def quantize_linears(model: nn.Module, cuda_kernels: bool) -> int:
    """Replace every nn.Linear (and transformers' Conv1D) but the output head with the stand-in, as
    transformers' replace_with_bnb_linear does for load_in_8bit. Returns the number of layers replaced."""
    return replace_linears(model, lambda child: Linear8bitModel(child, cuda_kernels))
