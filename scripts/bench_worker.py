"""What running user code in a worker process costs (benchmarks/worker.md).

Wall time, median of N runs, of the same commands on this tree ("after") and on a git revision without the
worker ("before", extracted with `git archive` to a temporary folder), runs interleaved so both see the same
machine load; then the start-up cost of one worker under multiprocessing's "fork" and "forkserver" methods
alone (a worker that returns at once), in a process that has imported memest's CLI as `memest check` has.

    python scripts/bench_worker.py [--before main] [--runs 5] [--only "estimate examples/mlp.py" ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = {
    "check configs/*.yaml": ["check", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml"))],
    "estimate examples/mlp.py": ["estimate", "examples/mlp.py"],
    "estimate examples/mlp.py --json": ["estimate", "examples/mlp.py", "--json"],
    "estimate hf:tests/configs/gpt2-tiny.json --seq 32": ["estimate", "hf:tests/configs/gpt2-tiny.json", "--seq", "32"],
    "whatif examples/mlp.py --batch 1,2 --target cpu": ["whatif", "examples/mlp.py", "--batch", "1,2", "--target",
                                                        "cpu"],
}


def wall(tree: Path, argv: list[str]) -> tuple[float, int]:
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "200"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memest", *argv], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, proc.returncode


def _returns(at):
    return 1


def start_cost(method: str, runs: int) -> list[float]:
    sys.path.insert(0, str(ROOT))
    import memest.cli  # noqa: F401  (what the parent has imported when `memest check` forks)
    from memest.worker import in_worker

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        in_worker(_returns, 60, method=method)
        times.append(time.perf_counter() - start)
    return times


def _estimate_text(argv: list[str]) -> tuple[str, int]:
    """`memest estimate`'s work and its rendering, as exits.run_command runs it (in-process or in the child)."""
    from memest.app import run_estimate
    from memest.report.emit import render
    from memest.report.views import estimate_view
    from memest.spec.choices import OutputFormat

    result = run_estimate({"model": argv[1]}, timeline=True)
    return render(estimate_view(result), OutputFormat.TABLE), 0


def warm_cost(runs: int, argv: list[str]) -> tuple[list[float], list[float]]:
    """The same estimate in this process and in a worker forked from it, alternately, after one warm-up run:
    what the worker adds (fork, the child's copy-on-write pages, the text sent back) without interpreter start-up
    and first imports, which both paths pay once per command."""
    sys.path.insert(0, str(ROOT))
    from memest.worker import in_worker

    _estimate_text(argv)
    here, there = [], []
    for _ in range(runs):
        start = time.perf_counter()
        _estimate_text(argv)
        here.append(time.perf_counter() - start)
        start = time.perf_counter()
        in_worker(lambda at: _estimate_text(argv), 600)
        there.append(time.perf_counter() - start)
    return here, there


def fork_after_openmp(wait: float = 60) -> None:
    """Why the CLI forks before any torch operation: after this process ran an OpenMP parallel region (a real
    1500x1500 matmul), a forked child's own parallel region hangs (GNU OpenMP's pool does not survive fork), unless
    the child runs one thread; an estimate on fake tensors in such a child completes."""
    sys.path.insert(0, str(ROOT))
    import torch

    from memest.worker import WorkerError, in_worker

    a = torch.randn(1500, 1500)
    (a @ a).sum()

    def matmul(at, threads=None):
        if threads:
            torch.set_num_threads(threads)
        return float((a @ a).sum())

    for name, work in (("a matmul in the child", matmul),
                       ("a matmul in the child, torch.set_num_threads(1) first", lambda at: matmul(at, 1)),
                       ("`memest estimate examples/mlp.py`'s work and rendering in the child", lambda at: _estimate_text(
                           ["estimate", "examples/mlp.py"]) and "done")):
        start = time.perf_counter()
        try:
            in_worker(work, wait)
            how = "completed"
        except WorkerError:
            how = f"still running after {wait:g} s: stopped"
        print(f"| {name} | {how} | {time.perf_counter() - start:.1f} s |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="main", help="git revision without the worker")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--only", choices=sorted(COMMANDS), action="append",
                        help="a command to time (repeatable; default: every one)")
    parser.add_argument("--openmp", action="store_true", help="only: fork after an OpenMP parallel region")
    args = parser.parse_args()
    if args.openmp:
        print("| after this process ran an OpenMP parallel region | the worker | wall |\n|---|---|---:|")
        fork_after_openmp()
        return
    rev = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.strip()
    after = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "memest"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; before: {args.before} ({rev}), "
          f"after: this tree ({after}{', modified' if dirty else ''}); median of {args.runs} runs, interleaved")
    with tempfile.TemporaryDirectory(prefix="memest-before-") as tmp:
        archive = subprocess.run(["git", "archive", args.before, "memest"], cwd=ROOT, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        print("| command | before (s), median [min-max] | after (s), median [min-max] | after - before (medians) | exit codes |")
        print("|---|---:|---:|---:|---|")
        for name, argv in COMMANDS.items():
            if args.only and name not in args.only:
                continue
            times = {"before": [], "after": []}
            codes = set()
            for _ in range(args.runs):
                for which, tree in (("before", Path(tmp)), ("after", ROOT)):
                    t, code = wall(tree, argv)
                    times[which].append(t)
                    codes.add((which, code))
            b, a = statistics.median(times["before"]), statistics.median(times["after"])
            spread = {w: f"[{min(t):.2f}-{max(t):.2f}]" for w, t in times.items()}
            print(f"| `memest {name}` | {b:.2f} {spread['before']} | {a:.2f} {spread['after']} | {a - b:+.2f} "
                  f"({(a - b) / b:+.1%}) | "
                  f"{', '.join(f'{w} {c}' for w, c in sorted(codes))} |")
    print()
    print("| start method | first worker in the process (ms): what one `memest` run pays | later workers, median (ms) |")
    print("|---|---:|---:|")
    for method in ("fork", "forkserver"):
        times = start_cost(method, args.runs + 1)
        print(f"| {method} | {times[0] * 1e3:.1f} | {statistics.median(times[1:]) * 1e3:.1f} |")
    print()
    print("| warm, one process: `memest estimate examples/mlp.py`'s work and rendering | in-process (ms), median "
          "[min-max] | in a forked worker (ms), median [min-max] | worker - in-process (medians) |")
    print("|---|---:|---:|---:|")
    here, there = warm_cost(args.runs, ["estimate", "examples/mlp.py"])
    h, t = statistics.median(here), statistics.median(there)
    print(f"| {args.runs} runs each, alternating | {h * 1e3:.1f} [{min(here) * 1e3:.1f}-{max(here) * 1e3:.1f}] | "
          f"{t * 1e3:.1f} [{min(there) * 1e3:.1f}-{max(there) * 1e3:.1f}] | {(t - h) * 1e3:+.1f} |")


if __name__ == "__main__":
    main()
