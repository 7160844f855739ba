"""--tp / --sp (and FSDP x TP): the traced per-rank peak (--target cpu) against the same step run for real
as N gloo processes on this CPU, each rank measured with torch.profiler memory events
(memest/validate/distributed_truth.py), both parallelised by the same plan (parallel/tensor_parallel.py).
Tolerance: 0.5% of the measured per-rank peak (issue 13).

The ranks hold the same bytes (every dimension divides evenly, so the traced rank stands for each), and
they measure the same except when gloo's worker thread frees a collective's buffer late on this shared
2-core machine (seen on one rank of four, now and then, rank 0 included: +6 to +14%; docs/sharding.md
describes the race). So the traced peak is compared with the lower median of the ranks' measured peaks:
one late-freeing rank of four cannot fail the test, and an estimate low or high on every rank still does.
With two ranks both can be lifted in one launch (seen once in a clean-clone CI run: TP 2 + SP, bf16-mixed, both
ranks +192,000 B, one rank's bf16 vocab-parallel logits; the same case read the trace to the byte in three
other runs). A late free only ever lifts a measurement, so where the ranks read above the trace the case is run
for real again (up to four more runs) and each rank's lowest peak is compared (conftest.lowest_of_runs); a low estimate still fails.
"""

import functools

import pytest

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import Category, Phase
from memest.validate.distributed_truth import measure_distributed_peaks, measure_pipeline_stage_peaks

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.005

# (model, world size, tp, sp, shard, precision)
CASES = {
    2: [
        # transformers' base_model_tp_plan at TP 2 is measured the same way (benchmarks/parallel.md); here
        # TP 2 runs with sequence parallel, and without it inside FSDP x TP 2 x 2 below
        ("hf:llama-tiny", 2, 2, True, "none", "bf16-mixed"),  # torchtitan's plan with sequence parallel
    ],
    4: [
        ("hf:llama-tiny-tp", 4, 4, False, "none", "fp32"),  # TP 4 (4 key/value heads)
        ("hf:llama-tiny-tp", 4, 2, False, "zero3", "fp32"),  # FSDP x TP, 2 x 2 on a 2-D mesh
        ("hf:llama-tiny-tp", 4, 2, True, "zero2", "bf16-mixed"),  # FSDP x TP + SP, mixed precision
    ],
}
PARAMS = [case for cases in CASES.values() for case in cases]


def _spec(case) -> RunSpec:
    name, world_size, tp, sp, shard, precision = case
    return RunSpec(
        model=model_ref(name), batch=2, seq=32, optim="adamw", precision=precision, target="cpu",
        world_size=world_size, tp=tp, sp=sp, shard=shard,
    )


def _id(case) -> str:
    name, world_size, tp, sp, shard, precision = case
    return f"{name.removeprefix('hf:')}-ws{world_size}-tp{tp}" + ("-sp" if sp else "") + f"-{shard}-{precision}"


@pytest.fixture(scope="module")
def measured():
    cache: dict[int, dict] = {}

    def get(case) -> list[dict]:
        world_size = case[1]
        if world_size not in cache:
            cases = CASES[world_size]
            cache[world_size] = dict(zip(cases, measure_distributed_peaks([_spec(c) for c in cases]), strict=True))
        return cache[world_size][case]

    return get


@pytest.mark.parametrize("case", PARAMS, ids=[_id(c) for c in PARAMS])
def test_traced_rank_peak_matches_real_tensor_parallel_run(case, measured):
    spec = _spec(case)
    trace = trace_step(load_source(spec.model), spec)
    estimated = trace.peak()[0]
    ranks = measured(case)
    peaks = sorted(r["peak_bytes"] for r in ranks)
    real = peaks[(len(peaks) - 1) // 2]  # the lower median (see the module's docstring)
    if (estimated - real) / real < -REL_TOL:  # read above the trace: once more (module docstring)
        ranks = lowest_of_runs(spec, ranks)
        peaks = sorted(r["peak_bytes"] for r in ranks)
        real = peaks[(len(peaks) - 1) // 2]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, (
        f"{_id(case)}: traced {estimated} B, ranks' lower median {real} B ({100 * error:+.3f}%); "
        f"all ranks: {[r['peak_bytes'] for r in ranks]}"
    )
    assert f"TP {spec.tp}" in trace.parallel


# -- no real run ---------------------------------------------------------------------------------
def test_tensor_parallel_divides_the_weights_as_the_plan_says():
    """TP 4 on llama-tiny-tp (hidden 64, MLP 128, vocab 512, 2 layers): rank 0 holds a quarter of every
    projection and of the untied head (colwise_gather_output), the whole embedding and the norms."""
    hidden, mlp, vocab, layers = 64, 128, 512, 2
    projections = layers * (4 * hidden * hidden + 3 * hidden * mlp)
    norms = (2 * layers + 1) * hidden
    expected = 4 * (projections // 4 + vocab * hidden + vocab * hidden // 4 + norms)  # fp32
    trace = trace_step(load_source(model_ref("hf:llama-tiny-tp")), _spec(CASES[4][0]))
    held = sum(rec.nbytes for rec in trace.storages if rec.category is Category.PARAMETERS and rec.phase is Phase.SETUP)
    assert held == expected


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"world_size": 3, "tp": 2}, "not a multiple"),
        ({"world_size": 4, "tp": 2}, "add --shard zero3"),
        ({"world_size": 2, "tp": 2, "shard": "zero3"}, "needs data-parallel ranks"),
        ({"sp": True}, "needs --tp 2"),
        ({"world_size": 2, "tp": 2, "mode": "inference"}, "training"),
    ],
)
def test_layouts_that_do_not_exist_are_refused(changes, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:llama-2-7b", **changes)


def test_a_model_without_a_plan_is_refused():
    spec = RunSpec(model=model_ref("hf:gpt2-tiny"), batch=2, seq=32, target="cpu", world_size=2, tp=2)
    with pytest.raises(MemestError, match="no tensor-parallel plan"):
        trace_step(load_source(spec.model), spec)


def test_heads_must_divide():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", world_size=4, tp=4)
    with pytest.raises(MemestError, match="key/value heads"):
        trace_step(load_source(spec.model), spec)


# -- pipeline parallel ---------------------------------------------------------------------------
# gpipe and looped-bfs measured the same way: every stage to the byte (benchmarks/parallel.md)
PP_CASES = [("1f1b", 4, "hf:llama-tiny"), ("interleaved", 4, "hf:llama-tiny-4l")]


@pytest.mark.parametrize(("schedule", "microbatches", "model"), PP_CASES)
def test_every_pipeline_stage_matches_its_real_run(schedule, microbatches, model):
    """Each stage's traced peak against the same stage run for real (real tensors, the CPU allocator),
    on a fake process group: torch.distributed.pipelining hangs on gloo (pytorch/pytorch#132644), so
    the transfers move no data; every other allocation is real."""
    spec = RunSpec(
        model=model_ref(model), batch=2, seq=32, optim="adamw", target="cpu", world_size=2, pp=2,
        microbatches=microbatches, pp_schedule=schedule,
    )
    real = measure_pipeline_stage_peaks(spec)
    for stage in range(spec.pp):
        trace = trace_step(load_source(spec.model), RunSpec(**{**spec.to_dict(), "pp_stage": stage}))
        estimated, measured_peak = trace.peak()[0], real[stage]["peak_bytes"]
        assert abs(estimated - measured_peak) <= REL_TOL * measured_peak, (schedule, stage, estimated, measured_peak)


def _activation_peak(trace) -> int:
    live = best = 0
    for sid, delta in trace.events:
        rec = trace.storages[sid]
        if rec.category is Category.ACTIVATIONS and rec.iteration == 2:
            live += delta
            best = max(best, live)
    return best


@functools.cache
def _stage_activation_peak(stage, schedule, pp, virtual, split) -> int:
    """A traced llama-tiny-4l stage's activation peak (M = 8), traced once per stage and schedule in this file: the
    GPipe middle stage is both the unit (one micro-batch of one layer) and a stage checked against the schedule."""
    ref = model_ref("hf:llama-tiny-4l")
    spec = RunSpec(model=ref, batch=1, seq=32, target="cpu", world_size=pp, pp=pp, pp_stage=stage, microbatches=8,
                   pp_schedule=schedule, pp_virtual=virtual, pp_split=split)
    return _activation_peak(trace_step(load_source(ref), spec))


# interleaved: every rank of 2 x 2 stages holds the embedding or the head, whose activations differ
# (rank 0: +32 KiB over 5 one-layer micro-batches); it is proven against its real run above
@pytest.mark.parametrize(("schedule", "pp", "virtual", "ranks"), [("1f1b", 4, 0, (1, 2)), ("gpipe", 4, 0, (1,))])
def test_traced_activations_are_the_schedules_micro_batches_in_flight(schedule, pp, virtual, ranks, tmp_path):
    """Stages of one identical layer each (ranks without the LM head), M = 8: the activations a traced rank holds at its peak are the micro-batches
    in flight that walking torch's own order gives (parallel/pipeline_schedule.py), times one micro-batch
    of one layer (measured on a GPipe middle stage)."""
    from memest.parallel.pipeline_schedule import in_flight

    split = ""
    trace = _stage_activation_peak
    one = trace(1, "gpipe", 4, 0, "") / 8  # one micro-batch of one layer
    assert one > 0
    held = in_flight(schedule, pp, virtual or 1, 8)
    for rank in ranks:
        assert trace(rank, schedule, pp, virtual, split) == held[rank].peak * one
    if schedule == "1f1b":
        assert [held[r].peak for r in ranks] == [3, 2]  # min(M, N - i)


def test_pipeline_report_lists_every_stage_and_judges_the_worst():
    from memest.estimator import estimate

    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", world_size=2, pp=2)
    est = estimate(spec)
    stages = est.report.pipeline_stages
    assert [s["stage"] for s in stages] == [0, 1]
    assert est.needed_bytes == max(s["needed_bytes"] for s in stages)
    assert est.report.effective_batch == 2 * 2  # --microbatches defaults to --pp


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"world_size": 4, "pp": 2}, "add --shard zero3"),
        ({"world_size": 2, "pp": 2, "sp": True, "tp": 2}, "not a multiple"),
        ({"world_size": 2, "pp": 2, "sp": True}, "needs --tp 2"),
        ({"world_size": 2, "pp": 2, "pp_virtual": 3}, "runs 1 stage"),
        ({"microbatches": 4}, "add --pp"),
        ({"world_size": 2, "pp": 2, "pp_split": "1,1,1"}, None),  # checked against the model's layers at trace time
    ],
)
def test_pipeline_layouts_that_are_not_traced_are_refused(changes, match):
    if match is None:
        spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", **changes)
        with pytest.raises(MemestError, match="give 2 layer counts"):
            trace_step(load_source(spec.model), spec)
        return
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:llama-2-7b", **changes)


def test_run_configs_take_the_model_parallel_keys(tmp_path):
    from memest.spec.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: hf:llama-2-7b\nworld_size: 2\npp: 2\nmicrobatches: 4\npp_schedule: gpipe\npp_split: '16,16'\n")
    spec = load_config(path).spec()
    assert (spec.pp, spec.microbatches, spec.pp_schedule, spec.pp_split) == (2, 4, "gpipe", "16,16")
    path.write_text("model: hf:llama-2-7b\nworld_size: 4\ntp: 2\nsp: true\nshard: zero3\n")
    spec = load_config(path).spec()
    assert (spec.tp, spec.sp, spec.dp) == (2, True, 2)


PP_GLOO = {  # id -> (model, RunSpec changes)
    "pp2xfsdp2": ("hf:llama-tiny", {"world_size": 4, "shard": "zero3"}),
    "pp2xtp2": ("hf:llama-tiny", {"world_size": 4, "tp": 2}),
    # sequence parallel inside each stage: the stages send their rank's sequence shard (measured to the byte,
    # benchmarks/parallel.md); with FSDP2 too, 8 gloo processes
    "pp2xtp2-sp": ("hf:llama-tiny", {"world_size": 4, "tp": 2, "sp": True}),
    "pp2xfsdp2xtp2-sp": ("hf:llama-tiny-tp", {"world_size": 8, "tp": 2, "sp": True, "shard": "zero3"}),
    # CPU offload per stage (FSDP2's CPUOffloadPolicy; the optimizer step on the host); on a CPU the host is the
    # same memory, so device + host together are compared (as tests/test_sharding.py does)
    "pp2xfsdp2-offload-params": ("hf:llama-tiny", {"world_size": 4, "shard": "zero3", "offload": "params"}),
    "pp2xfsdp2-offload-optimizer": ("hf:llama-tiny", {"world_size": 4, "shard": "zero2", "offload": "optimizer"}),
    "pp2-offload-optimizer": ("hf:llama-tiny", {"world_size": 2, "offload": "optimizer"}),  # stages in this process
}


def _pp_spec(case) -> RunSpec:
    model, changes = PP_GLOO[case]
    return RunSpec(model=model_ref(model), batch=2, seq=32, optim="adamw", target="cpu", pp=2, microbatches=4, **changes)


@pytest.fixture(scope="module")
def pp_measured():
    """Case -> per-rank measurements of PP_GLOO's gloo cases: each world size's cases run in one launch (every rank
    runs them one after another, as the ``measured`` fixture's cases do), on first use."""
    cache: dict[int, dict] = {}

    def get(case) -> list[dict]:
        world_size = _pp_spec(case).world_size
        if world_size not in cache:
            cases = [c for c in PP_GLOO if _pp_spec(c).world_size == world_size]
            cache[world_size] = dict(zip(cases, measure_distributed_peaks([_pp_spec(c) for c in cases]), strict=True))
        return cache[world_size][case]

    return get


@pytest.mark.parametrize("case", list(PP_GLOO))
def test_pipeline_x_data_or_tensor_parallel_matches_real_gloo_ranks(case, pp_measured):
    """Pipeline 2 x FSDP2 2, pipeline 2 x TP 2 (+ SP, and x FSDP2): real gloo processes, each running its stage with
    FSDP2's / TP's collectives on real gloo groups; the pipeline dimension's group is a fake one in all (its
    transfers move no data: pytorch#132644). Each stage's first rank traced against its measured peak."""
    spec = _pp_spec(case)
    gloo = spec.world_size > spec.pp
    real = pp_measured(case) if gloo else measure_pipeline_stage_peaks(spec)
    for stage in range(spec.pp):
        one = RunSpec(**{**spec.to_dict(), "pp_stage": stage})
        trace = trace_step(load_source(spec.model), one)
        estimated = trace.combined_peak() if spec.offload != "none" else trace.peak()[0]
        measured_peak = real[one.rank if gloo else stage]["peak_bytes"]
        if spec.offload != "none":
            _check_offloaded_stage(trace, spec)
        if gloo and estimated < (1 - REL_TOL) * measured_peak:  # read above the trace: again, up to four more runs (conftest.lowest_of_runs)
            real = lowest_of_runs(spec, real)
            measured_peak = real[one.rank]["peak_bytes"]
        assert abs(estimated - measured_peak) <= REL_TOL * measured_peak, (case, stage, estimated, measured_peak)


def _check_offloaded_stage(trace, spec: RunSpec) -> None:
    """What a stage keeps on the host, as the non-pipeline offload path splits it (trace/distributed.mark_host):
    the optimizer state and step always; with --offload params the sharded parameters and gradients too."""
    from memest.parallel.distributed import model_state_bytes

    state = model_state_bytes(trace)
    assert state["device"]["optimizer_state"] == 0 and state["host"]["optimizer_state"] > 0
    assert all(trace.storages[sid].phase is not Phase.OPTIMIZER for sid, _ in trace.events)
    if spec.offload == "params":
        assert state["device"]["parameters"] == state["device"]["gradients"] == 0
        assert state["host"]["parameters"] > 0 and state["host"]["gradients"] > 0
    else:
        assert state["host"]["parameters"] == state["host"]["gradients"] == 0


def test_pipeline_offload_on_cuda_keeps_the_host_part_out_of_the_device_peak():
    """--target cuda, pipeline 2 x FSDP2 2 with --offload params: what each stage's FSDP2 keeps on the host (sharded
    parameters, gradients, optimizer state and step) is counted apart, as without a pipeline; each shard is copied to
    the device before its all-gather (trace/distributed.instrument)."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, optim="adamw", precision="bf16-mixed", target="cuda",
                   world_size=4, pp=2, microbatches=4, shard="zero3", offload="params")
    for stage in range(spec.pp):
        one = RunSpec(**{**spec.to_dict(), "pp_stage": stage})
        trace = trace_step(load_source(spec.model), one)
        _check_offloaded_stage(trace, one)
        assert any(rec.op == "host-to-device copy of offloaded shards" for rec in trace.storages)
        plain = trace_step(load_source(spec.model), RunSpec(**{**one.to_dict(), "offload": "none"}))
        assert trace.peak()[0] < plain.peak()[0]


def test_pipeline_sequence_parallel_needs_a_sequence_that_divides():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=33, target="cpu", world_size=4, pp=2, tp=2, sp=True)
    with pytest.raises(MemestError, match="must divide by --tp 2"):
        trace_step(load_source(spec.model), spec)


def test_tp_without_fsdp_on_cuda_names_the_foreach_mix_and_the_way_out():
    """--tp 2 alone on --target cuda: the foreach AdamW step refuses TP's DTensors beside the plain norms and
    embedding; the error says so and names the layouts that trace, not a model-inputs hint."""
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, optim="adamw", target="cuda", world_size=2, tp=2)
    with pytest.raises(MemestError, match="mixed torch.Tensor and DTensor") as info:
        trace_step(load_source(spec.model), spec)
    assert "FSDP2 makes every parameter a DTensor" in str(info.value) and "example_inputs" not in str(info.value)
    sharded = RunSpec(**{**spec.to_dict(), "world_size": 4, "shard": "zero3"})
    assert trace_step(load_source(sharded.model), sharded).peak()[0] > 0
