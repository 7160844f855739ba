"""`memest max-batch`: the largest batch (or sequence length) that fits, found by search over traces.
Exact at the boundary: the answer was traced and fits, and answer + 1 was traced and does not."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memest.errors import MemestError
from memest.features.grpo import generations_of
from memest.plan.runner import Runner
from memest.spec.choices import Preference


@dataclass
class SearchResult:
    key: str  # "batch" or "seq"
    value: int  # largest that fits (0: even 1 does not)
    capacity_bytes: int
    needed_bytes: int  # at value (0 if none fits)
    next_needed_bytes: int | None  # at value + 1 (None when the search stopped at the limit)
    limit: int
    hit_limit: bool
    probes: list[tuple[int, int, bool]] = field(default_factory=list)  # (value, needed, fits)
    cap: str = ""  # what sets ``limit``: "--limit N", or the model's positions ("the model's N positions (...)")
    step: int = 1  # the values searched are its multiples: --preference grpo's batch, a multiple of --generations

    def to_dict(self) -> dict:
        return asdict(self)


def largest_fitting(runner: Runner, key: str, capacity: int, start: int = 1, limit: int = 1 << 16,
                    cap: str = "") -> SearchResult:
    """``cap``: what sets ``limit``, as the result names it (default "--limit N")."""
    step = _step(runner, key)
    if step > limit:
        raise MemestError(f"--limit {limit}: --preference grpo's batch is a multiple of --generations {step} (trl's "
                          f"check on the generation batch); give --limit {step} or more")
    result = _largest_fitting(runner, key, capacity, start, limit, step)
    result.cap = cap or f"--limit {limit}"
    result.step = step
    return result


def _step(runner: Runner, key: str) -> int:
    """What the searched values are multiples of: GRPO's batch counts completions, ``--generations`` per prompt
    (was: max-batch probed batch 1 and stopped on RunSpec's multiple check, battery 30)."""
    if key != "batch" or runner.base.preference != Preference.GRPO:
        return 1
    if runner.base.generation_batch:  # a fixed generation batch is a multiple of each batch searched: most are not
        raise MemestError(f"--generation-batch {runner.base.generation_batch} fixes trl's generation_batch_size, a "
                          "multiple of --batch: drop it to search --batch (trl's default scales it, --batch x "
                          "--grad-accum)")
    return generations_of(runner.base)


def _largest_fitting(runner: Runner, key: str, capacity: int, start: int, limit: int, step: int = 1) -> SearchResult:
    """The search over ``value * step`` (value counts steps); the result in the key's own units."""
    probes: list[tuple[int, int, bool]] = []

    def fits(value: int) -> bool:
        result = runner.run(**{key: value * step})
        ok = result.fits(capacity)
        probes.append((value * step, result.needed_bytes, ok))
        return ok

    def needed(value: int) -> int:
        return runner.run(**{key: value * step}).needed_bytes

    full_limit, limit = limit, limit // step
    start = max(1, min(start, full_limit) // step)
    floor = 2 if key == "batch" and runner.base.preference == Preference.KTO else 1  # trl's KTOTrainer: batch > 1
    start = max(floor, min(start, limit))
    if fits(start):
        lo, hi = start, None
        while lo < limit:
            nxt = min(lo * 2, limit)
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
                break
        if hi is None:
            return SearchResult(key, lo * step, capacity, needed(lo), None, full_limit, True, probes)
    else:
        if start == floor:
            return SearchResult(key, 0, capacity, 0, needed(floor), full_limit, False, probes)
        lo, hi = 0, start
        while lo == 0 and hi > floor:  # go down by halving until something fits
            mid = max(hi // 2, floor)
            if fits(mid):
                lo = mid
            else:
                hi = mid
        if lo == 0:
            return SearchResult(key, 0, capacity, 0, needed(floor), full_limit, False, probes)
    while hi - lo > 1:  # invariant: lo fits, hi does not
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return SearchResult(key, lo * step, capacity, needed(lo), needed(hi), full_limit, False, probes)
