"""Convolutions on CPU: the buffers ATen and oneDNN (through ideep) allocate inside aten::convolution
and aten::convolution_backward that the fake kernels do not show.

ATen picks the backend (aten/src/ATen/native/Convolution.cpp, _select_conv_backend; asked here
through torch._C._select_conv_backend, the same C++ function). For the Mkldnn backends
(aten/src/ATen/native/mkldnn/Conv.cpp) the real kernels allocate, through the CPU allocator:

- copies: ``input/weight.contiguous(memory_format)`` (1d convolutions run as 2d with H = 1; 3d ones as
  oneDNN's 5d problems, a depth beside H and W; ``grad_output.contiguous`` in backward), in the channels-last
  format when the input or the weight is channels-last (mkldnn_conv_use_channels_last);
- per oneDNN primitive (ideep operators/conv.hpp): the user-mode scratchpad, the inputs reordered to
  the layout the primitive's implementation asks for (``reorder_if_differ_in``), and its output
  (dst, diff_src, diff_weights, diff_bias) in that layout;
- for NCHW tensors the result copied back to a dense tensor (``mkldnn_to_dense``); for channels-last
  the output is allocated by ATen and the primitive writes into it.

Which implementation oneDNN runs, and so the layouts (16-channel blocks with zero padding, NHWC,
plain) and the scratchpad, is oneDNN's runtime choice (src/cpu/cpu_convolution_list.cpp: the first
implementation whose init_conf accepts the problem). :func:`implementation` encodes that choice for
fp32 on AVX-512 CPUs (oneDNN v3.x: jit_avx512_common_{convolution,1x1_convolution,dw_convolution},
gemm_convolution, brgemm convolutions), the ISA memest is validated on; scratchpads are modelled
where their size follows from the problem (gemm im2col and weight-reduction buffers, padded bias),
otherwise left out (a few KB to a few hundred KB per call; scripts/probe_onednn.py measures them).

3d convolutions take the same implementations on 5d problems (measured with ONEDNN_VERBOSE, oneDNN v3.12 in
torch 2.13, tests/test_cpu_scratch.py CONVS_3D), with these differences: jit_uni_dw takes no 5d problem (depthwise
runs brdgmm_dw on NDHWC forward and gemm backward), jit_avx2 bwd_weights none with depth padding, brgemm bwd_data
none whose output plane is 1x1 (jit_avx512_common runs it: Qwen2-VL's patch embedding), gemm's im2col one output
depth slice at a time. 3d channels-last (NDHWC brgemm) is not modelled.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

SIMD = 16  # fp32 lanes of an AVX-512 register: oneDNN's channel block on avx512_core
SCRATCH_ALIGN = 128  # memory_tracking.hpp default_alignment: every booked scratchpad entry adds it
F32 = 4
MKLDNN = 8  # ConvBackend::Mkldnn (torch._C._ConvBackend)
MKLDNN_TRANSPOSE = 9  # ConvBackend::MkldnnTranspose (missing from the Python enum's names)


def _rnd(x: int, m: int) -> int:
    return (x + m - 1) // m * m


@dataclass(frozen=True)
class ConvProblem:
    """A convolution as oneDNN sees it: 1d is viewed as 2d with H = 1, 3d has a depth (``id``/``od``/``kd``/``sd``,
    1 otherwise); for transposed convolutions (deconvolution) ``i*`` is the convolution's output side, as oneDNN
    stores it."""

    mb: int
    groups: int
    icg: int  # input channels per group
    ocg: int  # output channels per group
    ih: int
    iw: int
    oh: int
    ow: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dilated: bool
    bias: bool
    nxc: bool  # channels-last path
    esize: int
    ndims: int = 4  # oneDNN's: 4 for 1d and 2d convolutions, 5 for 3d
    id: int = 1
    od: int = 1
    kd: int = 1
    sd: int = 1
    pd: int = 0

    @property
    def ic(self) -> int:
        return self.groups * self.icg

    @property
    def oc(self) -> int:
        return self.groups * self.ocg

    @property
    def ks(self) -> int:
        return self.kd * self.kh * self.kw

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.icg == 1 and self.ocg == 1

    def src(self, block: int = 1) -> int:
        """Bytes of the input side with channels padded to ``block``."""
        return self.mb * _rnd(self.ic, block) * self.id * self.ih * self.iw * self.esize

    def dst(self, block: int = 1) -> int:
        return self.mb * _rnd(self.oc, block) * self.od * self.oh * self.ow * self.esize

    def weights(self) -> int:
        return self.oc * self.icg * self.ks * self.esize


@dataclass(frozen=True)
class Primitive:
    """One oneDNN primitive's buffers: bytes of its input layouts when they differ from the user's
    (0: used in place), of its output layout, and of its scratchpad."""

    name: str
    src: int = 0  # forward: src; backward_data: diff_dst; backward_weights: src
    src2: int = 0  # backward_weights: diff_dst
    weights: int = 0  # weights reorder (forward, backward_data)
    out: int = 0  # dst / diff_src / diff_weights in the primitive's layout
    scratchpad: int = 0
    known: bool = True  # False: an implementation (or its scratchpad) memest does not model
    nhwc_out: bool = False  # out is NHWC for an NCHW user: mkldnn_to_dense copies it twice (below)


def _padded_bias(p: ConvProblem) -> int:
    """jit kernels' key_conv_padded_bias: the bias copied to a channel count padded to the block."""
    if not p.bias or p.oc % SIMD == 0:
        return 0
    return _rnd(p.oc, SIMD) * p.esize + SCRATCH_ALIGN


def _blocked_weights(p: ConvProblem, o_block: int, i_block: int) -> int:
    return p.groups * _rnd(p.ocg, o_block) * _rnd(p.icg, i_block) * p.ks * p.esize


def _lower_simd(p: ConvProblem) -> int | None:
    """jit_avx512_common init_conf ok_to_try_lower_zmm: grouped convolutions whose channels per group
    are not multiples of 16 use 8- or 4-channel blocks; None when neither divides (no jit kernel)."""
    for simd in (SIMD, 8, 4):
        if p.icg % simd == 0 and p.ocg % simd == 0:
            return simd
    return None


def _gemm_col(p: ConvProblem) -> int:
    """gemm_convolution_utils.cpp: im2col buffer (ic * ks * os floats per thread, os = oh * ow: a 3d
    convolution's im2col runs one output depth slice at a time) unless the convolution is 1x1 with unit stride."""
    unit = p.ks == 1 and p.sd == p.sh == p.sw == 1 and p.id == p.od and p.ih == p.oh and p.iw == p.ow
    return 0 if unit else p.icg * p.ks * p.oh * p.ow


def _book(*sizes: int) -> int:
    return sum(size + SCRATCH_ALIGN for size in sizes if size > 0)


def gemm_bwd_weights(p: ConvProblem, nthr: int) -> Primitive:
    """gemm_convolution_bwd_weights (ncsp): outer threading when os / nthr < 256 and mb > 1; books
    key_conv_wei_reduction = nthr * weights_d.size() *floats* (the size in bytes, as oneDNN v3.x
    books it, 4x the bytes needed) and key_conv_gemm_col = nthr * im2col_sz floats."""
    outer = p.oh * p.ow / nthr < 256 and (p.mb != 1 or p.groups > 2)
    threads = nthr if outer else 1
    scratch = _book(threads * p.weights() * F32, threads * _gemm_col(p) * F32)
    return Primitive("gemm bwd_weights", out=p.weights(), scratchpad=scratch)


def gemm_fwd_or_bwd_data(p: ConvProblem, nthr: int, name: str) -> Primitive:
    """gemm_convolution (ncsp) forward / backward_data: im2col buffer per thread; the forward may
    block the spatial dimension (a smaller buffer), so this is its upper bound."""
    return Primitive(
        name, out=p.dst() if name.endswith("fwd") else p.src(), scratchpad=_book(nthr * _gemm_col(p) * F32)
    )


BARRIER = 4096  # simple_barrier::ctx_t: STRUCT_ALIGN(CTX_ALIGNMENT = 4096) (x64/cpu_barrier.hpp)
PAGE = 4096  # PAGE_4K: the bias reducer's space alignment (x64/cpu_reducer.cpp)
MIN_OH_REDUCE = 9  # jit_avx512_common_conv_bwd_weights_kernel_f32_t::min_oh_reduce


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _jit_bwd_weights_threads(p: ConvProblem, nthr: int, ic_block: int) -> tuple[int, int]:
    """(nthr_mb, threads used): jit_avx512_common_conv_bwd_weights_kernel_f32_t::balance, the search
    for the split over minibatch / groups / channel blocks with the least memory, then compute, cost."""
    if nthr < p.groups:  # "simplification... fortunately it doesn't hurt much"
        return 1, nthr
    nthr_g = p.groups
    per_g = nthr // nthr_g
    nb_ic, nb_oc = _div_up(p.icg, ic_block), _div_up(p.ocg, SIMD)
    # harness_2d_reduction (4d only; 5d runs harness_3d_reduction, which splits like the minibatch one)
    reduce_2d = p.ndims == 4 and not p.dilated and p.oh > MIN_OH_REDUCE and not p.nxc
    ih_reduce, oh_reduce = (p.ih, p.oh) if reduce_2d else (1, 1)
    ih_keep, oh_keep = (1, 1) if reduce_2d else (p.ih, p.oh)
    nthr_oh_reduce = max(1, oh_reduce // MIN_OH_REDUCE)

    def mem_cost(mb: int, ocb: int, icb: int) -> int:
        src = _div_up(p.mb * ih_reduce, mb) * _div_up(p.groups, nthr_g) * _div_up(nb_ic, icb) * ic_block
        src = src * ih_keep * p.iw * p.id // p.sd // p.sh // p.sw
        dst = _div_up(p.mb * oh_reduce, mb) * _div_up(p.groups, nthr_g) * _div_up(nb_oc, ocb) * SIMD * oh_keep * p.ow
        dst *= p.od
        wei = 8 * _div_up(p.groups, nthr_g) * _div_up(nb_oc, ocb) * _div_up(nb_ic, icb) * p.ks * ic_block * SIMD
        return src + dst + wei

    def comp_cost(mb: int, ocb: int, icb: int) -> int:
        return _div_up(p.mb * oh_reduce, mb) * _div_up(p.groups, nthr_g) * _div_up(nb_oc, ocb) * _div_up(nb_ic, icb)

    best = (1, 1, 1)
    best_mem = mem_cost(*best)
    nthr_mb_max = min(per_g, p.mb * p.od * nthr_oh_reduce)
    splits = []
    for mb in range(1, nthr_mb_max + 1):
        par = per_g // mb
        for ocb in range(1, min(par, nb_oc) + 1):
            splits.append((mb, ocb, min(par // ocb, nb_ic)))
    for split in splits:  # step 1: least memory
        cost = mem_cost(*split)
        if cost <= best_mem:
            best_mem, best = cost, split
    best_comp = comp_cost(*best)
    for split in splits:  # step 2: less compute within 110% of that memory, or 25% less compute
        cost, comp = mem_cost(*split), comp_cost(*split)
        if (comp <= best_comp and cost < 1.1 * best_mem) or 4 * comp <= 3 * best_comp:
            best_comp, best = comp, split
    nthr_mb, ocb, icb = best
    if nthr // 2 < nthr_mb < nthr:
        nthr_mb = min(p.mb * p.od * nthr_oh_reduce, nthr)
    return nthr_mb, nthr_mb * nthr_g * ocb * icb


def _bias_reducer(p: ConvProblem, nthr: int) -> int:
    """cpu_reducer_t (x64/cpu_reducer.cpp) for diff_bias: reduce_balancer_t(nthr, oc_block,
    groups * nb_oc, mb, nthr * 3 * 5 * 5 * 16 * 16, lock_free) and the space it books."""
    job, njobs, reduction = SIMD, p.groups * _div_up(p.ocg, SIMD), p.mb
    max_buffer = nthr * 3 * 5 * 5 * 16 * 16
    min_per_group = max(1, njobs // nthr)
    max_per_group = max(1, max_buffer // (nthr * job))
    ngroups = min(njobs // min_per_group, nthr)
    per_group = min(nthr // ngroups, reduction)
    ub = _div_up(njobs, ngroups)
    complexity = njobs * job * reduction
    for c in range(min_per_group, njobs):
        c_groups = min(njobs // c, nthr)
        c_per_group = min(nthr // c_groups, reduction)
        c_ub = _div_up(njobs, c_groups)
        if c_per_group > 1 and c_ub > max_per_group:
            continue
        c_complexity = job * c_ub * (_div_up(reduction, c_per_group) + (c_per_group != 1))
        if c_complexity < complexity:
            ngroups, per_group, ub, complexity = c_groups, c_per_group, c_ub, c_complexity
    if per_group == 1:
        return 0
    space = ngroups * (per_group - 1) * ub * job * F32
    return space + PAGE + ngroups * BARRIER + BARRIER  # key_reducer_space (PAGE_4K), one barrier per group


def jit_bwd_weights(p: ConvProblem, nthr: int, name: str, ic_block: int, src: int, src2: int) -> Primitive:
    """jit_avx512_common_convolution_bwd_weights: diff weights blocked 16x16 (or Ohwi16o); scratchpad
    (kernel init_scratchpad + the pd's bias reducer): with nthr_mb > 1 threads splitting the
    minibatch, (nthr_mb - 1) private copies of the weights + bias and a barrier; the bias padded to
    16 channels; the bias reducer."""
    nthr_mb, used = _jit_bwd_weights_threads(p, nthr, ic_block)
    wei = p.groups * _rnd(p.ocg, SIMD) * _rnd(p.icg, ic_block) * p.ks
    bia = p.groups * _rnd(p.ocg, SIMD)
    scratch = _book((wei + bia) * (nthr_mb - 1) * F32) + (2 * BARRIER if nthr_mb > 1 else 0)
    if p.bias:
        if p.ocg % SIMD:
            scratch += _book(bia * F32)  # key_conv_padded_bias
        scratch += _bias_reducer(p, used)
    return Primitive(name, src=src, src2=src2, out=wei * p.esize, scratchpad=scratch)


def _best_divider(value: int, lo: int, hi: int, find_max: bool) -> int:
    """jit_uni_1x1_conv_utils.hpp best_divider: the chunk in [lo, hi] that pads ``value`` least."""
    hi = max(1, min(hi, value))
    lo = max(1, min(lo, hi))
    best, best_loss = hi, float("inf")
    for divider in range(hi, lo - 1, -1):
        padded = _rnd(value, divider)
        loss = (padded - value) / padded
        if (find_max and loss < best_loss) or (not find_max and loss <= best_loss):
            best, best_loss = divider, loss
    return best


def jit_1x1_bwd_weights(p: ConvProblem, nthr: int) -> Primitive:
    """jit_avx512_common_1x1_convolution_bwd_weights (unit stride): its balance() over minibatch x
    spatial chunks and channel blocks, then init_scratchpad: the bias padded to 16 channels,
    (nthr_mb - 1) private weight copies and a barrier, and the pd's bias reducer."""
    oc, ic = _rnd(p.ocg, SIMD), _rnd(p.icg, SIMD)
    wei = p.groups * oc * ic
    nthr_mb, used = 1, 1
    if nthr >= p.groups:
        reduce_dim = p.id * p.ih * p.iw  # jcp.is
        reduce_block = _best_divider(reduce_dim, 7, 16, True)
        if reduce_dim % reduce_block:
            reduce_block = _best_divider(p.iw, 4, p.iw, False)
        if reduce_block > 256:
            reduce_block = 1
        nb_reduce, nb_load, nb_bcast = _div_up(reduce_dim, reduce_block), oc // SIMD, ic // SIMD
        per_g = nthr // p.groups

        def mem_cost(mb: int, ocb: int, icb: int) -> int:
            bcast = _div_up(p.mb * nb_reduce, mb) * _div_up(nb_bcast, icb) * SIMD * reduce_block // p.sh // p.sw
            load = _div_up(p.mb * nb_reduce, mb) * _div_up(nb_load, ocb) * SIMD * reduce_block
            return bcast + load + 12 * _div_up(nb_load, ocb) * _div_up(nb_bcast, icb) * SIMD * SIMD

        best, best_cost = (1, 1, 1), mem_cost(1, 1, 1)
        for mb in range(1, min(per_g, p.mb * nb_reduce) + 1):
            par = per_g // mb
            for ocb in range(1, min(par, nb_load) + 1):
                icb = min(par // ocb, nb_bcast)
                cost = mem_cost(mb, ocb, icb)
                if cost <= best_cost:
                    best, best_cost = (mb, ocb, icb), cost
        nthr_mb, ocb, icb = best
        if nthr // 2 < nthr_mb < nthr:
            nthr_mb = min(p.mb, nthr)
        used = nthr_mb * p.groups * ocb * icb
    scratch = _book(wei * (nthr_mb - 1) * F32) + (2 * BARRIER if nthr_mb > 1 else 0)
    if p.bias:
        if p.ocg % SIMD:
            scratch += _book(p.groups * oc * F32)  # key_conv_padded_bias
        scratch += _bias_reducer(p, used)
    return Primitive("jit_1x1 bwd_weights", src=p.src(SIMD), src2=p.dst(SIMD), out=wei * p.esize, scratchpad=scratch)


# -- which implementation runs (AVX-512, fp32) ----------------------------------------------------
def _nxc_grouped_weights(p: ConvProblem) -> int:
    """gOIhw{16,8,4}i{..}o on NHWC data: the block (ok_to_try_lower_zmm: 8 or 4 when both channel
    counts per group are below 16 and divide by it), channels per group padded to it."""
    simd = SIMD
    if p.icg < SIMD and p.ocg < SIMD:
        simd = next((b for b in (8, 4) if p.icg % b == 0 and p.ocg % b == 0), SIMD)
    return _blocked_weights(p, simd, simd)


def forward(p: ConvProblem, nthr: int) -> Primitive:
    if p.nxc:  # src/dst are the user's NHWC tensors; weights in a brgemm layout
        if p.depthwise:  # brdgmm_dw_convolution_fwd: weights debcA16a
            return Primitive("brdgmm_dw fwd", weights=_rnd(p.groups, SIMD) * p.ks * p.esize)
        if p.groups > 1:  # jit_avx512_common on NHWC: per-group channels padded in the weights only
            return Primitive("jit grouped fwd (nhwc)", weights=_nxc_grouped_weights(p))
        # brgemm_convolution_fwd: weights Acdb{16,32,48,64}a, the block from its cost model: at least
        # 16-channel padding; its batch-element scratchpad is not modelled
        return Primitive("brgconv fwd", weights=_blocked_weights(p, SIMD, 1), known=False)
    if p.depthwise and p.ndims == 5:
        # jit_uni_dw takes no 5d problem: brdgmm_dw on NDHWC (src reordered, weights defbcA16a, dst NDHWC copied
        # back twice), measured (oneDNN v3.12, ONEDNN_VERBOSE, tests/test_cpu_scratch.py)
        return Primitive(
            "brdgmm_dw fwd (ncdhw)", src=p.src(), weights=_rnd(p.groups, SIMD) * p.ks * p.esize, out=p.dst(),
            nhwc_out=True,
        )
    if p.depthwise:  # jit_uni_dw: nChw16c, Goihw16g
        return Primitive(
            "jit_dw fwd",
            src=p.src(SIMD),
            weights=_rnd(p.groups, SIMD) * p.ks * p.esize,
            out=p.dst(SIMD),
            scratchpad=_padded_bias(p),
        )
    if p.groups == 1 and p.icg < SIMD:  # is_1stconv: src stays plain, weights Ohwi16o
        return Primitive(
            "jit 1st fwd", weights=_blocked_weights(p, SIMD, 1), out=p.dst(SIMD), scratchpad=_padded_bias(p)
        )
    if p.groups == 1:  # jit / jit_1x1: channels padded to 16 (ok_to_pad_channels)
        name = "jit_1x1 fwd" if p.ks == 1 else "jit fwd"
        strided_1x1 = p.ks == 1 and (p.sh > 1 or p.sw > 1)  # rtus buffer not modelled
        return Primitive(
            name,
            src=p.src(SIMD),
            weights=_blocked_weights(p, SIMD, SIMD),
            out=p.dst(SIMD),
            scratchpad=_padded_bias(p),
            known=not strided_1x1,
        )
    simd = _lower_simd(p)
    if simd is None:
        return gemm_fwd_or_bwd_data(p, nthr, "gemm fwd")
    return Primitive("jit grouped fwd", src=p.src(simd), weights=p.weights(), out=p.dst(simd))


def backward_data(p: ConvProblem, nthr: int) -> Primitive:
    strided = p.sh > 1 or p.sw > 1
    if p.depthwise and (p.dilated or p.ndims == 5):  # jit_uni_dw bwd_data takes no dilation, no 5d: gemm
        return gemm_fwd_or_bwd_data(p, nthr, "gemm bwd_data")
    if p.depthwise:  # jit_uni_dw bwd_data (nChw16c, or NHWC in place)
        if p.nxc:
            return Primitive("jit_dw bwd_data", weights=_rnd(p.groups, SIMD) * p.ks * p.esize)
        return Primitive(
            "jit_dw bwd_data", src=p.dst(SIMD), weights=_rnd(p.groups, SIMD) * p.ks * p.esize, out=p.src(SIMD)
        )
    # 5d with a 1x1 output plane: brgemm's blocking search finds no blocking (jit_brgemm_conv_bwd_utils.cpp
    # init_conf: best_brgb empty -> unimplemented), jit_avx512_common runs (measured: Qwen2-VL's patch embedding)
    brgemm_blocks = not (p.ndims == 5 and p.oh == p.ow == 1)
    if p.groups == 1 and (strided or p.nxc) and brgemm_blocks:
        # brgemm_convolution_bwd_strided (and, for NHWC unit stride, brgemm_convolution_bwd): NHWC
        # layouts (an NCHW diff_dst is reordered to NHWC, diff_src made in NHWC), weights blocked by
        # input channels; its scratchpad (transposed-input buffers) is not modelled
        return Primitive(
            "brgconv bwd_data",
            src=0 if p.nxc else p.dst(),
            weights=_blocked_weights(p, 1, SIMD),
            out=0 if p.nxc else p.src(),
            known=False,
            nhwc_out=not p.nxc,
        )
    if p.groups == 1:
        name = "jit_1x1 bwd_data" if p.ks == 1 else "jit bwd_data"
        return Primitive(name, src=p.dst(SIMD), weights=_blocked_weights(p, SIMD, SIMD), out=p.src(SIMD))
    if p.nxc:  # jit_avx512_common on NHWC, like the forward
        return Primitive("jit grouped bwd_data (nhwc)", weights=_nxc_grouped_weights(p))
    simd = _lower_simd(p)
    if simd is None:
        return gemm_fwd_or_bwd_data(p, nthr, "gemm bwd_data")
    return Primitive("jit grouped bwd_data", src=p.dst(simd), weights=p.weights(), out=p.src(simd))


def _avx2_bwd_weights_ok(p: ConvProblem) -> bool:
    """jit_avx2_conv_bwd_weights_kernel_f32_t::init_conf (jit_avx2_conv_kernel_f32.cpp): no dilation, kw < 14,
    kh <= ih, kd <= id, no front or back padding in depth, the other paddings under the kernel's size."""
    r_pad = (p.ow - 1) * p.sw + p.kw - p.iw - p.pw
    b_pad = (p.oh - 1) * p.sh + p.kh - p.ih - p.ph
    back_pad = (p.od - 1) * p.sd + p.kd - p.id - p.pd
    boundaries = p.ph < p.kh and b_pad < p.kh and p.pw < p.kw and r_pad < p.kw and p.pd == 0 and back_pad <= 0
    return boundaries and not p.dilated and p.kw < 14 and p.kh <= p.ih and p.kd <= p.id


def _dw_jit_ok(p: ConvProblem) -> bool:
    """jit_uni_dw bwd_weights init_conf: kw <= 3, no dilation, stride_w <= kw, pads <= k / 2."""
    return p.kw <= 3 and not p.dilated and p.sw <= p.kw and p.ph <= p.kh // 2 and p.pw <= p.kw // 2


def _backward_weights_nxc(p: ConvProblem, nthr: int) -> Primitive:
    """Channels-last (NHWC) data: no reorders of src / diff_dst."""
    if p.depthwise and _dw_jit_ok(p):
        # jit_uni_dw bwd_weights, harness_nxc: nthr - 1 private weight (16-channel padded) and bias
        # buffers (init_scratchpad), assuming partition_nthr_nxc keeps every thread busy
        groups = _rnd(p.groups, SIMD)
        copies = max(nthr - 1, 0)
        scratch = _book(groups * p.ks * copies * F32, p.groups * copies * F32 if p.bias else 0)
        return Primitive("jit_dw bwd_weights (nhwc)", out=groups * p.ks * p.esize, scratchpad=scratch)
    # jit_avx512_common bwd_weights on NHWC: weights blocked 16x16 per group (depthwise 5x5+ too)
    if p.groups == 1 and p.icg < SIMD:  # 1st-convolution weights (Ohwi16o); its scratch not modelled
        return Primitive("jit bwd_weights (nhwc)", out=_blocked_weights(p, SIMD, 1), known=False)
    if p.ks == 1:  # jit_1x1 (NHWC): scratchpad not modelled
        return Primitive("jit_1x1 bwd_weights (nhwc)", out=_blocked_weights(p, SIMD, SIMD), known=False)
    return jit_bwd_weights(p, nthr, "jit bwd_weights (nhwc)", SIMD, 0, 0)


def _backward_weights_depthwise(p: ConvProblem, nthr: int) -> Primitive:
    if not _dw_jit_ok(p) or p.ndims == 5:  # jit_uni_dw takes no 5d problem
        return gemm_bwd_weights(p, nthr)
    # jit_uni_dw balance (harness_mb_reduction): threads over 16-channel blocks, the rest over the
    # minibatch, whose (nthr_mb - 1) private weights (+ bias) the scratchpad holds
    groups = _rnd(p.groups, SIMD)
    nthr_g = min(groups // SIMD, nthr)
    nthr_mb = min(max(1, nthr // nthr_g), p.mb)
    copies = nthr_mb - 1
    scratch = _book(groups * p.ks * copies * F32, groups * copies * F32 if p.bias else 0)
    return Primitive(
        "jit_dw bwd_weights", src=p.src(SIMD), src2=p.dst(SIMD), out=groups * p.ks * p.esize, scratchpad=scratch
    )


def backward_weights(p: ConvProblem, nthr: int) -> Primitive:
    """diff_weights in the implementation's layout (``out``), the reorders of src / diff_dst, and
    the scratchpad (``known`` False where memest leaves it out)."""
    if p.nxc:
        return _backward_weights_nxc(p, nthr)
    if p.depthwise:
        return _backward_weights_depthwise(p, nthr)
    if p.groups == 1 and p.icg < SIMD:
        if p.icg <= 3 and p.kw <= 14:  # is_1stconv: src stays plain, weights Ohwi16o (ic_block = ic)
            return jit_bwd_weights(p, nthr, "jit 1st bwd_weights", p.icg, 0, p.dst(SIMD))
        if p.icg > 3 and _avx2_bwd_weights_ok(p):  # jit_avx2 bwd_weights: 8-channel blocks
            return Primitive(
                "jit avx2 bwd_weights", src=p.src(8), src2=p.dst(8), out=_blocked_weights(p, 8, 8), known=False
            )
        return gemm_bwd_weights(p, nthr)
    if p.groups == 1:
        if p.kw > 14:
            return gemm_bwd_weights(p, nthr)
        if p.ks == 1 and (p.sh > 1 or p.sw > 1):  # strided: reduce-to-unit-stride (rtus) buffers not modelled
            return Primitive(
                "jit_1x1 bwd_weights",
                src=p.src(SIMD),
                src2=p.dst(SIMD),
                out=_blocked_weights(p, SIMD, SIMD),
                known=False,
            )
        if p.ks == 1:
            return jit_1x1_bwd_weights(p, nthr)
        return jit_bwd_weights(p, nthr, "jit bwd_weights", SIMD, p.src(SIMD), p.dst(SIMD))
    if p.icg % SIMD == 0 and p.ocg % SIMD == 0:
        return jit_bwd_weights(p, nthr, "jit grouped bwd_weights", SIMD, p.src(SIMD), p.dst(SIMD))
    if p.icg % 8 == 0 and p.ocg % 8 == 0 and _avx2_bwd_weights_ok(p):  # jit_avx2 bwd_weights, 8-channel blocks
        return Primitive("jit avx2 grouped bwd_weights", src=p.src(8), src2=p.dst(8), out=p.weights(), known=False)
    return gemm_bwd_weights(p, nthr)


# -- the ATen / ideep sequence of one op -----------------------------------------------------------
class _Live:
    """Bytes alive inside one op, in the order the real kernel allocates and frees them."""

    def __init__(self) -> None:
        self.live = self.peak = 0
        self.held: dict[str, int] = {}

    def alloc(self, name: str, nbytes: int) -> None:
        if nbytes > 0:
            self.held[name] = self.held.get(name, 0) + nbytes
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def free(self, *names: str) -> None:
        for name in names:
            self.live -= self.held.pop(name, 0)


def _copy_bytes(t: torch.Tensor, memory_format: torch.memory_format) -> int:
    """``t.contiguous(memory_format)`` allocates a copy when ``t`` is not already so laid out."""
    if t.is_contiguous(memory_format=memory_format):
        return 0
    return t.numel() * t.element_size()


def _to_dense(live: _Live, name: str, nbytes: int, nhwc: bool) -> None:
    """MKLDNNConversions.cpp mkldnn_to_dense: at::empty, ``to_public`` into it (keeping a plain NHWC
    layout as NHWC), then ``.contiguous()``, a second copy when the layout was NHWC."""
    live.alloc(name + " (public)", nbytes)
    if nhwc:
        live.alloc(name, nbytes)
        live.free(name + " (public)")
    else:
        live.held[name] = live.held.pop(name + " (public)", 0)


def run_forward(p: ConvProblem, prim: Primitive, copies: int, out: int) -> int:
    """Peak bytes inside aten::convolution (mkldnn_convolution / ideep compute_v3 / do_compute)."""
    live = _Live()
    live.alloc("copies", copies)  # input/weight.contiguous(backend memory format)
    if p.nxc:
        live.alloc("out", out)  # output.resize_(sizes, channels_last); the primitive writes into it
    live.alloc("scratchpad", prim.scratchpad)
    live.alloc("src", prim.src)
    live.alloc("weights", prim.weights)
    if not p.nxc:
        live.alloc("dst", prim.out)
    live.free("scratchpad", "src", "weights")
    if not p.nxc:
        _to_dense(live, "out", out, prim.nhwc_out)
        live.free("dst")
    return live.peak


def run_backward(
    p: ConvProblem,
    data: Primitive | None,
    weights: Primitive | None,
    copies: int,
    grad_input: int,
    grad_weight: int,
    grad_bias: int,
    weight_copy_cl: int,
) -> int:
    """Peak bytes inside aten::convolution_backward (mkldnn_convolution_backward: backward_input, then
    backward_weights)."""
    live = _Live()
    live.alloc("copies", copies)  # grad_output/input/weight.contiguous(backend memory format)
    if data is not None:
        if p.nxc:
            live.alloc("grad_input", grad_input)  # grad_input.resize_(channels_last)
        live.alloc("diff_dst", data.src)
        live.alloc("weights", data.weights)
        live.alloc("diff_src", data.out)
        live.alloc("scratchpad", data.scratchpad)
        live.free("scratchpad", "weights", "diff_dst")
        if not p.nxc:
            _to_dense(live, "grad_input", grad_input, data.nhwc_out)
        live.free("diff_src")
    if weights is not None:
        live.alloc("diff_dst", weights.src2)
        live.alloc("src", weights.src)
        live.alloc("diff_weights", weights.out)
        live.alloc("scratchpad", weights.scratchpad)
        live.alloc("diff_bias", grad_bias)
        live.free("scratchpad", "src", "diff_dst")
        live.alloc("grad_bias", grad_bias)  # mkldnn_to_dense(grad_b) (evaluated first)
        live.alloc("grad_weight", grad_weight)  # mkldnn_to_dense(grad_w)
        live.alloc("grad_weight_cl", weight_copy_cl)  # .to(channels_last)
        live.free("grad_weight" if weight_copy_cl else "", "diff_weights", "diff_bias")
    return live.peak


# -- the aten ops ---------------------------------------------------------------------------------
def _channels_last(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Conv.cpp mkldnn_conv_use_channels_last: the input or the weight suggests channels-last (2d or 3d)."""
    from torch._prims_common import suggest_memory_format

    if input.dim() == 3:
        return False  # 1d convolutions run as 2d views of contiguous tensors
    formats = (suggest_memory_format(input), suggest_memory_format(weight))
    return torch.channels_last in formats or torch.channels_last_3d in formats


def _dhw(values, dim: int, unit: int) -> tuple[int, int, int]:
    """(d, h, w) of a 1d, 2d or 3d shape or parameter; the dimensions a convolution lacks are ``unit`` (a 1d
    convolution's H is 1: view1d_as_2d; oneDNN's d of a 2d one)."""
    values = list(values) if len(values) > 1 else list(values) * dim
    return tuple([unit] * (3 - dim) + values[:dim])


def problem(
    input, weight, has_bias, stride, padding, dilation, transposed, output_padding, groups
) -> ConvProblem | None:
    """The oneDNN problem of an aten convolution on the Mkldnn backends; None when not modelled
    (another backend, a data type other than fp32, 3d channels-last)."""
    if input.dim() not in (3, 4, 5) or input.dtype != torch.float32 or weight.dtype != torch.float32:
        return None
    backend = int(
        torch._C._select_conv_backend(
            input,
            weight,
            None,
            list(stride),
            list(padding),
            list(dilation),
            transposed,
            list(output_padding),
            groups,
            None,
        )
    )
    if backend not in (MKLDNN, MKLDNN_TRANSPOSE):
        return None
    nxc = _channels_last(input, weight)
    if nxc and input.dim() == 5:
        return None  # 3d channels-last: oneDNN's brgemm convolutions on NDHWC, not measured
    dim = input.dim() - 2
    (sd, sh, sw), (pd, ph, pw) = _dhw(stride, dim, 1), _dhw(padding, dim, 0)
    (dd, dh, dw), (kd, kh, kw) = _dhw(dilation, dim, 1), _dhw(weight.shape[2:], dim, 1)
    ind, ih, iw = _dhw(input.shape[2:], dim, 1)
    icg, ocg = weight.shape[1], weight.shape[0] // groups

    def transposed_side(o: int, s: int, pad: int, dil: int, k: int, op: int) -> int:
        return (o - 1) * s - 2 * pad + dil * (k - 1) + op + 1

    def side(i: int, s: int, pad: int, dil: int, k: int) -> int:
        return (i + 2 * pad - dil * (k - 1) - 1) // s + 1

    if transposed:  # oneDNN deconvolution = the convolution whose input is this one's output
        (opd, oph, opw) = _dhw(output_padding, dim, 0)
        od, oh, ow = ind, ih, iw
        ind = transposed_side(od, sd, pd, dd, kd, opd)
        ih = transposed_side(oh, sh, ph, dh, kh, oph)
        iw = transposed_side(ow, sw, pw, dw, kw, opw)
    else:
        od, oh, ow = side(ind, sd, pd, dd, kd), side(ih, sh, ph, dh, kh), side(iw, sw, pw, dw, kw)
    return ConvProblem(
        mb=input.shape[0],
        groups=groups,
        icg=icg,
        ocg=ocg,
        ih=ih,
        iw=iw,
        oh=oh,
        ow=ow,
        kh=kh,
        kw=kw,
        sh=sh,
        sw=sw,
        ph=ph,
        pw=pw,
        dilated=dd > 1 or dh > 1 or dw > 1,
        bias=has_bias,
        nxc=nxc,
        esize=input.element_size(),
        ndims=5 if dim == 3 else 4,
        id=ind,
        od=od,
        kd=kd,
        sd=sd,
        pd=pd,
    )


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _memory_format(p: ConvProblem) -> torch.memory_format:
    return torch.channels_last if p.nxc else torch.contiguous_format


def _input_copy(input: torch.Tensor, p: ConvProblem) -> int:
    # 1d: input.contiguous() before the 4d view; 2d: input.contiguous(backend memory format)
    return _copy_bytes(input, torch.contiguous_format if input.dim() == 3 else _memory_format(p))


def _weight_copy(weight: torch.Tensor, p: ConvProblem) -> int:
    return _copy_bytes(weight, torch.contiguous_format if weight.dim() == 3 else _memory_format(p))


class ConvScratch:
    """aten::convolution and aten::convolution_backward scratch for the tracker: the peak of the real
    kernel's buffers minus the outputs the fake kernel already records. ``nthreads``: the threads
    oneDNN runs with (torch.get_num_threads() of the process that would train)."""

    def __init__(self, nthreads: int) -> None:
        self.nthreads = nthreads
        self.calls: dict[str, int] = {}  # implementation -> calls modelled
        self.unknown: dict[str, int] = {}  # implementation -> calls whose scratchpad is not modelled
        self.skipped = 0  # calls on a backend or dtype memest does not model
        self.history: list[list[Primitive]] = []  # per call, the primitives assumed (probe script)

    def _count(self, *prims: Primitive | None) -> None:
        self.history.append([prim for prim in prims if prim is not None])
        for prim in prims:
            if prim is not None:
                self.calls[prim.name] = self.calls.get(prim.name, 0) + 1
                if not prim.known:
                    self.unknown[prim.name] = self.unknown.get(prim.name, 0) + 1

    def forward(self, args, kwargs) -> list[int]:
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups = args[:9]
        p = problem(input, weight, bias is not None, stride, padding, dilation, transposed, output_padding, groups)
        if p is None:
            self.skipped += 1
            self.history.append([])
            return []
        out = p.src() if transposed else p.dst()  # the output, dense
        # a deconvolution's forward is oneDNN's backward_data of the convolution it transposes
        prim = backward_data(p, self.nthreads) if transposed else forward(p, self.nthreads)
        if transposed:  # its diff_dst is this op's input, its diff_src this op's output
            prim = dataclasses.replace(prim, name=prim.name.replace("bwd_data", "deconv fwd"))
        self._count(prim)
        copies = _input_copy(input, p) + _weight_copy(weight, p)
        return [run_forward(p, prim, copies, out) - out]

    def backward(self, args, kwargs) -> list[int]:
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = (
            args[:11]
        )
        # mkldnn_convolution_backward_weights(..., bias_defined = output_mask[2])
        p = problem(input, weight, bool(mask[2]), stride, padding, dilation, transposed, output_padding, groups)
        if p is None:
            self.skipped += 1
            self.history.append([])
            return []
        grad_input = _nbytes(input) if mask[0] else 0
        grad_weight = _nbytes(weight) if mask[1] else 0
        grad_bias = (p.oc if not transposed else p.ic) * p.esize if mask[2] else 0
        if transposed:  # deconvolution backward_data = convolution forward; backward_weights alike
            data = forward(p, self.nthreads) if mask[0] else None
            wei = backward_weights(p, self.nthreads) if (mask[1] or mask[2]) else None
        else:
            data = backward_data(p, self.nthreads) if mask[0] else None
            wei = backward_weights(p, self.nthreads) if (mask[1] or mask[2]) else None
        self._count(data, wei)
        grad_out_copy = _copy_bytes(
            grad_output, _memory_format(p) if grad_output.dim() == 4 else torch.contiguous_format
        )
        copies = grad_out_copy + _input_copy(input, p) + _weight_copy(weight, p)
        # channels-last: grad_weight = mkldnn_to_dense(grad_w).to(channels_last): a copy unless the
        # dense OIHW tensor already suggests channels-last (to_will_alias, TensorConversions.cpp)
        from torch._prims_common import suggest_memory_format

        dense_is_cl = suggest_memory_format(torch.empty(weight.shape, device="meta")) == torch.channels_last
        weight_cl = grad_weight if (p.nxc and mask[1] and not dense_is_cl) else 0
        peak = run_backward(p, data, wei, copies, grad_input, grad_weight, grad_bias, weight_cl)
        return [peak - grad_input - grad_weight - grad_bias]
