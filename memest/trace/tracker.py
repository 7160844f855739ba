"""StorageTracker: records every new storage and, through a weakref callback, the moment it is freed.

It runs inside the fake mode (:class:`TrackingFakeMode`), on the ops called into it: the fake
outputs of every aten op of the forward, the backward (autograd runs its ops through the same mode)
and the optimizer step — what a TorchDispatchMode stacked above FakeTensorMode would see, without
a second Python dispatch round trip per op.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch._decomp import decomposition_table, meta_table
from torch._prims_common import is_non_overlapping_and_dense_or_false, suggest_memory_format
from torch._subclasses.fake_tensor import (
    _DISPATCH_HANDLE_DIRECTLY,
    _DISPATCH_META_HANDLERS,
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _check_for_subclass,
    in_kernel_invocation_manager,
    torch_decomp_decompositions,
)
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry as FLOP_REGISTRY

from memest.trace.events import Category, Phase, StorageRecord, Trace
from memest.trace.fake_kernels import chained_outputs
from memest.trace.values import ITEM, placeholder_scalar


@dataclass(frozen=True)
class TrackerRules:
    """What the tracker must know about the kernels of a step, from one feature (features/base.py).

    ``scratch``: aten op -> fn(args, kwargs) -> byte sizes of kernel-internal buffers (allocated before the
    op's outputs, freed after them) that the fake kernel does not show; a size may be a
    targets/cuda/workspace.Workspace (expected bytes with a low/high range).
    ``outputs``: aten op -> fn(args, kwargs, out, make) -> out: the real kernel makes outputs differently from
    the fake one. Two kinds: (a) without ``fn.late`` (CUDA kernels: another dtype or storage size), fn runs
    before the outputs are recorded and make(op, *args, **kwargs) runs an op in the fake mode unrecorded;
    (b) with ``fn.late`` (oneDNN: a workspace the meta kernel leaves empty), fn runs after the scratch is
    freed and make = ``empty(shape, dtype[, numel])``; the output positions in ``fn.late`` are the ones it
    makes, recorded then as "(kernel output)", the others before.
    ``chained``: output fixes that run before the earlier rules' fix of the same op, which runs when they keep
    torch's output (fake_kernels.chained_outputs).
    ``subclass_types``: wrapper subclasses (DTensor, torchao's float8 weight wrapper) whose inner tensors are tracked.
    Rules merge in order: a later rule's op replaces an earlier one's."""

    scratch: dict = field(default_factory=dict)
    outputs: dict = field(default_factory=dict)
    chained: dict = field(default_factory=dict)
    subclass_types: tuple[type, ...] = ()


def merged(rules: Iterable[TrackerRules]) -> tuple[dict, dict, tuple[type, ...]]:
    """(scratch, outputs, subclass_types) of rules applied in order."""
    scratch: dict = {}
    outputs: dict = {}
    types: tuple[type, ...] = ()
    for rule in rules:
        scratch = {**scratch, **rule.scratch}
        outputs = {**outputs, **rule.outputs}
        if rule.chained:
            outputs = chained_outputs(outputs, rule.chained)
        types += tuple(t for t in rule.subclass_types if t not in types)
    return scratch, outputs, types


EMPTY_LIKE = torch.ops.aten.empty_like.default
EMPTY = torch.ops.aten.empty.memory_format
TO_COPY = torch.ops.aten._to_copy.default
CONTIGUOUS = torch.ops.aten.contiguous.default
CLONE = torch.ops.aten.clone.default
META = torch.device("meta")

_COMPOSITE: dict = {}  # aten op -> whether it is CompositeImplicitAutograd (asked once per op)
# op -> whether FakeTensorMode would only decompose it (TrackingFakeMode._decomposes_directly; asked once per op)
_DIRECT_DECOMPOSITION: dict = {}
_UNKNOWN = object()
UNSAFE_VIEW = torch.ops.aten._unsafe_view.default


def _decomposition_of(func):
    """FakeTensorMode's decomposition of ``func`` where its cache always bypasses ``func`` and ``_dispatch_impl`` only
    decomposes it (TrackingFakeMode._direct_decomposition); else None."""
    if not isinstance(func, torch._ops.OpOverload) or func in meta_table:
        return None
    if func is UNSAFE_VIEW:
        return decomposition_table.get(func) if torch_decomp_decompositions(func) else None
    composite_view = (func.is_view and torch._library.utils.is_builtin(func) and func not in decomposition_table
                      and torch._C._dispatch_has_kernel_for_dispatch_key(
                          func.name(), torch._C.DispatchKey.CompositeImplicitAutograd))
    return func.decompose if composite_view else None


def _composite(func) -> bool:
    """Whether ``func`` is an aten op with a CompositeImplicitAutograd kernel (it is made of other aten ops) and
    no kernel of its own at AutogradCPU. A --target cuda trace registers the CUDA kernels of composite ops there
    (targets/cuda: sdpa, dropout, rms_norm, RNNs); under inference_mode that key is skipped too, and decomposing
    such an op would trace the CPU branch (sdpa's math path) in place of the CUDA kernel: recorded whole, as
    before."""
    known = _COMPOSITE.get(func)
    if known is None:
        known = _COMPOSITE[func] = (
            isinstance(func, torch._ops.OpOverload) and func.namespace == "aten" and func._can_decompose()
        )
    # asked each time: the CUDA kernels are registered only while a --target cuda trace runs
    return known and not torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), torch._C.DispatchKey.AutogradCPU)


# FakeTensorMode's own __torch_dispatch__ under its dynamo-disabling wrapper (TorchDispatchMode.__init_subclass__,
# torch/utils/_python_dispatch.py): TrackingFakeMode's override below is wrapped the same way, so calling the wrapped
# one would run that wrapper twice per op
_FAKE_TORCH_DISPATCH = getattr(FakeTensorMode.__torch_dispatch__, "__wrapped__", FakeTensorMode.__torch_dispatch__)


# torch.profiler.record_function's enter and exit ops (torch.optim's step and zero_grad call them, FSDP2 labels its
# collectives with them): strings and a profiler ScriptObject, no tensor, nothing allocated, no FLOPs. FakeTensorMode
# runs the real op after its cache key's bypass and _dispatch_impl's argument walks (torch 2.13
# torch/_subclasses/fake_tensor.py): the same ScriptObject, about 160 us per enter/exit pair against 14 us run
# directly, measured 2026-11-29; 592 pairs in a GPT-2 --optim-in-backward step, one optimizer per parameter
_RECORD_FUNCTION_OPS = frozenset(
    getattr(packet, overload)
    for packet in (getattr(torch.ops.profiler, name) for name in ("_record_function_enter_new",
                                                                  "_record_function_enter", "_record_function_exit"))
    for overload in packet.overloads()
)

# argument types that reach the last branch of FakeTensorMode._prep_args_for_hash (no earlier isinstance matches them)
_PLAIN_KEY_TYPES = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                              torch.memory_format})
_STRIDED = torch.strided
_CONTIGUOUS = torch.contiguous_format


def _plain_fake(t: FakeTensor, mode: FakeTensorMode) -> bool:
    """Whether ``t`` is a fake tensor whose cache key :func:`_flatten_fake` writes: this mode's, strided, no
    constant, static sizes (torch's method raises its cache bypasses or converts symbols for the others)."""
    return t.fake_mode is mode and t.constant is None and t.layout == _STRIDED and not t._has_symbolic_sizes_strides


def _flatten_fake(result: list, t: FakeTensor) -> None:
    """``extract_tensor_metadata(t)._flatten_into(result, ...)`` for a tensor :func:`_plain_fake` accepts: the
    TensorMetadata fields in order, shape (a torch.Size) and strides (a tuple) flattened as
    ``_prep_args_for_hash`` flattens a sequence (its type, ``length_N``, then type and value of each int), the
    sparse-only fields None (torch 2.13 torch/_subclasses/fake_tensor.py)."""
    shape = t.shape
    stride = t.stride()
    ndim = len(shape)
    memory_format = suggest_memory_format(t) if ndim == 4 or ndim == 5 else _CONTIGUOUS
    if not t.is_contiguous(memory_format=memory_format):
        memory_format = None
    sizes = [int, 0] * ndim  # each int as (type, value)
    sizes[1::2] = shape
    steps = [int, 0] * len(stride)
    steps[1::2] = stride
    result += (t.dtype, torch.Size, f"length_{ndim}")
    result += sizes
    result += (tuple, f"length_{len(stride)}")
    result += steps
    result += (t.device, _STRIDED, memory_format, t.storage_offset(), t.untyped_storage().nbytes(), t.requires_grad,
               t.is_quantized, t.is_conj(), t.is_neg(), t.is_inference(), False, None, None, None)


def _new_fake(mode: FakeTensorMode, meta: torch.Tensor, device: torch.device) -> FakeTensor:
    """``FakeTensor(mode, meta, device)`` for a CPU fake device: the same subclass made by the same
    ``Tensor._make_subclass`` call and the same mutable-data-pointer guard, its attributes (``_fake_device``,
    ``fake_mode``, and the Nones: constant, real tensor, pytype, dispatch keys, each memo's value, version and
    epoch) copied from one FakeTensor made by torch's constructor for this mode, without that constructor's
    argument checks, device normalisation (the identity on "cpu") and per-memo descriptors (torch 2.13
    torch/_subclasses/fake_tensor.py ``FakeTensor.__new__``). Anything else is made by the constructor."""
    if device.type != "cpu" or FakeTensorConfig.debug:
        return FakeTensor(mode, meta, device)
    state = mode.__dict__.get("_memest_fake_state")
    if state is None or state["_fake_device"] != device:
        with torch._C._DisableTorchDispatch():
            model = FakeTensor(mode, torch.empty(0, device=META), device)
        state = dict(model.__dict__)
        if any(v is not None for k, v in state.items() if k not in ("_fake_device", "fake_mode")):
            return FakeTensor(mode, meta, device)  # a torch whose fresh fake tensors hold more: its own constructor
        mode.__dict__["_memest_fake_state"] = state
    out = torch.Tensor._make_subclass(FakeTensor, meta, meta.requires_grad, dispatch_device=True,
                                      device_for_backend_keys=device)
    if not mode._allow_unsafe_data_ptr_access:
        torch._C._set_throw_on_mutable_data_ptr(out)
    else:
        torch._C._set_warn_deprecated_on_mutable_data_ptr(out)
    out.__dict__.update(state)
    return out


class TrackingFakeMode(FakeTensorMode):
    """A FakeTensorMode that hands the ops called into it to a :class:`StorageTracker`.

    Only the outermost call goes to the tracker: the ops the fake kernels run themselves
    (decompositions, which re-enter the mode) are not the step's, exactly as a mode stacked above
    would not see them. A separate tracking mode costs one more Python dispatch per op (measured:
    ~0.45 s of a 4.8 s Llama-2-7B trace)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tracker: StorageTracker | None = None
        self._inside = False  # a tracked op is running in the fake kernels

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Metadata queries (prim.device above all: C++ asks a fake tensor's device that way, 3,212 of the 5,026
        # ops called into the mode in a step of examples/transformer.py) allocate nothing and have no FLOPs:
        # answered as FakeTensorMode.dispatch answers them first (_DISPATCH_META_HANDLERS, torch 2.13
        # torch/_subclasses/fake_tensor.py), without the tracker's per-op work and torch's per-call wrappers.
        handler = _DISPATCH_META_HANDLERS.get(func)
        if handler is not None:
            return handler(args)
        if func in _RECORD_FUNCTION_OPS:  # no tensor in or out: run as FakeTensorMode runs them, without its path
            with torch._C._DisableTorchDispatch():
                return func(*args, **(kwargs or {}))
        for kind in types:
            if kind is not FakeTensor and self._declines(func, args, kwargs):
                return NotImplemented
            break
        return _FAKE_TORCH_DISPATCH(self, func, types, args, kwargs if kwargs is not None else {})

    def _declines(self, func, args, kwargs) -> bool:
        """Whether FakeTensorMode answers ``func`` NotImplemented, so that torch hands it to a tensor subclass's own
        ``__torch_dispatch__`` (torchao's Float8TrainingTensor mm, t, view: 108 ops of an fp8 step of
        examples/transformer.py), with nothing recorded on the way: an argument of an unrecognised subclass
        (``_check_for_subclass``, the first test of torch 2.13 ``FakeTensorMode._dispatch_impl``, reached after the
        cache key's "non-fake tensor" bypass and a walk of the arguments), an OpOverload, and no branch of
        :meth:`dispatch` or ``StorageTracker.dispatch`` that acts before running it (inference-mode
        decomposition, Adafactor's item, a kernel rule's scratch). Answered without that key and walk."""
        if not isinstance(func, torch._ops.OpOverload) or func in _DISPATCH_HANDLE_DIRECTLY:
            return False
        tracker = self.tracker
        if tracker is not None and not self._inside and (
                func is ITEM or tracker.has_rule(func) or torch.is_inference_mode_enabled()):
            return False
        return _check_for_subclass(tree_flatten((args, kwargs or {}))[0])

    def _plain_contiguous(self, args, kwargs) -> bool:
        """Whether ``aten.contiguous(*args, **kwargs)`` is asked of a plain fake tensor (:func:`_plain_fake`, no
        memory format but torch.contiguous_format, no real-tensor propagation). Its CompositeImplicitAutograd
        kernel returns the input itself where it is contiguous, else ``self.clone(memory_format)``
        (aten/src/ATen/native/TensorProperties.cpp ``contiguous``), which FakeTensorMode reaches only after its cache
        key, the "CompositeImplicitAutograd" bypass, ``_dispatch_impl``'s checks and ``func.decompose``, that clone
        then dispatched into the mode again with ``memory_format=torch.contiguous_format`` (torch 2.13
        torch/_subclasses/fake_tensor.py). :meth:`_run_tracked` answers the same directly: the input, or that clone
        (54 calls in an fp8 step of examples/transformer.py, torchao's float8 mm making a column-major operand).
        tests/test_tracker.py compares the outputs with torch's."""
        t = args[0] if len(args) == 1 else None
        return (type(t) is FakeTensor and (not kwargs or kwargs == {"memory_format": _CONTIGUOUS})
                and _plain_fake(t, self) and not self.propagate_real_tensors)

    def _prep_args_for_hash(self, result, args, state, id_hashed_objects) -> None:
        """FakeTensorMode's dispatch cache key of ``args`` (torch 2.13 torch/_subclasses/fake_tensor.py
        ``_prep_args_for_hash``): the same values appended in the same order, without its per-argument chain of
        isinstance checks and, for a plain fake tensor (strided, static shape, this mode's, no constant), without
        ``extract_tensor_metadata`` and ``TensorMetadata._flatten_into`` (a dataclass walked field by field, the
        shape and strides re-entering this method). That key was the largest part of a traced op (benchmarks/
        trace-speed.md); anything else is handed to torch's own method, one argument at a time.
        tests/test_tracker.py compares the keys with torch's on many layouts."""
        if isinstance(args, (list, tuple, dict)):
            result.append(type(args))
            result.append(f"length_{len(args)}")
            if isinstance(args, dict):
                self._prep_args_for_hash(result, args.keys(), state, id_hashed_objects)
                self._prep_args_for_hash(result, args.values(), state, id_hashed_objects)
                return
        append = result.append
        for arg in args:
            kind = type(arg)
            if kind in _PLAIN_KEY_TYPES:  # torch's last branch: the type, then the value
                append(kind)
                append(arg)
            elif kind is FakeTensor and _plain_fake(arg, self):
                _flatten_fake(result, arg)
            elif kind is list or kind is tuple:
                self._prep_args_for_hash(result, arg, state, id_hashed_objects)
            else:  # torch's own branches (symbolic ints, subclasses, bypasses), this argument alone
                super()._prep_args_for_hash(result, iter((arg,)), state, id_hashed_objects)

    def _get_output_tensor_from_cache_entry(self, state, entry, key, func, args):
        """An op's output rebuilt from FakeTensorMode's cache entry as torch 2.13 rebuilds it
        (torch/_subclasses/fake_tensor.py ``_get_output_tensor_from_cache_entry``: a meta ``empty_strided`` of the
        cached sizes, strides, dtype and requires_grad, set onto the input's storage for a view op, in a FakeTensor)
        for the common entry: a new strided tensor, no shape environment, not conjugate or negative; its fake
        tensor made by :func:`_new_fake`. Other entries (in-place, constants, symbolic sizes) go to torch's."""
        metadata = entry.metadata
        if (metadata is None or entry.inplace_idx is not None or self.shape_env is not None
                or metadata.layout != _STRIDED or metadata.is_conj or metadata.is_neg):
            return super()._get_output_tensor_from_cache_entry(state, entry, key, func, args)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            meta = torch.empty_strided(metadata.shape, metadata.stride, dtype=metadata.dtype, device=META,
                                       requires_grad=metadata.requires_grad)
        if isinstance(func, torch._ops.OpOverload) and func.is_view:  # the input's storage, as torch sets it
            storage = args[entry.view_idx].untyped_storage()
            with in_kernel_invocation_manager(self):
                meta.set_(storage, metadata.storage_offset, metadata.shape, metadata.stride)
        return _new_fake(self, meta, metadata.device)

    def dispatch(self, func, types, args=(), kwargs=None):
        tracker = self.tracker
        if tracker is None:
            return super().dispatch(func, types, args, kwargs)
        if self._inside:  # an op of a decomposition or of a fake kernel: run, not recorded
            return self._untracked(func, types, args, kwargs)
        if torch.is_inference_mode_enabled() and _composite(func) and not tracker.has_rule(func):
            # Under torch.inference_mode() the autograd key that decomposes a CompositeImplicitAutograd op
            # (cross_entropy, linear, matmul, ...) is skipped, so the op reaches this mode whole and the fake
            # kernel would decompose it untracked; the real CPU kernel runs that same decomposition and
            # allocates its intermediates (cross_entropy's batch x seq x vocab log_softmax: issue 22, 25a).
            # Decomposed here, each of its ops is tracked, as in a step with grad mode on.
            with self:
                out = func.decompose(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return tracker.dispatch(func, types, args, kwargs, self._run_tracked)

    def _run_tracked(self, func, types, args, kwargs):
        if func is CONTIGUOUS and self._plain_contiguous(args, kwargs):
            if args[0].is_contiguous():
                return args[0]
            func, args, kwargs = CLONE, args, {"memory_format": _CONTIGUOUS}
        self._inside = True
        try:
            return self._untracked(func, types, args, kwargs)
        finally:
            self._inside = False

    def _untracked(self, func, types, args, kwargs):
        """``func`` run by FakeTensorMode (its direct decomposition where :meth:`_direct_decomposition` has one)."""
        direct = self._direct_decomposition(func, args, kwargs)
        if direct is not None:
            with self:
                out = direct(*args, **(kwargs or {}))
            if out is not NotImplemented:
                return out
        return super().dispatch(func, types, args, kwargs)

    def _direct_decomposition(self, func, args, kwargs):
        """What FakeTensorMode would run for ``func`` after its cache bypass, where that is all it would do; else
        None. Asked of plain fake tensors only (:func:`_plain_fake`: no constants, no symbolic sizes), without
        real-tensor propagation. Two kinds of op qualify (torch 2.13 torch/_subclasses/fake_tensor.py):
        ``aten._unsafe_view`` (``_validate_cache_key`` bypasses it: "unsafe view"; ``_dispatch_impl`` runs its Python
        decomposition, ``decomposition_table``) and a view op with a CompositeImplicitAutograd kernel and no Python
        meta or decomposition (bypassed: "CompositeImplicitAutograd"; ``_dispatch_impl`` returns
        ``func.decompose(*args, **kwargs)``), which reaches the mode whole only below autograd: torchao's MXFP8
        ``mx_mm`` reshapes and flattens inside its autograd Function, 324 calls in an mxfp8 step of
        examples/transformer.py. Both run under the mode as torch runs them, without the cache key, the bypass and
        ``_dispatch_impl``'s checks; each op of the decomposition comes back into the mode as before (untracked:
        ``_inside``), so the trace is the same (scripts/trace_digest.py)."""
        direct = _DIRECT_DECOMPOSITION.get(func, _UNKNOWN)
        if direct is _UNKNOWN:
            direct = _DIRECT_DECOMPOSITION[func] = _decomposition_of(func)
        if direct is None or self.propagate_real_tensors:
            return None
        for a in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(a, torch.Tensor) and not (type(a) is FakeTensor and _plain_fake(a, self)):
                return None
        return direct


class StorageTracker:
    """Context manager: while entered, every op called into ``fake_mode`` is recorded."""

    def __init__(
        self, trace: Trace, module_of: Callable[[], str], fake_mode: TrackingFakeMode,
        rules: Iterable[TrackerRules] = (),
    ) -> None:
        self._fake_mode = fake_mode
        # the kernel rules of every feature, merged once (TrackerRules says what each table holds)
        self.scratch, self.outputs, self.subclass_types = merged(rules)
        self._ruled = frozenset(self.scratch) | frozenset(self.outputs)  # the ops a kernel rule names
        self.trace = trace
        self.module_of = module_of  # returns the innermost running module's name
        self.phase = Phase.SETUP
        self.iteration = 0
        # id(storage) -> storage id while the storage lives (its weakref callback removes the entry,
        # so an id is never reused while it is here); id(storage) -> that weakref
        self._ids: dict[int, int] = {}
        self._refs: dict[int, weakref.ref] = {}
        self._closed = False
        self.ignoring = 0  # > 0: ops run only to compute metadata (DTensor sharding propagation), not recorded
        self.label: str | None = None  # appended to the op name of allocations (e.g. "FSDP all-gather")
        self._lineage: dict[int, list[int]] = {}  # storage id -> every id of that storage (resize_)
        # the step's streams: device-agnostic code (FSDP2's FSDPCommContext on a "cpu" mesh) selects
        # torch.cpu.Stream objects with ``torch.cpu.stream(...)``, exactly where it selects CUDA streams on a
        # GPU; the one current now is the default (0), others are numbered as they are first seen (the
        # objects are kept so an id() is never reused)
        self._streams: dict[int, tuple[int, object]] = {id(s): (0, s) for s in (torch.cpu.current_stream(),)}

    def stream(self) -> int:
        """The number of the stream current now (0: the default)."""
        current = torch.cpu.current_stream()
        known = self._streams.get(id(current))
        if known is None:
            known = self._streams[id(current)] = (len(self._streams), current)
        return known[0]

    # -- bookkeeping -------------------------------------------------------------------------
    def set_phase(self, iteration: int, phase: Phase) -> None:
        self.iteration, self.phase = iteration, phase
        self.trace.phase_marks.append((len(self.trace.events), iteration, phase))

    def _unwrapped(self, t: torch.Tensor) -> torch.Tensor:
        """``t``, or for a wrapper subclass of ``subclass_types`` the inner tensor that holds its memory (the first
        of ``__tensor_flatten__``'s: DTensor's ``_local_tensor``, torchao's WeightWithDynamicFloat8CastTensor's
        ``_tensor``), recursively: FSDP2 over --fp8-all-gather weights holds one inside the other."""
        while self.subclass_types and isinstance(t, self.subclass_types):
            t = getattr(t, t.__tensor_flatten__()[0][0])
        return t

    def storage_id(self, t: torch.Tensor) -> int | None:
        t = self._unwrapped(t)
        return self._ids.get(id(t.untyped_storage()))

    def register(self, t: torch.Tensor, category: Category, op: str, module: str | None = None) -> int | None:
        """Record ``t``'s storage if it is new; return its id (None for empty storages)."""
        t = self._unwrapped(t)
        storage = t.untyped_storage()
        key = id(storage)
        sid = self._ids.get(key)
        if sid is not None:
            return sid
        nbytes = storage.nbytes()
        if nbytes == 0:
            return None
        sid = len(self.trace.storages)
        self.trace.storages.append(
            StorageRecord(
                nbytes=nbytes,
                category=category,
                module=self.module_of() if module is None else module,
                phase=self.phase,
                op=op,
                iteration=self.iteration,
                stream=self.stream(),
            )
        )
        self._ids[key] = sid
        self.trace.events.append((sid, nbytes))
        self._refs[key] = weakref.ref(storage, self._on_free(key, sid, nbytes))
        return sid

    def _on_free(self, key: int, sid: int, nbytes: int):
        def freed(_ref) -> None:
            del self._ids[key], self._refs[key]
            if not self._closed:  # frees after the step (tearing the model down) are not part of it
                self.trace.events.append((sid, -nbytes))

        return freed

    def __enter__(self) -> StorageTracker:
        if self._fake_mode.tracker is not None:
            raise RuntimeError("the fake mode is already tracking a step")
        self._fake_mode.tracker = self
        return self

    def __exit__(self, *exc) -> None:
        self._closed = True
        self._fake_mode.tracker = None

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        """While entered, allocations are named ``op (label)`` (e.g. "FSDP all-gather")."""
        previous, self.label = self.label, label
        try:
            yield
        finally:
            self.label = previous

    @contextlib.contextmanager
    def ignored(self) -> Iterator[None]:
        """While entered, ops run only to compute metadata (DTensor's sharding propagation): not recorded."""
        self.ignoring += 1
        try:
            yield
        finally:
            self.ignoring -= 1

    def classify(self, t: torch.Tensor, category: Category) -> None:
        sid = self.storage_id(t)
        if sid is not None:
            self.trace.storages[sid].classify(category)

    # -- storages that change size or place (data parallelism) -------------------------------
    def lineage(self, sid: int) -> list[int]:
        """Every storage id of the storage that ``sid`` is (several when resize_ re-allocated it)."""
        return self._lineage.get(sid, [sid])

    def own_lineage(self, t: torch.Tensor, category: Category, module: str, host: bool = False) -> None:
        """Every storage of ``t``'s lineage classified as ``category``, owned by ``module`` (and host memory
        with ``host``); a tensor the tracker has not seen is left alone."""
        sid = self.storage_id(t)
        if sid is None:
            return
        for s in self.lineage(sid):
            self.trace.storages[s].classify(category)
            self.trace.owner_module[s] = module
            if host:
                self.trace.storages[s].host = True

    def resized(self, storage, old_nbytes: int, new_nbytes: int) -> None:
        """``storage.resize_`` ran (FSDP frees and re-allocates unsharded parameters this way): the
        old allocation ends, a new one (same role) begins."""
        key = id(storage)
        sid = self._ids.get(key)
        if sid is None:  # first seen now (it was empty)
            if new_nbytes:
                sid = self.allocate_unseen(new_nbytes, Category.TEMPORARIES, "resize_")
                self._ids[key] = sid
                self._refs[key] = weakref.ref(storage, self._on_free(key, sid, new_nbytes))
            return
        if old_nbytes:
            self.trace.events.append((sid, -old_nbytes))
        if new_nbytes:
            sid = self._reallocate(sid, new_nbytes, op_suffix=" (resize_)")
        self._ids[key] = sid
        self._refs[key] = weakref.ref(storage, self._on_free(key, sid, new_nbytes) if new_nbytes else self._on_drop(key))

    def move_to_host(self, t: torch.Tensor, op: str) -> None:
        """A device-to-host copy that replaces the device storage of ``t`` (FSDP's offloaded
        gradients): the device allocation ends, a host allocation of the same role begins."""
        t = self._unwrapped(t)
        storage = t.untyped_storage()
        key = id(storage)
        sid = self._ids.get(key)
        if sid is None or self.trace.storages[sid].host:
            return
        nbytes = storage.nbytes()
        self.trace.events.append((sid, -nbytes))
        sid = self._reallocate(sid, nbytes, op_suffix="", op=op, host=True)
        self._ids[key] = sid
        self._refs[key] = weakref.ref(storage, self._on_free(key, sid, nbytes))

    def _reallocate(self, sid: int, nbytes: int, op_suffix: str, op: str | None = None, host: bool | None = None) -> int:
        old = self.trace.storages[sid]
        new_sid = len(self.trace.storages)
        self.trace.storages.append(
            StorageRecord(
                nbytes=nbytes,
                category=old.category,
                module=old.module,
                phase=self.phase,
                op=(old.op.removesuffix(op_suffix) + op_suffix) if op is None else op,
                iteration=self.iteration,
                host=old.host if host is None else host,
                stream=self.stream(),
            )
        )
        if sid in self.trace.owner_module:
            self.trace.owner_module[new_sid] = self.trace.owner_module[sid]
        lineage = self._lineage.setdefault(sid, [sid])
        lineage.append(new_sid)
        self._lineage[new_sid] = lineage
        self.trace.events.append((new_sid, nbytes))
        return new_sid

    def _on_drop(self, key: int):
        def dropped(_ref) -> None:  # a storage resized to 0 bytes: nothing left to free
            del self._ids[key], self._refs[key]

        return dropped

    def allocate_unseen(self, nbytes: int, category: Category, op: str) -> int:
        """An allocation the fake step does not make (e.g. the host-to-device copies of offloaded
        shards on a GPU); free it with :meth:`free_unseen`."""
        sid = len(self.trace.storages)
        self.trace.storages.append(StorageRecord(nbytes, category, self.module_of(), self.phase, op, self.iteration,
                                                 stream=self.stream()))
        self.trace.events.append((sid, nbytes))
        return sid

    def free_unseen(self, sid: int) -> None:
        self.trace.events.append((sid, -self.trace.storages[sid].nbytes))

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """``torch.empty_like(t)`` of a fake tensor, recorded as :meth:`dispatch` records that op (an ``empty_like``
        temporary of the running module), for the allocations memest's own code makes where a library makes them
        (features/activation_offload.py: torchtune's host copies and the copies back): :meth:`made_like`, or the op
        itself where that does not apply."""
        out = self.made_like(t, EMPTY_LIKE)
        return torch.empty_like(t) if out is None else out

    def made_like(self, t: torch.Tensor, op) -> torch.Tensor | None:
        """A new fake tensor of ``t``'s sizes, dtype and device as ``torch.empty_like(t)`` makes it (preserve_format:
        ``t``'s strides where it is dense and non-overlapping; ``aten._to_copy`` of ``t`` to its own device and dtype
        makes the same, aten/src/ATen/native/TensorConversions.cpp), recorded as :meth:`dispatch` records ``op`` (a
        temporary of the running module). The output is made as FakeTensorMode's cache makes an op's output (a meta
        tensor of the op's sizes and strides in a FakeTensor, torch 2.13 torch/_subclasses/fake_tensor.py
        ``_get_output_tensor_from_cache_entry``) without the mode's per-op dispatch (its cache key), which costs 4.4
        times more (benchmarks/trace-speed.md); tests/test_tracker.py checks it against the ops. None where it is not
        a tracked op of this step, or a kernel rule of some feature prices ``op``."""
        mode = self._fake_mode
        if (mode.tracker is not self or mode._inside or not isinstance(t, FakeTensor) or EMPTY_LIKE in self._ruled
                or op in self._ruled):
            return None
        if op is TO_COPY and t.layout == torch.strided and is_non_overlapping_and_dense_or_false(t):
            # _to_copy keeps a dense tensor's strides as they are (those of size-1 dimensions too: TensorConversions.cpp
            # ``_to_copy``, memory_format preserve, ``empty_strided(self.sizes(), self.strides())``)
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=META)
        elif t.layout == torch.strided and t.is_contiguous() and not t.is_contiguous(memory_format=torch.channels_last):
            # the fake kernel (torch._refs.empty_like) gives a tensor contiguous and not also channels-last contiguous
            # the identity permutation (torch._prims_common.compute_elementwise_output_logical_to_physical_perm's
            # short-circuit): torch.empty of its shape (strides of size-1 dimensions made canonical too)
            with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
                meta = torch.empty(t.shape, dtype=t.dtype, device=META)
        else:  # the op's own meta kernel picks the strides
            with in_kernel_invocation_manager(mode):
                meta = EMPTY_LIKE(t)
        return self._made(meta, t.fake_device, op)

    def made_empty(self, shape, dtype: torch.dtype) -> torch.Tensor | None:
        """``torch.empty(shape, dtype=dtype)`` on the traced (CPU) device, contiguous, made and recorded as
        :meth:`made_like` makes and records its tensor (``aten.empty.memory_format``); None where that does not
        apply (not a tracked op of this step, or a kernel rule prices the op)."""
        mode = self._fake_mode
        if mode.tracker is not self or mode._inside or EMPTY in self._ruled:
            return None
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            meta = torch.empty(shape, dtype=dtype, device=META)
        return self._made(meta, torch.device("cpu"), EMPTY)

    def _made(self, meta: torch.Tensor, device: torch.device, op) -> torch.Tensor:
        """``meta`` in a fake tensor on ``device``, recorded as a temporary ``op`` makes (made_like, made_empty)."""
        out = _new_fake(self._fake_mode, meta, device)
        if not self.ignoring:
            self.register(out, Category.TEMPORARIES, self._op_name(op))
        return out

    # -- dispatch ----------------------------------------------------------------------------
    def has_rule(self, func) -> bool:
        """Whether a feature's kernel rules (scratch or outputs) name ``func``: such an op is recorded whole."""
        return func in self._ruled

    def dispatch(self, func, types, args, kwargs, run):
        """One op called into the fake mode; ``run(func, types, args, kwargs)`` runs it there."""
        if self.ignoring:
            return run(func, types, args, kwargs)
        if func is ITEM and self.phase is Phase.OPTIMIZER:
            # Adafactor reads param.norm().item() to scale its update: values cannot change memory
            return placeholder_scalar(args[0])
        if func not in self._ruled:  # most ops: no kernel rule, their outputs recorded as the fake kernel makes them
            out = run(func, types, args, kwargs)
            if out is NotImplemented:
                return out
            self._register_outputs(out, self._op_name(func))
            self._count_flops(func, args, kwargs, out)
            return out
        sizes = list(self.scratch[func](args, kwargs or {})) if func in self.scratch else []
        late = [n for n in sizes if getattr(n, "after_outputs", False)]  # allocated by the kernel once its outputs exist
        scratch = self._scratch_alloc(func, [n for n in sizes if not getattr(n, "after_outputs", False)])
        out = run(func, types, args, kwargs)
        if out is NotImplemented:  # a wrapper subclass (DTensor) runs it as ops on its local tensors
            return out
        name = self._op_name(func)
        fix = self.outputs.get(func)
        late_positions = getattr(fix, "late", None)
        if fix is not None and late_positions is None:  # (a) replaced before they are recorded
            out = fix(args, kwargs or {}, out, lambda op, *a, **k: run(op, types, a, k))
        outs = (out,) if isinstance(out, torch.Tensor) else out
        self._register_outputs([t for i, t in enumerate(outs) if i not in late_positions] if late_positions else out, name)
        scratch += self._scratch_alloc(func, late)
        for sid, nbytes in scratch:
            self.trace.events.append((sid, -nbytes))
        if late_positions is not None:  # (b) made by the kernel after its scratch is freed
            out = fix(args, kwargs or {}, out, self._empty(run))
            self._register_outputs(out, f"{name} (kernel output)")
        self._count_flops(func, args, kwargs, out)
        return out

    def _op_name(self, func) -> str:
        return func.__name__ if self.label is None else f"{func.__name__} ({self.label})"

    def _count_flops(self, func, args, kwargs, out) -> None:
        flop_fn = FLOP_REGISTRY.get(func._overloadpacket)
        if flop_fn is not None:
            key = (self.iteration, self.phase, self.module_of())
            try:
                flops = int(flop_fn(*args, **(kwargs or {}), out_val=out))
            except Exception:  # a formula that rejects valid inputs (torch 2.11's sdpa counter on GQA shapes)
                flops = 0  # FLOPs only price time; memory never depends on them
                self.trace.uncounted_flop_ops.add(str(func))
            self.trace.flops[key] = self.trace.flops.get(key, 0) + flops

    def _register_outputs(self, out, name: str) -> None:
        if isinstance(out, torch.Tensor):  # most ops
            self.register(out, Category.TEMPORARIES, name)
        elif isinstance(out, (tuple, list)):  # multi-output and foreach ops
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.register(t, Category.TEMPORARIES, name)

    @staticmethod
    def _empty(run) -> Callable:
        def empty(shape: list[int], dtype: torch.dtype, numel: int | None = None) -> torch.Tensor:
            """A fake tensor of ``shape``; with ``numel``, a view of a storage of that many elements."""
            kwargs = {"dtype": dtype, "device": torch.device("cpu")}
            if numel is None:
                return run(torch.ops.aten.empty.memory_format, (), (shape,), kwargs)
            storage = run(torch.ops.aten.empty.memory_format, (), ([numel],), kwargs)
            return run(torch.ops.aten.as_strided.default, (), (storage, shape, [0] * len(shape)), {})

        return empty

    def _scratch_alloc(self, func, sizes) -> list[tuple[int, int]]:
        allocated = []
        for nbytes in sizes:
            ranged = getattr(nbytes, "has_range", False)  # a Workspace: kept even at 0 expected bytes
            if nbytes <= 0 and not ranged:
                continue
            nbytes = int(nbytes) if not ranged else nbytes
            sid = len(self.trace.storages)
            if ranged:
                self.trace.workspace_ranges[sid] = (nbytes.low, nbytes.high, nbytes.why)
            self.trace.storages.append(
                StorageRecord(int(nbytes), Category.TEMPORARIES, self.module_of(), self.phase,
                              f"{func.__name__} (kernel scratch)", self.iteration, stream=self.stream())
            )
            self.trace.events.append((sid, int(nbytes)))
            allocated.append((sid, int(nbytes)))
        return allocated
