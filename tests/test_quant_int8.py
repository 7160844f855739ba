"""--quant int8 (LLM.int8, bitsandbytes' Linear8bitLt; features/quant_int8.py).

bitsandbytes runs Linear8bitLt forward + backward on CPU for real (in training it takes MatMul8bitFp there,
autograd/_functions.py ``matmul``), so the --target cpu stand-in is checked against real bitsandbytes layers
(with peft's own LoRA layer for them) through validate/cpu_truth.py, within 0.5%. The CUDA path
(MatMul8bitLt with bitsandbytes' CUDA ops) cannot run here: its forward allocations are checked against the
source arithmetic call by call, and what it keeps for backward and allocates in backward against bitsandbytes'
own MatMul8bitLt run on CPU (that part of its code is the same on every backend)."""

import pytest
import torch
from torch import nn

from memest.features import quant_int8
from memest.features.quant import _is_conv1d, output_linear
from memest.features.registry import trace_step
from memest.sources import load_source
from memest.spec import RunSpec
from memest.validate.cpu_truth import _allocation_events, measure_cpu_peak

from .conftest import model_ref

# traced and real steps on ATen's CPU kernels alike (conftest.aten_cpu_kernels): the bf16 steps compare to the byte on
# CPUs where oneDNN would run their matmuls (AVX-512/AMX), as on the others
pytestmark = pytest.mark.usefixtures("aten_cpu_kernels")

pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

REL_TOL = 0.005


def _real_linear8bit(linear: nn.Module) -> nn.Module:
    """A bitsandbytes Linear8bitLt as transformers' load_in_8bit builds it (replace_with_bnb_linear: has_fp16_weights
    False, threshold 6.0; Bnb8bitQuantize: Int8Params of the weight, Conv1D's transposed, quantised on .to())."""
    w = linear.weight.data if isinstance(linear, nn.Linear) else linear.weight.data.t()
    layer = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], linear.bias is not None, has_fp16_weights=False,
                                threshold=quant_int8.THRESHOLD)
    layer.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
    if linear.bias is not None:
        layer.bias = nn.Parameter(linear.bias.data, requires_grad=False)
    layer = layer.to("cpu")  # Int8Params._quantize: int8_vectorwise_quant of the weight cast to float16
    # SCB is an attribute of the weight, not a buffer: registered as one (same tensor) so that the ground truth
    # counts it among the bytes alive before the step, as the stand-in's buffer is.
    layer.register_buffer("SCB", layer.weight.SCB)
    return layer


def _quantize_for_real(model: nn.Module, cuda_kernels: bool) -> int:
    assert not cuda_kernels, "the real run is a --target cpu step"
    keep, n = output_linear(model), 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (type(child) is nn.Linear or _is_conv1d(child)) and full not in keep:
                setattr(module, child_name, _real_linear8bit(child))
                n += 1
    model.is_loaded_in_8bit = True  # as transformers marks it: peft then wraps its own bnb Linear8bitLt LoRA layer
    return n


CASES = [
    ("hf:llama-tiny", {"lora": "r=8,targets=all-linear"}),
    ("hf:llama-tiny", {"lora": "r=8,alpha=16,targets=q_proj,v_proj", "precision": "bf16"}),
    ("hf:llama-tiny", {"lora": "r=16,dropout=0.05,targets=all-linear", "precision": "bf16", "checkpointing": "blocks"}),
    ("hf:llama-tiny", {"lora": "r=8,targets=all-linear", "precision": "bf16-mixed", "outputs": "freed"}),
    ("hf:llama-tiny", {"lora": "r=8,targets=q_proj,v_proj", "precision": "bf16", "prepare_kbit": True}),
    ("hf:gpt2-tiny", {"lora": "r=8,targets=c_attn,c_proj"}),  # Conv1D with biases, transposed as transformers does
]


def _id(case):
    name, extra = case
    return "-".join([name[3:]] + [f"{k}={v}" for k, v in extra.items()])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_int8_step_matches_real_bitsandbytes_on_cpu(case, monkeypatch):
    name, extra = case
    ref = model_ref(name)
    spec = RunSpec(model=ref, batch=2, seq=32, optim="adamw", target="cpu", quant="int8", **extra)
    source = load_source(ref)
    trace = trace_step(source, spec)
    estimated = trace.peak()[0]
    monkeypatch.setattr(quant_int8, "quantize_linears", _quantize_for_real)
    real = measure_cpu_peak(source, spec)["peak_bytes"]
    error = (estimated - real) / real
    assert abs(error) <= REL_TOL, f"{_id(case)}: estimated {estimated} B, measured {real} B ({100 * error:+.3f}%)"
    assert any("--quant int8" in n for n in trace.notes)


def test_the_real_run_is_bitsandbytes_and_peft_s_own(monkeypatch):
    """The ground truth above runs bitsandbytes' Linear8bitLt (int8 data) under peft's bnb LoRA layer."""
    from peft.tuners.lora.bnb import Linear8bitLt as PeftLinear8bitLt

    from memest.features.registry import build

    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, target="cpu", quant="int8", lora="r=8,targets=all-linear")
    monkeypatch.setattr(quant_int8, "quantize_linears", _quantize_for_real)
    model = build(load_source(ref), spec).model
    wrapped = [m for m in model.modules() if isinstance(m, PeftLinear8bitLt)]
    assert len(wrapped) == 14 and all(isinstance(m.base_layer, bnb.nn.Linear8bitLt) for m in wrapped)
    assert all(m.base_layer.weight.dtype == torch.int8 for m in wrapped)


# -- stored bytes -------------------------------------------------------------------------------------

def _storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.mark.parametrize("shape", [(1024, 512), (333, 1000), (14336, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_stored_bytes_equal_bitsandbytes_own_int8_quantization(shape, dtype):
    """Int8Params' own quantisation (on .to(device)) of a real tensor against the stand-in's storages."""
    out_f, in_f = shape
    weight = torch.randn(shape, dtype=dtype)
    param = bnb.nn.Int8Params(weight, requires_grad=False, has_fp16_weights=False).to("cpu")
    assert param.data.dtype == torch.int8 and param.CB.data_ptr() == param.data_ptr()  # CB is the data
    assert param.SCB.dtype == torch.float32 and param.SCB.shape == (out_f,)
    bnb_bytes = {"weight": _storage_bytes(param.data), "SCB": _storage_bytes(param.SCB)}
    assert quant_int8.stored_layout(out_f, in_f) == bnb_bytes
    layer = quant_int8.Linear8bitModel(nn.Linear(in_f, out_f, bias=False, dtype=dtype), cuda_kernels=True)
    ours = {name: _storage_bytes(t) for name, t in [*layer.named_parameters(), *layer.named_buffers()]}
    assert ours == bnb_bytes
    assert sum(bnb_bytes.values()) / (out_f * in_f) == 1 + 4 / in_f
    # and bitsandbytes' functional call gives the same layout
    cb, scb, _ = bnb.functional.int8_vectorwise_quant(weight.to(torch.float16))
    assert (cb.dtype, cb.shape, scb.dtype, scb.shape) == (torch.int8, weight.shape, torch.float32, (out_f,))


# -- the CUDA path: MatMul8bitLt ----------------------------------------------------------------------

def _events(fn):
    """(bytes, +1 alloc / -1 free) of every allocation and free ``fn`` makes, in order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [e.extra_fields.alloc_size for e in _allocation_events(prof)]


def test_cuda_forward_allocations_follow_bitsandbytes_source():
    """MatMul8bitLt.forward (frozen weight, threshold 6.0, no outlier) with bitsandbytes' CUDA ops, call by call:
    the float16 input copy; int8_vectorwise_quant: row_stats f32 [M], out_row i8 [M,K], A.abs() f16 [M,K] and the
    bool mask [M,K] (abs freed first), outliers.any() (1 B), mask and float16 copy freed on return;
    subA = empty(0); int8_linear_matmul's int32 [M,N]; int8_mm_dequant's float16 [M,N], .to(bf16) [M,N], float16
    and int32 freed; CA and SCA freed on leaving forward."""
    m, k, n = 48, 128, 96
    layer = quant_int8.Linear8bitModel(nn.Linear(k, n, bias=False, dtype=torch.bfloat16), cuda_kernels=True)
    x = torch.randn(m, k, dtype=torch.bfloat16, requires_grad=True)
    held = {}

    def forward():
        held["y"] = layer(x)

    sizes = [s for s in _events(forward) if abs(s) >= 64]  # CPU's wrapped-scalar temporaries of `>= 6.0` apart
    a16, i32, f16 = 2 * m * k, 4 * m * n, 2 * m * n
    assert [s for s in sizes if s > 0] == [a16, 4 * m, m * k, a16, m * k, i32, f16, f16]
    alive = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    assert max(alive) == max(a16 + 4 * m + m * k + a16 + m * k, 4 * m + m * k + i32 + 2 * f16)
    assert alive[-1] == f16  # only the output stays: the input it keeps was allocated before


def test_cuda_path_keeps_and_dequantises_as_bitsandbytes_matmul8bitlt():
    """What MatMul8bitLt keeps from forward to backward (the input, by ctx.tensors; subA empty) and what its
    backward allocates (the weight dequantised in the input's dtype, a float32 [N, 1], the input gradient): the
    stand-in against bitsandbytes' own MatMul8bitLt run on CPU (its default-backend forward kernels differ from
    CUDA's, so only the bytes left alive after forward are compared there; backward is backend-independent)."""
    from bitsandbytes.autograd._functions import MatMul8bitLt

    m, k, n = 64, 128, 96
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False, dtype=torch.bfloat16)
    real = _real_linear8bit(linear)
    real.init_8bit_state()
    ours = quant_int8.Linear8bitModel(linear, cuda_kernels=True)
    held = {}

    def run(layer_fn):
        def forward():
            x = (torch.rand(2, m // 2, k) * 4 - 2).to(torch.bfloat16).requires_grad_()  # |x| < 6: no outlier
            held["y"] = layer_fn(x)  # x itself is dropped here: alive after forward only if the node keeps it
        fwd = _events(forward)

        def backward():
            held["y"].backward(torch.ones_like(held["y"]))
        return sum(fwd), _events(backward)

    real_fwd, real_bwd = run(lambda x: MatMul8bitLt.apply(x, real.weight, None, None, real.state))
    held.clear()
    ours_fwd, ours_bwd = run(ours)
    input_bytes, output_bytes = 2 * m * k, 2 * m * n
    assert real_fwd == ours_fwd == input_bytes + output_bytes
    weight_bf16 = 2 * n * k
    # ones_like (the incoming gradient), CB.to(bf16, copy=True), SCB.unsqueeze(1).mul(1/127), ..., grad_A (the
    # CPU bf16 matmul's own scratch in between, in both runs)
    positives = [s for s in real_bwd if s > 0]
    assert positives[:2] == [output_bytes, weight_bf16] and 4 * n in positives and input_bytes in positives
    assert ours_bwd == real_bwd


def test_cpu_training_path_is_bitsandbytes_matmul8bitfp():
    """bitsandbytes' ``matmul`` takes MatMul8bitFp when training on CPU; the stand-in's --target cpu layer
    allocates what a real Linear8bitLt does, forward and backward, call by call."""
    m, k, n = 32, 64, 48
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=True, dtype=torch.float32)
    real = _real_linear8bit(linear)
    ours = quant_int8.Linear8bitModel(nn.Linear(k, n, bias=True, dtype=torch.float32), cuda_kernels=False)
    real(torch.zeros(1, k))  # first forward moves CB/SCB into the layer's state (init_8bit_state)

    def events(layer):
        held = {}

        def step():
            x = torch.randn(m, k, requires_grad=True)
            held["y"] = layer(x)
            held["y"].backward(torch.ones_like(held["y"]))
        return _events(step)

    assert events(ours) == events(real)


# -- options ------------------------------------------------------------------------------------------

def test_int8_keeps_the_model_s_parameter_count_and_is_1_byte_per_weight():
    ref = model_ref("hf:llama-tiny")
    fields = dict(model=ref, batch=1, seq=16, target="cpu", precision="bf16", lora="r=8,targets=q_proj,v_proj")
    plain = trace_step(load_source(ref), RunSpec(**fields))
    quant = trace_step(load_source(ref), RunSpec(**fields, quant="int8"))
    assert quant.param_count == plain.param_count
    linear = 2 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 172)  # llama-tiny's two layers' linear weights
    assert plain.param_bytes - quant.param_bytes == 2 * linear - linear  # bf16 -> int8 (SCB buffers apart)


def test_planner_keys_accept_int8():
    from memest.spec.config import config_from_dict

    cfg = config_from_dict({"model": "hf:llama-3.1-8b", "lora": "r=16,targets=all-linear", "quant": "int8"})
    assert cfg.spec().quant == "int8"
    with pytest.raises(Exception, match="add --lora"):
        RunSpec(model="hf:gpt2", quant="int8")


def test_peft_s_own_8bit_lora_layer_traces_the_same_step(monkeypatch):
    """memest carries peft's LoRA forward for Linear8bitLt (no clone, unlike 4-bit); peft's own class on the
    stand-in traces the same step."""
    from peft.tuners.lora import bnb as peft_bnb

    from memest.features import quant

    ref = model_ref("hf:llama-tiny")
    spec = RunSpec(model=ref, batch=2, seq=32, target="cuda", precision="bf16", lora="r=8,targets=all-linear",
                   quant="int8")
    ours = trace_step(load_source(ref), spec)
    monkeypatch.setattr(quant, "lora_layer_class", lambda clone=True: peft_bnb.Linear8bitLt)
    peft_s = trace_step(load_source(ref), spec)
    assert ours.peak() == peft_s.peak() and len(ours.storages) == len(peft_s.storages)


def test_checkpointing_does_not_drop_what_the_int8_layer_keeps():
    """ctx.A / ctx.tensors are node attributes, not saved tensors: torch.utils.checkpoint (non-reentrant, as
    transformers uses it) leaves the layer's input alive until backward, in bitsandbytes and in the stand-in."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    linear = nn.Linear(256, 256, bias=False)
    real = _real_linear8bit(linear)
    real(torch.zeros(1, 256))
    ours = quant_int8.Linear8bitModel(linear, cuda_kernels=False)
    x = torch.randn(64, 256, requires_grad=True)
    held = {}

    def net_bytes(layer):
        held.clear()

        def forward():
            held["y"] = checkpoint(lambda t: layer(t * 2) * 1, x, use_reentrant=False)
        return sum(s for s in _events(forward) if abs(s) >= 64)

    internal = output = 64 * 256 * 4
    assert net_bytes(real) == net_bytes(ours) == internal + output
