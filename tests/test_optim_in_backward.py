"""--optim-in-backward (features/optim_in_backward.py): one optimizer per parameter stepped in its
post-accumulate-grad hook, each gradient freed as its parameter steps. The trace against the same step run for
real on this CPU with the same hooks (validate/cpu_truth.py) and on 2 gloo ranks under FSDP2
(validate/distributed_truth.py); the saving measured, not assumed: the real peak with it is below the real
peak without it.

Residual: AdamW reads 8 to 12 B below the real run with or without the feature (the plain step's own residual:
small scalars the real AdamW.step keeps alive at the peak, an 8 B one made in Optimizer.step and a 4 B
empty_strided, which the trace does not see); SGD matches to the byte."""

import json

import pytest
import torch

from memest.errors import MemestError
from memest.features.optim_in_backward import InBackwardOptimizer
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.config import load_config
from memest.trace import Category
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

RESIDUAL = 16  # B: AdamW's residual of the plain step (module docstring); SGD is exact

# (model, batch, seq): small sequences, where parameters, gradients and state make the step's peak
CASES = [("transformer", 2, 64), ("hf:llama-tiny", 1, 8), ("hf:gpt2-tiny", 1, 8)]
PARAMS = [(case, optim) for case in CASES for optim in ("sgd", "adamw")]


def _spec(name: str, batch: int, seq: int, optim: str, on: bool, **more) -> RunSpec:
    return RunSpec(model=model_ref(name), batch=batch, seq=seq, optim=optim, target="cpu", optim_in_backward=on, **more)


def _traced(spec: RunSpec) -> int:
    return trace_step(load_source(spec.model), spec).peak()[0]


def _real(spec: RunSpec) -> int:
    return measure_cpu_peak(load_source(spec.model), spec)["peak_bytes"]


@pytest.mark.parametrize("case,optim", PARAMS, ids=[f"{c[0].removeprefix('hf:')}-{o}" for c, o in PARAMS])
def test_traced_peak_matches_the_real_step_and_the_saving_is_real(case, optim):
    on, off = _spec(*case, optim, True), _spec(*case, optim, False)
    traced_on, real_on = _traced(on), _real(on)
    traced_off, real_off = _traced(off), _real(off)
    residual = RESIDUAL if optim == "adamw" else 0
    assert abs(traced_on - real_on) <= residual, (traced_on, real_on)
    assert abs(traced_off - real_off) <= residual, (traced_off, real_off)  # the plain step reads the same residual
    assert real_on < real_off, f"measured: {real_on} B with it, {real_off} B without"
    assert traced_on < traced_off


def test_every_gradient_is_classified_and_none_survives_the_step():
    spec = _spec("transformer", 1, 8, "adamw", True)
    trace = trace_step(load_source(spec.model), spec)
    grads = [rec for rec in trace.storages if rec.category is Category.GRADIENTS]
    # each iteration makes a new gradient per parameter (fp32: the parameter's bytes) and frees it in its hook
    assert sum(rec.nbytes for rec in grads) == spec.iterations * trace.param_bytes
    assert any("--optim-in-backward" in note for note in trace.notes)


def test_the_hooks_step_each_parameter_once_and_free_its_gradient():
    """The real wrapper on real tensors: after backward every parameter moved and no gradient is left."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    before = [p.detach().clone() for p in model.parameters()]
    opt = InBackwardOptimizer(model.parameters(), torch.optim.SGD, {"lr": 0.1})
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.remove()
    model(torch.randn(3, 4)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("more,needle", [
    ({"grad_accum": 2}, "--grad-accum 2"),
    ({"mode": "inference"}, "--mode inference"),
    ({"zero_grad": "zeros"}, "--zero-grad zeros"),
    ({"pp": 2, "world_size": 2}, "--pp"),
    ({"compile": True}, "--compile-scope blocks"),  # the whole step compiled (the default scope) stays refused
    ({"world_size": 2}, "--shard zero3"),
    ({"world_size": 2, "shard": "zero2"}, "--shard zero3"),
    ({"world_size": 2, "shard": "zero3", "offload": "params"}, "--offload"),
])
def test_refused_where_it_cannot_apply(more, needle):
    with pytest.raises(MemestError, match="--optim-in-backward") as err:
        RunSpec(model="m.py", optim_in_backward=True, **more)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_cli_flag_and_one_line_refusal():
    from typer.testing import CliRunner

    from memest.cli import app

    runner = CliRunner()
    ref = model_ref("mlp")
    on = runner.invoke(app, ["estimate", ref, "--batch", "4", "--target", "cpu", "--optim-in-backward", "--json"])
    off = runner.invoke(app, ["estimate", ref, "--batch", "4", "--target", "cpu", "--json"])
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert json.loads(on.stdout)["peak_allocated_bytes"] < json.loads(off.stdout)["peak_allocated_bytes"]
    refused = runner.invoke(app, ["estimate", ref, "--optim-in-backward", "--grad-accum", "4"])
    assert refused.exit_code == 2 and "accumulate" in refused.output.strip().splitlines()[0], refused.output


def test_yaml_key_and_api_keyword(tmp_path):
    import memest

    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_ref('mlp')}\nbatch: 4\ntarget: cpu\noptim_in_backward: true\n")
    assert RunSpec(**load_config(path).values).optim_in_backward is True
    on = memest.estimate(model_ref("mlp"), batch=4, target="cpu", optim_in_backward=True)
    off = memest.estimate(model_ref("mlp"), batch=4, target="cpu")
    assert on.peak_allocated_bytes < off.peak_allocated_bytes


# -- FSDP2: the hooks on the sharded parameters, called by FSDP2 after the reduce-scatter --------------------
FSDP_CASES = [("transformer", 1, 8, "adamw"), ("hf:gpt2-tiny", 1, 8, "sgd")]
# B: the plain FSDP step reads 0 to 12 B off; with the hooks gpt2-tiny SGD reads 36 B below: its peak moves into
# backward, where the real rank holds small CPU scalars the trace does not (at the peak: three 8 B blocks with no op,
# an 8 B one from aten::div_, a 4 B empty_strided; listed from the rank's profiler events on 2026-11-27)
FSDP_TOL = 64


def test_fsdp2_ranks_match_real_gloo_runs_and_the_saving_is_real():
    from memest.validate.distributed_truth import measure_distributed_peaks

    specs = [_spec(n, b, s, o, on, world_size=2, shard="zero3") for n, b, s, o in FSDP_CASES for on in (True, False)]
    measured = measure_distributed_peaks(specs)
    for i in range(0, len(specs), 2):
        on, off = specs[i], specs[i + 1]
        traced_on, traced_off = _traced(on), _traced(off)
        ranks_on = lowest_of_runs(on, measured[i], traced=lambda r, t=traced_on: t)
        ranks_off = lowest_of_runs(off, measured[i + 1], traced=lambda r, t=traced_off: t)
        for rank in ranks_on:
            assert abs(traced_on - rank["peak_bytes"]) <= FSDP_TOL, (on.model, traced_on, ranks_on)
        assert max(r["peak_bytes"] for r in ranks_on) < min(r["peak_bytes"] for r in ranks_off), (ranks_on, ranks_off)
        assert traced_on < traced_off


def test_advise_offers_it_with_its_cost_and_a_command_that_reproduces_it():
    from memest.plan.advise import advise
    from memest.plan.runner import Runner

    run = Runner(RunSpec(model=model_ref("mlp"), batch=4, optim="adamw", target="cpu"))
    advice = advise(run, capacity=2**40)  # every saver is traced and listed (no combination is searched)
    (remedy,) = [r for r in advice.remedies if r.changes == {"optim_in_backward": True}]
    assert remedy.lowers_need and remedy.needed_bytes < advice.base_needed_bytes
    assert "0% FLOPs" in remedy.time_cost and "no gradient accumulation" in remedy.time_cost
    assert "--optim-in-backward" in remedy.command
    # with accumulation in the base it cannot apply: not offered, not an error
    accum = Runner(RunSpec(model=model_ref("mlp"), batch=4, optim="adamw", target="cpu", grad_accum=2))
    assert not any("optim_in_backward" in r.changes for r in advise(accum, capacity=2**40).remedies)


COMBINED = [  # (model, batch, seq, optim, more options)
    ("hf:llama-tiny", 1, 8, "adamw", {"lora": "r=8,targets=all-linear"}),  # the peak is not the optimizer's: no saving
    ("transformer", 1, 8, "adam", {"precision": "bf16-mixed"}),
    ("hf:gpt2-tiny", 1, 8, "sgd-momentum", {"checkpointing": "blocks"}),
]


@pytest.mark.parametrize("case", COMBINED, ids=["lora", "bf16-mixed", "checkpointing"])
def test_combined_with_other_savers_the_trace_reads_the_real_step(case):
    name, batch, seq, optim, more = case
    on, off = _spec(name, batch, seq, optim, True, **more), _spec(name, batch, seq, optim, False, **more)
    traced_on, real_on, traced_off, real_off = _traced(on), _real(on), _traced(off), _real(off)
    # the plain step's residual (0 to 112 B on these), unchanged by the feature
    assert traced_on - real_on == traced_off - real_off, (traced_on, real_on, traced_off, real_off)
    assert (traced_on < traced_off) == (real_on < real_off) and traced_on <= traced_off


# -- with --compile-scope blocks: torchtune's ladder ('+ Fuse optimizer step into backward' keeps compile=True, which
# compiles each decoder layer, training.compile_model); the hooks run eager after each compiled block's backward ------
@pytest.mark.parametrize("checkpointing", ["none", "blocks"])
def test_with_compiled_blocks_the_trace_reads_the_real_compiled_step_and_the_saving_is_real(checkpointing):
    """Each llama-tiny block compiled in place (the real run: block.compile(), Inductor's C++ kernels), the
    per-parameter AdamW hooks outside the compiled graphs; the traced peak against the real one, on and off.
    Measured (torch 2.13.0+cpu, 2026-11-27): no checkpointing, on traced 3,496,892 B, real 3,496,968 B (-76 B),
    off 4,047,704 / 4,047,716 B (-12 B); --checkpointing blocks: see the assertion (batch 2, seq 64: 4,860,188 B
    traced and real, on and off, where activations make the peak). Tolerance: the plain compiled step's residual
    (tests/test_compile_blocks.py: up to 512 B, the first step's int64 position_ids kept alive into step 2 by a
    reference cycle with dynamo's state until gc runs) plus AdamW's (RESIDUAL above)."""
    on = _spec("hf:llama-tiny", 1, 8, "adamw", True, checkpointing=checkpointing, compile_scope="blocks")
    off = _spec("hf:llama-tiny", 1, 8, "adamw", False, checkpointing=checkpointing, compile_scope="blocks")
    trace_on = trace_step(load_source(on.model), on)
    assert any("compiled each repeated block" in n for n in trace_on.notes), trace_on.notes
    assert any("--optim-in-backward" in n for n in trace_on.notes), trace_on.notes
    traced_on, real_on, traced_off, real_off = trace_on.peak()[0], _real(on), _traced(off), _real(off)
    assert abs(traced_on - real_on) <= 512 + RESIDUAL, (traced_on, real_on)
    assert abs(traced_off - real_off) <= 512 + RESIDUAL, (traced_off, real_off)
    assert real_on < real_off, f"measured: {real_on} B with it, {real_off} B without"
    assert traced_on < traced_off


def test_advise_offers_it_on_compiled_blocks_not_on_a_whole_compiled_step():
    """advise lists only remedies a spec can take: --compile-scope blocks takes --optim-in-backward (traced above),
    the whole step compiled refuses it (RunSpec's check)."""
    from memest.plan.advise import candidates
    from memest.plan.runner import Runner

    def offered(**more):
        spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=1, seq=8, optim="adamw", target="cpu", **more)
        return any(changes == {"optim_in_backward": True} for _, changes, _ in candidates(Runner(spec)))

    assert offered(compile_scope="blocks")
    assert not offered(compile=True)
    with pytest.raises(MemestError, match="--compile-scope blocks"):
        RunSpec(model=model_ref("hf:llama-tiny"), compile=True, optim_in_backward=True)
