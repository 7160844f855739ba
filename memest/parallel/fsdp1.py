"""--fsdp-version 1: torch's FullyShardedDataParallel (FSDP1) with ``use_orig_params=False``, as fsdp_qlora's train.py
and accelerate / TrainingArguments (``fsdp_version: 1``, their default) wrap a model (docs/sharding.md).

Each wrapped unit's parameters become one ``FlatParameter`` (torch/distributed/fsdp/_flat_param.py) holding this
rank's padded shard; FSDP1 all-gathers the whole unit into ``_full_param_padded`` (a storage it grows and frees with
``_typed_storage()._resize_``) on its unshard stream, computes with views of it, and reduce-scatters the unit's
whole unsharded flat gradient on its post-backward stream. So a unit's parameters, gathered or not, are one
allocation, not one per parameter as under FSDP2's ``fully_shard``. NO_SHARD (``--shard none``): every rank keeps
each unit's whole flat parameter (no all-gather) and all-reduces its flat gradient in place (``_all_reduce_grad``);
fsdp_qlora's ``--sharding_strategy ddp`` and accelerate's ``NO_SHARD`` run it, not DDP's gradient buckets.

Units (the auto-wrap policy): each repeated block (the units FSDP2 uses, ``features/checkpointing.repeated_blocks``)
and the root; where some parameters are frozen and others train (LoRA), also each leaf module whose weight trains,
peft's ``fsdp_auto_wrap_policy`` and fsdp_qlora's ``lambda_policy_fn`` (train.py, 05ed9f2): with
``use_orig_params=False`` one flat parameter must be all frozen or all trainable.

The trace runs torch's own FSDP1 under the fake process group; ``instrument`` names its buffers (the all-gather into
the unsharded flat parameter, the low-precision shard, the reduce-scatter) and classifies the unsharded flat
parameter and gradient as their unit's parameters and gradients.

The wrap itself (``load_events``): ``FullyShardedDataParallel(model, device_id=...)`` over a model on the host (CPU
or meta, as fsdp_qlora's train.py, accelerate and TrainingArguments build it for FSDP1) materialises each unit on
the GPU, flattens it and keeps this rank's shard, unit after unit; the blocks it frees stay in the caching
allocator's cache (no ``empty_cache`` follows the wrap in those loops), so the step starts with them reserved. The
trace wraps on the fake CPU, where no move happens and the wrap is not tracked, so its device allocations are
rebuilt here from each unit's FlatParameter, in torch's order (torch 2.13, torch/distributed/fsdp/_init_utils.py
``_init_param_handle_from_module`` and ``_init_param_handle_from_params``; _flat_param.py ``FlatParamHandle``):
1. ``_move_module_to_device``: each of the unit's parameters, then its buffers that no inner unit moved, to the
   device (``_move_states_to_device``: ``tensor.data = tensor.to(device)``); a meta module's ``param_init_fn``
   (``to_empty``) allocates the same bytes. The buffers stay (the step's own storages); bitsandbytes' quant_state
   moves with its weight (``Params4bit.to`` calls ``quant_state.to(device)``), and memest's 4-bit stand-in holds it
   as the layer's buffers (features/quant.py), so it moves here too.
2. ``sync_module_states=True``: ``_sync_module_params_and_buffers`` -> ``_sync_params_and_buffers`` ->
   c10d ``broadcast_coalesced`` (torch/csrc/distributed/c10d/comm.cpp): the states bucketed by
   ``compute_bucket_assignment_by_size`` up to ``PARAM_BROADCAST_BUCKET_SIZE`` (250 MiB; a bucket closes once it
   reaches the limit), each bucket of two or more tensors flattened into one new tensor (``flatten_dense_tensors``;
   a bucket of one contiguous tensor is broadcast as a view of it: torch/csrc/utils/tensor_flatten.h, no allocation),
   at most 2 in flight. ``BroadcastWork::finish`` waits for the broadcast on the current stream only (no CPU wait),
   then the bucket is freed. ProcessGroupNCCL in the torch of 2024's runs (2.2) ``recordStream``'d a collective's
   tensors on its NCCL stream unless ``TORCH_NCCL_AVOID_RECORD_STREAMS=1`` (pytorch/pytorch#89880, #97053), so the
   freed bucket stays out of the cache until the broadcast ends; later torch stashes them in the Work instead and
   warns "TORCH_NCCL_AVOID_RECORD_STREAMS is the default now" (in pytorch main by 2025-04-10: pytorch/torchtitan#1088),
   so the bucket is free at once. memest's point estimate frees at once; the high end of reserved keeps each bucket
   pending (``Wrap.marks``) until the CPU waits for the GPU, the worst case of either torch.
3. ``FlatParamHandle.__init__``: ``flatten_tensors`` = ``torch.cat`` of the parameters (with alignment padding)
   into the unsharded flat parameter.
4. ``shard()``: ``_get_shard`` clones this rank's chunk (and ``F.pad``s it to the first chunk's size where it is
   shorter), then frees the unsharded flat parameter (``_typed_storage()._resize_(0)``). NO_SHARD (``--shard none``)
   skips this: the concatenation of step 3 is the flat parameter (``uses_sharded_strategy`` False).
5. ``CPUOffload(offload_params=True)``: ``flat_param_to(cpu)``: the device shard freed.
6. The moved parameters are freed when ``_init_param_handle_from_module`` returns (its ``managed_params`` list held
   them).
Units initialise inner first (``_recursive_wrap`` wraps children before their parent), the root last.
SIMPLIFICATION: the few-element padding tensors of step 3 are left out. The quant_state is broadcast here as the
stand-in's buffers are (in bitsandbytes it is no buffer, so sync_module_states does not broadcast it: its bytes, about
1/64 of the packed weights', sit in the broadcast buckets here).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from memest.device.allocator import FREE_EVENT_ID, GPU_PASSED_ID, RECORD_STREAM_ID
from memest.spec import RunSpec
from memest.spec.choices import Offload, Shard, Target
from memest.trace.dtype import HALF
from memest.trace.events import Category

PARAM_BROADCAST_BUCKET_SIZE = 250 * 1024 * 1024  # torch/distributed/fsdp/_init_utils.py (torch 2.13), line 60
BROADCASTS_IN_FLIGHT = 2  # torch/csrc/distributed/c10d/comm.cpp broadcast_coalesced: ``max_in_flight = 2``
# ids of the wrap's device allocations that are not the step's storages (the replay's ids; the step's are >= 0,
# device/usage.py's cuBLAS workspaces -1 and -2, allocator.EMPTY_CACHE_ID -(1 << 40))
LOAD_ID_BASE = -(1 << 42)


def _trainable_leaf(module: nn.Module) -> bool:
    """peft's fsdp_auto_wrap_policy ``lambda_policy_fn`` (peft/utils/other.py), fsdp_qlora's train.py the same."""
    weight = getattr(module, "weight", None)
    return len(list(module.named_children())) == 0 and weight is not None and weight.requires_grad


def wrap(model: nn.Module, spec: RunSpec, units: list[str]) -> tuple[nn.Module, str, list[str]]:
    """``model`` wrapped by FSDP1: (the root FullyShardedDataParallel, a description, the unit names, '' the root)."""
    from torch.distributed.fsdp import CPUOffload, MixedPrecision, ShardingStrategy
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    modules = dict(model.named_modules())
    blocks = {id(modules[name]) for name in units}
    # not a list of the parameters: held across the FSDP call it would keep every unit's original parameters alive
    # until the root is wrapped, which FSDP1 does not (each unit's are released once it is flattened)
    trains = {p.requires_grad for p in model.parameters()}
    mixed_grad = trains == {True, False}
    leaves = [name for name, m in modules.items() if mixed_grad and name and id(m) not in blocks and _trainable_leaf(m)]
    chosen = blocks | {id(modules[name]) for name in leaves}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in chosen)
    strategy = {Shard.ZERO3: ShardingStrategy.FULL_SHARD, Shard.ZERO2: ShardingStrategy.SHARD_GRAD_OP,
                Shard.NONE: ShardingStrategy.NO_SHARD}[spec.shard]
    kwargs: dict = {}
    if spec.mixed:  # gather and compute in 16-bit, reduce gradients in fp32 (fp32 sharded flat parameters)
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=HALF[spec.precision], reduce_dtype=torch.float32)
    if spec.offload == Offload.PARAMS:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    with _sync_on_a_cpu(), warnings.catch_warnings():
        # torch marks NO_SHARD deprecated ("please use DistributedDataParallel instead"); the runs traced still use it
        warnings.filterwarnings("ignore", message="The `NO_SHARD` sharding strategy is deprecated")
        root = FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, device_id=torch.device("cpu"),
                    use_orig_params=False, limit_all_gathers=True, sync_module_states=spec.fsdp_sync_module_states,
                    **kwargs)
    what = f"FSDP1 FullyShardedDataParallel({strategy.name}, use_orig_params=False)"
    if spec.offload == Offload.PARAMS:
        what += " + CPUOffload(offload_params=True)"
    if spec.fsdp_sync_module_states:
        what += " + sync_module_states"
    if spec.mixed:
        what += f" + MixedPrecision(param_dtype={str(HALF[spec.precision]).removeprefix('torch.')}, reduce_dtype=float32)"
    names = [name for name in modules if id(modules[name]) in chosen]
    n = len(names) + 1
    extra = f" ({len(leaves)} of them trainable leaves)" if leaves else ""
    return root, f"{what}, {n} units{extra}", names + [""]


@contextlib.contextmanager
def _sync_on_a_cpu() -> Iterator[None]:
    """``sync_module_states=True`` refuses module states on the CPU (_init_utils.py
    ``_check_module_states_for_sync_module_states``: NCCL broadcasts device tensors); memest wraps on the CPU (fake
    process group in the trace, gloo for the ground truth, which broadcasts CPU tensors), so the check is skipped
    while it wraps: the broadcast itself runs as torch runs it."""
    from torch.distributed.fsdp import _init_utils

    original = _init_utils._check_module_states_for_sync_module_states
    _init_utils._check_module_states_for_sync_module_states = lambda module_states: None
    try:
        yield
    finally:
        _init_utils._check_module_states_for_sync_module_states = original


@contextlib.contextmanager
def cpu_offload_without_a_gpu() -> Iterator[None]:
    """CPUOffload(offload_params=True) pins its host shards and gradients (``_local_shard.pin_memory()``,
    ``torch.zeros_like(...).pin_memory()``, _flat_param.py ``init_flat_param_attributes``); pinning needs an
    accelerator ("Cannot access accelerator device when none is available"). On a GPU ``pin_memory()`` returns a
    pinned copy of the same bytes, so the trace and the CPU ground truth both run it as a plain copy
    (``clone``): the bytes held are the same; pinned pages' speed is not memory. Its post-backward callback also
    waits for the offloaded gradients' copies with ``current_stream().synchronize()``, which ``torch.cpu.Stream``
    lacks; CPU work is synchronous, so there it returns at once."""
    original = torch.Tensor.pin_memory
    had_sync = hasattr(torch.cpu.Stream, "synchronize")

    def pin_memory(self, *args, **kwargs):
        return self.clone()

    torch.Tensor.pin_memory = pin_memory
    if not had_sync:
        torch.cpu.Stream.synchronize = lambda self: None
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original
        if not had_sync:
            del torch.cpu.Stream.synchronize


def flat_params(root: nn.Module) -> list[nn.Parameter]:
    """Every unit's FlatParameter (this rank's shard)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    out = []
    for m in FSDP.fsdp_modules(root):
        handle = m._handle
        if handle is not None:
            out.append(handle.flat_param)
    return out


@contextlib.contextmanager
def instrument(tracker, spec: RunSpec, owner_of_param: dict[int, str]) -> Iterator[None]:
    """While the step runs: FSDP1's unshard (all-gather into the unsharded flat parameter) and post-backward
    (reduce-scatter of the unsharded flat gradient) labelled, and what they hold classified as the unit's parameters
    and gradients. ``UntypedStorage.resize_`` is recorded by ``distributed.instrument``, which enters this."""
    from torch.distributed.fsdp import _flat_param as flat_mod
    from torch.distributed.fsdp import _runtime_utils as runtime

    saved = {"unshard": flat_mod.FlatParamHandle.unshard, "post_backward": runtime._post_backward_hook,
             "pre_unshard": flat_mod.FlatParamHandle.pre_unshard,
             "init": flat_mod.FlatParamHandle.init_flat_param_attributes}
    offload = spec.offload == Offload.PARAMS
    # --target cuda: the offloaded shard is copied to the device before the all-gather (pre_unshard's
    # ``flat_param_to(self.device)``; with MixedPrecision its low-precision ``_mp_shard`` is that copy, allocated on
    # the device in the trace too); on a CPU the shard is already where FSDP computes, as in the trace
    h2d = offload and spec.target == Target.CUDA and not spec.mixed
    copies: dict[int, int] = {}  # id(handle) -> the unseen device copy of its shard
    stack = contextlib.ExitStack()

    def owner(flat_param) -> str:
        return owner_of_param.get(id(flat_param), "")

    def init(handle):
        out = saved["init"](handle)
        if offload:  # the pinned host shard and host gradient: the unit's, in host memory
            flat = handle.flat_param
            for t, category in ((flat._local_shard, Category.PARAMETERS), (flat._cpu_grad, Category.GRADIENTS)):
                tracker.own_lineage(t, category, owner(flat), host=True)
        return out

    def pre_unshard(handle):
        flat = handle.flat_param
        # pre_unshard copies whenever the flat parameter is a host shard (``flat_param.device != self.device`` on a
        # GPU), i.e. not the unsharded parameter: also for the root in backward, which FULL_SHARD keeps gathered
        # after forward but points back at its host shard (``reshard(free_unsharded_flat_param=False)``)
        if h2d and handle.uses_sharded_strategy and not _same_storage(flat, flat._full_param_padded):
            nbytes = flat._local_shard.untyped_storage().nbytes()
            copies[id(handle)] = tracker.allocate_unseen(nbytes, Category.TEMPORARIES,
                                                         "host-to-device copy of the offloaded shard")
        with tracker.labelled("FSDP1 low-precision shard"):
            return saved["pre_unshard"](handle)

    def unshard(handle):
        with tracker.labelled("FSDP1 all-gather"):
            out = saved["unshard"](handle)
        if id(handle) in copies:  # flat_param.data is the unsharded parameter now: the copy's last reference went
            tracker.free_unseen(copies.pop(id(handle)))
        flat = handle.flat_param
        full = getattr(flat, "_full_param_padded", None)
        if full is not None and handle.uses_sharded_strategy:
            tracker.own_lineage(full, Category.PARAMETERS, owner(flat))
        return out

    def post_backward(state, handle, flat_param, *unused):
        flat = handle.flat_param
        if flat.grad is not None:
            tracker.own_lineage(flat.grad, Category.GRADIENTS, owner(flat))
        with tracker.labelled("FSDP1 reduce-scatter" if handle.uses_sharded_strategy else "FSDP1 all-reduce"):
            out = saved["post_backward"](state, handle, flat_param, *unused)
        shard = getattr(flat, "_saved_grad_shard", None)
        if shard is not None:
            tracker.own_lineage(shard, Category.GRADIENTS, owner(flat))
        return out

    flat_mod.FlatParamHandle.unshard = unshard
    flat_mod.FlatParamHandle.pre_unshard = pre_unshard
    stack.enter_context(_stream_marks(tracker))
    flat_mod.FlatParamHandle.init_flat_param_attributes = init
    runtime._post_backward_hook = post_backward
    try:
        yield
    finally:
        stack.close()
        flat_mod.FlatParamHandle.unshard = saved["unshard"]
        flat_mod.FlatParamHandle.pre_unshard = saved["pre_unshard"]
        flat_mod.FlatParamHandle.init_flat_param_attributes = saved["init"]
        runtime._post_backward_hook = saved["post_backward"]


@contextlib.contextmanager
def _stream_marks(tracker) -> Iterator[None]:
    """record_stream and the rate limiter as replay events (device/allocator.py docstring): each
    ``_no_dispatch_record_stream(tensor, stream)`` (torch/distributed/fsdp/_flat_param.py l.1486, 1543, 1818;
    _runtime_utils.py l.772, 871, 991, 1054; a no-op on a CPU tensor, still called) as RECORD_STREAM on its storage;
    each free event ``_reshard`` enqueues after freeing the unsharded parameter (_runtime_utils.py l.320-326,
    ``_FreeEventQueue.enqueue``) as FREE_EVENT; each ``dequeue_if_needed`` that returns one, which ``_unshard``
    synchronises on at once (l.297-303), as GPU_PASSED on that event."""
    from torch.distributed.fsdp import _flat_param as flat_mod
    from torch.distributed.fsdp import _limiter_utils as limiter
    from torch.distributed.fsdp import _runtime_utils as runtime

    trace = tracker.trace
    original = flat_mod._no_dispatch_record_stream
    enqueue, dequeue = limiter._FreeEventQueue.enqueue, limiter._FreeEventQueue.dequeue_if_needed
    numbers: dict[int, int] = {}  # id(free event) -> its number (the queue holds the event until it is dequeued)

    def record_stream(tensor, stream):
        sid = tracker.storage_id(tensor)
        if sid is not None:
            trace.stream_mark((RECORD_STREAM_ID, sid))
        return original(tensor, stream)

    def enqueue_event(queue, free_event):
        numbers[id(free_event)] = len(numbers)
        trace.stream_mark((FREE_EVENT_ID, numbers[id(free_event)]))
        return enqueue(queue, free_event)

    def dequeue_event(queue):
        event = dequeue(queue)
        if event is not None and id(event) in numbers:  # one enqueued before the step: nothing of the trace waits
            trace.stream_mark((GPU_PASSED_ID, numbers.pop(id(event))))
        return event

    flat_mod._no_dispatch_record_stream = runtime._no_dispatch_record_stream = record_stream
    limiter._FreeEventQueue.enqueue, limiter._FreeEventQueue.dequeue_if_needed = enqueue_event, dequeue_event
    try:
        yield
    finally:
        flat_mod._no_dispatch_record_stream = runtime._no_dispatch_record_stream = original
        limiter._FreeEventQueue.enqueue, limiter._FreeEventQueue.dequeue_if_needed = enqueue, dequeue


class Wrap(NamedTuple):
    """FSDP1's wrap as ``load_events`` rebuilds it: its allocator events, the record_stream marks of its broadcasts
    (positions in ``events``, as Trace.stream_marks; the high end's worst case only) and a line for the report."""

    events: list[tuple[int, int]]
    marks: list[tuple[int, tuple[int, int]]]
    what: str


def load_events(root: nn.Module, spec: RunSpec, storage_id, *, rank: int | None = None,
                on_device: bool = False) -> Wrap:
    """The device allocations of the FSDP1 wrap, as allocator events before the step (module docstring): each
    unit's shard (NO_SHARD: its whole flat parameter) and buffers under their own storage ids (``storage_id(t)``, the
    step's registered storages) unless offloaded, every other allocation under a fresh negative id; and a line for
    the report. ``rank``: whose shard (default: the traced rank). ``on_device``: the model was on the device before
    the wrap (every unit's parameters allocated first, nothing moved; how the wrap runs on a CPU,
    tests/test_fsdp1_load.py). The marks: each flattened broadcast bucket record_stream'ed on NCCL's stream (module
    docstring, 2.), pending from its free until the CPU waits for the GPU: on rank 0, which broadcasts the weights it
    holds on the host, when it moves the next unit (its first blocking host-to-device copy waits for the current
    stream, which waited for the broadcasts); elsewhere, and after the last unit, at the step's first wait."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    rank = spec.rank if rank is None else rank
    wrap = _WrapEvents(spec, storage_id, rank, copies_sync=not on_device and rank == 0)
    order = [unit for unit in _init_order(root, FSDP) if unit._handle is not None]
    resident = {id(unit): wrap.allocate_params(unit._handle.flat_param) for unit in order} if on_device else {}
    for unit in order:
        moved = resident[id(unit)] if on_device else wrap.allocate_params(unit._handle.flat_param)  # 1. to the device
        if not on_device:
            wrap.move_buffers(unit)
        if spec.fsdp_sync_module_states:  # 2. broadcast_coalesced: flattened buckets, 2 in flight
            wrap.broadcast(unit)
        wrap.flatten_and_shard(unit._handle)  # 3.-5.
        for moved_id, nbytes in moved:  # 6. managed_params released
            wrap.free(moved_id, nbytes)
    what = (f"FSDP1's wrap before the step: {len(order)} units "
            + ("flattened" if on_device else "moved to the device one by one, flattened")
            + (" and sharded" if spec.shard != Shard.NONE else " (NO_SHARD: each rank keeps the whole flat parameter)")
            + (" on the device" if on_device else "")
            + (" (sync_module_states: broadcast in 250 MiB buckets)" if spec.fsdp_sync_module_states else "")
            + "; the blocks it freed stay cached into the step (torch/distributed/fsdp/_init_utils.py)")
    return Wrap(wrap.events, wrap.marks, what)


class _WrapEvents:
    """The wrap's allocator events as ``load_events`` builds them, step by step (module docstring's numbers)."""

    def __init__(self, spec: RunSpec, storage_id, rank: int, copies_sync: bool = False):
        self.spec, self.storage_id, self.rank = spec, storage_id, rank
        self.events: list[tuple[int, int]] = []
        self.marks: list[tuple[int, tuple[int, int]]] = []  # (events before it, replay event): Wrap.marks
        self.copies_sync = copies_sync  # a unit's move waits for the GPU (load_events' docstring)
        self.broadcasts = 0  # the wrap's CUDA events, numbered -1, -2, ... (the step's from 0, fsdp1._stream_marks)
        self.waiting: int | None = None  # the last unit's broadcast event, until a copy waits for it
        self.next_id = LOAD_ID_BASE
        self.placed: set[int] = set()  # buffer storages on the device
        self.synced: set[int] = set()  # buffers broadcast (FSDP_SYNCED)

    def fresh(self, nbytes: int) -> int:
        self.next_id -= 1
        self.events.append((self.next_id, nbytes))
        return self.next_id

    def free(self, sid: int, nbytes: int) -> None:
        self.events.append((sid, -nbytes))

    def keep(self, tensor: torch.Tensor, nbytes: int) -> int:
        """An allocation that is the step's storage of ``tensor`` (a fresh id where the step has none)."""
        sid = self.storage_id(tensor)
        return self.fresh(nbytes) if sid is None else _append(self.events, sid, nbytes)

    def mark(self, event: tuple[int, int]) -> None:
        self.marks.append((len(self.events), event))

    def allocate_params(self, flat) -> list[tuple[int, int]]:
        moved = []
        for n in flat._numels:
            if nbytes := n * flat.element_size():
                moved.append((self.fresh(nbytes), nbytes))
                if self.copies_sync and self.waiting is not None:  # its copy waits: the broadcasts are done
                    self.mark((GPU_PASSED_ID, self.waiting))
                    self.waiting = None
        return moved

    def move_buffers(self, unit: nn.Module) -> None:
        """1. The unit's buffers no inner unit moved, kept on the device: the step's own storages (their setup
        allocation is the wrap's, device/usage.with_load), one per distinct storage."""
        for b in unit.buffers():
            key = b.untyped_storage()._cdata
            if key not in self.placed and b.numel():
                self.placed.add(key)
                self.keep(b, b.untyped_storage().nbytes())

    def broadcast(self, unit: nn.Module) -> None:
        """2. The unit's buffers not synced by an inner unit, then its parameters, in buckets, 2 in flight."""
        flat = unit._handle.flat_param
        buffers = [b for b in unit.buffers() if id(b) not in self.synced and b.numel()]
        self.synced.update(id(b) for b in buffers)
        states = [(b.dtype, b.numel() * b.element_size()) for b in buffers]
        states += [(flat.dtype, n * flat.element_size()) for n in flat._numels if n]
        in_flight: list[tuple[int, int] | None] = []  # a lone tensor's bucket is a view of it: nothing to free
        flattened = False
        for nbytes, tensors in _buckets(states):
            if len(in_flight) >= BROADCASTS_IN_FLIGHT and (done := in_flight.pop(0)) is not None:
                self.free_broadcast(*done)
            in_flight.append((self.fresh(nbytes), nbytes) if tensors > 1 else None)
            flattened |= tensors > 1
        for done in in_flight:
            if done is not None:
                self.free_broadcast(*done)
        if flattened:  # the CUDA event a later wait passes (load_events' docstring)
            self.broadcasts += 1
            self.waiting = -self.broadcasts
            self.mark((FREE_EVENT_ID, self.waiting))

    def free_broadcast(self, sid: int, nbytes: int) -> None:
        """A flattened bucket freed after ProcessGroupNCCL's ``recordStream`` on its stream (torch before the
        spring-2025 change that made ``TORCH_NCCL_AVOID_RECORD_STREAMS`` the default: module docstring, 2.)."""
        self.mark((RECORD_STREAM_ID, sid))
        self.free(sid, nbytes)

    def flatten_and_shard(self, handle) -> None:
        """3. torch.cat into the flat parameter; 4. this rank's chunk cloned (and padded), the rest freed (NO_SHARD:
        the concatenation is the flat parameter, kept whole); 5. an offloaded shard freed."""
        flat, size = handle.flat_param, handle.flat_param.element_size()
        full = flat._unpadded_unsharded_size.numel() * size
        if not handle.uses_sharded_strategy:
            self.keep(flat, full)
            return
        full_id = self.fresh(full)
        shard = flat._sharded_size.numel() * size
        chunk = _chunk_numel(flat._unpadded_unsharded_size.numel(), self.spec.world_size, self.rank) * size
        offloaded = self.spec.offload == Offload.PARAMS
        # where the chunk is short, F.pad makes the shard a padded copy of the clone (of nothing without a chunk)
        clone_id = self.fresh(chunk) if chunk != shard and chunk else None
        shard_id = self.fresh(shard) if offloaded else self.keep(flat, shard)
        if clone_id is not None:
            self.free(clone_id, chunk)
        self.free(full_id, full)
        if offloaded:  # flat_param_to(cpu)
            self.free(shard_id, shard)


def _init_order(root: nn.Module, fsdp_type) -> list[nn.Module]:
    """FSDP1 units in the order their ``__init__`` ran: children before parents (``_recursive_wrap``), the root last."""
    out: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if isinstance(module, fsdp_type):
            out.append(module)

    visit(root)
    return out


def _buckets(states: list[tuple[torch.dtype, int]], limit: int = PARAM_BROADCAST_BUCKET_SIZE) -> list[tuple[int, int]]:
    """c10d ``compute_bucket_assignment_by_size`` with one limit (torch/csrc/distributed/c10d/reducer.cpp), the bytes
    and tensor count of each bucket: tensors in order into their dtype's open bucket, a bucket closed once its bytes
    reach the limit, the open ones closed at the end; the buckets ordered by their first tensor."""
    done: list[tuple[int, int, int]] = []  # (first tensor's index, bytes, tensors)
    open_: dict[torch.dtype, list[int]] = {}
    for k, (dtype, nbytes) in enumerate(states):
        bucket = open_.setdefault(dtype, [k, 0, 0])
        bucket[1] += nbytes
        bucket[2] += 1
        if bucket[1] >= limit:
            done.append((bucket[0], bucket[1], bucket[2]))
            del open_[dtype]
    done += [(first, nbytes, tensors) for first, nbytes, tensors in open_.values()]
    return [(nbytes, tensors) for _, nbytes, tensors in sorted(done)]


def _chunk_numel(numel: int, world_size: int, rank: int) -> int:
    """``torch.flatten(t).chunk(world_size)[rank].numel()`` (0 where there are fewer chunks than ranks)."""
    per = -(-numel // world_size)
    return max(0, min(per, numel - rank * per))


def _append(events: list[tuple[int, int]], sid: int, nbytes: int) -> int:
    events.append((sid, nbytes))
    return sid


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


