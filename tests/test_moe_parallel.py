"""Mixture-of-experts models parallelised with transformers' own code: --ep (expert parallel, base_model_ep_plan and
AllToAllEP, with FSDP2) and --tp (base_model_tp_plan with its MoE styles packed_colwise / moe_tp_experts, applied by
transformers' apply_tensor_parallelism): the traced per-rank peak (--target cpu) against the same step run for real as
N gloo processes on this CPU, each rank measured with torch.profiler memory events
(memest/validate/distributed_truth.py). Tolerance: 0.5% (issue 13).

What reaches a rank's experts depends on the router. The trace answers the all-to-all's split sizes with an
assumption (uniform, or every rank's pairs to the traced rank); the real run gets router weights that make exactly
that split for every token (trace/expert_parallel.route_as), so each assumption is checked against its own real run.
Uniform: the ranks hold the same bytes, compared with the lower median of the ranks (a late-freeing gloo thread on
a shared core can lift one rank, see tests/test_model_parallel.py). One-rank: the traced rank is the receiver (local
rank 0 of its expert group): compared with the lowest of the receivers; the other ranks receive nothing. A case
that measures above the trace is run for real again (conftest.lowest_of_runs, four more runs) and each rank's lowest
reading compared: a late free only ever lifts a measurement (seen in clean-clone CI runs: Qwen2-MoE one-rank +3.8% at
aten::empty, the repeat read the trace to the byte; Mixtral EP 2 x TP 2 one-rank, its one receiver +16,396 B at
aten::div, 2026-11-29), while an estimate that is low on every run still fails.
"""

import pytest

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.parallel.expert_parallel import split_sizes
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import Category, Phase
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.005

# (model, world size, shard, precision); ep 2 each: EP 2 alone, and EP 2 x 2 copies of each expert group (efsdp 2)
CASES = {
    2: [("hf:mixtral-tiny", 2, "zero3", "fp32"), ("hf:qwen3-moe-tiny", 2, "zero2", "bf16-mixed"),
        ("hf:qwen2-moe-tiny", 2, "zero3", "fp32"), ("hf:olmoe-tiny", 2, "zero3", "fp32")],  # Qwen2-MoE: a shared expert
    4: [("hf:mixtral-tiny", 4, "zero3", "fp32")],
}
ROUTINGS = ("uniform", "one-rank")
PARAMS = [(case, routing) for cases in CASES.values() for case in cases for routing in ROUTINGS]
# tensor parallel with transformers' MoE styles: (model, world size, shard, precision), tp 2 each
TP_CASES = {
    2: [("hf:mixtral-tiny", 2, "none", "fp32"), ("hf:qwen3-moe-tiny", 2, "none", "bf16-mixed"),
        ("hf:olmoe-tiny", 2, "none", "fp32")],
    4: [("hf:mixtral-tiny", 4, "zero3", "fp32")],  # FSDP x TP 2 x 2
}
# expert x tensor parallel, ep 2 x tp 2: (model, world size, shard, precision); 2 ranks: the TP group is the EP group,
# each rank dispatches its slice of the shared batch; 4 ranks: FSDP 2 x TP 2, EP 2 with 2 copies of each expert group
EP_TP_CASES = {2: [("hf:mixtral-tiny", 2, "none", "fp32")], 4: [("hf:mixtral-tiny", 4, "zero3", "fp32")]}
EP_TP_PARAMS = [(case, routing) for cases in EP_TP_CASES.values() for case in cases for routing in ROUTINGS]
TP_PARAMS = [case for cases in TP_CASES.values() for case in cases]


def _spec(case, routing) -> RunSpec:
    name, world_size, shard, precision = case
    if routing.startswith("tp+"):  # expert x tensor parallel
        return RunSpec(model=model_ref(name), batch=2, seq=32, optim="adamw", precision=precision, target="cpu",
                       world_size=world_size, tp=2, ep=2, shard=shard, ep_routing=routing[3:])
    if routing == "tp":
        return RunSpec(model=model_ref(name), batch=2, seq=32, optim="adamw", precision=precision, target="cpu",
                       world_size=world_size, tp=2, shard=shard)
    return RunSpec(model=model_ref(name), batch=2, seq=32, optim="adamw", precision=precision, target="cpu",
                   world_size=world_size, ep=2, shard=shard, ep_routing=routing)


def _id(param) -> str:
    (name, world_size, shard, precision), routing = param
    what = "tp2" if routing == "tp" else f"ep2-{routing}".replace("ep2-tp+", "tp2-ep2-")
    return f"{name.removeprefix('hf:')}-ws{world_size}-{what}-{shard}-{precision}"


@pytest.fixture(scope="module")
def measured():
    """Every case of one world size in one gloo launch (each rank runs them one after another)."""
    cache: dict[int, dict] = {}

    def get(case, routing) -> list[dict]:
        world_size = case[1]
        if world_size not in cache:
            params = [(c, r) for c in CASES[world_size] for r in ROUTINGS] + [(c, "tp") for c in TP_CASES[world_size]]
            params += [(c, f"tp+{r}") for c in EP_TP_CASES[world_size] for r in ROUTINGS]
            peaks = measure_distributed_peaks([_spec(c, r) for c, r in params])
            cache[world_size] = dict(zip(params, peaks, strict=True))
        return cache[world_size][(case, routing)]

    return get


def _lower_median(ranks: list[dict]) -> int:
    peaks = sorted(r["peak_bytes"] for r in ranks)
    return peaks[(len(peaks) - 1) // 2]


@pytest.mark.parametrize("case", TP_PARAMS, ids=[_id((c, "tp")) for c in TP_PARAMS])
def test_traced_rank_peak_matches_real_moe_tensor_parallel_run(case, measured):
    spec = _spec(case, "tp")
    trace = trace_step(load_source(spec.model), spec)
    estimated, ranks = trace.peak()[0], measured(case, "tp")
    real = _lower_median(ranks)
    if (estimated - real) / real < -REL_TOL:  # read above the trace: again (module docstring)
        real = _lower_median(lowest_of_runs(spec, ranks))
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id((case, 'tp'))}: traced {estimated} B, measured {real} B ({100 * error:+.4f}%)"
    assert "transformers' own tensor parallel" in trace.parallel and "TP 2" in trace.parallel


@pytest.mark.parametrize("param", EP_TP_PARAMS, ids=[_id((c, "tp+" + r)) for c, r in EP_TP_PARAMS])
def test_traced_rank_peak_matches_real_expert_x_tensor_parallel_run(param, measured):
    case, routing = param
    spec = _spec(case, "tp+" + routing)
    trace = trace_step(load_source(spec.model), spec)
    estimated, ranks = trace.peak()[0], measured(case, "tp+" + routing)

    def compared(ranks):
        if routing == "uniform":
            return _lower_median(ranks)
        return min(r["peak_bytes"] for r in ranks if r["rank"] % spec.ep == 0)

    real = compared(ranks)
    if (estimated - real) / real < -REL_TOL:  # read above the trace: again (module docstring)
        ranks = lowest_of_runs(spec, ranks)
        real = compared(ranks)
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id((case, 'tp+' + routing))}: traced {estimated} B, measured {real} B; {ranks}"
    assert "TP 2" in trace.parallel and "EP 2" in trace.parallel


@pytest.mark.parametrize("param", PARAMS, ids=[_id(p) for p in PARAMS])
def test_traced_rank_peak_matches_real_expert_parallel_run(param, measured):
    case, routing = param
    spec = _spec(case, routing)
    trace = trace_step(load_source(spec.model), spec)
    estimated = trace.peak()[0]
    ranks = measured(case, routing)
    if routing == "uniform":
        real = _lower_median(ranks)
        if (estimated - real) / real < -REL_TOL:  # read above the trace: again (conftest.lowest_of_runs; a ws2 zero3
            ranks = lowest_of_runs(spec, ranks)  # case read +2.1% on both ranks once under load, 2026-11-28)
            real = _lower_median(ranks)
    else:
        real = min(r["peak_bytes"] for r in ranks if r["rank"] % spec.ep == 0)
        if (estimated - real) / real < -REL_TOL:  # read above the trace: again (module docstring)
            ranks = lowest_of_runs(spec, ranks)
            real = min(r["peak_bytes"] for r in ranks if r["rank"] % spec.ep == 0)
        others = [r["peak_bytes"] for r in ranks if r["rank"] % spec.ep]
        assert max(others) < real  # the ranks that receive nothing peak lower: the split decides the peak
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id(param)}: traced {estimated} B, measured {real} B ({100 * error:+.4f}%); {ranks}"
    assert "EP 2" in trace.parallel and "AllToAllEP" in trace.parallel


# -- expert x pipeline parallel ------------------------------------------------------------------------
# pp 2 x dp 2 (EP 2 over each stage's 2 data-parallel ranks), pp 2 x dp 4 (EP 2, 2 copies of each expert group) and
# pp 2 x dp 2 x tp 2 (EP 2 = each TP group, 2 copies): gloo processes whose "pp" mesh dimension is a fake group
# (pytorch#132644), a stage's received activations set to what route_as's model sends
# (trace/pipeline_parallel._received_values), so the later stage's router splits as traced
EP_PP = {"dp2": {"world_size": 4}, "dp4": {"world_size": 8}, "dp2xtp2": {"world_size": 8, "tp": 2}}
EP_PP_PARAMS = [(layout, routing) for layout in EP_PP for routing in ROUTINGS]


def _ep_pp_spec(layout: str, routing: str) -> RunSpec:
    return RunSpec(model=model_ref("hf:mixtral-tiny"), batch=2, seq=32, optim="adamw", target="cpu", pp=2, microbatches=4,
                   ep=2, shard="zero3", ep_routing=routing, **EP_PP[layout])


@pytest.fixture(scope="module")
def measured_ep_pp():
    """Every layout of one world size in one gloo launch (dp4 and dp2xtp2 are both 8 ranks), on first use."""
    cache: dict[tuple[str, str], list[dict]] = {}

    def get(layout: str, routing: str) -> list[dict]:
        if (layout, routing) not in cache:
            world_size = EP_PP[layout]["world_size"]
            params = [(w, r) for w in EP_PP if EP_PP[w]["world_size"] == world_size for r in ROUTINGS]
            cache.update(zip(params, measure_distributed_peaks([_ep_pp_spec(w, r) for w, r in params]), strict=True))
        return cache[(layout, routing)]

    return get


def _stage_measured(ranks: list[dict], first: int, per_stage: int, spec: RunSpec) -> tuple[int, list[int]]:
    """(the measured peak a stage's first rank is compared with, the peaks of its ranks that receive nothing)."""
    mine = ranks[first : first + per_stage]
    if spec.ep_routing == "uniform":
        return _lower_median(mine), []
    return (min(r["peak_bytes"] for r in mine if (r["rank"] - first) % spec.ep == 0),
            [r["peak_bytes"] for r in mine if (r["rank"] - first) % spec.ep])


@pytest.mark.parametrize("param", EP_PP_PARAMS, ids=[f"mixtral-tiny-pp2-{w}-ep2-{r}" for w, r in EP_PP_PARAMS])
def test_every_pipeline_rank_matches_real_expert_x_pipeline_run(param, measured_ep_pp):
    """Each pipeline rank's first rank traced against its stage's ranks: uniform, the lower median of the stage's ranks;
    one-rank, the stage's receivers (local rank 0 of each expert group), the others peaking lower."""
    layout, routing = param
    spec = _ep_pp_spec(layout, routing)
    ranks = measured_ep_pp(layout, routing)
    per_stage = spec.world_size // spec.pp
    for stage in range(spec.pp):
        one = RunSpec(**{**spec.to_dict(), "pp_stage": stage})
        trace = trace_step(load_source(spec.model), one)
        estimated = trace.peak()[0]
        assert "EP 2" in trace.parallel and f"pipeline rank {stage} of 2" in trace.parallel

        real, others = _stage_measured(ranks, one.rank, per_stage, spec)
        if (estimated - real) / real < -REL_TOL:  # read above the trace: again, up to four more runs (conftest.lowest_of_runs)
            ranks = lowest_of_runs(spec, ranks)
            real, others = _stage_measured(ranks, one.rank, per_stage, spec)
        if others:
            assert max(others) < real  # the ranks that receive nothing peak lower: the split decides the peak
        error = (estimated - real) / real
        assert abs(error) <= REL_TOL, f"{layout} {routing} stage {stage}: traced {estimated} B, measured {real} B; {ranks}"


def test_pipeline_estimate_takes_the_worst_rank_at_each_routing():
    from memest.estimator import estimate

    est = estimate(_ep_pp_spec("dp2", "uniform"))
    rows = {r["routing"]: r for r in est.report.expert_routing}
    assert [s["stage"] for s in est.report.pipeline_stages] == [0, 1]
    assert est.needed_bytes == rows["uniform"]["needed_bytes"] == max(s["needed_bytes"] for s in est.report.pipeline_stages)
    assert rows["one-rank"]["needed_bytes"] > rows["uniform"]["needed_bytes"]


# -- no real run ---------------------------------------------------------------------------------
def test_expert_counts_reads_every_family_s_name():
    from transformers import MixtralConfig

    from memest.parallel.expert_parallel import expert_counts

    assert expert_counts(MixtralConfig(num_local_experts=8, num_experts_per_tok=2)) == (8, 2)
    assert expert_counts({"num_experts": 60, "num_experts_per_tok": 4}) == (60, 4)  # Qwen2-MoE, OLMoE
    assert expert_counts({"n_routed_experts": 256, "num_experts_per_tok": 8}) == (256, 8)  # DeepSeek-V3
    assert expert_counts({"hidden_size": 64}) == (0, 0)


def test_split_sizes():
    assert split_sizes("uniform", 128, 2, 0) == [[64, 64], [64, 64]]
    assert split_sizes("uniform", 10, 4, 3) == [[3, 3, 2, 2], [2, 2, 2, 2]]
    assert split_sizes("one-rank", 128, 2, 0) == [[128, 0], [128, 128]]


def test_experts_are_divided_by_ep_and_the_rest_by_the_world():
    """mixtral-tiny (hidden 64, 8 experts of 2 x 96 + 96 rows, 2 layers), EP 2 on 2 ranks: rank 0 holds half of each
    layer's experts whole (efsdp 1) and FSDP's half of every other parameter."""
    spec = _spec(CASES[2][0], "uniform")
    model = load_source(spec.model)
    trace = trace_step(model, spec)
    hidden, inter, experts, layers = 64, 96, 8, 2
    expert_numel = layers * experts * 3 * inter * hidden
    held = sum(rec.nbytes for rec in trace.storages if rec.category is Category.PARAMETERS and rec.phase is Phase.SETUP)
    total = 4 * trace.param_count  # fp32
    assert held == total // 2  # both halves: experts by ep, the rest by FSDP over the world
    spec4 = _spec(CASES[4][0], "uniform")
    trace4 = trace_step(model, spec4)
    held4 = sum(rec.nbytes for rec in trace4.storages if rec.category is Category.PARAMETERS and rec.phase is Phase.SETUP)
    assert held4 == (4 * expert_numel) // 4 + (total - 4 * expert_numel) // 4  # ep 2 x efsdp 2, FSDP over 4


def test_estimate_reports_the_routing_range():
    from memest.estimator import estimate

    spec = RunSpec(model=model_ref("hf:mixtral-tiny"), batch=2, seq=32, optim="adamw", target="cpu", world_size=2, ep=2,
                   shard="zero3")
    est = estimate(spec)
    rows = {r["routing"]: r for r in est.report.expert_routing}
    assert est.needed_bytes == rows["uniform"]["needed_bytes"] < rows["one-rank"]["needed_bytes"]
    assert est.needed_range == (est.needed_bytes, est.needed_bytes, rows["one-rank"]["needed_bytes"])
    assert any("uniform routing" in n for n in est.report.notes)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"world_size": 3, "ep": 2, "shard": "zero3"}, "not a multiple"),
        ({"world_size": 2, "ep": 2}, "add --shard zero3"),
        ({"world_size": 4, "ep": 2, "pp": 2}, "add --shard zero3"),
        ({"world_size": 2, "ep": 2, "pp": 2}, "each stage's 1 ranks"),
        ({"world_size": 4, "ep": 2, "tp": 4}, "multiple of --tp"),
        ({"world_size": 2, "ep": 2, "shard": "zero3", "mode": "inference"}, "training"),
    ],
)
def test_layouts_that_are_not_traced_are_refused(changes, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:mixtral-8x7b", **changes)


def test_a_model_without_experts_is_refused():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", world_size=2, ep=2, shard="zero3")
    with pytest.raises(MemestError, match="no expert-parallel plan"):
        trace_step(load_source(spec.model), spec)


def test_experts_must_divide():
    spec = RunSpec(model=model_ref("hf:mixtral-tiny"), batch=2, seq=32, target="cpu", world_size=3, ep=3, shard="zero3")
    with pytest.raises(MemestError, match="8 experts per layer, not divisible by 3"):
        trace_step(load_source(spec.model), spec)


# -- plan-parallel ---------------------------------------------------------------------------------
def test_plan_parallel_searches_expert_parallel_for_moe_models():
    from memest.plan.parallel import Layout, comm_bytes, layouts_for

    mixtral = {"num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": 32, "hidden_size": 4096,
               "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2}
    assert [lay.ep for lay in layouts_for(8, mixtral) if lay.ep > 1 and lay.tp == 1] == [2, 4, 8]
    assert all(lay.dp == 8 for lay in layouts_for(8, mixtral) if lay.ep > 1 and lay.tp == 1)  # ep x tp: test_plan_parallel
    dense = {k: v for k, v in mixtral.items() if "expert" not in k}
    assert all(lay.ep == 1 for lay in layouts_for(8, dense))
    # EP 8 on 8 GPUs: one copy of each expert group, so the experts are not gathered; 4 all-to-alls per MoE layer,
    # 7/8 of tokens x top-k rows leaving the rank
    base = RunSpec(model="hf:mixtral-8x7b", batch=1, seq=100, precision="bf16-mixed")
    experts = 32 * 8 * 3 * 4096 * 14336
    psi = experts + 1_000_000
    a2a = 32 * 4 * 100 * 2 * 4096 * 2 * 7 / 8
    assert comm_bytes(Layout(dp=8, tp=1, pp=1, sp=False, ep=8), mixtral, base, psi) == int(a2a + 7 / 8 * 1_000_000 * 8)


def test_run_configs_and_the_cli_take_ep(tmp_path):
    from typer.testing import CliRunner

    from memest.cli import app
    from memest.spec.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: hf:mixtral-8x7b\nworld_size: 8\nep: 4\nshard: zero3\n")
    spec = load_config(path).spec()
    assert (spec.ep, spec.dp, spec.ep_routing) == (4, 8, "uniform")
    path.write_text("model: hf:mixtral-8x7b\nep_routing: one-rank\n")
    with pytest.raises(MemestError):  # the routing traced is not a user's key
        load_config(path).spec()
    result = CliRunner().invoke(app, ["estimate", "hf:mixtral-8x7b", "--world-size", "2", "--ep", "2"])
    assert result.exit_code == 2 and "--shard zero3" in result.output
