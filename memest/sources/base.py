"""The one interface the engine needs from a model source."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ModelSource:
    name: str
    build_model: Callable[[], torch.nn.Module]
    # (batch_size, seq_len) -> tuple of positional args, or dict of keyword args
    example_inputs: Callable[[int, int | None], Any]
    compute_loss: Callable[[Any, Any], torch.Tensor] | None = None
    default_seq: int | None = None  # used when the user gives no --seq and the model takes one
    origin: str = ""  # file or config the model came from, for error messages
    max_seq: int | None = None  # the longest sequence the model takes (position embeddings), if known
    max_seq_why: str = ""  # what sets max_seq, for messages (e.g. "n_positions")
    # (RunSpec) -> context manager entered around the traced step (e.g. transformers' mask branches,
    # its MoE kernel choice on the target device)
    trace_context: Callable[[Any], Any] | None = None
    notes: list[str] = field(default_factory=list)  # facts about the model or its inputs, for the report
    # those of ``notes`` that describe the inputs memest builds by default (vision-language hf: models: the default
    # image); the report leaves them out when --images / --video-frames replace them (was: "one 448x448 image per
    # example (256 image tokens)" beside --image-size 100000x100000, battery 30 #54)
    default_input_notes: list[str] = field(default_factory=list)
    # what the model's inputs are when they have no sequence (hf: image models): --seq is refused for it
    no_seq: str = ""
    # name -> what the model file defines under that name, or None (e.g. --checkpointing selective:NAME's policy)
    lookup: Callable[[str], Any] | None = None
    # notes a user must not miss (memest built something the model's config did not name): also said on stderr
    warnings: list[str] = field(default_factory=list)
    # what to check when the step fails on its inputs (model files: their example_inputs())
    inputs_hint: str = "check that example_inputs() matches the model's forward"
    # what to change when the step reads tensor values (model files: their forward)
    # build_model() makes its tensors on torch's default device (transformers from a config): under the meta
    # device it gives the model's structure (names, heads, layers) at no memory, for checks before any trace
    meta_build: bool = False
    # vision-language hf: models: (batch_size, text tokens, images per example, (height, width) or None) -> inputs
    # with the images turned into tokens as the model's processor does (--images, --image-size); keywords
    # min_pixels, max_pixels, video_frames (Qwen2-VL's processors; others refuse them); None: not a VLM
    image_inputs: Callable[..., Any] | None = None
    # (images per example, (height, width) or None, the same keywords) -> what the processor makes of them (size
    # after resizing, tokens per image, the processor and its source) and the vision tower's module names
    image_facts: Callable[..., dict] | None = None
    values_hint: str = (
        "make the forward value-free: no .item() or Python branches on tensors, torch.where instead of "
        "boolean-mask indexing or nonzero"
    )


def default_loss(output: Any) -> torch.Tensor:
    """``output.loss`` if the model computed one, else the mean of the first floating-point output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    from torch.utils._pytree import tree_flatten

    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.mean()
    raise TypeError("the model returned no floating-point tensor to take a loss from")
