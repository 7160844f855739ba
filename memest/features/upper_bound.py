"""``--data-dependent upper-bound``: size-bounded data-dependent ops answered at their bound.

Fake tensors have no values, so an op whose output size depends on them (trace/data_dependent.py) has
no size; by default memest refuses it. In upper-bound mode each such op whose size is bounded by its
inputs' sizes returns a fake output at that bound, as if every element were selected (``nonzero``,
boolean-mask indexing ``x[mask]``, ``masked_select``) or distinct (the ``unique`` family). Memory that
follows from those outputs is then the most the step can need for them, and the report says which ops
were bounded, how many calls, and that its figure is an upper bound for them.

How: fake kernels added, while the step runs, where FakeTensorMode looks first (the registry that
``torch.library.register_fake`` fills; trace/fake_kernels.py ``registered_fake_kernels``), and removed
at exit. No ShapeEnv: sizes stay plain ints, so nothing downstream (tracker, FLOPs, allocator replay)
reads a symbol. Value reads (``.item()``, Python branches on tensors) have no bound and stay refused.

What the real kernels allocate besides their outputs, at the bound (``bound_scratch``, held while the
op runs, as the tracker's kernel scratch):

- boolean-mask indexing and ``index_put`` with a boolean mask (``x[mask]`` and its backward): ATen's
  ``expandTensors`` (aten/src/ATen/native/IndexingUtils.h) replaces each mask by ``mask.nonzero()``,
  n x mask.dim() int64 indices, freed when the op returns (CPU and CUDA; measured with torch.profiler:
  ``aten::nonzero < aten::index``, tests/test_upper_bound.py).
- CPU ``masked_select`` (aten/src/ATen/native/TensorAdvancedIndexing.cpp, ``masked_select_out_impl_cpu``):
  ``_mask.sum()`` on the broadcast bool mask casts it to int64 (numel x 8 bytes) and returns an 8-byte
  scalar, both freed before the output is made (measured: ``aten::to < aten::sum < aten::masked_select``);
  unless the serial kernel runs (input below at::internal::GRAIN_SIZE = 32768 elements or one thread, and
  input and mask contiguous at the broadcast shape), two more numel x int64 buffers (``mask_long``,
  ``mask_prefix_sum``) live with the output. On CUDA (cuda/IndexKernel.cpp ``masked_select_out_cuda_impl``)
  it is ``index`` with the broadcast mask: the nonzero indices above.
- the backward of ``x[mask]`` and of ``masked_select`` (torch/csrc/autograd/FunctionsManual.cpp
  ``index_backward``, ``masked_select_backward``): for tensor subclasses (fake tensors are) autograd takes the
  out-of-place ``index_put`` / ``masked_scatter`` and so a copy of the zeros it scatters into, where the real
  run writes in place (``_index_put_impl_``, ``masked_scatter_``; measured: no copy). In backward the op's
  output is that zeros tensor (``bound_outputs``).
- ``unique``: only the outputs (values, inverse, counts at their bound); the CPU kernels' sort buffers
  are not modelled, so around a ``unique`` call the bound may be short by them (the note says so).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch

from memest.features.base import StepFeature
from memest.spec.choices import Target
from memest.trace.events import Phase
from memest.trace.fake_kernels import registered_fake_kernels
from memest.trace.tracker import TrackerRules
from memest.worker import modelled_threads

aten = torch.ops.aten
_INDEX_BYTES = 8  # int64 indices (nonzero's output dtype)
MASK_INDEXING = "index.Tensor (boolean mask)"
MASK_INDEX_PUT = "index_put (boolean mask)"


def _is_mask(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


GRAIN_SIZE = 32768  # at::internal::GRAIN_SIZE (aten/src/ATen/Parallel.h): masked_select's serial-kernel limit


class BoundedOps:
    """The fake kernels at the bound, counting their calls in ``calls`` (op label -> calls).
    ``in_backward``: whether the step is in backward now (the tracker's phase)."""

    def __init__(self, in_backward: Callable[[], bool] = lambda: False) -> None:
        self.calls: dict[str, int] = {}
        self.in_backward = in_backward

    def _count(self, label: str) -> None:
        self.calls[label] = self.calls.get(label, 0) + 1

    # -- the kernels ---------------------------------------------------------------------------
    def nonzero(self, x):
        self._count("nonzero")
        return x.new_empty((x.numel(), x.dim()), dtype=torch.int64)  # every element nonzero

    def masked_select(self, x, mask):
        self._count("masked_select")
        return x.new_empty((math.prod(torch.broadcast_shapes(x.shape, mask.shape)),))

    def index(self, x, indices):
        """``index.Tensor``: a boolean mask becomes mask.dim() int64 index vectors of mask.numel() entries
        (every element selected), as expandTensors does with the mask's nonzero; then torch's own meta kernel."""
        from torch._meta_registrations import meta_index_Tensor

        if not any(_is_mask(i) for i in indices):
            return meta_index_Tensor(x, indices).to(x.device)
        self._count(MASK_INDEXING)
        expanded, dim = [], 0
        for i in indices:
            if not _is_mask(i):
                expanded.append(i)
                dim += 1
                continue
            torch._check(
                tuple(i.shape) == tuple(x.shape[dim : dim + i.dim()]),
                lambda i=i, dim=dim: f"The shape of the mask {tuple(i.shape)} at index {dim} does not match the shape "
                f"of the indexed tensor {tuple(x.shape)}",
            )
            expanded += [torch.empty((i.numel(),), dtype=torch.int64, device=i.device) for _ in range(i.dim())]
            dim += i.dim()
        return meta_index_Tensor(x, expanded).to(x.device)

    def unique2(self, x, sorted=True, return_inverse=False, return_counts=False):
        self._count("unique")
        return _unique_at_bound(x, None, return_inverse, return_counts)

    def unique(self, x, sorted=True, return_inverse=False):
        self._count("unique")
        return _unique_at_bound(x, None, return_inverse, False)[:2]

    def unique_dim(self, x, dim, sorted=True, return_inverse=False, return_counts=False):
        self._count("unique")
        return _unique_at_bound(x, dim, return_inverse, return_counts)

    def unique_consecutive(self, x, return_inverse=False, return_counts=False, dim=None):
        self._count("unique")
        return _unique_at_bound(x, dim, return_inverse, return_counts)

    def unique_dim_consecutive(self, x, dim, return_inverse=False, return_counts=False):
        self._count("unique")
        return _unique_at_bound(x, dim, return_inverse, return_counts)

    def kernels(self) -> dict:
        return {
            "nonzero": self.nonzero,
            "masked_select": self.masked_select,
            "index.Tensor": self.index,
            "_unique2": self.unique2,
            "_unique": self.unique,
            "unique_dim": self.unique_dim,
            "unique_consecutive": self.unique_consecutive,
            "unique_dim_consecutive": self.unique_dim_consecutive,
        }

    @contextlib.contextmanager
    def active(self) -> Iterator[BoundedOps]:
        """While entered, the size-bounded ops answer at their bound on fake tensors (undone at exit)."""
        with registered_fake_kernels(self.kernels()):
            yield self

    # -- the real kernels' other buffers, at the bound (the tracker's kernel scratch) -----------
    def _mask_indices(self, args, kwargs) -> list[int]:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", [])
        return [i.numel() * i.dim() * _INDEX_BYTES for i in indices if _is_mask(i)]

    def _index_put_scratch(self, args, kwargs) -> list[int]:
        sizes = self._mask_indices(args, kwargs)
        if sizes:
            self._count(MASK_INDEX_PUT)
        return sizes

    def scratch(self, target: str) -> dict:
        table = {
            aten.index.Tensor: self._mask_indices,
            aten.index_put.default: self._index_put_scratch,
            aten.index_put_.default: self._index_put_scratch,
            aten._index_put_impl_.default: self._index_put_scratch,
        }
        table[aten.masked_select.default] = _masked_select_cpu_scratch if target == Target.CPU else _masked_select_cuda_scratch
        return table

    def outputs(self, target: str) -> dict:
        table = {aten.index_put.default: self._in_place_index_put, aten.masked_scatter.default: self._in_place_scatter}
        if target == Target.CPU:
            table[aten.masked_select.default] = _masked_select_cpu_output
        return table

    def _in_place_index_put(self, args, kwargs, out, make):
        """index_backward's accumulate into zeros with a mask: the real run writes in place."""
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        if accumulate and self.in_backward() and self._mask_indices(args, kwargs) and args[0].shape == out.shape:
            return args[0]
        return out

    def _in_place_scatter(self, args, kwargs, out, make):
        """masked_select_backward's masked_scatter into zeros: the real run writes in place."""
        if self.in_backward() and args[0].shape == out.shape and args[0].dtype == out.dtype:
            return args[0]
        return out

    def note(self) -> str:
        calls = ", ".join(f"{op} x{n}" for op, n in sorted(self.calls.items()))
        line = (
            f"--data-dependent upper-bound: data-dependent ops answered at their bound ({calls}): every element "
            "selected or distinct, so the estimate is an upper bound for them (a mask that selects fewer needs less)"
        )
        if "unique" in self.calls:
            line += "; unique's sort buffers inside the kernel are not modelled"
        return line


def _unique_at_bound(x, dim, return_inverse, return_counts):
    """The outputs torch's fake ``_unique`` (torch/_subclasses/fake_impls.py) makes, with every value distinct."""
    if dim is None:
        values = x.new_empty((x.numel(),))
    else:
        dim = dim % max(x.dim(), 1)
        values = x.new_empty(x.shape)
    cpu_dim = dim is not None and x.device.type == "cpu"
    n = x.numel() if dim is None else x.shape[dim]
    inverse_shape = (x.shape if dim is None else (n,)) if (return_inverse or cpu_dim) else (0,)
    counts_shape = (n,) if (return_counts or cpu_dim) else (0,)
    return values, x.new_empty(inverse_shape, dtype=torch.int64), x.new_empty(counts_shape, dtype=torch.int64)


def _broadcast_numel(args) -> int:
    return math.prod(torch.broadcast_shapes(args[0].shape, args[1].shape))


def _masked_select_cpu_scratch(args, kwargs) -> list[int]:
    """``_mask.sum()``: the broadcast mask cast to int64 and the 8-byte sum, freed before the output is made
    (``_masked_select_cpu_output``, late). The parallel kernel then holds ``mask_long`` and
    ``mask_prefix_sum`` with the output; the tracker makes a late output after all scratch, so there the
    scratch is the output's bytes plus those two (the same peak, the larger of the two moments)."""
    x, mask = args[0], args[1]
    shape = tuple(torch.broadcast_shapes(x.shape, mask.shape))
    numel = math.prod(shape)
    serial = ((x.numel() < GRAIN_SIZE or modelled_threads(torch.get_num_threads()) == 1) and x.is_contiguous() and tuple(x.shape) == shape
              and mask.is_contiguous() and tuple(mask.shape) == shape)
    if serial:
        return [numel * _INDEX_BYTES + 8]
    return [max(numel * _INDEX_BYTES + 8, numel * x.element_size() + 2 * numel * _INDEX_BYTES)]


def _masked_select_cuda_scratch(args, kwargs) -> list[int]:
    """``index`` with the broadcast mask: its nonzero, numel x mask dims int64."""
    return [_broadcast_numel(args) * max(args[0].dim(), args[1].dim(), 1) * _INDEX_BYTES]


def _masked_select_cpu_output(args, kwargs, out, empty):
    return empty(list(out.shape), out.dtype)


_masked_select_cpu_output.late = (0,)  # made after the sum's buffers are freed


class UpperBoundFeature(StepFeature):
    """--data-dependent upper-bound: the size-bounded ops answered at their bound, their kernels' other
    buffers as tracker rules, and the report's note on which ops were bounded."""

    name = "upper-bound"

    def __init__(self) -> None:
        self.bounded: BoundedOps | None = None

    def rules(self, step) -> TrackerRules:
        self.bounded = BoundedOps(in_backward=lambda: step.tracker.phase is Phase.BACKWARD)
        target = str(step.spec.target)
        return TrackerRules(scratch=self.bounded.scratch(target), chained=self.bounded.outputs(target))

    def contexts(self, step) -> list:
        return [self.bounded.active()]

    def finish(self, step) -> list[str]:
        if self.bounded is None or not self.bounded.calls:
            return []
        step.trace.bounded_ops = dict(self.bounded.calls)
        return [self.bounded.note()]
