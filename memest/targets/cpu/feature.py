"""--target cpu as a step feature: what the real CPU kernels allocate that their fake kernels do not show."""

from __future__ import annotations

from memest.features.base import StepFeature
from memest.targets.cpu import HalfMatmuls, cpu_kernels, cpu_notes, onednn_half_matmul
from memest.targets.cpu.rng_state import tracked_cpu_rng_state
from memest.trace.tracker import TrackerRules


class CpuTarget(StepFeature):
    """oneDNN's workspaces and scratch, aten's CPU buffers (targets/cpu/), and the CPU generator's state that
    activation checkpointing keeps."""

    name = "cpu"

    def __init__(self) -> None:
        self.conv = None  # the convolution scratch model (targets/cpu/onednn_conv.py), counting its calls
        self.half = HalfMatmuls() if onednn_half_matmul() else None  # bf16/fp16 matmuls oneDNN runs, not modelled

    def rules(self, step) -> TrackerRules:
        scratch, outputs, self.conv = cpu_kernels()
        if self.half is not None:
            scratch.update(dict.fromkeys(HalfMatmuls.OPS, self.half))
        return TrackerRules(scratch=scratch, outputs=outputs)

    def contexts(self, step) -> list:
        return [tracked_cpu_rng_state()] if step.spec.checkpointing != "none" else []

    def counters(self) -> list[object]:
        return [c for c in (self.conv, self.half) if c is not None]

    def finish(self, step) -> list[str]:
        notes = cpu_notes(step.trace, self.conv, step.spec.mode) if self.conv is not None else []
        if self.half is not None and self.half.calls:
            notes.append(
                f"{self.half.calls} bf16/fp16 matmuls: this CPU runs them through oneDNN (AVX-512/AMX), whose operand "
                "reorders and scratchpads (26 KiB to 3 MiB per call measured on an AMX Xeon) memest does not model: "
                "the real peak can be higher (fp32 matmuls and CPUs without AVX-512 are modelled; "
                "targets/cpu/__init__.py onednn_half_matmul)"
            )
        return notes
