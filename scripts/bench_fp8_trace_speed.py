"""Trace time of examples/transformer.py's step with and without --fp8 tensorwise, each with TrackingFakeMode's two
subclass/composite fast paths (trace/tracker.py ``_declines``: ops on torchao's Float8TrainingTensor answered
NotImplemented before FakeTensorMode's cache key; ``_plain_contiguous``: aten.contiguous answered as its
CompositeImplicitAutograd kernel answers it) on and forced off (torch's path), the four variants interleaved in one
process, the order reversed every round; medians of wall and CPU (process) time over ROUNDS rounds, as a Markdown
table for benchmarks/fp8-trace-speed.md.

Usage: PYTHONPATH=$PWD python scripts/bench_fp8_trace_speed.py [ROUNDS]   (default 9)"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.trace.tracker import TrackingFakeMode  # noqa: E402

MODEL = "examples/transformer.py"
BASE = {"model": MODEL, "target": "cuda", "batch": 2, "seq": 64, "optim": "adamw"}
FAST_PATHS = ("_declines", "_plain_contiguous")


def main(rounds: int) -> None:
    source = load_source(MODEL)
    specs = {"without --fp8": RunSpec(**BASE), "--fp8 tensorwise": RunSpec(**BASE, fp8="tensorwise")}
    own = {name: TrackingFakeMode.__dict__[name] for name in FAST_PATHS}
    variants = ("torch's path", "fast paths")
    wall: dict = {(v, k): [] for v in variants for k in specs}
    cpu: dict = {(v, k): [] for v in variants for k in specs}
    for spec in specs.values():  # warm-up: imports, torchao's conversion, FakeTensorMode's cache
        trace_step(source, spec)
    try:
        for i in range(rounds):
            order = [(v, k) for v in variants for k in specs]
            for variant, key in reversed(order) if i % 2 else order:
                for name in FAST_PATHS:
                    setattr(TrackingFakeMode, name, own[name] if variant == "fast paths" else lambda self, *a: False)
                start, start_cpu = time.perf_counter(), time.process_time()
                trace_step(source, specs[key])
                wall[variant, key].append(time.perf_counter() - start)
                cpu[variant, key].append(time.process_time() - start_cpu)
    finally:
        for name, method in own.items():
            setattr(TrackingFakeMode, name, method)
    print(f"{MODEL} batch 2 seq 64 --target cuda --optim adamw: medians over {rounds} interleaved rounds\n")
    print("| variant | without --fp8: wall s / CPU s | --fp8 tensorwise: wall s / CPU s | wall ratio | CPU ratio | "
          "CPU ratio of minima |")
    print("|---|---|---|---|---|---|")
    for v in variants:
        w = {k: statistics.median(wall[v, k]) for k in specs}
        c = {k: statistics.median(cpu[v, k]) for k in specs}
        plain, fp8 = specs
        print(f"| {v} | {w[plain]:.3f} / {c[plain]:.3f} | {w[fp8]:.3f} / {c[fp8]:.3f} | {w[fp8] / w[plain] - 1:+.1%} | "
              f"{c[fp8] / c[plain] - 1:+.1%} | {min(cpu[v, fp8]) / min(cpu[v, plain]) - 1:+.1%} |")
    for k in specs:
        before, after = (statistics.median(cpu[v, k]) for v in variants)
        print(f"\n{k}: CPU {before:.3f} s with torch's path, {after:.3f} s with the fast paths ({after / before - 1:+.1%})",
              end="")
    print()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
