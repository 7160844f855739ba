"""Estimates for planners: one loaded model source, many specs, progress on stderr."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable

from memest.estimator import Estimate, estimate
from memest.sources import load_source
from memest.spec import RunSpec


class Runner:
    """Runs estimates of variants of one base spec, caching by spec."""

    def __init__(self, base: RunSpec, calibration: dict | None = None, progress: Callable[[str], None] | None = None):
        self.base = base
        self.calibration = calibration
        self.source = load_source(base.model)
        self.progress = progress
        self.cache: dict[RunSpec, Estimate] = {}
        self.traces = 0

    def run(self, **changes) -> Estimate:
        spec = dataclasses.replace(self.base, **changes)
        if spec not in self.cache:
            start = time.perf_counter()
            self.cache[spec] = estimate(spec, self.calibration, source=self.source)
            self.traces += 1
            if self.progress:
                what = ", ".join(f"{k}={v}" for k, v in changes.items()) or "base"
                self.progress(f"traced {what} in {time.perf_counter() - start:.1f} s")
        return self.cache[spec]


def stderr_progress(message: str) -> None:
    print(f"memest: {message}", file=sys.stderr, flush=True)
