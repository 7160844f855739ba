"""cuDNN RNNs (nn.LSTM / nn.GRU / nn.RNN) as a CUDA run executes them, on fake CPU tensors.

On a GPU, ``aten::lstm`` / ``gru`` / ``rnn_tanh`` / ``rnn_relu`` call ``_cudnn_rnn`` when cuDNN accepts
the input (aten/src/ATen/native/RNN.cpp ``_cudnn_impl``; TensorProperties.cpp ``cudnn_is_acceptable``:
fp32, fp16 or fp64). ``_cudnn_rnn`` (aten/src/ATen/native/cudnn/RNN.cpp) returns output, hy, cy and a
*reserve* buffer that autograd saves for ``_cudnn_rnn_backward`` (with input, hx, cx, output and the
flat weights), and allocates a *workspace* for the call. On CPU the same modules run oneDNN or a
per-timestep decomposition, which saves different tensors. While :class:`CudaRnn` is active, those ops
on CPU tensors call ``_cudnn_rnn`` directly (its meta kernel gives the output shapes; autograd records
``CudnnRnnBackward0`` and saves what CUDA saves), and a meta kernel stands in for
``_cudnn_rnn_backward``, which has none.

cuDNN's reserve and workspace sizes come from cudnnGetRNNTempSpaceSizes, which documents no formula.
Measured on an H100 (cuDNN 9.19, torch 2.11; 17 shapes in benchmarks/gpu-kernels.json):

- reserve = elem x T x B x D x (L x g x H + (L-1) x H_out) + 256 bytes, g = 5 (LSTM), 6 (GRU), 1
  (RNN); with proj_size P an LSTM layer holds 5 (H + P) per step (one measured shape); this matched
  all 17 shapes to the byte.
- workspace ~ elem x 6 x T x B x H x D + 17.5 MB x L x D x H / 512, a fit: measured/fitted ranged
  0.807-2.401 over the 17 shapes (the small ones are under-fitted), kept as the range (0.80-2.41).
The backward allocates a workspace of the same size (measured equal in all 17 shapes). batch_first
inputs are transposed into contiguous copies around the call (input in the forward; input and
grad-output in the backward).
"""

from __future__ import annotations

import math
import warnings

import torch

from memest.targets.cuda.workspace import Workspace

CUDNN_MODES = {"rnn_relu": 0, "rnn_tanh": 1, "lstm": 2, "gru": 3}  # cudnnRNNMode_t (RNN.cpp)
RESERVE_PER_STEP = {0: 1, 1: 1, 2: 5, 3: 6}  # H-sized slots per step per layer in the reserve (measured)
RESERVE_EXTRA = 256  # bytes, every measured reserve
WS_PER_STEP = 6  # H-sized slots per step in the workspace (fit)
WS_PER_LAYER_AT_H512 = 17_498_624  # bytes per layer and direction at hidden 512, scaled by H / 512 (fit)
WS_RANGE = (0.80, 2.41)  # measured / fitted workspace over the 17 measured shapes: 0.807 to 2.401
CUDNN_DTYPES = (torch.float32, torch.float16, torch.float64)  # cudnn_is_acceptable
SOURCE = "cudnn/RNN.cpp _cudnn_rnn; sizes measured on H100 / cuDNN 9.19 (benchmarks/gpu-kernels.json)"


class RnnShape:
    """What the sizes depend on, from ``_cudnn_rnn`` / ``_cudnn_rnn_backward`` arguments."""

    def __init__(self, x, mode: int, hidden: int, proj: int, layers: int, batch_first: bool, bidirectional: bool,
                 batch_sizes) -> None:
        if batch_sizes:  # packed: T x B is the total number of steps
            self.steps_x_batch = x.shape[0]
        else:
            self.steps_x_batch = x.shape[0] * x.shape[1]
        self.input_size = x.shape[-1]
        self.elem = x.dtype.itemsize
        self.mode, self.hidden, self.proj, self.layers = mode, hidden, proj, layers
        self.dirs = 2 if bidirectional else 1
        self.batch_first = batch_first and not batch_sizes
        self.out = proj or hidden

    def reserve_bytes(self) -> int:
        per_layer = RESERVE_PER_STEP[self.mode] * self.hidden + (5 * self.proj if self.proj else 0)
        slots = self.layers * per_layer + (self.layers - 1) * self.out
        return self.elem * self.steps_x_batch * self.dirs * slots + RESERVE_EXTRA

    def workspace(self) -> Workspace:
        expected = (self.elem * WS_PER_STEP * self.steps_x_batch * self.hidden * self.dirs
                    + WS_PER_LAYER_AT_H512 * self.layers * self.dirs * self.hidden // 512)
        low, high = (math.floor(expected * r) for r in WS_RANGE)
        return Workspace(expected, low=low, high=high, why="cuDNN RNN workspace (fit to H100 measurements)")


def _shape(args, offset: int) -> RnnShape:
    """offset: where ``mode`` sits (6 in _cudnn_rnn, 10 in _cudnn_rnn_backward)."""
    mode, hidden, proj, layers, batch_first = args[offset:offset + 5]
    bidirectional, batch_sizes = args[offset + 7], args[offset + 8]
    return RnnShape(args[0], mode, hidden, proj, layers, batch_first, bidirectional, batch_sizes)


def forward_scratch(args, kwargs) -> list[int]:
    """_cudnn_rnn: the workspace, and the contiguous time-major copy of a batch_first input."""
    shape = _shape(args, 6)
    copies = [shape.steps_x_batch * shape.input_size * shape.elem] if shape.batch_first else []
    return [shape.workspace(), *copies]


def backward_scratch(args, kwargs) -> list[int]:
    """_cudnn_rnn_backward: the workspace (backward-data and backward-weights each allocate one, in
    turn), and for batch_first the time-major copies of input and grad-output."""
    shape = _shape(args, 10)
    copies = []
    if shape.batch_first:
        copies = [shape.steps_x_batch * shape.input_size * shape.elem,
                  shape.steps_x_batch * shape.out * shape.dirs * shape.elem]
    return [shape.workspace(), *copies]


def fix_reserve(args, kwargs, out, call):
    """_cudnn_rnn's meta kernel returns an empty reserve; a training call's real one is sized above."""
    output, hy, cy, reserve, weight_buf = out
    train = args[12]
    if not train:
        return out
    nbytes = _shape(args, 6).reserve_bytes()
    reserve = call(torch.ops.aten.empty.memory_format, [nbytes], dtype=torch.uint8, device=output.device)
    return output, hy, cy, reserve, weight_buf


class CudaRnn:
    """Context manager: while active, lstm / gru / rnn_tanh / rnn_relu on CPU tensors that cuDNN would
    take run ``_cudnn_rnn`` (registered at AutogradCPU, below CUDA autocast, which has cast them);
    others keep the composite CPU implementation. Counts calls by op."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._lib = None
        self._meta = None

    def __enter__(self) -> CudaRnn:
        self._lib = torch.library.Library("aten", "IMPL")
        self._meta = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            for name in CUDNN_MODES:
                self._lib.impl(f"{name}.input", self._rnn(name), "AutogradCPU")
            self._meta.impl("_cudnn_rnn_backward", _cudnn_rnn_backward_meta, "Meta")
        return self

    def __exit__(self, *exc) -> None:
        for lib in (self._lib, self._meta):
            if lib is not None:
                lib._destroy()
        self._lib = self._meta = None

    def _rnn(self, name: str):
        overload = getattr(torch.ops.aten, name).input

        def kernel(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
            if x.dtype not in CUDNN_DTYPES or x.numel() == 0:
                return overload.decompose(x, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                          batch_first)
            self.calls[name] = self.calls.get(name, 0) + 1
            h0, c0 = (hx[0], hx[1]) if name == "lstm" else (hx, None)
            hidden = c0.shape[-1] if c0 is not None else h0.shape[-1]
            proj = h0.shape[-1] if c0 is not None and h0.shape[-1] != hidden else 0
            stride0 = (4 if has_biases else 2) + (1 if proj else 0)
            # the module's weights are one flat buffer on a GPU (flatten_parameters): no copy is made
            weight_buf = x.new_empty(0)
            output, hy, cy, _reserve, _buf = torch.ops.aten._cudnn_rnn(
                x, list(params), stride0, weight_buf, h0, c0, CUDNN_MODES[name], hidden, proj, num_layers,
                batch_first, dropout, train, bidirectional, [], None,
            )
            return (output, hy, cy) if name == "lstm" else (output, hy)

        return kernel


def _cudnn_rnn_backward_meta(x, weight, weight_stride0, weight_buf, hx, cx, output, grad_output, grad_hy, grad_cy,
                             mode, hidden_size, proj_size, num_layers, batch_first, dropout, train, bidirectional,
                             batch_sizes, dropout_state, reserve, output_mask):
    """Shapes of _cudnn_rnn_backward's results: dx, dhx, dcx and the weight gradients, which cuDNN
    writes into one flat buffer (RNN.cpp: dw is one tensor, returned as views per weight)."""
    dx = torch.empty_like(x) if output_mask[0] else x.new_empty(0)
    dhx = torch.empty_like(hx) if output_mask[1] else hx.new_empty(0)
    dcx = torch.empty_like(cx) if (cx is not None and output_mask[2]) else x.new_empty(0)
    dws = []
    if output_mask[3]:
        flat = x.new_empty(sum(w.numel() for w in weight))
        offset = 0
        for w in weight:
            dws.append(flat[offset:offset + w.numel()].view(w.shape))
            offset += w.numel()
    return dx, dhx, dcx, dws
