"""--images on a vision-language model: what the images cost (the report's ``images`` row and JSON key).

The processor's side (size after resizing, tokens per image, the processor and its source) comes from the
source (sources/hf_inputs.py ``image_facts``); the memory side from the trace: the vision tower's modules
(their parameters, gradients, optimizer state, and the activations and temporaries made while they ran) alive
at the peak, beside the whole peak and all the activations at it."""

from __future__ import annotations

from memest.trace.events import Category, Trace


def _in_tower(module: str, tower: tuple[str, ...]) -> bool:
    """``module`` is one of the tower's modules or inside one (under a wrapper too: peft's base_model.model.)."""
    dotted = f".{module}."
    return any(f".{name}." in dotted for name in tower)


def images_summary(trace: Trace, facts: dict | None, batch: int, last: int, at_peak: set, peak: int) -> dict | None:
    """The ``images`` JSON value: ``facts`` (image_facts) with the batch's image tokens and the tower's memory."""
    if not facts:
        return None
    tower = tuple(facts.get("tower", ()))
    roots = [name for name in trace.modules if _in_tower(name, tower)
             and not _in_tower(name.rpartition(".")[0], tower)]  # the outermost tower modules (one per copy)
    params = sum(trace.modules[name].params for name in roots)
    param_bytes = sum(trace.modules[name].param_bytes for name in roots)
    grads = 0
    at = dict.fromkeys(("tower", "activations", "all_activations"), 0)
    for sid, rec in enumerate(trace.storages):
        module = trace.owner_module.get(sid, rec.module)
        inside = _in_tower(module, tower)
        if inside and rec.category is Category.GRADIENTS and rec.iteration == last:
            grads += rec.nbytes
        if sid not in at_peak:
            continue
        is_activation = rec.category is Category.ACTIVATIONS
        at["all_activations"] += rec.nbytes if is_activation else 0
        if inside:
            at["tower"] += rec.nbytes
            at["activations"] += rec.nbytes if is_activation else 0
    trained = "trained" if param_bytes and grads >= param_bytes else ("frozen" if not grads else "partly trained")
    tokens = facts["tokens_per_image"]
    video = facts.get("video")
    return {
        **{k: v for k, v in facts.items() if k != "tower"},
        "image_tokens": batch * facts["per_example"] * tokens,
        "video_tokens": batch * video["tokens_per_video"] if video else 0,
        "tower": list(tower),
        "tower_params": params,
        "tower_param_bytes": param_bytes,
        "tower_gradient_bytes": grads,
        "tower_state": trained,
        "tower_bytes_at_peak": at["tower"],
        "tower_share_of_peak": at["tower"] / peak if peak else 0.0,
        "tower_activation_bytes_at_peak": at["activations"],
        "tower_share_of_activations": at["activations"] / at["all_activations"] if at["all_activations"] else 0.0,
    }
