"""How fast is memest? End to end as a user runs it, and against PyTorch's MemTracker on the same step.

1. End to end: ``memest estimate MODEL ... --json`` as a subprocess, one warm-up run (page cache)
   then ``--reps`` timed runs: wall time and the child's peak RSS (os.wait4). Medians are quoted.
2. MemTracker (torch.distributed._tools.mem_tracker) under FakeTensorMode, in-process, on the step
   memest traces: same RunSpec, same model and inputs (memest.trace.step.build), same optimizer
   (make_optimizer), same step (run_iteration) and the same contexts memest enters around it.
   Peaks are compared with memest's, and trace times (build + 2 iterations) with memest's.
   The 70B case is skipped here unless --memtracker-70b (one MemTracker run would take several minutes).
3. A sequence sweep: ``memest whatif hf:gpt2 --seq 256,...,4096 --batch 8 --json`` end to end (wall, RSS)
   and the number of traces it used (its JSON's ``traces``), against 6 direct ``memest estimate`` runs.
4. Start-up: ``memest --help`` (median of --help-reps runs).

Writes benchmarks/speed.md and the raw numbers to benchmarks/speed.json.
Usage: python scripts/bench_speed.py [--out benchmarks/speed.md] [--reps 5] [--big-reps 3] [--trace-reps 3]
                                    [--skip-memtracker] [--memtracker-70b] [--quick] [--only CASE ...]
                                    [--baseline OTHER_CHECKOUT [--baseline-label TEXT]]
  --quick: 2 end-to-end runs (1 for the 70B case), 5 --help runs, no MemTracker, no direct-estimate sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GIB = 2**30

# The issue's goals, on a 2-core machine.
CASES = [
    {
        "name": "gpt2",
        "model": "hf:gpt2",
        "batch": 8,
        "seq": 1024,
        "optim": "adamw",
        "goal_seconds": 6.0,
        "goal_rss_bytes": None,
    },
    {
        "name": "llama-2-7b",
        "model": "hf:llama-2-7b",
        "batch": 1,
        "seq": 4096,
        "optim": "adamw",
        "goal_seconds": 15.0,
        "goal_rss_bytes": int(1.5 * GIB),
    },
    {
        "name": "bert-large",
        "model": "hf:bert-large-uncased",
        "batch": 8,
        "seq": 512,
        "optim": "adamw",
        "goal_seconds": None,
        "goal_rss_bytes": None,
    },
    {
        "name": "llama-2-70b",
        "model": "hf:llama-2-70b",
        "batch": 1,
        "seq": 4096,
        "precision": "bf16-mixed",
        "optim": "adamw",
        "goal_seconds": None,
        "goal_rss_bytes": None,
        "big": True,  # ~20 s a run: --big-reps runs, MemTracker only with --memtracker-70b
    },
]

SWEEP = {"model": "hf:gpt2", "batch": 8, "seqs": [256, 512, 1024, 1536, 2048, 4096], "optim": "adamw"}


NOTES = """\
Notes:
- Where the time goes: the imports (\"imports alone\") are most of the wall time; then the trace, where
  FakeTensorMode's own dispatch (cache-key hashing of every argument, output construction) dominates and
  memest's bookkeeping is a few percent; then ~0.2 s of interpreter exit.
- Parameters stay fake: the 7B model's fp32 parameters alone are 25 GiB, its peak RSS a few hundred MiB.
- memest counts the step's inputs (input_ids, labels); MemTracker only sees tensors created under it or
  passed to track_external, so they are passed there.
- A shared 2-core machine drifts with load (see the load averages above): compare numbers from one run;
  `--baseline` interleaves the before and after runs for that reason."""


# -- end to end ------------------------------------------------------------------------------------
def memest_command() -> list[str]:
    """The ``memest`` console script of this interpreter's environment (what a user runs)."""
    script = Path(sys.executable).with_name("memest")
    if script.exists():
        return [str(script)]
    found = shutil.which("memest")
    return [found] if found else [sys.executable, "-m", "memest"]


def cli_args(case: dict) -> list[str]:
    precision = ["--precision", case["precision"]] if case.get("precision") else []
    return [
        "estimate", case["model"], "--batch", str(case["batch"]), "--seq", str(case["seq"]),
        *precision, "--optim", case["optim"], "--json",
    ]


def run_child(cmd: list[str], source: str | None = None) -> dict:
    """Run ``cmd`` (with memest imported from ``source`` when given); wall seconds, the child's own
    peak RSS (wait4 rusage) and its stdout."""
    env = dict(os.environ, PYTHONPATH=source) if source else None
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr}")
    return {"wall_seconds": wall, "max_rss_bytes": usage.ru_maxrss * 1024, "stdout": stdout}  # Linux: KiB


def end_to_end(case: dict, reps: int, baseline: str | None = None) -> dict:
    """``reps`` timed runs of this checkout (and, interleaved, of a ``baseline`` checkout)."""
    cmd = memest_command() + cli_args(case)
    trees = {"this": str(ROOT)} | ({"baseline": baseline} if baseline else {})
    for source in trees.values():
        run_child(cmd, source)  # warm-up: page cache, not counted
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for i in range(reps):  # alternate the order, so drift on a noisy machine hits both alike
        for name in list(trees) if i % 2 == 0 else list(trees)[::-1]:
            child = run_child(cmd, trees[name])
            doc = json.loads(child.pop("stdout"))
            child.update(peak_allocated_bytes=doc["peak_allocated_bytes"], trace_seconds=doc["trace_seconds"])
            runs[name].append(child)
            print(f"  {case['name']} {name} run {i + 1}: {child['wall_seconds']:.2f} s, "
                  f"{child['max_rss_bytes'] / 2**20:.0f} MiB", file=sys.stderr)
    out = {name: _summary(rows, case) for name, rows in runs.items()}
    result = out["this"] | {"command": "memest " + " ".join(cli_args(case))}
    if baseline:
        result["baseline"] = out["baseline"]
    return result


def _summary(runs: list[dict], case: dict) -> dict:
    if len({r["peak_allocated_bytes"] for r in runs}) != 1:
        raise SystemExit(f"{case['name']}: the peak changed between runs: {[r['peak_allocated_bytes'] for r in runs]}")
    return {
        "runs": runs,
        "median_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "median_max_rss_bytes": statistics.median(r["max_rss_bytes"] for r in runs),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in runs),
        "median_trace_seconds": statistics.median(r["trace_seconds"] for r in runs),
        "peak_allocated_bytes": runs[0]["peak_allocated_bytes"],
    }


def import_floor(case: dict, reps: int) -> float:
    """Median wall time of a process that only imports what memest must import for this model
    (torch, torch._dynamo — FakeTensorMode needs it — and the model's transformers class), with the
    garbage collector handled as memest handles it (paused while importing, then gc.freeze)."""
    arch = json.loads((ROOT / "memest" / "data" / "models" / f"{case['model'][3:]}.json").read_text())["architectures"][0]
    code = f"import gc; gc.disable(); import torch, torch._dynamo, transformers; transformers.{arch}; gc.freeze()"
    return statistics.median(run_child([sys.executable, "-c", code])["wall_seconds"] for _ in range(reps))


# -- MemTracker on the same step -------------------------------------------------------------------
def step_contexts(source, spec) -> list:
    """The contexts memest's trace_step enters around the step besides its own tracking (keep in
    step with memest/trace/step.py): transformers' mask branches, and for --target cuda the CUDA
    SDPA kernels and (mixed precision) the CUDA autocast emulation."""
    contexts = [source.trace_context(spec) if source.trace_context else contextlib.nullcontext()]
    if spec.target == "cuda":
        from memest.targets.cuda.autocast import cuda_autocast_scope
        from memest.targets.cuda.sdpa import CudaSdpa

        contexts.append(CudaSdpa(spec.attention, spec.compute_capability))
        if spec.mixed:
            contexts.append(cuda_autocast_scope())
    return contexts


def memtracker_trace(source, spec) -> tuple[int, float]:
    """Peak bytes MemTracker reports for the step (cpu device, 'Total') and seconds taken."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils._pytree import tree_flatten

    from memest.features.optim import make_optimizer
    from memest.features.registry import build, run_iteration
    from memest.trace.step import LoopState
    from memest.trace.values import PlaceholderScalars

    start = time.perf_counter()
    with FakeTensorMode(allow_non_fake_inputs=False):
        with warnings.catch_warnings(), PlaceholderScalars():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            built = build(source, spec)
            model, inputs = built.model, built.inputs
        optimizer = make_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
        tracker = MemTracker()
        # parameters, buffers and optimizer state, plus the inputs (memest counts them too)
        tracker.track_external(model, optimizer, *[t for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)])
        with contextlib.ExitStack() as stack:
            for context in step_contexts(source, spec):
                stack.enter_context(context)
            stack.enter_context(tracker)
            loop = LoopState()  # what the user's loop keeps between steps (--outputs kept)
            for _ in range(spec.iterations):
                run_iteration(model, inputs, optimizer, source.compute_loss, spec, loop=loop)
                tracker.reset_mod_stats()  # MemTracker keeps per-module stats across iterations otherwise
        peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
        del model, inputs, optimizer
    return peak, time.perf_counter() - start


def memest_trace(source, spec) -> tuple[int, float]:
    from memest.features.registry import trace_step

    start = time.perf_counter()
    peak, _ = trace_step(source, spec).peak()
    return peak, time.perf_counter() - start


def compare_memtracker(case: dict, reps: int) -> dict:
    from memest.sources import load_source
    from memest.spec import RunSpec

    spec = RunSpec(model=case["model"], batch=case["batch"], seq=case["seq"], optim=case["optim"],
                   **({"precision": case["precision"]} if case.get("precision") else {}))
    source = load_source(spec.model)
    first_peak, first_seconds = memest_trace(source, spec)  # warm-up (the first trace in a process is slower)
    memest_runs, tracker_runs = [], []
    for i in range(reps):  # interleaved, so drift on a noisy machine hits both
        memest_runs.append(memest_trace(source, spec))
        tracker_runs.append(memtracker_trace(source, spec))
        print(f"  {case['name']} rep {i + 1}: memest {memest_runs[-1][1]:.2f} s, "
              f"MemTracker {tracker_runs[-1][1]:.2f} s", file=sys.stderr)
    memest_peak, tracker_peak = memest_runs[0][0], tracker_runs[0][0]
    if {p for p, _ in memest_runs} != {memest_peak} or {p for p, _ in tracker_runs} != {tracker_peak}:
        raise SystemExit(f"{case['name']}: a peak changed between runs")
    memest_s = statistics.median(s for _, s in memest_runs)
    tracker_s = statistics.median(s for _, s in tracker_runs)
    return {
        "spec": spec.to_dict(),
        "memest_peak_bytes": memest_peak,
        "memtracker_peak_bytes": tracker_peak,
        "relative_difference": (tracker_peak - memest_peak) / memest_peak,
        "memest_first_trace_seconds": first_seconds,
        "memest_trace_seconds": [s for _, s in memest_runs],
        "memtracker_trace_seconds": [s for _, s in tracker_runs],
        "median_memest_seconds": memest_s,
        "median_memtracker_seconds": tracker_s,
        "speed_ratio": tracker_s / memest_s,
    }


# -- sequence sweep and start-up ------------------------------------------------------------------
def sweep(reps: int, direct_reps: int) -> dict:
    """``memest whatif`` over SWEEP's sequence lengths, end to end (one warm-up, then ``reps`` runs),
    and ``direct_reps`` rounds of the same points as separate ``memest estimate`` runs (summed)."""
    whatif_args = [
        "whatif", SWEEP["model"], "--seq", ",".join(map(str, SWEEP["seqs"])), "--batch", str(SWEEP["batch"]),
        "--optim", SWEEP["optim"], "--json",
    ]
    cmd = memest_command() + whatif_args
    run_child(cmd)  # warm-up
    runs = []
    for i in range(reps):
        child = run_child(cmd)
        doc = json.loads(child.pop("stdout"))
        child.update(traces=doc["traces"], peaks={str(p["seq"]): p["peak_bytes"] for p in doc["points"]},
                     traced_seqs=[p["seq"] for p in doc["points"] if p.get("traced")])
        runs.append(child)
        print(f"  sweep run {i + 1}: {child['wall_seconds']:.2f} s, {child['max_rss_bytes'] / 2**20:.0f} MiB, "
              f"{child['traces']} traces", file=sys.stderr)
    result = {
        "command": "memest " + " ".join(whatif_args),
        "points": len(SWEEP["seqs"]),
        "runs": runs,
        "median_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in runs),
        "traces": sorted({r["traces"] for r in runs}),
    }
    rounds = []
    for i in range(direct_reps):
        points = []
        for seq in SWEEP["seqs"]:
            case = {"model": SWEEP["model"], "batch": SWEEP["batch"], "seq": seq, "optim": SWEEP["optim"]}
            child = run_child(memest_command() + cli_args(case))
            doc = json.loads(child.pop("stdout"))
            points.append(child | {"seq": seq, "peak_allocated_bytes": doc["peak_allocated_bytes"]})
        rounds.append({
            "points": points,
            "total_wall_seconds": sum(p["wall_seconds"] for p in points),
            "max_rss_bytes": max(p["max_rss_bytes"] for p in points),
        })
        print(f"  6 direct estimates, round {i + 1}: {rounds[-1]['total_wall_seconds']:.2f} s in all", file=sys.stderr)
    if rounds:
        result["direct"] = {
            "rounds": rounds,
            "median_total_wall_seconds": statistics.median(r["total_wall_seconds"] for r in rounds),
            "max_rss_bytes": max(r["max_rss_bytes"] for r in rounds),
            # whatif's points against the direct estimates' peaks (whatif interpolates the untraced ones)
            "peaks_match": all(runs[0]["peaks"][str(p["seq"])] == p["peak_allocated_bytes"] for p in rounds[0]["points"]),
        }
    return result


def startup(reps: int) -> dict:
    """``memest --help``: one warm-up run, then the median of ``reps``."""
    cmd = memest_command() + ["--help"]
    run_child(cmd)
    runs = [run_child(cmd) for _ in range(reps)]
    for r in runs:
        r.pop("stdout")
    return {
        "command": "memest --help",
        "runs": runs,
        "median_wall_seconds": statistics.median(r["wall_seconds"] for r in runs),
        "max_rss_bytes": max(r["max_rss_bytes"] for r in runs),
    }


# -- report ----------------------------------------------------------------------------------------
def machine() -> dict:
    import torch

    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name")]
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    total_kib = next((int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:")), 0)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": models[0] if models else platform.processor() or platform.machine(),
        "ram_bytes": total_kib * 1024,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": _version("transformers"),
        "memest_commit": _git("rev-parse", "--short", "HEAD"),
        "memest_tree": "modified" if _git("status", "--porcelain", "--untracked-files=no") else "clean",
        "memest_command": " ".join(memest_command()),
        "load_average_start": os.getloadavg(),
    }


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(meta: dict, results: list[dict], reps: int, trace_reps: int, extra: dict | None = None) -> str:
    extra = extra or {}
    lines = [
        "# memest speed",
        "",
        f"Measured {meta['date']} on {meta['nproc']} cores ({meta['cpu_model']}), "
        f"{meta['ram_bytes'] / GIB:.1f} GiB RAM; {meta['os']}; Python {meta['python']}, torch {meta['torch']} "
        f"({meta['torch_threads']} threads), transformers {meta['transformers']}; memest {meta['memest_commit']} "
        f"(working tree {meta['memest_tree']}). Load average at start: "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_start'])}; at end: "
        f"{', '.join(f'{x:.2f}' for x in meta['load_average_end'])}.",
        "",
        f"Reproduce: `{meta['command']}` (raw numbers: `benchmarks/speed.json`). `--baseline DIR` times another "
        "checkout end to end, interleaved with this one (e.g. `git archive COMMIT | tar -x -C DIR`; its memest "
        "is imported through PYTHONPATH).",
        "",
        "## End to end, as a user runs it",
        "",
        f"`{meta['memest_command']} estimate ... --json` as a subprocess: one warm-up run, then the median of "
        f"{_reps_text(results, reps)}. Peak RSS is the child's own (`os.wait4`). \"imports alone\" is a process that only "
        "imports torch, torch._dynamo and the model's transformers class (GC paused, then frozen, as memest does) "
        "— a floor memest cannot go below; \"trace\" is the run's own `trace_seconds` (trace + analysis).",
        "",
        "| command | wall (median) | min – max | goal | peak RSS (max) | goal | imports alone | trace (in the run) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    baseline = meta.get("baseline")
    if baseline:
        lines[-2] += " baseline (median) | speed-up |"
        lines[-1] = lines[-1] + "---:|---:|"
    for r in results:
        e, case = r["end_to_end"], r["case"]
        walls = [x["wall_seconds"] for x in e["runs"]]
        goal_t = "-"
        if case.get("goal_seconds"):
            goal_t = f"< {case['goal_seconds']:g} s {'✅' if e['median_wall_seconds'] < case['goal_seconds'] else '❌'}"
        goal_m = "-"
        if case["goal_rss_bytes"]:
            ok = e["max_rss_bytes"] < case["goal_rss_bytes"]
            goal_m = f"< {case['goal_rss_bytes'] / GIB:g} GiB {'✅' if ok else '❌'}"
        lines.append(
            f"| `{e['command']}` | **{e['median_wall_seconds']:.2f} s** | {min(walls):.2f} – {max(walls):.2f} s | "
            f"{goal_t} | {e['max_rss_bytes'] / 2**20:.0f} MiB | {goal_m} | {r['import_floor_seconds']:.2f} s | "
            f"{e['median_trace_seconds']:.2f} s |"
            + (
                f" {e['baseline']['median_wall_seconds']:.2f} s | {e['baseline']['median_wall_seconds'] / e['median_wall_seconds']:.2f}× |"
                if baseline else ""
            )
        )
    if baseline:
        lines += [
            "",
            f"Baseline: {baseline}, run interleaved with this checkout (order alternating). Baseline peak RSS "
            + ", ".join(f"{r['case']['name']} {r['end_to_end']['baseline']['max_rss_bytes'] / 2**20:.0f} MiB" for r in results)
            + "; baseline trace (in the run) "
            + ", ".join(f"{r['case']['name']} {r['end_to_end']['baseline']['median_trace_seconds']:.2f} s" for r in results)
            + "; peaks "
            + ", ".join(
                f"{r['case']['name']} " + ("identical" if r['end_to_end']['baseline']['peak_allocated_bytes'] == r['end_to_end']['peak_allocated_bytes'] else "DIFFERENT")
                for r in results
            )
            + ".",
        ]
    lines += _extra_sections(extra)
    if not any("memtracker" in r for r in results):
        return "\n".join([*lines, "", NOTES, *meta.get("notes", []), ""])
    lines += [
        "",
        "## Against PyTorch's MemTracker, same step",
        "",
        "`torch.distributed._tools.mem_tracker.MemTracker` under FakeTensorMode on the step memest traces: the "
        "same RunSpec (default `--target cuda`: foreach AdamW), model and inputs built by "
        "`memest.trace.step.build`, the optimizer from `make_optimizer`, two iterations of `run_iteration` inside "
        "the contexts memest's trace enters (transformers' mask branches; for `--target cuda` the CUDA SDPA "
        "kernels and, in mixed precision, the CUDA autocast emulation), `reset_mod_stats()` between iterations; `track_external(model, optimizer, *inputs)`. "
        "MemTracker's peak is `get_tracker_snapshot(\"peak\")[cpu][\"Total\"]`; memest's is "
        "`peak_allocated_bytes`. Times are in-process, build + 2 iterations, median of "
        f"{trace_reps} interleaved runs after one warm-up memest trace.",
        "",
        "| model | memest peak | MemTracker peak | difference | memest trace | MemTracker trace | MemTracker / memest |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        m = r.get("memtracker")
        if m is None:
            lines.append(f"| {_label(r['case'])} | {r['end_to_end']['peak_allocated_bytes']:,} B | not run | | "
                         f"{r['end_to_end']['median_trace_seconds']:.2f} s (in the end-to-end run) | | |")
            continue
        lines.append(
            f"| {_label(r['case'])} | "
            f"{m['memest_peak_bytes']:,} B | {m['memtracker_peak_bytes']:,} B | {100 * m['relative_difference']:+.3f}% | "
            f"{m['median_memest_seconds']:.2f} s | {m['median_memtracker_seconds']:.2f} s | "
            f"**{m['speed_ratio']:.1f}×** |"
        )
    lines.append("")
    for r in results:
        m = r.get("memtracker")
        if m is None:
            lines.append(f"- {r['case']['name']}: MemTracker not run ({r.get('memtracker_skipped', 'skipped')}).")
            continue
        verdict = (
            "agree to the byte" if m["memtracker_peak_bytes"] == m["memest_peak_bytes"]
            else f"agree within 1% ({100 * m['relative_difference']:+.4f}%)" if abs(m["relative_difference"]) <= 0.01
            else f"DIFFER by {100 * m['relative_difference']:+.2f}% (more than 1%: investigate)"
        )
        lines.append(
            f"- {r['case']['name']}: the peaks {verdict}; MemTracker took {m['speed_ratio']:.1f}× memest's time "
            f"(memest's first trace in the process, cold: {m['memest_first_trace_seconds']:.2f} s"
            + (f"; {len(m['memtracker_trace_seconds'])} timed run of each, not {trace_reps}"
               if len(m["memtracker_trace_seconds"]) != trace_reps else "") + ")."
        )
    lines += ["", NOTES, *meta.get("notes", []), ""]
    return "\n".join(lines)


def _label(case: dict) -> str:
    precision = f" {case['precision']}" if case.get("precision") else ""
    return f"{case['name']} bs{case['batch']} seq{case['seq']}{precision} {case['optim']}"


def _reps_text(results: list[dict], reps: int) -> str:
    counts = {r["case"]["name"]: len(r["end_to_end"]["runs"]) for r in results}
    if len(set(counts.values())) <= 1:
        return f"{next(iter(counts.values()), reps)} runs"
    return "; ".join(f"{n}: {c} runs" for n, c in counts.items()) + " (the 70B case has fewer: ~20 s a run)"


def _extra_sections(extra: dict) -> list[str]:
    lines = []
    s = extra.get("sweep")
    if s:
        lines += [
            "",
            "## Sequence sweep",
            "",
            f"`{s['command']}` end to end as a subprocess: one warm-up run, then the median of {len(s['runs'])} runs. "
            f"\"traces\" is the JSON's `traces` (how many of the {s['points']} points were traced; the rest are fitted "
            "and one is traced again to verify the fit).",
            "",
            "| command | points | traces | wall (median) | min – max | peak RSS (max) |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        walls = [r["wall_seconds"] for r in s["runs"]]
        lines.append(
            f"| `{s['command']}` | {s['points']} | {', '.join(map(str, s['traces']))} | "
            f"**{s['median_wall_seconds']:.2f} s** | {min(walls):.2f} – {max(walls):.2f} s | {s['max_rss_bytes'] / 2**20:.0f} MiB |"
        )
        d = s.get("direct")
        if d:
            lines.append(
                f"| the same {s['points']} points as separate `memest estimate ... --json` runs (sum) | {s['points']} | "
                f"{s['points']} | **{d['median_total_wall_seconds']:.2f} s** | "
                f"{len(d['rounds'])} round(s) | {d['max_rss_bytes'] / 2**20:.0f} MiB |"
            )
            lines += ["", f"whatif's peaks vs the direct estimates: {'identical at every point' if d['peaks_match'] else 'DIFFERENT'}; "
                      f"the sweep took {d['median_total_wall_seconds'] / s['median_wall_seconds']:.1f}× less wall time."]
        else:
            lines += ["", f"(Direct estimates not timed in this run; {s['points']} of them would be {s['points']} traces and "
                      f"{s['points']} process start-ups.)"]
    st = extra.get("startup")
    if st:
        walls = [r["wall_seconds"] for r in st["runs"]]
        lines += [
            "",
            "## Start-up",
            "",
            f"`{st['command']}` as a subprocess: one warm-up run, then the median of {len(st['runs'])}: "
            f"**{st['median_wall_seconds'] * 1000:.0f} ms** ({min(walls) * 1000:.0f} – {max(walls) * 1000:.0f} ms), "
            f"peak RSS {st['max_rss_bytes'] / 2**20:.0f} MiB.",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "speed.md"))
    parser.add_argument("--reps", type=int, default=None, help="timed end-to-end runs per case (default 5; --quick 2)")
    parser.add_argument("--big-reps", type=int, default=None,
                        help="timed end-to-end runs for the 70B case, ~20 s each (default 3; --quick 1)")
    parser.add_argument("--sweep-reps", type=int, default=None, help="timed whatif sweep runs (default 3; --quick 1)")
    parser.add_argument("--sweep-direct-reps", type=int, default=None,
                        help="rounds of 6 direct estimates to compare the sweep with (default 1; --quick 0)")
    parser.add_argument("--help-reps", type=int, default=None, help="timed `memest --help` runs (default 10; --quick 5)")
    parser.add_argument("--quick", action="store_true",
                        help="a quick run: fewer reps (2, 70B 1, sweep 1, --help 5), no direct sweep, no MemTracker")
    parser.add_argument("--skip-sweep", action="store_true", help="no whatif sweep")
    parser.add_argument("--skip-startup", action="store_true", help="no `memest --help` timing")
    parser.add_argument("--memtracker-70b", action="store_true",
                        help="run MemTracker on the 70B step too (several minutes a run; skipped by default)")
    parser.add_argument("--trace-reps", type=int, default=3, help="in-process trace runs per case and tool")
    parser.add_argument("--only", choices=[c["name"] for c in CASES], action="append", help="run only these cases")
    parser.add_argument("--skip-memtracker", action="store_true", help="end to end only (MemTracker takes minutes)")
    parser.add_argument("--baseline", help="another memest checkout to time end to end, interleaved (before/after)")
    parser.add_argument("--baseline-label", help="how the report names the baseline (default: its path)")
    parser.add_argument("--notes", type=Path, help="Markdown appended to the report (findings, explanations)")
    parser.add_argument("--render", type=Path, help="only rewrite --out from this speed.json (no measuring)")
    args = parser.parse_args()
    if args.render:
        doc = json.loads(args.render.read_text())
        results = doc["results"]
        reps = len(results[0]["end_to_end"]["runs"])
        tracked = [r for r in results if "memtracker" in r]
        trace_reps = len(tracked[0]["memtracker"]["memest_trace_seconds"]) if tracked else 0
        Path(args.out).write_text(markdown(doc["meta"], results, reps, trace_reps, doc))
        return
    quick = args.quick
    reps = args.reps if args.reps is not None else (2 if quick else 5)
    big_reps = args.big_reps if args.big_reps is not None else (1 if quick else 3)
    sweep_reps = args.sweep_reps if args.sweep_reps is not None else (1 if quick else 3)
    direct_reps = args.sweep_direct_reps if args.sweep_direct_reps is not None else (0 if quick else 1)
    help_reps = args.help_reps if args.help_reps is not None else (5 if quick else 10)
    skip_memtracker = args.skip_memtracker or quick
    cases = [c for c in CASES if not args.only or c["name"] in args.only]

    meta = machine()
    meta["command"] = shlex.join(["python", "scripts/bench_speed.py", *sys.argv[1:]])
    if args.baseline:
        meta["baseline"] = args.baseline_label or args.baseline
    results = []
    for case in cases:  # end to end first, while this process has not yet imported torch's models
        print(f"{case['name']}: end to end", file=sys.stderr)
        n = big_reps if case.get("big") else reps
        results.append({"case": case, "end_to_end": end_to_end(case, n, args.baseline),
                        "import_floor_seconds": import_floor(case, min(n, reps))})
    extra = {}
    if not args.skip_startup:
        print("memest --help: start-up", file=sys.stderr)
        extra["startup"] = startup(help_reps)
    if not args.skip_sweep:
        print("whatif sequence sweep", file=sys.stderr)
        extra["sweep"] = sweep(sweep_reps, direct_reps)
    for result in [] if skip_memtracker else results:
        if result["case"].get("big") and not args.memtracker_70b:
            result["memtracker_skipped"] = (
                "one MemTracker run on this step would take several minutes on this machine; "
                "pass --memtracker-70b to run it")
            continue
        print(f"{result['case']['name']}: MemTracker comparison", file=sys.stderr)
        # the 70B step: one timed run (several minutes each)
        result["memtracker"] = compare_memtracker(result["case"], 1 if result["case"].get("big") else args.trace_reps)
    meta["load_average_end"] = os.getloadavg()
    if args.notes:
        meta["notes"] = [args.notes.read_text().rstrip()]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if skip_memtracker:
        meta.setdefault("notes", []).append("MemTracker was not run (--quick or --skip-memtracker).")
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": results, **extra}, indent=2) + "\n")
    out.write_text(markdown(meta, results, reps, args.trace_reps, extra))
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
