"""``memest.preflight(model, optimizer, sample_batch)``: the check for hand-written training loops.

The user's model is rebuilt under memest's fake tensors (``fake_factory``: a deep copy whose parameters and
buffers are replaced by new tensors of the same shapes, dtypes and requires_grad, created in the fake mode the
trace runs in, so no real tensor is read or copied); the optimizer is mapped by class to an ``--optim`` choice
with its lr and fused flag (``optim_settings``); the batch becomes an inputs factory of the same shapes and dtypes
(``batch_factory``, its first dimension the batch size). Then memest.estimate traces the step as usual."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from memest.api import estimate
from memest.errors import MemestError
from memest.integrations.check import Preflight, check_margin, gpu_budget, judge, react
from memest.spec.choices import OnFail

# torch.optim / bitsandbytes.optim class name -> memest's --optim choice (features/optim.py's table)
OPTIMIZER_CHOICES = {
    "Adam": "adam", "AdamW": "adamw", "Adafactor": "adafactor",
    "Adam8bit": "adam8bit", "AdamW8bit": "adam8bit", "PagedAdamW8bit": "paged-adamw-8bit",
    "PagedAdamW": "paged-adamw-32bit", "PagedAdamW32bit": "paged-adamw-32bit",
}


def preflight(model, optimizer, sample_batch, *, loss_fn: Callable[[Any, Any], Any] | None = None,
              gpu: int | str | None = None, margin: float = 0.0, on_fail: str = "warn", **options: Any) -> Preflight:
    """Estimate the step ``loss_fn(model(*sample_batch), sample_batch).backward(); optimizer.step()`` without
    touching the real tensors. ``sample_batch``: a tensor, a tuple/list of positional inputs or a dict of keyword
    inputs (a transformers batch); its first dimension is the batch size. ``loss_fn(output, batch)``: default
    memest's (the output's ``loss``, else its sum). ``gpu``: a card name, a size ('80GB') or bytes; default the
    present GPU's total memory (none: no verdict). ``margin``: the fraction of the budget kept free. ``on_fail``:
    'warn' or 'raise' (DoesNotFitError). ``options``: any other memest.estimate keyword (precision, seq,
    checkpointing, grad_accum, target, ...); precision defaults to the parameters' dtype (fp32 or bf16/fp16).
    Returns a Preflight; nothing is allocated beyond the fake trace."""
    reaction = OnFail.parse(on_fail, "on_fail")
    result = estimate_step(model, optimizer, sample_batch, loss_fn=loss_fn, gpu=gpu, margin=margin, **options)
    react(result, OnFail.RAISE if reaction == OnFail.STOP else reaction)
    return result


def estimate_step(model, optimizer, sample_batch, *, loss_fn=None, gpu=None, margin: float = 0.0,
                  wrap: Callable | None = None, shared: tuple = (), **options: Any) -> Preflight:
    """preflight's estimate and verdict, without the reaction. ``wrap(built_copy) -> module``: what the trace
    runs instead of the copy itself (Lightning's training_step)."""
    check_margin(margin)  # before the trace, not after it
    factory = fake_factory(model, wrap, shared)
    inputs, batch = batch_factory(sample_batch)
    if "batch" in options and options["batch"] != batch:  # was: batch=8 over a sample of 2 silently (battery 29, A26)
        raise MemestError(f"memest.preflight: batch={options['batch']!r} disagrees with sample_batch's first dimension "
                          f"({batch}); the sample's size is the batch: drop batch=, or pass a sample of that size")
    settings = {"batch": batch, **optim_settings(optimizer, model), **options}
    settings.setdefault("precision", _precision(model))
    budget, label, cc = gpu_budget(gpu)
    if cc is not None:
        settings.setdefault("compute_capability", cc)
    est = estimate(factory, inputs=inputs, loss=loss_fn, gpu=gpu if isinstance(gpu, str) else None, **settings)
    return judge(est, budget, margin, settings, label)


def fake_factory(model, wrap: Callable | None = None, shared: tuple = ()) -> Callable[[], Any]:
    """A zero-argument factory memest calls under its fake mode: a deep copy of ``model`` whose parameters and
    buffers are new (fake) tensors of the same shape, dtype and requires_grad, so tied weights stay tied and the
    real tensors are neither read nor copied. ``shared``: objects the copy refers to, not copied (a trainer)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise MemestError(f"memest.preflight: model must be a torch.nn.Module, not {type(model).__name__}")

    def build():
        memo: dict = {id(obj): obj for obj in shared}
        loose = [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
        for t in [*model.parameters(), *model.buffers(), *loose]:  # loose: tensors kept as plain attributes
            if id(t) in memo:
                continue
            if type(t) not in (torch.Tensor, torch.nn.Parameter, torch.nn.parameter.Buffer):
                raise MemestError(f"memest.preflight: {type(model).__name__} holds a {type(t).__name__} parameter "
                                  "(quantized or sharded); build it with memest.estimate('hf:...', quant=...) instead")
            fake = torch.empty(t.shape, dtype=t.dtype)
            memo[id(t)] = torch.nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(
                t, torch.nn.Parameter) else fake
        built = copy.deepcopy(model, memo)
        built = built.cpu() if any(t.device.type != "cpu" for t in built.parameters()) else built
        return wrap(built) if wrap is not None else built

    build.__qualname__ = type(model).__name__
    return build


def batch_factory(sample_batch) -> tuple[Callable[[int], Any], int]:
    """(inputs factory taking the batch size, the sample's batch size): the same structure, shapes and dtypes."""
    import torch

    tensors = [t for t in _leaves(sample_batch) if isinstance(t, torch.Tensor)]
    if not tensors or any(t.dim() == 0 for t in tensors):
        raise MemestError("memest.preflight: sample_batch must hold tensors with a batch dimension (a tensor, a "
                          "tuple of them or a dict of them)")
    batch = tensors[0].shape[0]

    def like(t, b):
        if not isinstance(t, torch.Tensor):
            return t
        shape = (b, *t.shape[1:]) if t.shape[0] == batch else t.shape
        return torch.zeros(shape, dtype=t.dtype)

    def inputs(batch_size):
        if isinstance(sample_batch, torch.Tensor):
            return (like(sample_batch, batch_size),)
        if isinstance(sample_batch, dict) or hasattr(sample_batch, "keys"):
            return {k: like(v, batch_size) for k, v in sample_batch.items()}
        return tuple(like(t, batch_size) for t in sample_batch)

    return inputs, int(batch)


def optim_settings(optimizer, model) -> dict:
    """memest.estimate's optim, lr and fused for ``optimizer``; a MemestError for a class or setting memest does
    not model, and when it steps other parameters than the model's trainable ones."""
    if optimizer is None:
        return {"mode": "inference"}
    name = type(optimizer).__name__
    group = optimizer.param_groups[0] if optimizer.param_groups else {}
    if name == "SGD":
        choice = "sgd-momentum" if group.get("momentum", 0) else "sgd"
    elif name in OPTIMIZER_CHOICES:
        choice = OPTIMIZER_CHOICES[name]
    else:
        raise MemestError(f"memest.preflight: {name} is not an optimizer memest models; it models torch.optim SGD, "
                          f"{', '.join(sorted(OPTIMIZER_CHOICES))} (bitsandbytes' 8-bit ones by their names)")
    if group.get("amsgrad"):
        raise MemestError(f"memest.preflight: {name}(amsgrad=True) keeps a third state tensor memest does not model")
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    if stepped != trainable:
        raise MemestError(f"memest.preflight: the optimizer steps {len(stepped)} tensors, the model has "
                          f"{len(trainable)} trainable parameters; memest models an optimizer over exactly the "
                          "trainable ones (set requires_grad=False on the others)")
    out = {"optim": choice, "lr": float(group.get("lr", 1e-3))}
    if group.get("fused"):
        out["fused"] = True
    return out


def _precision(model) -> str:
    import torch

    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if dtypes == {torch.bfloat16}:
        return "bf16"
    if dtypes == {torch.float16}:
        return "fp16"
    return "fp32"


def _leaves(batch):
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return list(batch.values())
    if isinstance(batch, (tuple, list)):
        return list(batch)
    return [batch]
