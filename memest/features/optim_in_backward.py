"""--optim-in-backward: the optimizer step fused into the backward pass, as the libraries run it.

One real ``torch.optim`` optimizer per parameter, stepped in the parameter's post-accumulate-grad hook and
then ``zero_grad(set_to_none=True)``, so each gradient is freed as soon as its parameter has stepped:
- the torch tutorial "How to save memory by fusing the optimizer step into the backward pass"
  (https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html);
- torchtune's ``optimizer_in_bwd`` (torchtune/training/memory.py: ``create_optim_in_bwd_wrapper``,
  ``register_optim_in_bwd_hooks``: ``p.register_post_accumulate_grad_hook(optim_step)`` with
  ``opt_dict[param].step(); opt_dict[param].zero_grad()``), whose wrapper's own step/zero_grad do nothing;
- torchtitan's ``OptimizersInBackwardContainer`` (torchtitan/components/optimizer.py), the same hooks.
Under FSDP2 (``fully_shard``) the hooks sit on the sharded parameters; FSDP2 calls them after the
reduce-scatter with the sharded gradient (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py,
``foreach_reduce``), so the trace runs FSDP2's own code path.

The step's loop calls ``optimizer.step()`` / ``zero_grad()`` as usual; here they are no-ops, as in torchtune."""

from __future__ import annotations

from collections.abc import Callable

import torch

from memest.features.base import StepFeature
from memest.trace.events import Category
from memest.trace.replay import Replays, replaying

SOURCES = (
    "https://pytorch.org/tutorials/intermediate/optimizer_step_in_backward_tutorial.html",
    "torchtune/training/memory.py (create_optim_in_bwd_wrapper, register_optim_in_bwd_hooks)",
)


class InBackwardOptimizer:
    """Per-parameter optimizers stepped in the post-accumulate-grad hooks (torchtune's
    OptimizerInBackwardWrapper shape). ``cls(params, **kwargs)`` builds each one (the --optim choice as
    features/optim.py configures it). ``on_grad(param)``: called in the hook before the step (the trace
    classifies the gradient there: it is freed before backward ends)."""

    def __init__(self, params, cls: type, kwargs: dict) -> None:
        self.params = list(params)
        self.optimizers = {p: cls([p], **kwargs) for p in self.params}
        self.on_grad: Callable[[torch.Tensor], None] | None = None
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def _hook(self, param: torch.Tensor) -> None:
        if self.on_grad is not None:
            self.on_grad(param)
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        """Every parameter stepped in backward already."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient was set to None in its hook."""

    @property
    def state(self) -> dict:
        """param -> state over every per-parameter optimizer (what torch.optim's ``.state`` holds)."""
        return {p: s for opt in self.optimizers.values() for p, s in opt.state.items()}

    @property
    def paged(self) -> list:
        """bitsandbytes' paged buffers of every per-parameter optimizer (features/optim.py reads them)."""
        return [t for opt in self.optimizers.values() for t in getattr(opt, "paged", ())]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles = []


class OptimInBackwardFeature(StepFeature):
    """The trace's part: each gradient is a gradient (owned by its parameter's module) from its hook on,
    since it is gone by the end of backward, where the step classifies the others."""

    name = "optim_in_backward"

    def __init__(self) -> None:
        self.hooked = 0
        self.replays: Replays | None = None

    def register(self, step) -> None:
        optimizer = step.optimizer
        if not isinstance(optimizer, InBackwardOptimizer):
            return
        tracker, trace, owner = step.tracker, step.trace, step.owner_of_param
        self.hooked = len(optimizer.params)

        def on_grad(param: torch.Tensor) -> None:
            sid = tracker.storage_id(param.grad) if param.grad is not None else None
            if sid is not None:
                trace.storages[sid].classify(Category.GRADIENTS)
                trace.owner_module[sid] = owner.get(id(param), "")

        optimizer.on_grad = on_grad

    def contexts(self, step) -> list:
        """torch.optim's update functions (Adam/AdamW's and SGD's, single-tensor and foreach) replayed from their first
        call with the same argument metadata and step count (trace/replay.py): one optimizer per parameter runs the
        same update once per parameter, for parameters of a few shapes. Not under --compile."""
        if not isinstance(step.optimizer, InBackwardOptimizer) or step.spec.compile:
            return []
        import torch.optim.adam as adam
        import torch.optim.sgd as sgd

        self.replays = Replays()
        patches = [(module, name, f"torch.optim {module.__name__.rsplit('.', 1)[-1]} {name}")
                   for module, names in ((adam, ("_single_tensor_adam", "_multi_tensor_adam")),
                                         (sgd, ("_single_tensor_sgd", "_multi_tensor_sgd")))
                   for name in names if hasattr(module, name)]
        return [replaying(self.replays, patches)]

    def finish(self, step) -> list[str]:
        if not self.hooked:
            return []
        return [
            f"--optim-in-backward: {self.hooked} per-parameter {step.spec.optim} optimizers stepped in "
            "register_post_accumulate_grad_hook hooks, each gradient freed as its parameter steps (the torch tutorial "
            "'How to save memory by fusing the optimizer step into the backward pass'; torchtune optimizer_in_bwd): "
            "no extra FLOPs; no gradient accumulation, no gradient clipping over the whole model"
        ]
