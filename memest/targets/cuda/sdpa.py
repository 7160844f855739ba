"""scaled_dot_product_attention as the CUDA kernels allocate and save it, while tracing on fake CPU
tensors (``--target cuda``).

On CPU, F.scaled_dot_product_attention picks CPU kernels (often the math path, which saves the
batch x heads x seq x seq probabilities). A CUDA run picks flash or memory-efficient attention, which
save only the output and a logsumexp (+ RNG seed/offset with dropout). A kernel registered for the call
selects the backend with PyTorch's CUDA rules, and calls that backend's aten op directly; fake
tensors run its meta kernel, and autograd records the same backward node (and saved tensors) as on
CUDA. Sources: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (select_sdp_backend,
can_use_flash_attention, can_use_mem_efficient_attention), attention.cu (flash/efficient wrappers),
transformers/attention.cpp (scaled_dot_product_attention: pad_last_dim<8> for flash,
preprocess_mask for efficient) and flash_attn/flash_api.cpp (mha_bwd scratch).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from memest.errors import MemestError

ATTENTION_CHOICES = ("auto", "flash", "efficient", "math")
FLASH_MAX_HEAD_DIM = 256  # check_head_dim_size_flash
MEM_EFF_MASK_ALIGN = 16  # attention.cpp preprocess_mask: pad_bias<mem_eff_alignment = 16>


@dataclass(frozen=True)
class SdpaCall:
    dtype: torch.dtype
    head_dim_qk: int
    head_dim_v: int
    seq_q: int
    seq_k: int
    has_mask: bool
    is_causal: bool
    requires_grad: bool
    heads_q: int = 1
    heads_kv: int = 1


def flash_rejects(call: SdpaCall, sm: tuple[int, int]) -> str | None:
    """Why the flash kernel cannot run (None when it can), after can_use_flash_attention."""
    if sm < (8, 0):
        return "flash attention needs an sm80+ GPU (Ampere or newer)"
    if call.dtype not in (torch.float16, torch.bfloat16):
        return "flash attention needs fp16/bf16 inputs (use --precision bf16-mixed or bf16)"
    if call.has_mask:
        return "flash attention takes no attn_mask (only is_causal)"
    if not (call.head_dim_qk == call.head_dim_v and call.head_dim_qk <= FLASH_MAX_HEAD_DIM):
        return "flash attention needs equal q/k/v head dims <= 256"
    if call.requires_grad and call.head_dim_qk > 192 and sm in ((8, 6), (8, 9), (12, 0)):
        return "flash backward with head dim > 192 is not supported on sm86/sm89/sm120"
    if call.is_causal and call.seq_q != call.seq_k:
        return "flash attention with is_causal needs equal query and key lengths"
    return None


def efficient_rejects(call: SdpaCall, sm: tuple[int, int]) -> str | None:
    """Why the memory-efficient kernel cannot run, after can_use_mem_efficient_attention."""
    allowed = (torch.float16, torch.float32, torch.bfloat16) if sm >= (8, 0) else (torch.float16, torch.float32)
    if call.dtype not in allowed:
        return "memory-efficient attention does not take this dtype on this GPU"
    if call.heads_q != call.heads_kv:
        # grouped-query attention: newer sdp_utils lets the efficient kernel take it, older releases
        # (and the fake backward kernel here) do not; memest takes the conservative math path
        return "memory-efficient attention is not used with grouped-query attention (k/v heads != q heads)"
    half = call.dtype in (torch.float16, torch.bfloat16)
    # minimum_gemm_alignment: tensor cores on sm80+ (and sm70+ for half) -> 128 bits / element bits
    tensor_cores = sm >= (8, 0) or (sm >= (7, 0) and half)
    align = max(4 if sm >= (8, 0) else 1, (8 if half else 4) if tensor_cores else 1)
    if call.head_dim_qk % align or call.head_dim_v % align:
        return f"memory-efficient attention needs head dims divisible by {align}"
    return None


def select_backend(call: SdpaCall, sm: tuple[int, int], requested: str = "auto") -> str:
    """PyTorch's default priority order (flash, efficient, math), or the requested backend."""
    rules = {"flash": flash_rejects, "efficient": efficient_rejects}
    if requested == "math":
        return "math"
    if requested in rules:
        why = rules[requested](call, sm)
        if why:
            raise MemestError(f"--attention {requested}: {why}; use --attention auto")
        return requested
    for backend in ("flash", "efficient"):
        if rules[backend](call, sm) is None:
            return backend
    return "math"


class CudaSdpa:
    """Context manager: while active, aten::scaled_dot_product_attention on CPU tensors runs the CUDA
    backend's op (registered at the AutogradCPU dispatch key, so it also holds when checkpointing
    recomputes the forward inside backward, where Python function modes are not active). It sits below
    the autocast key, so CUDA autocast (cuda_autocast.py) has cast the inputs already. Counts choices."""

    def __init__(self, requested: str = "auto", sm: tuple[int, int] = (9, 0)) -> None:
        self.requested = requested
        self.sm = sm
        self.choices: Counter[str] = Counter()
        self._lib = None

    def __enter__(self) -> CudaSdpa:
        self._lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
            self._lib.impl("scaled_dot_product_attention", self._sdpa, "AutogradCPU")
        return self

    def __exit__(self, *exc) -> None:
        if self._lib is not None:
            self._lib._destroy()
            self._lib = None

    def _sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        call = SdpaCall(
            dtype=query.dtype,
            head_dim_qk=query.shape[-1],
            head_dim_v=value.shape[-1],
            seq_q=query.shape[-2],
            seq_k=key.shape[-2],
            has_mask=attn_mask is not None,
            is_causal=is_causal,
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
            heads_q=query.shape[-3] if query.dim() >= 3 else 1,
            heads_kv=key.shape[-3] if key.dim() >= 3 else 1,
        )
        backend = select_backend(call, self.sm, self.requested)
        if backend == "math" and _sequence_sharded(query):
            raise MemestError(
                "--cp: this attention runs on the math SDPA path on the modelled GPU, and torch's context parallel has "
                "ring handlers for the flash, memory-efficient and cuDNN kernels only (torch/distributed/tensor/"
                f"experimental/_context_parallel/_attention.py, _sdpa_handler); flash: "
                f"{flash_rejects(call, self.sm) or 'not requested'}; memory-efficient: "
                f"{efficient_rejects(call, self.sm) or 'not requested'}"
            )
        self.choices[backend] += 1
        if backend == "flash":
            return _flash(query, key, value, dropout_p, is_causal, scale)
        if backend == "efficient":
            return _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, call.requires_grad)
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, None, scale=scale, enable_gqa=enable_gqa
        )[0]


def _sequence_sharded(t) -> bool:
    """A DTensor: context parallel's patched SDPA hands the kernels sequence-sharded q/k/v."""
    dtensor = getattr(getattr(torch.distributed, "tensor", None), "DTensor", None) if torch.distributed.is_available() else None
    return dtensor is not None and isinstance(t, dtensor)


def _flash(query, key, value, dropout_p, is_causal, scale):
    head_dim = query.shape[-1]
    if scale is None:  # calculate_scale uses the original head dim, before padding
        scale = head_dim**-0.5
    pad = (-head_dim) % 8  # pad_last_dim<8, false>: copies q, k, v when the head dim is not a multiple of 8
    if pad:
        query, key, value = (F.pad(t, (0, pad)) for t in (query, key, value))
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]
    return out[..., :head_dim] if pad else out


def _efficient(query, key, value, attn_mask, dropout_p, is_causal, scale, compute_log_sumexp):
    if attn_mask is not None:
        # preprocess_mask: boolean masks become additive float masks, and the last dim is padded to 16
        if attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, 0.0, float("-inf")).to(query.dtype)
        pad = (-attn_mask.shape[-1]) % MEM_EFF_MASK_ALIGN
        if pad:
            attn_mask = F.pad(attn_mask, (0, pad))[..., : attn_mask.shape[-1]]
        attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, compute_log_sumexp, dropout_p, is_causal, scale=scale
    )[0]


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def flash_backward_scratch(args, kwargs) -> list[int]:
    """Bytes mha_bwd allocates besides dq/dk/dv (flash_api.cpp): softmax_d (B, H, Lq rounded to 128)
    and dq_accum (B, Lq rounded to 128, H, head dim rounded to 32), both fp32; for grouped-query
    attention also dk_expanded and dv_expanded (B, Lk, H, D) in the input dtype."""
    query, key = args[1], args[2]  # args[0] is grad_out
    b, h, lq, d = query.shape
    lk, hk = key.shape[2], key.shape[1]
    lq_r, d_r = _round_up(lq, 128), _round_up(d, 32)
    sizes = [b * h * lq_r * 4, b * lq_r * h * d_r * 4]
    if hk != h:
        sizes += [2 * b * lk * h * d * query.element_size()]
    return sizes


def efficient_backward_scratch(args, kwargs) -> list[int]:
    """_efficient_attention_backward allocates delta (B, H, Lq) fp32 before its kernel
    (attention_backward.cu); the kernel's own workspace is not modelled."""
    query = args[1]
    b, h, lq, _ = query.shape
    return [b * h * lq * 4]


# aten op -> bytes of scratch its CUDA kernel allocates and frees around its outputs
CUDA_SCRATCH = {
    torch.ops.aten._scaled_dot_product_flash_attention_backward.default: flash_backward_scratch,
    torch.ops.aten._scaled_dot_product_efficient_attention_backward.default: efficient_backward_scratch,
}
