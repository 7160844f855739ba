"""ATen's CPU layer norm: what the real kernels allocate that the meta kernels do not show.

``layer_norm_backward_cpu`` (aten/src/ATen/native/layer_norm.cpp, with layer_norm_kernel.cpp):
- ``X = input.expect_contiguous()``: a contiguous copy of a non-contiguous input, made before the outputs
  and freed when the kernel returns;
- ``dX = empty_like(*X, LEGACY_CONTIGUOUS_MEMORY_FORMAT)``: dX is contiguous whatever ``dY``'s strides; the
  meta kernel gives it ``dY``'s, so a transposed ``dY`` (e.g. from a pooling over the sequence, Swin's
  pooler) made a non-contiguous dX that the next Linear's backward copied (``reshape``): the real run
  makes no such copy;
- once the outputs exist: ``dY.contiguous()`` when ``dY`` is not, and, when dgamma or dbeta is asked
  for, a reduction buffer of 2 x threads x N elements (``buffer.resize_``), both freed on return.
``layer_norm_cpu`` (forward) makes the same copy of a non-contiguous input, and its mean and rstd in
``param_scalar_type(input, mixed_type)``: the input's dtype unless the weight's differs (mixed: float32);
torch 2.13's fake kernel makes them in the input's dtype in both cases (a bf16 input with fp32 weights under
CPU autocast read 2 bytes per statistic where the real kernel holds 4).
Checked call by call against torch.profiler in tests/test_cpu_scratch.py (fp32, bf16, fp64; 1 and 2
threads; contiguous and transposed inputs and gradients).
"""

from __future__ import annotations

import math

import torch

from memest.targets.cuda.workspace import Workspace
from memest.worker import modelled_threads


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _copy_if_strided(t) -> int:
    return _bytes(t) if isinstance(t, torch.Tensor) and not t.is_contiguous() else 0


def forward_scratch(args, kwargs) -> list[int]:
    return [_copy_if_strided(args[0])]


def backward_scratch(args, kwargs, nthreads: int | None = None) -> list[int]:
    dy, x, normalized_shape = args[0], args[1], args[2]
    mask = args[7] if len(args) > 7 else kwargs.get("output_mask", [True, True, True])
    threads = modelled_threads(torch.get_num_threads()) if nthreads is None else nthreads
    n = math.prod(normalized_shape)
    buffer = 2 * threads * n * x.element_size() if (mask[1] or mask[2]) else 0
    return [_copy_if_strided(x), Workspace(_copy_if_strided(dy)), Workspace(buffer)]


def backward_outputs(args, kwargs, out, make):
    """dX contiguous, as layer_norm_backward_cpu allocates it."""
    dx = out[0]
    if not isinstance(dx, torch.Tensor) or dx.is_contiguous():
        return out
    contiguous = make(torch.ops.aten.empty.memory_format, list(dx.shape), dtype=dx.dtype, device=dx.device)
    return (contiguous, *out[1:])


def forward_outputs(args, kwargs, out, make):
    """mean and rstd as layer_norm_cpu makes them for a reduced-precision input: in the input's dtype when
    the parameters share it (or there are none), in float32 when they do not (``param_scalar_type``,
    aten/src/ATen/native/mixed_type.h: a bf16 input with fp32 weights, as under CPU autocast)."""
    x = args[0]
    weight = args[2] if len(args) > 2 else kwargs.get("weight")
    bias = args[3] if len(args) > 3 else kwargs.get("bias")
    mixed = any(isinstance(p, torch.Tensor) and p.dtype != x.dtype for p in (weight, bias))
    want = torch.float32 if mixed else x.dtype
    if x.dtype not in (torch.bfloat16, torch.float16) or out[1].dtype == want:
        return out
    stats = [make(torch.ops.aten.empty.memory_format, list(t.shape), dtype=want, device=t.device) for t in out[1:]]
    return (out[0], *stats)
