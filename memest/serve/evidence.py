"""Constants of the serving engines and GPUs that memest cannot trace, each with its source and range.

Sizes in the vLLM logs are GiB rounded to two decimals; a value read from one carries +-0.005 GiB.
"""

from __future__ import annotations

from memest.errors import MemestError
from memest.serve.budget import Part
from memest.spec.choices import CudaGraphs

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

# vLLM's "non-torch increase": memory outside torch's caching allocator that appears between the start-up
# snapshot and the end of the profile run. What it counts depends on the build (read in each release's source):
#   - vLLM >= 0.7 (PR #11809 / #12126; V0 worker.py and, since PR #19312, the V1 gpu_worker.py, through
#     utils.memory_profiling / mem_utils.py): the increase of (cudaMemGetInfo used - torch.cuda.memory_reserved())
#     from MemorySnapshot() taken in Worker.init_device, after torch.cuda.set_device has created the CUDA context
#     and before init_worker_distributed_environment: the CUDA context is NOT in it; NCCL and custom all-reduce
#     buffers (TP > 1), cuBLAS/cuBLASLt and kernels loaded lazily by the profile run are.
#   - vLLM 0.6.5 (PR #10511; V1 before PR #19312 likewise): used - baseline - weights - the change of torch's
#     *allocated* bytes: torch's cached-but-unallocated blocks count as non-torch too; context in the baseline.
#   - vLLM 0.6.4: everything used on the GPU (every process, this process's CUDA context included) minus torch's
#     allocated bytes (worker.py determine_num_available_blocks, "non_torch_allocations").
# Published TP-1 values, each with its build: 0.03 GiB (RTX 4060, vLLM 0.7.x, github.com/vllm-project/vllm/
# issues/13882), 0.16 GiB (H100, V0 main Jan 2025 after PR #12126, pull/12126) -- the current arithmetic;
# 0.35 GiB (RTX 3090, vLLM 0.6.4, issues/10517: context and all) and 1.79 GiB (H100, PR #10511's Dec-2024 build:
# allocator cache) measure other things and are not in the range below.
# TP 1, current arithmetic: low 0.03 (issue #13882), expected 0.16 (PR #12126, the larger published value: fewer
# KV tokens, the safe side), high 0.57 GiB: this project's H100 measurement of what the first GEMMs load outside
# torch's allocator with every kernel loaded eagerly (profiles/h100-cuda13.0-torch2.11-eager.json
# cublas_library_bytes 610,271,232 B; lazily 232,783,872 B), the bulk of what the profile run adds.
# TP > 1: + NCCL, measured here as 589,299,712 B (0.55 GiB, profiles/h100-cuda13.0-torch2.11.json
# nccl_library_bytes): expected 0.16 + 0.55 = 0.71 GiB; low 0.20 GiB (TP > 1 on RTX 3090s, vLLM 0.8.x V0,
# github.com/vllm-project/vllm/pull/14447); high 0.57 + 1.79 GiB, 1.79 GiB being what TP 2 added over TP 1 in the
# same build (3.58 vs 1.79 GiB, H100, pull/10511); a V1 TP-4 start-up on H200 logged 2.04 GiB (pull/21429's
# "non-torch forward increase memory"), inside it.
NON_TORCH_TP1 = (int(0.03 * GiB), int(0.16 * GiB), 610_271_232)
NON_TORCH_TP = (int(0.20 * GiB), int(0.16 * GiB) + 589_299_712, 610_271_232 + int(1.79 * GiB))
# DEBUG-level vLLM V1 start-up logs of several models on H100s, collected by llm-d ("non-torch forward increase
# memory" per model); they fall inside the ranges above and did not set them (the Llama-3.1-8B row is also one of
# the logs scripts/bench_serve.py predicts).
LLMD_MEMORY = ("https://github.com/llm-d/llm-d-benchmark/blob/4f4d44943c39b76b28e30dfa1fb0dfaf1ee894b5/"
               "config_explorer/empirical-vllm-memory-results.md")
NON_TORCH_PUBLISHED = (
    # (GiB, GPU, build and what it counts, TP, address)
    (0.03, "RTX 4060 8 GB", "vLLM 0.7.x V0: current arithmetic", 1, "https://github.com/vllm-project/vllm/issues/13882"),
    (0.16, "H100 80GB", "V0 main Jan 2025 (PR #12126): current arithmetic", 1,
     "https://github.com/vllm-project/vllm/pull/12126"),
    (0.35, "RTX 3090", "vLLM 0.6.4 V0: all GPU use minus torch allocated (CUDA context included)", 1,
     "https://github.com/vllm-project/vllm/issues/10517"),
    (1.79, "H100 80GB", "PR #10511 Dec 2024 (vLLM 0.6.5 arithmetic): torch's cached-unallocated blocks included", 1,
     "https://github.com/vllm-project/vllm/pull/10511"),
    (3.58, "H100 80GB", "PR #10511 Dec 2024 (vLLM 0.6.5 arithmetic), as above", 2,
     "https://github.com/vllm-project/vllm/pull/10511"),
    (0.20, "RTX 3090", "vLLM 0.8.x V0: current arithmetic", "> 1", "https://github.com/vllm-project/vllm/pull/14447"),
    (2.04, "H200 (139 GiB)", "V1 July 2025 (after PR #19312), Qwen3-235B-A22B-FP8: current arithmetic", 4,
     "https://github.com/vllm-project/vllm/pull/21429"),
    (0.13, "H100 (79.18 GiB)", "V1 (v0.11.0 image), gpt-oss-20b, gpt-oss-120b, Qwen3-0.6B, Llama-3.1-8B: current "
     "arithmetic", 1, LLMD_MEMORY),
    (0.14, "H100 (79.18-79.19 GiB)", "V1 (v0.11.0 image), Qwen3-32B, Mistral-Small-3.2-24B, Llama-3.3-70B-FP8: current "
     "arithmetic", 1, LLMD_MEMORY),
    (0.54, "H100 (79.18 GiB)", "V1 (v0.11.0 image), Qwen3-32B: current arithmetic", 2, LLMD_MEMORY),
    (0.55, "H100 (79.18 GiB)", "V1 (v0.11.0 image), Llama-3.3-70B-FP8: current arithmetic", 2, LLMD_MEMORY),
)
NON_TORCH_NAME = "non-torch increase"


def non_torch(tp: int) -> Part:
    low, mid, high = NON_TORCH_TP1 if tp == 1 else NON_TORCH_TP
    where = ("published TP-1 values of vLLM >= 0.7's arithmetic 0.03 and 0.16 GiB (vllm issue #13882, PR #12126): "
             "expected 0.16; high 0.57 GiB, what the first GEMMs load outside torch's allocator on an H100 with eager "
             "kernel loading (this project's profiles/h100-cuda13.0-torch2.11-eager.json)"
             if tp == 1 else "TP > 1: TP-1 expected + NCCL 0.55 GiB (profiles/h100-cuda13.0-torch2.11.json) = 0.71 GiB; "
             "range 0.20 GiB (vllm PR #14447) to 0.57 + 1.79 GiB (what TP 2 added over TP 1 in vllm PR #10511)")
    return Part(NON_TORCH_NAME, mid, low, high, f"evidence, not traced: {where}; a measured value replaces it: "
                "--non-torch-memory (your vLLM log's non-torch figure) or --calibration (mem_utils.py memory_profiling "
                "non_torch_increase)")


NON_TORCH_OLDER = ("vLLM before 0.7 counted more as non-torch (0.6.4: the CUDA context and every other process's "
                   "memory; 0.6.5: torch's cached-unallocated blocks), 0.35-1.79 GiB at TP 1 in published logs "
                   "(vllm#10517, PR #10511): with those builds pass the log's figure as --non-torch-memory")


def measured_non_torch(tp: int, gib: float | None = None, profile: dict | None = None) -> Part | None:
    """The non-torch increase from a measurement instead of the evidence: ``gib`` (the user's vLLM log's figure,
    ``--non-torch-memory``) or a calibration profile (``memest calibrate --out``): its cuBLAS/cuBLASLt stage (+ its
    NCCL stage when TP > 1), what vLLM's non-torch increase mostly holds. None: neither given."""
    if gib is not None:
        if not 0 <= gib < 1024:
            raise MemestError(f"--non-torch-memory must be a size in GiB between 0 and 1024, got {gib}")
        return Part.exact(NON_TORCH_NAME, int(round(gib * GiB)), f"measured: --non-torch-memory {gib:g} GiB (your "
                          "vLLM log's non-torch figure; replaces the evidence constant)")
    if profile is None or profile.get("cublas_library_bytes") is None:
        return None
    value = int(profile["cublas_library_bytes"])
    what = "cuBLAS/cuBLASLt stage"
    if tp > 1:
        if profile.get("nccl_library_bytes") is None:
            return None
        value += int(profile["nccl_library_bytes"])
        what += " + NCCL stage"
    where = f" ({profile['profile_path']})" if profile.get("profile_path") else ""
    return Part.exact(NON_TORCH_NAME, value, f"calibrated: the profile's {what}{where}, {profile.get('gpu_name', '?')}, "
                      f"torch {profile.get('torch_version', '?')}: what vLLM's non-torch increase mostly holds (the "
                      "attention kernels vLLM loads are not in it); a vLLM log's own figure (--non-torch-memory) is "
                      "exact")


# vLLM's CUDA-graph memory estimate, subtracted before the KV cache since v0.21
# (VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=1 default; "CUDA graph memory profiling is enabled (default since
# v0.21.0)" in the start-up log). Published: 0.36 GiB estimated (TP 2, github.com/gpustack/runner/pull/251),
# 0.65 GiB captured for gemma-3-4b, ~1.3 GB for Llama-4-Maverick (github.com/vllm-project/vllm/pull/21489);
# the estimator has over-counted by several x on MoE models (vllm issues #45178, #53013).
CUDA_GRAPHS = (int(0.2 * GiB), int(0.5 * GiB), int(1.5 * GiB))


def cuda_graphs(mode: str) -> Part | None:
    if mode != CudaGraphs.PROFILED:
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
# vLLM's main branch has since raised that default to 0.92 (vllm/config/cache.py CacheConfig.gpu_memory_utilization
# ``Field(default=0.92, ...)`` at commit 002f10e0cfa1373a19a0d2756598a34b700d20e5); the release that changed it is not
# pinned here, so memest keeps 0.9 (the value of every published log it is checked against) and says so.
DEFAULT_UTILIZATION_NEWER = ("--gpu-memory-utilization not given: memest uses 0.9, vLLM's default up to at least v0.11 "
                             "(the published logs in benchmarks/serve.md); vLLM's main branch now defaults to 0.92 "
                             "(vllm/config/cache.py at commit 002f10e0): pass the value your build uses")
DEFAULT_BLOCK_SIZE = 16  # vllm/config/cache.py CacheConfig.block_size default on CUDA


def measured_context(profile: dict | None) -> Part | None:
    """A calibration profile's measured CUDA context (``context_bytes``) in place of the evidence spread."""
    if not profile or profile.get("context_bytes") is None:
        return None
    where = f" ({profile['profile_path']})" if profile.get("profile_path") else ""
    return Part.exact("CUDA context", int(profile["context_bytes"]), f"calibrated: the profile's context stage{where}, "
                      f"{profile.get('gpu_name', '?')}")
