"""CPU ground truth (design.md §3): run the step for real on CPU under torch.profiler with memory
events and take the true peak of the CPU allocator.

The model code runs under trace/devices.py's ``traced_device``, as in the trace: its CUDA requests
(``.cuda()``, ``device="cuda"``) become the CPU, for real tensors here, so a model file written for a
GPU runs on this CPU as the step the trace describes (without it, ``.cuda()`` fails on a CPU-only torch)."""

from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

from memest.features.compiled import dynamo_session
from memest.features.registry import build, run_step, step_optimizer
from memest.sources.base import ModelSource
from memest.spec import RunSpec
from memest.spec.choices import Target
from memest.targets.cpu import onednn_half_matmul
from memest.trace.devices import traced_device
from memest.trace.step import LoopState, tensor_attributes


def _allocation_events(prof) -> list:
    alloc_tag = torch._C._profiler._EventType.Allocation
    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.tag == alloc_tag and e.extra_fields.device.type == torch.device("cpu").type:
            out.append(e)
        stack.extend(e.children)
    out.sort(key=lambda e: e.start_time_ns)
    return out


HALF_MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"})


def onednn_half_matmuls(prof) -> int:
    """The profiled step's bf16/fp16 matmul calls where this CPU runs them through oneDNN
    (targets/cpu.onednn_half_matmul): kernels whose reorders and scratchpads memest does not model, so a byte-exact
    comparison of such a step is not claimed (the trace's note says so). 0 elsewhere. Needs ``record_shapes``."""
    if not onednn_half_matmul():
        return 0
    # the raw event tree, as _allocation_events walks it: prof.events() would build every op's FunctionEvent
    # (0.4 s of a tiny Llama's 1.9 s measurement, measured 2026-11-29), for the names and input dtypes only
    op_tag, half, calls = torch._C._profiler._EventType.TorchOp, (torch.bfloat16, torch.float16), 0
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == op_tag and e.name in HALF_MATMULS:
            calls += any(getattr(i, "dtype", None) in half for i in e.extra_fields.inputs)
    return calls


def _holders(t: torch.Tensor):
    """``t``, or the inner tensors that hold a wrapper subclass's memory (``__tensor_flatten__``'s; torchao's
    MXFP8 weight wrapper owns no storage of its own)."""
    if is_traceable_wrapper_subclass(t):
        for name in t.__tensor_flatten__()[0]:
            yield from _holders(getattr(t, name))
    else:
        yield t


def held_before_step(model, inputs, params=None) -> list:
    """What exists before the profiled step, counted in its peak: ``params`` (the model's parameters by default),
    buffers, plain tensor attributes (trace/step.py ``tensor_attributes``), inputs."""
    params = list(model.parameters()) if params is None else list(params)
    return params + list(model.buffers()) + [t for _, t in tensor_attributes(model)] + tree_flatten(inputs)[0]


def _distinct_storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in (h for x in tensors if isinstance(x, torch.Tensor) for h in _holders(x)):
        st = t.untyped_storage()
        if st.data_ptr() in seen or st.nbytes() == 0:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total


def measure_cpu_peak(source: ModelSource, spec: RunSpec, seed: int = 0) -> dict:
    """Peak bytes of the real step (parameters, buffers, plain tensor attributes and inputs included) and the op
    that made it."""
    assert spec.target == Target.CPU, "CPU ground truth is for --target cpu estimates"
    torch.manual_seed(seed)
    with traced_device():
        return _measure(source, spec)


def _measure(source: ModelSource, spec: RunSpec) -> dict:
    built = build(source, spec)
    model, inputs = built.model, built.inputs
    runnable = built.runnable  # torch.compile'd (the model file's own, or --compile): the real compiled step
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = step_optimizer(spec, params)
    baseline = _distinct_storage_bytes(held_before_step(model, inputs))
    with dynamo_session(), profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof:
        loop = LoopState()  # what the user's loop keeps between steps (--outputs kept)
        for _ in range(spec.iterations):
            run_step(runnable, inputs, optimizer, source.compute_loss, spec, loop=loop)
    peak, top = _step_peak(_allocation_events(prof))
    return {"peak_bytes": peak + baseline, "op_at_peak": top.parent.name if top is not None and top.parent is not None else None,
            "onednn_half_matmuls": onednn_half_matmuls(prof)}


def _step_peak(events) -> tuple[int, object]:
    """The most bytes the step's own allocations hold at once, and the event that reached it.

    Only blocks allocated inside the profiled window count, and only their frees: a block from before it
    (garbage of an earlier run in this process, e.g. an output a compiled frame's state still referenced)
    freed during the step would otherwise lower the running total the allocator reports (its
    ``total_allocated`` counts every block it has seen while any profiler ran) and hide that many bytes
    of the step's peak (benchmarks/compile-accuracy.md: 1,024,000 B on a second compiled GPT-2 run)."""
    live: dict[int, int] = {}
    running = peak = 0
    top = None
    for e in events:
        fields = e.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
            running += fields.alloc_size
            if running > peak:
                peak, top = running, e
        elif fields.ptr in live:
            running -= live.pop(fields.ptr)
    return peak, top


def measure_cpu_phase_peaks(source: ModelSource, spec: RunSpec, prefix: str, seed: int = 0) -> dict[str, int]:
    """The real step's peak bytes within each phase of its last iteration, where the step marks a phase's start with
    ``torch.profiler.record_function(prefix + name)`` (features/grpo.py): a phase runs to the next mark or to the
    end of the step; a phase marked several times (once per micro-step) peaks at the highest of its windows. Bytes as
    ``measure_cpu_peak`` counts them (parameters, buffers and inputs included)."""
    assert spec.target == Target.CPU, "CPU ground truth is for --target cpu estimates"
    torch.manual_seed(seed)
    with traced_device():
        built = build(source, spec)
        params = [p for p in built.model.parameters() if p.requires_grad]
        optimizer = step_optimizer(spec, params)
        baseline = _distinct_storage_bytes(held_before_step(built.model, built.inputs))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loop = LoopState()
            for _ in range(spec.iterations):
                run_step(built.runnable, built.inputs, optimizer, source.compute_loss, spec, loop=loop)
    return {name: peak + baseline for name, peak in profiled_phase_peaks(prof, prefix, spec.iterations).items()}


def profiled_phase_peaks(prof, prefix: str, iterations: int, allocator_totals: bool = False) -> dict[str, int]:
    """Each ``prefix``-marked phase's peak bytes in the last of ``iterations`` profiled steps (the last that starts
    with the first phase), above the level the
    profile started at (a step run by other code than memest's build: tests/test_grpo_recipes.py's bitsandbytes).
    ``allocator_totals``: the level read from each event's ``total_allocated`` (the allocator's own count, as
    distributed_truth's whole-step peak reads it) rather than summed from the events' pointers: with gloo's threads
    a free can sort before the allocation it frees (a pointer reused across threads), which the sum would keep."""
    marks, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name.startswith(prefix):
            marks.append((e.start_time_ns, e.name[len(prefix):]))
        stack.extend(e.children)
    marks.sort()
    # the last iteration that starts with the first phase: with --generation-batch a step may not generate (nor
    # mark its first phase), as features/grpo.py's phase_peaks counts the traced ones
    starting = sum(1 for _, name in marks if name == marks[0][1]) if marks else 0
    per_iteration = len(marks) // max(min(iterations, starting), 1)
    last = marks[-per_iteration:] if per_iteration else []
    peaks: dict[str, int] = {}
    live: dict[int, int] = {}
    running, k = 0, -1
    events = _allocation_events(prof)
    start_total = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size if events else 0
    for e in events:
        while k + 1 < len(last) and e.start_time_ns >= last[k + 1][0]:
            k += 1
            # the level the phase starts at; a phase marked again (each micro-step's training step) keeps its max
            peaks[last[k][1]] = max(peaks.get(last[k][1], 0), running)
        fields = e.extra_fields
        if fields.alloc_size > 0:
            live[fields.ptr] = fields.alloc_size
            running += fields.alloc_size
        elif fields.ptr in live:
            running -= live.pop(fields.ptr)
        if allocator_totals:
            running = fields.total_allocated - start_total
        if k >= 0:
            peaks[last[k][1]] = max(peaks[last[k][1]], running)
    return peaks
