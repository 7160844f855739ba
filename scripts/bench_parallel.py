"""Issue 13's benchmark -> benchmarks/parallel.md.

1. Tiny layouts measured for real on this CPU (TP 2, TP 2 + SP, TP 4, FSDP x TP 2 x 2, 2-rank pipelines
   under 1F1B, GPipe, interleaved 1F1B and looped BFS, pipeline x FSDP2, x TP, x FSDP2 x TP, x TP + SP, x FSDP2 with
   CPU offload, x EP; MoE TP and EP): each rank's measured peak (validate/distributed_truth.py), memest's traced peak, and
   Megatron-LM's published per-rank formula on the same configuration, as a peer.
2. llama-2-70b and mixtral-8x7b planned on 8 and 64 GPUs (`memest plan-parallel`, H100 80 GB,
   bf16-mixed AdamW, batch 1, seq 4096), with the wall time of each plan, and Megatron's formula for the
   same layouts beside memest's per-rank need.

Megatron's formula: megatron/training/theoretical_memory_usage.py (NVIDIA/Megatron-LM, read at commit
00caa53a), re-implemented here for dense GQA/SwiGLU decoders and Mixtral's MoE:
  weights + optimizer = params on the most loaded shard x (18 B, or 6 + 12 / dp with the distributed
    optimizer), the most loaded shard = (transformer block / pp + embedding) / tp (+ the untied output
    layer when pp = 1);
  activations (``compute_activation_memory_without_sp``) = s b h (10 + 24 / tp) per layer x layers, + 8 s b pp
    + s b h pp (embedding), x min(1, M / pp) with a pipeline, + 2 (s b V / tp + s b h) when pp = 1, x 1.05.
It describes Megatron's own training (bf16 weights with fp32 main grads, its kernels), not torch AMP +
FSDP2 as memest traces; it is a peer, not a ground truth.

Usage: python scripts/bench_parallel.py [--skip-real] [--skip-plans] [--skip-unpruned] [--skip-full-depth] [--only TEXT] [--plan-model NAME]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TINY = [  # (label, config, RunSpec changes)
    ("TP 2", "llama-tiny", dict(world_size=2, tp=2)),
    ("TP 2 + SP", "llama-tiny", dict(world_size=2, tp=2, sp=True)),
    # torchtitan's head (issue 21): loss parallel (its default, vocabulary-sharded logits) and disable_loss_parallel
    ("TP 2 + SP, loss parallel", "llama-tiny", dict(world_size=2, tp=2, sp=True, loss_parallel=True)),
    ("TP 2 + SP, no loss parallel", "llama-tiny", dict(world_size=2, tp=2, sp=True, loss_parallel=False)),
    ("TP 4", "llama-tiny-tp", dict(world_size=4, tp=4)),
    ("FSDP x TP 2 x 2", "llama-tiny-tp", dict(world_size=4, tp=2, shard="zero3")),
    ("PP 2, 1F1B, M 4", "llama-tiny", dict(world_size=2, pp=2, microbatches=4)),
    ("PP 2, GPipe, M 4", "llama-tiny", dict(world_size=2, pp=2, microbatches=4, pp_schedule="gpipe")),
    ("PP 2 x 2 virtual, interleaved 1F1B, M 4", "llama-tiny-4l", dict(world_size=2, pp=2, microbatches=4,
                                                                      pp_schedule="interleaved")),
    ("PP 2 x 2 virtual, looped BFS, M 4", "llama-tiny-4l", dict(world_size=2, pp=2, microbatches=4,
                                                                pp_schedule="looped-bfs")),
    ("PP 2 x FSDP 2, 1F1B, M 4", "llama-tiny", dict(world_size=4, pp=2, microbatches=4, shard="zero3")),
    ("PP 2 x TP 2, 1F1B, M 4", "llama-tiny", dict(world_size=4, pp=2, microbatches=4, tp=2)),
    ("PP 2 x 2 virtual x FSDP 2, interleaved 1F1B, M 4", "llama-tiny-4l",
     dict(world_size=4, pp=2, microbatches=4, pp_schedule="interleaved", shard="zero3")),
    ("PP 2 x FSDP 2 x TP 2, 1F1B, M 4", "llama-tiny-tp", dict(world_size=8, pp=2, microbatches=4, tp=2, shard="zero3")),
    # issue 13's pipeline combinations: sequence parallel and CPU offload inside each stage (offload rows: device + host,
    # one memory on a CPU)
    ("PP 2 x TP 2 + SP, 1F1B, M 4", "llama-tiny", dict(world_size=4, pp=2, microbatches=4, tp=2, sp=True)),
    ("PP 2 x FSDP 2 x TP 2 + SP, 1F1B, M 4", "llama-tiny-tp",
     dict(world_size=8, pp=2, microbatches=4, tp=2, sp=True, shard="zero3")),
    ("PP 2 x FSDP 2, offload params, 1F1B, M 4", "llama-tiny", dict(world_size=4, pp=2, microbatches=4, shard="zero3",
                                                                   offload="params")),
    ("PP 2 x FSDP 2 (zero2), offload optimizer, 1F1B, M 4", "llama-tiny",
     dict(world_size=4, pp=2, microbatches=4, shard="zero2", offload="optimizer")),
    ("PP 2, offload optimizer, 1F1B, M 4", "llama-tiny", dict(world_size=2, pp=2, microbatches=4, offload="optimizer")),
    # MoE (transformers' own parallel code): TP with its MoE styles, EP at each routing assumption, the real run's
    # router weights set to make that split (trace/expert_parallel.route_as)
    ("Mixtral TP 2 (packed_colwise, moe_tp_experts)", "mixtral-tiny", dict(world_size=2, tp=2)),
    ("Mixtral FSDP x TP 2 x 2", "mixtral-tiny", dict(world_size=4, tp=2, shard="zero3")),
    ("Qwen3-MoE TP 2, bf16-mixed", "qwen3-moe-tiny", dict(world_size=2, tp=2, precision="bf16-mixed")),
    ("Mixtral EP 2, uniform routing", "mixtral-tiny", dict(world_size=2, ep=2, shard="zero3")),
    ("Mixtral EP 2, all pairs to rank 0", "mixtral-tiny", dict(world_size=2, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Mixtral EP 2 x 2 copies, uniform", "mixtral-tiny", dict(world_size=4, ep=2, shard="zero3")),
    ("Mixtral EP 2 x 2 copies, all to rank 0", "mixtral-tiny", dict(world_size=4, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Mixtral TP 2 x EP 2, uniform", "mixtral-tiny", dict(world_size=2, tp=2, ep=2)),
    ("Mixtral TP 2 x EP 2, all to rank 0", "mixtral-tiny", dict(world_size=2, tp=2, ep=2, ep_routing="one-rank")),
    ("Mixtral FSDP 2 x TP 2 x EP 2, uniform", "mixtral-tiny", dict(world_size=4, tp=2, ep=2, shard="zero3")),
    ("Mixtral FSDP 2 x TP 2 x EP 2, all to rank 0", "mixtral-tiny",
     dict(world_size=4, tp=2, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Qwen2-MoE EP 2 (a shared expert), uniform", "qwen2-moe-tiny", dict(world_size=2, ep=2, shard="zero3")),
    ("Qwen2-MoE EP 2 (a shared expert), all to rank 0", "qwen2-moe-tiny",
     dict(world_size=2, ep=2, shard="zero3", ep_routing="one-rank")),
    ("OLMoE EP 2, uniform", "olmoe-tiny", dict(world_size=2, ep=2, shard="zero3")),
    ("OLMoE EP 2, all to rank 0", "olmoe-tiny", dict(world_size=2, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Qwen3-MoE EP 2, bf16-mixed, uniform", "qwen3-moe-tiny", dict(world_size=2, ep=2, shard="zero2", precision="bf16-mixed")),
    ("Qwen3-MoE EP 2, bf16-mixed, all to rank 0", "qwen3-moe-tiny",
     dict(world_size=2, ep=2, shard="zero2", precision="bf16-mixed", ep_routing="one-rank")),
    # expert x pipeline parallel: EP over each stage's dp ranks
    ("Mixtral PP 2 x EP 2 (dp 2), uniform, M 4", "mixtral-tiny", dict(world_size=4, pp=2, microbatches=4, ep=2, shard="zero3")),
    ("Mixtral PP 2 x EP 2 (dp 2), all to each stage's rank 0, M 4", "mixtral-tiny",
     dict(world_size=4, pp=2, microbatches=4, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Mixtral PP 2 x EP 2 x 2 copies (dp 4), uniform, M 4", "mixtral-tiny",
     dict(world_size=8, pp=2, microbatches=4, ep=2, shard="zero3")),
    ("Mixtral PP 2 x EP 2 x 2 copies (dp 4), all to each stage's rank 0, M 4", "mixtral-tiny",
     dict(world_size=8, pp=2, microbatches=4, ep=2, shard="zero3", ep_routing="one-rank")),
    ("Mixtral PP 2 x FSDP 2 x TP 2 x EP 2, uniform, M 4", "mixtral-tiny",
     dict(world_size=8, pp=2, microbatches=4, tp=2, ep=2, shard="zero3")),
    ("Mixtral PP 2 x FSDP 2 x TP 2 x EP 2, all to each stage's rank 0, M 4", "mixtral-tiny",
     dict(world_size=8, pp=2, microbatches=4, tp=2, ep=2, shard="zero3", ep_routing="one-rank")),
    ("PP 2 x TP 2 + SP, bf16-mixed, 1F1B, M 4", "llama-tiny", dict(world_size=4, pp=2, microbatches=4, tp=2, sp=True,
                                                                  precision="bf16-mixed")),
    ("PP 2 x 2 virtual x TP 2 + SP, interleaved 1F1B, M 4", "llama-tiny-4l",
     dict(world_size=4, pp=2, microbatches=4, tp=2, sp=True, pp_schedule="interleaved")),
    ("Mixtral PP 2 x 2 virtual x EP 2 (dp 2), interleaved 1F1B, all to each stage's rank 0, M 4", "mixtral-tiny-4l",
     dict(world_size=4, pp=2, microbatches=4, ep=2, shard="zero3", pp_schedule="interleaved", ep_routing="one-rank")),
]
PLANS = [("llama-2-70b", 8), ("llama-2-70b", 64), ("mixtral-8x7b", 8), ("mixtral-8x7b", 64)]


def megatron_bytes(cfg: dict, tp: int, pp: int, dp: int, batch: int, seq: int, microbatches: int | None,
                   distributed_optimizer: bool, virtual: int = 1) -> tuple[float, float]:
    """(weights + optimizer, activations) per rank, bytes (module docstring)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    groups = cfg.get("num_key_value_heads") or heads
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or 1
    ffn = cfg.get("moe_intermediate_size") or cfg["intermediate_size"] if experts > 1 else cfg["intermediate_size"]
    attn = 2 * h * h * (1 + groups / heads)
    layer = 2 * h * (ffn * experts * 3 / 2 + 1) + attn  # SwiGLU x 3/2, RMSNorm (1)
    block = layer * layers + h
    emb = h * vocab
    untied = not cfg.get("tie_word_embeddings", False)
    shard = (block / pp + emb) / tp
    if untied and pp == 1:
        shard += emb / tp
    per_param = 6 + 12 / dp if distributed_optimizer else 18
    weights = shard * per_param
    act = seq * batch * h * (10 + 24 / tp) * layers
    act += 8 * seq * batch * pp + seq * batch * h * pp
    if pp > 1:
        act *= min(1, (microbatches or pp) / pp)
        if virtual > 1:  # interleaved_schedule_memory_penalty
            act *= 1 + (pp - 1) / (pp * virtual)
    else:
        act += 2 * (seq * batch * vocab / tp + seq * batch * h)
    return weights, act * 1.05


def _config(name: str) -> dict:
    tests = ROOT / "tests" / "configs" / f"{name}.json"
    path = tests if tests.exists() else ROOT / "memest" / "data" / "models" / f"{name}.json"
    return json.loads(path.read_text())


def tiny_rows(only: str = "") -> list[str]:
    from memest.features.registry import trace_step
    from memest.sources import load_source
    from memest.spec import RunSpec
    from memest.validate.distributed_truth import measure_distributed_peaks, measure_pipeline_stage_peaks

    rows = []
    for label, name, changes in TINY:
        if only and not any(o in label for o in only.split("|")):
            continue
        spec = RunSpec(model=f"hf:{ROOT / 'tests' / 'configs' / (name + '.json')}", batch=2, seq=32, optim="adamw",
                       target="cpu", **changes)
        if spec.pp > 1 and spec.world_size == spec.pp:  # each stage in this process (pytorch#132644)
            real = measure_pipeline_stage_peaks(spec)
        else:  # gloo processes; a pipeline's "pp" group is a fake one (trace/distributed._pipeline_mesh)
            real = measure_distributed_peaks([spec])[0]
        cfg = _config(name)
        weights, act = megatron_bytes(cfg, spec.tp, spec.pp, spec.dp, spec.batch, spec.seq, spec.microbatches or None,
                                      distributed_optimizer=spec.dp > 1, virtual=spec.stages_per_rank if spec.pp > 1 else 1)
        formula = f"{weights + act:,.0f} ({{:+.0f}}%)" if spec.ep == 1 else "- (not re-implemented for EP)"
        if spec.offload != "none":
            formula = "- (no offload in the formula)"
        for stage in range(spec.pp):  # each pipeline rank's first rank (the only rank without a pipeline)
            one = RunSpec(**{**spec.to_dict(), "pp_stage": stage})
            trace = trace_step(load_source(spec.model), one)
            traced = trace.combined_peak() if spec.offload != "none" else trace.peak()[0]  # offload: device + host
            rank = one.rank if len(real) == spec.world_size else stage
            measured = real[rank]["peak_bytes"]
            per_stage = spec.world_size // spec.pp
            others = [x["peak_bytes"] for x in real[rank + 1 : rank + per_stage]] if len(real) == spec.world_size else []
            rows.append(
                f"| {label} | {rank} | {measured:,} | {traced:,} | {100 * (traced - measured) / measured:+.3f}% | "
                f"{formula.format(100 * (weights + act - measured) / measured)} | {', '.join(map(str, others))} |"
            )
    return rows


RUNS = 3  # each plan timed this many times (median), end to end as a user runs it


def _plan_command(name: str, gpus: int) -> list[str]:
    return [sys.executable, "-m", "memest", "plan-parallel", f"hf:{name}", "--gpus", str(gpus), "--gpu", "h100",
            "--batch", "1", "--seq", "4096", "--precision", "bf16-mixed", "--optim", "adamw", "--json"]


def _timed(cmd: list[str]) -> tuple[dict, float, float, float]:
    """(JSON document, wall s, CPU s of the process, 1-min load average before it)."""
    import os
    import resource
    import subprocess

    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.stdout), wall, cpu, load


def _megatron_row(name: str, gpus: int, cfg: dict, lay: dict, extra: str) -> str:
    weights, act = megatron_bytes(cfg, lay["tp"], lay["pp"], lay["dp"], 1, 4096, lay["pp"] if lay["pp"] > 1 else None,
                                  distributed_optimizer=lay["dp"] > 1)
    layout = f"dp {lay['dp']} x tp {lay['tp']}{' + sp' if lay['sp'] else ''} x pp {lay['pp']}" + (f" (ep {lay['ep']})" if lay.get("ep", 1) > 1 else "")
    if lay["error"]:
        return f"| {name} | {gpus} | {layout} | not traced: {lay['error']} | | | | |"
    if lay["verdict"] == "not-traced":  # the search stopped before it (plan_parallel's top)
        return f"| {name} | {gpus} | {layout} | - | not traced | {lay['comm_bytes'] / 2**30:.1f} | | {extra} |"
    need = (">= " if lay.get("lower_bound") or not lay["traced"] else "") + f"{lay['needed_bytes'] / 2**30:.1f}"
    formula = f"{(weights + act) / 2**30:.1f}" if lay.get("ep", 1) == 1 else "-"  # not re-implemented for EP
    return (f"| {name} | {gpus} | {layout} | {need} | {lay['verdict']} | {lay['comm_bytes'] / 2**30:.1f} | "
            f"{formula} | {extra} |")


def plan_rows(only: str = "") -> tuple[list[str], list[str], list[dict]]:
    """The plans as users run them (RUNS times each, median wall and CPU time), and the planner's check."""
    import statistics

    rows, timing, docs = [], [], []
    for name, gpus in PLANS:
        if only and only != name:
            continue
        runs = [_timed(_plan_command(name, gpus)) for _ in range(RUNS)]
        doc = runs[-1][0]
        docs.append(doc)
        walls, cpus, loads = [r[1] for r in runs], [r[2] for r in runs], [r[3] for r in runs]
        check = doc["check"]
        check_text = (f"peak {100 * check['error']:+.2f}%, needed {100 * check['needed_error']:+.2f}% at "
                      f"{check['depth_per_stage']} layers" + (f", {check['microbatches']} micro-batches" if check["microbatches"] else "")
                      + f" ({check['layout']})") if check else "-"
        timing.append(f"| {name} | {gpus} | {statistics.median(walls):.1f} ({', '.join(f'{w:.0f}' for w in walls)}) | "
                      f"{statistics.median(cpus):.1f} | {', '.join(f'{x:.1f}' for x in loads)} | {doc['traces']} | {check_text} |")
        cfg = _config(name)
        rows += [_megatron_row(name, gpus, cfg, lay, lay["derived_from"]) for lay in doc["layouts"]]
    return rows, timing, docs


def unpruned_rows() -> list[str]:
    """The 8-GPU plans with every layout traced (plan_parallel(prune=False)): the per-rank need of layouts
    the model state already rules out, beside Megatron's formula, and how long tracing them takes."""
    from memest.app import resolve_gpu
    from memest.plan.parallel import plan_parallel
    from memest.spec import RunSpec

    rows = []
    ctx = resolve_gpu("h100", need_budget=True)
    for name, gpus in PLANS:
        if gpus != 8:
            continue
        base = RunSpec(model=f"hf:{name}", batch=1, seq=4096, optim="adamw", precision="bf16-mixed", target="cuda",
                       compute_capability=ctx.compute_capability)
        start = time.process_time()
        plan = plan_parallel(base.model, gpus, ctx.capacity_bytes, ctx.budget_label, base, prune=False, top=None)
        cpu = time.process_time() - start
        cfg = _config(name)
        for lay in plan.to_dict()["layouts"]:
            rows.append(_megatron_row(name, gpus, cfg, lay, f"{lay['derived_from']}; all traced in {cpu:.0f} s CPU"))
    return rows


def full_depth_rows(docs: list[dict]) -> list[str]:
    """The recommended (or, where none fits, the first traced) layout of each 64-GPU plan traced directly at
    the model's full depth: the derived per-rank peak and need against the direct ones."""
    from memest.app import resolve_gpu

    ctx = resolve_gpu("h100", need_budget=True)
    rows = []
    for (name, gpus), doc in zip(PLANS, docs, strict=True):
        if gpus != 64:
            continue
        first = next((x for x in doc["layouts"] if x["traced"] and not x["error"] and x["pp"] == 1), None)
        pipes = [x for x in doc["layouts"] if x["traced"] and not x["error"] and x["pp"] > 1]
        for lay in ([first] if first else []) + pipes:
            rows.append(_direct_row(name, lay, ctx))
    return rows


def _direct_row(name: str, lay: dict, ctx) -> str:
    """A pipeline: its first and last stage traced directly (M = pp), the worst of them."""
    from memest.estimator import _estimate_one, estimate
    from memest.plan.parallel import Layout
    from memest.sources import load_source
    from memest.spec import RunSpec

    layout = Layout(lay["dp"], lay["tp"], lay["pp"], lay["sp"])
    spec = RunSpec(model=f"hf:{name}", batch=1, seq=4096, optim="adamw", precision="bf16-mixed", target="cuda",
                   compute_capability=ctx.compute_capability, **layout.changes())
    start = time.process_time()
    if layout.pp == 1:
        direct = estimate(spec)
    else:
        src = load_source(spec.model)
        ends = [_estimate_one(RunSpec(**{**spec.to_dict(), "pp_stage": i}), None, src) for i in (0, layout.pp - 1)]
        direct = max(ends, key=lambda e: e.needed_bytes)
    cpu = time.process_time() - start
    peak, need = direct.report.peak_allocated_bytes, direct.needed_bytes
    return (f"| {name} | {layout.name} | {lay['peak_bytes']:,} | {peak:,} | {100 * (lay['peak_bytes'] - peak) / peak:+.3f}% | "
            f"{lay['needed_bytes']:,} | {need:,} | {100 * (lay['needed_bytes'] - need) / need:+.2f}% | {cpu:.0f} s |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-real", action="store_true")
    parser.add_argument("--skip-plans", action="store_true")
    parser.add_argument("--only", default="", help="measure only the tiny layouts whose label contains this text "
                        "(several: separated by |)")
    parser.add_argument("--plan-model", default="", help="plan only this model (llama-2-70b or mixtral-8x7b)")
    parser.add_argument("--skip-unpruned", action="store_true")
    parser.add_argument("--skip-full-depth", action="store_true")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "parallel-results.md"))
    args = parser.parse_args()
    import torch

    lines = [f"machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}", ""]
    if not args.skip_real:
        lines += ["| layout | rank | measured peak (B) | memest traced (B) | error | Megatron formula (B) | other ranks measured (B) |",
                  "|---|---|---|---|---|---|---|", *tiny_rows(args.only), ""]
    if not args.skip_plans:
        rows, timing, docs = plan_rows(args.plan_model)
        lines += ["| model | GPUs | median wall s (runs) | median CPU s | load average before each run | traces | "
                  "check against a direct trace |", "|---|---|---|---|---|---|---|", *timing, ""]
        lines += ["| model | GPUs | layout | memest need per rank (GiB) | verdict (H100 80 GB) | sent per rank per step (GiB) | "
                  "Megatron formula (GiB) | how |", "|---|---|---|---|---|---|---|---|", *rows, ""]
        if not args.skip_full_depth:
            lines += ["| model | layout | derived peak (B) | direct full-depth peak (B) | error | derived need (B) | "
                      "direct need (B) | error | direct trace CPU |", "|---|---|---|---|---|---|---|---|---|",
                      *full_depth_rows(docs), ""]
    if not args.skip_unpruned:
        lines += ["| model | GPUs | layout | memest need per rank (GiB) | verdict (H100 80 GB) | sent per rank per step (GiB) | "
                  "Megatron formula (GiB) | how |", "|---|---|---|---|---|---|---|---|", *unpruned_rows(), ""]
    Path(args.out).write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
