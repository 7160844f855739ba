"""The model zoo (issue 10's goal): public model code nobody on this project wrote, each case traced by memest's
Python API (``memest.estimate(factory, inputs=..., loss=..., target="cpu")``) and run for real on this CPU in the
identical loop (validate/cpu_truth.py: torch.profiler memory events), in both loops (``outputs="kept"``, the
default, and ``"freed"``). Cases: scripts/zoo_cases.py. Writes benchmarks/zoo.md (+ .json): traced or the
one-line error, estimated and measured peaks, error, trace seconds, and what failed and why.

Each case runs in its own process (a crash or a hang costs that case only). Packages are installed at
benchmark time, not memest dependencies; a case whose package is missing is reported as skipped. Set-up and
rerun: see benchmarks/zoo.md. Usage:
    python scripts/bench_zoo.py [--repos DIR] [--only NAME[,NAME] [--fresh]] [--quick] [--render] [--list]
--quick: the kept loop only. --repos: a folder holding nanoGPT/ and minGPT/ checkouts (read at run time).
--only: those cases, their rows updated in the existing .json (--fresh: only them). --render: the .md again
from the .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve().parent
MARK = "ZOO-RESULT "
GOAL_TRACED, GOAL_MEDIAN, GOAL_MAX = 97.0, 0.1, 2.0  # issue 10's goals: % traced, median and max |error| %
NOTED = 0.01  # |error| % above which a run's cause is stated in "what failed and why"

# What each miss comes from, found by comparing the trace's live storages at the peak with the real run's
# (torch.profiler allocation events, op by op). A case that misses without an entry here says so.
CAUSES = {
    "pyg-gcn": "traced with --data-dependent upper-bound: GCNConv's self-loop insertion (gcn_norm -> "
    "add_remaining_self_loops: `edge_index[:, mask]`, boolean-mask indexing) at its bound, every edge kept; where "
    "the graph holds self loops the real step keeps fewer edges and the estimate is above it by design.",
    "pyg-gat": "the same in GATConv (remove_self_loops then add_self_loops, `edge_index[:, mask]`).",
    "hf-whisper": "the freed loop peaks inside the CPU flash-attention backward "
    "(aten._scaled_dot_product_flash_attention_for_cpu_backward, cross-attention), whose per-thread buffers "
    "(24,576 + 96 B here; aten/src/ATen/native/cpu/FlashAttentionKernel.cpp) memest does not model on "
    "--target cpu; the kept loop peaks elsewhere and is exact.",
    "diffusers-unet2d": "the real peak is in a convolution_backward (the estimate is 42,288 B low there); the live "
    "storages at the two peaks differ by oneDNN-sized buffers of several convolutions, so the miss is in the "
    "--target cpu convolution scratch rules (targets/cpu/onednn_conv.py, whose known gap is brgemm scratchpads, "
    "README limitations); not isolated to one kernel call yet.",
}

# What the zoo found in memest and memest now does (first full run, 2026-11-24, same cases and versions)
FIXED = [
    "hf-bart +0.454% (both loops): the tracing instrumentation held gradients the real run frees. torch's ModTracker waits for a module's "
    "input gradients with register_multi_grad_hook(mode=\"all\"), whose buffer kept the first until the last "
    "arrived (a decoder layer's hidden-state gradient until the encoder output's); memest's hooks now count "
    "without keeping them (trace/modules.py; tests/test_trace_stages.py).",
    "hf-swin +1.207% (both loops): ATen's CPU layer-norm backward makes dX contiguous whatever dY's strides, the meta "
    "kernel copied dY's, and a transposed gradient (Swin's pooler) then cost a reshape copy in the next Linear's "
    "backward that the real run does not make; memest now follows layer_norm_backward_cpu (targets/cpu/aten_norms.py, "
    "with its contiguous copies and per-thread reduction buffer; tests/test_cpu_scratch.py).",
    "diffusers-vae +0.203% (both loops) reads exact after these two changes and the main branch's dropped-output "
    "fix merged meanwhile; which of them it took was not isolated.",
]


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _worker(name: str, loops: list[str], repos: Path | None) -> dict:
    """Run one case in this process: for each loop, memest's estimate and the real CPU peak."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(HERE))
    from zoo_cases import CASES

    case = next(c for c in CASES if c.name == name)
    result = {"name": name, "family": case.family, "source": case.source, "batch": case.batch, "seq": case.seq,
              "optim": case.optim, "precision": case.precision, "note": case.note, "runs": []}
    try:
        factory, inputs, loss = case.build(repos)
    except ImportError as exc:
        result["skipped"] = _one_line(exc)
        return result
    import torch

    import memest
    from memest.sources.callables import callable_source
    from memest.spec import RunSpec
    from memest.validate.cpu_truth import measure_cpu_peak

    for loop in loops:
        run = {"loop": loop}
        fields = dict(batch=case.batch, seq=case.seq, optim=case.optim, precision=case.precision, target="cpu",
                      outputs=loop, **case.options)
        start = time.perf_counter()
        try:
            est = memest.estimate(factory, inputs=inputs, loss=loss, **fields)
            run["estimated_bytes"] = est.peak_allocated_bytes
            run["params"] = est.report.param_count if hasattr(est.report, "param_count") else None
        except Exception as exc:  # the case's result, not the benchmark's failure
            run["trace_error"] = _one_line(exc)
            run["trace_traceback"] = traceback.format_exc(limit=-6)
        run["trace_seconds"] = time.perf_counter() - start
        source = callable_source(factory, inputs, loss)
        start = time.perf_counter()
        try:
            with torch.random.fork_rng():
                real = measure_cpu_peak(source, RunSpec(model=source.origin, **fields))
            run["measured_bytes"] = real["peak_bytes"]
            run["op_at_peak"] = real["op_at_peak"]
        except Exception as exc:
            run["real_error"] = _one_line(exc)
        run["real_seconds"] = time.perf_counter() - start
        if "estimated_bytes" in run and "measured_bytes" in run:
            run["error_pct"] = 100 * (run["estimated_bytes"] - run["measured_bytes"]) / run["measured_bytes"]
        result["runs"].append(run)
    return result


def _run_case(name: str, loops: list[str], repos: Path | None, timeout: int) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--loops", ",".join(loops)]
    if repos is not None:
        cmd += ["--repos", str(repos)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"name": name, "crash": f"timed out after {timeout} s", "runs": []}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARK):
            result = json.loads(line[len(MARK):])
            result["seconds"] = time.perf_counter() - start
            return result
    tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"name": name, "crash": f"worker exited {proc.returncode}: {tail}"[:300], "runs": []}


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    from zoo_cases import PACKAGES

    out = {}
    for name in ["torch", *PACKAGES]:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def _repo_commit(repos: Path | None, name: str) -> str:
    if repos is None:
        return "absent"
    stamp = repos / name / "COMMIT"
    return stamp.read_text().strip() if stamp.is_file() else ("present" if (repos / name).is_dir() else "absent")


def _fmt(n) -> str:
    return f"{n:,}" if isinstance(n, int) else "-"


def _failures(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        if "crash" in r:
            lines.append(f"- **{r['name']}**: the case's process crashed: {r['crash']}")
        for run in r.get("runs", []):
            if "trace_error" in run:
                real = ("the real run also fails: " + run["real_error"]) if "real_error" in run else \
                    "the real run succeeds"
                lines.append(f"- **{r['name']}** ({run['loop']}): memest: `{run['trace_error']}`; {real}.")
            elif "real_error" in run:
                lines.append(f"- **{r['name']}** ({run['loop']}): traced; the real run fails: `{run['real_error']}`.")
            elif abs(run.get("error_pct", 0.0)) > NOTED:
                lines.append(f"- **{r['name']}** ({run['loop']}): {run['error_pct']:+.3f}% "
                             f"({run['estimated_bytes'] - run['measured_bytes']:+,} B; real peak in "
                             f"{run.get('op_at_peak')}).")
        if lines and lines[-1].startswith(f"- **{r['name']}**"):
            lines.append("  Why: " + CAUSES.get(r["name"], "not analysed yet."))
    return lines or [f"Nothing: every attempted case traced and read within {NOTED}%."]


def _write(results: list[dict], meta: dict, out: Path) -> dict:
    runs = [(r, run) for r in results for run in r["runs"]]
    attempted = [r for r in results if "skipped" not in r]
    traced = [r for r in attempted if r["runs"] and all("estimated_bytes" in run for run in r["runs"])]
    compared = [abs(run["error_pct"]) for _, run in runs if "error_pct" in run]
    summary = {
        "cases": len(results),
        "attempted": len(attempted),
        "skipped": len(results) - len(attempted),
        "traced": len(traced),
        "traced_pct": 100 * len(traced) / len(attempted) if attempted else 0.0,
        "runs_compared": len(compared),
        "median_abs_error_pct": statistics.median(compared) if compared else None,
        "max_abs_error_pct": max(compared) if compared else None,
        "families": len({r.get("family") for r in attempted}),
    }
    for loop in ("kept", "freed"):
        picked = [abs(run["error_pct"]) for _, run in runs if run["loop"] == loop and "error_pct" in run]
        if picked:
            summary[f"{loop}_median"], summary[f"{loop}_max"] = statistics.median(picked), max(picked)
            summary[f"{loop}_runs"] = len(picked)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "cases": results},
                                                   indent=2) + "\n")
    s = summary
    bounded = _upper_bound_cases(results)  # cases traced with --data-dependent upper-bound
    goals = (s["traced_pct"] >= GOAL_TRACED and s["median_abs_error_pct"] is not None
             and s["median_abs_error_pct"] <= GOAL_MEDIAN and s["max_abs_error_pct"] <= GOAL_MAX
             and s["attempted"] >= 40)
    lines = [
        "# Model zoo: public model code, memest --target cpu vs real CPU runs",
        "",
        f"Measured {meta['date']} on {meta['machine']}; Python {meta['python']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items())
        + f"; nanoGPT {meta['repos']['nanoGPT']}, minGPT {meta['repos']['minGPT']}.",
        "",
        "Each case is a small configuration of a model's own code from a public package or repository (nothing "
        "vendored into memest; cases: scripts/zoo_cases.py), estimated through the Python API "
        "(`memest.estimate(factory, inputs=..., loss=..., target=\"cpu\", outputs=...)`) and run for real in the "
        "identical loop on this CPU (validate/cpu_truth.py: torch.profiler memory events, two steps with the "
        "optimizer), in both loops: **kept** (the plain loop, memest's default) and **freed** (the output dropped "
        "before backward). Error = (estimated - measured) / measured peak.",
        "",
        f"**{s['attempted']} cases ({s['families']} families): {s['traced']} trace without error "
        f"({s['traced_pct']:.1f}%); over {s['runs_compared']} runs compared, median |error| "
        + (f"{s['median_abs_error_pct']:.3f}%, max {s['max_abs_error_pct']:.2f}%" if compared else "-")
        + f"** (goal: >= {GOAL_TRACED:g}% traced, median <= {GOAL_MEDIAN:g}%, max <= {GOAL_MAX:g}%, >= 40 cases: "
        + ("met" if goals else "not met") + ")."
        + (f" {s['skipped']} skipped (package or checkout absent)." if s["skipped"] else ""),
        "",
    ]
    for loop in ("kept", "freed"):
        if f"{loop}_runs" in s:
            lines.append(f"- loop {loop}: median |error| {s[f'{loop}_median']:.3f}%, max {s[f'{loop}_max']:.2f}% "
                         f"over {s[f'{loop}_runs']} runs")
    lines += [
        "",
        "Reproduce (set-up once, then the run):",
        "",
        "```",
        *meta["setup"],
        "```",
        "",
        "| case | family | source | batch | seq | optim | precision | loop | traced | estimated | measured | error "
        "| trace s |",
        "|---|---|---|---:|---:|---|---|---|---|---:|---:|---:|---:|",
    ]
    for r in results:
        if "skipped" in r or "crash" in r:
            why = r.get("skipped") or r.get("crash")
            lines.append(f"| {r['name']} | {r.get('family', '-')} | {r.get('source', '-')} | | | | | | "
                         f"{'skipped' if 'skipped' in r else 'crashed'}: {why} | | | | |")
            continue
        for run in r["runs"]:
            ok = ("yes (upper bound)" if r["name"] in dict(bounded) else "yes") if "estimated_bytes" in run else "**no**"
            err = f"{run['error_pct']:+.3f}%" if "error_pct" in run else "-"
            lines.append(
                f"| {r['name']} | {r['family']} | {r['source']} | {r['batch']} | {r['seq'] or '-'} | {r['optim']} | "
                f"{r['precision']} | {run['loop']} | {ok} | {_fmt(run.get('estimated_bytes'))} | "
                f"{_fmt(run.get('measured_bytes'))} | {err} | {run['trace_seconds']:.1f} |")
    if bounded:
        lines += ["", "## Cases traced with `--data-dependent upper-bound`", "",
                  "Their model code runs ops whose output size depends on tensor values (by default memest refuses "
                  "them with the way out); these cases pass `data_dependent=\"upper-bound\"` (memest/trace/"
                  "upper_bound.py), which traces those ops at their bound, so their estimate is an upper bound: "
                  "exact where the bound is attained, above the real peak where it is not.", ""]
        lines += [f"- **{name}**: {note}" for name, note in bounded]
    lines += ["", "## What failed and why", ""] + _failures(results)
    lines += ["", "Found by the zoo and fixed in memest (these cases read exact now):", ""] + [f"- {f}" for f in FIXED]
    skipped = [r for r in results if "skipped" in r]
    if skipped:
        lines += ["", "Skipped (not failures): " + "; ".join(f"{r['name']} ({r['skipped']})" for r in skipped) + "."]
    notes = [r for r in results if r.get("note") and r["name"] not in dict(bounded)]
    if notes:
        lines += ["", "Notes on the loops traced:", ""] + [f"- {r['name']}: {r['note']}" for r in notes]
    out.write_text("\n".join(lines) + "\n")
    return summary


def _upper_bound_cases(results: list[dict]) -> list[tuple[str, str]]:
    """(name, why) of the cases that need --data-dependent upper-bound (scripts/zoo_cases.py marks them)."""
    from zoo_cases import CASES

    marked = {c.name: c.note for c in CASES if c.options.get("data_dependent") == "upper-bound"}
    return [(r["name"], marked[r["name"]]) for r in results if r["name"] in marked]


SETUP = [
    "python3 -m venv /work/zoo-venv",
    "/work/zoo-venv/bin/pip install torch==2.14.1 torchvision==0.29.1 timm transformers diffusers peft \\",
    "    x-transformers vit-pytorch torch_geometric accelerate",
    "/work/zoo-venv/bin/pip install -e .",
    "mkdir -p /tmp/zoo-repos  # nanoGPT and minGPT read from public checkouts at run time",
    "git clone https://github.com/karpathy/nanoGPT /tmp/zoo-repos/nanoGPT",
    "git clone https://github.com/karpathy/minGPT /tmp/zoo-repos/minGPT",
    "/work/zoo-venv/bin/python scripts/bench_zoo.py --repos /tmp/zoo-repos",
    "# one case, both loops, its rows updated in benchmarks/zoo.json/.md: --only NAME; kept loop only: --quick",
]


def _report(r: dict) -> dict:
    if "skipped" in r or "crash" in r:
        status = "skipped: " + r["skipped"] if "skipped" in r else "CRASH: " + r["crash"]
    else:
        status = "  ".join(
            f"{run['loop']} " + (f"{run['error_pct']:+.3f}%" if "error_pct" in run else
                                 "TRACE " + run["trace_error"] if "trace_error" in run else
                                 "REAL " + run.get("real_error", "?"))
            for run in r["runs"])
    print(f"{r['name']:28} {status}", file=sys.stderr, flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "zoo.md"))
    parser.add_argument("--only", default=None, help="comma-separated case names")
    parser.add_argument("--quick", action="store_true", help="the kept loop only")
    parser.add_argument("--repos", default=os.environ.get("ZOO_REPOS"), help="folder holding nanoGPT/, minGPT/")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per case")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--loops", default="kept,freed", help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help="list the cases")
    parser.add_argument("--fresh", action="store_true",
                        help="with --only: write only these cases (default: update their rows in the existing .json)")
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the existing .json, no runs")
    args = parser.parse_args()
    repos = Path(args.repos).resolve() if args.repos else None
    if args.worker:
        result = _worker(args.worker, args.loops.split(","), repos)
        print(MARK + json.dumps(result), flush=True)
        return
    sys.path.insert(0, str(HERE))
    from _machine import cpu_model
    from zoo_cases import CASES

    if args.list:
        for c in CASES:
            print(f"{c.name:28} {c.family:20} {c.source}")
        return
    names = [c.name for c in CASES]
    if args.only:
        wanted = args.only.split(",")
        unknown = [n for n in wanted if n not in names]
        if unknown:
            parser.error(f"unknown case(s) {unknown}; --list shows them")
        names = [n for n in names if n in wanted]
    out = Path(args.out)
    if args.render:
        doc = json.loads(out.with_suffix(".json").read_text())
        _write(doc["cases"], {**doc["meta"], "setup": SETUP}, out)
        return
    loops = ["kept"] if args.quick else ["kept", "freed"]
    results = [_report(_run_case(name, loops, repos, args.timeout)) for name in names]
    if args.only and not args.fresh and out.with_suffix(".json").is_file():  # update those rows
        fresh = {r["name"]: r for r in results}
        kept = {r["name"]: r for r in json.loads(out.with_suffix(".json").read_text())["cases"]}
        kept.update(fresh)
        order = [c.name for c in CASES]
        results = sorted(kept.values(), key=lambda r: order.index(r["name"]) if r["name"] in order else len(order))
    import torch

    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {platform.machine()} ({torch.backends.cpu.get_cpu_capability()}), "
        f"{torch.get_num_threads()} threads",
        "python": platform.python_version(),
        "versions": _versions(),
        "repos": {n: _repo_commit(repos, n) for n in ("nanoGPT", "minGPT")},
        "setup": SETUP,
        "command": " ".join(["python", "scripts/bench_zoo.py", *sys.argv[1:]]),
    }
    summary = _write(results, meta, out)
    print(json.dumps(summary, indent=2), file=sys.stderr)


if __name__ == "__main__":
    main()
