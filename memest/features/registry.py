"""The composition root of the traced step: which step features a spec uses, in the order their hooks run,
and the step's functions with those features (what every caller outside the trace core uses).

Adding a technique: a StepFeature (features/base.py) in its own module, one line in ``features_for``."""

from __future__ import annotations

from memest.features.activation_offload import ActivationOffloadFeature, TorchtuneOffloadFeature, TrlOffloadFeature
from memest.features.base import StepFeature
from memest.features.checkpointing import CheckpointingFeature
from memest.features.compiled import CompileFeature
from memest.features.empty_cache import EmptyCacheStepsFeature
from memest.features.finetune import FinetuneFeature
from memest.features.fp8 import Fp8Feature
from memest.features.grpo import GRPOFeature
from memest.features.loss_head import LossHeadFeature
from memest.features.mxfp8 import MxFp8Feature
from memest.features.optim import OptimizerFeature, step_optimizer
from memest.features.optim_in_backward import OptimInBackwardFeature
from memest.features.preference_feature import PreferenceFeature
from memest.features.te_fp8 import TEFp8Feature
from memest.features.upper_bound import UpperBoundFeature
from memest.parallel.feature import ParallelFeature
from memest.spec import RunSpec
from memest.spec.choices import ActivationOffload, DataDependent, Fp8, LossHead, Offload, Preference, Quant, Target
from memest.targets.cpu.feature import CpuTarget
from memest.targets.cuda.feature import CudaTarget
from memest.trace import step as core
from memest.trace.events import Trace


def features_for(spec: RunSpec) -> list[StepFeature]:
    """New feature objects for one trace of ``spec``. Order matters: model transforms in build order (the
    model file's torch.compile unwrapped first, then quantization/LoRA, then checkpointing), a target's
    kernel rules before the size-bounded ops chained onto them, parallelism before the plain optimizer
    (its wrapper's optimizer wins), notes in report order."""
    features: list[StepFeature] = [CompileFeature()]  # also a model file that compiles itself
    if spec.lora or spec.freeze or spec.quant != Quant.NONE:
        features.append(FinetuneFeature())
    if spec.fp8 != Fp8.NONE:  # torchao converts the Linear layers before checkpointing (torchtitan's order)
        features.append(MxFp8Feature(spec.fp8) if spec.fp8.is_mx else
                        TEFp8Feature() if spec.fp8 == Fp8.TE_DELAYED else Fp8Feature())
    if spec.checkpointing != "none":
        features.append(CheckpointingFeature())
    if spec.activation_offload != ActivationOffload.NONE:  # saved tensors to host memory (save_on_cpu's hooks)
        kind = {ActivationOffload.TORCHTUNE: TorchtuneOffloadFeature, ActivationOffload.TRL: TrlOffloadFeature}.get(
            spec.activation_offload, ActivationOffloadFeature)  # torchtune's or trl's OffloadActivations, or save_on_cpu
        features.append(kind(spec.activation_offload, ActivationOffloadFeature.moves_for(spec)))
    if spec.preference == Preference.GRPO:  # trl GRPOTrainer's generation + training step (features/grpo.py)
        features.append(GRPOFeature(spec))
    elif spec.preference != Preference.NONE:  # the policy + reference step of trl's trainer, after LoRA and checkpointing
        features.append(PreferenceFeature(spec))
    if spec.empty_cache_steps:  # Trainer's torch_empty_cache_steps: the cache emptied after the loss
        features.append(EmptyCacheStepsFeature(spec.empty_cache_steps))
    if LossHead.of(spec.loss_head)[0] is not LossHead.STANDARD:
        features.append(LossHeadFeature())
    features.append(CudaTarget() if spec.target == Target.CUDA else CpuTarget())
    if spec.data_dependent == DataDependent.UPPER_BOUND:
        features.append(UpperBoundFeature())
    if spec.world_size > 1 or spec.offload in (Offload.OPTIMIZER, Offload.PARAMS):  # CPU offload of model state
        features.append(ParallelFeature())
    features.append(OptimizerFeature())
    if spec.optim_in_backward:
        features.append(OptimInBackwardFeature())
    return features


def trace_step(source, spec: RunSpec) -> Trace:
    """The traced step of ``spec`` with its features (trace/step.trace_step)."""
    return core.trace_step(source, spec, features=features_for(spec))


def build(source, spec: RunSpec) -> core.Built:
    """Model and inputs as the spec's step runs them (trace/step.build), for real runs and probes."""
    return core.build(source, spec, features_for(spec))


__all__ = ["autocast_context", "build", "features_for", "run_iteration", "run_step", "step_optimizer", "trace_step"]


def run_step(
    model, inputs, optimizer, compute_loss, spec: RunSpec, on_phase=None, after=None, device_type: str = "cpu",
    max_micro_steps: int | None = None, loop: core.LoopState | None = None,
) -> None:
    """One step of the spec's mode with its features (trace/step.run_step), for real runs."""
    core.run_step(model, inputs, optimizer, compute_loss, spec, on_phase, after, device_type, max_micro_steps, loop,
                  features=features_for(spec))


def run_iteration(
    model, inputs, optimizer, compute_loss, spec: RunSpec, on_phase=None, after=None, device_type: str = "cpu",
    max_micro_steps: int | None = None, loop: core.LoopState | None = None,
) -> None:
    """One training step with the spec's features (trace/step.run_iteration), for real runs."""
    core.run_iteration(model, inputs, optimizer, compute_loss, spec, on_phase, after, device_type, max_micro_steps,
                       loop, features=features_for(spec))


def autocast_context(spec: RunSpec, device_type: str = "cpu"):
    """The spec's mixed-precision context (trace/step.autocast_context) with its features."""
    return core.autocast_context(spec, device_type, features=features_for(spec))

