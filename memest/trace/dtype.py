"""Module conversions (``model.to(dtype)``, ``.half()``, ``.cuda()``, ...) for fake and real models alike.

nn.Module._apply, behind every module conversion, swaps a FakeTensor parameter for its converted copy
in place (torch.utils.swap_tensors, torch/nn/modules/module.py), and the swap fails — ``_apply():
Couldn't swap Linear.weight`` — because the fake mode's converter keeps a weak reference to every fake
tensor it made (MetaConverter.tensor_memo, torch/_subclasses/meta_utils.py), and swap_tensors refuses a
tensor that has one. Making a new Parameter for each converted one is equivalent for memory (the old
storage is freed when nothing holds it) — it is torch's own non-swap path — and with one new tensor per
old one, tied weights stay tied.

- :func:`cast_floating`: memest's own ``--precision bf16/fp16`` cast.
- :func:`convertible_fake_parameters`: while entered, ``nn.Module._apply`` does the same for the model
  code's own conversions (``.to(device)``, ``.half()``, ``.to(torch.bfloat16)``, peft moving its
  adapters to the base layer's device and dtype); modules without fake tensors convert as torch does.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memest.spec.choices import Precision

# the 16-bit compute dtype of each -mixed precision (autocast's, and FSDP2's MixedPrecisionPolicy param_dtype)
HALF = {Precision.BF16_MIXED: torch.bfloat16, Precision.FP16_MIXED: torch.float16}


def cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    converted: dict[int, torch.Tensor] = {}

    def convert(t: torch.Tensor, make) -> torch.Tensor:
        if id(t) not in converted:
            converted[id(t)] = make(t.detach().to(dtype)) if t.is_floating_point() else t
        return converted[id(t)]

    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    module._parameters[name] = convert(
                        p, lambda t, rg=p.requires_grad: torch.nn.Parameter(t, requires_grad=rg)
                    )
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = convert(b, lambda t: t)
    return model


def _has_fake(module: torch.nn.Module) -> bool:
    tensors = list(module._parameters.values()) + list(module._buffers.values())
    return any(isinstance(t, FakeTensor) for t in tensors)


class _Conversion:
    """One outermost ``_apply`` call: each tensor converted once (id -> (old, new), the old one kept
    alive so that its id is not reused), so a parameter shared by two modules stays shared."""

    def __init__(self) -> None:
        self.depth = 0
        self.done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def convert(self, t: torch.Tensor, fn, parameter: bool) -> torch.Tensor:
        if id(t) in self.done:
            return self.done[id(t)][1]
        with torch.no_grad():
            applied = fn(t)
        new = applied
        if parameter and applied is not t:
            new = torch.nn.Parameter(applied, requires_grad=t.requires_grad)
            new.__dict__.update(t.__dict__)  # attributes set on the parameter (swap_tensors keeps them too)
            if t.grad is not None:
                with torch.no_grad():
                    new.grad = fn(t.grad)
        self.done[id(t)] = (t, new)
        return new


@contextlib.contextmanager
def convertible_fake_parameters():
    """Patch ``nn.Module._apply`` so that modules holding fake tensors convert by replacement; restored
    on exit however it ends."""
    original = torch.nn.Module._apply
    conversion = _Conversion()

    def _apply(self, fn, recurse=True):
        conversion.depth += 1
        try:
            if not _has_fake(self):
                return original(self, fn, recurse)  # recurses into the children through this patch
            if recurse:
                for child in self.children():
                    child._apply(fn)
            for key, p in self._parameters.items():
                if p is not None:
                    self._parameters[key] = conversion.convert(p, fn, parameter=True)
            for key, b in self._buffers.items():
                if b is not None:
                    self._buffers[key] = conversion.convert(b, fn, parameter=False)
            return self
        finally:
            conversion.depth -= 1
            if conversion.depth == 0:
                conversion.done.clear()

    torch.nn.Module._apply = _apply
    try:
        yield
    finally:
        torch.nn.Module._apply = original
