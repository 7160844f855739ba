"""Data parallelism: the step as one rank of ``--world-size N`` runs it (docs/sharding.md).

The model is wrapped with torch's own data-parallel code, so the trace records what it allocates:

  --shard none   (N > 1)  DistributedDataParallel: full parameters, gradients and optimizer state
                          on every rank, plus DDP's gradient buckets (one flat buffer per bucket).
  --shard zero1           DDP + torch.distributed.optim.ZeroRedundancyOptimizer: the optimizer (and
                          its state) covers only the parameters ZeRO assigns to this rank.
  --shard zero2           FSDP2 ``fully_shard(reshard_after_forward=False)``: sharded parameters,
                          gradients (reduce-scattered) and optimizer state; a unit's unsharded
                          parameters stay gathered from its forward to its backward.
  --shard zero3           FSDP2 ``fully_shard(reshard_after_forward=True)``: full shard; parameters
                          are gathered per unit for its forward and again for its backward.
  FSDP units: each repeated block (trace/checkpointing.repeated_blocks) and the root.
  --offload optimizer     optimizer state and the optimizer step's allocations live in host memory.
  --offload params        (zero3) FSDP2 ``CPUOffloadPolicy``: sharded parameters, gradients and
                          optimizer state (and the step) in host memory; each unit's parameters are
                          copied to the device and gathered there for compute.

The trace is rank 0's, run against a fake process group (``init_process_group("fake")``, the
technique of torch's own FSDP memory-tracker tests): collectives move no data, but every buffer
the wrappers allocate for them (all-gather outputs, reduce-scatter inputs and outputs, DDP buckets)
is an allocation in the trace. ``wrap`` is shared with the real multi-process ground truth
(validate/distributed_truth.py), so both run the same wrappers.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memest.errors import MemestError
from memest.features.checkpointing import repeated_blocks
from memest.features.fp8 import precompute_scales_hook
from memest.features.optim import make_optimizer, optimizer_class
from memest.parallel import context_parallel as cp
from memest.parallel import expert_parallel, fsdp1, tensor_parallel, trl_fsdp
from memest.parallel.dims import Meshes, build_mesh, real_values
from memest.parallel.pipeline_parallel import PipelineStep, describe
from memest.spec import RunSpec
from memest.spec.choices import Fp8AllGather, FsdpVersion, Offload, Optimizer, Shard, Target
from memest.spec.parallel_dims import loss_parallel
from memest.trace.dtype import HALF
from memest.trace.events import Category, Phase, Trace
from memest.trace.tracker import TrackerRules


@dataclass
class Parallel:
    """A model wrapped for data parallelism, and the optimizer this rank runs."""

    module: nn.Module  # what the step calls: the DDP wrapper, or the model itself (FSDP wraps in place)
    model: nn.Module  # the user's model (its parameters are DTensor shards under FSDP)
    optimizer: torch.optim.Optimizer
    description: str
    units: list[str] = field(default_factory=list)  # fully_shard units ('' = the root)
    ddp_buckets: list = field(default_factory=list)  # storages of DDP's gradient buckets (traces only)
    stage: nn.Module | None = None  # --pp: the module the pipeline stage calls (its .module is ``model``)
    # --cp: this rank's share of the inputs (applied once, before the step) and the context the step runs in
    shard_inputs: Callable[[Any], Any] | None = None
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None

    @property
    def wrapper(self) -> nn.Module | None:
        if self.stage is not None:
            return self.stage
        return self.module if self.module is not self.model else None

    def optimizer_state(self) -> dict:
        """param -> state of what this rank's optimizer holds (ZeRO keeps it in its local ``optim``)."""
        return getattr(self.optimizer, "optim", self.optimizer).state


# -- process groups ------------------------------------------------------------------------------
@contextlib.contextmanager
def fake_process_group(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world_size``: collectives complete at once and move no data."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise MemestError(
            "a torch.distributed process group is already initialised in this process; memest simulates the "
            "ranks with its own fake group, so run it outside the distributed job"
        )
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _clear_dtensor_caches()


def _clear_dtensor_caches() -> None:
    """DTensor caches sharding propagation per op (in C++, ``torch._C._clear_DTensor_sharding_propagator_cache``,
    and in Python, torch/distributed/tensor/_sharding_prop.py) keyed by specs whose meshes compare by the
    world's rank layout, not by this rank's process groups: a later trace of another rank (pipeline x TP:
    rank 2 after rank 0) would get outputs on the destroyed world's groups ("Could not resolve the process
    group"). Dropped with the world."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos

    torch._C._clear_DTensor_sharding_propagator_cache()
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear()
    _gen_transform_infos.cache_clear()


# -- wrapping (shared by the trace and the real ground truth) ------------------------------------
def wrap(model: nn.Module, spec: RunSpec, fake: bool) -> Parallel:
    """Wrap ``model`` as ``spec``'s layout says (``spec.parallel``: one mesh, ``parallel.dims.build_mesh``; one apply
    order, ``_parallelize``: TP, then EP, then FSDP2, then the pipeline stage); ``fake``: under a fake process
    group on fake tensors."""
    dims = spec.parallel
    meshes = build_mesh(dims)
    if dims.pp_enabled:
        return _pipeline(model, spec, meshes, fake)
    if dims.cp_enabled:
        return _context_parallel(model, spec, meshes, fake)
    if dims.tp_enabled:
        return _tensor_parallel(model, spec, meshes, fake)
    if dims.ep_enabled:
        return _expert_parallel(model, spec, meshes, fake)
    if dims.fsdp_enabled and trl_fsdp.is_preference_step(model):  # --preference: trl + accelerate's FSDP2 wrap
        return Parallel(model, model, *trl_fsdp.wrap(model, spec, meshes.fsdp))
    if spec.fsdp_wraps:  # FSDP2, or FSDP1 (--shard none too: NO_SHARD)
        return _fsdp(model, spec, meshes.fsdp)
    return _ddp(model, spec, fake)


@dataclass
class _Applied:
    """What ``_parallelize`` applied: the TP plan's description, the experts modules and EP's description, FSDP2."""

    tp: str = ""
    experts: list[str] = field(default_factory=list)
    ep: str = ""
    fsdp: Parallel | None = None


def _parallelize(model: nn.Module, spec: RunSpec, meshes: Meshes, fake: bool, root: nn.Module | None = None,
                 units: list[str] | None = None) -> _Applied:
    """The one apply order (torchtitan's parallelize_llama, transformers' maybe_distribute_model): the --tp plan on
    the "tp" mesh, then --ep (the experts over the ep mesh, their FSDP2 units on the efsdp mesh), then FSDP2 over the
    data-parallel ranks (dp, or dp x cp with --cp) on ``root`` (``model``; a pipeline's stage module) with ``units``
    (default: the repeated blocks). Activation checkpointing and torch.compile come before, in the step's build
    (trace/step.py); a pipeline's stage module wraps each stage (``_pipeline``)."""

    dims, out, experts = spec.parallel, _Applied(), None
    if dims.tp_enabled:
        out.tp = tensor_parallel.apply(model, spec, meshes.tp)
    if dims.ep_enabled:
        out.experts = names = expert_parallel.apply(model, spec, meshes.ep, meshes.ep_tp, fake)
        out.ep = expert_parallel.describe(spec, names)

        def experts(kwargs):
            expert_parallel.fsdp_experts(model, names, spec, meshes.efsdp, kwargs)
    if dims.fsdp_enabled:
        with _real_mesh_concatenation():  # FSDP over TP (or EP) joins their meshes
            out.fsdp = _fsdp(root if root is not None else model, spec, meshes.fsdp, units, experts=experts)
    return out


def _pipeline(model: nn.Module, spec: RunSpec, meshes: Meshes, fake: bool) -> Parallel:
    """--pp: this rank's stages (parallel/pipeline_parallel.py); with dp or tp ranks per stage, each stage
    module parallelised on its sub-mesh of the ("pp", "dp", "tp") mesh (TP, then FSDP2), as torchtitan
    does; with --ep the experts by transformers' expert parallel over ep of the stage's dp ranks first, their
    experts modules FSDP2 units on the stage's efsdp mesh (parallel/expert_parallel.py); the optimizer covers the
    rank's parameters."""

    dims, parallelize, what = spec.parallel, None, []
    if meshes.world is not None:

        def parallelize(stage: nn.Module) -> None:
            # each decoder layer a unit, as torchtitan shards a stage (a stage of one layer too)
            base = getattr(stage.module, "base_model_prefix", "model")
            units = [f"module.{base}.layers.{k}" for k in range(len(getattr(stage.module, base).layers))]
            applied = _parallelize(stage.module, spec, meshes, fake, root=stage, units=units)
            what.extend(w for w in (applied.tp, applied.ep and f"{applied.ep} per stage") if w)
            if applied.fsdp is not None:
                more = f" (+ {len(applied.experts)} expert units on EFSDP {dims.expert_copies})" if dims.ep_enabled else ""
                what.append(f"{applied.fsdp.description}{more} per stage over DP {dims.dp}")

    step = PipelineStep(model, spec, parallelize, meshes.pp_group)
    params = list({id(p): p for m in step.modules for p in m.parameters() if p.requires_grad}.values())
    description = describe(step, spec) + "".join(f"; {w}" for w in dict.fromkeys(what))
    return Parallel(step, model, make_optimizer(spec, params), description, stage=step.module)


def _tensor_parallel(model: nn.Module, spec: RunSpec, meshes: Meshes, fake: bool) -> Parallel:
    """--tp: torch's parallelize_module on the mesh's "tp" dimension, then FSDP2 on its "dp" dimension
    when there is one (torch's 2-D FSDP x TP recipe; parallel/tensor_parallel.py). With --ep, the experts by
    transformers' expert parallel between the two (as transformers' maybe_distribute_model orders them)."""
    applied = _parallelize(model, spec, meshes, fake)
    what = f"{applied.tp} x {applied.ep}" if applied.ep else applied.tp
    if applied.fsdp is not None:
        applied.fsdp.description = f"{what} x {applied.fsdp.description} over DP {spec.parallel.dp}"
        if loss_parallel(spec):
            applied.fsdp.step_context = _loss_parallel
        return applied.fsdp
    params = [p for p in model.parameters() if p.requires_grad]
    parallel = Parallel(model, model, make_optimizer(spec, params), what)
    if loss_parallel(spec):  # torchtitan's train_context: forward and backward under loss_parallel()
        parallel.step_context = _loss_parallel
    return parallel


def _loss_parallel() -> contextlib.AbstractContextManager:
    from torch.distributed.tensor.parallel import loss_parallel as context

    return context()


def _expert_parallel(model: nn.Module, spec: RunSpec, meshes: Meshes, fake: bool) -> Parallel:
    """--ep: transformers' expert parallel on its expert mesh, its experts modules FSDP2 units on the efsdp mesh,
    then FSDP2 on every rank for the rest (parallel/expert_parallel.py)."""
    applied = _parallelize(model, spec, meshes, fake)
    fsdp, names = applied.fsdp, applied.experts
    fsdp.units = names + fsdp.units
    fsdp.description = f"{applied.ep} x {fsdp.description} (+ {len(names)} expert units)"
    return fsdp


def _context_parallel(model: nn.Module, spec: RunSpec, meshes: Meshes, fake: bool) -> Parallel:
    """--cp: FSDP2 over every rank (dp x cp, torchtitan's dp_shard_cp), the inputs cut on the sequence and the
    attention run as torch's ring over the "cp" dimension (parallel/context_parallel.py). With --tp: the --tp plan on
    the "tp" dimension of the ("dp", "cp", "tp") mesh first, then FSDP2 over its flattened dp x cp dimensions, as
    torchtitan applies TP, CP and FSDP (parallelize_llama); the colwise q/k/v hand SDPA local tensors of the rank's
    heads, so the ring runs on the 1-D cp mesh as without TP."""

    dims = spec.parallel
    cp.check_model(model, spec)
    applied = _parallelize(model, spec, meshes, fake)
    what = f"context parallel {dims.cp} (torch's ring attention, head-tail load balance, {spec.cp_rotate} rotation)"
    if applied.tp:
        what = f"{what} x TP {dims.tp}: {applied.tp}"
    fsdp = applied.fsdp
    fsdp.description = f"{what} x {fsdp.description} over dp {dims.dp} x cp {dims.cp}"
    fsdp.shard_inputs = lambda inputs: cp.shard_inputs(inputs, meshes.cp, spec)
    fsdp.step_context = lambda: cp.ring_attention(meshes.cp, spec)
    return fsdp


@contextlib.contextmanager
def _real_mesh_concatenation() -> Iterator[None]:
    """FSDP over TP joins the dp and tp meshes (``DeviceMesh._concatenate``), which indexes the rank table
    (a real tensor); under the trace's fake mode it runs with fake tensors unset, as the mesh's own setup does."""
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__dict__["_concatenate"]

    def concatenate(meshes):
        with real_values():
            return original.__func__(meshes)

    DeviceMesh._concatenate = staticmethod(concatenate)
    try:
        yield
    finally:
        DeviceMesh._concatenate = original


def _fsdp(model: nn.Module, spec: RunSpec, mesh, units: list[str] | None = None, experts=None) -> Parallel:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if spec.fsdp_version == FsdpVersion.V1:  # FullyShardedDataParallel, flat parameters (parallel/fsdp1.py)
        root, what, names = fsdp1.wrap(model, spec, repeated_blocks(model) if units is None else units)
        params = [p for p in root.parameters() if p.requires_grad]
        parallel = Parallel(root, model, make_optimizer(spec, params), what, names)
        if spec.offload == Offload.PARAMS:  # its pinned host copies, as plain copies (fsdp1.cpu_offload_without_a_gpu)
            parallel.step_context = fsdp1.cpu_offload_without_a_gpu
        return parallel
    if spec.optim == Optimizer.ADAFACTOR:  # the real run fails the same way
        raise MemestError(
            f"--optim adafactor does not run on FSDP's sharded (DTensor) parameters: its in-place ops on "
            f"row/column norms need placement changes DTensor does not support; use --shard zero1 or another "
            f"optimizer with --shard {spec.shard}"
        )
    reshard = spec.shard == Shard.ZERO3
    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard}
    if spec.offload == Offload.PARAMS:
        # pinned host memory needs CUDA; pinning changes transfer speed, not the bytes held
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    else:
        kwargs["offload_policy"] = OffloadPolicy()
    if spec.mixed:  # gather and compute in 16-bit, reduce gradients in fp32 (fp32 master shards)
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=HALF[spec.precision], reduce_dtype=torch.float32)
    if experts is not None:  # --ep: the experts modules first, on their own mesh
        experts(kwargs)
    units = repeated_blocks(model) if units is None else units
    modules = dict(model.named_modules())
    for name in units:
        fully_shard(modules[name], **kwargs)
    fully_shard(model, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = make_optimizer(spec, params)
    # right after each optimizer.step(), where torchao 0.18's docstring (torchao/float8/fsdp_utils.py
    # precompute_float8_dynamic_scale_for_fsdp) and torchtitan's trainer call it
    if spec.fp8_all_gather == Fp8AllGather.FLOAT8_PRECOMPUTED:
        optimizer.register_step_post_hook(precompute_scales_hook(model))
    what = f"FSDP2 fully_shard(reshard_after_forward={reshard})"
    if spec.offload == Offload.PARAMS:
        what += " + CPUOffloadPolicy"
    if spec.mixed:
        what += f" + MixedPrecisionPolicy(param_dtype={str(HALF[spec.precision]).removeprefix('torch.')}, reduce_dtype=float32)"
    n = len(units) + 1
    return Parallel(model, model, optimizer, f"{what}, {n} unit{'s' if n > 1 else ''}", units + [""])


def _ddp(model: nn.Module, spec: RunSpec, fake: bool) -> Parallel:
    from torch.nn.parallel import DistributedDataParallel as DDP

    collect = _NewStorages()  # the buckets: C++ allocations, seen as the ops they dispatch
    with collect:
        # init_sync checks shapes and broadcasts rank 0's values: it reads data that fake tensors
        # do not have, and allocates nothing that outlives the constructor
        ddp = DDP(model, init_sync=not fake)
    if fake:
        ddp.register_comm_hook(None, _fake_allreduce)
        ddp.reducer = _NoBucketRebuild(ddp.reducer)
    params = [p for p in ddp.parameters() if p.requires_grad]
    if spec.shard == Shard.ZERO1:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        cls, kwargs = optimizer_class(spec)
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, **kwargs)
        what = "DDP + ZeroRedundancyOptimizer"
    else:
        optimizer = make_optimizer(spec, params)
        what = "DDP"
    return Parallel(ddp, model, optimizer, what, ddp_buckets=collect.alive())


def _fake_allreduce(state, bucket):
    """DDP's default hook (allreduce of the bucket, in place) against a fake process group, whose
    work objects carry no result for the reducer to read back."""
    buffer = bucket.buffer()
    buffer.div_(dist.get_world_size())
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


class _NoBucketRebuild:
    """DDP's reducer, minus the rebuild of its buckets in the order gradients arrived (after the first
    iteration): the rebuild broadcasts bucket indices as data, which fake tensors do not have. The
    rebuild replaces buckets by buckets of the same total size (old ones are cleared first)."""

    def __init__(self, reducer) -> None:
        self._reducer = reducer

    def _rebuild_buckets(self) -> bool:
        return False

    def __getattr__(self, name):
        return getattr(self._reducer, name)


class _NewStorages(TorchDispatchMode):
    """Collects the storages allocated while entered (DDP's C++ reducer allocates its buckets)."""

    def __init__(self) -> None:
        super().__init__()
        self._refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in inputs:  # not a view or in-place
                self._refs.append(weakref.ref(t.untyped_storage()))
        return out

    def alive(self) -> list:
        gc.collect()  # temporaries of the constructor caught in reference cycles
        seen, out = set(), []
        for ref in self._refs:
            st = ref()
            if st is not None and st.nbytes() and id(st) not in seen:
                seen.add(id(st))
                out.append(st)
        return out


class _StorageHandle:
    """Lets StorageTracker.register take a bare storage."""

    def __init__(self, storage) -> None:
        self._storage = storage

    def untyped_storage(self):
        return self._storage


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --target cpu: collectives run on gloo, whose all-gather and reduce-scatter into one tensor use
# temporaries of the full size (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp):
# reduce_scatter_tensor_coalesced clones the whole input, all-reduces the clone and copies this
# rank's chunk out; allgather gathers into a flat output of its own and copies it out. Measured on
# real gloo runs (validate/distributed_truth.py). NCCL (--target cuda) works in the given buffers.
# The functional collectives DTensor redistributes with (--tp) call the same gloo ops: all_gather_into_tensor
# gathers into gloo's own flat buffer of the output's size (measured: aten::empty of the output size
# freed inside gloo:all_gather); all_reduce works in its output (a clone of the input) without a temporary.
def _gloo_buffers() -> dict:
    c10d, functional = torch.ops.c10d, torch.ops._c10d_functional
    return {
        c10d._reduce_scatter_base_.default: lambda args, kwargs: [_nbytes(args[1])],
        c10d._allgather_base_.default: lambda args, kwargs: [_nbytes(args[0])],
        # all_gather into a list (accelerate's gather on gloo, features/preference_kto.py): ProcessGroupGloo's
        # AsyncAllgatherWork gathers into one flat tensor of every output (newLikeFlat), then copies each out
        c10d.allgather_.default: lambda args, kwargs: [sum(_nbytes(t) for t in args[0][0])],
        functional.all_gather_into_tensor.default: lambda args, kwargs: [_nbytes(args[0]) * args[1]],
        functional.reduce_scatter_tensor.default: lambda args, kwargs: [_nbytes(args[0])],
    }


def _wait_returns_input(args, kwargs, out, run):
    """``_c10d_functional.wait_tensor`` returns the tensor it waited on (its fake kernel makes a new one)."""
    return args[0]


def tracker_rules(spec: RunSpec) -> TrackerRules:
    """What the tracker must know: DTensors (FSDP's sharded parameters, gradients and optimizer state) are
    tracked by their local tensors, wait_tensor returns its input, and gloo's collective buffers (--target cpu)."""
    from torch.distributed.tensor import DTensor

    return TrackerRules(
        scratch=_gloo_buffers() if spec.target == Target.CPU else {},
        outputs={torch.ops._c10d_functional.wait_tensor.default: _wait_returns_input},
        subclass_types=(DTensor,),
    )


def register_buffers(tracker, parallel: Parallel) -> None:
    """Before anything else is registered: the buffers the wrappers made before the step (DDP's gradient
    buckets)."""
    for storage in parallel.ddp_buckets:
        sid = tracker.register(_StorageHandle(storage), Category.GRADIENTS, "DDP gradient bucket", module="")
        if sid is not None:
            tracker.trace.owner_module[sid] = ""
    parallel.ddp_buckets = []


# -- tracing instrumentation ---------------------------------------------------------------------
@contextlib.contextmanager
def instrument(tracker, spec: RunSpec, owner_of_param: dict[int, str]) -> Iterator[None]:
    """While the step runs: track DTensors by their local tensors, skip DTensor's metadata-only ops,
    record ``UntypedStorage.resize_`` (FSDP frees and re-allocates unsharded parameters with it),
    name FSDP's communication buffers, and classify unsharded parameters and gradients."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as group_mod
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    saved = {
        "propagate": ShardingPropagator._propagate_tensor_meta_non_cached,
        "resize": torch.UntypedStorage.resize_,
        "all_gather": group_mod.foreach_all_gather,
        "copy_out": group_mod.foreach_all_gather_copy_out,
        "reduce": group_mod.foreach_reduce,
    }

    def propagate(self, *args, **kwargs):
        # DTensor computes output shapes by running the op on global-size fake tensors: no memory
        with tracker.ignored():
            return saved["propagate"](self, *args, **kwargs)

    def resize_(storage, size):
        old = storage.nbytes()
        out = saved["resize"](storage, size)
        new = storage.nbytes()
        if new != old and not tracker.ignoring:
            tracker.resized(storage, old, new)
        return out

    h2d = spec.offload == Offload.PARAMS and spec.target == Target.CUDA

    def foreach_all_gather(fsdp_params, *args, **kwargs):
        copy = None
        if h2d:  # the shards live on the host: each is copied to the device, then gathered
            nbytes = sum(p._sharded_param_data.untyped_storage().nbytes() for p in fsdp_params)
            copy = tracker.allocate_unseen(nbytes, Category.TEMPORARIES, "host-to-device copy of offloaded shards")
        with tracker.labelled("FSDP all-gather"):
            result = saved["all_gather"](fsdp_params, *args, **kwargs)
        if copy is not None:
            tracker.free_unseen(copy)
        return result

    def foreach_all_gather_copy_out(result, fsdp_params, *args, **kwargs):
        with tracker.labelled("FSDP all-gather copy-out"):
            out = saved["copy_out"](result, fsdp_params, *args, **kwargs)
        for p in fsdp_params:  # the unsharded parameters
            for t in p.all_gather_outputs:
                tracker.own_lineage(t, Category.PARAMETERS, owner_of_param.get(id(p.sharded_param), ""))
        return out

    def foreach_reduce(fsdp_params, unsharded_grads, *args, **kwargs):
        _own_gradients(tracker, fsdp_params, unsharded_grads, owner_of_param)
        with tracker.labelled("FSDP reduce-scatter"):
            out = saved["reduce"](fsdp_params, unsharded_grads, *args, **kwargs)
        if spec.offload == Offload.PARAMS:
            for p in fsdp_params:
                if p.sharded_param.grad is not None:
                    tracker.move_to_host(p.sharded_param.grad, "sharded gradient (device-to-host copy)")
        return out

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    torch.UntypedStorage.resize_ = resize_
    group_mod.foreach_all_gather = foreach_all_gather
    group_mod.foreach_all_gather_copy_out = foreach_all_gather_copy_out
    group_mod.foreach_reduce = foreach_reduce
    try:
        with warnings.catch_warnings(), (fsdp1.instrument(tracker, spec, owner_of_param)
                                         if spec.fsdp_version == FsdpVersion.V1 else contextlib.nullcontext()):
            # FSDP warns that a wrapped module returned a view (an in-place op on it would skip the
            # all-gather); transformers' outputs are views and nothing writes to them in place
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = saved["propagate"]
        torch.UntypedStorage.resize_ = saved["resize"]
        group_mod.foreach_all_gather = saved["all_gather"]
        group_mod.foreach_all_gather_copy_out = saved["copy_out"]
        group_mod.foreach_reduce = saved["reduce"]


def _own_gradients(tracker, fsdp_params, unsharded_grads, owner_of_param: dict[int, str]) -> None:
    """FSDP's unsharded gradients as gradients of their parameters' owners. A function of its own, so no local of
    the wrapper keeps the last gradient alive: FSDP frees them after copying them into the reduce-scatter input."""
    for p, g in zip(fsdp_params, unsharded_grads, strict=True):
        tracker.own_lineage(g, Category.GRADIENTS, owner_of_param.get(id(p.sharded_param), ""))




# -- host memory ---------------------------------------------------------------------------------
def offloaded(trace: Trace, spec: RunSpec) -> list[int]:
    """The storages that CPU offloading of data-parallel state really moves to host memory (only these:
    another kind of --offload moves nothing here).
    --offload optimizer | params: optimizer state and every allocation of the optimizer step.
    --offload params: also the sharded parameters (alive before the step); sharded gradients are moved
    when FSDP copies them to the host (``instrument``)."""
    if spec.offload not in (Offload.OPTIMIZER, Offload.PARAMS):
        return []
    params = spec.offload == Offload.PARAMS
    return [
        sid for sid, rec in enumerate(trace.storages)
        if rec.category is Category.OPTIMIZER_STATE or rec.phase is Phase.OPTIMIZER
        or (params and rec.category is Category.PARAMETERS and rec.phase is Phase.SETUP)
    ]


# -- summary (for reports) -----------------------------------------------------------------------
MODEL_STATE = (Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE)


def model_state_bytes(trace: Trace) -> dict[str, dict[str, int]]:
    """Parameters, gradients and optimizer state this rank holds as the last optimizer step begins
    (gradients reduced, state from the step before; FSDP units resharded), on the device and on
    the host: the persistent "model states" that DeepSpeed's ZeRO formulas count (docs/sharding.md).
    DDP's gradient buckets count as gradients."""
    last = max((it for _, it, _ in trace.phase_marks), default=0)
    marks = [k for k, (_, it, phase) in enumerate(trace.phase_marks) if it == last and phase is Phase.OPTIMIZER]
    device_end, host_end = len(trace.events), len(trace.host_events)
    if marks:
        device_end = trace.phase_marks[marks[0]][0]
        host_end = trace.host_marks[marks[0]] if trace.host_marks else host_end
    out = {"device": dict.fromkeys((c.value for c in MODEL_STATE), 0), "host": dict.fromkeys((c.value for c in MODEL_STATE), 0)}
    live: dict[int, int] = {}
    for sid, delta in trace.events[:device_end]:
        live[sid] = live.get(sid, 0) + delta
    for _, sid, delta in trace.host_events[:host_end]:
        live[sid] = live.get(sid, 0) + delta
    for sid, nbytes in live.items():
        rec = trace.storages[sid]
        if nbytes > 0 and rec.category in MODEL_STATE:
            out["host" if rec.host else "device"][rec.category.value] += nbytes
    return out


def sharding_summary(trace: Trace) -> dict:
    """What a report shows for --world-size/--shard/--offload (JSON-ready: ints for bytes)."""
    device_peak, _ = trace.peak()
    return {
        "world_size": trace.world_size,
        "rank": trace.rank,
        "parallel": trace.parallel,
        "shard_units": list(trace.shard_units),
        "device_peak_bytes": device_peak,
        "host_peak_bytes": trace.host_peak(saved=False),
        "model_state_bytes": model_state_bytes(trace),
    }
