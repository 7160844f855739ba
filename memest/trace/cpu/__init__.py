"""CPU kernel semantics applied while tracing --target cpu: what the real CPU kernels allocate through
the CPU allocator that their fake (meta) kernels do not show. oneDNN's LSTM workspace and scratch
(onednn_rnn.py). Rules come from ATen's, ideep's and oneDNN's sources and are checked against
torch.profiler on real runs (scripts/probe_onednn.py, benchmarks/onednn-scratch.md)."""

from __future__ import annotations

import torch

from . import onednn_rnn
from .onednn_conv import ConvScratch

aten = torch.ops.aten

# aten op -> fn(args, kwargs) -> bytes of kernel-internal buffers held while the kernel runs
CPU_SCRATCH = {
    aten.mkldnn_rnn_layer.default: onednn_rnn.forward_scratch,
    aten.mkldnn_rnn_layer_backward.default: onednn_rnn.backward_scratch,
}

# aten op -> fn(args, kwargs, out, empty) -> out: outputs the real kernel makes that the fake one does not
CPU_OUTPUTS = {
    aten.mkldnn_rnn_layer.default: onednn_rnn.forward_workspace,
    aten.mkldnn_rnn_layer_backward.default: onednn_rnn.backward_outputs,
}


def cpu_kernels(nthreads: int | None = None) -> tuple[dict, dict, ConvScratch]:
    """(scratch, outputs, conv) hooks for one trace; ``conv`` counts the convolutions it modelled."""
    conv = ConvScratch(torch.get_num_threads() if nthreads is None else nthreads)
    scratch = {
        **CPU_SCRATCH,
        aten.convolution.default: conv.forward,
        aten.convolution_backward.default: conv.backward,
    }
    return scratch, dict(CPU_OUTPUTS), conv
