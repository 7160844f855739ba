"""torch's own RMSNorm (``nn.RMSNorm``, ``F.rms_norm``) as the CUDA kernel runs it, for ``--target cuda`` traces.

``aten::rms_norm`` is CompositeImplicitAutograd (``rms_norm_symint``, aten/src/ATen/native/layer_norm.cpp). It
calls ``at::_fused_rms_norm``, which has a CUDA kernel (``_fused_rms_norm_cuda``) but is
CompositeImplicitAutograd on the CPU (``rms_norm_composite``: torch 2.13's
torchgen/packaged/ATen/native/native_functions.yaml). So on the CPU autograd records the composite's ops and
saves what they save (the fp32 up-cast input and the fp32 normalized tensor: 8 B per element for a bf16 input),
while on a GPU ``_fused_rms_norm`` is one autograd node that saves its ``input``, ``weight`` and ``result1``
(the rstd, in the accumulation type) (torchgen/packaged/autograd/derivatives.yaml, ``_fused_rms_norm``): 2 B per
element for a bf16 input. Measured difference on a Llama-2-7B layer at batch 8 x seq 2048:
benchmarks/llama-layer.md (0.75 GiB per layer, two norms).

``rms_norm_symint`` takes the composite on CUDA too for channels-last and complex inputs and where the weight's
dtype differs from the input's (it warns "Can not dispatch to fused implementation"); this rule does the same.

The CUDA kernels allocate their outputs only (Y in the input's dtype, rstd in the accumulation type; dX and
dweight in backward); SIMPLIFICATION: the backward kernel's per-block partial sums for dweight (a few hundred
rows of N fp32 values where M is large, layer_norm_kernel.cu) are not counted. The rule runs on fake tensors
only (values do not exist there); real tensors and tensor subclasses (DTensor) keep the composite.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

aten = torch.ops.aten
_ACC = {torch.float16: torch.float32, torch.bfloat16: torch.float32}  # at::opmath_type / acc_type


def _stat_shape(x: torch.Tensor, normalized_shape) -> list[int]:
    axis = x.dim() - len(normalized_shape)
    return list(x.shape[:axis]) + [1] * len(normalized_shape)


class _FusedRmsNorm(torch.autograd.Function):
    """One node that saves input, weight and rstd, as ``_fused_rms_norm``'s CUDA kernel and formula do."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps):
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        rstd = x.new_empty(_stat_shape(x, normalized_shape), dtype=_ACC.get(x.dtype, x.dtype))
        ctx.save_for_backward(x, weight, rstd)
        ctx.has_weight = weight is not None
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, _rstd = ctx.saved_tensors
        dx = torch.empty_like(x, memory_format=torch.contiguous_format) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.has_weight and ctx.needs_input_grad[1] else None
        return dx, dw, None, None


def fused_applies(x, weight) -> bool:
    """Would ``rms_norm_symint`` call the fused kernel on CUDA for these inputs (and can the rule model it)?"""
    if type(x) is not FakeTensor or (weight is not None and type(weight) is not FakeTensor):
        return False
    channels_last = not x.is_contiguous() and (
        (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
        or (x.dim() == 5 and x.is_contiguous(memory_format=torch.channels_last_3d))
    )
    if x.is_complex() or channels_last:
        return False
    return weight is None or weight.dtype == x.dtype


def rms_norm(x, normalized_shape, weight=None, eps=None):
    """aten::rms_norm at AutogradCPU while a --target cuda trace runs."""
    if fused_applies(x, weight):
        return _FusedRmsNorm.apply(x, weight, list(normalized_shape), eps)
    return aten._fused_rms_norm(x, list(normalized_shape), weight, eps)[0]  # the composite, as on the CPU
