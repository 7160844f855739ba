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
    needed_bytes: int  # the smallest budget the step runs in, expected (cuda) or peak allocated (cpu)
    required_bytes: int  # needed x (1 + margin)
    budget_label: str
    budget_bytes: int
    margin: float
    fits: bool  # what the exit code counts: verdict fits, or tight unless --strict
    headroom_bytes: int  # budget - required (>= 0 exactly when expected fits)
    seq: int | None = None  # the sequence length traced (the model's default when the config gives none)
    arch: str = ""  # the GPU generation whose kernels were modelled (sm90), --target cuda
    verdict: str = ""  # fits (high <= budget) | tight (expected <= budget < high) | does-not-fit
    needed_bytes_low: int = 0  # the needed range (device/usage.py); needed_bytes is the expected value
    needed_bytes_high: int = 0
    required_bytes_high: int = 0  # needed high x (1 + margin): what "fits" needs
    calibration: str = ""  # the calibration applied, if any

    def to_dict(self) -> dict:
        return asdict(self)


def check_config(config: RunConfig, spec: RunSpec, source, gpu, margin: float | None,
                 strict: bool = False) -> CheckRow:
    """``gpu``: the app layer's GpuContext for this config (budget, GPU generation, calibration);
    ``source``: the loaded model. The verdict compares needed x (1 + margin), expected and high, with
    the budget; ``strict``: tight counts as not fitting."""
    from ..device.fit import passes, verdict
    from ..pipeline import estimate

    margin = margin if margin is not None else config.margin
    result = estimate(spec, gpu.calibration if spec.target == "cuda" else None, source=source)
    low, needed, high = result.needed_range
    required = math.ceil(needed * (1 + margin))
    required_high = None if high is None else math.ceil(high * (1 + margin))  # None: unbounded
    budget = gpu.capacity_bytes
    outcome = verdict(required, required_high, budget) if result.fits(budget) else "does-not-fit"
    return CheckRow(
        name=config.name,
        path=config.path,
        model=spec.model,
        needed_bytes=needed,
        required_bytes=required,
        budget_label=gpu.budget_label,
        budget_bytes=budget,
        margin=margin,
        fits=passes(outcome, strict),
        headroom_bytes=budget - required,
        seq=spec.seq if spec.seq is not None else source.default_seq,
        arch=gpu.arch if spec.target == "cuda" else "",
        verdict=outcome,
        needed_bytes_low=low,
        needed_bytes_high=high,
        required_bytes_high=required_high,
        calibration=(gpu.calibration_note or "") if spec.target == "cuda" else "",
    )
