"""Trace time of examples/transformer.py's step with and without --fp8 tensorwise, each with TrackingFakeMode's two
subclass/composite fast paths (trace/tracker.py ``_declines``: ops on torchao's Float8TrainingTensor answered
NotImplemented before FakeTensorMode's cache key; ``_plain_contiguous``: aten.contiguous answered as its
CompositeImplicitAutograd kernel answers it) on and forced off (torch's path), the four variants interleaved in one
process, the order reversed every round; medians of wall and CPU (process) time over ROUNDS rounds, as a Markdown
table for benchmarks/fp8-trace-speed.md. Then the CPU time of the calls the fast paths answer, in the fp8 step, both
variants interleaved (a difference too small for the whole step's noise on a shared machine).

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


def affected_ops(source, spec: RunSpec, rounds: int) -> dict[str, tuple[int, float]]:
    """Per variant: (calls per step, median CPU s per step) of the calls into TrackingFakeMode.__torch_dispatch__
    that the fast paths answer (aten.contiguous, and the ops answered NotImplemented), timed by a wrapper (its own
    cost is in both variants), the variants interleaved."""
    import torch

    own = {name: TrackingFakeMode.__dict__[name] for name in FAST_PATHS}
    entry = TrackingFakeMode.__torch_dispatch__
    spent = {"calls": 0, "cpu": 0.0}
    depth = [0]

    def timed(self, func, types, args=(), kwargs=None):
        depth[0] += 1
        start = time.process_time()
        try:
            out = entry(self, func, types, args, kwargs)
        finally:
            depth[0] -= 1
        if depth[0] == 0 and (out is NotImplemented or func is torch.ops.aten.contiguous.default):
            spent["calls"] += 1
            spent["cpu"] += time.process_time() - start
        return out

    result: dict = {"torch's path": [], "fast paths": []}
    TrackingFakeMode.__torch_dispatch__ = timed
    try:
        for i in range(rounds):
            for variant in sorted(result, reverse=i % 2 == 1):
                for name in FAST_PATHS:
                    setattr(TrackingFakeMode, name, own[name] if variant == "fast paths" else lambda self, *a: False)
                spent.update(calls=0, cpu=0.0)
                trace_step(source, spec)
                result[variant].append((spent["calls"], spent["cpu"]))
    finally:
        TrackingFakeMode.__torch_dispatch__ = entry
        for name, method in own.items():
            setattr(TrackingFakeMode, name, method)
    return {v: (runs[0][0], statistics.median(c for _, c in runs)) for v, runs in result.items()}


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
    ops = affected_ops(source, specs["--fp8 tensorwise"], rounds)
    print("\n--fp8 tensorwise, the calls the fast paths answer (aten.contiguous; ops answered NotImplemented for a tensor "
          "subclass), per step, median of the same rounds: " + "; ".join(
              f"{v}: {n} calls, {1000 * c:.1f} CPU ms ({1e6 * c / n:.0f} us each)" for v, (n, c) in ops.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 9)
