"""What a serve plan takes from the GPU the app layer resolved (app.GpuContext): the total memory the engine
sees, and the measured terms (non-torch, CUDA context) of a calibration profile or a vLLM log."""

from __future__ import annotations

from memest.device.catalogue import CARDS, normalise
from memest.serve.evidence import TOTALS, measured_context, measured_non_torch


def serve_total(ctx) -> tuple[int, str]:
    """The GPU's total memory as the engine sees it (cudaMemGetInfo): a logged figure for known cards,
    else the nominal size, a budget as given, or NVML's total for a local GPU."""
    flag = ctx.flag or ""
    known = TOTALS.get(normalise(flag))
    if known is not None:
        return known
    target = ctx.targets[0]
    if target.total_bytes is not None and target.label.startswith("GPU "):
        return target.total_bytes, f"{target.label.replace(' (free)', '')}: NVML total (cudaMemGetInfo's is a little lower)"
    return target.capacity_bytes, (f"--gpu {flag}: nominal size (the driver keeps a little; the engine sees somewhat "
                                   "less)" if not flag[:1].isdigit() else f"--gpu {flag} taken as the GPU's total")


def serve_measured(ctx, tp: int, non_torch_memory: float | None) -> dict:
    """ServeSpec's measured terms: the non-torch increase from ``non_torch_memory`` (GiB, the user's vLLM log's
    figure) or else the calibration profile of ``ctx``, and the profile's CUDA context; {} when neither applies."""
    out = {}
    non_torch = measured_non_torch(tp, non_torch_memory, ctx.calibration)
    if non_torch is not None:
        out["non_torch"] = non_torch
    context = measured_context(ctx.calibration)
    if context is not None:
        out["context"] = context
    return out


def larger_cards(total: int) -> list[tuple[str, int, tuple[int, int]]]:
    """The catalogue's cards (device/catalogue.py) whose total as the engine sees it (a logged total where TOTALS has
    one, else the nominal size) is above ``total``: (name, total, compute capability), smallest first, one name per
    (total, generation) (h100 for h100-80gb)."""
    seen, out = set(), []
    for name, (nominal, cc) in sorted(CARDS.items(), key=lambda kv: (kv[1][0], len(kv[0]), kv[0])):
        size = TOTALS.get(name, (nominal,))[0]
        if size > total and (size, cc) not in seen:
            seen.add((size, cc))
            out.append((name, size, cc))
    return sorted(out, key=lambda c: c[1])
