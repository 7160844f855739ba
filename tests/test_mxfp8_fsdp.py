"""--fp8 mxfp8* over FSDP2 ranks (--world-size 2 --shard zero2|zero3, features/mxfp8.py): every gloo rank's real CPU
peak (validate/distributed_truth.py) against memest's traced rank, with torchao's emulated MXFP8 recipe (the one
that runs on a CPU). torchao's weight wrapper carries FSDP2's extension hooks (fsdp_pre_all_gather /
fsdp_post_all_gather: the high-precision shard all-gathered), which FSDP2 runs in the real ranks as in the trace."""

import importlib.util

import pytest

from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels; tests/test_fp8.py runs oneDNN's)
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (memest[fp8])")

# (model, batch, seq, shard, more)
CASES = [
    ("transformer", 2, 64, "zero3", ()),
    ("hf:llama-tiny", 2, 64, "zero2", ()),
    ("hf:llama-tiny", 2, 64, "zero3", (("precision", "bf16-mixed"), ("optim", "adamw"))),
]
PLAIN = ("transformer", 2, 64, "zero3", (("fp8", "none"),))  # the same step without MXFP8: not a no-op


def _spec(name, batch, seq, shard, more=()) -> RunSpec:
    return RunSpec(model=model_ref(name), batch=batch, seq=seq, target="cpu", world_size=2, shard=shard,
                   **{"optim": "sgd", "fp8": "mxfp8-emulated", **dict(more)})


@pytest.fixture(scope="module")
def measured():
    """Every case's ranks, measured once (one set of gloo processes for all of them)."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    cases = [*CASES, PLAIN]
    return dict(zip(cases, measure_distributed_peaks([_spec(*c) for c in cases]), strict=True))


@needs_torchao
@pytest.mark.parametrize("case", CASES, ids=["-".join([c[0].removeprefix("hf:"), c[3], *dict(c[4]).values()])
                                            for c in CASES])
def test_every_gloo_rank_reads_the_traced_peak(case, measured):
    spec = _spec(*case)
    trace = trace_step(load_source(spec.model), spec)
    traced = trace.peak()[0]
    ranks = lowest_of_runs(spec, measured[case], traced=lambda r: traced)
    assert len(ranks) == 2
    for rank in ranks:
        assert rank["peak_bytes"] == traced, (rank["rank"], rank["peak_bytes"], traced)
    assert any("FSDP2 all-gathers each wrapped weight in high precision" in n for n in trace.notes)


PLAIN_RESIDUAL = 12  # B: the plain FSDP2 step's CPU scalars at its peak (tests/test_fp8_fsdp.py's docstring)


@needs_torchao
def test_mxfp8_changes_every_rank_and_the_trace_follows(measured):
    """The real ranks' peak moves with MXFP8 by what the trace's moves, within the plain step's own residual (the
    plain FSDP2 step of this model reads 12 B below its real ranks; the MXFP8 step reads exact, above)."""
    on, off = _spec(*CASES[0]), _spec(*PLAIN)
    real_on = [r["peak_bytes"] for r in measured[CASES[0]]]
    real_off = [r["peak_bytes"] for r in measured[PLAIN]]
    assert real_on != real_off
    delta = trace_step(load_source(on.model), on).peak()[0] - trace_step(load_source(off.model), off).peak()[0]
    for real in (a - b for a, b in zip(real_on, real_off, strict=True)):
        assert 0 <= delta - real <= PLAIN_RESIDUAL, (delta, real)


@needs_torchao
def test_the_sm100_recipe_traces_over_ranks():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=64, target="cuda", compute_capability=(10, 0),
                   world_size=2, shard="zero3", fp8="mxfp8", precision="bf16-mixed")
    trace = trace_step(load_source(spec.model), spec)
    assert trace.world_size == 2 and any(n.startswith("--fp8 mxfp8:") for n in trace.notes)
