"""CPU kernel semantics applied while tracing --target cpu: what the real CPU kernels allocate through
the CPU allocator that their fake (meta) kernels do not show: oneDNN's LSTM workspace and scratch
(onednn_rnn.py), the layout buffers and scratchpads of oneDNN convolutions (onednn_conv.py),
mse_loss's input-sized result storage (aten_losses.py), and layer norm's contiguous copies, reduction
buffer and contiguous input gradient (aten_norms.py), the float32 copies of the emulated float8 matmul
(aten_scaled_mm.py), and mixed-dtype arithmetic's common-dtype copies (aten_binary.py).
Rules come from ATen's, ideep's and oneDNN's sources and are checked against torch.profiler on real
runs, kernel by kernel (validate/op_truth.py, scripts/probe_onednn.py, benchmarks/onednn-scratch.md)."""

from __future__ import annotations

import os

import torch

from memest.spec.choices import Mode
from memest.targets.cpu import aten_binary, aten_losses, aten_norms, aten_scaled_mm, onednn_rnn
from memest.targets.cpu.onednn_conv import ConvScratch
from memest.units import format_bytes
from memest.worker import modelled_threads

aten = torch.ops.aten

# aten op -> fn(args, kwargs) -> bytes of kernel-internal buffers held while the kernel runs
CPU_SCRATCH = {
    aten.mkldnn_rnn_layer.default: onednn_rnn.forward_scratch,
    aten.mkldnn_rnn_layer_backward.default: onednn_rnn.backward_scratch,
    aten.mse_loss.default: aten_losses.mse_loss_scratch,
    aten.native_layer_norm.default: aten_norms.forward_scratch,
    aten.native_layer_norm_backward.default: aten_norms.backward_scratch,
    aten._scaled_mm.default: aten_scaled_mm.scaled_mm_scratch,
    **dict.fromkeys(aten_binary.OUT_OF_PLACE, aten_binary.common_dtype_scratch),
    **dict.fromkeys(aten_binary.IN_PLACE, aten_binary.in_place_scratch),
}

# aten op -> fn(args, kwargs, out, empty) -> out: outputs the real kernel makes that the fake one does not
CPU_OUTPUTS = {
    aten.mkldnn_rnn_layer.default: onednn_rnn.forward_workspace,
    aten.mkldnn_rnn_layer_backward.default: onednn_rnn.backward_outputs,
    aten.mse_loss.default: aten_losses.mse_loss_output,
    aten.native_layer_norm.default: aten_norms.forward_outputs,
    aten.native_layer_norm_backward.default: aten_norms.backward_outputs,
}

CONV_ISA = "AVX512"  # the ATen CPU capability whose oneDNN convolution choices onednn_conv.py encodes


def conv_modelled() -> bool:
    """oneDNN picks convolution implementations (and so layouts) by ISA; memest's rules are for
    AVX-512 (oneDNN's avx512_core), unless oneDNN is capped below it (ONEDNN_MAX_CPU_ISA)."""
    capped = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "ALL")).upper()
    return torch.backends.cpu.get_cpu_capability() == CONV_ISA and (
        capped == "ALL" or "AVX512" in capped or "AVX10" in capped or "AMX" in capped
    )


def onednn_half_matmul() -> bool:
    """Whether this CPU runs bf16/fp16 matmuls through oneDNN (ATen mkldnn/Matmul.cpp use_mkldnn_bf16_matmul /
    use_mkldnn_fp16_matmul: oneDNN enabled and its bf16/fp16 device check, AVX-512 class CPUs and AMX): those
    kernels reorder operands and use scratchpads through the CPU allocator, which memest does not model (measured on
    an Intel Xeon with AMX, torch 2.13: 26 KiB to 3 MiB per bf16 call; none for fp32, which stays on MKL's sgemm)."""
    return bool(torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
                and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class HalfMatmuls:
    """Counts the bf16/fp16 matmuls of a trace on a CPU where oneDNN runs them (their scratch is not modelled)."""

    OPS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default)

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, args, kwargs) -> list[int]:
        if any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args[:3]):
            self.calls += 1
        return []


def cpu_kernels(nthreads: int | None = None) -> tuple[dict, dict, ConvScratch]:
    """(scratch, outputs, conv) hooks for one trace; ``conv`` counts the convolutions it modelled.
    ``nthreads``: oneDNN's thread count (some scratchpads are per thread), this process's by default."""
    conv = ConvScratch(modelled_threads(torch.get_num_threads()) if nthreads is None else nthreads)
    scratch = dict(CPU_SCRATCH)
    if conv_modelled():
        scratch[aten.convolution.default] = conv.forward
        scratch[aten.convolution_backward.default] = conv.backward
    return scratch, dict(CPU_OUTPUTS), conv


def cpu_notes(trace, conv: ConvScratch, mode: str) -> list[str]:
    """One line per kind of kernel scratch memest added to (or could not add to) this trace."""
    notes = []
    workspaces = [r.nbytes for r in trace.storages if r.op == "mkldnn_rnn_layer.default (kernel output)"]
    lstm_calls = sum(1 for r in trace.storages if r.op in ("mkldnn_rnn_layer.default", "lstm.input"))
    if workspaces:
        notes.append(
            f"nn.LSTM (oneDNN, CPU): training workspace kept for backward ({len(workspaces)} layer calls, up to "
            f"{format_bytes(max(workspaces))} each) and kernel scratch modelled from ATen RNN.cpp, ideep lstm.hpp and "
            "oneDNN rnn_utils (fp32 rules; bf16/fp16 LSTMs may run oneDNN's brgemm RNN, whose scratch differs)"
        )
    elif lstm_calls and mode != Mode.TRAIN:
        notes.append(
            "nn.LSTM inference (oneDNN, CPU): the kernel's scratchpad (every time step's states) is not modelled; "
            "the estimate is low for LSTMs"
        )
    modelled = sum(conv.calls.values())
    if modelled:
        unknown = sum(conv.unknown.values())
        line = (
            f"convolutions (oneDNN, CPU): layout reorders, blocked outputs, dense copies and scratchpads modelled "
            f"for {modelled} kernel passes (AVX-512 fp32 rules, {conv.nthreads} threads)"
        )
        if unknown:
            names = ", ".join(sorted({name.split()[0] for name in conv.unknown}))
            line += (
                f"; {unknown} passes ({names}) also use a scratchpad memest leaves out "
                "(0.2 to 540 KiB per call on the measured grid: benchmarks/onednn-scratch.md)"
            )
        notes.append(line)
    if conv.skipped:
        notes.append(
            f"{conv.skipped} convolution calls on a non-oneDNN backend, 3d channels-last, or not fp32: kernel scratch not modelled"
        )
    return notes
