"""--world-size / --shard / --offload: the traced per-rank peak (--target cpu) against the same step
run for real as N processes on this CPU (gloo), each rank measuring its own peak with torch.profiler
memory events (memest/validate/distributed_truth.py). Tolerance: 5% of rank 0's measured peak.

The real runs of one world size share one set of processes (forked from a forkserver that imported
torch once); the traces run here.

Known, not tested: examples/transformer.py --shard zero3 at --world-size 4 (4 processes on this
2-core machine) usually matches to the byte, but in about one run in three one rank peaks one or two
transformer layers' parameter bytes higher (3,159,040 B each: -4.0% or -7.7%). gloo's reduce-scatter
all-reduces a clone of its input on a worker thread; when that thread is descheduled it drops the
clone after the main thread has started the next unit's all-gather. A timing race of the CPU
backend (NCCL reduce-scatters in place, without a clone), so no fixed tolerance describes it.
"""

import pytest
import torch.distributed as dist

from memest.errors import TraceError
from memest.features.registry import trace_step
from memest.parallel.distributed import model_state_bytes
from memest.sources import load_source
from memest.spec import RunSpec
from memest.trace import Category, Phase
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.05

# (model, batch, seq, optimizer, precision, shard, offload)
CASES = {
    2: [
        ("mlp", 4, None, "adam", "fp32", "none", "none"),  # plain DDP: + gradient buckets
        ("mlp", 4, None, "adam", "fp32", "zero3", "params"),  # no repeated blocks: one unit, the root
        ("transformer", 2, 64, "adamw", "fp32", "zero1", "none"),
        ("transformer", 2, 64, "adamw", "fp32", "zero2", "none"),
        ("transformer", 2, 64, "adamw", "fp32", "zero3", "none"),  # 4 layers + root
        ("hf:gpt2-tiny", 4, 64, "adamw", "bf16-mixed", "zero3", "none"),  # FSDP MixedPrecisionPolicy
    ],
    4: [
        ("hf:gpt2-tiny", 4, 64, "adamw", "fp32", "zero1", "none"),
        ("hf:gpt2-tiny", 4, 64, "adamw", "fp32", "zero2", "optimizer"),
        ("hf:gpt2-tiny", 4, 64, "adamw", "fp32", "zero3", "params"),
    ],
}
PARAMS = [(ws, case) for ws, cases in CASES.items() for case in cases]


def _spec(case, world_size: int) -> RunSpec:
    name, batch, seq, optim, precision, shard, offload = case
    return RunSpec(
        model=model_ref(name), batch=batch, seq=seq, optim=optim, precision=precision, target="cpu",
        world_size=world_size, shard=shard, offload=offload,
    )


def _id(param) -> str:
    ws, (name, batch, seq, optim, precision, shard, offload) = param
    parts = [f"ws{ws}", name.removeprefix("hf:"), shard, optim, precision]
    return "-".join(parts + ([f"offload-{offload}"] if offload != "none" else []))


@pytest.fixture(scope="module")
def measured():
    """World size -> {case: per-rank measurements}, each world size run once, on first use."""
    cache: dict[int, dict] = {}

    def get(world_size: int, case) -> list[dict]:
        if world_size not in cache:
            cases = CASES[world_size]
            results = measure_distributed_peaks([_spec(c, world_size) for c in cases])
            cache[world_size] = dict(zip(cases, results, strict=True))
        return cache[world_size][case]

    return get


@pytest.mark.parametrize("param", PARAMS, ids=[_id(p) for p in PARAMS])
def test_traced_rank_peak_matches_real_run(param, measured):
    world_size, case = param
    spec = _spec(case, world_size)
    trace = trace_step(load_source(spec.model), spec)
    # on CPU the "host" of an offloading run is the same memory: compare device + host together
    estimated = trace.combined_peak() if spec.offload != "none" else trace.peak()[0]
    ranks = measured(world_size, case)
    real = ranks[0]["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, (
        f"{_id(param)}: traced {estimated} B, rank 0 measured {real} B ({100 * error:+.2f}%); "
        f"all ranks: {[r['peak_bytes'] for r in ranks]}"
    )
    if spec.offload != "none":
        _check_host_split(trace, spec)


def _check_host_split(trace, spec: RunSpec) -> None:
    """The device/host split is the designed one (docs/sharding.md)."""
    host = [rec for rec in trace.storages if rec.host]
    assert host and trace.host_peak() > 0
    device_sids = {sid for sid, _ in trace.events}
    host_sids = {sid for _, sid, _ in trace.host_events}
    assert not device_sids & host_sids
    for sid in device_sids:
        rec = trace.storages[sid]
        assert rec.category is not Category.OPTIMIZER_STATE and rec.phase is not Phase.OPTIMIZER, rec
    state = model_state_bytes(trace)
    assert state["device"]["optimizer_state"] == 0 and state["host"]["optimizer_state"] > 0
    if spec.offload == "params":
        for rec in host:
            assert rec.phase is Phase.OPTIMIZER or rec.category in (
                Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE,
            ), rec
        # sharded parameters and gradients on the host; unsharded parameters gathered on the device
        assert state["device"]["parameters"] == state["device"]["gradients"] == 0
        assert state["host"]["parameters"] > 0 and state["host"]["gradients"] > 0
        assert any(trace.storages[sid].category is Category.PARAMETERS for sid in device_sids)
        # the same step without offloading holds the same bytes in one place
        plain = trace_step(load_source(spec.model), _replace(spec, offload="none"))
        assert trace.combined_peak() == plain.peak()[0]
    else:
        assert state["host"]["parameters"] == state["host"]["gradients"] == 0


def _replace(spec: RunSpec, **changes) -> RunSpec:
    return RunSpec(**{**spec.to_dict(), **changes})


# -- no real run ---------------------------------------------------------------------------------
def _gpt2_tiny(shard: str, world_size: int = 4, offload: str = "none") -> RunSpec:
    return RunSpec(
        model=model_ref("hf:gpt2-tiny"), batch=2, seq=32, optim="adamw", precision="bf16-mixed",
        world_size=world_size, shard=shard, offload=offload,
    )


def test_zero_model_states_follow_the_zero_paper():
    """Persistent model states per rank against ZeRO's accounting (docs/sharding.md). With torch
    AMP the parameters stay fp32 (4 B) and Adam holds two fp32 moments (8 B): 16 B per parameter in
    all, as in ZeRO's 2 + 2 + 12. FSDP pads each parameter's dim 0 to a multiple of N."""
    n = 4
    per_shard = {}
    for shard in ("none", "zero1", "zero3"):
        trace = trace_step(load_source(model_ref("hf:gpt2-tiny")), _gpt2_tiny(shard, n))
        psi = trace.param_count
        state = model_state_bytes(trace)["device"]
        per_shard[shard] = state
        if shard == "none":  # DDP: fp32 params, grads + DDP's buckets (4 B each), Adam 8 B
            assert state["parameters"] == 4 * psi
            assert state["gradients"] == 8 * psi
            assert 8 * psi <= state["optimizer_state"] <= 8 * psi + 1024  # + a step count per tensor
        elif shard == "zero3":  # (4 + 12) psi / N
            total = sum(state.values())
            assert 16 * psi / n <= total <= 1.01 * 16 * psi / n
    # ZeRO-1: full parameters and gradients, the optimizer state of rank 0's partition only
    assert per_shard["zero1"]["parameters"] == per_shard["none"]["parameters"]
    assert per_shard["zero1"]["gradients"] == per_shard["none"]["gradients"]
    assert per_shard["zero1"]["optimizer_state"] < per_shard["none"]["optimizer_state"] / 2


def test_fsdp_frees_and_regathers_unsharded_parameters():
    """zero3: each unit's parameters are gathered (resize_ re-allocates their storage) for its forward
    and again for its backward, and freed after each; zero2 keeps them from forward to backward."""
    gathers = {}
    for shard in ("zero2", "zero3"):
        trace = trace_step(load_source(model_ref("hf:gpt2-tiny")), _gpt2_tiny(shard, 2))
        unsharded = [
            rec for rec in trace.storages
            if rec.category is Category.PARAMETERS and rec.phase in (Phase.FORWARD, Phase.BACKWARD) and rec.iteration == 2
        ]
        assert unsharded and all("FSDP all-gather copy-out" in rec.op for rec in unsharded)
        gathers[shard] = {phase: sum(1 for rec in unsharded if rec.phase is phase) for phase in (Phase.FORWARD, Phase.BACKWARD)}
        assert any("FSDP reduce-scatter" in rec.op for rec in trace.storages)
    assert gathers["zero3"][Phase.BACKWARD] == gathers["zero3"][Phase.FORWARD]  # gathered twice
    assert gathers["zero2"][Phase.BACKWARD] < gathers["zero2"][Phase.FORWARD]  # the root only


def test_process_group_is_torn_down_after_a_failing_trace(tmp_path):
    model = tmp_path / "broken.py"
    model.write_text(
        "import torch\n"
        "class Broken(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.lin = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        raise ValueError('boom')\n"
        "def build_model():\n"
        "    return Broken()\n"
        "def example_inputs(batch_size, seq_len=None):\n"
        "    return (torch.randn(batch_size, 4),)\n"
    )
    for shard in ("none", "zero3"):
        spec = RunSpec(model=str(model), batch=2, target="cpu", world_size=2, shard=shard)
        with pytest.raises(TraceError, match="boom"):
            trace_step(load_source(spec.model), spec)
        assert not dist.is_initialized()
