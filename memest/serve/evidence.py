"""Constants of the serving engines and GPUs that memest cannot trace, each with its source and range.

Sizes in the vLLM logs are GiB rounded to two decimals; a value read from one carries +-0.005 GiB.
"""

from __future__ import annotations

from .budget import Part

GiB = 2**30

# What torch.cuda.mem_get_info() reports as the total (vLLM's total_gpu_memory): a little below the
# nominal size (the driver keeps some). Cards without a logged figure use the nominal size, and say so.
TOTALS: dict[str, tuple[int, str]] = {
    "h100": (int(79.22 * GiB), "total_gpu_memory 79.22GiB in vLLM's logs on H100 80GB "
             "(github.com/vllm-project/vllm/pull/10511, /pull/12126)"),
    "h100-80gb": (int(79.22 * GiB), "as h100"),
    "rtx3090": (int(23.58 * GiB), "total_gpu_memory=23.58GiB in vLLM's log on an RTX 3090 "
                "(github.com/vllm-project/vllm/issues/10517)"),
}

# vLLM's "non-torch forward increase": memory outside torch's allocator that appears between the start-up
# snapshot (taken after the CUDA context and NCCL exist) and the end of the profile run (cuBLAS/cuBLASLt
# handles and kernels loaded by the first matmuls, attention backend buffers; with TP, NCCL's and the custom
# all-reduce's buffers created during the forward). Published values (TP 1): 0.03 GiB (a 7B AWQ model, RTX 4060,
# github.com/vllm-project/vllm/issues/13882), 0.16 GiB (Llama-3.2-11B-Vision, H100, pull/12126), 0.35 GiB
# (Llama-3.1-8B, RTX 3090, issues/10517). Expected: their median; range: their span, widened to 0.5 GiB.
NON_TORCH_TP1 = (int(0.03 * GiB), int(0.16 * GiB), int(0.5 * GiB))
NON_TORCH_TP = (int(0.2 * GiB), int(0.6 * GiB), int(2.0 * GiB))  # TP > 1: NCCL and custom all-reduce buffers


def non_torch(tp: int) -> Part:
    low, mid, high = NON_TORCH_TP1 if tp == 1 else NON_TORCH_TP
    where = ("median of published TP-1 values 0.03, 0.16, 0.35 GiB (vllm issue #13882, PR #12126, issue #10517); "
             "range 0.03-0.5 GiB"
             if tp == 1 else "TP > 1 adds NCCL and custom all-reduce buffers; few published values: range 0.2-2 GiB")
    return Part("non-torch increase", mid, low, high, f"evidence, not traced: {where} (mem_utils.py memory_profiling "
                "non_torch_increase)")


# vLLM's CUDA-graph memory estimate, subtracted before the KV cache since v0.21
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 default; "CUDA graph memory profiling is enabled (default since
# v0.21.0)" in the start-up log). Published: 0.36 GiB estimated (TP 2, github.com/gpustack/runner/pull/251),
# 0.65 GiB captured for gemma-3-4b, ~1.3 GB for Llama-4-Maverick (github.com/vllm-project/vllm/pull/21489);
# the estimator has over-counted by several x on MoE models (vllm issues #45178, #53013).
CUDA_GRAPHS = (int(0.2 * GiB), int(0.5 * GiB), int(1.5 * GiB))


def cuda_graphs(mode: str) -> Part | None:
    if mode != "profiled":
        return None
    low, mid, high = CUDA_GRAPHS
    return Part("CUDA graphs (estimate)", mid, low, high,
                "evidence, not traced: published estimates 0.36-1.3 GiB for dense models (gpustack/runner#251, "
                "vllm PR #21489); subtracted since vLLM v0.21 (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS, PR #30515)")


CUDA_GRAPHS_AFTER = ("vLLM < v0.21 (or VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0) captures CUDA graphs after the "
                     "KV cache is allocated: they are not subtracted from it and come on top of the utilization "
                     "(about 0.2-1.5 GiB, vllm PR #21489)")


def default_batching(total: int, card: str | None) -> tuple[int, int, str]:
    """vLLM's defaults for `vllm serve` (vllm/engine/arg_utils.py ``EngineArgs.get_batch_defaults``):
    GPUs with >= 70 GiB that are not an A100: 8192 batched tokens, 1024 sequences; others 2048 and 256;
    max_num_seqs is then capped at max_num_batched_tokens."""
    big = total >= 70 * GiB and not (card or "").lower().startswith("a100")
    tokens, seqs = (8192, 1024) if big else (2048, 256)
    return tokens, seqs, ("vLLM defaults for `vllm serve` on a >= 70 GiB GPU other than A100: 8192 batched tokens, "
                          "1024 sequences" if big else "vLLM defaults for `vllm serve`: 2048 batched tokens, 256 "
                          "sequences") + " (engine/arg_utils.py get_batch_defaults)"


DEFAULT_UTILIZATION = 0.9  # vllm/config/cache.py CacheConfig.gpu_memory_utilization
DEFAULT_BLOCK_SIZE = 16  # vllm/config/cache.py CacheConfig.block_size default on CUDA
