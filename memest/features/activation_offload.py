"""--activation-offload: tensors saved for backward moved to host memory in the forward and back in backward, as
``torch.autograd.graph.save_on_cpu`` does it (torch/autograd/graph.py, torch 2.13.0, commit
cf30153c4c131c8164ee7798e5022d810682e2cb: ``pack_to_cpu`` / ``unpack_from_cpu``).

The traced step runs save_on_cpu's own pack and unpack hooks on every tensor autograd saves (the StepFeature
``pack`` seam; a real run enters them through ``loop``):

- pack: ``tensor.cpu()`` (pageable), or ``torch.empty(tensor.size(), pin_memory=...)`` + ``copy_`` (pinned): a host
  copy of the saved view's elements; autograd then holds the copy, so the device storage is freed unless something
  else still references it (a parameter, a tensor the forward keeps).
- unpack (backward): ``tensor.to(device)``: a new device tensor for the backward node, freed after it.

memest traces on fake CPU tensors. On ``--target cuda`` the saved tensors model GPU memory, so the hooks' device
moves are made copies (``_DeviceMoves``: ``Tensor.cpu()`` and ``Tensor.to(device)`` inside the hooks only): the
host copy becomes a host storage, the unpacked tensor a device one, as on a GPU. On ``--target cpu`` the hooks run
unchanged: ``tensor.cpu()`` of a CPU tensor is the tensor itself (pageable save_on_cpu moves nothing), the pinned
variant copies each saved tensor (into pageable memory where CUDA is absent) and backward uses that copy.

The host copies are host storages of their own kind (``StorageRecord.saved_copy``): ``Trace.host_peak(saved=True)``
is their peak, kept apart from --offload's model state (parallel/distributed.offloaded), which this never marks.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from memest.features.base import StepFeature
from memest.spec.choices import ActivationOffload, Target
from memest.trace.events import Category
from memest.units import format_bytes

SOURCE = ("torch.autograd.graph.save_on_cpu (torch/autograd/graph.py, torch 2.13.0 commit "
          "cf30153c4c131c8164ee7798e5022d810682e2cb)")


class _DeviceMoves(TorchFunctionMode):
    """Inside save_on_cpu's hooks on a modelled GPU: ``Tensor.cpu()`` and ``Tensor.to(device)`` copy, as a move
    between GPU and host memory does (on fake CPU tensors they would return the tensor itself)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu:
            return args[0].to("cpu", copy=True)
        if func is torch.Tensor.to:
            return func(*args, **{**kwargs, "copy": True})
        return func(*args, **kwargs)


def _storages(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


class ActivationOffloadFeature(StepFeature):
    """save_on_cpu's hooks on every saved tensor; the host copies they make marked as saved-tensor host memory."""

    name = "activation_offload"
    packs_saved = True

    def __init__(self, choice: ActivationOffload, moves: bool) -> None:
        self.choice = choice
        self.pinned = choice == ActivationOffload.SAVE_ON_CPU_PINNED
        self.moves = moves  # the saved tensors live in another memory than the host (--target cuda)
        self.hooks = torch.autograd.graph.save_on_cpu(pin_memory=self.pinned)
        self.tracing = False
        self.copied_bytes = 0  # bytes of the host copies the pack hook made (every call, every step)
        self.copies = 0
        self._step = None

    @staticmethod
    def moves_for(spec) -> bool:
        """Whether the saved tensors model device memory apart from the host (--target cuda)."""
        return spec.target == Target.CUDA

    # -- the library's hooks ---------------------------------------------------------------------
    def _scope(self) -> contextlib.AbstractContextManager:
        return _DeviceMoves() if self.moves else contextlib.nullcontext()

    def pack_saved(self, t: torch.Tensor):
        """save_on_cpu's pack hook on ``t``; counts (and, in a trace, marks) the host copy it made."""
        with self._scope():
            packed = self.hooks.pack_hook(t)
        source = t.untyped_storage()._cdata
        for copy in _storages(packed):
            if copy is t or copy.untyped_storage()._cdata == source:
                continue  # no copy: the tensor itself (pageable save_on_cpu on the host)
            self.copied_bytes += copy.untyped_storage().nbytes()
            self.copies += 1
            if self._step is not None:
                self._mark_host(copy)
        return packed

    def unpack_saved(self, packed):
        with self._scope():
            return self.hooks.unpack_hook(packed)

    def _mark_host(self, copy: torch.Tensor) -> None:
        tracker = self._step.tracker
        sid = tracker.storage_id(copy)
        if sid is None:
            return
        rec = self._step.trace.storages[sid]
        rec.classify(Category.ACTIVATIONS)
        rec.saved_for_backward = True
        rec.host = rec.saved_copy = True

    # -- the traced step -------------------------------------------------------------------------
    def contexts(self, step) -> list:
        @contextlib.contextmanager
        def tracing():
            self.tracing, self._step = True, step
            try:
                yield
            finally:
                self.tracing, self._step = False, None

        return [tracing()]

    def pack(self, step, t):
        return self.pack_saved(t)

    def unpack(self, step, packed):
        return self.unpack_saved(packed)

    # -- real runs (validate/): the same hooks around the user's loop ------------------------------
    def loop(self, model, spec) -> contextlib.AbstractContextManager:
        if self.tracing:  # the trace's own saved-tensor hooks call pack/unpack
            return contextlib.nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved)

    def finish(self, step) -> list[str]:
        return [note(step.trace, step.spec, self.moves)]


def note(trace, spec, moves: bool) -> str:
    """What the report says about the host copies."""
    kind = "pinned (page-locked: the OS cannot swap or reuse it)" if spec.activation_offload == \
        ActivationOffload.SAVE_ON_CPU_PINNED else "pageable"
    peak = saved_copies_peak(trace)
    if moves:
        return (f"--activation-offload {spec.activation_offload}: every tensor autograd saves is copied to {kind} host "
                f"memory in the forward and back to the GPU in backward ({SOURCE}); {format_bytes(peak)} peak in host "
                "memory, not in the GPU peak (weights saved for backward are copied too; the device copy is freed "
                "only where nothing else holds it); transfer streams are not modelled (copies are synchronous here)")
    if spec.activation_offload == ActivationOffload.SAVE_ON_CPU:
        return (f"--activation-offload save-on-cpu on --target cpu: the saved tensors are already in host memory, so "
                f"save_on_cpu's tensor.cpu() returns each one itself and moves nothing ({SOURCE})")
    return (f"--activation-offload save-on-cpu-pinned on --target cpu: save_on_cpu copies every saved tensor into a new "
            f"host buffer (pinned only where CUDA is available) and backward uses the copy ({SOURCE}); "
            f"{format_bytes(peak)} peak of such copies, counted in the host column (the same memory on --target cpu)")


def saved_copies_peak(trace) -> int:
    """Peak of the saved-tensor host copies, from the trace's events before its host events are split (the
    features' notes are made first); ``Trace.host_peak(saved=True)`` gives it after."""
    live = best = 0
    for sid, delta in trace.events:
        if trace.storages[sid].saved_copy:
            live += delta
            best = max(best, live)
    return best
