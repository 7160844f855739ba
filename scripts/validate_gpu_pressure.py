"""Near-capacity GPU ground truth (issue 21): training steps whose memest-predicted allocated peak is
80-97% of the card, N steps each, with and without expandable_segments, plus runs just above capacity
that are expected to OOM; raw torch.cuda.memory_stats() per step and a memory snapshot per run.

The device-side command, one line (the image's python3 holds torch, transformers and nvidia-ml-py):

    PYTHONPATH=. python3 scripts/validate_gpu_pressure.py --budget-s 420 --out /tmp/pressure --bundle "$OUT/pressure.tar.gz"

(``python3 scripts/validate_gpu.py --pressure ...`` is the same). Then unpack the bundle into
benchmarks/gpu-raw/<date>-<gpu>/ and commit it (the bundle is rewritten after every run, so a run cut short
still brings back what finished). Steps, all in fresh processes:

  plan      for the card present (torch.cuda.mem_get_info's total), memest on the CPU (CUDA hidden) picks per
            model the batch whose predicted allocated peak is 80-97% of the total (batch 1 and 2 estimated,
            the batch interpolated linearly, then checked and corrected up to twice) and the first batch
            predicted above the total (expected OOM). ``--plan-only --capacity 80GiB`` does it on any machine
            and ``--plan FILE`` reuses it (re-planned when the card's total differs by more than 1%).
  real      each planned config, default allocator then expandable_segments:True, ``--steps`` steps (default 6):
            per step the raw memory_stats() (all keys), max_memory_allocated/reserved (running peaks since
            the run began: never reset, so step k's is the peak of steps 0..k), num_alloc_retries,
            num_ooms, NVML used (device, and this process); an OOM is recorded (step, stats), not raised; at the
            end a memory snapshot (_record_memory_history(max_entries=...)): the pickle where under 20 MB, else
            the segment list summary only
  multi     torch.cuda.device_count() >= 2: FSDP2 (fully_shard) on NCCL over 2 ranks (mp.spawn), per rank the
            same records plus NVML per process (what NCCL holds outside the allocator = NVML - reserved)
  budget    no new run starts when the time left is under the longest run so far (``--budget-s``); whatever
            finished is written (summary.json, summary.md) after every run

Comparison per run: memest allocated / reserved / needed range and its verdict for the card's total; a run
that ran must not be does-not-fit, one that OOMed is listed with the verdict memest gave.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# models validate_gpu.py already runs (model, seq, optimizer, precision); batch chosen per card
PRESSURE_MODELS = [
    ("hf:llama-3.2-1b", 2048, "adamw", "bf16-mixed"),
    ("hf:tinyllama-1.1b", 2048, "adamw", "bf16-mixed"),
    ("hf:gpt2-medium", 1024, "adamw", "bf16-mixed"),
]
LOW, HIGH = 0.80, 0.97  # the share of the card's total the predicted allocated peak must fall in
# larger snapshot pickles are kept as their segment summary only: the device tool brings back at most 8 files of
# 16 MiB (/work/.library/device/README.md, "Limits"), so all runs go back as one --bundle tar.gz under 16 MiB
SNAPSHOT_MAX_BYTES = 1536 * 2**10
SNAPSHOT_MAX_ENTRIES = 20000
EXPANDABLE = "expandable_segments:True"
FIRST_RUN_GUESS_S = 90.0  # before any run finished: a guess of one run's wall time (model build + steps)


# ---- plan: pure, tested on the CPU -------------------------------------------------------------------

def interpolate_batch(points: dict[int, int], capacity: int, low: float = LOW, high: float = HIGH) -> int | None:
    """The next batch to estimate, aiming at the middle of [low, high] x capacity: between the two batches that
    bracket it (linear interpolation kept off the ends by a quarter of the gap: converges on curved growth
    too), else on the line through the two largest batches. None: no untried integer batch is left between."""
    target = capacity * (low + high) / 2
    below = [b for b, a in points.items() if a < target]
    above = [b for b, a in points.items() if a >= target]
    if below and above:
        b1 = max(below)
        higher = [b for b in above if b > b1]
        if not higher or min(higher) - b1 <= 1:
            return None
        b2 = min(higher)
        guess = b1 + (target - points[b1]) * (b2 - b1) / (points[b2] - points[b1])
        q = max(1, (b2 - b1) // 4)
        return int(min(max(guess, b1 + q), b2 - q))
    if not below:
        return None  # the smallest batch tried is already above the middle
    b1, b2 = sorted(points)[-2:]
    slope = (points[b2] - points[b1]) / (b2 - b1)
    if slope <= 0:
        return b2 * 2
    return max(b2 + 1, int(b2 + (target - points[b2]) / slope))


def plan_model(estimate, capacity: int, low: float = LOW, high: float = HIGH, rounds: int = 6) -> dict:
    """Pick the in-range batch and the first over-capacity batch for one model. ``estimate(batch)`` returns
    memest's dict (at least "allocated"). Returns {"batch", "estimate", "oom_batch", "oom_estimate", "tried"};
    "batch" None when no batch tried lands in range."""
    ests = {1: estimate(1), 2: estimate(2)}
    points = {b: e["allocated"] for b, e in ests.items()}
    for _ in range(rounds):
        b = interpolate_batch(points, capacity, low, high)
        if b is None or b in ests:
            break
        ests[b] = estimate(b)
        points[b] = ests[b]["allocated"]
        if low * capacity <= points[b] <= high * capacity:
            break
    inside = [b for b, a in points.items() if low * capacity <= a <= high * capacity]
    batch = max(inside) if inside else None
    over = [b for b, a in points.items() if a > capacity]
    oom = min(over) if over else None
    if batch is not None and (oom is None or oom > batch + max(1, batch // 8)):
        # the first batch right above capacity: step up from the chosen one by its per-sample slope
        per = max(1, (points[batch] - points[1]) // max(1, batch - 1))
        step = batch + max(1, -(-(capacity - points[batch]) // per))
        ests[step] = estimate(step)
        points[step] = ests[step]["allocated"]
        if points[step] > capacity:
            oom = step
    return {"batch": batch, "estimate": ests.get(batch), "oom_batch": oom, "oom_estimate": ests.get(oom),
            "tried": {str(b): a for b, a in sorted(points.items())}}


def runs_from_plan(plan: dict) -> list[dict]:
    """The real runs, in order: in-range configs (default, then expandable), then the expected-OOM ones."""
    runs = []
    for entry in plan["models"]:
        if entry["batch"] is not None:
            for conf in ("", EXPANDABLE):
                runs.append({"config": entry["config"], "batch": entry["batch"], "alloc_conf": conf,
                             "expect": "fits", "memest": entry["estimate"]})
    for entry in plan["models"]:
        if entry["oom_batch"] is not None:
            runs.append({"config": entry["config"], "batch": entry["oom_batch"], "alloc_conf": "",
                         "expect": "oom", "memest": entry["oom_estimate"]})
    return runs


class Budget:
    """Stops starting new runs when the time left is under the longest run so far (a guess before any)."""

    def __init__(self, seconds: float, clock=time.monotonic, first_guess: float = FIRST_RUN_GUESS_S) -> None:
        self.seconds, self.clock, self.start, self.longest = seconds, clock, clock(), 0.0
        self.first_guess = first_guess

    def left(self) -> float:
        return self.seconds - (self.clock() - self.start)

    def can_start(self) -> bool:
        return self.left() >= (self.longest or self.first_guess)

    def record(self, run_seconds: float) -> None:
        self.longest = max(self.longest, run_seconds)


# ---- records: pure, tested on synthetic stats ---------------------------------------------------------

def step_record(step: int, stats: dict, max_allocated: int, max_reserved: int, nvml_device: int | None,
                nvml_process: int | None, seconds: float, oom: str | None = None) -> dict:
    return {"step": step, "seconds": seconds, "oom": oom, "max_memory_allocated": max_allocated,
            "max_memory_reserved": max_reserved, "num_alloc_retries": stats.get("num_alloc_retries", 0),
            "num_ooms": stats.get("num_ooms", 0), "nvml_device_used": nvml_device,
            "nvml_process_used": nvml_process, "memory_stats": dict(stats)}


def snapshot_summary(snapshot: dict) -> dict:
    """The segment list of torch.cuda.memory._snapshot() without the blocks' stacks, and totals."""
    segments = [{k: s.get(k) for k in ("device", "address", "total_size", "allocated_size", "active_size",
                                       "requested_size", "segment_type", "stream")} | {"blocks": len(s.get("blocks", []))}
                for s in snapshot.get("segments", [])]
    return {"segments": segments, "segment_count": len(segments),
            "total_size": sum(s["total_size"] or 0 for s in segments),
            "allocated_size": sum(s["allocated_size"] or 0 for s in segments),
            "trace_entries": sum(len(t) for t in snapshot.get("device_traces", []))}


def save_snapshot(snapshot: dict, stem: Path, max_bytes: int = SNAPSHOT_MAX_BYTES) -> str:
    """The pickle where small enough, else the summary JSON; returns the file written."""
    data = pickle.dumps(snapshot)
    summary = snapshot_summary(snapshot)
    stem.with_suffix(".segments.json").write_text(json.dumps(summary, indent=1) + "\n")
    if len(data) <= max_bytes:
        stem.with_suffix(".pickle").write_bytes(data)
        return str(stem.with_suffix(".pickle"))
    return str(stem.with_suffix(".segments.json"))


def bundle(folder: Path, target: Path) -> Path:
    """``folder`` as one tar.gz (written beside, then moved: never half-written)."""
    import tarfile

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    tmp.replace(target)
    return target


def compare(run: dict, result: dict, capacity: int) -> dict:
    """One run against memest: the errors of the peaks, the verdict, and whether the verdict holds."""
    from memest.device.fit import verdict

    est = run["memest"] or {}
    steps = result.get("steps", [])
    oomed = bool(result.get("oom"))
    out = {"config": run["config"], "batch": run["batch"], "alloc_conf": run["alloc_conf"] or "default",
           "expect": run["expect"], "oomed": oomed, "steps_run": len([s for s in steps if not s["oom"]])}
    if not est:
        return out | {"verdict": None, "verdict_holds": None}
    v = verdict(est["needed_expected"], est["needed_high"], capacity, est.get("needed_floor"))
    out["verdict"] = str(v.value)
    out["verdict_holds"] = (v.value != "does-not-fit") if not oomed else None  # ran => not does-not-fit
    if steps and not oomed:
        real_alloc = max(s["max_memory_allocated"] for s in steps)
        real_res = max(s["max_memory_reserved"] for s in steps)
        out |= {"real_allocated": real_alloc, "real_reserved": real_res, "memest_allocated": est["allocated"],
                "memest_reserved": est["reserved"],
                "error_allocated_pct": 100.0 * (est["allocated"] - real_alloc) / real_alloc,
                "error_reserved_pct": 100.0 * (est["reserved"] - real_res) / real_res,
                "num_alloc_retries": steps[-1]["num_alloc_retries"],
                "nvml_process_peak": max((s["nvml_process_used"] or 0) for s in steps)}
    return out


def summary_markdown(env: dict, capacity: int, rows: list[dict], skipped: list[dict]) -> str:
    gib = 2**30
    lines = [f"# Near-capacity GPU runs: {env.get('gpu')} ({capacity / gib:.2f} GiB total)", "",
             f"driver {env.get('driver')}, CUDA {env.get('cuda')}, torch {env.get('torch')}, {env.get('date')}. "
             f"memest {env.get('plan_memest')}: defaults, no calibration, CUDA hidden.", "",
             "| config | batch | allocator | expect | OOMed | steps | real alloc GiB | memest alloc GiB | err | "
             "real reserved GiB | memest reserved GiB | err | retries | verdict | holds |",
             "|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]

    def g(v):
        return f"{v / gib:.2f}" if isinstance(v, int | float) else "-"

    def p(v):
        return f"{v:+.2f}%" if isinstance(v, int | float) else "-"

    for r in rows:
        lines.append(f"| {r['config'][0]} seq {r['config'][1]} {r['config'][3]} | {r['batch']} | {r['alloc_conf']} | "
                     f"{r['expect']} | {r['oomed']} | {r['steps_run']} | {g(r.get('real_allocated'))} | "
                     f"{g(r.get('memest_allocated'))} | {p(r.get('error_allocated_pct'))} | "
                     f"{g(r.get('real_reserved'))} | {g(r.get('memest_reserved'))} | {p(r.get('error_reserved_pct'))} | "
                     f"{r.get('num_alloc_retries', '-')} | {r.get('verdict')} | {r.get('verdict_holds')} |")
    if skipped:
        lines += ["", "Not run (time budget or failure):", ""]
        lines += [f"- {s['config'][0]} batch {s['batch']} {s['alloc_conf'] or 'default'}: {s['why']}" for s in skipped]
    return "\n".join(lines) + "\n"


# ---- the processes (need CUDA, except the memest child) ----------------------------------------------

def _estimate(config, batch: int, cc) -> dict:
    """memest for (model, seq, optim, precision) at ``batch``: CUDA hidden in this process."""
    from memest.estimator import estimate
    from memest.spec import RunSpec

    model, seq, optim, precision = config
    spec = RunSpec(model=model, batch=batch, seq=seq, optim=optim, precision=precision,
                   compute_capability=tuple(cc), outputs="freed")
    d = estimate(spec, calibration=None).report.device
    return {"allocated": d.allocated_peak_bytes, "reserved": d.reserved_peak_bytes, "device": d.device_bytes,
            "needed_low": d.needed_bytes_low, "needed_expected": d.needed_bytes_expected,
            "needed_high": d.needed_bytes_high, "needed_floor": d.needed_bytes_floor}


def _nvml(index: int):
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    pid = os.getpid()

    def read() -> tuple[int, int | None]:
        proc = next((p.usedGpuMemory for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                     if p.pid == pid), None)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used), (int(proc) if proc else None)
    return read


def _build(config, batch: int):
    import torch
    from torch.utils._pytree import tree_map

    from memest.features.registry import build, step_optimizer
    from memest.sources import load_source
    from memest.spec import RunSpec

    model_ref, seq, optim, precision = config
    spec = RunSpec(model=model_ref, batch=batch, seq=seq, optim=optim, precision=precision,
                   compute_capability=tuple(torch.cuda.get_device_capability()), outputs="freed")
    source = load_source(spec.model)
    torch.manual_seed(0)
    built = build(source, spec)
    return spec, source, built.model, built.inputs, tree_map, step_optimizer


def run_pressure(config, batch: int, steps: int, stem: Path) -> dict:
    """One near-capacity run in this (fresh) process: per-step records, OOM caught, snapshot at the end."""
    import torch

    from memest.features.registry import run_step

    spec, source, model, inputs, tree_map, step_optimizer = _build(config, batch)
    read = _nvml(torch.cuda.current_device())
    torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_MAX_ENTRIES)
    records, oom = [], None
    try:
        model = model.cuda()
        inputs = tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, inputs)
        torch.set_default_device("cuda")
        optimizer = step_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
        for i in range(steps):
            start = time.perf_counter()
            try:
                run_step(model, inputs, optimizer, source.compute_loss, spec, device_type="cuda")
                torch.cuda.synchronize()
            except torch.OutOfMemoryError as exc:
                oom = f"step {i}: {str(exc).splitlines()[0]}"
            dev, proc = read()
            records.append(step_record(i, torch.cuda.memory_stats(), torch.cuda.max_memory_allocated(),
                                       torch.cuda.max_memory_reserved(), dev, proc, time.perf_counter() - start, oom))
            if oom:
                break
    except torch.OutOfMemoryError as exc:  # moving the model or building the optimizer
        oom = f"setup: {str(exc).splitlines()[0]}"
        dev, proc = read()
        records.append(step_record(-1, torch.cuda.memory_stats(), torch.cuda.max_memory_allocated(),
                                   torch.cuda.max_memory_reserved(), dev, proc, 0.0, oom))
    snapshot_file = save_snapshot(torch.cuda.memory._snapshot(), stem)
    torch.cuda.memory._record_memory_history(enabled=None)
    return {"steps": records, "oom": oom, "snapshot": snapshot_file,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}


def _fsdp_rank(rank: int, world: int, config, batch: int, steps: int, out: str) -> None:
    """One FSDP2 rank on NCCL: per-step records with NVML per process (NCCL's memory is NVML - reserved)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from memest.features.registry import run_step

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world)
    spec, source, model, inputs, tree_map, step_optimizer = _build(config, batch)
    read = _nvml(rank)
    model = model.cuda()
    for module in model.modules():  # each decoder block its own unit, then the root
        if type(module).__name__.endswith(("DecoderLayer", "Block")):
            fully_shard(module)
    fully_shard(model)
    inputs = tree_map(lambda t: t.cuda() if isinstance(t, torch.Tensor) else t, inputs)
    torch.set_default_device("cuda")
    optimizer = step_optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    records = []
    for i in range(steps):
        start = time.perf_counter()
        run_step(model, inputs, optimizer, source.compute_loss, spec, device_type="cuda")
        torch.cuda.synchronize()
        dev, proc = read()
        records.append(step_record(i, torch.cuda.memory_stats(), torch.cuda.max_memory_allocated(),
                                   torch.cuda.max_memory_reserved(), dev, proc, time.perf_counter() - start))
    Path(out, f"fsdp-rank{rank}.json").write_text(json.dumps({"rank": rank, "world": world, "config": list(config),
                                                               "batch": batch, "steps": records}) + "\n")
    dist.destroy_process_group()


def _spawn(args: list[str], env_extra: dict, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          env={**os.environ, **env_extra}, timeout=max(10.0, timeout))
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(proc.stderr[-3000:])


HIDDEN = {"CUDA_VISIBLE_DEVICES": "", "XDG_CACHE_HOME": "/nonexistent-memest-cache"}


def make_plan(capacity: int, cc, workers: int, models=PRESSURE_MODELS) -> dict:
    def one(config):
        def est(batch):
            return _spawn(["--child", "estimate", "--config", json.dumps(list(config)), "--batch", str(batch),
                           "--cc", json.dumps(list(cc))], HIDDEN, 900)
        try:
            return {"config": list(config)} | plan_model(est, capacity)
        except Exception as exc:  # noqa: BLE001 -- a model that fails to plan is reported, the others run
            return {"config": list(config), "batch": None, "oom_batch": None, "error": str(exc)[-1500:]}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        entries = list(pool.map(one, models))
    return {"capacity": capacity, "compute_capability": list(cc), "low": LOW, "high": HIGH, "memest": _memest_version(),
            "models": entries}


def _memest_version() -> str:
    """memest's version and, where the checkout has git, its commit: a reused --plan's estimates are that memest's."""
    from memest.version import __version__

    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{__version__} {commit}".strip()


def card(index: int = 0) -> tuple[int, list[int], int]:
    """The card's total bytes, compute capability and the GPU count, from NVML: the parent process creates no
    CUDA context (it would hold memory beside the runs; cudaMemGetInfo's total is the same figure)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return (int(pynvml.nvmlDeviceGetMemoryInfo(handle).total), list(pynvml.nvmlDeviceGetCudaComputeCapability(handle)),
            int(pynvml.nvmlDeviceGetCount()))


def _environment() -> dict:
    from validate_gpu import _environment as env

    return env()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-raw" / "pressure"))
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting new runs near this many seconds")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plan", help="a plan JSON (--plan-only's) to reuse instead of planning here")
    parser.add_argument("--plan-only", action="store_true", help="no GPU needed: write the plan for --capacity")
    parser.add_argument("--capacity", help="--plan-only: the card's total (e.g. 79.19GiB), --cc the capability")
    parser.add_argument("--cc", default="[9, 0]")
    parser.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--bundle", help="also pack --out into this .tar.gz after every run (one file to bring back)")
    parser.add_argument("--child")
    parser.add_argument("--config")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--stem")
    args = parser.parse_args(argv)
    if args.child == "estimate":
        print("RESULT " + json.dumps(_estimate(json.loads(args.config), args.batch, json.loads(args.cc))))
        return
    if args.child == "fsdp":
        import torch.multiprocessing as mp

        mp.spawn(_fsdp_rank, args=(2, tuple(json.loads(args.config)), args.batch, args.steps, args.stem), nprocs=2)
        print("RESULT {}")
        return
    if args.child == "real":
        print("RESULT " + json.dumps(run_pressure(json.loads(args.config), args.batch, args.steps, Path(args.stem))))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_s)
    if args.plan_only:
        from memest.units import parse_bytes

        plan = make_plan(parse_bytes(args.capacity), json.loads(args.cc), args.workers)
        (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
        print(f"wrote {out / 'plan.json'}")
        return
    import torch

    if not torch.cuda.is_available():
        sys.exit("validate_gpu_pressure.py needs a CUDA GPU (or --plan-only --capacity SIZE)")
    capacity, cc, count = card()
    plan = json.loads(Path(args.plan).read_text()) if args.plan else None
    if plan is None or abs(plan["capacity"] - capacity) > 0.01 * capacity or plan["compute_capability"] != cc:
        plan = make_plan(capacity, cc, args.workers)
    (out / "plan.json").write_text(json.dumps(plan, indent=1) + "\n")
    env = _environment() | {"capacity": capacity, "device_count": count, "plan_memest": plan.get("memest"), "nvml_device_used_before": _nvml(0)()[0]}
    rows, skipped, raw = [], [], []

    def save():
        (out / "summary.json").write_text(json.dumps({"environment": env, "rows": rows, "skipped": skipped,
                                                      "runs": raw}, indent=1) + "\n")
        (out / "summary.md").write_text(summary_markdown(env, capacity, rows, skipped))
        if args.bundle:
            bundle(out, Path(args.bundle))

    for i, run in enumerate(runs_from_plan(plan)):
        if not budget.can_start():
            skipped.append(run | {"why": f"budget: {budget.left():.0f} s left"})
            continue
        stem = out / f"run{i:02d}"
        start = time.monotonic()
        try:
            result = _spawn(["--child", "real", "--config", json.dumps(run["config"]), "--batch", str(run["batch"]),
                             "--steps", str(args.steps), "--stem", str(stem)],
                            {"PYTORCH_CUDA_ALLOC_CONF": run["alloc_conf"]} if run["alloc_conf"] else {},
                            budget.left())
        except Exception as exc:  # noqa: BLE001 -- one failing run must not lose the others
            skipped.append(run | {"why": f"failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else '?'}"})
            budget.record(time.monotonic() - start)
            save()
            continue
        budget.record(time.monotonic() - start)
        stem.with_suffix(".json").write_text(json.dumps(run | result, indent=1) + "\n")
        raw.append(str(stem.with_suffix(".json")))
        rows.append(compare(run, result, capacity))
        print(json.dumps(rows[-1]), flush=True)
        save()
    entry = next((e for e in plan["models"] if e.get("batch")), None)
    if count >= 2 and entry and budget.can_start():
        try:
            _spawn(["--child", "fsdp", "--config", json.dumps(entry["config"]), "--batch", str(entry["batch"]),
                    "--steps", str(args.steps), "--stem", str(out)], {}, budget.left())
            env["fsdp_ranks"] = [f"fsdp-rank{r}.json" for r in range(2)]
        except Exception as exc:  # noqa: BLE001 -- the single-GPU runs are kept
            env["fsdp_error"] = str(exc)[-1500:]
    save()
    print(f"wrote {out / 'summary.md'}")


if __name__ == "__main__":
    main()
