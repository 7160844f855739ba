"""--checkpointing: wrap modules with torch.utils.checkpoint (non-reentrant), so the trace records
the real recomputation in backward.

  none            nothing
  blocks          every repeated block: the children of each nn.ModuleList whose modules share a class
                  (transformer layers); transformers models use their own gradient-checkpointing switch
  every:N         every N-th repeated block (0, N, 2N, ...)
  a.b,c.d         the named modules
"""

from __future__ import annotations

import difflib

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import MemestError


def repeated_blocks(model: nn.Module) -> list[str]:
    """Names of the children of every nn.ModuleList (2+ entries) whose modules all share one class."""
    names = []
    for list_name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2:
            classes = {type(child) for child in module}
            if len(classes) == 1:
                prefix = f"{list_name}." if list_name else ""
                names += [f"{prefix}{i}" for i in range(len(module))]
    return names


def _wrap(module: nn.Module) -> None:
    forward = module.forward

    def checkpointed_forward(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = checkpointed_forward


def _hf_switch(model: nn.Module) -> bool:
    """transformers' own gradient checkpointing (non-reentrant), for the model's layers."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        return False
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x renamed the switch
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return True


def apply_checkpointing(model: nn.Module, value: str, model_name: str = "the model") -> list[str]:
    """Apply ``--checkpointing value``; return the names of the checkpointed modules."""
    if value == "none":
        return []
    if value == "blocks" or value.startswith("every:"):
        blocks = repeated_blocks(model)
        if not blocks:
            raise MemestError(
                f"--checkpointing {value}: {model_name} has no repeated blocks (an nn.ModuleList of same-class "
                "modules); name the modules to checkpoint instead, e.g. --checkpointing encoder,decoder"
            )
        if value == "blocks":
            if _hf_switch(model):
                return blocks
            chosen = blocks
        else:
            try:
                step = int(value.split(":", 1)[1])
            except ValueError:
                step = 0
            if step < 1:
                raise MemestError(f"--checkpointing {value}: N must be a whole number >= 1, e.g. every:2")
            chosen = blocks[::step]
    else:
        chosen = [name.strip() for name in value.split(",") if name.strip()]
    modules = dict(model.named_modules())
    for name in chosen:
        if name not in modules or name == "":
            close = difflib.get_close_matches(name, [n for n in modules if n], n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else "; see the module names in the memest table"
            raise MemestError(f"--checkpointing: {model_name} has no module {name!r}{hint}")
        _wrap(modules[name])
    return chosen


def within(name: str, roots: list[str]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)

