"""Each command's result as a View (report/emit.py): its JSON document and, for people, tables and
lines. Byte figures in one table share one binary unit; a budget written in decimal units (24GB)
keeps its own text beside the binary value."""

from __future__ import annotations

import re

from memest.device.fit import tight_reason
from memest.report.emit import Table, View
from memest.spec import RunSpec
from memest.spec.choices import KvDtype, Outputs, ServeVerdict, Target, Verdict
from memest.spec.trainers.load import as_dict, lines
from memest.units import format_bytes, format_in, plural, table_unit


def _yes(ok: bool | None) -> str:
    return "-" if ok is None else ("yes" if ok else "no")


# -------------------------------------------------------------------------------------- estimate


def estimate_doc(result) -> dict:
    report = result.report
    doc = report.to_dict()
    doc["peak_by_iteration"] = {str(k): v for k, v in report.peak_by_iteration.items()}
    needed = result.estimate.needed_bytes
    doc["needed_bytes"] = needed
    low, _, high = result.estimate.needed_range
    doc["needed_bytes_low"], doc["needed_bytes_high"] = low, high
    doc["gpus"] = {
        "compared_bytes": needed,
        "rows": [f.to_dict() for f in result.fits],
        "fits": result.verdict_fits,
        "verdict": result.verdict,
        "reason": "" if result.fits else result.gpu.no_gpu_reason,
    }
    doc["verdict"] = result.verdict  # worst over the budgets compared; None without one
    doc["gpu_arch"] = {"arch": result.gpu.arch, "why": result.gpu.arch_reason}
    doc["calibration"] = result.gpu.calibration_note
    doc["colocate"] = result.colocate.to_dict() if result.colocate is not None else None
    return doc


def estimate_view(result, depth: int = 3, expand: bool = False) -> View:
    from memest.report.console import print_estimate
    from memest.report.markdown import estimate_markdown

    report, fits, reason = result.report, result.fits, result.gpu.no_gpu_reason

    extra = colocate_lines(result.colocate, ("GiB", 2**30)) if result.colocate is not None else []
    if report.device is not None:  # said loudly: why a tight budget is tight
        extra = [f"TIGHT against {r.label}: {tight_reason(report.device.needed_bytes_floor, r.needed_bytes, r.capacity_bytes)}"
                 for r in fits if r.verdict == Verdict.TIGHT] + extra

    def rich(console) -> None:
        print_estimate(console, report, fits, reason, depth, **_expand_kw(print_estimate, expand))
        if result.timeline is not None:
            from memest.report.timeline import terminal_timeline

            for line in terminal_timeline(result.timeline):
                console.print(line, markup=False, highlight=False)
        for line in extra:
            console.print(line, markup=False, highlight=False)

    def markdown() -> str:
        text = estimate_markdown(report, fits, depth=depth, gpu_reason=reason, **_expand_kw(estimate_markdown, expand))
        return "\n\n".join([text, *extra])

    return View(estimate_doc(result), rich=rich, markdown=markdown)


def with_trainer(view: View, trainer) -> View:
    """``view`` with the mapping a ``--from`` trainer config used (spec/trainers): the JSON document's ``from``,
    and the same lines after the table and the Markdown."""
    if trainer is None:
        return view
    text = lines(trainer)
    rich, markdown = view.rich, view.markdown

    def rich_with(console) -> None:
        rich(console)
        for line in text:
            console.print(line, markup=False, highlight=False)

    def markdown_with() -> str:
        return "\n\n".join([markdown(), "```\n" + "\n".join(text) + "\n```"])

    blocks = view.blocks if rich else [*view.blocks, "\n".join(text)]  # the planners' views are blocks only
    return View({**view.doc, "from": as_dict(trainer)}, blocks, rich=rich_with if rich else None,
                markdown=markdown_with if markdown else None)


def _expand_kw(fn, expand: bool) -> dict:
    """Pass expand= to renderers that take it."""
    import inspect

    return {"expand": expand} if "expand" in inspect.signature(fn).parameters else {}


# ----------------------------------------------------------------------------------------- check


VERDICT_TEXT = {Verdict.FITS: "fits", Verdict.TIGHT: "TIGHT", Verdict.DOES_NOT_FIT: "DOES NOT FIT"}


_SIZE_IN_LABEL = re.compile(r" \([0-9.]+ [KMGT]i?B\)")  # "rtx2080ti (11 GiB)": the cell shows the size already


def check_view(result) -> View:
    rows = result.rows
    unit = table_unit([v for r in rows for v in (r.needed_bytes, r.required_bytes, r.budget_bytes)])
    headers = ["config", "model", "seq", "gpu", "predicted", "range", "with margin", "budget", "headroom", "verdict"]
    cells = [
        [
            r.name,
            r.model if r.model.startswith("hf:") else r.model.rsplit("/", 1)[-1],
            str(r.seq) if r.seq is not None else "-",
            r.arch or "-",  # the GPU generation whose kernels were modelled (--target cuda)
            format_in(r.needed_bytes, unit),
            f"{format_in(r.needed_bytes_low, unit)}-"
            + ("unbounded" if r.needed_bytes_high is None else format_in(r.needed_bytes_high, unit)),
            f"{format_in(r.required_bytes, unit)} (+{100 * r.margin:g}%)",
            f"{format_in(r.budget_bytes, unit)} ({_SIZE_IN_LABEL.sub('', r.budget_label)})",  # the size once
            format_in(r.headroom_bytes, unit),
            VERDICT_TEXT.get(r.verdict, r.verdict),
        ]
        for r in rows
    ]
    doc = {"fits": result.fits, "verdict": result.verdict, "strict": result.strict,
           "configs": [r.to_dict() for r in rows]}
    blocks: list = [Table("memest check", headers, cells, left=("config", "model", "budget", "verdict"))]
    blocks += tight_lines(result)
    blocks += [line for r in rows if r.trainer is not None for line in lines(r.trainer)]
    return View(doc, blocks)


def tight_lines(result) -> list[str]:
    """Said loudly: what tight means and how it was counted."""
    tight = result.tight
    if not tight:
        return []
    names = ", ".join(r.name for r in tight)
    counted = ("counted as NOT fitting (--strict)" if result.strict else
               "counted as fitting (exit 0); --strict counts tight as not fitting")
    return [f"TIGHT: {names}: the budget is between the needed floor (the allocator floor: the step's live "
            "blocks, no fragmentation; + fixed costs) and the high end of the needed range; below the expected need the caching "
            "allocator replay fragments more than fits, and the real allocator may or may not "
            f"(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True brings it nearer the floor); {counted}. "
            "`memest calibrate` on the card narrows the range."]


# ---------------------------------------------------------------------------------------- whatif


def whatif_view(run) -> View:
    s = run.sweep
    budget = run.gpu.capacity_bytes
    unit = table_unit([v for p in s.points for v in (p.peak_bytes, p.needed_bytes)] + [budget or 0])
    headers = ["batch", "seq", "peak allocated", "needed", "fits", "headroom", "how"]
    rows = [
        [str(p.batch), str(p.seq or "-"), format_in(p.peak_bytes, unit), format_in(p.needed_bytes, unit),
         _yes(p.fits), format_in(budget - p.needed_bytes, unit) if budget is not None else "-",
         "traced" if p.traced else "fit"]
        for p in s.points
    ]
    against = f" against {run.gpu.budget_label}" if run.gpu.budget_label else ""
    blocks: list = [Table(f"memest whatif {run.model}{against}", headers, rows, left=("how", "fits"))]
    blocks += list(s.plain_words)
    v = s.verification
    if v:
        blocks.append(f"fit checked by a direct trace at batch {v['batch']}, seq {v['seq']}: peak error "
                      f"{100 * v['peak_error']:+.3f}%, needed error {100 * v['needed_error']:+.3f}%")
    if s.fallback:
        blocks.append(f"note: {s.fallback}")
    blocks += largest_lines(s)
    blocks.append("needed: the smallest device budget the step runs in (allocator replay); "
                  + ("peak allocated: tensors only" if run.target == Target.CUDA else "--target cpu: the peak allocated"))
    blocks.append(f"{plural(s.traces, 'trace')} for {plural(len(s.points), 'point')}")
    if run.outputs:
        blocks.append(loop_line(run.outputs))
    doc = {"budget": run.gpu.budget_label, "capacity_bytes": budget, **s.to_dict(), "outputs": run.outputs or None}
    return View(doc, blocks)


def loop_line(outputs: str) -> str:
    """What a planner's traces assume about the user's loop (--outputs)."""
    if outputs == Outputs.KEPT:
        return "loop: outputs kept through backward (the plain loop); --outputs freed if yours drops them first"
    return "loop: outputs freed before backward (HF Trainer, Lightning); --outputs kept for the plain loop"


def largest_lines(s) -> list[str]:
    lines = []
    if s.largest_from == "grid":  # every point traced: the largest traced point that fits, not the boundary
        if s.largest_batch is not None:
            at = f" at seq {s.largest_batch_at_seq}" if s.largest_batch_at_seq is not None else ""
            lines.append(f"largest batch that fits{at}: {s.largest_batch or 'none traced'} (the largest traced that "
                         "fits, from the traced grid: not fitted here; memest max-batch finds the boundary with traces)")
        if s.largest_seq is not None:
            lines.append(f"largest seq that fits at batch {s.largest_seq_at_batch}: {s.largest_seq or 'none traced'} "
                         "(the largest traced that fits, from the traced grid; memest max-batch --seq-search finds the "
                         "boundary)")
        return lines
    if s.largest_batch is not None:
        at = f" at seq {s.largest_batch_at_seq}" if s.largest_batch_at_seq is not None else ""
        lines.append(f"largest batch that fits{at}: {s.largest_batch} (from the fit; memest max-batch confirms "
                     "with traces)")
    if s.largest_seq is not None:
        lines.append(f"largest seq that fits at batch {s.largest_seq_at_batch}: {s.largest_seq} (from the fit)")
    return lines


# ------------------------------------------------------------------------------------- max-batch


def max_batch_view(run) -> View:
    r = run.result
    budget = run.gpu.capacity_bytes
    unit = table_unit([n for _, n, _ in r.probes] + [budget])
    rows = [[str(v), format_in(n, unit), _yes(ok), format_in(budget - n, unit)] for v, n, ok in sorted(set(r.probes))]
    blocks: list = [Table(f"memest max-batch {run.model} against {run.gpu.budget_label}",
                          [r.key, "needed", "fits", "headroom"], rows, left=("fits",))]
    if r.value == 0:
        blocks.append(f"even {r.key} {r.step} does not fit {run.gpu.budget_label}: it needs "
                      f"{format_in(r.next_needed_bytes or 0, unit)}; see memest advise")
    elif r.hit_limit and r.cap.startswith("the model's"):  # the model takes no longer sequence
        blocks.append(f"largest {r.key} that fits: {r.value} ({format_in(r.needed_bytes, unit)}), the longest the model "
                      f"takes: the search stopped at {r.cap}")
    elif r.hit_limit:
        blocks.append(f"largest {r.key} that fits: at least {r.value} (the search stopped at {r.cap or f'--limit {r.limit}'})")
    else:
        blocks.append(f"largest {r.key} that fits: {r.value} ({format_in(r.needed_bytes, unit)}); "
                      f"{r.value + r.step} needs {format_in(r.next_needed_bytes, unit)}"
                      + (f" (--preference grpo: multiples of --generations {r.step})" if r.step > 1 else ""))
    if run.outputs:
        blocks.append(loop_line(run.outputs))
    doc = {"budget": run.gpu.budget_label, "traces": run.traces, **r.to_dict(), "outputs": run.outputs or None}
    return View(doc, blocks)


# ---------------------------------------------------------------------------------------- advise


def advise_view(run) -> View:
    a = run.advice
    unit = table_unit([a.base_needed_bytes, a.capacity_bytes] + [r.needed_bytes for r in a.remedies])
    label = run.gpu.budget_label
    blocks: list = []
    headroom = a.capacity_bytes - a.base_needed_bytes
    if a.base_fits:
        blocks.append(f"as configured: needs {format_in(a.base_needed_bytes, unit)} of {label}: fits, with "
                      f"{format_in(headroom, unit)} headroom; no change needed. The savers below, each re-traced, "
                      "show what more headroom would cost.")
    else:
        blocks.append(f"as configured: needs {format_in(a.base_needed_bytes, unit)} of {label}: does not fit "
                      f"({format_in(-headroom, unit)} over)")
    lowering = [r for r in a.remedies if r.lowers_need]
    other = [r for r in a.remedies if not r.lowers_need]
    if lowering:
        title = ("memory savers, each re-traced" + ("" if a.base_fits else ", cheapest first among those that fit"))
        rows = [[r.name, format_in(r.needed_bytes, unit), format_in(a.base_needed_bytes - r.needed_bytes, unit),
                 _yes(r.fits), r.time_cost] for r in lowering]
        blocks.append(Table(title, ["remedy", "needed", "saves", "fits", "time cost"], rows,
                            left=("remedy", "fits", "time cost")))
    if other:
        rows = [[r.name, format_in(r.needed_bytes, unit), format_in(r.needed_bytes - a.base_needed_bytes, unit),
                 r.note] for r in other]
        blocks.append(Table("do not lower the need here (not remedies for this step)",
                            ["change", "needed", "adds", "why"], rows, left=("change", "why")))
    if not a.base_fits:
        if a.combination is None:
            blocks.append("no combination of these remedies fits; a larger GPU or more GPUs are needed")
        else:
            blocks.append(f"cheapest that fits: {a.combination.name} ({format_in(a.combination.needed_bytes, unit)})")
            blocks.append(f"  {a.command}")
    if a.parallel:
        blocks.append(_parallel_line(a.parallel))
    blocks += [f"skipped {s['name']}: its trace fails on this step: {s['reason']}" for s in a.skipped]
    blocks += [f"not offered: {s['name']}: {s['reason']}" for s in a.not_offered]
    blocks.append(plural(a.traces, "trace"))
    doc = {"budget": label, "headroom_bytes": headroom, **a.to_dict()}
    return View(doc, blocks)


def _parallel_line(parallel: dict) -> str:
    """advise --gpus: where its layouts come from."""
    if parallel.get("error"):
        return f"no layouts of {plural(parallel['gpus'], 'GPU')}: {parallel['error']}"
    line = (f"layouts of {plural(parallel['gpus'], 'GPU')} from plan-parallel's planner ({plural(parallel['traces'], 'trace')} of the model cut "
            f"in depth, {parallel['seconds']:.0f} s)")
    c = parallel.get("check")
    if c:
        line += f"; its extrapolation checked on {c['layout']}: peak {100 * c['error']:+.2f}%, needed {100 * c['needed_error']:+.2f}%"
    return line


def plan_parallel_view(run) -> View:
    p = run.plan
    unit = table_unit([p.budget_bytes] + [lay.needed_bytes for lay in p.layouts if not lay.error])
    rows = []
    for lay in p.layouts:
        if lay.error:  # its trace fails (the whole error in --json)
            rows.append([lay.name, "-", format_bytes(lay.comm_bytes), "not traceable", lay.reason or lay.error])
            continue
        need = (">= " if lay.lower_bound or not lay.traced else "") + format_in(lay.needed_bytes, unit) if lay.needed_bytes else "-"
        # "not-traced" with no need: the search stopped before it (a bounded layout has its lower bound)
        verdict = "not searched" if lay.verdict == "not-traced" else lay.verdict
        rows.append([lay.name, need, format_bytes(lay.comm_bytes), verdict, lay.derived_from])
    blocks: list = [Table(f"{p.model} on {plural(p.gpus, 'GPU')} of {run.gpu.budget_label}: per-rank need, fitting layouts first "
                          "(least communication first)", ["layout", "needed per rank", "sent per rank per step", "verdict",
                                                          "how"], rows, left=("layout", "verdict", "how"))]

    base = RunSpec(**p.base)
    commands = [lay.command(base, gpu=run.gpu.flag, calibration=run.calibration) for lay in p.layouts]
    best = next((i for i, lay in enumerate(p.layouts) if lay.fits and not lay.error), None)
    if best is None:
        blocks.append("no layout searched fits")
    else:
        blocks.append(f"best: {p.layouts[best].name}\n  {commands[best]}")
    if p.check:
        c = p.check
        where = f"{c['depth_per_stage']} layers per stage" + (f", {c['microbatches']} micro-batches" if c["microbatches"] else "")
        blocks.append(f"extrapolation checked on {c['layout']} (stage {c['stage']}) at {where}: peak predicted "
                      f"{format_bytes(c['predicted_peak_bytes'])}, traced {format_bytes(c['traced_peak_bytes'])} "
                      f"({100 * c['error']:+.2f}%); needed predicted {format_bytes(c['predicted_needed_bytes'])}, traced "
                      f"{format_bytes(c['traced_needed_bytes'])} ({100 * c['needed_error']:+.2f}%)")
    blocks += [f"note: {n}" for n in p.notes]
    blocks.append(f"planned in {p.seconds:.1f} s ({plural(p.traces, 'trace')})")
    doc = {"budget": run.gpu.budget_label, **p.to_dict()}
    for layout, command in zip(doc["layouts"], commands, strict=True):
        layout["command"] = command
    return View(doc, blocks)


# ---------------------------------------------------------------------------------- gpus, calibrate


def gpus_view(query) -> View:
    doc = {"gpus": [g.to_dict() for g in query.gpus], "reason": query.reason}
    if not query.gpus:
        return View(doc, [query.reason])
    unit = table_unit([g.total_bytes for g in query.gpus])
    rows = [
        [str(g.index), g.name, format_in(g.total_bytes, unit), format_in(g.used_bytes, unit),
         format_in(g.free_bytes, unit), f"{g.utilization}%" if g.utilization is not None else "-",
         ", ".join(f"{p.command}[{p.pid}] {format_bytes(p.used_bytes)}" for p in g.processes) or "-"]
        for g in query.gpus
    ]
    headers = ["index", "name", "total", "used", "free", "util", "processes"]
    return View(doc, [Table("NVIDIA GPUs", headers, rows, left=("name", "processes"))])


def calibrate_view(run) -> View:
    e = run.entry

    def size(key: str) -> str:
        return format_bytes(e[key]) if e.get(key) is not None else "not measured"

    lines = [
        f"{e['gpu_name']} (driver {e['driver']}, CUDA {e.get('cuda_version')}, torch {e['torch_version']}, "
        f"{e.get('module_loading', 'lazy')} loading), outside the caching allocator:",
        f"  CUDA context       {size('context_bytes')}",
        f"  cuBLAS/cuBLASLt    {size('cublas_library_bytes')}",
        f"  cuDNN              {size('cudnn_library_bytes')}",
        f"  NCCL               {size('nccl_library_bytes')}",
        f"  cuBLAS workspace   {size('cublas_workspace_bytes')} (inside the allocator)",
        f"saved to {run.path}",
    ]
    if run.profile_path is not None:
        lines.append(f"profile written to {run.profile_path}: use it anywhere with --calibration {run.profile_path}")
    doc = {"saved_to": str(run.path), "profile": str(run.profile_path) if run.profile_path else None, **e}
    return View(doc, lines)




# ----------------------------------------------------------------------------------------- serve


SERVE_VERDICT = {ServeVerdict.STARTS: "STARTS (one full-length sequence fits even with every cost at the high end of "
                 "its range)", ServeVerdict.MAY_NOT_START: "MAY NOT START (one full-length sequence fits only with the "
                 "expected or low-end costs)", ServeVerdict.WILL_NOT_START: "WILL NOT START"}


def serve_doc(plan) -> dict:
    """The JSON document of a serve plan (serve/engine.py ServePlan; bytes as integers)."""
    s = plan.spec
    engine = plan.engine
    doc = {
        "engine": s.engine, "model": s.model, "total_bytes": s.total_bytes, "gpu": s.card,
        "settings": {"max_model_len": plan.max_model_len, "utilization": plan.utilization,
                     "utilization_source": plan.utilization_source, "tp": s.tp, "kv_dtype": s.kv_dtype,
                     "dtype": plan.kv.dtype if s.kv_dtype == KvDtype.AUTO else None, "block_size": s.block_size,
                     "max_num_seqs": plan.max_num_seqs or None, "max_num_batched_tokens": plan.max_num_batched_tokens or None,
                     "batching_source": plan.batching_source or None, "cuda_graphs": s.cuda_graphs},
        "kv": plan.kv.to_dict(), "kv_bytes_per_token": plan.kv.bytes_per_token, "weights": plan.weights.to_dict(),
        "profile_run": plan.profile.to_dict() if plan.profile else None,
        "context": plan.context.to_dict() if plan.context else None,
        "verdict": plan.verdict, "starts": plan.starts, "reasons": plan.reasons, "fixes": plan.fixes,
        "larger_gpu": plan.larger_gpu,
        "longest_context": plan.longest_context, "notes": plan.notes, "seconds": round(plan.seconds, 3),
        "non_torch": plan.non_torch.to_dict() if plan.non_torch else None,
        "non_torch_calibrated": bool(plan.spec.non_torch is not None),
    }
    low, mid, high = engine.sizes()
    kv = engine.kv_cache
    doc.update(budget=engine.budget.to_dict(), kv_cache_bytes=kv.bytes, kv_cache_bytes_low=kv.low,
               kv_cache_bytes_high=kv.high, blocks=mid.blocks, kv_tokens=mid.tokens, kv_tokens_low=low.tokens,
               kv_tokens_high=high.tokens, concurrency=mid.concurrency, sequences=mid.sequences,
               concurrency_low=low.concurrency, concurrency_high=high.concurrency, sequences_low=low.sequences,
               sequences_high=high.sequences, longest_context_low=plan.longest_context_low,
               longest_context_high=plan.longest_context_high)
    return doc


def serve_view(run) -> View:
    p = run.plan
    doc = {**serve_doc(p), "total_source": run.total_source, "gpu_arch": {"arch": run.gpu.arch, "why": run.gpu.arch_reason}}
    if run.colocate is not None:
        doc["colocate"] = run.colocate.to_dict()
    unit = ("GiB", 2**30)
    table, sources = serve_budget_table(p, run, unit)
    blocks: list = [table] + sources
    blocks += serve_lines(p, unit)
    if run.colocate is not None:
        blocks += colocate_lines(run.colocate, unit)
    return View(doc, blocks)


def _range(low: int, high: int, unit) -> str:
    return "-" if low == high else f"{format_in(low, unit)}-{format_in(high, unit)}"


def serve_budget_table(p, run, unit) -> tuple[Table, list[str]]:
    """The engine's budget steps from the GPU's total to the KV cache; each step's source is a short reference in
    the table ([1], [2], ...) and a line under it, so the table stays a few lines wide and long (the JSON document
    has every source in its budget)."""
    s = p.spec
    title = f"memest serve {s.model} on {run.gpu.budget_label} ({s.engine}, tp {s.tp})"
    a = p.engine.kv_cache
    steps = [("GPU total", s.total_bytes, "-", run.total_source)]
    steps += [(x.name, x.bytes, _range(x.low, x.high, unit), x.source) for x in p.engine.steps()]
    steps.append(("= KV cache", a.bytes, _range(a.low, a.high, unit), a.source))
    refs: dict[str, int] = {}
    rows = []
    for name, value, spread, source in steps:
        ref = refs.setdefault(source, len(refs) + 1)
        rows.append([name, format_in(value, unit), spread, f"[{ref}]"])
    return (Table(title, ["step", "GiB", "range", "source"], rows, left=("step", "source")),
            [f"[{n}] {source}" for source, n in refs.items()])


def serve_lines(p, unit) -> list[str]:
    kv = p.kv
    lines = [f"KV per token: {kv.bytes_per_token:,} B over {len(kv.layers)} layers ({kv.dtype}"
             + (f", {', '.join(f'{n} {k}' for k, n in kv.kinds.items())}" if len(kv.kinds) > 1 else "") + ")"]
    lines += p.engine.capacity_lines()
    nt = p.non_torch
    if nt is not None:
        lines.append(f"non-torch memory: {format_in(nt.bytes, unit)}"
                     + (f" ({format_in(nt.low, unit)}-{format_in(nt.high, unit)})" if nt.low != nt.high else "")
                     + f", {nt.source.split(':')[0]}")
    lines.append(f"longest context one sequence fits: {p.longest_context:,} tokens ({p.longest_context_low:,} for "
                 f"certain, up to {p.longest_context_high:,})")
    lines.append(f"verdict: {SERVE_VERDICT[p.verdict]}")
    lines += [f"  why: {r}" for r in p.reasons]
    lines += [f"  fix: {f}" for f in p.fixes]
    if p.larger_gpu:
        lines.append(f"  on a larger GPU: --gpu {p.larger_gpu} starts with these settings (re-planned with its "
                     "compute capability and vLLM's defaults for it)")
    lines += [f"note: {n}" for n in p.notes]
    return lines


def colocate_lines(c, unit) -> list[str]:
    high = "unbounded" if c.training_bytes_high is None else format_in(c.training_bytes_high, unit)
    lines = [f"colocate (trl GRPO vllm_mode='colocate') on {format_in(c.total_bytes, unit)}: training step needs "
             f"{format_in(c.training_bytes, unit)} (high {high}) + rollout engine {c.utilization:g} x total = "
             f"{format_in(c.engine_bytes, unit)} -> {VERDICT_TEXT.get(c.verdict, c.verdict)} "
             f"(headroom {format_in(c.headroom_bytes, unit)})"]
    lines.append((f"largest utilization that still fits: {c.largest_utilization:.2f}" if c.largest_utilization > 0 else
                  "no utilization leaves room for the training step")
                 + f"; the engine starts from {c.smallest_utilization:.2f} (one {c.max_model_len}-token sequence)")
    lines += [f"note: {n}" for n in c.notes]
    return lines


__all__ = ["estimate_view", "check_view", "whatif_view", "max_batch_view", "advise_view", "gpus_view",
           "calibrate_view", "serve_view"]
