"""cuDNN convolution workspaces, per call, as PyTorch allocates them.

Source: aten/src/ATen/native/cudnn/Conv_v8.cpp. ``run_conv_plan`` allocates ``plan.getWorkspaceSize()``
bytes through the caching allocator for every forward, backward-data and backward-filter call and frees
them when the call returns (the outputs are allocated before, by ConvShared.cpp). Which plan runs is
cuDNN's choice at run time:

- default (``torch.backends.cudnn.benchmark = False``): the first engine config of cuDNN's heuristics
  that builds and whose workspace can be allocated (``try_configs``: an OutOfMemoryError moves on to
  the next config, so under memory pressure cuDNN falls back to engines with less workspace);
- benchmark: ``get_plans_from_find`` keeps every plan whose workspace fits ``get_available_workspace()``
  (the largest free block: cudaMemGetInfo's free memory or the largest cached block), allocates the
  largest of them (halving on OOM), times them all, then runs the fastest (``try_plans``). The trial
  workspace is taken once per convolution shape, in the first step, and can be gigabytes.

cuDNN does not document engine workspace sizes. The expected sizes below are the pattern measured on an
H100 (cuDNN 9.19, torch 2.11, benchmarks/gpu-kernels.json, scripts/probe_cuda_kernels.py): for most
engines the workspace holds NHWC copies of the call's operands — input + output + weight for the
forward, grad-output + grad-input + weight for backward-data, input + grad-output + weight for
backward-filter — to the byte, plus 16-679 bytes, with 16-bit channels padded to a multiple of 8
(tensor-core alignment). 1x1 stride-1 convolutions and grouped/depthwise ones measured 0 in most
calls. Other engines were measured up to 9.06x these operands (a 3x3 backward-filter of a 32->64
channel CIFAR layer: 57.7 MB): the range's high end. Low is 0: cuDNN has engines without workspace and
falls back to them when the allocation fails.
"""

from __future__ import annotations

import math

import torch

from memest.targets.cuda.workspace import Workspace

HIGH_OVER_OPERANDS = 10  # measured maximum 9.06x the operand bytes (H100, cuDNN 9.19): see the module doc
CHANNEL_ALIGN_16BIT = 8  # 16-bit operands are staged with channels padded to 8 (16 bytes): stem and patch convs
SOURCE = "Conv_v8.cpp run_conv_plan; sizes measured on H100 / cuDNN 9.19 (benchmarks/gpu-kernels.json)"


def _bytes(shape, dtype: torch.dtype, channels: int | None = None) -> int:
    """Bytes of a tensor of ``shape`` (dim 1 = channels), with channels padded for 16-bit dtypes."""
    dims = list(shape)
    if channels is not None and dtype.itemsize == 2 and len(dims) > 1:
        dims[1] = math.ceil(dims[1] / CHANNEL_ALIGN_16BIT) * CHANNEL_ALIGN_16BIT
    return math.prod(dims) * dtype.itemsize


def _no_staging(weight_shape, stride, padding, groups: int) -> bool:
    """Convolutions whose measured heuristic workspace was (nearly) 0: grouped/depthwise, and 1x1
    stride-1 unpadded ones (a GEMM over the input as it lies)."""
    if groups > 1:
        return True
    pointwise = all(k == 1 for k in weight_shape[2:])
    return pointwise and all(s == 1 for s in stride) and all(p == 0 for p in padding)


def call_workspace(operands: list[int], no_staging: bool, first_call: bool, benchmark: bool) -> Workspace:
    """One cuDNN call's workspace: expected = the operands' staging copies (0 for ``no_staging``
    convolutions), low 0, high 10x the operands; with benchmark the first call of a shape also runs
    cudnnFind, whose trial workspace is bounded only by the free device memory (high None)."""
    staged = sum(operands)
    expected = 0 if no_staging else staged
    high = None if (benchmark and first_call) else HIGH_OVER_OPERANDS * staged
    why = "cudnnFind trial workspace (benchmark)" if high is None else "cuDNN engine workspace"
    return Workspace(expected, low=0, high=high, why=why)


class ConvWorkspaces:
    """CUDA_SCRATCH rules for aten.convolution / aten.convolution_backward (one instance per trace:
    with ``benchmark`` it remembers which shapes have been searched)."""

    def __init__(self, benchmark: bool = False) -> None:
        self.benchmark = benchmark
        self._searched: set[tuple] = set()

    def _first(self, key: tuple) -> bool:
        if key in self._searched:
            return False
        self._searched.add(key)
        return True

    def forward(self, args, kwargs) -> list[int]:
        x, w = args[0], args[1]
        stride, padding, _dilation, transposed, _out_pad, groups = args[3:9]
        if x.device.type == "meta" or x.dim() < 3:
            return []
        out_shape = _conv_output_shape(x, w, stride, padding, args[5], transposed, args[7], groups)
        dtype = x.dtype
        operands = [_bytes(x.shape, dtype, 1), _bytes(out_shape, dtype), _bytes(w.shape, dtype, 1)]
        key = ("fwd", tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), groups, dtype)
        ws = call_workspace(operands, _no_staging(w.shape, stride, padding, groups), self._first(key), self.benchmark)
        return [ws]

    def backward(self, args, kwargs) -> list[int]:
        """convolution_backward runs backward-data, then backward-filter (ConvShared.cpp), each with its
        own workspace freed before the next: one scratch of the larger of the two."""
        dy, x, w = args[0], args[1], args[2]
        stride, padding, groups, mask = args[4], args[5], args[9], args[10]
        dtype = x.dtype
        no_staging = _no_staging(w.shape, stride, padding, groups)
        dy_b, x_b, w_b = _bytes(dy.shape, dtype), _bytes(x.shape, dtype, 1), _bytes(w.shape, dtype, 1)
        shapes = (tuple(x.shape), tuple(w.shape), tuple(stride), tuple(padding), groups, dtype)
        calls = []
        if mask[0]:
            calls.append(call_workspace([dy_b, x_b, w_b], no_staging, self._first(("data", *shapes)), self.benchmark))
        if mask[1]:
            calls.append(call_workspace([x_b, dy_b, w_b], no_staging, self._first(("filter", *shapes)), self.benchmark))
        if not calls:
            return []
        highs = [ws.high for ws in calls]
        high = None if None in highs else max(highs)
        why = next((ws.why for ws in calls if ws.high is None), calls[0].why)
        return [Workspace(max(int(ws) for ws in calls), low=0, high=high, why=why)]


def _conv_output_shape(x, w, stride, padding, dilation, transposed, output_padding, groups) -> list[int]:
    spatial = []
    for i, size in enumerate(x.shape[2:]):
        k = (w.shape[2 + i] - 1) * dilation[i] + 1
        if transposed:
            spatial.append((size - 1) * stride[i] - 2 * padding[i] + k + output_padding[i])
        else:
            spatial.append((size + 2 * padding[i] - k) // stride[i] + 1)
    channels = w.shape[1] * groups if transposed else w.shape[0]
    return [x.shape[0], channels, *spatial]
