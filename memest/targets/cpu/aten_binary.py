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


def _tensors(args) -> list[torch.Tensor]:
    return [a for a in args[:2] if isinstance(a, torch.Tensor)]


def common_dtype_scratch(args, kwargs) -> list[int]:
    """Bytes of the common-dtype copies of the inputs (and of an in-place op's temporary output)."""
    tensors = _tensors(args)
    if len(tensors) < 2 or (tensors[0].dtype == tensors[1].dtype and tensors[0].dtype.is_floating_point):
        return []  # the common case, answered first: every call of these ops in a trace comes here
    common = torch.result_type(args[0], args[1])
    return [t.numel() * common.itemsize for t in tensors if t.dtype != common and t.numel()]


def in_place_scratch(args, kwargs) -> list[int]:
    """As ``common_dtype_scratch``, plus ``self``'s temporary output where ``self`` is not in the common dtype."""
    sizes = common_dtype_scratch(args, kwargs)
    self = args[0]
    if sizes and isinstance(self, torch.Tensor) and len(_tensors(args)) == 2:
        common = torch.result_type(args[0], args[1])
        if self.dtype != common:
            sizes.append(self.numel() * common.itemsize)
    return sizes
