"""Model code that empties the CUDA cache during the traced step, recorded at the point it calls it.

The torch 2.13 calls that reach the CUDA caching allocator's ``emptyCache`` (device/allocator.py ``EMPTY_CACHE``):

- ``torch.cuda.empty_cache()``: torch/cuda/memory.py, re-exported by torch/cuda/__init__.py;
  ``torch.get_device_module("cuda")`` (torch/__init__.py) is the ``torch.cuda`` module itself, so
  ``torch.get_device_module("cuda").empty_cache()`` is this call too;
- ``torch.accelerator.empty_cache()``: torch/accelerator/memory.py, re-exported by torch/accelerator/__init__.py
  (``torch._C._accelerator_emptyCache``: the current accelerator's allocator, CUDA's on a GPU).

Each does nothing unless its allocator is initialised (``torch.cuda.is_initialized()``,
``torch._C._accelerator_isAllocatorInitialized()``), and memest never initialises CUDA: on the trace's CPU both are
no-ops. While the step runs, :func:`recording` puts in their place a function that records an
:class:`~memest.trace.events.EmptyCache` after the events so far and touches no device; the originals come back
however the step ends.

Not seen: a reference taken before the trace (``from torch.cuda import empty_cache`` at a model file's top), a
call guarded by ``torch.cuda.is_available()`` (False where the CLI hides CUDA), ``torch.xpu`` / ``torch.mps`` /
``torch.mtia``'s own (other allocators). accelerate's ``clear_device_cache`` (Trainer's ``torch_empty_cache_steps``)
is such a guarded call: features/empty_cache.py records it instead.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator

import torch

from memest.trace.events import Trace

# (module, attribute, the call as model code writes it)
CALLS = (
    ("torch.cuda", "empty_cache", "torch.cuda.empty_cache"),
    ("torch.cuda.memory", "empty_cache", "torch.cuda.empty_cache"),
    ("torch.accelerator", "empty_cache", "torch.accelerator.empty_cache"),
    ("torch.accelerator.memory", "empty_cache", "torch.accelerator.empty_cache"),
)


def _recorder(trace: Trace, where: Callable[[], tuple[int, str]], name: str):
    def empty_cache() -> None:
        iteration, place = where()
        trace.empty_cache(iteration, f"{name}() in {place}")

    empty_cache.__name__ = empty_cache.__qualname__ = "empty_cache"
    # recorded at each call in event order, never traced into a compiled graph (dynamo would replay the recording at
    # the graph's end): a graph break here. torch 2.13's dynamo lists torch.cuda.memory.empty_cache among its in-graph
    # functions (torch/_dynamo/trace_rules.py); where a real compiled graph runs it among its kernels is not checked
    return torch.compiler.disable(empty_cache)


@contextlib.contextmanager
def recording(trace: Trace, where: Callable[[], tuple[int, str]]) -> Iterator[None]:
    """While entered, the calls of ``CALLS`` record an EmptyCache in ``trace`` (``where()``: the traced step's
    number and where the step is, e.g. "the forward of module 'blocks.1'") and do nothing else."""
    saved: list[tuple[object, str, object]] = []
    try:
        for module_name, attr, name in CALLS:
            module = importlib.import_module(module_name)
            saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, _recorder(trace, where, name))
        yield
    finally:
        for module, attr, original in reversed(saved):
            setattr(module, attr, original)
