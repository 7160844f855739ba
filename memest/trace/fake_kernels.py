"""Fake kernels that answer as the real kernel does, where torch's own meta kernel does not.

A fake tensor takes its dtype rules and its output's size and strides from the op's meta kernel.
Where that kernel is stricter than the real one, a fake trace fails on a step the real one runs;
where it lays the output out differently, the trace counts other bytes. The kernels here answer
for torch's meta kernel on fake tensors while a step is traced (``real_fake_kernels()``, undone at
exit; meta tensors and real kernels are untouched) and each says which real kernel it copies.

``aten::_grouped_mm`` (what transformers' MoE experts call by default, through
``torch.nn.functional.grouped_mm``): torch 2.13's meta kernel (torch/_meta_registrations.py,
``_meta_grouped_mm_common``) implements the checks of the CUDA bf16 fast path and refuses anything
but bfloat16 inputs. The real kernels take float32, bfloat16 and float16: the CPU kernel
(aten/src/ATen/native/Blas.cpp ``_grouped_mm``, CompositeExplicitAutograd) and the CUDA
kernel (aten/src/ATen/native/cuda/GroupedBlas.cpp ``_grouped_mm_cuda``: the CUTLASS kernel for
bf16 on sm90/sm100, else a loop of ``mm_out`` over the groups) both validate with
``_grouped_mm_validate_inputs`` and allocate their output with ``create_grouped_gemm_output_tensor``
(aten/src/ATen/native/GroupedMMUtils.h): the last dimension's stride padded to 16 bytes, which the
meta kernel does only on a CUDA build (``if torch.version.cuda``). Both are copied below.

``aten::_ctc_loss`` (CTC heads: transformers' ForCTCLoss): torch has a meta kernel for it (C++,
``ctc_loss_meta`` in aten/src/ATen/native/LossCTC.cpp: the outputs of ``ctc_loss_allocate_outputs``,
which the CPU kernel allocates too), but the op is tagged ``dynamic_output_shape`` and
FakeTensorMode refuses every such op before looking for one. Its output shapes depend on its
``target_lengths`` argument, a list of ints the fake step has, not on tensor values; the kernel here
allocates what that meta kernel does.

``aten::_scaled_mm.out`` (compiled float8 graphs): no meta kernel in torch 2.13, so FakeTensorMode ran the real
kernel on real tensors (its unsafe fallback); the kernel here answers as the out= variants do (``scaled_mm_out_fake``).

``IndexBackward0`` (the gradient of ``x[index_tensor]``; transformers' MoE dispatch, any gather by index):
autograd's formula (torch/csrc/autograd/FunctionsManual.cpp, ``index_backward``) scatters the gradient into its
zeros in place (``at::_index_put_impl_``), but for tensor subclasses, fake tensors included, it takes the
out-of-place ``zeros_like_self.index_put(indices, grad, true)``: a second buffer of the input's size the real
step never makes. ``OUTPUTS`` answers that call as the real one (in place on the zeros), only inside IndexBackward0.

``GatherBackward0`` (the gradient of ``torch.gather``: trl's ``selective_log_softmax``, any gather of log-probs):
the same pattern (FunctionsManual.cpp ``gather_backward``): ``grad.new_zeros(self.sizes())`` then
``result.scatter_add_(dim, index, grad)`` in place, but for tensor subclasses the out-of-place ``scatter_add``: a
second buffer of the input's size (measured: +496,000 B on --preference orpo, llama-tiny, batch 2, seq 32, the
(4, 31, 1000) float32 log-prob gradient). ``OUTPUTS`` answers it in place, only inside GatherBackward0.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ALIGNMENT_BYTES = 16  # GroupedMMUtils.h: operand strides and output rows aligned to 16 bytes (TMA)


def _check_strides(name: str, mat: torch.Tensor) -> None:
    """check_valid_strides_and_return_transposed (GroupedMMUtils.h), without the data-pointer
    alignment it checks on CUDA only (fake tensors have no data)."""
    strides, sizes, end = mat.stride(), mat.shape, mat.dim() - 1
    alignment = _ALIGNMENT_BYTES // mat.element_size()
    if strides[end - 1] == 1 and strides[end] >= max(1, sizes[end - 1]):
        torch._check(strides[end] % alignment == 0, lambda: f"{name}: strides should be multiple of 16 bytes")
    elif strides[end] == 1 and strides[end - 1] >= max(1, sizes[end]):
        torch._check(strides[end - 1] % alignment == 0, lambda: f"{name}: strides should be multiple of 16 bytes")
    else:
        torch._check(False, lambda: f"{name}: invalid strides/sizes, got {strides} for strides and {tuple(sizes)} for sizes")


def _check_operand(name: str, mat: torch.Tensor) -> None:
    torch._check(
        mat.dtype in _GROUPED_MM_DTYPES, lambda: f"Expected {name} to be Float32, BFloat16 or Float16 matrix, got {mat.dtype}"
    )
    torch._check(mat.dim() in (2, 3), lambda: f"{name} has to be 2 or 3d")


def grouped_mm_fake(mat_a, mat_b, offs=None, bias=None, out_dtype=None):
    """``_grouped_mm_validate_inputs`` + ``_resolve_grouped_mm_out_dtype`` +
    ``create_grouped_gemm_output_tensor`` (GroupedMMUtils.h, non-ROCm build)."""
    for name, mat in (("mat_a", mat_a), ("mat_b", mat_b)):
        _check_operand(name, mat)
    a_2d, b_2d = mat_a.dim() == 2, mat_b.dim() == 2
    if not (a_2d and b_2d):
        torch._check(mat_a.shape[-1] == mat_b.shape[-2], lambda: "contraction dimension of mat_a and mat_b must match")
    _check_strides("mat_a", mat_a)
    _check_strides("mat_b", mat_b)
    torch._check((offs is not None) == (a_2d or b_2d), lambda: "Have to provide offsets if there is a 2d matrix, or no offset if both matrices are 3d")
    if offs is not None:
        torch._check(offs.dim() == 1, lambda: "offs has to be 1D")
        torch._check(offs.dtype == torch.int32, lambda: "Offsets have to be int32")
    torch._check(bias is None, lambda: "Bias not supported yet")
    dtype = out_dtype or mat_a.dtype
    torch._check(dtype == mat_a.dtype, lambda: "Grouped gemm output dtype must match `mat_a` dtype")

    if a_2d and b_2d:
        size = [offs.shape[0], mat_a.shape[0], mat_b.shape[1]]
    elif a_2d:
        torch._check(offs.shape[0] == mat_b.shape[0], lambda: "matrix batch sizes have to match")
        size = [mat_a.shape[0], mat_b.shape[-1]]
    elif b_2d:
        torch._check(offs.shape[0] == mat_a.shape[0], lambda: "matrix batch sizes have to match")
        size = [mat_a.shape[1], mat_b.shape[1]]
    else:
        torch._check(mat_a.shape[0] == mat_b.shape[0], lambda: "batched dimension has to match")
        size = [mat_a.shape[0], mat_a.shape[1], mat_b.shape[-1]]
    alignment = _ALIGNMENT_BYTES // dtype.itemsize
    padded = (size[-1] + alignment - 1) // alignment * alignment
    stride = [padded, 1] if a_2d != b_2d else [size[1] * padded, padded, 1]
    return torch.empty_strided(size, stride, dtype=dtype, device=mat_a.device)


def ctc_loss_fake(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    """``ctc_loss_allocate_outputs`` (LossCTC.cpp, shared by the CPU kernel and ``ctc_loss_meta``): the
    negative log likelihood per example and log_alpha, batch x input length x (2 x longest target + 1)."""
    batch = log_probs.shape[1]
    torch._check(len(input_lengths) == batch, lambda: "input_lengths must be of size batch_size")
    torch._check(len(target_lengths) == batch, lambda: "target_lengths must be of size batch_size")
    longest = max(target_lengths, default=0)
    nll = log_probs.new_empty((batch,))
    log_alpha = log_probs.new_empty((batch, log_probs.shape[0], 2 * longest + 1))
    return nll, log_alpha


def scaled_mm_out_fake(self, mat2, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None,
                       use_fast_accum=False, *, out):
    """``aten::_scaled_mm.out`` (Inductor's compiled float8 graphs call it: ``extern_kernels._scaled_mm(...,
    out=buf)``): torch 2.13 has a meta kernel for ``_scaled_mm.default`` only, so FakeTensorMode ran the real CPU
    kernel on real zero-filled tensors of the fake sizes (its unsafe fallback: real memory and real matmuls, minutes
    for an 8B model's shapes). The out= contract of the real kernels (Blas.cpp ``_scaled_mm_out_cpu``,
    ScaledBlas.cpp ``_scaled_mm_out_cuda``): the inputs checked as the functional op checks them (its meta kernel
    here), ``out`` resized to the result's size where it differs (``at::native::resize_output``), written and
    returned: no other output."""
    result = torch.ops.aten._scaled_mm.default(self, mat2, scale_a, scale_b, bias, scale_result, out_dtype,
                                               use_fast_accum)
    if out.shape != result.shape:
        out.resize_(result.shape)
    return out


# aten op name -> fake kernel
FAKE_KERNELS = {"_grouped_mm": grouped_mm_fake, "_ctc_loss": ctc_loss_fake, "_scaled_mm.out": scaled_mm_out_fake}


@contextlib.contextmanager
def real_fake_kernels() -> Iterator[None]:
    """While entered, the kernels of ``FAKE_KERNELS`` answer for their aten ops on fake tensors; at
    exit torch's own answers are back (``registered_fake_kernels``)."""
    with registered_fake_kernels(FAKE_KERNELS):
        yield


@contextlib.contextmanager
def registered_fake_kernels(kernels: dict) -> Iterator[None]:
    """While entered, ``kernels`` (aten op name, ``name`` or ``name.overload`` -> fake kernel) answer for
    their ops on fake tensors; at exit torch's own answers are back.

    They are added where FakeTensorMode looks first, the fake-kernel registry that
    ``torch.library.register_fake`` fills (torch/_library/simple_registry.py), without the Meta
    kernel that register_fake also installs: overriding an aten op's Meta kernel and removing it again
    left FakeTensorMode calling the removed kernel (torch 2.13). FakeTensorMode also caches op results
    by input metadata, class-wide, so the cached answers for these ops are dropped on entry and exit."""
    from torch._library.simple_registry import singleton
    from torch._library.utils import Kernel

    added = []
    ops = set()
    for name, fn in kernels.items():
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.aten, base, None)
        op = getattr(packet, overload or "default", None) if packet is not None else None
        if op is None:
            continue
        holder = singleton.find(f"aten::{name}").fake_impl
        kernel = Kernel(fn, f"memest.trace.{getattr(fn, '__qualname__', name)}")
        holder.kernels.append(kernel)
        added.append((holder, kernel))
        ops.add(op)
    _forget_cached(ops)
    try:
        yield
    finally:
        for holder, kernel in added:
            holder.kernels.remove(kernel)
        _forget_cached(ops)


def _forget_cached(ops) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    cache = getattr(FakeTensorMode, "cache", None)
    if not isinstance(cache, dict):
        return
    for key in [k for k in cache if getattr(k, "key", None) and k.key[0] in ops]:
        cache.pop(key, None)


def _index_backward_in_place(args, kwargs, out, run):
    """aten.index_put (out of place) called by autograd's index_backward on fake tensors: the real formula's
    ``_index_put_impl_`` works in the zeros it was given (module docstring)."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() != "IndexBackward0":
        return out
    run(torch.ops.aten.index_put_.default, *args, **kwargs)
    return args[0]


def _gather_backward_in_place(args, kwargs, out, run):
    """aten.scatter_add (out of place) called by autograd's gather_backward on fake tensors: the real formula
    (FunctionsManual.cpp ``gather_backward``) runs ``result.scatter_add_`` in the zeros it made (module docstring)."""
    node = torch._C._current_autograd_node()
    if node is None or node.name() != "GatherBackward0":
        return out
    run(torch.ops.aten.scatter_add_.default, *args, **kwargs)
    return args[0]


# aten op -> fn(args, kwargs, out, run): outputs the real step makes differently (StorageTracker.outputs)
OUTPUTS = {torch.ops.aten.index_put.default: _index_backward_in_place,
           torch.ops.aten.scatter_add.default: _gather_backward_in_place}


def chained_outputs(first: dict, then: dict) -> dict:
    """Two tables of output fixes (``StorageTracker.outputs``) as one: where both answer an op, ``then``'s fix
    runs first and, when it keeps torch's output, ``first``'s (e.g. ``index_put``: upper_bound's boolean-mask
    case, then ``_index_backward_in_place`` for any other index inside IndexBackward0)."""
    merged = {**first, **then}
    for op in first.keys() & then.keys():
        def fix(args, kwargs, out, make, a=first[op], b=then[op]):
            answer = b(args, kwargs, out, make)
            return a(args, kwargs, out, make) if answer is out else answer
        merged[op] = fix
    return merged
