"""nn.LSTM on CPU: what oneDNN's RNN primitive allocates that the fake kernels do not show.

On CPU, aten::lstm runs ``mkldnn_rnn_layer`` once per layer and direction (ATen
aten/src/ATen/native/mkldnn/RNN.cpp, lstm_mkldnn_stub; GRU and vanilla RNNs run as plain ATen ops,
which fake tensors see). Its fake (meta) kernel returns an empty workspace, and the kernels' internal
buffers are invisible. What the real kernels allocate through the CPU allocator (so torch.profiler
and a real process see it), from ATen's RNN.cpp, ideep's operators/lstm.hpp and oneDNN v3.x
src/cpu/rnn/{rnn_utils.hpp,rnn_utils.cpp,ref_rnn.cpp,cpu_rnn_pd.hpp}:

forward (grad mode, RNN.cpp mkldnn_rnn_layer + ideep lstm_forward_training):
  workspace (an output, saved for backward): oneDNN's training workspace, rnn_utils set_offsets
  (gates, ht, states, c states, diff states of every time step, each region page aligned);
  scratch freed on return: bias = bias_ih + bias_hh, the two weight matrices reordered to ldigo
  with a padded leading dimension (get_good_ld), and the user-mode scratchpad (ref_rnn init_scratchpad).
backward (RNN.cpp mkldnn_rnn_layer_backward + ideep lstm_backward):
  contiguous copies or zeros of the incoming gradients, bias, fp32 copies of the gradients for
  bf16/fp16, weights reordered to ldgoi when the padded leading dimension differs, zero-initialised
  diff weights (ldigo, padded) and diff bias, the scratchpad; and diff_b2 is a clone of diff_b (the
  meta kernel returns the same tensor twice).

fp32 training always uses oneDNN's reference RNN (ref_rnn.cpp init_brgemm rejects "f32 datatype in
brgemm-based implementation" for forward_training and backward), so these rules hold on any x86 CPU.
bf16 training takes the brgemm implementation on CPUs with AVX512-BF16 or AMX: other weight layouts,
per-step gates not merged (``brgemm_n_block``). Measured against torch.profiler on real runs:
scripts/probe_onednn.py, benchmarks/onednn-scratch.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LSTM_MODE = 2  # ideep::rnn_kind::LSTM (ideep abstract_types.hpp); only LSTM reaches mkldnn_rnn_layer on CPU
PAGE = 4096  # rnn_utils.cpp set_offsets: page_size, every workspace/scratch region starts on a page
SCRATCHPAD_RNN_SPACE_ALIGN = 4096  # ref_rnn.cpp init_scratchpad: key_rnn_space perf_align
SCRATCHPAD_MIN_ALIGN = 128  # memory_tracking.hpp default_alignment: each booked entry gets size + alignment
POINTER = 8  # sizeof(float *)
F32 = 4


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def good_ld(dim: int, esize: int) -> int:
    """rnn_utils.cpp get_good_ld: a leading dimension 64-byte aligned and not a multiple of 256
    elements (4K aliasing)."""
    ld = _round_up(dim, 64 // esize)
    return ld + 64 // esize if ld % 256 == 0 else ld


def _regions(sizes) -> int:
    """set_offsets' register_space: each region (zero-sized ones too) starts on a page, so a last
    empty region (ws_grid_comp, scratch_cell for LSTM) rounds the total up to a page."""
    offset = 0
    for size in sizes:
        offset = _round_up(offset, PAGE) + size
    return offset


@dataclass(frozen=True)
class LstmLayer:
    """One mkldnn_rnn_layer call: one layer, one direction (rnn_conf_t with n_layer = n_dir = 1)."""

    seq: int  # n_iter
    batch: int  # mb
    input_size: int  # slc
    hidden: int  # sic = dhc = dlc (no projection)
    esize: int  # bytes of the data type (src_layer_t = gates_t = ht_t)
    c_esize: int = F32  # bytes of the c state's data type (src_iter_c_dt)
    gates: int = 4
    n_block: int = 0  # > 0: oneDNN's brgemm RNN runs (bf16 training on CPUs with AVX512-BF16 or AMX)

    # -- oneDNN rnn_utils.hpp set_workspace_sizes / init_conf ---------------------------------
    def workspace_bytes(self) -> int:
        """Training workspace (the 4th output of mkldnn_rnn_layer), rnn_utils set_offsets."""
        t, n, h, e = self.seq, self.batch, self.hidden, self.esize
        states_ld = good_ld(max(h, self.input_size), e)
        diff_ld = good_ld(max(h, self.input_size), F32)  # gemm_acc_t is f32
        steps = 2 * (t + 1) * n  # (n_layer + 1) * n_dir * (n_iter + 1) * mb
        return _regions(
            [
                t * n * good_ld(self.gates * h, e) * e,  # ws_gates
                t * n * good_ld(h, e) * e,  # ws_ht
                steps * states_ld * e,  # ws_states_layer (= ws_states_iter)
                steps * h * self.c_esize,  # ws_states_iter_c
                steps * diff_ld * F32,  # ws_diff_states_layer
                steps * diff_ld * F32,  # ws_diff_states_iter
                steps * h * F32,  # ws_diff_states_iter_c
                0,  # ws_grid_comp (lbr GRU only)
            ]
        )

    def scratchpad_bytes(self, backward: bool) -> int:
        """The user-mode scratchpad ideep allocates per call (ref_rnn init_scratchpad)."""
        t, n, h = self.seq, self.batch, self.hidden
        # forward: scratch_t = acc (f32); backward: scratch_t = src type (ref_rnn.hpp scratch_type)
        scratch_e = self.esize if backward else F32
        # merge_gemm_layer (forward with mb < 128; backward always) keeps every step's gates
        merged = (backward or n < 128) and not self.n_block  # merge_gemm_*: never with brgemm
        space = _regions(
            [
                (t if merged else 1) * n * good_ld(self.gates * h, scratch_e) * scratch_e,  # scratch_gates
                n * good_ld(h, self.esize) * self.esize,  # scratch_ht
                n * good_ld(h, F32) * F32,  # scratch_diff_ht (training)
                0,  # scratch_cell (GRU only)
            ]
        )
        pointers = 1  # ptr_wei_sz = n_layer * n_dir * max_nparts (1 for LSTM)
        booked = space + SCRATCHPAD_RNN_SPACE_ALIGN  # key_rnn_space
        booked += 3 * (POINTER * pointers + SCRATCHPAD_MIN_ALIGN)  # ptrs_wei_layer / _iter / _projection
        # ptrs_bia: nelems = ptr_wei_sz * bias dt size; the bias is in the weights' (= the input's) dtype, as
        # _shuffle_bias builds it (bf16 LSTMs book 2 per pointer: measured 16 B below f32's on an AVX-512 CPU
        # without BF16, tests/test_cpu_scratch.py::test_bf16_lstm_kernels_are_close)
        booked += POINTER * pointers * self.esize + SCRATCHPAD_MIN_ALIGN
        return booked

    def ldigo_bytes(self, rows: int, esize: int) -> int:
        """Weights (rows x gates*hidden) in ldigo with the padded leading dimension (set_good_strides)."""
        return rows * good_ld(self.gates * self.hidden, esize) * esize

    def forward_weights_bytes(self, rows: int, esize: int) -> int:
        """The forward's weights layout: ldigo with the padded leading dimension, or for brgemm
        ldgOI{n_block}o2i (rnn_utils set_expected_desc: output channels in n_block blocks, input pairs)."""
        if self.n_block:
            return self.gates * _round_up(self.hidden, self.n_block) * _round_up(rows, 2) * esize
        return self.ldigo_bytes(rows, esize)

    def backward_weights_reorder_bytes(self, rows: int) -> int:
        """The backward's weights layout: ldgoi with the padded leading dimension (a reorder only when
        the padding changes it), or for brgemm ldgIO32i2o (always reordered)."""
        if self.n_block:
            return self.gates * _round_up(rows, 32) * _round_up(self.hidden, 2) * self.esize
        return self.ldgoi_reorder_bytes(rows)

    def ldgoi_reorder_bytes(self, rows: int) -> int:
        """Backward wants ldgoi with the leading dimension padded; PyTorch's (4H, rows) weight is ldgoi
        unpadded, so it is reordered only when the padding changes it."""
        ld = good_ld(rows, self.esize)
        return 0 if ld == rows else self.gates * self.hidden * ld * self.esize


def _layer(input: torch.Tensor, hidden_size: int, cx: torch.Tensor | None) -> LstmLayer:
    # RNN.cpp RNNParams: input is (seq, batch, features) -- mkldnn_rnn transposes batch_first input
    # before calling the layer, so input.size(0) is the sequence either way
    return LstmLayer(
        seq=input.shape[0],
        batch=input.shape[1],
        input_size=input.shape[2],
        hidden=hidden_size,
        esize=input.element_size(),
        c_esize=cx.element_size() if cx is not None else F32,
        n_block=brgemm_n_block(input.dtype, hidden_size),
    )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def forward_scratch(args, kwargs) -> list[int]:
    """Bytes mkldnn_rnn_layer holds while it runs besides output, hy and cy. The workspace is among
    them: the tracker frees the scratch when the kernel returns and :func:`forward_workspace` then
    makes the workspace output of the same size, so the peak inside the op and the bytes kept after
    it are the real ones."""
    input, w0, w2 = args[0], args[1], args[3]
    mode, hidden_size, has_biases = args[9], args[10], args[12]
    if mode != LSTM_MODE or not torch.is_grad_enabled():
        return []  # inference (lstm_forward_inference) may pack weights: not modelled
    layer = _layer(input, hidden_size, args[6])
    wsize = w0.element_size()
    bias = _nbytes(w2) if has_biases else layer.gates * hidden_size * wsize  # bias_ih + bias_hh, or zeros
    return [
        bias,
        layer.workspace_bytes(),
        layer.forward_weights_bytes(layer.input_size, wsize),  # weights_layer reordered
        layer.forward_weights_bytes(hidden_size, wsize),  # weights_iter reordered
        layer.scratchpad_bytes(backward=False),
    ]


def forward_workspace(args, kwargs, out, empty):
    """mkldnn_rnn_layer's 4th output is oneDNN's training workspace (kept for backward); the meta
    kernel returns it empty."""
    input, mode, hidden_size = args[0], args[9], args[10]
    if mode != LSTM_MODE or not torch.is_grad_enabled():
        return out
    workspace = empty([_layer(input, hidden_size, args[6]).workspace_bytes()], torch.uint8)
    return (out[0], out[1], out[2], workspace)


forward_workspace.late = (3,)


def backward_scratch(args, kwargs) -> list[int]:
    """Bytes mkldnn_rnn_layer_backward allocates and frees besides its outputs."""
    input, w0, w2 = args[0], args[1], args[3]
    hx, cx, output = args[5], args[6], args[7]
    grad_out, grad_hy, grad_cy = args[10], args[11], args[12]
    mode, hidden_size, has_biases = args[14], args[15], args[17]
    if mode != LSTM_MODE or (grad_out is None and grad_hy is None and grad_cy is None):
        return []
    layer = _layer(input, hidden_size, cx)
    sizes = []
    # grad_output.contiguous() / zeros_like(output); grad_hy, grad_cy likewise
    for grad, like in ((grad_out, output), (grad_hy, hx), (grad_cy, cx)):
        if grad is None:
            sizes.append(_nbytes(like))
        elif not grad.is_contiguous():
            sizes.append(_nbytes(grad))
    wsize = w0.element_size()
    sizes.append(_nbytes(w2) if has_biases else layer.gates * hidden_size * wsize)  # _shuffle_bias / zeros
    if hx.untyped_storage() is cx.untyped_storage():
        sizes.append(_nbytes(cx))  # at::clone(cx_tmp)
    if input.dtype != torch.float32:  # grad_y_, grad_hy_, grad_cy_ converted to f32
        sizes += [_nbytes(output) // output.element_size() * F32, 2 * _nbytes(hx) // hx.element_size() * F32]
    sizes += [
        layer.backward_weights_reorder_bytes(layer.input_size),  # weights_layer to the backward's layout
        layer.backward_weights_reorder_bytes(hidden_size),  # weights_iter
        layer.ldigo_bytes(layer.input_size, F32),  # expected_diff_weights_layer.zero_init (ldigo, f32)
        layer.ldigo_bytes(hidden_size, F32),  # expected_diff_weights_iter
        layer.gates * hidden_size * F32,  # expected_diff_bias
        layer.scratchpad_bytes(backward=True),
    ]
    return sizes


def backward_outputs(args, kwargs, out, empty):
    """diff_b2 is ``at::clone(diff_b_)`` in the real kernel, its own storage made after the scratch
    is freed; the meta kernel returns diff_b twice."""
    return (*out[:4], empty(list(out[3].shape), out[3].dtype), *out[5:])


backward_outputs.late = (4,)  # the meta kernel returns diff_b twice; with FakeTensorMode's cache, two storages


def brgemm_n_block(dtype: torch.dtype, hidden: int) -> int:
    """0 when oneDNN trains the LSTM with its reference RNN; else the brgemm RNN's output-channel block.
    ref_rnn.cpp init_brgemm: training takes brgemm only for bf16 (f32 is rejected) and needs
    avx512_core_bf16 (or AMX); rnn_brgemm_utils.cpp brgemm_calc_n_block: 64 on AMX when the hidden size
    divides by 64, else 2 * 16 fp32 lanes. The brgemm kernels' own small buffers (batch elements,
    blocked gates for the backward: a few KB per call) are not modelled."""
    if dtype != torch.bfloat16:
        return 0
    amx = torch.cpu._is_amx_tile_supported()
    if not (amx or torch.cpu._is_avx512_bf16_supported()):
        return 0
    return 64 if amx and hidden % 64 == 0 else 32
