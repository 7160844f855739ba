"""--fsdp-version 1: torch's FullyShardedDataParallel (FSDP1) with ``use_orig_params=False``, as fsdp_qlora's train.py
and accelerate / TrainingArguments (``fsdp_version: 1``, their default) wrap a model (docs/sharding.md).

Each wrapped unit's parameters become one ``FlatParameter`` (torch/distributed/fsdp/_flat_param.py) holding this
rank's padded shard; FSDP1 all-gathers the whole unit into ``_full_param_padded`` (a storage it grows and frees with
``_typed_storage()._resize_``) on its unshard stream, computes with views of it, and reduce-scatters the unit's
whole unsharded flat gradient on its post-backward stream. So a unit's parameters, gathered or not, are one
allocation, not one per parameter as under FSDP2's ``fully_shard``.

Units (the auto-wrap policy): each repeated block (the units FSDP2 uses, ``features/checkpointing.repeated_blocks``)
and the root; where some parameters are frozen and others train (LoRA), also each leaf module whose weight trains,
peft's ``fsdp_auto_wrap_policy`` and fsdp_qlora's ``lambda_policy_fn`` (train.py, 05ed9f2): with
``use_orig_params=False`` one flat parameter must be all frozen or all trainable.

The trace runs torch's own FSDP1 under the fake process group; ``instrument`` names its buffers (the all-gather into
the unsharded flat parameter, the low-precision shard, the reduce-scatter) and classifies the unsharded flat
parameter and gradient as their unit's parameters and gradients.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn

from memest.spec import RunSpec
from memest.spec.choices import Offload, Shard, Target
from memest.trace.dtype import HALF
from memest.trace.events import Category


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
    params = list(model.parameters())
    mixed_grad = any(p.requires_grad for p in params) and not all(p.requires_grad for p in params)
    leaves = [name for name, m in modules.items() if mixed_grad and name and id(m) not in blocks and _trainable_leaf(m)]
    chosen = blocks | {id(modules[name]) for name in leaves}
    policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: id(m) in chosen)
    strategy = ShardingStrategy.FULL_SHARD if spec.shard == Shard.ZERO3 else ShardingStrategy.SHARD_GRAD_OP
    kwargs: dict = {}
    if spec.mixed:  # gather and compute in 16-bit, reduce gradients in fp32 (fp32 sharded flat parameters)
        kwargs["mixed_precision"] = MixedPrecision(param_dtype=HALF[spec.precision], reduce_dtype=torch.float32)
    if spec.offload == Offload.PARAMS:
        kwargs["cpu_offload"] = CPUOffload(offload_params=True)
    root = FSDP(model, auto_wrap_policy=policy, sharding_strategy=strategy, device_id=torch.device("cpu"),
                use_orig_params=False, limit_all_gathers=True, **kwargs)
    what = f"FSDP1 FullyShardedDataParallel({strategy.name}, use_orig_params=False)"
    if spec.offload == Offload.PARAMS:
        what += " + CPUOffload(offload_params=True)"
    if spec.mixed:
        what += f" + MixedPrecision(param_dtype={str(HALF[spec.precision]).removeprefix('torch.')}, reduce_dtype=float32)"
    names = [name for name in modules if id(modules[name]) in chosen]
    n = len(names) + 1
    extra = f" ({len(leaves)} of them trainable leaves)" if leaves else ""
    return root, f"{what}, {n} units{extra}", names + [""]


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
        with tracker.labelled("FSDP1 reduce-scatter"):
            out = saved["post_backward"](state, handle, flat_param, *unused)
        shard = getattr(flat, "_saved_grad_shard", None)
        if shard is not None:
            tracker.own_lineage(shard, Category.GRADIENTS, owner(flat))
        return out

    flat_mod.FlatParamHandle.unshard = unshard
    flat_mod.FlatParamHandle.pre_unshard = pre_unshard
    flat_mod.FlatParamHandle.init_flat_param_attributes = init
    runtime._post_backward_hook = post_backward
    try:
        yield
    finally:
        flat_mod.FlatParamHandle.unshard = saved["unshard"]
        flat_mod.FlatParamHandle.pre_unshard = saved["pre_unshard"]
        flat_mod.FlatParamHandle.init_flat_param_attributes = saved["init"]
        runtime._post_backward_hook = saved["post_backward"]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


