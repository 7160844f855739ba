"""torch.compile (features/compiled.py): a model file that returns ``torch.compile(model)`` (nanoGPT's default) and
``--compile`` on an eager model file, traced on fake tensors and compared with the same compiled loop run for real on
CPU (validate/cpu_truth.py runs the identical loop through the real ``torch.compile``: Inductor generates and
compiles its C++ kernels with gcc). Tolerance: 2% of the true peak, as the other accuracy tests; measured: exact.

The real compiled runs take seconds each (Inductor's compile; its on-disk cache makes repeated runs faster), so
each (model, loop) is run once for the whole file."""

import functools
import json

import pytest
import torch
from typer.testing import CliRunner

from memest.cli import app
from memest.errors import MemestError, TraceError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace.events import Category
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

REL_TOL = 0.02

# (model, batch, seq, optimizer, compile): nanogpt_compiled returns torch.compile(GPT()) as nanoGPT's train.py does;
# gelu_mlp is an eager file compiled by --compile
CASES = [
    ("nanogpt_compiled", 4, 64, "adamw", None),
    ("gelu_mlp", 1024, None, "sgd", True),
]
EAGER = {"nanogpt_compiled": ("nanogpt", None), "gelu_mlp": ("gelu_mlp", None)}


@functools.cache
def _traced_and_real(name, batch, seq, optim, compile, outputs="kept", budget=None):
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=batch, seq=seq, optim=optim, target="cpu", outputs=outputs, compile=compile)
    source = load_source(ref)
    patch = torch._functorch.config.patch(activation_memory_budget=budget) if budget else _nothing()
    with patch:
        trace = trace_step(source, spec)
        real = measure_cpu_peak(source, spec)["peak_bytes"]
    return trace, real


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _assert_close(what, estimated, real):
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{what}: estimated {estimated} B, measured {real} B ({100 * error:+.2f}%)"


def _saved_bytes(trace) -> int:
    """Bytes the first step's forward saves for backward."""
    return sum(r.nbytes for r in trace.storages if r.category is Category.ACTIVATIONS and r.iteration == 1)


@pytest.mark.parametrize("outputs", ["kept", "freed"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_compiled_step_matches_the_same_compiled_loop_run_for_real(case, outputs):
    trace, real = _traced_and_real(*case, outputs=outputs)
    assert any("compiled step (torch.compile, Inductor" in n for n in trace.notes), trace.notes
    _assert_close(f"{case[0]} compiled, {outputs}", trace.peak()[0], real)


def test_a_module_compiled_in_place_is_the_compiled_step():
    """``model.compile()`` (nn.Module.compile: __call__ compiled in place) traces as torch.compile(model) does."""
    trace, real = _traced_and_real("gelu_mlp:build_compiled_in_place", 1024, None, "sgd", None)
    assert any("by the model file (model.compile())" in n for n in trace.notes), trace.notes
    _assert_close("gelu_mlp, model.compile()", trace.peak()[0], real)


def test_compiled_and_eager_steps_differ_as_the_real_ones_do():
    """nanoGPT: the compiled step saves other tensors (AOTAutograd's partition: Inductor recomputes pointwise ops,
    fuses the loss's backward) and peaks lower; the eager trace of the same file (--no-compile) would read high
    against the real compiled run. Both traces differ by what the two real runs differ by."""
    name, batch, seq, optim, _ = CASES[0]
    compiled, real_compiled = _traced_and_real(*CASES[0])
    eager, real_eager = _traced_and_real(name, batch, seq, optim, False)
    assert any("traced eager, as --no-compile asks" in n for n in eager.notes)
    assert real_compiled < real_eager  # measured: 5,483,132 B vs 5,992,056 B (-8.5%)
    assert compiled.peak()[0] - eager.peak()[0] == pytest.approx(real_compiled - real_eager, rel=0.01)
    assert _saved_bytes(compiled) != _saved_bytes(eager)


def test_activation_memory_budget_is_honoured():
    """torch._functorch.config.activation_memory_budget: 0.5 makes the partitioner recompute half of what it
    saves; the trace and the real run read it from the same config (measured on gelu_mlp: -21% peak, exact)."""
    full, real_full = _traced_and_real(*CASES[1])
    half, real_half = _traced_and_real(*CASES[1], budget=0.5)
    _assert_close("gelu_mlp, activation_memory_budget 0.5", half.peak()[0], real_half)
    assert real_half < real_full
    assert _saved_bytes(half) < _saved_bytes(full) / 1.5
    assert any("activation_memory_budget 0.5" in n for n in half.notes)


def test_other_backends_run_their_own_partition():
    """backend="aot_eager_decomp_partition" (Inductor's decompositions and partitioner, graphs run op by op): traced
    through the same backend; its unfused temporaries make it read above Inductor's real step (nanoGPT +19%)."""
    ref = model_ref("nanogpt_compiled:build_decomp_partition")
    spec = RunSpec(model=ref, batch=4, seq=64, optim="adamw", target="cpu")
    source = load_source(ref)
    trace = trace_step(source, spec)
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    _assert_close("nanogpt, aot_eager_decomp_partition", trace.peak()[0], real)
    assert any("backend 'aot_eager_decomp_partition'" in n for n in trace.notes)


def test_the_trace_leaves_torch_as_it_found_it():
    """Dynamo reset, Inductor's kernel compiler, the wrapper's allocators and the module hooks restored, whether
    the compiled step ends well or raises."""
    from torch._inductor.async_compile import AsyncCompile
    from torch.nn.modules import module as nn_module

    before = (AsyncCompile.cpp_pybinding, torch._C._dynamo.guards._empty_strided_cpu,
              torch._C._dynamo.guards._reinterpret_tensor, dict(nn_module._global_forward_pre_hooks))
    spec = RunSpec(model="gelu_mlp", batch=8, optim="sgd", target="cpu", compile=True)
    trace_step(load_source(model_ref("gelu_mlp")), spec)
    with pytest.raises(TraceError, match="forward"):
        trace_step(load_source(model_ref("wrong_shape")), RunSpec(model="wrong_shape", batch=2, target="cpu",
                                                                   compile=True))
    after = (AsyncCompile.cpp_pybinding, torch._C._dynamo.guards._empty_strided_cpu,
             torch._C._dynamo.guards._reinterpret_tensor, dict(nn_module._global_forward_pre_hooks))
    assert after == before


def test_compile_flag_cli_yaml_and_api(tmp_path):
    path = model_ref("gelu_mlp")
    result = CliRunner().invoke(app, ["estimate", path, "--batch", "8", "--optim", "sgd", "--target", "cpu",
                                      "--compile", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["spec"]["compile"] is True
    assert any("compiled step (torch.compile, Inductor, by --compile)" in n for n in doc["notes"])
    from memest.spec.config import load_config

    config = tmp_path / "run.yaml"
    config.write_text(f"model: {path}\nbatch: 8\ncompile: false\n")
    assert load_config(config).spec().compile is False
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"model: {path}\ncompile: yes please\n")
    result = CliRunner().invoke(app, ["check", str(bad)])
    assert result.exit_code == 2 and "compile: expected true or false" in result.output
    import memest

    # compile= reaches the RunSpec; the API's error names its keywords (issue 22 item 27)
    with pytest.raises(MemestError, match="compile=True with world_size:"):
        memest.estimate(path, compile=True, world_size=2)


def test_what_is_not_modelled_is_refused_with_the_way_out():
    with pytest.raises(MemestError, match="--compile with --world-size"):
        RunSpec(model="m.py", compile=True, world_size=2)
    with pytest.raises(MemestError, match="--compile with --mode generate"):
        RunSpec(model="m.py", compile=True, mode="generate", new_tokens=4)
    # torch.utils.checkpoint inside torch.compile saves the real RNG state (run_and_save_rng_state): refused
    spec = RunSpec(model="gelu_mlp", batch=8, optim="sgd", target="cpu", compile=True, checkpointing="0,2")
    with pytest.raises(TraceError, match="--checkpointing 0,2 on a compiled step.*--no-compile"):
        trace_step(load_source(model_ref("gelu_mlp")), spec)
    spec = RunSpec(model="nanogpt_compiled", batch=2, seq=16, target="cpu", world_size=2)
    with pytest.raises(TraceError, match="compiles the whole model.*--world-size.*--no-compile.*--compile-scope blocks"):
        trace_step(load_source(model_ref("nanogpt_compiled")), spec)
