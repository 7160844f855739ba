"""How long ``--compile`` takes end to end, as docs/usage.md's example runs it.

    python scripts/bench_compile_time.py [--reps 3] [--out benchmarks/compile-time.md]

Each command runs as a subprocess (the ``memest`` console script, this checkout through PYTHONPATH): one
warm-up run (page cache, not counted), then ``--reps`` timed runs; wall time is the median, with min and max,
and ``trace_seconds`` from the run's own JSON. The load average at the start and the end is written next to
the numbers: on a shared machine the wall time follows the load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speed import ROOT, machine, memest_command  # noqa: E402


def run_child(cmd: list[str], source: str) -> dict:
    """``cmd`` with memest imported from ``source``: wall seconds, the child's CPU seconds (user + system,
    os.wait4: less sensitive to other jobs on the machine than the wall time) and its stdout."""
    env = dict(os.environ, PYTHONPATH=source)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{err.read().decode()}")
        return {"wall_seconds": wall, "cpu_seconds": usage.ru_utime + usage.ru_stime, "stdout": out.read().decode()}

CASES = [
    ("nanoGPT-style model, eager file, `--compile`",
     ["estimate", "tests/models/nanogpt.py", "--compile", "--target", "cpu", "--json"]),
    ("the same model, eager (no `--compile`), for comparison",
     ["estimate", "tests/models/nanogpt.py", "--target", "cpu", "--json"]),
]


def time_case(args: list[str], reps: int) -> dict:
    cmd = memest_command() + args
    run_child(cmd, str(ROOT))  # warm-up
    runs = []
    for i in range(reps):
        child = run_child(cmd, str(ROOT))
        doc = json.loads(child.pop("stdout"))
        runs.append({"wall_seconds": child["wall_seconds"], "cpu_seconds": child["cpu_seconds"],
                     "trace_seconds": doc["trace_seconds"], "load_average_1min": os.getloadavg()[0]})
        print(f"  {' '.join(args)} run {i + 1}: {child['wall_seconds']:.2f} s", file=sys.stderr)
    walls = [r["wall_seconds"] for r in runs]
    return {"command": "memest " + " ".join(args), "runs": runs, "wall_median": statistics.median(walls),
            "wall_min": min(walls), "wall_max": max(walls),
            "trace_median": statistics.median(r["trace_seconds"] for r in runs),
            "cpu_median": statistics.median(r["cpu_seconds"] for r in runs)}


def markdown(meta: dict, results: list[dict], reps: int) -> str:
    lines = [
        "# `--compile`: end-to-end time", "",
        f"Measured {meta['date']} on {meta['nproc']} cores ({meta['cpu_model']}); Python {meta['python']}, "
        f"torch {meta['torch']} ({meta['torch_threads']} threads), transformers {meta['transformers']}; "
        f"memest {meta['memest_commit']}. Load average at start: "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_start'])}; at end: "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_end'])} (a shared machine: other jobs ran).", "",
        "Reproduce: `python scripts/bench_compile_time.py --out benchmarks/compile-time.md` (raw numbers: "
        "`benchmarks/compile-time.json`). Each command as a subprocess, one warm-up run, then the median of "
        f"{reps}; \"trace\" is the run's own `trace_seconds`; \"CPU\" the process's user + system seconds "
        "(os.wait4), which other jobs on the machine move less than the wall time.", "",
        "| what | command | wall (median) | min – max | CPU (median) | trace (median) | 1-min load during the runs |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (label, _), r in zip(CASES, results, strict=True):
        loads = [x["load_average_1min"] for x in r["runs"]]
        lines.append(f"| {label} | `{r['command']}` | **{r['wall_median']:.1f} s** | {r['wall_min']:.1f} – "
                     f"{r['wall_max']:.1f} s | {r['cpu_median']:.1f} s | {r['trace_median']:.1f} s | "
                     f"{min(loads):.2f} – {max(loads):.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "compile-time.md")
    args = parser.parse_args()
    meta = machine()
    results = [time_case(case_args, args.reps) for _, case_args in CASES]
    meta["load_average_end"] = os.getloadavg()
    args.out.write_text(markdown(meta, results, args.reps))
    args.out.with_suffix(".json").write_text(json.dumps({"machine": meta, "results": results}, indent=1) + "\n")
    print(args.out.read_text())


if __name__ == "__main__":
    main()
