"""--sp with torchtitan's loss parallel (its default; --no-loss-parallel: torchtitan's disable_loss_parallel): the
head's logits vocabulary-sharded DTensors and transformers' loss run under torch's loss_parallel(), against the same
step run for real as gloo processes on this CPU (memest/validate/distributed_truth.py runs the same plan and the
same loss_parallel() context: parallel/distributed.py's step_context).

Every rank is compared with the traced peak (the TP ranks hold the same bytes: the vocabulary and heads divide
evenly), within 0.5% (tests/test_model_parallel.py's tolerance and its reason: gloo's worker thread can free a
collective's buffer late on this shared 2-core machine, which only lifts a measurement; such a case is run for real
again and each rank's lowest peak compared, conftest.lowest_of_runs)."""

import json

import pytest

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import CONFIGS, lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.005

# (world size, tp, shard, precision, loss_parallel)
CASES = [
    (2, 2, "none", "bf16-mixed", None),  # the default: torchtitan's loss parallel
    (2, 2, "none", "bf16-mixed", False),  # --no-loss-parallel: the head gathers whole logits
    (2, 2, "none", "fp32", None),
]


def _spec(case, model="hf:llama-tiny", **changes) -> RunSpec:
    world_size, tp, shard, precision, lp = case
    return RunSpec(model=model_ref(model) if model.startswith("hf:") and "/" not in model else model, batch=2, seq=32,
                   optim="adamw", precision=precision, target="cpu", world_size=world_size, tp=tp, sp=True, shard=shard,
                   loss_parallel=lp, **changes)


def _id(case) -> str:
    world_size, tp, shard, precision, lp = case
    return f"ws{world_size}-tp{tp}-sp-{shard}-{precision}-" + ("no-loss-parallel" if lp is False else "loss-parallel")


@pytest.fixture(scope="module")
def measured():
    return dict(zip(CASES, measure_distributed_peaks([_spec(c) for c in CASES]), strict=True))


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_tp_rank_matches_its_real_run(case, measured):
    spec = _spec(case)
    trace = trace_step(load_source(spec.model), spec)
    estimated = trace.peak()[0]
    ranks = measured[case]
    if any(r["peak_bytes"] > estimated * (1 + REL_TOL) for r in ranks):  # lifted by a late free: once more
        ranks = lowest_of_runs(spec, ranks, traced=lambda r: estimated * (1 + REL_TOL))
    for r in ranks:
        error = (estimated - r["peak_bytes"]) / r["peak_bytes"]
        assert abs(error) <= REL_TOL, (
            f"{_id(case)}: traced {estimated} B, rank {r['rank']} measured {r['peak_bytes']} B ({100 * error:+.3f}%); "
            f"all ranks: {[x['peak_bytes'] for x in ranks]}"
        )
    head = "loss parallel: vocabulary-sharded logits" if case[4] is not False else "the head gathers whole logits"
    assert head in trace.parallel


def test_loss_parallel_lowers_the_peak_on_a_big_vocabulary(tmp_path):
    config = json.loads((CONFIGS / "llama-tiny.json").read_text())
    config["vocab_size"] = 32000  # logits dominate: batch 2 x seq 32 x 32000
    path = tmp_path / "llama-tiny-bigvocab.json"
    path.write_text(json.dumps(config))
    peaks = {}
    for lp in (True, False):
        spec = _spec((2, 2, "none", "fp32", lp), model=f"hf:{path}")
        peaks[lp] = trace_step(load_source(spec.model), spec).peak()[0]
    # whole fp32 logits are 2 x 32 x 32000 x 4 B = 8.2 MB per rank without loss parallel; with it each rank holds half
    assert peaks[True] < peaks[False] - 2 * 32 * 32000 * 4 // 2


@pytest.mark.parametrize("changes, match", [
    (dict(sp=False), "transformers' plan"),
    (dict(loss_head="chunked"), "--loss-head"),
    (dict(world_size=4, pp=2), "--pp or --cp"),
])
def test_loss_parallel_where_it_is_not_modelled_is_refused(changes, match):
    base = dict(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", world_size=2, tp=2, sp=True,
                loss_parallel=True)
    with pytest.raises(MemestError, match=match):
        spec = RunSpec(**{**base, **changes})
        trace_step(load_source(spec.model), spec)


def test_the_default_is_off_where_loss_parallel_is_not_modelled():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", world_size=4, pp=2, tp=2, sp=True,
                   shard="none")
    trace = trace_step(load_source(spec.model), spec)
    assert "the head gathers whole logits" in trace.parallel
