"""Trace time of a step with and without a technique, interleaved in one process (A B, B A, A B, ...), as Markdown rows
for benchmarks/trace-speed.md: the medians of wall and CPU (process) time over PAIRS pairs, the ops the tracker
traced per step (StorageTracker.dispatch calls) and the metadata queries answered before it (prim.device, sizes,
strides), and CPU ms per traced op; the ratio of the CPU minima too (the
least disturbed run of each, on a shared machine). Then, for each step, its CPU time with TrackingFakeMode's
FakeTensorMode shortcuts (the dispatch cache key and the output rebuilt from the cache entry, trace/tracker.py) and
with torch's own two methods in their place, interleaved the same way in the same process.

Usage: python scripts/bench_trace_speed.py [PAIRS] [LABEL]   (default 7; LABEL: only the cases whose technique
contains it, e.g. mxfp8)"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.trace import tracker as tracker_module  # noqa: E402

# (label, model, without, with): each spec traced on --target cuda
CASES = [
    ("--activation-offload torchtune", "hf:tests/configs/llama-tiny.json",
     {"batch": 2, "seq": 64}, {"activation_offload": "torchtune"}),
    ("--activation-offload torchtune", "hf:tests/configs/gpt2-tiny.json",
     {"batch": 4, "seq": 64}, {"activation_offload": "torchtune"}),
    ("--fp8 tensorwise", "examples/transformer.py", {"batch": 2, "seq": 64, "optim": "adamw"}, {"fp8": "tensorwise"}),
    ("--fp8 mxfp8", "examples/transformer.py", {"batch": 2, "seq": 64, "optim": "adamw", "compute_capability": (10, 0)},
     {"fp8": "mxfp8"}),
    ("--fp8 te-delayed", "examples/transformer.py", {"batch": 2, "seq": 64, "optim": "adamw"}, {"fp8": "te-delayed"}),
    # a model of the size people train with float8 (16 decoder layers: the first layer's casts are recorded, the
    # other layers' replayed, trace/replay.py)
    ("--fp8 tensorwise", "hf:llama-3.2-1b", {"batch": 1, "seq": 256, "optim": "adamw", "precision": "bf16-mixed"},
     {"fp8": "tensorwise"}),
    ("--fp8 mxfp8", "hf:llama-3.2-1b", {"batch": 1, "seq": 256, "optim": "adamw", "precision": "bf16-mixed",
                                        "compute_capability": (10, 0)}, {"fp8": "mxfp8"}),
]


class _Counting(dict):
    """_DISPATCH_META_HANDLERS, counting the queries TrackingFakeMode answers from it."""

    hits = 0

    def get(self, key, default=None):
        found = super().get(key, default)
        if found is not None:
            _Counting.hits += 1
        return found


def op_counts(source, spec: RunSpec) -> tuple[int, int]:
    """(ops the tracker traced: dispatched ones and StorageTracker.empty_like's, metadata queries answered before
    it) in one traced step (not timed)."""
    calls = 0
    dispatch, empty_like = tracker_module.StorageTracker.dispatch, tracker_module.StorageTracker.empty_like

    def counting(method):
        def counted(self, *args, **kwargs):
            nonlocal calls
            calls += 1
            return method(self, *args, **kwargs)

        return counted

    handlers = tracker_module._DISPATCH_META_HANDLERS
    tracker_module.StorageTracker.dispatch = counting(dispatch)
    tracker_module.StorageTracker.empty_like = counting(empty_like)
    tracker_module._DISPATCH_META_HANDLERS = _Counting(handlers)
    _Counting.hits = 0
    try:
        trace_step(source, spec)
    finally:
        tracker_module.StorageTracker.dispatch, tracker_module.StorageTracker.empty_like = dispatch, empty_like
        tracker_module._DISPATCH_META_HANDLERS = handlers
    return calls, _Counting.hits


def empty_like_cost(rounds: int, calls: int = 500) -> tuple[float, float]:
    """Median CPU us per call of torch.empty_like dispatched into a tracked fake mode and of StorageTracker.empty_like
    (the same record), on a contiguous 2 x 64 x 128 float32 fake tensor, interleaved."""
    import torch

    from memest.trace.events import Trace

    mode = tracker_module.TrackingFakeMode()
    times: dict[str, list[float]] = {"op": [], "shortcut": []}
    with mode:
        t = torch.randn(2, 64, 128)
        with tracker_module.StorageTracker(Trace(), lambda: "", mode) as tracker:
            makers = {"op": torch.empty_like, "shortcut": tracker.empty_like}
            for _ in range(rounds):
                for key, make in makers.items():
                    start = time.process_time()
                    for _ in range(calls):
                        make(t)
                    times[key].append(1e6 * (time.process_time() - start) / calls)
    return statistics.median(times["op"]), statistics.median(times["shortcut"])


def shortcut_cost(source, specs: dict, pairs: int) -> dict[str, tuple[float, float]]:
    """Per spec: median CPU s of a traced step with torch's FakeTensorMode._prep_args_for_hash and
    _get_output_tensor_from_cache_entry on TrackingFakeMode and no direct decomposition (every op through
    FakeTensorMode's own path), and with memest's (the class's own), interleaved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = tracker_module.TrackingFakeMode
    names = ("_prep_args_for_hash", "_get_output_tensor_from_cache_entry", "_direct_decomposition")
    methods = {"torch": [getattr(FakeTensorMode, n) for n in names[:2]] + [lambda self, *args: None],
               "memest": [mode.__dict__[n] for n in names]}
    cpu: dict = {(v, k): [] for v in methods for k in specs}
    try:
        for i in range(pairs):
            for variant in sorted(methods, reverse=i % 2 == 1):
                for name, method in zip(names, methods[variant], strict=True):
                    setattr(mode, name, method)
                for key, spec in sorted(specs.items(), reverse=i % 2 == 1):
                    start = time.process_time()
                    trace_step(source, spec)
                    cpu[variant, key].append(time.process_time() - start)
    finally:
        for name, method in zip(names, methods["memest"], strict=True):
            setattr(mode, name, method)
    return {k: (statistics.median(cpu["torch", k]), statistics.median(cpu["memest", k])) for k in specs}


def main(pairs: int, only: str = "") -> None:
    op, shortcut = empty_like_cost(pairs)
    print(f"torch.empty_like through the tracked fake mode: {op:.1f} CPU us per call; StorageTracker.empty_like: "
          f"{shortcut:.1f} (median of {pairs} rounds of 500 calls each, interleaved)\n")
    print("| technique | model | step | without: wall s / CPU s | with: wall s / CPU s | wall ratio | CPU ratio | CPU ratio of minima | "
          "ops traced without / with | metadata queries without / with | CPU ms per op without / with |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    shortcut_rows = []
    for label, model, base, extra in (c for c in CASES if only in c[0]):
        source = load_source(model)
        specs = {"without": RunSpec(model=model, target="cuda", **base),
                 "with": RunSpec(model=model, target="cuda", **base, **extra)}
        for spec in specs.values():  # warm-up: imports, torchao's conversion, caches
            trace_step(source, spec)
        wall: dict[str, list[float]] = {k: [] for k in specs}
        cpu: dict[str, list[float]] = {k: [] for k in specs}
        for i in range(pairs):
            for key, spec in sorted(specs.items(), reverse=i % 2 == 1):  # A B, B A, A B, ...
                start, start_cpu = time.perf_counter(), time.process_time()
                trace_step(source, spec)
                wall[key].append(time.perf_counter() - start)
                cpu[key].append(time.process_time() - start_cpu)
        counts = {k: op_counts(source, spec) for k, spec in specs.items()}
        w = {k: statistics.median(v) for k, v in wall.items()}
        c = {k: statistics.median(v) for k, v in cpu.items()}
        step = " ".join(f"{k}={v}" for k, v in base.items())
        print(f"| {label} | {model} | {step} | {w['without']:.3f} / {c['without']:.3f} | {w['with']:.3f} / "
              f"{c['with']:.3f} | {w['with'] / w['without'] - 1:+.1%} | {c['with'] / c['without'] - 1:+.1%} | "
              f"{min(cpu['with']) / min(cpu['without']) - 1:+.1%} | "
              f"{counts['without'][0]:,} / {counts['with'][0]:,} | {counts['without'][1]:,} / {counts['with'][1]:,} | "
              f"{1000 * c['without'] / counts['without'][0]:.3f} / {1000 * c['with'] / counts['with'][0]:.3f} |",
              flush=True)
        shortcut_rows.append((label, model, shortcut_cost(source, specs, pairs)))
    print(f"\nTrackingFakeMode's cache-key, cached-output and direct-decomposition shortcuts: median CPU s per traced "
          f"step over {pairs} interleaved rounds, torch's path in their place against memest's\n")
    print("| technique | model | step | torch's: CPU s | memest's: CPU s | change |")
    print("|---|---|---|---|---|---|")
    for label, model, costs in shortcut_rows:
        for key, (theirs, ours) in costs.items():
            print(f"| {label} | {model} | {key} | {theirs:.3f} | {ours:.3f} | {ours / theirs - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7, sys.argv[2] if len(sys.argv) > 2 else "")
