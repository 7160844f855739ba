"""The real torch.optim classes, configured the way the target device would run them, and the one
table that says what each --optim choice is."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memest.spec import RunSpec
from memest.spec.choices import Optimizer, Target


@dataclass(frozen=True)
class OptimizerInfo:
    cls: str  # attribute of torch.optim, or "adam8bit" (memest's model of bitsandbytes' layout)
    kwargs: dict = field(default_factory=dict)
    fused: bool = False  # a fused (single-kernel) CUDA implementation exists in torch.optim
    foreach: bool = True  # a foreach (multi-tensor) implementation exists; CUDA runs default to it
    folklore_n: float = 2  # bytes of params + grads + state per parameter byte (folklore: params x n)
    summary: str = ""


OPTIMIZERS: dict[Optimizer, OptimizerInfo] = {
    Optimizer.SGD: OptimizerInfo("SGD", fused=True, folklore_n=2, summary="no state"),
    Optimizer.SGD_MOMENTUM: OptimizerInfo("SGD", {"momentum": 0.9}, fused=True, folklore_n=3,
                                          summary="momentum buffer (1x params)"),
    Optimizer.ADAM: OptimizerInfo("Adam", fused=True, folklore_n=4, summary="exp_avg + exp_avg_sq (2x params)"),
    Optimizer.ADAMW: OptimizerInfo("AdamW", fused=True, folklore_n=4, summary="exp_avg + exp_avg_sq (2x params)"),
    Optimizer.ADAFACTOR: OptimizerInfo("Adafactor", folklore_n=2, summary="factored second moment (row + column)"),
    Optimizer.ADAM8BIT: OptimizerInfo("adam8bit", foreach=False, folklore_n=2.5,
                                      summary="bitsandbytes 8-bit state, block-wise (modelled)"),
    Optimizer.PAGED_ADAMW_8BIT: OptimizerInfo("adam8bit", {"paged": True}, foreach=False, folklore_n=2.5,
                                              summary="bitsandbytes PagedAdamW8bit: large states host-pageable"),
    Optimizer.PAGED_ADAMW_32BIT: OptimizerInfo("adam8bit", {"bits": 32, "paged": True}, foreach=False, folklore_n=4,
                                               summary="bitsandbytes PagedAdamW32bit: large states host-pageable"),
}

# kept for callers that ask by name
FUSED = tuple(o.value for o, info in OPTIMIZERS.items() if info.fused)
FOLKLORE_N = {o.value: info.folklore_n for o, info in OPTIMIZERS.items()}


def optim_help() -> str:
    return "; ".join(f"{o.value}: {info.summary}" for o, info in OPTIMIZERS.items())


def make_optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    """``--target cuda``: foreach implementations (what a CUDA run defaults to).
    ``--target cpu``: torch's own defaults for CPU tensors (single-tensor loops)."""
    cls, kwargs = optimizer_class(spec)
    return cls(params, **kwargs)


def optimizer_class(spec: RunSpec) -> tuple[type, dict]:
    """The optimizer class and its keyword arguments (ZeroRedundancyOptimizer builds it itself)."""
    info = OPTIMIZERS[spec.optim]
    kwargs: dict = {**info.kwargs, "lr": spec.lr}
    if spec.target == Target.CUDA and info.foreach:
        if spec.fused and info.fused:
            kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
    if info.cls == "adam8bit":
        from memest.features.adam8bit import Adam8bitModel

        if spec.target == Target.CPU:
            kwargs.pop("paged", None)  # bitsandbytes falls back to non-paged buffers on CPU (get_state_buffer)
        return Adam8bitModel, kwargs
    return getattr(torch.optim, info.cls), kwargs
