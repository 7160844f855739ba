"""torch's RMSNorm on --target cuda: one _fused_rms_norm node saving input + rstd (memest/targets/cuda/rms_norm.py),
where the CPU's composite saves the fp32 up-cast input and the fp32 normalized tensor."""

import math

import torch
from torch import nn

from .test_cuda_kernels import saved, trace_op

SHAPE = (4, 256, 512)


def _saved_bytes(trace) -> int:
    return sum(r.nbytes for r in saved(trace))


def test_bf16_rms_norm_saves_input_and_rstd_on_cuda():
    n = math.prod(SHAPE)
    rows = SHAPE[0] * SHAPE[1]
    cuda = trace_op(lambda m, x: m(x), [SHAPE], module=lambda: nn.RMSNorm(SHAPE[-1]), dtype=torch.bfloat16)
    cpu = trace_op(lambda m, x: m(x), [SHAPE], module=lambda: nn.RMSNorm(SHAPE[-1]), dtype=torch.bfloat16, target="cpu")
    # derivatives.yaml _fused_rms_norm: input (the bf16 input the caller holds: not a new storage) and result1 (rstd,
    # fp32 acc_type, one per row); the CPU composite saves the fp32 up-cast input and the fp32 normalized tensor too
    assert _saved_bytes(cuda) == rows * 4
    assert _saved_bytes(cpu) - _saved_bytes(cuda) == 2 * 4 * n
    assert not [r for r in cuda.storages if r.op.startswith("_to_copy")]  # no fp32 up-cast on the fused path


def test_weight_dtype_mismatch_keeps_the_composite():
    """rms_norm_symint: a weight whose dtype differs from the input's cannot take the fused kernel (it warns)."""

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(SHAPE[-1]))

        def forward(self, x):
            return nn.functional.rms_norm(x.to(torch.bfloat16), (SHAPE[-1],), self.weight.float())

    cuda = trace_op(lambda m, x: m(x), [SHAPE], module=Mixed)
    cpu = trace_op(lambda m, x: m(x), [SHAPE], module=Mixed, target="cpu")
    assert _saved_bytes(cuda) == _saved_bytes(cpu)


def test_gradients_keep_their_shapes_and_dtypes():
    """The fused node's backward returns dX in the input's dtype and dweight in the weight's (the step's optimizer
    and the next layer see the same tensors as with the composite)."""
    def grads(target):
        trace = trace_op(lambda m, x: m(x), [SHAPE], module=lambda: nn.RMSNorm(SHAPE[-1]), dtype=torch.bfloat16,
                         target=target)
        return sorted(r.nbytes for r in trace.storages if r.category.name == "GRADIENTS")

    assert SHAPE[-1] * 2 in grads("cuda")  # the bf16 weight's gradient
    assert grads("cuda") == grads("cpu")



def test_hf_rms_norm_models_say_what_torchtitans_norm_saves_less():
    """The note's per-element figure is what the traces show: transformers' LlamaRMSNorm on a bf16 input saves an fp32
    copy and a bf16 normalized tensor (6 B per element), the fused node only keeps its input alive (the caller's bf16
    tensor, 2 B, not a new storage here): 4 B net per element per norm."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from memest.sources.hf import RMS_NORM_EXTRA_BYTES, load_hf_source

    assert any("32.00 KiB per token" in n for n in load_hf_source("llama-2-7b").notes)  # 2 norms x 4096 x 4 B
    assert not any("RMSNorm" in n for n in load_hf_source("gpt2").notes)

    hidden, tokens = SHAPE[-1], SHAPE[0] * SHAPE[1]
    ours = trace_op(lambda m, x: m(x), [SHAPE], module=lambda: LlamaRMSNorm(hidden), dtype=torch.bfloat16)
    fused = trace_op(lambda m, x: m(x), [SHAPE], module=lambda: nn.RMSNorm(hidden), dtype=torch.bfloat16)
    assert _saved_bytes(ours) - _saved_bytes(fused) == tokens * hidden * (RMS_NORM_EXTRA_BYTES + 2)
