"""Mixed-dtype arithmetic on the CPU: TensorIterator's common-dtype copies.

A binary op's TensorIterator (aten/src/ATen/TensorIterator.cpp, ``TensorIteratorBase::compute_types``) computes in
the operands' common dtype (type promotion: ``torch.result_type``). On the CPU, and only there, it makes that real:
every input whose dtype differs from the common one is replaced by a copy in it (``op.tensor().to(common_dtype_)``,
``promote_inputs_to_common_dtype``), and an output whose dtype differs (an in-place op's ``self``) is replaced by a
temporary in it (``at::empty_like(..., common_dtype_)``, ``cast_common_dtype_to_outputs``), copied back afterwards.
CUDA casts inside the kernel instead. The meta kernels the trace runs skip both (``is_meta_``), so the CPU target adds
them as the kernel's scratch, held with its output. Measured (torch.profiler, torch 2.13.0+cpu, tests/test_cpu_scratch.py):
bf16 (8000 x 256) ``mul_`` by a float32 column: 16,384,000 B (the copy of ``self`` and the temporary output); the
same out of place: 8,192,000 B; by a 0-d float32 tensor (which does not promote): 2 B; float32 ``+`` bf16: 8,192,000 B.
The four arithmetic ops and their in-place forms only: other TensorIterator ops with promotion are not modelled."""

from __future__ import annotations

import torch

aten = torch.ops.aten

OUT_OF_PLACE = (aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor)
IN_PLACE = (aten.add_.Tensor, aten.sub_.Tensor, aten.mul_.Tensor, aten.div_.Tensor)


def _mixed(args) -> tuple[list[torch.Tensor], torch.dtype | None]:
    """The two tensor operands and their common dtype; None where there is nothing to copy (one tensor, or both in
    the same floating dtype: the common case, answered first, as every call of these ops in a trace comes here)."""
    tensors = [a for a in args[:2] if isinstance(a, torch.Tensor)]
    if len(tensors) < 2 or (tensors[0].dtype == tensors[1].dtype and tensors[0].dtype.is_floating_point):
        return tensors, None
    return tensors, torch.result_type(args[0], args[1])


def _copies(tensors: list[torch.Tensor], common: torch.dtype) -> list[int]:
    return [t.numel() * common.itemsize for t in tensors if t.dtype != common and t.numel()]


def common_dtype_scratch(args, kwargs) -> list[int]:
    """Bytes of the common-dtype copies of the inputs."""
    tensors, common = _mixed(args)
    return _copies(tensors, common) if common else []


def in_place_scratch(args, kwargs) -> list[int]:
    """As ``common_dtype_scratch``, plus ``self``'s temporary output where ``self`` is not in the common dtype."""
    tensors, common = _mixed(args)
    if common is None:
        return []
    sizes = _copies(tensors, common)
    if sizes and tensors[0] is args[0] and args[0].dtype != common:
        sizes.append(args[0].numel() * common.itemsize)
    return sizes
