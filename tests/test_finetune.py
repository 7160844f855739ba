"""Fine-tuning (issue 12): --lora through peft's own LoraConfig / get_peft_model, --freeze, --quant nf4|fp4
(bitsandbytes' Linear4bit layout, features/quant.py) and paged optimizers.

LoRA and --freeze are checked against the same step run for real on CPU (validate/cpu_truth.py: peft runs
for real there) within 0.5%. The 4-bit layout cannot run for real on CUDA here; its stored bytes are checked
against bitsandbytes' own quantize_4bit of a real tensor, its dequantisation temporaries against the
allocations bitsandbytes' source makes (features/quant.py cites each), and the stand-in's trace against its own
real CPU run."""

import pytest
import torch

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.spec.config import config_from_dict
from memest.spec.lora import lora_settings, parse_lora
from memest.validate.cpu_truth import measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")

REL_TOL = 0.005
QV = "r=8,alpha=16,targets=q_proj,v_proj"

CASES = [
    # (model, extra RunSpec fields)
    ("hf:llama-tiny", {"lora": QV}),
    ("hf:llama-tiny", {"lora": "r=16,alpha=32,dropout=0.05,targets=all-linear"}),
    ("hf:llama-tiny", {"lora": "r=4,targets=q_proj,k_proj,v_proj,o_proj", "checkpointing": "blocks"}),
    ("hf:llama-tiny", {"lora": "r=8,targets=all-linear", "grad_accum": 3}),
    ("hf:llama-tiny", {"lora": QV, "precision": "bf16-mixed"}),
    ("hf:llama-tiny", {"lora": "r=32,dropout=0.1,targets=gate_proj,up_proj,down_proj", "outputs": "freed"}),
    ("hf:gpt2-tiny", {"lora": "r=8,dropout=0.05,targets=c_attn"}),  # GPT-2's Conv1D (peft's fan_in_fan_out)
    ("hf:gpt2-tiny", {"lora": "r=8,targets=c_attn,c_proj", "quant": "nf4"}),  # Conv1D quantized as transformers does
    ("hf:llama-tiny", {"freeze": "model.embed_tokens"}),  # full fine-tuning, frozen embedding
    ("hf:llama-tiny", {"freeze": "model.embed_tokens,model.layers.0.*", "optim": "sgd-momentum"}),
    ("hf:llama-tiny", {"lora": QV, "freeze": "model.norm"}),
    ("hf:llama-tiny", {"lora": "r=8,targets=all-linear", "quant": "nf4", "precision": "bf16"}),  # the stand-in
    ("hf:llama-tiny", {"lora": QV, "quant": "fp4", "precision": "bf16", "prepare_kbit": True}),  # + peft's fp32 cast
]


def _id(case):
    name, extra = case
    return "-".join([name[3:]] + [f"{k}={v}" for k, v in extra.items()])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_fine_tuning_matches_the_real_cpu_step(case):
    name, extra = case
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=2, seq=32, optim=extra.pop("optim", "adamw"), target="cpu", **extra)
    source = load_source(ref)
    trace = trace_step(source, spec)
    estimated = trace.peak()[0]
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id(case)}: estimated {estimated} B, measured {real} B ({100 * error:+.3f}%)"
    assert 0 < trace.trainable_count < trace.param_count


def _peft_trainable(ref: str, spec: RunSpec) -> tuple[int, int]:
    """peft's own count on a real model built the same way."""
    from peft import LoraConfig, get_peft_model

    model = load_source(ref).build_model()
    config = LoraConfig(**lora_settings(spec.lora).peft_kwargs(), task_type="CAUSAL_LM")
    return get_peft_model(model, config).get_nb_trainable_parameters()


def test_adapters_are_peft_s_own_in_fp32_with_no_state_for_the_base():
    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=64, optim="adamw", target="cpu", precision="bf16", lora=QV)
    trace = trace_step(load_source(ref), spec)
    trainable, total = _peft_trainable(ref, spec)
    assert trace.trainable_count == trainable and trace.param_count == total
    grads = sum(r.nbytes for r in trace.storages if r.category.value == "gradients" and r.iteration == 1)
    state = sum(r.nbytes for r in trace.storages if r.category.value == "optimizer_state")
    assert grads == 4 * trainable  # fp32 adapter gradients (peft autocast_adapter_dtype), none for the bf16 base
    assert state >= 2 * 4 * trainable and state < 2 * 4 * trainable + 4096  # exp_avg, exp_avg_sq (+ step counters)


# -- the 4-bit layout ---------------------------------------------------------------------------------

def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(1024, 512), (64 * 257, 64), (1000, 333)])
def test_stored_bytes_equal_bitsandbytes_own_quantization(quant_type, double_quant, shape):
    """bitsandbytes' quantize_4bit (its CPU backend) on a real tensor against the stand-in's storages."""
    F = pytest.importorskip("bitsandbytes.functional")
    from memest.features.quant import Linear4bitModel, stored_layout

    weight = torch.randn(shape, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(weight, quant_type=quant_type, compress_statistics=double_quant)
    bnb = {"weight": _storage_bytes(packed), "absmax": _storage_bytes(state.absmax), "code": _storage_bytes(state.code)}
    if double_quant:
        bnb |= {"nested_absmax": _storage_bytes(state.state2.absmax), "nested_code": _storage_bytes(state.state2.code),
                "offset": _storage_bytes(state.offset)}
    n = shape[0] * shape[1]
    assert stored_layout(n, double_quant) == bnb
    layer = Linear4bitModel(torch.nn.Linear(shape[1], shape[0], bias=False, dtype=torch.bfloat16), quant_type,
                            double_quant, torch.bfloat16)
    ours = {name: _storage_bytes(t) for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    assert ours == bnb
    per_param = sum(bnb.values()) / n
    assert per_param == pytest.approx(0.5 + (1 / 64 + 4 / (64 * 256) if double_quant else 4 / 64), rel=0.05)


def _allocations(fn) -> list[int]:
    """Bytes of every tensor allocation ``fn`` makes, in order (torch.profiler memory events, as cpu_truth reads
    them), leaving out what a CPU kernel allocates and frees inside itself (oneDNN's bf16 matmul scratch)."""
    from torch.profiler import ProfilerActivity, profile

    from memest.validate.cpu_truth import _allocation_events

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    sizes = [e.extra_fields.alloc_size for e in _allocation_events(prof)]
    return [s for k, s in enumerate(sizes) if s > 0 and (k + 1 == len(sizes) or sizes[k + 1] != -s)]


def test_dequantisation_temporaries_follow_bitsandbytes_source():
    """Forward (backends/cuda/ops.py _dequant_linear_fallback): float32 absmax_dq and absmax_dq + offset per
    64-element block, then the weight in the compute dtype; backward (functional.dequantize_4bit): float32
    absmax, the weight in its stored dtype, cast to the gradient's dtype when they differ."""
    from memest.features.quant import Linear4bitModel

    out_f, in_f, tokens = 256, 128, 32
    layer = Linear4bitModel(torch.nn.Linear(in_f, out_f, bias=False, dtype=torch.float32), "nf4", True, torch.bfloat16)
    blocks = out_f * in_f // 64
    x = torch.randn(tokens, in_f, dtype=torch.bfloat16, requires_grad=True)
    peaks = {}

    def step():
        y = layer(x)
        peaks["y"] = y
        y.backward(torch.ones_like(y))

    sizes = _allocations(step)
    weight_bf16, weight_fp32 = 2 * out_f * in_f, 4 * out_f * in_f
    forward = [4 * blocks, 4 * blocks, weight_bf16, 2 * tokens * out_f]
    backward = [4 * blocks, weight_fp32, weight_bf16, 2 * tokens * in_f]  # stored fp32, cast to bf16 gradients
    incoming = [2 * tokens * out_f]  # ones_like: the gradient backward starts from
    assert sizes == forward + incoming + backward


def test_real_bitsandbytes_dequantizes_the_whole_weight():
    """The size the stand-in allocates for a dequantised weight is what bitsandbytes returns."""
    F = pytest.importorskip("bitsandbytes.functional")
    weight = torch.randn(512, 256, dtype=torch.bfloat16)
    packed, state = F.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    w = F.dequantize_4bit(packed, state)
    assert w.shape == weight.shape and w.dtype == torch.bfloat16


def test_quantized_parameter_count_is_the_model_s():
    ref = model_ref("hf:llama-tiny")
    plain = trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cpu", lora=QV))
    quant = trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cpu", lora=QV, quant="nf4"))
    assert quant.param_count == plain.param_count
    linear = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 172)  # llama-tiny's two layers' linear weights
    assert plain.param_bytes - quant.param_bytes == 4 * linear - linear // 2  # fp32 -> packed 4-bit (buffers apart)
    assert any("--quant nf4" in n for n in quant.notes)


def test_prepare_kbit_casts_the_non_quantized_weights_to_fp32():
    ref = model_ref("hf:llama-tiny")
    fields = dict(model=ref, batch=1, seq=16, target="cpu", precision="bf16", lora=QV, quant="nf4")
    plain = trace_step(load_source(ref), RunSpec(**fields))
    prepared = trace_step(load_source(ref), RunSpec(**fields, prepare_kbit=True))
    sixteen_bit = 2 * 1000 * 64 + 5 * 64  # embedding, head, 5 RMSNorm weights of llama-tiny
    assert prepared.param_bytes - plain.param_bytes == 2 * sixteen_bit
    assert any("prepare_model_for_kbit_training cast" in n for n in prepared.notes)


# -- paged optimizers ---------------------------------------------------------------------------------

def test_paged_optimizer_state_is_host_pageable_on_cuda():
    import memest

    def build():
        return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))

    def inputs(batch):
        return (torch.randn(batch, 512),)

    paged = memest.estimate(build, inputs, batch=4, optim="paged_adamw_8bit")
    plain = memest.estimate(build, inputs, batch=4, optim="adam8bit")
    big = 512 * 512  # >= 1e5 elements: bitsandbytes' get_state_buffer pages it
    assert plain.trace.host_peak() == 0
    assert paged.trace.host_peak() == 2 * big  # state1 + state2, uint8
    assert plain.breakdown["optimizer_state"] - paged.breakdown["optimizer_state"] == 2 * big
    assert any("unified memory" in n for n in paged.report.notes)
    fp32 = memest.estimate(build, inputs, batch=4, optim="paged-adamw-32bit")
    assert fp32.trace.host_peak() == 2 * 4 * big
    cpu = memest.estimate(build, inputs, batch=4, optim="paged-adamw-8bit", target="cpu")
    assert cpu.trace.host_peak() == 0  # bitsandbytes falls back to ordinary buffers on CPU


# -- flags, configs, API ------------------------------------------------------------------------------

def test_lora_text_mapping_and_bool_canonicalise_alike():
    text = "r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj"
    assert parse_lora(text) == text
    assert parse_lora({"r": 16, "lora_alpha": 32, "dropout": 0.05, "targets": ["q_proj", "k_proj"]}) == text
    assert parse_lora({"rank": 8, "targets": "all-linear"}) == "r=8,targets=all-linear"
    assert parse_lora(True) == "on" and parse_lora(None) == "" and parse_lora("none") == ""
    assert lora_settings(text).peft_kwargs() == {"r": 16, "lora_alpha": 32.0, "lora_dropout": 0.05,
                                                 "target_modules": ["q_proj", "k_proj"]}
    assert lora_settings("targets=all-linear").peft_kwargs() == {"target_modules": "all-linear"}


@pytest.mark.parametrize("fields,match", [
    ({"lora": "r=0"}, "r: a whole number"),
    ({"lora": "rank=8,beta=3"}, "unknown key 'beta'"),
    ({"lora": "q_proj"}, "key=value"),
    ({"quant": "nf4"}, "add --lora"),
    ({"lora": "r=8", "mode": "inference"}, "fine-tuning"),
    ({"lora": "r=8", "prepare_kbit": True}, "add --quant"),
    ({"quant": "int4", "lora": "r=8"}, "choose one of"),
])
def test_bad_fine_tuning_options_are_one_line_errors(fields, match):
    with pytest.raises(MemestError, match=match):
        RunSpec(model="hf:gpt2", **fields)


def test_run_config_takes_lora_mapping_quant_and_freeze():
    cfg = config_from_dict({"model": "hf:llama-3.1-8b", "lora": {"r": 16, "alpha": 32, "targets": "all-linear"},
                            "quant": "nf4", "double_quant": False, "freeze": "model.embed_tokens",
                            "optim": "paged_adamw_8bit"})
    spec = cfg.spec()
    assert spec.lora == "r=16,alpha=32,targets=all-linear" and spec.quant == "nf4" and not spec.double_quant
    assert spec.optim == "paged-adamw-8bit" and spec.freeze == "model.embed_tokens"
    with pytest.raises(MemestError, match="lora"):
        config_from_dict({"model": "hf:gpt2", "lora": 3}).spec()


def test_freeze_pattern_matching_nothing_names_the_parameters():
    ref = model_ref("hf:llama-tiny")
    with pytest.raises(MemestError, match="matches no parameter.*model.embed_tokens"):
        trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cpu", freeze="encoder.*"))


def test_lora_with_no_matching_target_is_peft_s_error():
    ref = model_ref("hf:llama-tiny")
    with pytest.raises(MemestError, match="peft's get_peft_model"):
        trace_step(load_source(ref), RunSpec(model=ref, batch=1, seq=16, target="cpu", lora="targets=nothing_here"))


def test_chunked_loss_head_sees_through_peft():
    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=64, target="cpu", lora=QV, loss_head="chunked")
    source = load_source(ref)
    estimated = trace_step(source, spec).peak()[0]
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    assert abs(estimated - real) / real <= REL_TOL


def test_advise_offers_lora_and_qlora_for_a_causal_lm():
    from memest.plan.advise import candidates
    from memest.plan.runner import Runner

    runner = Runner(RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=64))
    names = {name: changes for name, changes, _ in candidates(runner)}
    lora = [c for c in names.values() if "lora" in c]
    assert len(lora) == 2 and any(c.get("quant") == "nf4" for c in lora)


def test_memest_s_4bit_lora_layer_allocates_as_peft_s_own(monkeypatch):
    """memest carries peft's LoRA forward for bitsandbytes' Linear4bit (peft defines the class only where it
    imports bitsandbytes); with bitsandbytes installed, peft's own class on the stand-in traces the same step."""
    pytest.importorskip("bitsandbytes")
    from peft.tuners.lora import bnb as peft_bnb

    from memest.features import quant

    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", precision="bf16", lora="r=8,targets=all-linear",
                   quant="nf4")
    ours = trace_step(load_source(ref), spec)
    monkeypatch.setattr(quant, "lora_layer_class", lambda: peft_bnb.Linear4bit)
    peft_s = trace_step(load_source(ref), spec)
    assert ours.peak() == peft_s.peak() and len(ours.storages) == len(peft_s.storages)


def test_whatif_and_max_batch_plan_a_qlora_step():
    """The planners take the fine-tuning fields like any other: whatif's fitted points equal direct traces,
    max-batch is exact at its boundary."""
    from memest.plan.runner import Runner
    from memest.plan.search import largest_fitting
    from memest.plan.whatif import sweep

    run = Runner(RunSpec(model=model_ref("hf:llama-tiny"), batch=2, seq=32, precision="bf16",
                         lora="r=8,targets=all-linear", quant="nf4", optim="paged-adamw-8bit"))
    capacity = 2 * 2**30
    result = sweep(run, [1, 2], [32, 64], capacity=capacity)
    for p in result.points:
        direct = run.run(batch=p.batch, seq=p.seq)
        assert abs(p.needed_bytes - direct.needed_bytes) <= 0.01 * direct.needed_bytes
    cpu = Runner(RunSpec(model=model_ref("hf:llama-tiny"), seq=32, target="cpu", lora=QV))
    budget = cpu.run(batch=3).needed_bytes
    found = largest_fitting(cpu, "batch", budget)
    assert found.value >= 3 and not cpu.run(batch=found.value + 1).fits(budget)
