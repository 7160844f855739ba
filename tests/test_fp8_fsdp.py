"""--fp8 over FSDP2 ranks (--world-size 2 --shard zero2|zero3, features/fp8.py): every gloo rank's real CPU peak
(validate/distributed_truth.py, the harness of the other FSDP truth tests) against memest's traced rank.

Two modes, as torchtitan exposes them: --fp8-all-gather high-precision (Float8Linear layers sharded by FSDP2, the
high-precision weight all-gathered; tensorwise and rowwise) and float8 / float8-precomputed (torchao's
enable_fsdp_float8_all_gather: WeightWithDynamicFloat8CastTensor's fsdp_pre_all_gather / fsdp_post_all_gather
hooks run by FSDP2; + precompute_float8_dynamic_scale_for_fsdp after each optimizer step; tensorwise only).

Residual: examples/mlp.py under the float8 all-gather reads 12 B below both ranks, the same 12 B the plain FSDP2 step
of that model reads below without --fp8 (traced 252,264,776 B, real 252,264,788 B on 2026-11-28): small CPU scalars
the plain FSDP2 step keeps at its peak (tests/test_optim_in_backward.py's FSDP_TOL note), not float8's."""

import importlib.util

import pytest

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.config import load_config

from .conftest import lowest_of_runs, model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels; tests/test_fp8.py runs oneDNN's)
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao not installed (memest[fp8])")

HP, F8, F8P = "high-precision", "float8", "float8-precomputed"
# (model, batch, seq, recipe, shard, all-gather, B the trace may read below every rank)
CASES = [
    ("transformer", 2, 64, "tensorwise", "zero3", HP, 0),
    ("transformer", 2, 64, "rowwise", "zero3", HP, 0),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero3", HP, 0),
    ("hf:llama-tiny", 2, 128, "rowwise", "zero3", HP, 0),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero2", HP, 0),
    ("hf:llama-tiny", 2, 128, "rowwise", "zero2", HP, 0),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero3", F8, 0),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero2", F8, 0),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero3", F8P, 0),
    # weights make this one's peak: the float8 all-gather's saving shows in the real ranks (module docstring: 12 B)
    ("mlp", 4, None, "tensorwise", "zero3", HP, 0),
    ("mlp", 4, None, "tensorwise", "zero3", F8, 12),
    ("mlp", 4, None, "tensorwise", "zero3", F8P, 12),
    # FSDP2's MixedPrecisionPolicy (bf16 all-gather; torchao's post-all-gather hook takes its param_dtype) and AdamW
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero3", HP, 0, (("precision", "bf16-mixed"), ("optim", "adamw"))),
    ("hf:llama-tiny", 2, 128, "tensorwise", "zero3", F8, 0, (("precision", "bf16-mixed"), ("optim", "adamw"))),
]


def _spec(name, batch, seq, recipe, shard, all_gather, residual=0, more=()) -> RunSpec:
    return RunSpec(model=model_ref(name), batch=batch, seq=seq, target="cpu", fp8=recipe, fp8_all_gather=all_gather,
                   world_size=2, shard=shard, **{"optim": "sgd", **dict(more)})


def _id(case) -> str:
    name, _, _, recipe, shard, all_gather, *rest = case
    more = dict(rest[1]) if len(rest) > 1 else {}
    return "-".join([name.removeprefix("hf:"), recipe, shard, all_gather, *more.values()])


@pytest.fixture(scope="module")
def measured():
    """Every case's ranks, measured once (one set of gloo processes for all of them)."""
    from memest.validate.distributed_truth import measure_distributed_peaks

    return dict(zip(CASES, measure_distributed_peaks([_spec(*c) for c in CASES]), strict=True))


def _traced(spec: RunSpec):
    return trace_step(load_source(spec.model), spec)


@needs_torchao
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_every_gloo_rank_reads_the_traced_peak(case, measured):
    spec, residual = _spec(*case), case[6]
    trace = _traced(spec)
    traced = trace.peak()[0]
    ranks = lowest_of_runs(spec, measured[case], traced=lambda r: traced + residual)
    assert len(ranks) == 2
    for rank in ranks:
        assert 0 <= rank["peak_bytes"] - traced <= residual, (_id(case), traced, ranks)
    note = next(n for n in trace.notes if n.startswith("--fp8 "))
    assert ("in float8" in note) is (case[5] != HP) and ("precompute" in note) is (case[5] == F8P), note


@needs_torchao
def test_the_float8_all_gather_saving_is_real_and_traced(measured):
    """examples/mlp.py: the float8 all-gather lowers every real rank's peak, and the trace by the same bytes
    (to the 12 B residual)."""
    hp, f8 = (next(c for c in CASES if c[0] == "mlp" and c[5] == mode) for mode in (HP, F8))
    real_hp = max(r["peak_bytes"] for r in measured[hp])
    real_f8 = max(r["peak_bytes"] for r in measured[f8])
    assert real_f8 < real_hp
    saved = _traced(_spec(*hp)).peak()[0] - _traced(_spec(*f8)).peak()[0]
    assert 0 <= saved - (real_hp - real_f8) <= 12, (saved, real_hp - real_f8)


@needs_torchao
def test_precompute_runs_after_every_optimizer_step_in_the_trace():
    """float8-precomputed: torchao's precompute_float8_dynamic_scale_for_fsdp runs once per optimizer step (the
    optimizer's step post-hook) and leaves a scale on every float8 weight; float8 alone never runs it."""
    import torchao.float8 as ao
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    calls = []
    original = ao.precompute_float8_dynamic_scale_for_fsdp

    def counted(model):
        original(model)
        wrapped = [m.weight._local_tensor for m in model.modules()
                   if isinstance(getattr(getattr(m, "weight", None), "_local_tensor", None), WeightWithDynamicFloat8CastTensor)]
        calls.append((len(wrapped), sum(w._precomputed_scale is not None for w in wrapped)))

    ao.precompute_float8_dynamic_scale_for_fsdp = counted
    try:
        _traced(_spec(*CASES[8]))
        precomputed, calls[:] = list(calls), []
        _traced(_spec(*CASES[6]))
    finally:
        ao.precompute_float8_dynamic_scale_for_fsdp = original
    # llama-tiny: q, k, v and o of its 2 layers are converted (172 and 1000 are not multiples of 16); 2 iterations
    assert precomputed == [(8, 8), (8, 8)], precomputed
    assert calls == []


@needs_torchao
def test_multihead_attention_is_refused_under_the_float8_all_gather():
    """nn.MultiheadAttention reads out_proj.weight with F.linear: torchao's float8 addmm asserts on the gathered
    float8 weight, so the estimate refuses it in one line rather than failing inside torchao."""
    spec = _spec("transformer", 1, 8, "tensorwise", "zero3", F8)
    with pytest.raises(MemestError, match="nn.MultiheadAttention .* out_proj") as err:
        _traced(spec)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("more,needle", [
    ({"world_size": 2}, "--shard none"),  # DDP
    ({"world_size": 2, "shard": "zero1"}, "--shard zero1"),
    ({"world_size": 4, "shard": "zero3", "tp": 2}, "--tp 2"),
    ({"world_size": 4, "shard": "zero3", "pp": 2}, "--pp 2"),
    ({"world_size": 4, "shard": "zero3", "cp": 2}, "--cp 2"),
    ({"world_size": 2, "shard": "zero3", "offload": "params"}, "--offload params"),
    ({"world_size": 2, "shard": "zero3", "optim_in_backward": True}, "--optim-in-backward"),
    ({"lora": "r=8"}, "--lora"),
    ({"quant": "nf4", "lora": "r=8"}, "--quant"),
])
def test_what_is_not_traced_is_refused_in_one_line(more, needle):
    with pytest.raises(MemestError, match="--fp8 tensorwise") as err:
        RunSpec(model="m.py", fp8="tensorwise", **more)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_compiled_blocks_under_fsdp2_are_traced():
    """--compile-scope blocks over FSDP2 ranks with --fp8: traced (every gloo rank checked, tests/test_fp8_compile.py)."""
    RunSpec(model="m.py", fp8="tensorwise", world_size=2, shard="zero3", compile=True, compile_scope="blocks")


@pytest.mark.parametrize("more,needle", [
    ({"fp8": "rowwise", "world_size": 2, "shard": "zero3"}, "tensorwise"),  # torchao asserts tensorwise
    ({"fp8": "none", "world_size": 2, "shard": "zero3"}, "tensorwise"),
    ({"fp8": "tensorwise"}, "--shard zero2 or zero3"),  # nothing to all-gather
    ({"fp8": "tensorwise", "world_size": 2, "shard": "zero1"}, "--shard zero2 or zero3"),
])
def test_the_float8_all_gather_is_refused_where_it_cannot_apply(more, needle):
    with pytest.raises(MemestError, match="--fp8-all-gather float8") as err:
        RunSpec(model="m.py", fp8_all_gather="float8", **more)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)
    with pytest.raises(MemestError, match="--optim-in-backward"):
        RunSpec(model="m.py", fp8="tensorwise", fp8_all_gather=F8P, world_size=2, shard="zero3", optim_in_backward=True)


@needs_torchao
def test_cli_flag_yaml_key_and_api_keyword_reach_it(tmp_path):
    import json

    import memest

    from .conftest import run

    args = ["estimate", model_ref("mlp"), "--batch", "4", "--target", "cpu", "--optim", "sgd", "--world-size", "2",
            "--shard", "zero3", "--fp8", "tensorwise", "--json"]
    cli = {mode: run(*args, "--fp8-all-gather", mode) for mode in (HP, F8)}
    assert all(r.exit_code == 0 for r in cli.values()), [r.output for r in cli.values()]
    peaks = {mode: json.loads(r.stdout)["peak_allocated_bytes"] for mode, r in cli.items()}
    assert peaks[F8] < peaks[HP], peaks
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {model_ref('mlp')}\nworld_size: 2\nshard: zero3\nfp8: tensorwise\nfp8_all_gather: float8\n")
    assert RunSpec(**load_config(path).values).fp8_all_gather == F8
    api = memest.estimate(model_ref("mlp"), batch=4, target="cpu", optim="sgd", world_size=2, shard="zero3",
                          fp8="tensorwise", fp8_all_gather=F8)
    assert api.peak_allocated_bytes == peaks[F8]
    refused = run(*args, "--fp8-all-gather", "float9")
    assert refused.exit_code == 2, refused.output

