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

``--activation-offload torchtune`` (``TorchtuneOffloadFeature``, ``TorchtuneRules``) prices torchtune 0.6.1's
``OffloadActivations`` instead: its pack and unpack run from memest code, line by line with the class (line numbers
of torchtune/training/_activation_offloading.py), the streams' stashes kept, their synchronisation left out; proven
against the class itself, copied into tests/torchtune_activation_offloading.py, on real CPU steps.

The host copies are host storages of their own kind (``StorageRecord.saved_copy``): ``Trace.host_peak(saved=True)``
is their peak, kept apart from --offload's model state (parallel/distributed.offloaded), which this never marks.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from memest.features.base import StepFeature
from memest.features.empty_cache import bitsandbytes_imported
from memest.spec.choices import ActivationOffload, Target
from memest.trace.events import Category
from memest.trace.tracker import TO_COPY
from memest.units import format_bytes

SOURCE = ("torch.autograd.graph.save_on_cpu (torch/autograd/graph.py, torch 2.13.0 commit "
          "cf30153c4c131c8164ee7798e5022d810682e2cb)")


class _DeviceMoves(TorchFunctionMode):
    """Inside save_on_cpu's hooks on a modelled GPU: ``Tensor.cpu()`` and ``Tensor.to(device)`` copy, as a move
    between GPU and host memory does (on fake CPU tensors they would return the tensor itself). In a trace the copy
    (``aten._to_copy`` to the tensor's own device and dtype) is made by ``StorageTracker.made_like`` and recorded as
    that op, without a fake-tensor dispatch (two per saved tensor: benchmarks/activation-offload.md)."""

    def __init__(self, tracker=None) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cpu and len(args) == 1 and not kwargs:
            return self._copy(args[0], lambda: args[0].to("cpu", copy=True))
        if func is torch.Tensor.to:
            if len(args) == 2 and isinstance(args[1], torch.device) and set(kwargs) <= {"non_blocking"}:
                return self._copy(args[0], lambda: func(*args, **{**kwargs, "copy": True}))
            return func(*args, **{**kwargs, "copy": True})
        if self.tracker is not None and func is torch.empty and len(args) == 1 and _pinned_empty(kwargs):
            # the pinned variant's host buffer (pin_memory is False without CUDA: pageable, as traced)
            made = self.tracker.made_empty(args[0], kwargs.get("dtype") or torch.get_default_dtype())
            if made is not None:
                return made
        if (self.tracker is not None and func is torch.Tensor.copy_ and len(args) == 2 and set(kwargs) <= {"non_blocking"}
                and not self.tracker.has_rule(COPY_) and _same_fake(*args)):
            return args[0]  # the copy into that buffer: in place, nothing allocated, no FLOPs: nothing to record
        return func(*args, **kwargs)

    def _copy(self, t, op):
        """The copy of ``t`` on its own (fake) device, made fast where the tracker can, else by ``op()``."""
        made = None
        if self.tracker is not None and not (t.requires_grad and torch.is_grad_enabled()):
            made = self.tracker.made_like(t, TO_COPY)
        return op() if made is None else made


COPY_ = torch.ops.aten.copy_.default


def _pinned_empty(kwargs: dict) -> bool:
    """save_on_cpu's pinned buffer: ``torch.empty(size, dtype=, layout=torch.strided, pin_memory=)``."""
    return set(kwargs) <= {"dtype", "layout", "pin_memory"} and kwargs.get("layout", torch.strided) == torch.strided


def _same_fake(dst, src) -> bool:
    return (type(dst) is FakeTensor and type(src) is FakeTensor and dst.shape == src.shape
            and dst.dtype == src.dtype and not dst.requires_grad)


def _storages(obj) -> list[torch.Tensor]:
    if type(obj) is tuple and not any(type(x) in (tuple, list, dict) for x in obj):  # save_on_cpu's (device, tensor)
        return [t for t in obj if isinstance(t, torch.Tensor)]
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
        self._moves: _DeviceMoves | None = None

    @staticmethod
    def moves_for(spec) -> bool:
        """Whether the saved tensors model device memory apart from the host (--target cuda)."""
        return spec.target == Target.CUDA

    # -- the library's hooks ---------------------------------------------------------------------
    def _scope(self) -> contextlib.AbstractContextManager:
        if not self.moves:
            return contextlib.nullcontext()
        if self._moves is None:  # one mode per traced step (or real run), entered in each hook
            self._moves = _DeviceMoves(self._step.tracker if self._step is not None else None)
        return self._moves

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
            self.tracing, self._step, self._moves = True, step, None
            try:
                yield
            finally:
                self.tracing, self._step, self._moves = False, None, None

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


# -- --activation-offload torchtune: torchtune's OffloadActivations ---------------------------------------------
TT_FILE = "torchtune/training/_activation_offloading.py"
TT_SOURCE = f"torchtune 0.6.1 {TT_FILE} (PyPI wheel torchtune-0.6.1)"
TT_MIN_OFFLOAD_SIZE = 1024  # OffloadActivations(min_offload_size=1024), l. 71
TT_MAX_FWD_STASH_SIZE = 5  # OffloadActivations(max_fwd_stash_size=5), l. 70


def rules_source(choice: ActivationOffload) -> str:
    """Whose rule the mode prices (the report's activation offload row, JSON ``activation_host.rules``)."""
    if choice == ActivationOffload.TRL:
        return trl_rules_source()
    if choice == ActivationOffload.TORCHTUNE:
        return (f"OffloadActivations(use_pin_memory=True, use_streams=True, max_fwd_stash_size="
                f"{TT_MAX_FWD_STASH_SIZE}, min_offload_size={TT_MIN_OFFLOAD_SIZE}) + NoOpManager on the output head, "
                f"as get_act_offloading_ctx_manager sets it up ({TT_SOURCE})")
    return SOURCE


class TorchtuneRules:
    """OffloadActivations' pack and unpack (``TT_FILE``, line numbers of torchtune 0.6.1), their bookkeeping run
    as the class runs it, with the CUDA streams' synchronisation left out: a traced step is one sequence of
    allocations, so ``wait_event``/``wait_stream`` order nothing here. What the streams cost in memory is their
    stashes, and those are kept exactly: ``fwd_stash`` holds each offloaded device tensor until the pack
    ``max_fwd_stash_size`` ids later (or the first backward node's hook), ``bwd_tensor_stash`` each tensor brought
    back until the next node that brings one back has run (or the end of backward).

    ``to_host(t)`` is torch.empty_like(t, pin_memory=..., device="cpu") + copy_ (l. 171-179); ``to_device(t)``
    is ``t.to("cuda")`` (l. 220, 275); the caller supplies them (copies of fake CPU tensors in a trace)."""

    def __init__(self, to_host, to_device, use_streams: bool = True,
                 max_fwd_stash_size: int = TT_MAX_FWD_STASH_SIZE, min_offload_size: int = TT_MIN_OFFLOAD_SIZE):
        self.to_host, self.to_device = to_host, to_device
        self.use_streams = use_streams
        self.min_tensor_size_bytes = min_offload_size
        self.max_fwd_stash_size = max_fwd_stash_size
        self.tracker: dict = {}  # tensor_id => (tensor, modified), l. 80
        self.tensor_id = 0
        self.is_first_forward_call = self.is_first_backward_call = True
        self.fwd_stash: dict = {}  # tensor_id => activation (l. 95; its event left out)
        self.bwd_tensor_stash: dict = {}  # l. 101
        self.bwd_ev_stash: dict = {}  # l. 102: which brought-back tensors recorded an event (True)
        self.curr_graph_id = self.curr_autograd_node = None
        self.record_streams = 0  # brought-back tensors a node's outputs still use (record_stream, l. 316-323)

    def pack(self, activation: torch.Tensor) -> int:  # pack_tensor, l. 133-200
        if self.is_first_forward_call:
            self.is_first_forward_call, self.is_first_backward_call = False, True
        num_bytes = activation.element_size() * activation.nelement()  # l. 126-131
        self.tensor_id += 1
        tensor_id = self.tensor_id
        if num_bytes >= self.min_tensor_size_bytes and not isinstance(activation, torch.nn.Parameter | torch.nn.Buffer):
            evicted = None
            if self.use_streams:  # l. 157-163: dereference the stash entries max_fwd_stash_size ids back
                for id_ in list(self.fwd_stash):
                    if id_ <= tensor_id - self.max_fwd_stash_size:
                        # l. 159 ``_, ev = self.fwd_stash[id]``: the loop variable holds the last evicted tensor
                        # until pack_tensor returns, so it is freed only after this pack's host copy is allocated
                        evicted = self.fwd_stash.pop(id_)
                    else:
                        break
            self.tracker[tensor_id] = (self.to_host(activation), True)
            del evicted
            if self.use_streams:
                self.fwd_stash[tensor_id] = activation  # l. 193: kept alive until its copy is done
        else:
            self.tracker[tensor_id] = (activation, False)
        return tensor_id

    def unpack(self, unpack_tensor_id: int) -> torch.Tensor:
        return self._unpack_streams(unpack_tensor_id) if self.use_streams else self._unpack_single(unpack_tensor_id)

    def _first_backward_call(self) -> None:
        self.is_first_backward_call, self.is_first_forward_call = False, True

    def _unpack_single(self, unpack_tensor_id: int) -> torch.Tensor:  # unpack_tensor_single_stream, l. 202-225
        if self.is_first_backward_call:
            self._first_backward_call()
        tensor, modified = self.tracker.pop(unpack_tensor_id)
        return self.to_device(tensor) if modified else tensor

    def _unpack_streams(self, unpack_tensor_id: int) -> torch.Tensor:  # unpack_tensor_with_streams, l. 227-346
        if self.is_first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()

            def wait_and_del_remaining_references() -> None:  # l. 232-245: at the end of backward
                for id_ in list(self.bwd_tensor_stash):
                    del self.bwd_tensor_stash[id_]

            torch.autograd.variable.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)
            self._first_backward_call()
        tensor, modified = self.tracker[unpack_tensor_id]
        if modified:
            graph_id = torch._C._current_graph_task_id()
            node = torch._C._current_autograd_node()
            prev_node_ids = []
            if graph_id == self.curr_graph_id and self.curr_autograd_node != node:  # l. 264-266
                self.curr_autograd_node = node
                prev_node_ids = list(self.bwd_tensor_stash)
            brought_back = unpack_tensor_id not in self.fwd_stash
            if not brought_back:  # l. 269-271: still on the device
                tensor = self.fwd_stash[unpack_tensor_id]
            else:  # l. 273-299
                tensor = self.to_device(tensor)
                self.bwd_tensor_stash[unpack_tensor_id] = tensor
                storage_refcount = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

            def hook(outputs, inputs):  # l. 301-340, after the node has run
                if brought_back:
                    unpacked = self.bwd_tensor_stash[unpack_tensor_id]
                    if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > storage_refcount:
                        del self.bwd_tensor_stash[unpack_tensor_id]  # record_stream(s0): freed when s0 is done
                        self.record_streams += 1
                    else:
                        self.bwd_ev_stash[unpack_tensor_id] = True
                self.fwd_stash.clear()  # l. 329-332
                for id_ in prev_node_ids:  # l. 335-338
                    self.bwd_ev_stash[id_]  # noqa: B018  (the event torchtune waits on: a KeyError there too)
                    del self.bwd_tensor_stash[id_]
                return outputs

            node.register_hook(hook)
        del self.tracker[unpack_tensor_id]
        return tensor


def output_head(model) -> torch.nn.Module | None:
    """The module get_act_offloading_ctx_manager puts under a NoOpManager (l. 400-417): ``model.output`` (a
    torchtune TransformerDecoder's head); a transformers model's head is ``get_output_embeddings()``."""
    base = getattr(model, "module", model)  # a wrapper (data parallel) holds the model
    head = getattr(base, "output", None)
    if isinstance(head, torch.nn.Module):
        return head
    getter = getattr(base, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    return head if isinstance(head, torch.nn.Module) else None


class TorchtuneOffloadFeature(ActivationOffloadFeature):
    """--activation-offload torchtune: OffloadActivations' rules (``TorchtuneRules``) on the tensors the model's
    forward saves (torchtune's recipes enter the context around ``self._model(**batch)`` only: the loss after the
    model saves its tensors on the device), none of the output head's (its NoOpManager)."""

    name = "activation_offload"
    use_streams = True  # torchtune's default, and its recipes' (OffloadActivations() in get_act_offloading_ctx_manager)

    def __init__(self, choice: ActivationOffload, moves: bool) -> None:
        super().__init__(choice, moves)
        self.pinned = True  # use_pin_memory=True (l. 68)
        self.offload_rules: TorchtuneRules | None = None
        self.in_model = self.in_head = False
        self.offloaded = 0  # tensors the pack copied to the host
        self.kept = 0  # tensors the pack kept (under min_offload_size, parameters)
        self.real_host_copies = 0  # real (not fake) host tensors in the traced step it copied (RNG states)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        # torch.empty_like(activation, pin_memory=True, device="cpu") + copy_ (l. 171-179): a new host buffer
        # (pinned on a CUDA machine; a CPU-only torch cannot pin, and pinning changes no byte count)
        if self._step is not None and not isinstance(t, FakeTensor):
            # a real host tensor in the traced step (a compiled checkpointed block saves the CPU RNG state,
            # 5,056 B): torchtune 0.6.1 copies it too (no device check), host to host, outside device memory
            with unset_fake_temporarily():
                copy = torch.empty_like(t, device="cpu")
                copy.copy_(t)
            self.real_host_copies += 1
            return copy
        if self._step is None:  # a real run
            copy = torch.empty_like(t, device="cpu")
            copy.copy_(t)
        else:  # in a trace the copy's values are nothing (fake tensors), its bytes the empty_like's: one op fewer
            copy = self._step.tracker.empty_like(t)  # per offloaded tensor, made without the fake mode's dispatch
        self.copied_bytes += copy.untyped_storage().nbytes()
        self.copies += 1
        if self._step is not None:
            self._mark_host(copy)
        return copy

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self._step is not None and not isinstance(t, FakeTensor):  # the real host copy above, back to the device
            with unset_fake_temporarily():
                return t.to("cpu", copy=True)
        if self._step is not None:  # .to("cuda") (l. 220, 275): a new device tensor of the same layout (a fake
            return self._step.tracker.empty_like(t)  # CPU tensor here: empty_like is that allocation, cheaper than .to)
        return t.to("cpu", copy=True)  # a real run on CPU: the move is a copy into a new buffer

    def pack_saved(self, t: torch.Tensor):
        if not self.in_model or self.in_head:
            return t  # outside the forward's context, or under the head's NoOpManager: saved as is
        if self.offload_rules is None:
            self.offload_rules = TorchtuneRules(self._to_host, self._to_device, use_streams=self.use_streams)
        before = self.copies
        packed = self.offload_rules.pack(t)
        if self.copies == before:
            self.kept += 1
        else:
            self.offloaded += 1
        return packed

    def unpack_saved(self, packed):
        return self.offload_rules.unpack(packed) if isinstance(packed, int) else packed

    @contextlib.contextmanager
    def _scopes(self, model):
        """The recipe's ``with activations_handling_ctx: model(...)`` and the head's NoOpManager, as forward hooks."""

        def flag(name, value):
            return lambda *args: setattr(self, name, value)

        handles = [model.register_forward_pre_hook(flag("in_model", True)),
                   model.register_forward_hook(flag("in_model", False), always_call=True)]
        head = output_head(model)
        if head is not None:
            handles += [head.register_forward_pre_hook(flag("in_head", True)),
                        head.register_forward_hook(flag("in_head", False), always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.in_model = self.in_head = False

    def contexts(self, step) -> list:
        return [*super().contexts(step), self._scopes(step.model)]

    def loop(self, model, spec) -> contextlib.AbstractContextManager:
        if self.tracing:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self._scopes(model))
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self.pack_saved, self.unpack_saved))
        return stack

    def finish(self, step) -> list[str]:
        head = output_head(step.model)
        peak = saved_copies_peak(step.trace)
        return [f"--activation-offload torchtune: {rules_source(self.choice)}: every tensor the model's forward saves "
                f"of at least {TT_MIN_OFFLOAD_SIZE} B that is not a parameter is copied to pinned host memory "
                f"({self.offloaded} offloaded, {self.kept} kept on the device per traced step); the last "
                f"{TT_MAX_FWD_STASH_SIZE} offloaded stay on the device until the next offload past them (the copy "
                "stream's fwd stash), and backward keeps each tensor it brings back until the next node that brings "
                f"one back has run (the bwd stash); {format_bytes(peak)} peak in host memory; "
                + (f"the output head ({type(head).__name__}) saves on the device (its NoOpManager)" if head is not None
                   else "no output head found: every layer offloads (torchtune warns the same)")
                + "; the loss after the model saves on the device (the recipes' context holds the forward only); "
                "the copies' timing is not modelled (streams synchronous here)"]


# -- --activation-offload trl: trl's port of OffloadActivations ---------------------------------------------------
TRL_FILE = "trl/models/activation_offloading.py"
TRL_SOURCE = f"trl 1.16 {TRL_FILE} (a port of torchtune's, with its own rules)"
TRL_FP8_CLASSES = ("Float8TrainingTensor", "ScaledMMConfig", "LinearMMConfig")  # kept on the device, l. 246


def trl_rules_source() -> str:
    return (f"OffloadActivations(use_pin_memory=True, use_streams=True, min_offload_size={TT_MIN_OFFLOAD_SIZE}, "
            f"max_fwd_stash_size={TT_MAX_FWD_STASH_SIZE}) + NoOpManager on the output head, as "
            "get_act_offloading_ctx_manager(model) sets it up for SFT/DPO/KTO/Reward trainers' "
            f"activation_offloading=True, its context around the whole training_step ({TRL_SOURCE})")


class TrlRules(TorchtuneRules):
    """trl's OffloadActivations (``TRL_FILE``, line numbers of trl 1.16): torchtune's class (``TorchtuneRules``: the
    same stashes, eviction and backward hooks) with trl's own pack rules, l. 200-340, in this order:

    - l. 220-225: with streams, a tensor whose storage key (data_ptr + storage_offset, dtype; l. 53-80) is already
      tracked (an offloaded tensor still in the fwd stash, or a tensor kept by this rule) stays on the device;
    - l. 228: a tensor not on the accelerator stays (torchtune copies it);
    - l. 233, 238: under ``min_offload_size`` bytes, a Parameter or Buffer: stays (as torchtune);
    - l. 246: a torchao float8 tensor stays; l. 257: a tensor sharing a parameter's storage stays (torchtune
      offloads a view of a weight);
    - l. 267-278: a non-contiguous or offset view is first cloned contiguous on the device (a device allocation the
      fwd stash then holds); a broadcast view (a 0 stride) copies its whole storage (l. 303-316).

    ``storage_key(t)`` identifies a storage (its address on a GPU), ``is_device(t)`` says the tensor is in device
    memory, ``param_storages`` the parameters' storages (``update_model_params``, l. 545-575)."""

    def __init__(self, to_host, to_device, storage_key, is_device, param_storages, use_streams: bool = True) -> None:
        super().__init__(to_host, to_device, use_streams=use_streams)
        self.storage_key, self.is_device, self.param_storages = storage_key, is_device, param_storages
        self.storage_to_tensor_id: dict = {}  # l. 141-142
        self._storage_key_by_tensor_id: dict = {}
        self.cloned = 0  # views cloned contiguous on the device before their copy (l. 273-278)

    def enter(self) -> None:  # __enter__, l. 577-604: a step starts afresh
        self.tracker.clear()
        self.storage_to_tensor_id.clear()
        self._storage_key_by_tensor_id.clear()
        self.tensor_id = 0
        self.is_first_forward_call = self.is_first_backward_call = True
        self.bwd_tensor_stash.clear()
        self.bwd_ev_stash.clear()
        self.fwd_stash.clear()

    def _track(self, key, tensor_id) -> None:  # track_storage_key, l. 190-192
        self.storage_to_tensor_id[key] = tensor_id
        self._storage_key_by_tensor_id[tensor_id] = key

    def _release(self, tensor_id) -> None:  # release_storage_key, l. 194-197
        key = self._storage_key_by_tensor_id.pop(tensor_id, None)
        if key is not None and self.storage_to_tensor_id.get(key) == tensor_id:
            del self.storage_to_tensor_id[key]

    def _keep(self, activation, tensor_id) -> int:
        self.tracker[tensor_id] = (activation, False, None, None, None)
        return tensor_id

    def pack(self, activation: torch.Tensor) -> int:  # pack_tensor, l. 200-340
        if self.is_first_forward_call:  # l. 202-211
            self.is_first_forward_call, self.is_first_backward_call = False, True
            self.storage_to_tensor_id, self._storage_key_by_tensor_id = {}, {}
        num_bytes = activation.element_size() * activation.nelement()  # l. 186-188
        self.tensor_id += 1
        tensor_id = self.tensor_id
        key = (self.storage_key(activation), activation.storage_offset(), activation.dtype)  # l. 220, 53-80
        if self.use_streams and key in self.storage_to_tensor_id:  # l. 221-225
            self._keep(activation, tensor_id)
            self._track(key, tensor_id)
            return tensor_id
        if (not self.is_device(activation) or num_bytes < self.min_tensor_size_bytes  # l. 228, 233
                or isinstance(activation, torch.nn.Parameter | torch.nn.Buffer)  # l. 238
                or type(activation).__name__ in TRL_FP8_CLASSES  # l. 246
                or self.storage_key(activation) in self.param_storages):  # l. 251-262
            return self._keep(activation, tensor_id)
        has_broadcast = 0 in activation.stride()  # l. 267
        if not has_broadcast and (not activation.is_contiguous() or activation.storage_offset() != 0):  # l. 273-278
            self.cloned += 1
            activation = (activation.clone(memory_format=torch.contiguous_format) if activation.storage_offset() != 0
                          else activation.contiguous())
        evicted = None
        if self.use_streams:  # l. 280-291, as torchtune: ``_, ev = ...`` holds the last evicted tensor till return
            for id_ in list(self.fwd_stash):
                if id_ <= tensor_id - self.max_fwd_stash_size:
                    evicted = self.fwd_stash.pop(id_)
                    self._release(id_)
                else:
                    break
        stride, offset, shape = activation.stride(), activation.storage_offset(), activation.size()  # l. 294-296
        if has_broadcast:  # l. 303-316: the whole storage, as a 1-d tensor of its elements
            flat = torch.as_strided(activation, size=(activation.untyped_storage().nbytes() // activation.element_size(),),
                                    stride=(1,), storage_offset=0)
            cpu_tensor = self.to_host(flat)
        else:  # l. 318-320
            cpu_tensor = self.to_host(activation)
        self.tracker[tensor_id] = (cpu_tensor, True, stride, offset, shape)  # l. 323-329
        del evicted
        if self.use_streams:  # l. 331-338
            self.fwd_stash[tensor_id] = activation
            self._track(key, tensor_id)
        return tensor_id

    def _back(self, entry) -> torch.Tensor:  # l. 364-375, 436-447: .to(accelerator) + as_strided to the saved layout
        tensor, _, stride, offset, shape = entry
        tensor = self.to_device(tensor)
        return torch.as_strided(tensor, size=shape, stride=stride, storage_offset=offset) if stride is not None \
            else tensor

    def _unpack_single(self, unpack_tensor_id: int) -> torch.Tensor:  # unpack_tensor_single_stream, l. 342-383
        if self.is_first_backward_call:
            self.is_first_backward_call = False
        entry = self.tracker[unpack_tensor_id]
        tensor = self._back(entry) if entry[1] else entry[0]
        del self.tracker[unpack_tensor_id]
        self._release(unpack_tensor_id)
        if not self.tracker:  # l. 381-382
            self.is_first_forward_call = True
        return tensor

    def _unpack_streams(self, unpack_tensor_id: int) -> torch.Tensor:  # unpack_tensor_with_streams, l. 385-535
        if self.is_first_backward_call:
            self.curr_graph_id = torch._C._current_graph_task_id()

            def wait_and_del_remaining_references() -> None:  # l. 391-397
                for id_ in list(self.bwd_tensor_stash):
                    del self.bwd_tensor_stash[id_]

            torch.autograd.variable.Variable._execution_engine.queue_callback(wait_and_del_remaining_references)
            self.is_first_backward_call = False
        entry = self.tracker[unpack_tensor_id]
        tensor = entry[0]
        if entry[1]:
            graph_id = torch._C._current_graph_task_id()
            node = torch._C._current_autograd_node()
            prev_node_ids = []
            if graph_id == self.curr_graph_id and self.curr_autograd_node != node:  # l. 424-426
                self.curr_autograd_node = node
                prev_node_ids = list(self.bwd_tensor_stash)
            brought_back = unpack_tensor_id not in self.fwd_stash
            if not brought_back:  # l. 429-431
                tensor = self.fwd_stash[unpack_tensor_id]
            else:  # l. 432-471
                tensor = self._back(entry)
                self.bwd_tensor_stash[unpack_tensor_id] = tensor
                storage_refcount = torch._C._storage_Use_Count(tensor.untyped_storage()._cdata)

            def hook(outputs, inputs):  # l. 473-524
                if brought_back and unpack_tensor_id in self.bwd_tensor_stash:  # l. 492: trl's guard
                    unpacked = self.bwd_tensor_stash[unpack_tensor_id]
                    if torch._C._storage_Use_Count(unpacked.untyped_storage()._cdata) > storage_refcount:
                        del self.bwd_tensor_stash[unpack_tensor_id]  # record_stream(s0), l. 500-502
                        self.record_streams += 1
                    else:
                        self.bwd_ev_stash[unpack_tensor_id] = True
                for id_ in list(self.fwd_stash):  # l. 508-512
                    del self.fwd_stash[id_]
                    self._release(id_)
                for id_ in prev_node_ids:  # l. 515-522: trl's guards, no KeyError
                    self.bwd_ev_stash.pop(id_, None)
                    self.bwd_tensor_stash.pop(id_, None)
                return outputs

            node.register_hook(hook)
        del self.tracker[unpack_tensor_id]  # l. 529-534
        self._release(unpack_tensor_id)
        if not self.tracker:
            self.is_first_forward_call = True
        return tensor


def trl_output_heads(model) -> list[torch.nn.Module]:
    """The modules get_act_offloading_ctx_manager puts under its NoOpManager (l. 697-760): the first of ``output``
    (or ``output.linear``), ``lm_head``, ``decoder.output`` / ``decoder.lm_head``, ``final_layer_norm`` / ``ln_f``,
    ``head``, on the model unwrapped from ``.module`` and a PEFT model's ``base_model``; then every module whose
    name contains "liger"."""
    if model is None:
        return []
    base = getattr(model, "module", model)  # l. 698-700
    if hasattr(base, "base_model") and hasattr(base, "peft_config"):  # l. 702-703
        base = base.base_model
    head = None
    if hasattr(base, "output"):  # l. 706-714
        out = base.output
        head = out if isinstance(out, torch.nn.Module) else getattr(out, "linear", None)
    elif hasattr(base, "lm_head"):  # l. 717-720
        head = base.lm_head
    elif hasattr(base, "decoder"):  # l. 723-733
        head = getattr(base.decoder, "output", None) or getattr(base.decoder, "lm_head", None)
    elif hasattr(base, "final_layer_norm") or hasattr(base, "ln_f"):  # l. 736-740
        head = getattr(base, "final_layer_norm", None) or base.ln_f
    elif isinstance(getattr(base, "head", None), torch.nn.Module):  # l. 743-746
        head = base.head
    heads = [head] if isinstance(head, torch.nn.Module) else []
    return heads + [m for name, m in base.named_modules() if "liger" in name.lower()]  # l. 757-760


class TrlOffloadFeature(TorchtuneOffloadFeature):
    """--activation-offload trl: trl's OffloadActivations rules (``TrlRules``) on every tensor the training step
    saves (trl's trainers enter the context around ``training_step``: the model's forward, the loss and backward),
    none of the output head's (its NoOpManager, ``trl_output_heads``). Each model forward with nothing left
    unpacked starts a step (``__enter__`` clears the class's state)."""

    def __init__(self, choice: ActivationOffload, moves: bool) -> None:
        super().__init__(choice, moves)
        self.params: set = set()
        self.heads: list[str] = []  # the NoOpManager's modules' classes (the trace releases its model before finish)
        self.bitsandbytes = ""  # why the run imports bitsandbytes ('' : not known to): __enter__ empties the cache

    def _key(self, t: torch.Tensor):
        if self._step is not None:
            sid = self._step.tracker.storage_id(t)
            if sid is not None:
                return sid
        return ("storage", t.untyped_storage()._cdata)  # a real run: the storage itself (its address on a GPU)

    def _is_device(self, t: torch.Tensor) -> bool:
        if self._step is not None:
            return isinstance(t, FakeTensor)  # a real tensor in a trace is host memory (the CPU RNG state)
        return True  # the real runs this loop serves keep the step's tensors in the device's place

    def pack_saved(self, t: torch.Tensor):
        if not self.in_model or self.in_head:
            return t
        if self.offload_rules is None:
            self.offload_rules = TrlRules(self._to_host, self._to_device, self._key, self._is_device, self.params,
                                          use_streams=self.use_streams)
        before = self.copies
        packed = self.offload_rules.pack(t)
        if self.copies == before:
            self.kept += 1
        else:
            self.offloaded += 1
        return packed

    @contextlib.contextmanager
    def _scopes(self, model):
        self.params.clear()
        self.params.update(self._key(p) for p in model.parameters())  # update_model_params, l. 545-575

        def start(*args):
            self.in_model = True
            fresh = self.offload_rules is None or not self.offload_rules.tracker  # a training_step begins
            if self.offload_rules is not None and not self.offload_rules.tracker:
                self.offload_rules.enter()
            if fresh and self.bitsandbytes and self._step is not None:
                # l. 602-603: if "bitsandbytes" in sys.modules: self.device_module.empty_cache()
                self._step.trace.empty_cache(self._step.tracker.iteration, "trl's OffloadActivations.__enter__ "
                                             f"(l. 602-603: bitsandbytes imported, {self.bitsandbytes})")

        def flag(value):
            return lambda *args: setattr(self, "in_head", value)

        handles = [model.register_forward_pre_hook(start)]
        self.heads = [type(head).__name__ for head in trl_output_heads(model)]
        for head in trl_output_heads(model):
            handles += [head.register_forward_pre_hook(flag(True)),
                        head.register_forward_hook(flag(False), always_call=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.in_model = self.in_head = False

    def contexts(self, step) -> list:
        self.bitsandbytes = bitsandbytes_imported(step.spec)
        return super().contexts(step)

    def finish(self, step) -> list[str]:
        heads = self.heads
        peak = saved_copies_peak(step.trace)
        return [f"--activation-offload trl: {trl_rules_source()}: every tensor the training step saves of at least "
                f"{TT_MIN_OFFLOAD_SIZE} B that is not a parameter, a view of one's storage, or a second save of a "
                f"storage still in the fwd stash is copied to pinned host memory ({self.offloaded} offloaded, "
                f"{self.kept} kept on the device per traced step; views are cloned contiguous on the device first); "
                f"the last {TT_MAX_FWD_STASH_SIZE} offloaded stay on the device until the next offload past them, "
                f"backward keeps each tensor it brings back until the next node that brings one back has run; "
                f"{format_bytes(peak)} peak in host memory; "
                + (f"the output head ({heads[0]}) saves on the device (its NoOpManager)" if heads
                   else "no output head found: every layer offloads (trl warns the same)")
                + "; the loss offloads too (the context holds the whole training_step); the copies' timing is not "
                "modelled (streams synchronous here); a freed storage's address reused within the fwd stash (which "
                "trl would take for the same storage) is not modelled; "
                + (f"its __enter__ empties the device cache at each training_step ({self.bitsandbytes} imports "
                   "bitsandbytes; l. 602-603), replayed" if self.bitsandbytes else
                   "its __enter__ empties the device cache at each training_step only where bitsandbytes is imported "
                   "(l. 602-603), which this run's options do not say (peft's LoRA imports it wherever it is "
                   "installed): not replayed")]
