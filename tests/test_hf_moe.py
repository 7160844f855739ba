"""Mixture-of-experts models from transformers (its experts interface, default ``grouped_mm``), traced on
fake tensors against the same step run for real on CPU; and the kernel transformers picks on CUDA.

Tiny configs (tests/configs/*-tiny.json) are built from each family's config class: Mixtral (8 experts,
top 2), Qwen2-MoE (with a shared expert), OLMoE, Qwen3-MoE and DeepSeek-V3 (group-limited routing, a
shared expert, a first dense layer). Batch 4 x 64 tokens: 512 (token, expert) pairs per layer."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.sources.hf_experts import grouped_mm_on_cuda
from memest.spec import RunSpec
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.02  # as tests/test_accuracy_cpu.py
FAMILIES = ["mixtral-tiny", "qwen2-moe-tiny", "olmoe-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny"]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
@pytest.mark.parametrize("name", FAMILIES)
def test_moe_estimate_matches_real_cpu_peak(name, precision):
    ref = model_ref(f"hf:{name}")
    spec = RunSpec(model=ref, batch=4, seq=64, optim="adamw", precision=precision, target="cpu")
    source = load_source(ref)
    trace = trace_step(source, spec)
    estimated, _ = trace.peak()
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{name} {precision}: estimated {estimated} B, measured {real} B ({100 * error:+.2f}%)"
    # the experts ran as grouped matmuls (forward: up and down per MoE layer, backward: their gradients)
    assert any(rec.op.startswith("_grouped_mm") for rec in trace.storages)


@pytest.mark.parametrize("capability,op", [((9, 0), "_grouped_mm"), ((8, 0), "_grouped_mm"), ((7, 5), "grouped_mm_fallback")])
def test_target_cuda_takes_the_kernel_transformers_takes_on_that_gpu(capability, op):
    """transformers/integrations/moe.py, _can_use_grouped_mm: torch's grouped_mm on sm80+, else its own
    loop over experts (transformers::grouped_mm_fallback)."""
    ref = model_ref("hf:mixtral-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, precision="bf16-mixed", target="cuda", compute_capability=capability)
    trace = trace_step(load_source(ref), spec)
    ops = {rec.op.split(".")[0] for rec in trace.storages}
    assert op in ops
    assert ("grouped_mm_fallback" in ops) == (not grouped_mm_on_cuda(capability))


def test_cpu_trace_takes_torchs_grouped_mm_and_leaves_transformers_as_it_was():
    from transformers.integrations import moe

    before = moe._can_use_grouped_mm
    ref = model_ref("hf:mixtral-tiny")
    trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cuda", compute_capability=(7, 0)))
    assert moe._can_use_grouped_mm is before


def test_eager_experts_are_refused_with_the_config_key_to_drop(tmp_path):
    """experts_implementation "eager" loops over the experts the router hit (nonzero): routing-dependent
    buffers, which fake tensors cannot size. The message names the key, not the user's forward."""
    raw = json.loads(Path(model_ref("hf:mixtral-tiny")[3:]).read_text())
    raw["experts_implementation"] = "eager"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(TraceError) as info:
        trace_step(load_source(f"hf:{path}"), RunSpec(model=f"hf:{path}", batch=1, seq=16, target="cpu"))
    message = str(info.value)
    assert 'experts_implementation "eager"' in message and "drop that key" in message
    assert "example_inputs" not in message and "make the forward value-free" not in message


def test_bundled_moe_trace_from_the_cli():
    result = CliRunner().invoke(
        app, ["estimate", "hf:qwen3-30b-a3b", "--batch", "1", "--seq", "128", "--precision", "bf16-mixed", "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["param_count"] == 30_532_122_624
    assert doc["breakdown_at_peak"]["optimizer_state"] >= 2 * 4 * doc["param_count"]  # Adam: 2 fp32 states
