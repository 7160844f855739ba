"""--fp8 te-delayed (features/te_fp8.py): TransformerEngine's te.Linear under DelayedScaling, a documented estimate.

TransformerEngine cannot be imported on a machine without CUDA, so nothing here compares with a real TE step (the
report and docs/fp8.md say so). What is checked: the stand-in holds, saves and frees the tensors TE 2.20.2's Linear
does as its source states them (``_linear_forward_fake``'s saved-tensor layout, ``Float8Quantizer``'s
``inner_tensor_specs``: ``_data``, ``_transpose`` only on TN-only GPUs, a 1-element float32 ``_scale_inv``;
``clear_tensor_data`` of the input after the wgrad GEMM), the delayed-scaling state and cuBLAS workspace are in the
trace to the byte, and the options refuse what is not estimated."""

import pytest
import torch

from memest.errors import MemestError
from memest.features import te_fp8
from memest.features.registry import trace_step
from memest.report.analysis import analyse
from memest.sources import load_source
from memest.spec import RunSpec

from .conftest import model_ref

U8 = 1  # bytes per float8 element


def _saved_by(linear, x, capability):
    """Run a TELinear stand-in forward and backward on CPU tensors: (what autograd saved, as (shape, itemsize),
    the saved tensors themselves, the gradients)."""
    module = te_fp8.TELinear(linear, 16, capability, workspace=False)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    layout = [(tuple(t.shape), t.element_size()) for t in saved]
    out.float().sum().backward()
    return layout, saved, out


@pytest.mark.parametrize("capability,expected", [
    # Hopper (TN-only FP8 GEMMs): the input's transpose and the weight's rowwise data and transpose, each + scale-inv
    ((9, 0), [((48, 2, 8), U8), ((1,), 4), ((32, 48), U8), ((48, 32), U8), ((1,), 4)]),
    # Blackwell: one buffer per tensor serves both layouts, no transposes
    ((10, 0), [((2, 8, 48), U8), ((1,), 4), ((32, 48), U8), ((1,), 4)]),
    ((12, 0), [((48, 2, 8), U8), ((1,), 4), ((32, 48), U8), ((48, 32), U8), ((1,), 4)]),  # 12.x: TN-only again
])
def test_saved_tensors_follow_te_layout(capability, expected):
    torch.manual_seed(0)
    linear = torch.nn.Linear(48, 32).to(torch.bfloat16)
    x = torch.randn(2, 8, 48, dtype=torch.bfloat16, requires_grad=True)
    layout, _, out = _saved_by(linear, x, capability)
    assert layout == expected
    assert out.shape == (2, 8, 32) and out.dtype == torch.bfloat16
    assert x.grad.shape == x.shape and linear.weight.grad.dtype == torch.bfloat16 and linear.bias.grad.shape == (32,)


def test_input_float8_data_freed_after_wgrad_scale_inverse_kept():
    """clear_tensor_data(inputmat_total) after the wgrad GEMM swaps the float8 buffers for empty ones
    (Float8TensorStorage.clear); the scale-inverse stays (it may be shared)."""
    linear = torch.nn.Linear(48, 32, bias=False)
    x = torch.randn(16, 48, requires_grad=True)
    _, saved, _ = _saved_by(linear, x, (9, 0))
    assert saved[0].untyped_storage().nbytes() == 0  # the input's transpose
    assert saved[1].untyped_storage().nbytes() == 4  # its scale-inverse
    assert saved[2].untyped_storage().nbytes() == 32 * 48  # the weight's float8 data stays until the node is freed


def test_frozen_weight_saves_no_input_and_no_transpose_without_input_grad():
    linear = torch.nn.Linear(48, 32, bias=False)
    linear.weight.requires_grad_(False)
    x = torch.randn(16, 48, requires_grad=True)
    layout, _, _ = _saved_by(linear, x, (9, 0))
    assert layout == [((32, 48), U8), ((48, 32), U8), ((1,), 4)]  # no wgrad: the input is not kept
    linear.weight.requires_grad_(True)
    layout, _, _ = _saved_by(linear, torch.randn(16, 48), (9, 0))  # no dgrad: the weight's transpose not made
    assert layout == [((48, 16), U8), ((1,), 4), ((32, 48), U8), ((1,), 4)]


def test_autocast_sets_the_activation_dtype_and_the_fp32_weight_gets_an_fp32_gradient():
    linear = torch.nn.Linear(48, 32)
    x = torch.randn(16, 48, requires_grad=True)
    module = te_fp8.TELinear(linear, 16, (9, 0), workspace=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = module(x)
    assert out.dtype == torch.bfloat16  # set_activation_dtype: autocast's dtype first
    out.float().sum().backward()
    assert linear.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32


def test_state_and_workspace_in_the_trace_to_the_byte():
    """Each converted Linear's delayed-scaling state (3 + 2 quantizers: a float32 scale and amax_history_len x n
    float32) and one cuBLAS workspace (32 MiB + 1 KiB from compute capability 9.0, 4 MiB before) are traced."""
    base = {"model": model_ref("hf:llama-tiny"), "batch": 2, "seq": 64, "optim": "adamw", "target": "cuda",
            "precision": "bf16-mixed"}
    plain = trace_step(load_source(base["model"]), RunSpec(**base))
    for capability, history, workspace in (((9, 0), 1024, 32 * 2**20 + 1024), ((8, 9), 1, 4 * 2**20)):
        spec = RunSpec(**base, fp8="te-delayed", compute_capability=capability, fp8_amax_history=history)
        trace = trace_step(load_source(spec.model), spec)
        converted = int(trace.notes[[i for i, n in enumerate(trace.notes) if "te-delayed" in n][0]].split(": ")[1].split()[0])
        assert converted == 8  # llama-tiny: q, k, v, o of 2 layers; 172-wide MLPs and the 1,000-row head stay
        state = converted * (5 * 4 + history * 5 * 4)
        other = (analyse(trace, spec, "te").breakdown_at_peak["other"]
                 - analyse(plain, RunSpec(**base), "plain").breakdown_at_peak["other"])
        assert other == workspace + state


def test_refusals():
    base = {"model": model_ref("transformer"), "batch": 2, "seq": 64}
    RunSpec(**base, target="cuda", fp8="te-delayed")
    with pytest.raises(MemestError, match="runs on NVIDIA GPUs only"):
        RunSpec(**base, target="cpu", fp8="te-delayed")
    with pytest.raises(MemestError, match=r"compute capability 8\.0.*8\.9 or higher"):
        RunSpec(**base, target="cuda", fp8="te-delayed", compute_capability=(8, 0))
    for more, flag in (({"world_size": 2, "shard": "zero3"}, "--world-size 2"), ({"compile": True}, "--compile"),
                       ({"lora": "r=8"}, "--lora"), ({"preference": "dpo"}, "--preference dpo")):
        with pytest.raises(MemestError, match=f"te-delayed with {flag}.*not estimated"):
            RunSpec(**base, target="cuda", fp8="te-delayed", **more)
    with pytest.raises(MemestError, match="needs --fp8 te-delayed"):
        RunSpec(**base, target="cuda", fp8="tensorwise", fp8_amax_history=16)
    with pytest.raises(MemestError, match="at least 1"):
        RunSpec(**base, target="cuda", fp8="te-delayed", fp8_amax_history=0)


def test_refuses_token_counts_te_cannot_multiply():
    spec = RunSpec(model=model_ref("hf:llama-tiny"), batch=1, seq=63, target="cuda", fp8="te-delayed")
    with pytest.raises(MemestError, match="multiple of 8.*assert_dim_for_fp8_exec"):
        trace_step(load_source(spec.model), spec)
