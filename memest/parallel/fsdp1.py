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
from memest.spec.choices import Offload, Shard
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
             "pre_unshard": flat_mod.FlatParamHandle.pre_unshard}

    def owner(flat_param) -> str:
        return owner_of_param.get(id(flat_param), "")

    def pre_unshard(handle):
        with tracker.labelled("FSDP1 low-precision shard"):
            return saved["pre_unshard"](handle)

    def unshard(handle):
        with tracker.labelled("FSDP1 all-gather"):
            out = saved["unshard"](handle)
        flat = handle.flat_param
        full = getattr(flat, "_full_param_padded", None)
        if full is not None and handle.uses_sharded_strategy:
            _own_lineage(tracker, full, Category.PARAMETERS, owner(flat))
        return out

    def post_backward(state, handle, flat_param, *unused):
        flat = handle.flat_param
        if flat.grad is not None:
            _own_lineage(tracker, flat.grad, Category.GRADIENTS, owner(flat))
        with tracker.labelled("FSDP1 reduce-scatter"):
            out = saved["post_backward"](state, handle, flat_param, *unused)
        shard = getattr(flat, "_saved_grad_shard", None)
        if shard is not None:
            _own_lineage(tracker, shard, Category.GRADIENTS, owner(flat))
        if spec.offload == Offload.PARAMS and getattr(flat, "_cpu_grad", None) is not None:
            _own_lineage(tracker, flat._cpu_grad, Category.GRADIENTS, owner(flat))
        return out

    flat_mod.FlatParamHandle.unshard = unshard
    flat_mod.FlatParamHandle.pre_unshard = pre_unshard
    runtime._post_backward_hook = post_backward
    try:
        yield
    finally:
        flat_mod.FlatParamHandle.unshard = saved["unshard"]
        flat_mod.FlatParamHandle.pre_unshard = saved["pre_unshard"]
        runtime._post_backward_hook = saved["post_backward"]


def _own_lineage(tracker, t: torch.Tensor, category: Category, module: str) -> None:
    sid = tracker.storage_id(t)
    if sid is None:
        return
    for s in tracker.lineage(sid):
        tracker.trace.storages[s].classify(category)
        tracker.trace.owner_module[s] = module
