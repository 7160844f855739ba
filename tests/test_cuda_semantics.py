"""--target cuda kernel semantics, checked against the byte counts the CUDA kernels document
(sdp_utils.cpp selection rules, attention.cu outputs, flash_api.cpp mha_bwd scratch, optimizer
implementations)."""

import pytest
import torch
from torch import nn

from memest.errors import MemestError
from memest.features.registry import trace_step
from memest.report.analysis import analyse
from memest.sources.base import ModelSource
from memest.spec import RunSpec
from memest.targets.cuda.sdpa import SdpaCall, select_backend
from memest.trace import Category

from .conftest import model_ref

B, H, L, D = 2, 4, 256, 64


def call(dtype=torch.bfloat16, d=64, mask=False, causal=True, lq=L, lk=L):
    return SdpaCall(dtype, d, d, lq, lk, mask, causal, True)


@pytest.mark.parametrize(
    "c,sm,expected",
    [
        (call(), (9, 0), "flash"),
        (call(torch.float16), (8, 0), "flash"),
        (call(torch.float32), (9, 0), "efficient"),  # flash is 16-bit only
        (call(mask=True), (9, 0), "efficient"),  # flash takes no attn_mask
        (call(causal=True, lq=128, lk=256), (9, 0), "efficient"),  # causal needs square for flash
        (call(d=320), (9, 0), "efficient"),  # flash head dim <= 256
        (call(d=250), (9, 0), "flash"),  # padded to 256 by pad_last_dim<8>
        (call(d=250, mask=True), (9, 0), "math"),  # efficient needs head dim % 8 for 16-bit
        (call(d=224), (8, 6), "efficient"),  # flash bwd head dim > 192 not on sm86
        (call(), (7, 5), "math"),  # bf16: no flash (sm80+) and no efficient below sm80
        (call(torch.float16), (7, 5), "efficient"),
    ],
)
def test_backend_selection_follows_sdp_utils(c, sm, expected):
    assert select_backend(c, sm) == expected


def test_forcing_an_impossible_backend_is_a_clear_error():
    with pytest.raises(MemestError, match="--attention flash: flash attention needs fp16/bf16"):
        select_backend(call(torch.float32), (9, 0), "flash")


class Attention(nn.Module):
    """Self-attention on given q, k, v (they are inputs, so only the kernel's own bytes show)."""

    def __init__(self, dropout=0.0):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))
        self.dropout = dropout

    def forward(self, q, k, v):
        out = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout, is_causal=True)
        return out * self.scale


def attention_source(dtype, dropout=0.0):
    def inputs(batch, seq=None):
        return tuple(torch.randn(B, H, L, D, dtype=dtype, requires_grad=True) for _ in range(3))

    return ModelSource("attn", lambda: Attention(dropout), inputs)


def kernel_storages(trace, op_prefix):
    return [r for r in trace.storages if r.op.startswith(op_prefix) and r.iteration == 1]


def test_flash_saves_output_and_logsumexp_not_probabilities():
    spec = RunSpec(model="attn", precision="bf16", optim="sgd", iterations=1)
    trace = trace_step(attention_source(torch.bfloat16), spec)
    assert trace.attention_backends == {"flash": 1}
    outs = kernel_storages(trace, "_scaled_dot_product_flash_attention.")
    sizes = sorted(r.nbytes for r in outs if r.saved_for_backward and r.nbytes > 64)
    # output (B, L, H, D) bf16 and logsumexp (B, H, L) fp32 (+ RNG seed/offset scalars); nothing L x L
    assert sizes == sorted([B * L * H * D * 2, B * H * L * 4])
    assert all(r.nbytes < B * H * L * L * 2 for r in trace.storages)  # no bf16 probabilities


def test_flash_backward_scratch_per_flash_api():
    spec = RunSpec(model="attn", precision="bf16", optim="sgd", iterations=1)
    trace = trace_step(attention_source(torch.bfloat16), spec)
    scratch = sorted(r.nbytes for r in trace.storages if "kernel scratch" in r.op)
    lq_rounded, d_rounded = 256, 64  # round up to 128 and 32
    assert scratch == sorted([B * H * lq_rounded * 4, B * lq_rounded * H * d_rounded * 4])  # softmax_d, dq_accum
    grads = [r for r in kernel_storages(trace, "_scaled_dot_product_flash_attention_backward.") if "scratch" not in r.op]
    assert sorted(r.nbytes for r in grads) == [B * H * L * D * 2] * 3  # dq, dk, dv


def test_flash_with_dropout_keeps_rng_state_not_a_mask():
    spec = RunSpec(model="attn", precision="bf16", optim="sgd", iterations=1)
    trace = trace_step(attention_source(torch.bfloat16, dropout=0.1), spec)
    saved = [r for r in kernel_storages(trace, "_scaled_dot_product_flash_attention.") if r.saved_for_backward]
    assert len(saved) == 4  # output, logsumexp, philox seed and offset
    masks = [r for r in trace.storages if r.nbytes >= B * H * L * L and "scratch" not in r.op]
    assert not masks  # no bool dropout mask (1 B/element), no probabilities


def test_efficient_logsumexp_is_padded_to_32():
    global L
    spec = RunSpec(model="attn", optim="sgd", iterations=1)
    old, L = L, 100
    try:
        trace = trace_step(attention_source(torch.float32), spec)
    finally:
        L = old
    assert trace.attention_backends == {"efficient": 1}
    outs = kernel_storages(trace, "_scaled_dot_product_efficient_attention.")
    assert B * H * 128 * 4 in [r.nbytes for r in outs]  # ceil(100 / 32) * 32 = 128


def test_math_path_keeps_probabilities():
    spec = RunSpec(model="attn", precision="bf16", optim="sgd", attention="math", iterations=1)
    trace = trace_step(attention_source(torch.bfloat16), spec)
    probs = B * H * L * L * 4  # the math path computes in fp32 (allow_fp16_bf16_reduction_math_sdp off)
    assert any(r.nbytes == probs and r.category is Category.ACTIVATIONS for r in trace.storages)


@pytest.mark.parametrize("fused,ratio", [(False, 5.0), (True, 4.0)])
def test_adam_step_peak_foreach_vs_fused(fused, ratio):
    """Optimizer-step peak in parameter bytes: params + grads + 2 states = 4x; foreach adds one more
    parameter-sized temporary list (design.md §2)."""
    ref = model_ref("mlp")
    spec = RunSpec(model=ref, batch=8, optim="adam", fused=fused)
    from memest.sources import load_source

    trace = trace_step(load_source(ref), spec)
    report = analyse(trace, spec, "mlp")
    assert report.peak_by_phase["optimizer"] / trace.param_bytes == pytest.approx(ratio, abs=0.01)


def test_cuda_options_rejected_for_cpu_target():
    with pytest.raises(MemestError, match="--target cuda"):
        RunSpec(model="x.py", target="cpu", fused=True)


def test_autocast_casts_sdpa_inputs_before_the_backend_is_chosen():
    """SDPA is on CUDA autocast's lower-precision list: fp32 q/k/v under bf16-mixed reach the kernel
    as bf16, so flash (16-bit only) is chosen, as on a GPU."""
    spec = RunSpec(model="attn", precision="bf16-mixed", optim="sgd", iterations=1)
    trace = trace_step(attention_source(torch.float32), spec)
    assert trace.attention_backends == {"flash": 1}


def test_grouped_query_attention_takes_flash_in_16_bit_and_math_in_fp32():
    gqa = dict(heads_q=8, heads_kv=2)
    assert select_backend(SdpaCall(torch.bfloat16, 64, 64, L, L, False, True, True, **gqa), (9, 0)) == "flash"
    assert select_backend(SdpaCall(torch.float32, 64, 64, L, L, False, True, True, **gqa), (9, 0)) == "math"
