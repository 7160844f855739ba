"""--checkpointing: wrap modules with torch.utils.checkpoint (non-reentrant unless said), so the trace records
the real recomputation in backward.

  none            nothing
  blocks          every repeated block (see repeated_blocks: transformer layers, a ViT's blocks, the
                  residual blocks of each ResNet stage); transformers models use their own switch
  blocks-reentrant  the same blocks under torch.utils.checkpoint(use_reentrant=True) (torch 2.13,
                  torch/utils/checkpoint.py CheckpointFunction: the block's forward under no_grad, its inputs
                  saved; in backward the whole block re-run with grad and torch.autograd.backward over its
                  outputs), as FSDP's checkpoint_wrapper(CheckpointImpl.REENTRANT) and transformers'
                  gradient_checkpointing_kwargs={"use_reentrant": True} apply it
  every:N         every N-th repeated block (0, N, 2N, ...)
  selective[:F]   every repeated block under op-level selective checkpointing: torchtitan's op policy, or the
                  model file's policy F (features/selective.py)
  a.b,c.d         the named modules
"""

from __future__ import annotations

import difflib
import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.features.selective import selective_context_fn, selective_note, user_policy
from memest.spec.choices import CheckpointPolicy, CompileScope
from memest.trace.recompute import Recomputes
from memest.trace.step import TRACED_MICRO_STEPS


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the repeated blocks: the children of a list of blocks (:func:`_block_list`), outermost
    only — a list inside a block (a MoE layer's experts, a ConvNeXt stage's blocks when the stages form
    a list themselves) is part of that block, and checkpointing it again would recompute it twice."""
    names: list[str] = []
    for list_name, module in model.named_modules():  # parents before their children
        if within(list_name, names) or not _block_list(module):
            continue
        prefix = f"{list_name}." if list_name else ""
        names += [f"{prefix}{key}" for key in module._modules]
    return names


def _block_list(module: nn.Module) -> bool:
    """An nn.ModuleList or nn.Sequential of 2+ modules of one class, each one a module with a forward
    (not a ModuleList/ModuleDict, which the model indexes instead of calling; never None, which a
    ModuleList may hold: x-transformers' ``layer_integrators``). In an nn.Sequential each must hold
    submodules itself — a ViT's Blocks, a ResNet stage's Bottlenecks — since nn.Sequential(Linear,
    Linear) or a stack of convolutions is a layer inside a block, not a list of blocks."""
    if not isinstance(module, (nn.ModuleList, nn.Sequential)):
        return False
    entries = list(module._modules.values())
    if len(entries) < 2 or any(e is None or isinstance(e, (nn.ModuleList, nn.ModuleDict)) for e in entries):
        return False
    if len({type(e) for e in entries}) != 1:
        return False
    return isinstance(module, nn.ModuleList) or all(next(e.children(), None) is not None for e in entries)


def _wrap(module: nn.Module, options: dict, name: str = "", recomputes: Recomputes | None = None) -> None:
    forward = module.forward

    def checkpointed_forward(*args, **kwargs):
        fn = forward if recomputes is None else recomputes.region(forward, name, module)
        return checkpoint(fn, *args, **options, **kwargs)

    module.forward = checkpointed_forward


def _hf_regions(model: nn.Module, names: list[str], recomputes: Recomputes) -> None:
    """transformers' checkpointed layers hand ``partial(forward, layer, **kwargs)`` to their
    ``_gradient_checkpointing_func``: that function handed to checkpoint as one of ``recomputes``' regions."""
    modules = dict(model.named_modules())
    for name in names:
        layer = modules[name]
        func = getattr(layer, "_gradient_checkpointing_func", None)
        if func is not None:
            layer._gradient_checkpointing_func = functools.partial(_in_region, func, recomputes, name, layer)


def _in_region(func, recomputes: Recomputes, name: str, layer: nn.Module, fn, *args, **kwargs):
    return func(recomputes.region(fn, name, layer), *args, **kwargs)


def _hf_switch(model: nn.Module, kwargs: dict) -> bool:
    """transformers' own gradient checkpointing (non-reentrant; ``kwargs`` go to torch.utils.checkpoint), for the
    model's layers."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed the switch
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def _hf_checkpointed(model: nn.Module) -> list[str]:
    """The layers transformers' switch checkpoints (GradientCheckpointingLayer with the flag set)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: its encoders loop over their layers themselves
        return []
    return [
        name for name, m in model.named_modules()
        if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False)
    ]


def apply_checkpointing(model: nn.Module, value: str, model_name: str = "the model", lookup=None,
                        recomputed: list[int] | None = None, hf_switch: bool = True,
                        recomputes: Recomputes | None = None) -> list[str]:
    """Apply ``--checkpointing value``; return the names of the checkpointed modules. ``lookup(name)`` finds a
    name the model file defines (``selective:NAME``); ``recomputed[0]`` sums the FLOPs selective checkpointing
    leaves to recompute. ``hf_switch=False``: a transformers model's blocks are wrapped here too (their forward
    under torch.utils.checkpoint, as torchtitan's checkpoint_wrapper), not by transformers' switch, whose
    checkpoint runs in the layer's ``__call__``, outside a compiled block (--compile-scope blocks)."""
    policy = CheckpointPolicy.of(value)
    if policy is CheckpointPolicy.NONE:
        return []
    options: dict = {"use_reentrant": policy is CheckpointPolicy.BLOCKS_REENTRANT}
    if policy is CheckpointPolicy.NAMES:
        chosen = [name.strip() for name in value.split(",") if name.strip()]
    else:
        if policy is CheckpointPolicy.SELECTIVE_USER:  # a NAME the file lacks is said first (battery 29, #161)
            user_policy(value.partition(":")[2], lookup, model_name)
        blocks = repeated_blocks(model)
        if not blocks:
            raise MemestError(
                f"--checkpointing {value}: {model_name} has no repeated blocks (an nn.ModuleList, or an "
                "nn.Sequential of blocks, of same-class modules); name the modules to checkpoint instead, "
                "e.g. --checkpointing encoder,decoder"
            )
        if policy is CheckpointPolicy.EVERY:
            chosen = blocks[::int(value.split(":", 1)[1])]
        else:
            hf = _hf_checkpointed_names(model) or blocks
            if policy in (CheckpointPolicy.SELECTIVE, CheckpointPolicy.SELECTIVE_USER):
                # torchtitan's SelectiveAC: checkpoint_wrapper(block, context_fn=..., early_stop=False)
                context_fn = selective_context_fn(value, model, hf, lookup, model_name,
                                                  recomputed if recomputed is not None else [0, 0, 0],
                                                  metadata_shortcut=recomputes is not None)
                options.update(context_fn=context_fn, early_stop=False)
            else:
                recomputes = None  # plain checkpointing stops its recomputation early (not replayed)
            if hf_switch and _hf_switch(model, options):
                names = _hf_checkpointed(model)
                if recomputes is not None:
                    _hf_regions(model, names, recomputes)
                return names or blocks
            chosen = blocks
    modules = dict(model.named_modules())
    for name in chosen:
        if name not in modules or name == "":
            # a policy spelled with '_' or another case is read as a module name: say which policy it is (battery 30)
            words = ("none", "blocks", "blocks-reentrant", "selective")
            policy_like = next((w for w in words if name.lower().replace("_", "-") == w), None)
            close = [f"the policy {policy_like}"] if policy_like else \
                difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see the module names in the memest table"
            raise MemestError(f"--checkpointing: {model_name} has no module {name!r}{hint}")
        _wrap(modules[name], options, name, recomputes if policy in _SELECTIVE else None)
    return chosen


_SELECTIVE = (CheckpointPolicy.SELECTIVE, CheckpointPolicy.SELECTIVE_USER)


def _hf_checkpointed_names(model: nn.Module) -> list[str]:
    """The layers transformers' switch would checkpoint (before it is set), for the policy's block names."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:
        return []
    if not getattr(model, "supports_gradient_checkpointing", False):
        return []
    return [name for name, m in model.named_modules() if isinstance(m, GradientCheckpointingLayer)]


def within(name: str, roots: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)



class CheckpointingFeature(StepFeature):
    """--checkpointing: the chosen modules run under torch.utils.checkpoint (or transformers' own switch)."""

    name = "checkpointing"

    def __init__(self) -> None:
        # a selective policy's [FLOPs left to recompute, op calls saved, op calls recomputed], over the traced steps
        self.recomputed = [0, 0, 0]
        self.recomputes = Recomputes()  # a selective policy's recomputations, replayed (trace/recompute.py)

    def build(self, built, spec) -> None:
        # --compile-scope blocks compiles each block with its checkpoint wrapper inside (torchtitan's order)
        built.checkpointed = apply_checkpointing(built.model, spec.checkpointing, built.where, built.lookup,
                                                 self.recomputed, hf_switch=spec.compile_scope is not CompileScope.BLOCKS,
                                                 recomputes=None if spec.compile else self.recomputes)

    def contexts(self, step) -> list:
        self.recomputes.counters = lambda: [c for feature in step.features for c in feature.counters()]
        self.recomputes.caches = lambda: [c for feature in step.features for c in feature.caches()]
        return []

    def finish(self, step) -> list[str]:
        if CheckpointPolicy.of(step.spec.checkpointing) in (CheckpointPolicy.SELECTIVE, CheckpointPolicy.SELECTIVE_USER):
            # the ops its policy recomputes, not the blocks' whole forward (report/analysis.py); per traced iteration
            step.trace.recompute_flops = self.recomputed[0] // step.spec.iterations
            forwards = step.spec.iterations * min(step.spec.grad_accum, TRACED_MICRO_STEPS)
            return [selective_note(step.spec.checkpointing, self.recomputed, forwards)]
        return []
