"""Does the estimate fit? Against the live free memory of each GPU, a chosen GPU, or a budget.

The verdict is three-way, on the needed range (the smallest budget the step runs in, low / expected /
high, device/usage.py):

    fits          high <= budget       the step fits across the evidence's spread
    tight         floor <= budget < high
    does-not-fit  budget < floor

where floor (DeviceUsage.needed_bytes_floor) is the allocator floor (allocator.allocator_floor: the
step's live blocks in whole segments or pages, no fragmentation; no allocator runs the step in less)
plus the expected costs outside the allocator (their spread is the range's, not the verdict's line:
below expected fixed costs the step does not fit, as before). Between the floor and expected the
replay says the caching allocator's fragmentation does not fit; the real one may fragment less (another
event order, its cache freed before an OOM, expandable segments): tight, not does-not-fit. Callers that
give no floor keep the older rule (tight from expected up).

By default a tight step counts as fitting for exit codes (said loudly); with --strict it does not.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from memest.device.catalogue import CARDS, card_bytes
from memest.device.nvml import GpuQuery
from memest.errors import MemestError
from memest.spec.choices import Verdict
from memest.units import parse_bytes

_UNITLESS = re.compile(r"^[0-9]*\.[0-9]*$")  # a bare decimal number
FITS, TIGHT, DOES_NOT_FIT = Verdict.FITS, Verdict.TIGHT, Verdict.DOES_NOT_FIT  # short names


def verdict(needed_expected: int, needed_high: int | None, capacity: int, needed_low: int | None = None) -> Verdict:
    """``needed_high`` None: unbounded (cuDNN's benchmark search may take all free memory): never fits.
    ``needed_low``: the needed floor (DeviceUsage.needed_bytes_floor); does-not-fit only below it (None:
    below expected)."""
    if needed_high is not None and needed_high <= capacity:
        return Verdict.FITS
    floor = needed_expected if needed_low is None else min(needed_low, needed_expected)
    return Verdict.TIGHT if floor <= capacity else Verdict.DOES_NOT_FIT


def tight_reason(needed_low: int, needed_expected: int, capacity: int) -> str:
    """Why a tight verdict is tight, in one line (units in MiB)."""
    mib = 2**20
    if capacity < needed_expected:
        return (f"the budget is {(needed_expected - capacity) / mib:.0f} MiB under the caching-allocator replay's "
                f"need and {(capacity - needed_low) / mib:.0f} MiB over the floor (live blocks, no fragmentation): "
                "the real allocator may or may not fragment that much; PYTORCH_CUDA_ALLOC_CONF="
                "expandable_segments:True brings it nearer the floor")
    return "the expected need fits, the high end of the range does not"


def passes(result: Verdict | str, strict: bool = False) -> bool:
    """What a verdict means for an exit code: tight passes unless ``strict``."""
    return result == Verdict.FITS or (result == Verdict.TIGHT and not strict)


def worst(verdicts: list) -> Verdict | None:
    return Verdict.worst(verdicts)


@dataclass
class FitRow:
    label: str  # "GPU 0 NVIDIA H100 (free)" or "budget 11GB"
    capacity_bytes: int  # what the estimate must fit into: free memory, or the budget
    total_bytes: int | None
    used_bytes: int | None
    needed_bytes: int
    fits: bool  # needed (expected) <= capacity: fits or tight
    headroom_bytes: int
    verdict: Verdict | str = ""  # the needed range's Verdict ("" where none was given)
    needed_bytes_low: int | None = None
    needed_bytes_high: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def _row(label, capacity, total, used, needed, check=None) -> FitRow:
    fits = check(capacity) if check else needed <= capacity
    return FitRow(label, capacity, total, used, needed, fits, capacity - needed)


def resolve_budget(flag: str) -> tuple[str, int] | int:
    """``--gpu``: a device index (``0``) -> int; a size (``11GB``) or card (``rtx2080ti``) -> (label, bytes)."""
    text = flag.strip()
    if text.isdigit():
        return int(text)
    card = card_bytes(text)
    if card is not None:
        return f"{text} ({card / 2**30:g} GiB)", card
    if text[:1].isdigit() or text.startswith("-") or text.startswith("."):
        if _UNITLESS.match(text):  # 24.0 or 0.5: bytes, GB or GiB? never guessed (an integer is a device index)
            raise MemestError(f"--gpu {text} has no unit; write {text}GB (10^9 bytes) or {text}GiB (2^30 bytes)")
        size = parse_bytes(text)
        if size <= 0:
            raise MemestError(f"--gpu {text} is an empty budget (zero bytes): nothing fits in it; pass a size such as 11GB")
        return text, size
    raise MemestError(
        f"unknown GPU {flag!r}; pass a size such as 11GB or 11GiB, a device index such as 0, "
        f"or a known card: {', '.join(sorted(CARDS))}"
    )


def no_device(index: int, why: str) -> str:
    """A bare whole number names a device index; where there is none, say how to write a budget."""
    return (f"--gpu {index}: no such GPU ({why}); a bare number is a device index: for a budget write {index}GB "
            f"(10^9 bytes) or {index}GiB (2^30 bytes)")


def fit_rows(needed: int, gpu_flag: str | None, query: GpuQuery | None, check=None) -> list[FitRow]:
    """``check(capacity) -> bool`` decides fitting when given (the allocator replay with a device
    limit); otherwise ``needed <= capacity``."""
    if gpu_flag is not None:
        target = resolve_budget(gpu_flag)
        if isinstance(target, tuple):
            label, budget = target
            return [_row(f"budget {label}", budget, budget, None, needed, check)]
        gpus = {g.index: g for g in (query.gpus if query else [])}
        if target not in gpus:
            why = query.reason if query and query.reason else f"visible GPUs: {sorted(gpus) or 'none'}"
            raise MemestError(no_device(target, why))
        gpu_list = [gpus[target]]
    else:
        gpu_list = query.gpus if query else []
    return [
        _row(f"GPU {g.index} {g.name} (free)", g.free_bytes, g.total_bytes, g.used_bytes, needed, check)
        for g in gpu_list
    ]


