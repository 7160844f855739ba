"""``model.to(dtype)`` for fake and real models alike.

nn.Module.to() swaps FakeTensor parameters in place (torch.utils.swap_tensors), which fails once
anything holds a weak reference to them; making new Parameters is equivalent for memory and keeps
tied weights tied (one new tensor per old one).
"""

from __future__ import annotations

import torch


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
