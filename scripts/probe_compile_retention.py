"""Why the real compiled transformers GPT-2 step peaks above memest's compiled trace (benchmarks/compile-accuracy.md).

Runs the real compiled step (hf:tests/configs/gpt2-tiny.json, batch 4, seq 64, AdamW, --target cpu, the kept loop)
under torch.profiler memory events, twice in one process as memest/validate/cpu_truth.py does (dynamo reset before
and after each run), after one unprofiled step, and prints:

- the peak from the allocator's running total (``total_allocated``, what cpu_truth used before) and from the blocks
  allocated inside the profiled window only (cpu_truth now), and every logits-sized (batch x seq x vocab x 4 B)
  allocation and free with the profiler's op chain;
- after one step, with the loop's own reference dropped: which tensors of that size are still alive, and the dynamo
  VariableTracker that holds the model output they belong to (its ``source``).

Usage: python scripts/probe_compile_retention.py   (about 3 minutes on 2 cores)
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from memest.features.compiled import dynamo_session  # noqa: E402
from memest.features.registry import build, run_step, step_optimizer  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.trace.devices import traced_device  # noqa: E402
from memest.trace.step import LoopState  # noqa: E402
from memest.validate.cpu_truth import _allocation_events, _distinct_storage_bytes, _step_peak  # noqa: E402

REF = "hf:tests/configs/gpt2-tiny.json"
LOGITS = 4 * 64 * 1000 * 4  # batch x seq x vocab x fp32


def _chain(e) -> str:
    names, p = [], e.parent
    while p is not None and len(names) < 4:
        names.append(p.name)
        p = p.parent
    return " < ".join(names)


def _built(spec):
    source = load_source(REF)
    built = build(source, spec)
    optimizer = step_optimizer(spec, [p for p in built.model.parameters() if p.requires_grad])
    return source, built, optimizer


def profiled_run(label: str) -> None:
    spec = RunSpec(model=REF, batch=4, seq=64, optim="adamw", target="cpu", compile=True)
    torch.manual_seed(0)
    with traced_device():
        source, built, optimizer = _built(spec)
        baseline = _distinct_storage_bytes(list(built.model.parameters()) + list(built.model.buffers()))
        with dynamo_session(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loop = LoopState()
            for _ in range(spec.iterations):
                run_step(built.runnable, built.inputs, optimizer, source.compute_loss, spec, loop=loop)
    events = _allocation_events(prof)
    first = events[0].extra_fields
    totals = max(e.extra_fields.total_allocated for e in events) - (first.total_allocated - first.alloc_size)
    print(f"{label}: peak from the allocator's running total {totals + baseline:,} B; from blocks allocated in the "
          f"window {_step_peak(events)[0] + baseline:,} B")
    t0 = events[0].start_time_ns
    for e in events:
        if abs(e.extra_fields.alloc_size) == LOGITS:
            print(f"   {e.extra_fields.alloc_size:+,} B at {(e.start_time_ns - t0) / 1e6:,.0f} ms: {_chain(e)}")


def _alive_logits() -> list:
    out = []
    for o in gc.get_objects():
        try:
            if type(o) is torch.Tensor and o.untyped_storage().nbytes() == LOGITS:
                out.append(o)
        except ReferenceError:
            pass
    return out


def who_holds_the_output() -> None:
    spec = RunSpec(model=REF, batch=4, seq=64, optim="adamw", target="cpu", compile=True, iterations=1)
    torch.manual_seed(0)
    with traced_device():
        source, built, optimizer = _built(spec)
        with dynamo_session():
            loop = LoopState()
            run_step(built.runnable, built.inputs, optimizer, source.compute_loss, spec, loop=loop)
            output_type = type(loop.output)
            del loop
            print(f"after one step, the loop's output dropped: {len(_alive_logits())} logits-sized tensor(s) alive")
            holders = []
            for o in gc.get_objects():
                try:
                    if type(o).__name__.endswith("DictVariable") and type(o.__dict__.get("value")) is output_type:
                        holders.append(f"{type(o).__name__}(source={o.source})")
                except Exception:  # weak proxies, trackers that compute .value
                    pass
            print(f"   the {output_type.__name__} that holds them is the value of dynamo's {holders}")
            del holders
            print(f"   unreachable objects gc.collect() found: {gc.collect()}; logits-sized tensors alive after it: "
                  f"{len(_alive_logits())} (a reference cycle: freed by the cyclic garbage collector, not by refcount)")
        gc.collect()
        print(f"after torch._dynamo.reset() (dynamo_session's exit) and gc.collect(): {len(_alive_logits())} alive")


if __name__ == "__main__":
    who_holds_the_output()  # first: the first compile of this process
    profiled_run("first profiled run")
    profiled_run("second profiled run")
