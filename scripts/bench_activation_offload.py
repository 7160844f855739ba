"""Trace time of a step with and without --activation-offload (median of 5, runs interleaved), as Markdown rows for
benchmarks/activation-offload.md. Usage: python scripts/bench_activation_offload.py"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402

CASES = [("examples/transformer.py", 8, 128), ("hf:gpt2", 4, 512)]
MODES = ["none", "save-on-cpu", "save-on-cpu-pinned"]
RUNS = 5


def main() -> None:
    print("| model | batch x seq | target | mode | median trace s (5) | vs none | device peak | host copies peak |")
    print("|---|---|---|---|---|---|---|---|")
    for model, batch, seq in CASES:
        source = load_source(model)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        peaks: dict[str, tuple[int, int]] = {}
        for _ in range(RUNS):
            for mode in MODES:
                spec = RunSpec(model=model, batch=batch, seq=seq, target="cuda", activation_offload=mode)
                start = time.perf_counter()
                trace = trace_step(source, spec)
                times[mode].append(time.perf_counter() - start)
                peaks[mode] = (trace.peak()[0], trace.host_peak(saved=True))
        base = statistics.median(times["none"])
        for mode in MODES:
            med = statistics.median(times[mode])
            print(f"| {model} | {batch} x {seq} | cuda | {mode} | {med:.2f} | {100 * (med - base) / base:+.1f}% | "
                  f"{peaks[mode][0]:,} | {peaks[mode][1]:,} |")


if __name__ == "__main__":
    main()
