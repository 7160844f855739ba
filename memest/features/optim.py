"""The real torch.optim classes, configured the way the target device would run them, and the one
table that says what each --optim choice is."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from memest.features.adam8bit import Adam8bitModel
from memest.features.base import StepFeature
from memest.features.optim_in_backward import InBackwardOptimizer
from memest.spec import RunSpec
from memest.spec.choices import Offload, Optimizer, Target
from memest.trace.events import Phase
from memest.units import format_bytes


@dataclass(frozen=True)
class OptimizerInfo:
    cls: str  # attribute of torch.optim, or "adam8bit" (memest's model of bitsandbytes' layout)
    kwargs: dict = field(default_factory=dict)
    fused: bool = False  # a fused (single-kernel) CUDA implementation exists in torch.optim
    foreach: bool = True  # a foreach (multi-tensor) implementation exists; CUDA runs default to it
    folklore_n: float = 2  # bytes of params + grads + state per parameter byte (folklore: params x n)


OPTIMIZERS: dict[Optimizer, OptimizerInfo] = {
    Optimizer.SGD: OptimizerInfo("SGD", fused=True, folklore_n=2),
    Optimizer.SGD_MOMENTUM: OptimizerInfo("SGD", {"momentum": 0.9}, fused=True, folklore_n=3),
    Optimizer.ADAM: OptimizerInfo("Adam", fused=True, folklore_n=4),
    Optimizer.ADAMW: OptimizerInfo("AdamW", fused=True, folklore_n=4),
    Optimizer.ADAFACTOR: OptimizerInfo("Adafactor", folklore_n=2),
    Optimizer.ADAM8BIT: OptimizerInfo("adam8bit", foreach=False, folklore_n=2.5),
    Optimizer.PAGED_ADAMW_8BIT: OptimizerInfo("adam8bit", {"paged": True}, foreach=False, folklore_n=2.5),
    Optimizer.PAGED_ADAMW_32BIT: OptimizerInfo("adam8bit", {"bits": 32, "paged": True}, foreach=False, folklore_n=4),
}

# kept for callers that ask by name
FUSED = tuple(o.value for o, info in OPTIMIZERS.items() if info.fused)
FOLKLORE_N = {o.value: info.folklore_n for o, info in OPTIMIZERS.items()}


def make_optimizer(spec: RunSpec, params) -> torch.optim.Optimizer:
    """``--target cuda``: foreach implementations (what a CUDA run defaults to).
    ``--target cpu``: torch's own defaults for CPU tensors (single-tensor loops).
    ``--optim-in-backward``: one such optimizer per parameter, stepped in its post-accumulate-grad hook."""
    cls, kwargs = optimizer_class(spec)
    if spec.optim_in_backward:
        return InBackwardOptimizer(params, cls, kwargs)
    return cls(params, **kwargs)


def step_optimizer(spec: RunSpec, params: list) -> torch.optim.Optimizer | None:
    """The optimizer of a training step over the parameters that require grad; None when there is
    nothing to step (inference, or every parameter frozen: torch.optim refuses an empty list)."""
    return make_optimizer(spec, params) if spec.training and params else None


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

        if spec.target == Target.CPU:
            kwargs.pop("paged", None)  # bitsandbytes falls back to non-paged buffers on CPU (get_state_buffer)
        return Adam8bitModel, kwargs
    return getattr(torch.optim, info.cls), kwargs


class OptimizerFeature(StepFeature):
    """--optim: the real optimizer over the parameters that require grad; bitsandbytes' paged state
    (``optimizer.paged``) contributed to host memory: CUDA unified memory, paged in by the driver."""

    name = "optimizer"

    def __init__(self) -> None:
        self.paged: set[int] = set()  # storage ids of paged optimizer state

    def optimizer(self, step) -> torch.optim.Optimizer | None:
        return step_optimizer(step.spec, step.params)

    def after(self, step, phase) -> None:
        if phase is Phase.OPTIMIZER:
            for t in getattr(step.optimizer, "paged", ()):
                if (sid := step.tracker.storage_id(t)) is not None:
                    self.paged.add(sid)

    def host(self, trace, spec) -> list[int]:
        return sorted(self.paged)

    def finish(self, step) -> list[str]:
        if not self.paged or step.spec.offload != Offload.NONE:  # offloaded: the host holds the state anyway
            return []
        paged = sum(step.trace.storages[sid].nbytes for sid in self.paged)
        return [
            f"--optim {step.spec.optim}: {format_bytes(paged)} of optimizer state in CUDA unified memory (bitsandbytes "
            "paged buffers, cudaMallocManaged): host-pageable, not counted as device memory; the driver pages it "
            "in during the optimizer step"
        ]
