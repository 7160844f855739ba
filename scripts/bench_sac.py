"""Trace time of a step with selective activation checkpointing against the same step without it (and with every
block checkpointed): median of --runs traces each, the three interleaved round by round, after one warm-up trace of
each. Prints a Markdown table for benchmarks/sac.md.

    PYTHONPATH=$PWD python scripts/bench_sac.py --runs 5 [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from _machine import cpu_model  # noqa: E402

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402

CASES = [  # (model, batch, seq, extra RunSpec fields)
    ("examples/transformer.py", 4, 128, {"target": "cpu", "optim": "adamw"}),
    ("examples/transformer.py", 4, 128, {"precision": "bf16-mixed", "optim": "adamw"}),  # --target cuda
    ("hf:tests/configs/llama-tiny.json", 4, 128, {"precision": "bf16-mixed", "optim": "adamw"}),
    ("hf:tests/configs/gpt2-tiny.json", 4, 128, {"target": "cpu", "optim": "adamw"}),
    # full-size configs (12 and 16 blocks): the blocks' share of the step as users trace it
    ("hf:gpt2", 2, 256, {"target": "cpu", "optim": "adamw"}),
    ("hf:llama-3.2-1b", 1, 256, {"precision": "bf16-mixed", "optim": "adamw"}),
    # a vision-language model: its blocks run under memest's KnownValues mode (image_grid_thw's real values)
    ("hf:tests/configs/qwen2-vl-tiny.json", 2, 64, {"images": 2, "image_size": "140x250", "precision": "bf16-mixed",
                                                    "optim": "adamw"}),
    ("hf:benchmarks/configs/qwen2-vl-2b-shapes.json", 1, 128, {"images": 1, "image_size": "448x448",
                                                               "precision": "bf16-mixed", "optim": "adamw"}),
]
POLICIES = ("none", "selective", "blocks")


def _trace_seconds(ref: str, batch: int, seq: int, extra: dict, checkpointing: str) -> float:
    spec = RunSpec(model=ref, batch=batch, seq=seq, checkpointing=checkpointing, **extra)
    source = load_source(ref)
    start = time.perf_counter()
    trace_step(source, spec)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", default=None, help="the cases whose model reference contains this")
    args = parser.parse_args()
    print(f"{cpu_model()}, {os.cpu_count()} CPUs, load average before: {os.getloadavg()[0]:.1f}\n")
    print("| model | batch, seq | run | " + " | ".join(f"{p} median (min-max) s" for p in POLICIES)
          + " | selective vs none |")
    print("|---|---|---|" + "---:|" * (len(POLICIES) + 1))
    for ref, batch, seq, extra in CASES:
        if args.only and args.only not in ref:
            continue
        times: dict[str, list[float]] = {p: [] for p in POLICIES}
        for p in POLICIES:
            _trace_seconds(ref, batch, seq, extra, p)  # warm-up: imports, the first trace's one-time costs
        for _ in range(args.runs):
            for p in POLICIES:
                times[p].append(_trace_seconds(ref, batch, seq, extra, p))
        med = {p: statistics.median(ts) for p, ts in times.items()}
        cells = [f"{med[p]:.2f} ({min(times[p]):.2f}-{max(times[p]):.2f})" for p in POLICIES]
        run = ", ".join(f"{k} {v}" for k, v in extra.items()) + ("" if "target" in extra else ", target cuda")
        pct = 100 * (med["selective"] / med["none"] - 1)
        print(f"| {ref} | {batch}, {seq} | {run} | " + " | ".join(cells) + f" | {pct:+.1f}% |", flush=True)
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
