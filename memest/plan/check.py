"""`memest check`: does each run config fit its GPU or budget (with a margin)?"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..config import RunConfig
from ..device.fit import resolve_budget
from ..errors import MemestError


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
    headroom_bytes: int  # budget - required

    def to_dict(self) -> dict:
        return asdict(self)


def budget_for(gpu: str | None, query) -> tuple[str, int, tuple[int, int] | None]:
    """(label, bytes, compute capability) for a --gpu value, or the first visible GPU's free memory."""
    from ..device.fit import target_compute_capability

    if gpu is None:
        if query is None or not query.gpus:
            reason = query.reason if query is not None else "no GPU query"
            raise MemestError(f"no budget: add `gpu: 11GB` (or a card name) to the config or pass --gpu ({reason})")
        g = query.gpus[0]
        return f"GPU {g.index} {g.name} (free)", g.free_bytes, target_compute_capability(None, query)
    target = resolve_budget(gpu)
    cc = target_compute_capability(gpu, query)
    if isinstance(target, tuple):
        return target[0], target[1], cc
    gpus = {g.index: g for g in (query.gpus if query else [])}
    if target not in gpus:
        raise MemestError(f"--gpu {target}: no such GPU; pass a budget such as 11GB instead")
    return f"GPU {target} {gpus[target].name} (free)", gpus[target].free_bytes, cc


def check_config(config: RunConfig, overrides: dict, gpu: str | None, margin: float | None, query) -> CheckRow:
    from ..pipeline import estimate

    gpu = gpu if gpu is not None else config.gpu
    margin = margin if margin is not None else config.margin
    label, budget, cc = budget_for(gpu, query)
    spec = config.spec(**overrides, compute_capability=cc)
    result = estimate(spec)
    needed = result.needed_bytes
    required = int(needed * (1 + margin))
    fits = result.fits(int(budget / (1 + margin)))
    return CheckRow(
        name=config.name,
        path=config.path,
        model=spec.model,
        needed_bytes=needed,
        required_bytes=required,
        budget_label=label,
        budget_bytes=budget,
        margin=margin,
        fits=fits,
        headroom_bytes=budget - required,
    )
