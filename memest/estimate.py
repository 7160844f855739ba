"""The estimate pipeline: spec -> source -> trace -> report. Library code: returns data, prints nothing."""

from __future__ import annotations

import time

from .report.analysis import Report, analyse
from .sources import load_source
from .spec import RunSpec
from .trace.step import trace_step


def estimate(spec: RunSpec) -> Report:
    source = load_source(spec.model)
    start = time.perf_counter()
    trace = trace_step(source, spec)
    report = analyse(trace, spec, source.name)
    report.trace_seconds = time.perf_counter() - start
    report.notes.append(
        "peak allocated = tensor bytes alive at once; the device also holds the CUDA context, library "
        "workspaces and the caching allocator's slack, which this version does not add"
        if spec.target == "cuda"
        else "peak allocated = bytes held by the CPU allocator at the step's peak"
    )
    if spec.mixed:
        note = "mixed precision traced with CPU autocast op lists"
        if spec.target == "cuda":
            note += " (CUDA's lists differ for a few ops)"
        report.notes.append(note)
    return report
