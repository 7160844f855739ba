"""Where --fp8 tensorwise's added trace time goes by code (issue 23): cProfile of STEPS traced steps of
examples/transformer.py with and without --fp8 tensorwise (after one warm-up each), the profiled own time
(tottime) per step summed by where the code lives: torchao's Python, memest's modules, torch's FakeTensorMode, C
functions (the dispatcher and tensor methods called from Python), and the rest. cProfile inflates Python calls, so
the columns are comparable with each other, not with unprofiled times.

Usage: PYTHONPATH=$PWD python scripts/trace_profile_groups.py [STEPS]   (default 3)"""

from __future__ import annotations

import collections
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402

MODEL = "examples/transformer.py"
BASE = {"model": MODEL, "target": "cuda", "batch": 2, "seq": 64, "optim": "adamw"}
GROUPS = (  # (label, test on the profiled function's file name), first match wins
    ("torchao's Python", lambda f: "torchao" in f),
    ("memest trace/tracker.py (incl. its FakeTensorMode cache key and cached outputs)", lambda f: "memest/trace/tracker" in f),
    ("memest, other modules", lambda f: "memest" in f),
    ("torch FakeTensorMode (fake_tensor.py, meta_utils.py)", lambda f: "fake_tensor.py" in f or "meta_utils" in f),
    ("C functions (dispatcher, tensor methods, builtins)", lambda f: f == "~"),
    ("torch's per-call wrappers (dynamo disable, stats), pytree", lambda f: any(
        s in f for s in ("_dynamo", "_compile.py", "_stats.py", "pytree"))),
    ("torch autograd Python", lambda f: "autograd" in f),
    ("other Python", lambda f: True),
)


def profile(source, spec: RunSpec, steps: int) -> collections.Counter:
    trace_step(source, spec)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        trace_step(source, spec)
    profiler.disable()
    spent: collections.Counter = collections.Counter()
    for (filename, _line, _name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(profiler).stats.items():
        spent[next(label for label, test in GROUPS if test(filename))] += tottime / steps
    return spent


def main(steps: int) -> None:
    source = load_source(MODEL)
    plain = profile(source, RunSpec(**BASE), steps)
    fp8 = profile(source, RunSpec(**BASE, fp8="tensorwise"), steps)
    print(f"{MODEL} batch 2 seq 64 --target cuda --optim adamw: profiled own time per step, {steps} steps each\n")
    print("| code | without --fp8: ms | --fp8 tensorwise: ms | added: ms |")
    print("|---|---|---|---|")
    for label, _ in GROUPS:
        print(f"| {label} | {1000 * plain[label]:.1f} | {1000 * fp8[label]:.1f} | {1000 * (fp8[label] - plain[label]):+.1f} |")
    a, b = sum(plain.values()), sum(fp8.values())
    print(f"| all | {1000 * a:.1f} | {1000 * b:.1f} | {1000 * (b - a):+.1f} ({b / a - 1:+.1%}) |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
