"""FSDP-QLoRA (issue 24, item 1): a quantized base (--quant) under sharding, offload or model parallelism is
not modelled, so every path refuses it with one line (exit 2) naming what is not modelled and what to do: the
CLI, a YAML run config, the Python API, advise (never proposes it) and plan-parallel. Plain DDP over a
quantized base stays modelled: its traced rank peak is checked against the same step run on real gloo ranks
(memest/validate/distributed_truth.py), as tests/test_sharding.py checks the unquantized layouts. So are FSDP-QLoRA
(FSDP2 --shard zero3 / zero2 over a 4-bit base in bf16 or fp32) and, under zero3, FSDP2's CPUOffloadPolicy over it
(--offload params): on a CPU offloading moves nothing, so its device + host peak is checked against the real ranks'
peak and its host column against the real ranks' sharded storage bytes (docs/limitations.md: what a CPU cannot
prove)."""

import json

import pytest
import torch
from typer.testing import CliRunner

import memest
from memest.cli import app
from memest.errors import EXIT_USAGE, MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.config import load_config
from memest.validate.distributed_truth import measure_distributed_peaks

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

QLORA = ["--lora", "r=8,targets=all-linear", "--quant", "nf4"]

# (flags that lay the run out, the option the error names first)
UNMODELLED = [
    (["--world-size", "2", "--shard", "zero3", "--precision", "bf16-mixed"], "--shard zero3"),
    (["--world-size", "2", "--shard", "zero2", "--precision", "fp16"], "--shard zero2"),
    (["--world-size", "2", "--shard", "zero1"], "--shard zero1"),
    (["--world-size", "2", "--shard", "zero3", "--offload", "optimizer"], "--offload optimizer"),
    (["--offload", "optimizer"], "--offload optimizer"),
    (["--world-size", "2", "--tp", "2"], "--tp 2"),
    (["--world-size", "2", "--pp", "2"], "--pp 2"),
]


def _one_line(result) -> str:
    assert result.exit_code == EXIT_USAGE, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    return lines[0]


@pytest.mark.parametrize("layout, named", UNMODELLED, ids=[n for _, n in UNMODELLED])
@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_cli_refuses_a_quantized_base_under_sharding_or_model_parallelism(layout, named, quant):
    args = ["estimate", model_ref("hf:llama-tiny"), "--lora", "r=8,targets=all-linear", "--quant", quant, *layout]
    line = _one_line(CliRunner().invoke(app, args))
    assert f"--quant {quant}" in line and named in line and "not modelled" in line
    assert "--shard none" in line and "drop --quant" in line  # what to do instead


def test_deepspeed_style_optimizer_offload_over_qlora_says_why_it_is_refused():
    """A DeepSpeed ZeRO-3 QLoRA config with offload_optimizer reads as --shard zero3 --offload optimizer
    (spec/trainers/deepspeed.py); FSDP2 has no such policy and no real DeepSpeed run checks it."""
    args = ["estimate", model_ref("hf:llama-tiny"), *QLORA, "--precision", "bf16", "--world-size", "2", "--shard",
            "zero3", "--offload", "optimizer"]
    line = _one_line(CliRunner().invoke(app, args))
    assert "--quant nf4 with --offload optimizer is not modelled" in line
    assert "DeepSpeed" in line and "FSDP2 has no policy" in line and "--offload params" in line


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_int8_base_under_zero3_stays_refused(precision):
    """FSDP-QLoRA is modelled for the 4-bit stand-in only: Linear8bitLt's int8 weight under FSDP is not checked."""
    with pytest.raises(MemestError, match="--quant int8 with --shard zero3 is not modelled"):
        RunSpec(model=model_ref("hf:llama-tiny"), lora="r=8", quant="int8", world_size=2, shard="zero3",
                precision=precision, target="cpu")


@pytest.mark.parametrize("shard", ["zero3", "zero2"])
def test_fsdp_qlora_in_bf16_and_fp32_is_accepted(shard):
    for precision in ("bf16", "fp32"):
        spec = RunSpec(model=model_ref("hf:llama-tiny"), lora="r=8", quant="nf4", world_size=2, shard=shard,
                       precision=precision, target="cpu")
        assert spec.parallel.dp_shard == 2


def test_the_issue_s_command_under_mixed_precision_is_refused():
    """The issue's command (it used to run, unchecked, with no note) under bf16-mixed: FSDP's
    MixedPrecisionPolicy would cast the packed 4-bit storage, which is not modelled."""
    args = ["estimate", "hf:llama-3.2-1b", "--lora", "r=16,alpha=32,targets=all-linear", "--quant", "nf4",
            "--world-size", "2", "--shard", "zero3", "--precision", "bf16-mixed"]
    line = _one_line(CliRunner().invoke(app, args))
    assert "--quant nf4 with --shard zero3 with --precision bf16-mixed is not modelled" in line


def test_yaml_config_refuses_it(tmp_path):
    path = tmp_path / "qlora.yaml"
    path.write_text(f"model: {model_ref('hf:llama-tiny')}\nbatch: 1\nseq: 16\nlora: r=8\nquant: nf4\n"
                    "world_size: 2\nshard: zero1\n")
    # a YAML config's refusal names its keys, not the flags (issue 22, item 28; spec/options.as_yaml_keys)
    with pytest.raises(MemestError, match="quant: nf4 with shard: zero1 is not modelled"):
        load_config(path).spec()
    line = _one_line(CliRunner().invoke(app, ["check", str(path), "--gpu", "1GB"]))
    assert "quant: nf4 with shard: zero1 is not modelled" in line and "--quant" not in line


def test_check_override_that_shards_a_quantized_config_is_refused(tmp_path):
    path = tmp_path / "qlora.yaml"
    path.write_text(f"model: {model_ref('hf:llama-tiny')}\nbatch: 1\nseq: 16\nlora: r=8\nquant: nf4\n")
    line = _one_line(CliRunner().invoke(app, ["check", str(path), "--gpu", "1GB", "--world-size", "2", "--shard", "zero1"]))
    assert "--shard zero1" in line and "not modelled" in line


def test_api_refuses_it():
    # the API's error names its keywords (issue 22 item 27)
    with pytest.raises(MemestError, match="quant fp4 with shard='zero1' is not modelled"):
        memest.estimate(model_ref("hf:llama-tiny"), batch=1, seq=16, lora="r=8", quant="fp4", world_size=2,
                        shard="zero1", target="cpu")


def test_plan_parallel_refuses_a_quantized_base():
    args = ["plan-parallel", model_ref("hf:llama-tiny"), "--gpus", "2", "--gpu", "1GB", "--batch", "1", "--seq", "16",
            "--target", "cpu", *QLORA]
    line = _one_line(CliRunner().invoke(app, args))
    assert "plan-parallel with --quant nf4" in line and "not modelled" in line


def test_advise_never_proposes_qlora_with_sharding_and_lays_out_no_quantized_base():
    """advise on a bf16-mixed QLoRA base that does not fit: its ZeRO-3 / offload remedies are not modelled with
    --quant and are not offered; --gpus records the planner's refusal and the other savers still stand."""
    args = ["advise", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "32", "--target", "cpu", "--gpu", "1MiB",
            "--precision", "bf16-mixed", "--gpus", "2", "--json", *QLORA]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(result.stdout)
    offered = [doc.get("combination") or {}] + doc["remedies"]
    assert doc["remedies"]
    for remedy in offered:
        changes = remedy.get("changes", {})
        assert changes.get("shard", "none") == "none" and changes.get("offload", "none") == "none", remedy
        assert changes.get("tp", 1) == 1 and changes.get("pp", 1) == 1, remedy
    assert "plan-parallel with --quant nf4" in doc["parallel"]["error"]


def test_advise_does_not_combine_qlora_with_zero3():
    """From an unquantized bf16-mixed base too tight for any single saver, the greedy combination adds ZeRO-3 first (it
    ranks cheaper) and must then leave QLoRA out rather than print a command memest refuses."""
    args = ["advise", model_ref("hf:llama-tiny"), "--batch", "2", "--seq", "32", "--target", "cpu", "--gpu", "1MiB",
            "--precision", "bf16-mixed", "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code in (0, 1), result.output
    doc = json.loads(result.stdout)
    for remedy in [doc.get("combination") or {}] + doc["remedies"]:
        changes = remedy.get("changes", {})
        assert not (changes.get("quant") and changes.get("shard", "none") != "none"), remedy
    qlora = [r for r in doc["remedies"] if r["changes"].get("quant") == "nf4"]
    assert qlora and all("--shard" not in r["command"] for r in qlora)


def test_ddp_over_a_quantized_base_stays_allowed():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), lora="r=8", quant="nf4", world_size=2, target="cpu")
    assert spec.dp == 2


DDP_CASES = [
    ("nf4", "bf16"),
    ("fp4", "fp32"),
    ("int8", "bf16"),
]
REL_TOL = 0.001  # the harness is deterministic (main e2465d4); measured to within 0.01% when written


def _lowest(spec, ranks: list[dict], traced: int) -> list[dict]:
    """``ranks``, measured again while one reads above the trace by more than REL_TOL (conftest.lowest_of_runs: gloo's
    worker can free a collective's buffer late on a loaded machine; a low estimate still fails on every run)."""
    return lowest_of_runs(spec, ranks, traced=lambda rank: traced * (1 + REL_TOL))


def _ddp_spec(quant: str, precision: str) -> RunSpec:
    return RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, target="cpu", precision=precision,
                   lora="r=8,targets=all-linear", quant=quant, world_size=2)


@pytest.fixture(scope="module")
def ddp_measured():
    """Both cases run for real on 2 gloo ranks, in one set of processes, on first use."""
    specs = [_ddp_spec(*case) for case in DDP_CASES]
    return dict(zip(DDP_CASES, measure_distributed_peaks(specs), strict=True))


@pytest.mark.parametrize("case", DDP_CASES, ids=[f"{q}-{p}" for q, p in DDP_CASES])
def test_ddp_over_a_quantized_base_matches_real_gloo_ranks(case, ddp_measured):
    """DDP (--world-size 2, --shard none) over the 4-bit and int8 stand-ins with LoRA adapters: every rank's traced peak
    against the same step run for real on 2 gloo processes (DDP buckets only the adapters' gradients)."""
    spec = _ddp_spec(*case)
    traced = trace_step(load_source(spec.model), spec).peak()[0]
    for rank in _lowest(spec, ddp_measured[case], traced):
        error = (traced - rank["peak_bytes"]) / rank["peak_bytes"]
        assert abs(error) <= REL_TOL, f"rank {rank['rank']}: traced {traced} B, measured {rank['peak_bytes']} B"


def test_ddp_over_a_wide_quantized_base_is_within_one_percent_of_real_gloo_ranks():
    """A config whose 4-bit weights dominate (llama-tiny-wide): DDP over the stand-in reads 0.48% below the real
    ranks when written (trace 11,432,652 B, measured 11,488,112 B; plain LoRA DDP on the same config, no --quant:
    -0.19%); DDP's per-forward broadcast of module buffers (the stand-in keeps the quantization state as buffers,
    bitsandbytes keeps it on the weight) is the suspected cause, not established. The test holds it under 1%."""
    spec = RunSpec(model=model_ref("hf:llama-tiny-wide"), batch=1, seq=16, target="cpu", precision="bf16",
                   lora="r=8,targets=all-linear", quant="nf4", world_size=2)
    traced = trace_step(load_source(spec.model), spec).peak()[0]
    for rank in _lowest(spec, measure_distributed_peaks([spec])[0], traced):
        error = (traced - rank["peak_bytes"]) / rank["peak_bytes"]
        assert abs(error) <= 0.01, f"rank {rank['rank']}: traced {traced} B, measured {rank['peak_bytes']} B"


# FSDP-QLoRA: --shard zero3 over a 4-bit base, the packed weights stored as the model's dtype
FSDP_CASES = [
    ("nf4", "bf16", True, "zero3"),  # the recipe: bf16 weights, bnb_4bit_quant_storage=bfloat16, double quantization
    ("fp4", "fp32", False, "zero3"),
    ("nf4", "bf16", True, "zero2"),  # FSDP2 reshard_after_forward=False (SHARD_GRAD_OP)
    ("nf4", "bf16", True, "zero3-wide"),  # the 4-bit weights dominate (vocabulary 128)
    ("nf4", "bf16", True, "zero3-offload"),  # FSDP2 CPUOffloadPolicy (--offload params)
]


def _fsdp_spec(quant: str, precision: str, double_quant: bool, shard: str, target: str = "cpu") -> RunSpec:
    shard, *extra = shard.split("-")
    model, batch, seq = ("hf:llama-tiny-wide", 1, 16) if "wide" in extra else ("hf:llama-tiny", 2, 32)
    return RunSpec(model=model_ref(model), batch=batch, seq=seq, target=target, precision=precision,
                   lora="r=8,targets=all-linear", quant=quant, double_quant=double_quant, world_size=2, shard=shard,
                   offload="params" if "offload" in extra else "none")


@pytest.fixture(scope="module")
def fsdp_measured():
    specs = [_fsdp_spec(*case) for case in FSDP_CASES]
    return dict(zip(FSDP_CASES, measure_distributed_peaks(specs), strict=True))


@pytest.mark.parametrize("case", FSDP_CASES, ids=[f"{q}-{p}-{sh}" for q, p, _, sh in FSDP_CASES])
def test_fsdp_qlora_matches_real_gloo_ranks(case, fsdp_measured):
    """FSDP2 fully_shard over the 4-bit stand-in (packed weights in the model's dtype, sharded and all-gathered
    per block; the quantization state whole on each rank; only the adapters' gradients reduce-scattered and
    their optimizer state sharded): every rank's traced peak against 2 real gloo ranks."""
    spec = _fsdp_spec(*case)
    result = trace_step(load_source(spec.model), spec)
    # on a CPU the host of an offloading run is the same memory: device + host together (as tests/test_sharding.py)
    traced = result.combined_peak() if spec.offload != "none" else result.peak()[0]
    for rank in _lowest(spec, fsdp_measured[case], traced):
        error = (traced - rank["peak_bytes"]) / rank["peak_bytes"]
        assert abs(error) <= REL_TOL, f"rank {rank['rank']}: traced {traced} B, measured {rank['peak_bytes']} B"
    assert any("bnb_4bit_quant_storage" in note for note in result.notes)


OFFLOAD_CASE = ("nf4", "bf16", True, "zero3-offload")


def test_fsdp_qlora_cpu_offload_host_column_is_the_real_ranks_sharded_state(fsdp_measured):
    """FSDP2's CPUOffloadPolicy over the 4-bit base: the host column holds, byte for byte, what every real gloo rank
    holds as the last optimizer step begins (the local shards of every parameter, the packed 4-bit storage among
    them, in FSDP's padded storage; the adapters' sharded gradients; AdamW's state), and the device holds none of it.
    The quantization state (buffers, no parameter) stays on the device, where FSDP2 puts buffers; the same step
    without offloading holds the same bytes in one place."""
    from memest.parallel.distributed import model_state_bytes
    from memest.trace import Category, Phase

    spec = _fsdp_spec(*OFFLOAD_CASE)
    trace = trace_step(load_source(spec.model), spec)
    state = model_state_bytes(trace)
    for rank in fsdp_measured[OFFLOAD_CASE]:
        assert state["host"] == rank["state_bytes"], f"rank {rank['rank']}"
    assert state["device"] == {"parameters": 0, "gradients": 0, "optimizer_state": 0}
    packed = [rec for rec in trace.storages if rec.host and rec.category is Category.PARAMETERS and rec.module
              and any(rec.module.endswith(p) for p in ("q_proj.base_layer", "down_proj.base_layer"))]
    assert packed, "the sharded packed 4-bit storage is host memory"
    for rec in trace.storages:
        if rec.host:
            assert rec.phase is Phase.OPTIMIZER or rec.category in (
                Category.PARAMETERS, Category.GRADIENTS, Category.OPTIMIZER_STATE), rec
        if rec.category is Category.BUFFERS:
            assert not rec.host, rec
    plain = trace_step(load_source(spec.model), _fsdp_spec("nf4", "bf16", True, "zero3"))
    assert trace.combined_peak() == plain.peak()[0]
    assert model_state_bytes(plain)["device"] == state["host"]


def test_fsdp_qlora_cpu_offload_on_a_gpu_copies_each_unit_s_host_shards_in():
    """--target cuda (no real run: a CPU moves nothing): each FSDP unit's all-gather first copies its host shards
    (the packed 4-bit storage with the rest) to the device, so one forward's copies add up to the host parameters."""
    from memest.trace import Category, Phase

    spec = _fsdp_spec(*OFFLOAD_CASE, target="cuda")
    trace = trace_step(load_source(spec.model), spec)
    host_params = sum(rec.nbytes for rec in trace.storages if rec.host and rec.category is Category.PARAMETERS)
    copies = [rec for rec in trace.storages if rec.op == "host-to-device copy of offloaded shards"]
    first_forward = sum(rec.nbytes for rec in copies if rec.iteration == 1 and rec.phase is Phase.FORWARD)
    assert host_params > 0 and first_forward == host_params
    assert all(not rec.host for rec in copies)
    plain = trace_step(load_source(spec.model), _fsdp_spec("nf4", "bf16", True, "zero3", target="cuda"))
    assert trace.peak()[0] < plain.peak()[0]


def test_fsdp_qlora_stand_in_stores_the_packed_weight_in_the_model_dtype():
    from memest.features.quant import Linear4bitModel, stored_layout

    layer = Linear4bitModel(torch.nn.Linear(96, 64, bias=False, dtype=torch.bfloat16), "nf4", True, torch.bfloat16,
                            torch.bfloat16)
    assert layer.weight.dtype == torch.bfloat16 and tuple(layer.weight.shape) == (96 * 64 // 4, 1)
    assert layer.weight.numel() * 2 == stored_layout(96 * 64, True)["weight"]


class _Adapted(torch.nn.Module):
    def __init__(self, base, adapter):
        super().__init__()
        self.base, self.adapter = base, adapter

    def forward(self, x):
        return self.base(x) + self.adapter(x)


def _bnb_rank(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One gloo rank: bitsandbytes' own Linear4bit (quant_storage=bfloat16) and memest's stand-in, each under
    FSDP2 fully_shard; each weight's local shard and the quantization state's bytes, and a real step."""
    import os

    import bitsandbytes as bnb
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from memest.features.quant import Linear4bitModel

    # a forked child of a process that ran OpenMP kernels (this pytest session) hangs at its first parallel
    # region (GNU OpenMP's pool does not survive fork; seen: CI stopped in bitsandbytes' quantize_4bit): one thread
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        out_f, in_f = 192, 128
        real = bnb.nn.Linear4bit(in_f, out_f, bias=False, compute_dtype=torch.bfloat16, compress_statistics=True,
                                 quant_type="nf4", quant_storage=torch.bfloat16)
        weight = bnb.nn.Params4bit(torch.randn(out_f, in_f, dtype=torch.bfloat16), requires_grad=False,
                                   compress_statistics=True, quant_type="nf4", quant_storage=torch.bfloat16,
                                   module=real)
        real.weight = weight._quantize("cpu")
        state = real.weight.quant_state
        state_bytes = sum(t.numel() * t.element_size() for t in
                          (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code))
        stand_in = Linear4bitModel(torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16), "nf4", True,
                                   torch.bfloat16, torch.bfloat16)
        buffer_bytes = sum(b.numel() * b.element_size() for b in stand_in.buffers())
        adapter = torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.bfloat16)
        model = _Adapted(real, adapter)
        fully_shard(real)
        fully_shard(stand_in)
        fully_shard(model)
        x = torch.randn(4, in_f, dtype=torch.bfloat16, requires_grad=True)
        model(x).float().sum().backward()
        local = real.weight.to_local()
        mine = stand_in.weight.to_local()
        row = {"real_shape": list(real.weight.shape), "real_local": local.numel() * local.element_size(),
               "real_dtype": str(local.dtype), "stand_in_shape": list(stand_in.weight.shape),
               "stand_in_local": mine.numel() * mine.element_size(), "state_bytes": state_bytes,
               "buffer_bytes": buffer_bytes, "adapter_grad": adapter.weight.grad is not None}
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(row, f)
    finally:
        dist.destroy_process_group()


def test_fsdp2_shards_bitsandbytes_own_4bit_weights_as_the_stand_in():
    """bitsandbytes 0.50's Linear4bit with quant_storage=bfloat16 under FSDP2 on 2 real gloo ranks (bitsandbytes
    runs 4-bit on CPU): its packed weight is sharded as the stand-in's is, byte for byte on every rank, the
    quantization state (no parameter) stays whole and equals the stand-in's buffers, and a step runs."""
    pytest.importorskip("bitsandbytes")
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_bnb_rank, args=(2, port, out_dir), nprocs=2, join=True, start_method="fork")
        rows = [json.loads(open(f"{out_dir}/rank{r}.json").read()) for r in range(2)]
    for row in rows:
        assert row["real_dtype"] == "torch.bfloat16" and row["real_shape"] == row["stand_in_shape"]
        assert row["real_local"] == row["stand_in_local"] == 192 * 128 // 2 // 2
        assert row["state_bytes"] == row["buffer_bytes"] and row["adapter_grad"]
