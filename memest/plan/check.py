"""`memest check`: does each run config fit its GPU or budget (with a margin)?"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..config import RunConfig
from ..spec import RunSpec


@dataclass
class CheckRow:
    name: str
    path: str
    model: str
    needed_bytes: int  # predicted device usage (cuda) or peak allocated (cpu)
    required_bytes: int  # needed x (1 + margin)
    budget_label: str
    budget_bytes: int
    margin: float
    fits: bool
    headroom_bytes: int  # budget - required (>= 0 exactly when it fits)
    seq: int | None = None  # the sequence length traced (the model's default when the config gives none)
    arch: str = ""  # the GPU generation whose kernels were modelled (sm90), --target cuda

    def to_dict(self) -> dict:
        return asdict(self)


def check_config(config: RunConfig, spec: RunSpec, source, gpu, margin: float | None) -> CheckRow:
    """``gpu``: the app layer's GpuContext for this config (budget, GPU generation, calibration);
    ``source``: the loaded model. Fits when needed x (1 + margin) <= budget."""
    from ..pipeline import estimate

    margin = margin if margin is not None else config.margin
    result = estimate(spec, gpu.calibration if spec.target == "cuda" else None, source=source)
    needed = result.needed_bytes
    required = math.ceil(needed * (1 + margin))
    budget = gpu.capacity_bytes
    return CheckRow(
        name=config.name,
        path=config.path,
        model=spec.model,
        needed_bytes=needed,
        required_bytes=required,
        budget_label=gpu.budget_label,
        budget_bytes=budget,
        margin=margin,
        fits=required <= budget and result.fits(budget),
        headroom_bytes=budget - required,
        seq=spec.seq if spec.seq is not None else source.default_seq,
        arch=gpu.arch if spec.target == "cuda" else "",
    )
