"""Where a traced step's CPU time goes, with and without --fp8 (issue 23): per step, the CPU time inside
StorageTracker.dispatch (the ops traced), split into FakeTensorMode's own dispatch of each op (TrackingFakeMode's
_run_tracked) and memest's per-op work around it (recording storages, FLOPs), and the time outside the traced ops
(the model's and torchao's Python, autograd, the dispatcher's path into the mode, module hooks). Medians over ROUNDS
interleaved rounds; the timing wrappers add two process_time calls per op to each step.

Usage: PYTHONPATH=$PWD python scripts/trace_split.py [ROUNDS]   (default 7)"""

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

MODEL = "examples/transformer.py"
BASE = {"model": MODEL, "target": "cuda", "batch": 2, "seq": 64, "optim": "adamw"}


def main(rounds: int) -> None:
    source = load_source(MODEL)
    specs = {"without --fp8": RunSpec(**BASE), "--fp8 tensorwise": RunSpec(**BASE, fp8="tensorwise")}
    for spec in specs.values():  # warm-up
        trace_step(source, spec)
    clock = time.process_time
    spent = {"ops": 0.0, "fake": 0.0}
    dispatch, run = tracker_module.StorageTracker.dispatch, tracker_module.TrackingFakeMode._run_tracked

    def timed(method, key):
        def wrapper(self, *args):
            start = clock()
            try:
                return method(self, *args)
            finally:
                spent[key] += clock() - start

        return wrapper

    tracker_module.StorageTracker.dispatch = timed(dispatch, "ops")
    tracker_module.TrackingFakeMode._run_tracked = timed(run, "fake")
    rows: dict[str, list[tuple[float, ...]]] = {k: [] for k in specs}
    try:
        for i in range(rounds):
            for key, spec in sorted(specs.items(), reverse=i % 2 == 1):
                spent.update(ops=0.0, fake=0.0)
                start = clock()
                trace_step(source, spec)
                step = clock() - start
                rows[key].append((step, spent["ops"], spent["fake"], spent["ops"] - spent["fake"], step - spent["ops"]))
    finally:
        tracker_module.StorageTracker.dispatch, tracker_module.TrackingFakeMode._run_tracked = dispatch, run
    print(f"{MODEL} batch 2 seq 64 --target cuda --optim adamw: median CPU s over {rounds} interleaved rounds\n")
    print("| step | whole step | traced ops | FakeTensorMode's dispatch | memest's per-op work | outside the traced ops |")
    print("|---|---|---|---|---|---|")
    for key, values in rows.items():
        medians = [statistics.median(v[i] for v in values) for i in range(5)]
        print(f"| {key} | " + " | ".join(f"{m:.3f}" for m in medians) + " |")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
