"""What a config asks of its model that the model's structure answers without a trace (issue 22, 28): `check`
refuses a bad config before it traces any, so a batch of configs fails at once, naming the file and key.

The checks are the trace's own (the same functions, on the same model), run on a model built at no memory: an
hf: config's model on the meta device (transformers builds from the config alone), a model file's under fake
tensors. A model that does not build so is left to the trace, which says why."""

from __future__ import annotations

import torch

from memest.errors import MemestError
from memest.features.compiled import is_compiled
from memest.features.finetune import expand_freeze, unmatched_freeze
from memest.parallel import expert_parallel, pipeline_parallel, tensor_parallel
from memest.spec import RunSpec
from memest.spec.lora import freeze_patterns
from memest.trace.step import check_positions


def check_before_trace(source, spec: RunSpec) -> None:
    """Raise what tracing ``spec`` on ``source`` would raise for its sequence length, ``freeze`` patterns, and
    its tensor-, expert- and pipeline-parallel layout against the model's heads, experts and layers."""
    check_positions(source, spec, spec.seq)
    patterns = freeze_patterns(spec.freeze)
    d = spec.parallel
    if not (patterns or d.tp_enabled or d.ep_enabled or d.pp_enabled):
        return
    model = structure(source)
    if model is None:
        return
    if patterns:
        missing = unmatched_freeze([name for name, _ in model.named_parameters()], expand_freeze(model, patterns),
                                   of=source.name)
        if missing:
            raise MemestError(missing)
    if d.tp_enabled:
        tensor_parallel.tp_plan(model, spec)  # a model without a plan; heads that tp does not divide
    if d.ep_enabled:
        expert_parallel.ep_plan(model, spec)  # a model without experts; experts that ep does not divide
    if d.pp_enabled:
        _check_stages(model, spec)


def _check_stages(model, spec: RunSpec) -> None:
    """--pp-split against the model's layers: as many counts as stages, adding up to the layers, none empty
    (parallel/pipeline_parallel.stage_modules, for every stage: the estimate traces each pipeline rank)."""
    bounds = pipeline_parallel.split_layers(len(pipeline_parallel._decoder_parts(model).layers), spec)
    empty = [s for s, (start, end) in enumerate(bounds) if start == end]
    if empty and spec.pp_split:
        raise MemestError(
            f"--pp-split {spec.pp_split}: stage {empty[0]} holds no layer (an empty stage still takes a pipeline rank "
            "and a send/recv per micro-batch); give every stage at least one layer"
        )


def structure(source) -> torch.nn.Module | None:
    """``source``'s model built at no memory (meta device or fake tensors), or None when it does not build so."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with torch.device("meta") if source.meta_build else FakeTensorMode(allow_non_fake_inputs=True):
            model = source.build_model()
    except Exception:  # the trace builds it again and reports the failure with its own words
        return None
    if is_compiled(model):  # a model file's torch.compile(model): the trace unwraps it (features/compiled.py)
        model = model._orig_mod
    return model if isinstance(model, torch.nn.Module) else None

