"""``MemestCallback`` for Lightning: at ``on_train_start`` (the optimizers configured, the train dataloader set up,
no batch run yet) the step estimated from the LightningModule rebuilt under fake tensors (its ``training_step``
traced on a batch of the first batch's shapes), the trainer's optimizer, precision and accumulation; a warning,
an error, or ``trainer.should_stop`` (the fit loop ends before its first batch) when it does not fit; after step 2
on a GPU, predicted vs measured (one log line and ``callback.result.measured``).

    trainer = L.Trainer(callbacks=[MemestCallback(gpu="a100", on_fail="stop")])"""

from __future__ import annotations

from typing import Any

import torch

try:
    from lightning.pytorch.callbacks import Callback
except ImportError:  # the older package name
    try:
        from pytorch_lightning.callbacks import Callback
    except ImportError as exc:
        raise ImportError("memest.integrations.lightning needs Lightning: pip install 'memest[lightning]'") from exc

from memest.errors import MemestError
from memest.integrations.check import Preflight, check_arguments, react
from memest.integrations.preflight import estimate_step
from memest.spec.choices import OnFail

# Trainer(precision=...) as Lightning normalises it -> memest's --precision
LIGHTNING_PRECISION = {"32-true": "fp32", "bf16-mixed": "bf16-mixed", "16-mixed": "fp16-mixed",
                       "bf16-true": "bf16", "16-true": "fp16"}


class MemestCallback(Callback):
    """``sample_batch``: a batch (default: the train dataloader's first, peeked with torch's RNG state restored).
    ``gpu``, ``margin``, ``options``: as memest.preflight. ``on_fail``: 'warn', 'raise' (DoesNotFitError from
    ``trainer.fit``) or 'stop' (``trainer.should_stop``: fit ends before its first batch). ``self.result``: the
    Preflight."""

    def __init__(self, *, sample_batch=None, gpu: int | str | None = None, margin: float = 0.0,
                 on_fail: str = "warn", **options: Any):
        self.sample_batch, self.gpu, self.margin, self.options = sample_batch, gpu, margin, options
        self.on_fail = OnFail.parse(on_fail, "on_fail")
        check_arguments("MemestCallback: ", gpu, margin, options)
        self.result: Preflight | None = None

    def on_train_start(self, trainer, pl_module):
        if len(trainer.optimizers) != 1:
            raise MemestError(f"memest's Lightning callback models one optimizer; {type(pl_module).__name__} "
                              f"configures {len(trainer.optimizers)}")
        batch = self.sample_batch if self.sample_batch is not None else first_batch(trainer.train_dataloader)
        precision = str(trainer.precision)
        if precision not in LIGHTNING_PRECISION:
            raise MemestError(f"memest's Lightning callback: precision={precision!r} is not one it models "
                              f"({', '.join(LIGHTNING_PRECISION)})")
        settings = {"precision": LIGHTNING_PRECISION[precision], "grad_accum": trainer.accumulate_grad_batches,
                    **self.options}
        self.result = estimate_step(pl_module, trainer.optimizers[0], batch, gpu=self.gpu, margin=self.margin,
                                    wrap=lambda m: TrainingStep(m, batch), shared=(trainer,), **settings)
        if react(self.result, self.on_fail):
            trainer.should_stop = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.result is not None:
            self.result.after_step(trainer.global_step)


class TrainingStep(torch.nn.Module):
    """The LightningModule's ``training_step(batch, 0)`` as a forward returning its loss (its ``log`` calls
    dropped: they go to the trainer, which the copy does not own)."""

    def __init__(self, module, sample_batch):
        super().__init__()
        self.module = module
        self.kind = type(sample_batch)
        module.log = module.log_dict = lambda *a, **k: None

    def forward(self, *args, **kwargs):
        if kwargs:
            batch = kwargs
        elif isinstance(self.kind, type) and issubclass(self.kind, torch.Tensor):
            batch = args[0]
        else:
            batch = list(args) if issubclass(self.kind, list) else tuple(args)
        out = self.module.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out


def first_batch(dataloader):
    state = torch.random.get_rng_state()
    try:
        return next(iter(dataloader))
    finally:
        torch.random.set_rng_state(state)
