"""CUDA kernel semantics that differ from the CPU kernels, for ``--target cuda`` traces on fake CPU tensors.

Three mechanisms, each undone when its trace ends:

- op replacements (``CudaKernels``, registered at the AutogradCPU key like ``sdpa.CudaSdpa``): where a
  CompositeImplicit op branches on the device, the CUDA branch is called on the CPU tensors, so autograd
  records (and saves) what it records on a GPU — dropout, torch's RMSNorm (rms_norm.py), and cuDNN RNNs (rnn.py);
- output rewrites (``CUDA_OUTPUTS``, applied by the tracker at the fake-kernel level): a CUDA kernel whose
  outputs differ from the fake (CPU/meta) kernel's in dtype or storage size — layer/batch norm statistics,
  cuDNN RNN reserve, mse_loss's reduced output;
- kernel scratch (``cuda_scratch``): buffers a CUDA kernel allocates and frees around its outputs —
  cuDNN convolution and RNN workspaces, embedding backward's sort and segment buffers, mse_loss's
  element-wise loss, flash / efficient attention backward (sdpa.py).

Every rule names its source; docs/cuda-kernels.md lists the ops checked, the ones found identical, and the
GPU evidence (benchmarks/gpu-probe.json, benchmarks/gpu-kernels.json).
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

from memest.targets.cuda.conv import ConvWorkspaces
from memest.targets.cuda.rms_norm import rms_norm as _rms_norm
from memest.targets.cuda.rnn import CudaRnn, backward_scratch, fix_reserve, forward_scratch
from memest.targets.cuda.sdpa import CUDA_SCRATCH as SDPA_SCRATCH

aten = torch.ops.aten
HALF = (torch.float16, torch.bfloat16)


# -- dropout ---------------------------------------------------------------------------------------
# aten/src/ATen/native/Dropout.cpp: dropout(input, p, train) takes the fused native_dropout when
# is_fused_kernel_acceptable (a CUDA input, 0 < p < 1, numel > 0): it saves a 1-byte bool mask
# (native_dropout_cuda, Dropout.cu). Elsewhere (CPU) _dropout_impl multiplies by a noise tensor in the
# input's dtype, which autograd saves: 4x the bytes in fp32. Feature/alpha dropout and dropout_ are not
# fused on CUDA either.
def _dropout(x, p, train):
    if not train or p == 0 or x.numel() == 0:
        return x  # _dropout_impl returns its input (torch's Python decomposition would clone it)
    if p < 1:
        return aten.native_dropout(x, p, train)[0]
    return x * x.new_zeros(())  # _dropout_impl for p == 1


# -- normalisation statistics ----------------------------------------------------------------------
def _float_stats(indices: tuple[int, ...]):
    """CUDA layer norm (layer_norm_kernel.cu: mean/rstd in acc_type, fp32 for 16-bit inputs) and batch
    norm (Normalization.cu / cudnn BatchNorm.cpp: save_mean/save_invstd in fp32 for 16-bit inputs)
    return fp32 statistics where the CPU kernels (and the fake ones here) return the input's dtype."""

    def rewrite(args, kwargs, out, call):
        if args[0].dtype not in HALF:
            return out
        out = list(out)
        for i in indices:
            t = out[i]
            if isinstance(t, torch.Tensor) and t.dtype in HALF and t.numel() > 0:
                out[i] = call(aten._to_copy.default, t, dtype=torch.float32)
        return tuple(out)

    return rewrite


# -- mse_loss --------------------------------------------------------------------------------------
# aten/src/ATen/native/Loss.cpp mse_loss_out: with a reduction, the element-wise loss goes to a temporary
# (freed after the reduction) and the result is reduced into the structured output, which the real
# kernels (CPU and CUDA) back with an input-sized storage; the meta kernel's 0-d output has 4 bytes.
# Measured on an H100 (benchmarks/gpu-kernels.json misc/mse_mean_32M): output storage 134,217,728 B and a
# 134,217,728 B temporary for a 134 MB input.
def _mse_full_output(args, kwargs, out, call):
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == 0:
        return out
    full = call(aten.empty.memory_format, [_numel(args)], dtype=out.dtype, device=out.device)
    return call(aten.as_strided.default, full, [], [])


def _mse_scratch(args, kwargs) -> list[int]:
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    return [] if reduction == 0 else [_numel(args) * args[0].dtype.itemsize]


def _numel(args) -> int:
    return math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape))


# -- embedding backward ----------------------------------------------------------------------------
EMBEDDING_DIRECT_MAX = 3072  # Embedding.cu: up to 3072 indices one kernel writes grad_weight directly
NROWS_PER_THREAD = 10  # EmbeddingBackwardKernel.cu: a segment is split into partial segments of 10 rows


def _embedding_backward_scratch(args, kwargs) -> list[int]:
    """embedding_dense_backward_cuda (Embedding.cu) above 3072 indices: sorted and original indices and
    an arange (index dtype), cub radix-sort temporaries, then embedding_backward_cuda_kernel
    (EmbeddingBackwardKernel.cu) with segment-offset arrays and grad_weight_per_segment: one fp32
    (acc_type) row per partial segment, sized for the worst case of num_indices + num_indices / 10
    partial segments. Measured (H100, 8192 indices, dim 768): 27,681,792 B = 9011 x 768 x 4 for that
    buffer, whatever the number of distinct tokens."""
    grad, indices = args[0], args[1]
    scale_grad_by_freq = args[4] if len(args) > 4 else kwargs.get("scale_grad_by_freq", False)
    n = indices.numel()
    if n <= EMBEDDING_DIRECT_MAX and not scale_grad_by_freq:
        return []
    idx = indices.dtype.itemsize
    partial = n + n // NROWS_PER_THREAD
    dim = grad.shape[-1]
    acc = 4 if grad.dtype in HALF + (torch.float32,) else grad.dtype.itemsize
    sort = 3 * n * idx + 2 * n * idx  # sorted, original, arange; cub's double buffers
    segments = 4 * n * idx + partial * idx  # segment offsets and partial-segment bookkeeping
    return [sort + segments, partial * dim * acc]


CUDA_OUTPUTS = {
    aten.native_layer_norm.default: _float_stats((1, 2)),
    aten.native_batch_norm.default: _float_stats((1, 2)),
    aten._native_batch_norm_legit.default: _float_stats((1, 2)),
    aten._native_batch_norm_legit_functional.default: _float_stats((1, 2)),
    aten._batch_norm_with_update.default: _float_stats((1, 2)),
    aten._batch_norm_with_update_functional.default: _float_stats((1, 2)),
    aten._cudnn_rnn.default: fix_reserve,
    aten.mse_loss.default: _mse_full_output,
}


def cuda_scratch(cudnn_benchmark: bool = False) -> dict:
    """aten op -> fn(args, kwargs) -> byte sizes of its CUDA kernel's scratch (a new table per trace:
    the cuDNN benchmark search happens once per convolution shape)."""
    conv = ConvWorkspaces(cudnn_benchmark)
    return {
        **SDPA_SCRATCH,
        aten.convolution.default: conv.forward,
        aten.convolution_backward.default: conv.backward,
        aten._cudnn_rnn.default: forward_scratch,
        aten._cudnn_rnn_backward.default: backward_scratch,
        aten.embedding_dense_backward.default: _embedding_backward_scratch,
        aten.mse_loss.default: _mse_scratch,
    }


class CudaKernels(contextlib.ExitStack):
    """Context manager: the CUDA branches of device-dependent composite ops (dropout, RMSNorm, cuDNN RNNs) for
    CPU tensors; ``rnn.calls`` counts the RNN calls it redirected."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = CudaRnn()

    def __enter__(self) -> CudaKernels:
        super().__enter__()
        lib = torch.library.Library("aten", "IMPL")
        self.callback(lib._destroy)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            lib.impl("dropout", _dropout, "AutogradCPU")
            lib.impl("rms_norm", _rms_norm, "AutogradCPU")  # rms_norm.py
        self.enter_context(self.rnn)
        return self
