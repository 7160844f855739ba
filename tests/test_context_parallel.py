"""--cp N (context parallel): every cp rank's traced peak (--target cpu) against the same step run for real as
N gloo processes on this CPU, each rank measured with torch.profiler memory events
(memest/validate/distributed_truth.py); both run torch's ring attention with the CPU flash op as its
per-block kernel (parallel/context_parallel.py). Tolerance: 0.5% of the measured per-rank peak (issue 13).

With --tp M the mesh is ("dp", "cp", "tp") (tp innermost, torchtitan's order): the cp rank of global rank g is
g // M % N; the tp ranks of one cp rank run the same shapes, so the first of them is traced. The first data-parallel
group is traced: where FSDP2's shards are uneven (llama-tiny's 172-wide MLP, 86 rows per tp rank over 4 dp x cp
ranks: 22, 22, 22, 20) the last dp x cp rank holds less (FSDP 2 x CP 2 x TP 2: ranks 6, 7 measure 4,096 B,
0.24%, below cp rank 1's trace, and equal the trace of global rank 6 to the byte).

The cp ranks differ (torch's head-tail load balance gives rank 0 the half-query blocks and the last rank the
half-key/value ones), so each rank is compared with its own trace (global rank = dp index x cp + cp rank).
gloo's worker thread can free a collective's buffer late on this shared 2-core machine and lift one rank's
measured peak (docs/sharding.md; seen here once, +5.4% on one rank of a CP 2 run whose other rank read the trace
to 12 bytes), so where a rank reads above its trace the case runs for real again (up to four more runs) and each rank's
lowest peak is compared (conftest.lowest_of_runs); a low estimate still fails.
"""

import dataclasses
import os
import socket

import pytest
import torch
import torch.nn.functional as F

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

REL_TOL = 0.005

# (label, RunSpec changes); llama-tiny: 4 query / 2 key-value heads, vocab 1000; llama-tiny-long: 4 / 4 heads,
# vocab 512, 4096 positions, where attention and the ring's rank difference set the peak
BASE = dict(batch=2, seq=32, optim="adamw", target="cpu", shard="zero3")
CASES = {
    2: [
        ("cp2", dict(model="hf:llama-tiny", world_size=2, cp=2)),
        ("cp2-alltoall-bf16", dict(model="hf:llama-tiny", world_size=2, cp=2, cp_rotate="alltoall",
                                   precision="bf16-mixed")),
        ("long-cp2", dict(model="hf:llama-tiny-long", world_size=2, cp=2, batch=1, seq=1024)),
    ],
    4: [
        ("fsdp2-x-cp2", dict(model="hf:llama-tiny", world_size=4, cp=2)),
        ("long-cp4", dict(model="hf:llama-tiny-long", world_size=4, cp=4, batch=1, seq=1024)),
        # --cp x --tp on the (dp, cp, tp) mesh, FSDP2 over dp x cp (torchtitan's dp_shard_cp)
        ("cp2-x-tp2", dict(model="hf:llama-tiny", world_size=4, cp=2, tp=2)),
        ("long-cp2-x-tp2-sp", dict(model="hf:llama-tiny-long", world_size=4, cp=2, tp=2, sp=True, batch=1, seq=1024)),
    ],
    8: [  # dp 2 x cp 2 x tp 2: the last dp x cp rank holds FSDP's shorter last shard (module docstring)
        ("fsdp2-x-cp2-x-tp2", dict(model="hf:llama-tiny", world_size=8, cp=2, tp=2)),
    ],
}
PARAMS = [case for cases in CASES.values() for case in cases]


def _spec(case) -> RunSpec:
    _, changes = case
    return RunSpec(**{**BASE, **changes, "model": model_ref(changes["model"])})


@pytest.fixture(scope="module")
def measured():
    cache: dict[int, dict] = {}

    def get(case) -> list[dict]:
        world = case[1]["world_size"]
        if world not in cache:
            cases = CASES[world]
            cache[world] = dict(zip((c[0] for c in cases), measure_distributed_peaks([_spec(c) for c in cases]), strict=True))
        return cache[world][case[0]]

    return get


@pytest.mark.parametrize("case", PARAMS, ids=[c[0] for c in PARAMS])
def test_every_cp_rank_matches_its_real_run(case, measured):
    spec = _spec(case)
    source = load_source(spec.model)
    traced = [trace_step(source, dataclasses.replace(spec, cp_rank=r)) for r in range(spec.cp)]
    assert all(f"context parallel {spec.cp}" in t.parallel for t in traced)
    ranks = measured(case)
    assert [t.rank for t in traced] == [r * spec.tp for r in range(spec.cp)]

    def cp_rank(rank: int) -> int:  # the ("dp", "cp", "tp") mesh, tp innermost
        return rank // spec.tp % spec.cp

    if any(r["peak_bytes"] > traced[cp_rank(r["rank"])].peak()[0] * (1 + REL_TOL) for r in ranks):
        ranks = lowest_of_runs(spec, ranks, traced=lambda r: traced[cp_rank(r["rank"])].peak()[0] * (1 + REL_TOL))  # docstring
    for r in ranks:
        estimated, real = traced[cp_rank(r["rank"])].peak()[0], r["peak_bytes"]
        assert abs(estimated - real) <= REL_TOL * real, (
            f"{case[0]} rank {r['rank']}: traced {estimated} B, measured {real} B "
            f"({100 * (estimated - real) / real:+.3f}%); all ranks: {[x['peak_bytes'] for x in ranks]}"
        )


def test_the_ring_attention_runs_and_context_parallel_saves_memory_at_length():
    """The trace runs the CPU ring handlers (one forward and one backward per layer and iteration), and a rank
    of CP 2 holds less than a rank of FSDP 2 that runs the whole sequence."""
    from memest.parallel import context_parallel as cp

    spec = _spec(CASES[2][2])
    calls = []
    forward, backward = cp._cpu_flash_forward, cp._cpu_flash_backward
    try:
        cp._cpu_flash_forward = lambda *a: (calls.append("forward"), forward(*a))[1]
        cp._cpu_flash_backward = lambda *a: (calls.append("backward"), backward(*a))[1]
        with_cp = trace_step(load_source(spec.model), spec).peak()[0]
    finally:
        cp._cpu_flash_forward, cp._cpu_flash_backward = forward, backward
    layers, iterations = 2, spec.iterations
    assert calls.count("forward") == calls.count("backward") == layers * iterations
    without = trace_step(load_source(spec.model), dataclasses.replace(spec, cp=1)).peak()[0]
    assert with_cp < 0.6 * without


def test_every_patch_is_undone_after_the_trace():
    from torch.distributed.tensor import DTensor
    from transformers import masking_utils

    sdpa, handlers, packed = F.scaled_dot_product_attention, DTensor._op_dispatcher._custom_op_handlers, \
        masking_utils.find_packed_sequence_indices
    spec = _spec(CASES[2][0])
    trace_step(load_source(spec.model), spec)
    assert F.scaled_dot_product_attention is sdpa
    assert DTensor._op_dispatcher._custom_op_handlers is handlers
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default not in handlers
    assert masking_utils.find_packed_sequence_indices is packed


def test_cuda_target_runs_torchs_own_ring_handlers_for_flash():
    """--target cuda: memest calls the CUDA SDPA op on the fake tensors (targets/cuda/sdpa.py), and torch's own CP
    handler (``_sdpa_handler``) runs the ring around it."""
    from torch.distributed.tensor.experimental._context_parallel import _attention

    spec = dataclasses.replace(_spec(CASES[2][2]), target="cuda", precision="bf16-mixed")
    kernels = []
    ring = _attention._templated_ring_attention
    try:
        _attention._templated_ring_attention = lambda *a, **k: (kernels.append(a[2]), ring(*a, **k))[1]
        trace_step(load_source(spec.model), spec)
    finally:
        _attention._templated_ring_attention = ring
    assert kernels and all(k is torch.ops.aten._scaled_dot_product_flash_attention for k in kernels)


def test_cuda_math_path_is_refused_with_the_reason():
    """fp32 with grouped-query attention takes the math path on CUDA (targets/cuda/sdpa.py), which torch's CP does
    not handle."""
    spec = dataclasses.replace(_spec(CASES[2][0]), target="cuda")
    with pytest.raises(MemestError, match="ring handlers for the flash, memory-efficient and cuDNN kernels only"):
        trace_step(load_source(spec.model), spec)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"world_size": 2, "cp": 2}, "add --shard zero3"),
        ({"world_size": 3, "cp": 2, "shard": "zero3"}, "not a multiple"),
        ({"world_size": 8, "cp": 2, "pp": 2, "shard": "zero3"}, "not traced yet"),
        ({"world_size": 4, "cp": 2, "tp": 2}, "add --shard zero3"),
        ({"world_size": 6, "cp": 2, "tp": 2, "shard": "zero3"}, "not a multiple of --cp 2 x --tp 2"),
        ({"world_size": 2, "cp": 2, "shard": "zero3", "seq": 30}, "does not divide into 4 chunks"),
        ({"world_size": 2, "cp": 2, "shard": "zero3", "mode": "inference"}, "training"),
        ({"cp_rotate": "alltoall"}, "add --cp N"),
    ],
)
def test_layouts_that_are_not_traced_are_refused(changes, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:llama-2-7b", **changes)


def test_attention_dropout_on_cpu_is_refused_with_the_reason():
    """CPU SDPA takes the math path with dropout (sdp_utils_cpp.cpp, check_for_dropout), and torch's CP has no ring for
    it: a real gloo run of torch's patched SDPA with dropout 0.1 raises "got mixed torch.Tensor and DTensor"."""
    spec = RunSpec(model=model_ref("hf:gpt2-tiny"), batch=1, seq=32, target="cpu", world_size=2, cp=2, shard="zero3")
    with pytest.raises(MemestError, match="attention dropout 0.1 makes CPU SDPA take the math path"):
        trace_step(load_source(spec.model), spec)


def test_a_model_not_on_sdpa_attention_is_refused():
    spec = RunSpec(model=model_ref("mlp"), batch=2, target="cpu", world_size=2, cp=2, shard="zero3")
    with pytest.raises(MemestError, match="must use SDPA attention"):
        trace_step(load_source(spec.model), spec)


def test_cli_and_run_configs_take_cp(tmp_path):
    import json

    from typer.testing import CliRunner

    from memest.cli import app
    from memest.spec.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model: hf:llama-2-7b\nworld_size: 8\ncp: 4\ncp_rotate: alltoall\nshard: zero3\n")
    spec = load_config(path).spec()
    assert (spec.cp, spec.dp, spec.cp_rotate) == (4, 2, "alltoall")
    path.write_text("model: hf:llama-2-7b\ncp_rank: 1\n")
    with pytest.raises(MemestError):  # the rank traced is not a user's key
        load_config(path).spec()
    result = CliRunner().invoke(app, [
        "estimate", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "32", "--target", "cpu", "--world-size", "2",
        "--cp", "2", "--shard", "zero3", "--json",
    ])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    rows = doc["context_parallel_ranks"]
    assert [r["cp_rank"] for r in rows] == [0, 1]
    assert doc["peak_allocated_bytes"] == max(r["peak_allocated_bytes"] for r in rows)


def _real_ring_rank(rank: int, world: int, tp: int, port: int, out: dict) -> None:
    """One rank of a real CP 2 (x TP ``tp``) forward and backward of llama-tiny-long, beside the whole model on the
    whole sequence."""
    import copy

    import torch.distributed as dist

    from memest.features.registry import build
    from memest.parallel.distributed import wrap

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        spec = RunSpec(model=model_ref("hf:llama-tiny-long"), batch=2, seq=64, target="cpu", world_size=world,
                       cp=world // tp, tp=tp, shard="zero3")
        torch.manual_seed(0)
        built = build(load_source(spec.model), spec)
        model, inputs = built.model, built.inputs
        torch.manual_seed(1)
        inputs["input_ids"] = torch.randint(0, 512, inputs["input_ids"].shape)
        whole = copy.deepcopy(model)
        expected = whole(**inputs).logits
        expected.pow(2).sum().backward()
        parallel = wrap(model, spec, fake=False)
        local = parallel.shard_inputs(inputs)
        with parallel.step_context():
            logits = parallel.module(**local).logits
            logits.pow(2).sum().backward()
        positions = local["position_ids"][0]
        name = "model.layers.0.self_attn.k_proj.weight"
        grad = dict(model.named_parameters())[name].grad.full_tensor() * spec.cp  # FSDP averages over dp x cp
        reference = dict(whole.named_parameters())[name].grad
        if rank == 0:
            out["logits"] = (logits - expected[:, positions]).abs().max().item()
            out["grad"] = ((grad - reference).norm() / reference.norm()).item()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tp", [1, 2], ids=["cp2", "cp2-x-tp2"])
def test_the_cpu_ring_handlers_compute_attention_over_the_whole_sequence(tp):
    """What makes the ground truth a context-parallel run: the ring's logits equal the whole model's at each rank's
    positions, and its key-projection gradient (summed over the ranks) the whole model's; with --tp 2 too (each
    rank's ring over its tensor-parallel share of the heads)."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_real_ring_rank, args=(2 * tp, tp, port, out), nprocs=2 * tp, start_method="forkserver")
        logits, grad = out["logits"], out["grad"]
    assert logits < 1e-5
    assert grad < 1e-5
