"""``MemestCallback`` for transformers' ``Trainer``: at train start, the run estimated from the trainer's own model
config (the model rebuilt under fake tensors from ``model.config``, as ``memest estimate hf:config.json`` does, not
from the loaded weights; a peft-wrapped model's base config, its LoRA, its bitsandbytes quantization, whether peft's
prepare_model_for_kbit_training ran, and the live model's gradient checkpointing: hf_model.py) and its ``TrainingArguments`` (with DeepSpeed, FSDP and the world size); a warning, or an error before the first step, when
it does not fit; after step 2 on a GPU, predicted vs measured (one log line and ``callback.result.measured``).

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[MemestCallback(seq=2048, on_fail="stop")])"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from memest.api import estimate
from memest.errors import MemestError
from memest.integrations.check import Preflight, check_arguments, gpu_budget, judge, react
from memest.integrations.hf_model import (
    base_model,
    checkpointing_settings,
    kbit_prepared_dtype,
    layout_settings,
    model_settings,
)
from memest.spec.choices import OnFail

# TrainingArguments.optim (transformers' OptimizerNames) -> memest's --optim and fused flag
HF_OPTIMIZERS = {
    "adamw_torch": ("adamw", False), "adamw_torch_fused": ("adamw", True), "adafactor": ("adafactor", False),
    "sgd": ("sgd", False), "adamw_bnb_8bit": ("adam8bit", False), "adamw_8bit": ("adam8bit", False),
    "paged_adamw_8bit": ("paged-adamw-8bit", False), "paged_adamw_32bit": ("paged-adamw-32bit", False),
}


class MemestCallback(TrainerCallback):
    """``seq``: the sequence length (default: the train dataloader's first batch, peeked with torch's RNG state
    restored). ``gpu``: a card name, a size or bytes (default: the present GPU's memory). ``margin``: the fraction
    of the budget kept free. ``on_fail``: 'warn', or 'raise' / 'stop': DoesNotFitError from ``trainer.train()``
    before its first step. The Trainer reads ``control.should_training_stop`` only after a step has run
    (transformers 5.24, trainer.py ``_run_epoch``), so a callback cannot end it earlier any other way; 'stop' also
    sets the flag. ``options``: other memest.estimate
    keywords (they override what the arguments give). The answer is ``self.result`` (a Preflight)."""

    def __init__(self, *, seq: int | None = None, gpu: int | str | None = None, margin: float = 0.0,
                 on_fail: str = "warn", **options: Any):
        self.seq, self.gpu, self.margin, self.options = seq, gpu, margin, options
        self.on_fail = OnFail.parse(on_fail, "on_fail")
        check_arguments("MemestCallback: ", gpu, margin, {"seq": seq, **options})
        self.result: Preflight | None = None

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        settings = {**trainer_settings(args, model), **self.options}
        seq = self.seq or settings.pop("seq", None) or first_batch_seq(train_dataloader)
        if seq is not None:
            settings["seq"] = seq
        self.result = estimate_config(base_model(model).config, self.gpu, self.margin, settings)
        if self.on_fail == OnFail.STOP and self.result.fits is False:
            control.should_training_stop = True
        react(self.result, OnFail.RAISE if self.on_fail == OnFail.STOP else self.on_fail)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        if self.result is not None:
            self.result.after_step(state.global_step)
        return control


def trainer_settings(args, model) -> dict:
    """memest.estimate's keywords for TrainingArguments ``args`` training ``model`` on one device."""
    optim = getattr(args.optim, "value", args.optim)
    if optim not in HF_OPTIMIZERS:
        raise MemestError(f"MemestCallback: TrainingArguments.optim={optim!r} is not one memest models; it models "
                          f"{', '.join(HF_OPTIMIZERS)}")
    choice, fused = HF_OPTIMIZERS[optim]
    base = base_model(model)
    prepared = kbit_prepared_dtype(base)  # peft's prepare_model_for_kbit_training ran on a 16-bit quantized base
    settings: dict = {"batch": args.per_device_train_batch_size, "grad_accum": args.gradient_accumulation_steps,
                      "optim": choice, "lr": float(args.learning_rate), "precision": _precision(args, model, prepared)}
    if fused:
        settings["fused"] = True
    if prepared is not None:
        settings["prepare_kbit"] = True
    if getattr(args, "torch_empty_cache_steps", None):  # training_step empties the cache (features/empty_cache.py)
        settings["empty_cache_steps"] = args.torch_empty_cache_steps
    if getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False):
        settings["checkpointing"] = "blocks"  # transformers' own switch on an hf: model (features/checkpointing.py)
    settings.update(checkpointing_settings(base))  # what the live model has: the Trainer's switch, or peft's
    return {**settings, **model_settings(model), **layout_settings(args)}


def estimate_config(config, gpu, margin: float, settings: dict) -> Preflight:
    """The estimate of ``hf:<config as JSON>`` with ``settings``, judged against ``gpu`` (or the present GPU)."""
    budget, label, cc = gpu_budget(gpu)
    if cc is not None:
        settings.setdefault("compute_capability", cc)
    with tempfile.TemporaryDirectory(prefix="memest-") as tmp:
        path = Path(tmp) / "config.json"
        data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        data.pop("quantization_config", None)  # the base is built unquantized; settings' quant stands in for it
        path.write_text(json.dumps(data))
        est = estimate(f"hf:{path}", gpu=gpu if isinstance(gpu, str) else None, **settings)
    return judge(est, budget, margin, settings, label)


def first_batch_seq(dataloader) -> int | None:
    """The sequence length of the first batch's ``input_ids`` (torch's CPU RNG state restored after the peek)."""
    if dataloader is None:
        return None
    import torch

    state = torch.random.get_rng_state()
    try:
        batch = next(iter(dataloader))
    finally:
        torch.random.set_rng_state(state)
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return int(ids.shape[1]) if ids is not None and ids.dim() == 2 else None


def _precision(args, model, prepared=None) -> str:
    """The weights' dtype, or autocast's over fp32 weights. A base prepared by prepare_model_for_kbit_training
    (``prepared``: the 16-bit dtype it was loaded in) holds its non-quantized weights in fp32: under the arguments'
    autocast that is bf16-mixed / fp16-mixed (docs/finetuning.md), without it the dtype it was loaded in, which
    prepare_kbit then casts as peft did."""
    import torch

    mixed = "bf16-mixed" if args.bf16 else "fp16-mixed" if args.fp16 else None
    if prepared is not None:
        return mixed or ("bf16" if prepared == torch.bfloat16 else "fp16")
    dtype = getattr(model, "dtype", torch.float32)
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return mixed or "fp32"
