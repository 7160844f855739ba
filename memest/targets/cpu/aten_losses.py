"""ATen CPU loss kernels whose real allocations differ from their meta kernels.

``mse_loss`` with a reduction (aten/src/ATen/native/Loss.cpp): the elementwise loss goes through a
TensorIterator into a full-size buffer and the reduction writes the 0-d result into storage of that
size; so the loss the step holds until backward is backed by input-sized storage, and a second
input-sized buffer lives while the kernel runs (measured with torch.profiler: tests/test_cpu_scratch.py).
The meta kernel returns a 4-byte 0-d tensor.
"""

from __future__ import annotations

REDUCTION_NONE, REDUCTION_MEAN = 0, 1  # at::Reduction::None, Mean


def _numel(args) -> int:
    return max(args[0].numel(), args[1].numel())


def mse_loss_scratch(args, kwargs) -> list[int]:
    """While the kernel runs: the result's input-sized storage (the output made when the kernel
    returns, :func:`mse_loss_output`) and a second input-sized buffer; for the mean, ``div_`` by
    the element count as a wrapped double scalar (8 bytes) cast to the loss dtype."""
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == REDUCTION_NONE:
        return []
    esize = args[0].element_size()
    return [2 * _numel(args) * esize + (8 + esize if reduction == REDUCTION_MEAN else 0)]


def mse_loss_output(args, kwargs, out, empty):
    reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
    if reduction == REDUCTION_NONE:
        return out
    return empty([], out.dtype, numel=_numel(args))


mse_loss_output.late = (0,)
