"""How far the caching-allocator replay's reserved memory was from the real one, as a band.

The replay (allocator.py) predicts max_memory_reserved from the trace's blocks; its error on real runs
is the evidence for the range of reserved (and of the smallest budget the step runs in). Measured on
this project's 34 real training runs (measured_runs.MEASURED_RUNS), counted only where memest's
allocated peak was within ``ALLOCATED_WITHIN`` of the real one, so the difference left is the
allocator's, not a missing tensor; runs with ``cudnn.benchmark`` on are left out (memest models the
default, off). For each run:

    delta = (real max_memory_reserved - memest reserved) / memest allocated

and the band for a step is [min delta, max delta] over the runs of its kind (with or without cuDNN
kernels, whose per-call workspaces the replay does not see yet), widened to include 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memest.device.measured_runs import MEASURED_RUNS, VALIDATION_SOURCE, Run

ALLOCATED_WITHIN = 0.03  # the allocated peak within 3%: the replay was given the real step's tensors


@dataclass(frozen=True)
class SlackBand:
    low: float  # fraction of the allocated peak (<= 0)
    high: float  # (>= 0)
    runs: int  # how many runs it rests on
    basis: str

    def bounds(self, allocated: int, value: int, floor: int = 0) -> tuple[int, int]:
        """``value`` (reserved, or an allocator limit) widened by the band, never below ``floor``."""
        return max(floor, value + math.floor(allocated * self.low)), value + math.ceil(allocated * self.high)


def counted(run: Run) -> bool:
    within = abs(run.memest_allocated - run.allocated) <= ALLOCATED_WITHIN * run.allocated
    return within and "cudnn_benchmark" not in run.options


def delta(run: Run) -> float:
    return (run.reserved - run.memest_reserved) / run.memest_allocated


def slack_band(cudnn: bool, runs: tuple[Run, ...] = MEASURED_RUNS) -> SlackBand:
    rows = [r for r in runs if counted(r)]
    kind = [r for r in rows if r.cudnn == cudnn] or rows
    if not kind:
        return SlackBand(0.0, 0.0, 0, "no measured run to derive an allocator band from")
    deltas = [delta(r) for r in kind]
    low, high = min(0.0, min(deltas)), max(0.0, max(deltas))
    what = "with cuDNN kernels (their workspaces are not replayed yet)" if cudnn else "without cuDNN kernels"
    return SlackBand(low, high, len(kind),
                     f"allocator replay vs real max_memory_reserved on {len(kind)} real runs {what}: "
                     f"{100 * low:+.1f}% to {100 * high:+.1f}% of the allocated peak ({VALIDATION_SOURCE})")
