"""Training loops that empty the device cache during the step, as libraries do it (the model code's own
``torch.cuda.empty_cache()`` calls are recorded by trace/empty_cache.py).

``--empty-cache-steps N`` (TrainingArguments' ``torch_empty_cache_steps``): transformers 5.24.0
src/transformers/trainer.py ``Trainer.training_step``, once per micro-step::

    with self.compute_loss_context_manager():
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
    del inputs
    if (self.args.torch_empty_cache_steps is not None
            and self.state.global_step % self.args.torch_empty_cache_steps == 0):
        clear_device_cache()
    ...
    self.accelerator.backward(loss, **kwargs)

``clear_device_cache`` (accelerate 1.15.0 accelerate/utils/memory.py) calls ``torch.cuda.empty_cache()`` on a CUDA
machine; ``global_step`` counts the optimizer steps done, 0 during the first. So every micro-step of the steps
0, N, 2N... empties the cache between its loss and its backward (Trainer's compute_loss has dropped the outputs:
--outputs freed, which TrainingArguments configs set). accelerate's call is guarded by its CUDA check (False where
the CLI hides CUDA), so the trace records it here, after the loss (``StepFeature.after``), not through torch.

memest's traced step i (1, 2) is the run's step i - 1: step 1 empties the cache; step 2 does only with N = 1.
With N > 1 the calls of both traced steps are recorded with ``every=N`` and the replay forms the run's pairs of
steps from them (device/usage.py ``empty_cache_schedules``).
"""

from __future__ import annotations

from memest.features.base import StepFeature
from memest.spec.choices import Optimizer, Quant
from memest.trace.events import Phase

TRAINER_SOURCE = ("transformers 5.24.0 trainer.py Trainer.training_step: clear_device_cache() after the loss when "
                  "global_step % torch_empty_cache_steps == 0")

# bitsandbytes' optimizers (features/optim.py: adam8bit, paged AdamW): the run imports bitsandbytes to build them
BNB_OPTIMIZERS = (Optimizer.ADAM8BIT, Optimizer.PAGED_ADAMW_8BIT, Optimizer.PAGED_ADAMW_32BIT)


def bitsandbytes_imported(spec) -> str:
    """Why the run certainly imports bitsandbytes ('' where memest cannot tell: peft imports it for LoRA wherever it
    is installed, peft/tuners/lora/model.py ``is_bnb_available()``)."""
    if spec.quant != Quant.NONE:
        return f"--quant {spec.quant}: bitsandbytes' quantized layers"
    if spec.optim in BNB_OPTIMIZERS:
        return f"--optim {spec.optim}: a bitsandbytes optimizer"
    return ""


class EmptyCacheStepsFeature(StepFeature):
    """--empty-cache-steps N: the device cache emptied after the loss of each micro-step of the steps Trainer's
    rule picks (module docstring)."""

    name = "empty_cache_steps"

    def __init__(self, every: int) -> None:
        self.every = every

    def after(self, step, phase) -> None:
        if phase is not Phase.LOSS:
            return
        # recorded in both traced steps; with N > 1 the replay picks the steps that make it (``every``)
        step.trace.empty_cache(step.tracker.iteration, f"Trainer's torch_empty_cache_steps {self.every} after the "
                               "loss (clear_device_cache)", every=self.every)
