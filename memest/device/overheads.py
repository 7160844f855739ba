"""Fixed device costs outside the tensors a step allocates: one table of constants, each with its
source, and the arithmetic that turns them into bytes for one run.

Defaults are replaced by `memest calibrate` measurements when a calibration for the same GPU, driver
and torch version exists (see calibration.py); the report says which values are which.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass

from ..units import MiB

# name: (bytes, source)
CONSTANTS: dict[str, tuple[int, str]] = {
    # CUDA context (driver state + loaded kernels). With lazy module loading (default from CUDA 11.7,
    # PyTorch >= 1.13) only kernels that run are loaded.
    "context_lazy": (
        400 * MiB,
        "~300-400 MB with CUDA >= 11.7 lazy loading (ptrblck, pytorch#107667, pytorch#109888); "
        "274 MiB lazy vs 636 MiB eager measured in pytorch#86509; 256 MiB on an RTX 3090 with torch 2.7.1+cu128 "
        "(invoke-ai/InvokeAI#9413). Default: the upper value, uncalibrated",
    ),
    "context_eager": (
        1000 * MiB,
        ">1000 MB when all kernels load at start-up (CUDA_MODULE_LOADING=EAGER or CUDA < 11.7; pytorch#107667)",
    ),
    # cuBLAS workspace per (handle, stream), allocated through the caching allocator.
    "cublas_workspace_default": (
        4096 * 1024 * 2 + 16 * 1024 * 8,
        'CUBLAS_WORKSPACE_CONFIG default ":4096:2:16:8" (aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize)',
    ),
    "cublas_workspace_sm90": (
        4096 * 8 * 1024,
        "32 MiB default on Hopper and Blackwell, major 9/10/12 (CublasHandlePool.cpp, parseChosenWorkspaceSize)",
    ),
    "cublaslt_workspace": (
        1024 * 1024,
        "CUBLASLT_WORKSPACE_SIZE default 1024 KiB (#73328); shared with the cuBLAS workspace unless "
        "TORCH_CUBLASLT_UNIFIED_WORKSPACE=0 (CublasHandlePool.cpp, unified_cublas_and_lt_workspaces)",
    ),
    # NCCL: per channel, per peer, for each of its protocols' buffers.
    "nccl_buffsize": (4 * MiB, "NCCL_BUFFSIZE default 4 MiB (NCCL environment-variable docs)"),
}
# Measured lazy-loading contexts by GPU generation (compute capability) where a public measurement
# exists; other generations use "context_lazy". Add rows from `memest calibrate` / validate_gpu.py runs.
CONTEXT_LAZY_BY_CC: dict[tuple[int, int], tuple[int, str]] = {
    (8, 6): (256 * MiB, "256 MiB measured on RTX 3090, torch 2.7.1+cu128, driver 610.43 (invoke-ai/InvokeAI#9413)"),
}
NCCL_CHANNELS_DEFAULT = 16  # assumption: NCCL picks 2-32 channels by topology; NCCL_MAX_NCHANNELS caps it
CUBLAS_HANDLES_IN_TRAINING = 2  # the forward thread and autograd's device thread each reserve a handle


@dataclass
class FixedCost:
    name: str
    bytes: int
    source: str
    calibrated: bool = False
    in_allocator: bool = False  # allocated through the caching allocator (part of reserved memory)

    def to_dict(self) -> dict:
        return asdict(self)


def cublas_workspace_bytes(compute_capability: tuple[int, int], env: dict | None = None) -> int:
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    key = "cublas_workspace_sm90" if compute_capability[0] in (9, 10, 12) else "cublas_workspace_default"
    return CONSTANTS[key][0]


def fixed_costs(
    compute_capability: tuple[int, int],
    world_size: int = 1,
    training: bool = True,
    calibration: dict | None = None,
    env: dict | None = None,
) -> list[FixedCost]:
    env = os.environ if env is None else env
    cal = calibration or {}
    costs = []
    eager = env.get("CUDA_MODULE_LOADING", "LAZY").upper() == "EAGER"
    key = "context_eager" if eager else "context_lazy"
    if "context_bytes" in cal and not eager:
        costs.append(FixedCost("cuda_context", int(cal["context_bytes"]), cal.get("source", "memest calibrate"), True))
    elif not eager and tuple(compute_capability) in CONTEXT_LAZY_BY_CC:
        nbytes, source = CONTEXT_LAZY_BY_CC[tuple(compute_capability)]
        costs.append(FixedCost("cuda_context", nbytes, source))
    else:
        costs.append(FixedCost("cuda_context", CONSTANTS[key][0], CONSTANTS[key][1]))

    handles = CUBLAS_HANDLES_IN_TRAINING if training else 1
    if "cublas_workspace_bytes" in cal:
        ws, src, calibrated = int(cal["cublas_workspace_bytes"]), cal.get("source", "memest calibrate"), True
    else:
        ws = cublas_workspace_bytes(compute_capability, env)
        src = CONSTANTS["cublas_workspace_sm90" if compute_capability[0] in (9, 10, 12) else "cublas_workspace_default"][1]
        calibrated = False
    costs.append(
        FixedCost(
            "cublas_workspaces", ws * handles, f"{handles} handle(s) x {ws} B: {src}", calibrated, in_allocator=True
        )
    )
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1") in ("0", "false", "False"):
        lt = int(env.get("CUBLASLT_WORKSPACE_SIZE", 1024)) * 1024
        costs.append(FixedCost("cublaslt_workspaces", lt * handles, CONSTANTS["cublaslt_workspace"][1], in_allocator=True))
    if world_size > 1:
        buff = int(env.get("NCCL_BUFFSIZE", CONSTANTS["nccl_buffsize"][0]))
        channels = int(env.get("NCCL_MAX_NCHANNELS", NCCL_CHANNELS_DEFAULT))
        peers = 2  # ring: previous and next rank
        costs.append(
            FixedCost(
                "nccl_buffers",
                buff * channels * peers,
                f"{buff} B x {channels} channels x {peers} peers; {CONSTANTS['nccl_buffsize'][1]}; "
                f"{channels} channels is an assumption (NCCL_MAX_NCHANNELS overrides)",
            )
        )
    return costs
