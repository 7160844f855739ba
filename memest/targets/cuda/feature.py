"""--target cuda as a step feature: the CUDA kernels' rules for a step traced on CPU fake tensors."""

from __future__ import annotations

import contextlib

from memest.features.base import StepFeature
from memest.targets.cuda.autocast import cast_cache, cuda_autocast, cuda_autocast_scope
from memest.targets.cuda.kernels import CUDA_OUTPUTS, CudaKernels, cuda_scratch
from memest.targets.cuda.sdpa import CudaSdpa
from memest.trace.step import autocast_dtype
from memest.trace.tracker import TrackerRules


class CudaTarget(StepFeature):
    """Kernel scratch and output rules (cuDNN, cuBLAS, SDPA backward), SDPA's backend choice, dropout and
    cuDNN RNNs as CUDA runs them, and CUDA autocast's op lists (also in backward, where checkpointing
    replays the forward)."""

    name = "cuda"

    def __init__(self) -> None:
        self.sdpa: CudaSdpa | None = None
        self.kernels: CudaKernels | None = None

    def rules(self, step) -> TrackerRules:
        return TrackerRules(scratch=cuda_scratch(step.spec.cudnn_benchmark), outputs=CUDA_OUTPUTS)

    def contexts(self, step) -> list:
        self.sdpa = CudaSdpa(step.spec.attention, step.spec.compute_capability)
        self.kernels = CudaKernels()
        return [self.sdpa, self.kernels] + ([cuda_autocast_scope()] if step.spec.mixed else [])

    def caches(self) -> list[dict]:
        return [cast_cache()]

    def counters(self) -> list[object]:
        return [c for c in (self.sdpa, self.kernels.rnn if self.kernels else None) if c is not None]

    def autocast(self, spec, device_type: str) -> contextlib.AbstractContextManager | None:
        """Tracing a CUDA run on CPU tensors: CUDA autocast's rules; a real GPU run keeps torch.autocast."""
        return cuda_autocast(autocast_dtype(spec)) if device_type == "cpu" else None

    def finish(self, step) -> list[str]:
        if self.sdpa is None:
            return []
        step.trace.attention_backends = dict(self.sdpa.choices)
        if not self.kernels.rnn.calls:
            return []
        calls = ", ".join(f"{name} x{n}" for name, n in sorted(self.kernels.rnn.calls.items()))
        return [f"RNNs run as cuDNN's _cudnn_rnn ({calls}): reserve and workspace per docs/cuda-kernels.md"]
