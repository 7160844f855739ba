"""--target cpu as a step feature: what the real CPU kernels allocate that their fake kernels do not show."""

from __future__ import annotations

from memest.features.base import StepFeature
from memest.targets.cpu import cpu_kernels, cpu_notes
from memest.targets.cpu.rng_state import tracked_cpu_rng_state
from memest.trace.tracker import TrackerRules


class CpuTarget(StepFeature):
    """oneDNN's workspaces and scratch, aten's CPU buffers (targets/cpu/), and the CPU generator's state that
    activation checkpointing keeps."""

    name = "cpu"

    def __init__(self) -> None:
        self.conv = None  # the convolution scratch model (targets/cpu/onednn_conv.py), counting its calls

    def rules(self, step) -> TrackerRules:
        scratch, outputs, self.conv = cpu_kernels()
        return TrackerRules(scratch=scratch, outputs=outputs)

    def contexts(self, step) -> list:
        return [tracked_cpu_rng_state()] if step.spec.checkpointing != "none" else []

    def finish(self, step) -> list[str]:
        return cpu_notes(step.trace, self.conv, step.spec.mode) if self.conv is not None else []
