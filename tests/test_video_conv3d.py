"""A video model nobody here wrote, whole steps against the same steps run for real on CPU (torch.profiler memory
events, validate/cpu_truth.py): transformers' VideoMAE (tests/models/videomae_tiny.py). Its tubelet embedding is a
Conv3d, priced by oneDNN's 5d rules (targets/cpu/onednn_conv.py; before them the estimate read -40.5% / -48.0% on
these two steps, measured 2026-11-29), and it keeps its sinusoid position table as a plain tensor attribute, held
before the step like a buffer (trace/step.py tensor_attributes; before, the trace recorded it as a temporary made
by its first ``detach`` and the real step's baseline left it out: +24,576 B)."""

import pytest

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category

from .conftest import model_ref, real_cpu_peak

VIDEOMAE = "videomae_tiny"


@pytest.mark.parametrize("kw", [dict(batch=2, optim="adamw"), dict(batch=4, optim="sgd")], ids=["adamw-b2", "sgd-b4"])
def test_videomae_step_equals_real_cpu_peak(kw):
    spec = RunSpec(model=model_ref(VIDEOMAE), target="cpu", precision="fp32", **kw)
    source = load_source(spec.model)
    estimated, real = trace_step(source, spec).peak()[0], real_cpu_peak(source, spec)
    assert estimated == real, f"estimated {estimated} B, measured {real} B ({estimated - real:+d} B)"


def test_tensor_attribute_is_model_state_before_the_step():
    """The table is recorded once, before the step, as the embeddings' model state; each forward's copy of it
    (``.to(device, copy=True)``) is a temporary of that forward."""
    spec = RunSpec(model=model_ref(VIDEOMAE), target="cpu", precision="fp32", batch=1, optim="sgd")
    trace = trace_step(load_source(spec.model), spec)
    table = 64 * 96 * 4  # (1, 64 tubelets, hidden 96) float32
    held = [r for r in trace.storages if r.op == "tensor attribute"]
    assert [(r.nbytes, r.category, r.module) for r in held] == [(table, Category.BUFFERS, "videomae.embeddings")]
    copies = [r for r in trace.storages if r.nbytes == table and r.op.startswith("_to_copy")]
    assert len(copies) == spec.iterations and all(r.category is Category.TEMPORARIES for r in copies)
