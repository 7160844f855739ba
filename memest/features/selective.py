"""--checkpointing selective | selective:NAME: op-level selective activation checkpointing (SAC).

Each checkpointed block runs under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False,
context_fn=lambda: create_selective_checkpoint_contexts(policy))``, a fresh policy per call, as torchtitan's
``SelectiveAC._wrap_block`` does (TORCHTITAN below): the outputs of the ops the policy saves stay alive from the
forward to the backward, every other op of the block is recomputed in backward. The trace runs torch's own SAC
dispatch modes on the fake tensors, so what is saved and what is recomputed is what torch does.

  selective        torchtitan's policy: save the outputs of torch's compute-intensive ops (the partitioner's
                   ``get_default_op_list().compute_intensive_ops``: mm, addmm, bmm, convolution, the CUDA SDPA
                   kernels, ...), the other SDPA variants, aten.max, flex attention, linear, topk, and the
                   reduce-scatter / all-to-all collectives; except every second mm (counted per block call, forward
                   and recompute apart) and any mm whose weight has the shape of a Linear named ``moe.router.gate``
  selective:NAME   the model file's ``NAME``: a policy ``NAME(ctx, op, *args, **kwargs)`` returning a
                   torch.utils.checkpoint.CheckpointPolicy (or a bool: True saves), or a list of ops to save
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import _DISPATCH_META_HANDLERS, FakeTensor
from torch.utils import checkpoint as _checkpoint
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from memest.errors import MemestError
from memest.trace.tracker import TrackingFakeMode

# torchtitan's SelectiveAC (its _get_default_save_ops, force_recompute_mm_shapes_by_fqns and wrapped_policy), at
# the commit this reproduces
TORCHTITAN = ("https://github.com/pytorch/torchtitan/blob/b5bcd76c66d0acb1a08b176d9639425bc55e0b2a/"
              "torchtitan/distributed/activation_checkpoint.py")
FORCE_RECOMPUTE_FQNS = ("moe.router.gate",)  # SelectiveAC.Config.force_recompute_mm_shapes_by_fqns' default

# ops torchtitan saves besides the partitioner's compute-intensive ones; (root, dotted path) where the op exists
# only with some builds or packages (torchtitan skips those that are missing)
_COMPUTE_OPS = (
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten.max.default",
    "aten.linear.default",
    "aten.topk.default",
    "torch_attn._varlen_attn.default",
)
_COMM_OPS = (
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_to_all_single.default",
    "deepep.dispatch.default", "deepep.combine.default", "hybridep.dispatch.default", "hybridep.combine.default",
)
_HIGHER_ORDER = ("flex_attention", "inductor_compiled_code")


def _resolve(root, path: str):
    try:
        for part in path.split("."):
            root = getattr(root, part)
    except (AttributeError, RuntimeError):  # an op namespace that is not registered here
        return None
    return root


@functools.cache
def torchtitan_save_ops() -> frozenset:
    """The ops whose outputs torchtitan's SelectiveAC saves (``_get_default_save_ops``)."""
    from torch._functorch.partitioners import get_default_op_list

    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {op for path in _COMPUTE_OPS + _COMM_OPS if (op := _resolve(torch.ops, path)) is not None}
    ops |= {op for name in _HIGHER_ORDER if (op := _resolve(torch._higher_order_ops, name)) is not None}
    return frozenset(ops)


def _forced_recompute_shapes(model: nn.Module, blocks: list[str]) -> set[torch.Size]:
    """(in, out) of every Linear in the blocks whose name contains a FORCE_RECOMPUTE_FQNS entry (torchtitan)."""
    shapes: set[torch.Size] = set()
    for name, module in model.named_modules():
        if not any(name == b or name.startswith(b + ".") for b in blocks):
            continue
        if not any(f in name for f in FORCE_RECOMPUTE_FQNS):
            continue
        if not isinstance(module, nn.Linear):
            raise MemestError(f"--checkpointing selective: {name} matches torchtitan's force_recompute_mm_shapes_by_fqns "
                              f"{list(FORCE_RECOMPUTE_FQNS)} but is a {type(module).__name__}, not an nn.Linear")
        out_f, in_f = module.weight.shape
        shapes.add(torch.Size((in_f, out_f)))
    return shapes


def torchtitan_policy(save_ops: frozenset, recompute_shapes: set) -> Callable:
    """One block call's policy: torchtitan's ``wrapped_policy`` (fresh counters per call)."""
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    meta = {"forward_mm_count": 0, "recompute_mm_count": 0}

    def wrapped_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if (func == torch.ops.aten._to_copy.default and "cuda" in str(args[0].device) and "device" in kwargs
                and str(kwargs["device"]) == "cpu"):
            return CheckpointPolicy.MUST_SAVE
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func in mm_ops:
            weight_shape = args[1].shape
            if func == torch.ops.aten.linear.default:
                weight_shape = torch.Size((weight_shape[1], weight_shape[0]))
            if weight_shape in recompute_shapes:
                return CheckpointPolicy.PREFER_RECOMPUTE
            meta[key] += 1
        if func in save_ops:
            if func in mm_ops and meta[key] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return wrapped_policy


def user_policy(name: str, lookup: Callable[[str], object] | None, where: str) -> Callable[[], object]:
    """The model file's ``name``: a policy function, or a list of ops (torch saves those)."""
    found = lookup(name) if lookup is not None else None
    if found is None:
        whose = where if lookup is not None else f"{where} (not a model file)"
        raise MemestError(
            f"--checkpointing selective:{name}: {whose} defines no {name}; define {name}(ctx, op, *args, **kwargs) "
            "returning a torch.utils.checkpoint.CheckpointPolicy (or a list of ops to save) in the model file"
        )
    if isinstance(found, (list, tuple, set, frozenset)):
        ops = list(found)
        bad = [op for op in ops if not isinstance(op, (torch._ops.OpOverload, torch._ops.HigherOrderOperator))]
        if bad:
            raise MemestError(f"--checkpointing selective:{name}: {bad[0]!r} is not an op overload; write e.g. "
                              "torch.ops.aten.mm.default, not torch.ops.aten.mm")
        return lambda: ops
    if not callable(found):
        raise MemestError(f"--checkpointing selective:{name}: {where}'s {name} is a {type(found).__name__}, not a "
                          "policy function (ctx, op, *args, **kwargs) or a list of ops")
    return lambda: found


def _op_flops(func, args, kwargs, out) -> int:
    """FLOPs of one op call by torch.utils.flop_counter's formulas (0 where it has none), as trace/tracker.py counts."""
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket) if hasattr(func, "_overloadpacket") else None
    if formula is None:
        return 0
    try:
        return int(formula(*args, **kwargs, out_val=out))
    except Exception:  # a formula that does not take these arguments: the tracker counts it as 0 too
        return 0


def _counted(policy, recomputed: list[int]) -> Callable:
    """``policy`` that adds, in the forward, the FLOPs of every op it leaves to recompute to ``recomputed[0]``
    (and counts the forward's op calls saved and recomputed in ``recomputed[1]`` and ``[2]``): with
    early_stop=False the backward re-runs exactly those ops (torch's _CachedTorchDispatchMode)."""
    if isinstance(policy, list):  # the list form, as create_selective_checkpoint_contexts reads it
        ops = policy

        def policy(ctx, op, *args, **kwargs):
            return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE

    def counted(ctx, func, *args, **kwargs):
        decision = policy(ctx, func, *args, **kwargs)
        saved = decision is True or decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)
        if not ctx.is_recompute:
            recomputed[1 if saved else 2] += 1
            if not saved:
                recomputed[0] += _op_flops(func, args, kwargs, ctx.op_output)
        return decision

    return counted


def selective_context_fn(value: str, model: nn.Module, blocks: list[str], lookup, where: str,
                         recomputed: list[int], metadata_shortcut: bool = False) -> Callable:
    """``context_fn`` for torch.utils.checkpoint: the SAC contexts of ``--checkpointing value``, one policy per call;
    ``recomputed`` = [FLOPs the backward recomputes, op calls saved, op calls recomputed] (see _counted).
    ``metadata_shortcut`` (not while compiling): SAC's modes answer metadata queries as the tracking mode below
    them would (:func:`_answering_metadata`)."""
    _, _, name = value.partition(":")
    if name:
        make = user_policy(name, lookup, where)
    else:
        save_ops, shapes = torchtitan_save_ops(), _forced_recompute_shapes(model, blocks)
        make = functools.partial(torchtitan_policy, save_ops, shapes)
    if metadata_shortcut:
        return lambda: _answering_metadata(*create_selective_checkpoint_contexts(_counted(make(), recomputed)))
    return lambda: create_selective_checkpoint_contexts(_counted(make(), recomputed))


# SAC's two dispatch modes (torch 2.13 torch/utils/checkpoint.py) pass every op of SAC_IGNORED_OPS (prim.device, the
# size/stride queries, detach) straight to the mode below them; the tracking mode (trace/tracker.py) answers the
# metadata queries among them with FakeTensorMode's own handlers (_DISPATCH_META_HANDLERS). C++ asks a fake tensor's
# device through prim.device, so in a checkpointed block each such query went through SAC's mode (its dynamo-disabling
# wrapper, its __torch_dispatch__, a second dispatch) before that handler: 1,856 of the 2,872 calls into SAC's modes
# in a traced step of examples/transformer.py (bf16-mixed, 4 blocks). These subclasses answer them with the same
# handler where the tracking mode is the only mode below (the answer it would give), and hand every other op to
# torch's own method.
def _metadata_answered(raw):
    ignored = _checkpoint.SAC_IGNORED_OPS
    tracking = TrackingFakeMode.__torch_dispatch__  # a mode that answers metadata as TrackingFakeMode does
    proxy = torch._C._TorchDispatchModeKey.PROXY

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        handler = _DISPATCH_META_HANDLERS.get(func)
        if (handler is not None and func in ignored and not kwargs and args and type(args[0]) is FakeTensor
                and torch._C._len_torch_dispatch_stack() == 1
                and type(torch._C._get_dispatch_stack_at(0)).__torch_dispatch__ is tracking
                and torch._C._get_dispatch_mode(proxy) is None):  # not while AOTAutograd traces (SAC tags nodes then)
            return handler(args)
        return raw(self, func, types, args, kwargs)

    return __torch_dispatch__


class _Caching(_checkpoint._CachingTorchDispatchMode):
    pass


class _Cached(_checkpoint._CachedTorchDispatchMode):
    pass


# assigned after the class statements: TorchDispatchMode.__init_subclass__ wraps a __torch_dispatch__ defined in a
# class body in dynamo's disable (torch/utils/_python_dispatch.py); the torch methods called here keep theirs
_Caching.__torch_dispatch__ = _metadata_answered(_checkpoint._CachingTorchDispatchMode.__torch_dispatch__)
_Cached.__torch_dispatch__ = _metadata_answered(_checkpoint._CachedTorchDispatchMode.__torch_dispatch__)


def _answering_metadata(caching, cached) -> tuple:
    """torch's two SAC modes, as made by create_selective_checkpoint_contexts, answering metadata queries
    themselves (the subclasses above: same state, same methods otherwise)."""
    if type(caching) is _checkpoint._CachingTorchDispatchMode and type(cached) is _checkpoint._CachedTorchDispatchMode:
        caching.__class__, cached.__class__ = _Caching, _Cached
    return caching, cached


def selective_note(value: str, recomputed: list[int], forwards: int) -> str:
    """The report's note: which policy (torchtitan's with its source), and what it saved and recomputed per
    forward (``forwards``: the traced micro-steps)."""
    _, _, name = value.partition(":")
    which = f"the model file's policy {name}" if name else f"torchtitan's SelectiveAC op policy ({TORCHTITAN})"
    saved, rerun = recomputed[1] // forwards, recomputed[2] // forwards
    return (f"--checkpointing {value}: op-level selective activation checkpointing of every repeated block with "
            f"{which}; per forward, the outputs of {saved} op calls in the blocks kept, {rerun} recomputed in backward")
