"""Trace time of a step with and without --optim-in-backward (median of N runs each, interleaved), and the
traced peaks. Writes benchmarks/optim-in-backward.md with --out.

    PYTHONPATH=$PWD python scripts/bench_optim_in_backward.py --runs 5 --out benchmarks/optim-in-backward.md
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402

CASES = [  # (model, batch, seq, optim, target)
    ("examples/transformer.py", 2, 64, "adamw", "cpu"),
    ("hf:tests/configs/llama-tiny.json", 1, 8, "adamw", "cpu"),
    ("hf:tests/configs/gpt2-tiny.json", 1, 8, "sgd", "cpu"),
    ("hf:gpt2", 4, 512, "adamw", "cuda"),
]


def _model(ref: str) -> str:
    if ref.startswith("hf:") and "/" in ref:
        return "hf:" + str(ROOT / ref[3:])
    return str(ROOT / ref) if ref.endswith(".py") else ref


def _time(spec: RunSpec) -> tuple[float, int]:
    source = load_source(spec.model)
    start = time.perf_counter()
    peak = trace_step(source, spec).peak()[0]
    return time.perf_counter() - start, peak


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for ref, batch, seq, optim, target in CASES:
        specs = {on: RunSpec(model=_model(ref), batch=batch, seq=seq, optim=optim, target=target, optim_in_backward=on)
                 for on in (False, True)}
        _time(specs[False])  # warm: imports, the model class
        times: dict[bool, list[float]] = {False: [], True: []}
        peaks: dict[bool, int] = {}
        for _ in range(args.runs):
            for on in (False, True):
                seconds, peaks[on] = _time(specs[on])
                times[on].append(seconds)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        rows.append((f"`{ref}` --batch {batch} --seq {seq} --optim {optim} --target {target}", off, on,
                     peaks[False], peaks[True]))
        print(rows[-1][:5], flush=True)
    lines = [
        "# --optim-in-backward: trace time and traced peak",
        "",
        f"`PYTHONPATH=$PWD python scripts/bench_optim_in_backward.py --runs {args.runs} --out "
        "benchmarks/optim-in-backward.md` on this project's 2-CPU machine (Python "
        f"{platform.python_version()}, torch {__import__('torch').__version__} CPU), shared with other jobs. Trace "
        f"time of `trace_step` alone (the model source loaded before), median of {args.runs} runs each, with and "
        "without interleaved. Peaks are traced (`--target cpu` ones are checked against real runs in "
        "tests/test_optim_in_backward.py; the `--target cuda` row is a trace, not a GPU measurement).",
        "",
        "| step | trace s, without | trace s, with | with / without | traced peak without | traced peak with | saved |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, off, on, p_off, p_on in rows:
        lines.append(f"| {name} | {off:.2f} | {on:.2f} | {on / off:.2f} | {p_off:,} | {p_on:,} | "
                     f"{100 * (p_off - p_on) / p_off:.1f}% |")
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
