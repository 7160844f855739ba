"""The inputs memest builds for an ``hf:`` model, by its head (what its forward takes and returns).

Each head says what ``--seq`` counts for it, the longest sequence the model takes (and what sets it)
and the inputs of one training step: the tensors a data loader would hand the model, labels included
so that the model computes its own loss. A head memest does not know is refused when the config is
loaded, naming what the model's forward asks for.

| head | model (forward) | inputs | --seq counts |
|---|---|---|---|
| causal-lm, masked-lm, seq2seq | ...ForCausalLM, ...LMHeadModel, ...ForMaskedLM, T5/BART-style ...ForConditionalGeneration | input_ids, labels | tokens |
| sequence-classification | ...ForSequenceClassification | input_ids, labels (one per example) | tokens |
| image-classification, vision | ...ForImageClassification, ViTModel | pixel_values (+ labels) | (no sequence) |
| speech-seq2seq | Whisper | input_features (batch, mel bins, 2 x max_source_positions), labels | decoder tokens |
| ctc | ...ForCTC on raw audio (Wav2Vec2, HuBERT, WavLM, ...) | input_values, labels (frames // 2 per example) | audio samples |
| vision-text | CLIP-style models with ``return_loss`` | input_ids, pixel_values, return_loss=True | text tokens |
| vision-language | LLaVA | input_ids with one image token per image feature, pixel_values, labels | image + text tokens |
| vision-language | LLaVA-NeXT | input_ids with the image tokens (hf_llava_next.py) then text, pixel_values (images, anyres tiles, C, H, W), image_sizes, labels | text tokens (image tokens added) |
| vision-language | Qwen2-VL, Qwen2.5-VL | input_ids with <|vision_start|>, image pads, <|vision_end|> per image, pixel_values (patches, C*T*P*P), image_grid_thw, mm_token_type_ids, labels | text tokens (image tokens added) |

``--images N --image-size HxW`` (``image_inputs``): N images per example of HxW pixels before the processor
resizes them; the image tokens are added to --seq text tokens. Qwen2-VL and Qwen2.5-VL also take
``--min-pixels`` / ``--max-pixels`` and ``--video-frames F`` (one video of F frames per example): hf_qwen_vl.py.

Every example is full length (no padding), as in ``hf_masks.py``: the step a packed or bucketed
loader runs at this length.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from memest.errors import ModelLoadError
from memest.sources.hf_llava_next import LLAVA_NEXT, llava_next_inputs, llava_next_tiles, llava_next_tokens
from memest.sources.hf_qwen_vl import (
    QWEN_VL,
    QWEN_VL_DEFAULT_IMAGE,
    pixel_bounds,
    plugin_resized,
    qwen_vl_grid,
    qwen_vl_inputs,
    video_grid,
)

DEFAULT_SEQ = 512  # tokens when --seq is not given (capped by the model's maximum positions)
DEFAULT_AUDIO_SAMPLES = 160_000  # CTC without --seq: 10 s at 16 kHz, the rate wav2vec2-style models are trained on
IGNORE_INDEX = -100  # transformers' label value that the loss skips (loss_utils.py)

CAUSAL_LM, MASKED_LM, SEQ2SEQ = "causal-lm", "masked-lm", "seq2seq"
SEQUENCE_CLASSIFICATION, IMAGE_CLASSIFICATION, VISION, BASE = (
    "sequence-classification", "image-classification", "vision", "base",
)
SPEECH_SEQ2SEQ, CTC, VISION_TEXT, VISION_LANGUAGE = "speech-seq2seq", "ctc", "vision-text", "vision-language"

SUPPORTED = (
    "text (causal LM, masked LM, seq2seq, sequence classification), image classification, speech seq2seq "
    "(Whisper: input_features), CTC on raw audio (input_values), vision-text with return_loss (CLIP) and "
    "vision-language with image tokens (LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL)"
)


@dataclass
class Head:
    """What memest feeds one model and what ``--seq`` means for it."""

    name: str
    default_seq: int | None  # None: the model takes no sequence (images)
    max_seq: int | None = None
    max_seq_why: str = ""
    seq_means: str = "tokens"
    notes: list[str] = field(default_factory=list)  # what memest built, for the report
    image_tokens: int = 0  # vision-language: image features per image (each one token in input_ids)
    reads_values: bool = False  # transformers checks these inputs' values (hf_values.py answers the checks)


def forward_params(cls) -> set[str]:
    if cls is None:
        return set()
    try:
        return set(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return set()


def head_of(arch: str, config, params: set[str]) -> Head:
    """The head of ``arch`` (its class's forward takes ``params``), or ModelLoadError if memest does
    not know what to feed it."""
    model_type = getattr(config, "model_type", "")
    if "input_features" in params:
        if model_type == "whisper":
            return _whisper(arch, config)
        raise _unsupported(arch, "input_features (spectrogram features)", params)
    if "input_values" in params:
        if arch.endswith("ForCTC") or arch == "AutoModel":
            return _ctc(arch, config)
        raise _unsupported(arch, "input_values (raw audio)", params)
    if "pixel_values" in params and "input_ids" in params:
        if "return_loss" in params:
            return _vision_text(config)
        if model_type == "llava":
            return _llava(config)
        if model_type in LLAVA_NEXT:
            return _llava_next(config)
        if model_type in QWEN_VL:
            return _qwen_vl(config)
        raise _unsupported(arch, "input_ids and pixel_values", params)
    if "pixel_values" in params or arch.endswith("ForImageClassification") or model_type == "vit":
        return Head(IMAGE_CLASSIFICATION if arch.endswith("ForImageClassification") else VISION, None)
    if "input_ids" not in params and params:
        raise _unsupported(arch, "no input_ids", params)
    return _text(arch, config)


def _unsupported(arch: str, takes: str, params: set[str]) -> ModelLoadError:
    wanted = ", ".join(sorted(p for p in params - {"self", "kwargs", "args"} if not p.startswith("output_"))[:8])
    return ModelLoadError(
        f"memest does not build inputs for {arch} (its forward takes {takes}: {wanted}); it builds them for "
        f"{SUPPORTED}. Estimate it from a model file with your own example_inputs() (memest estimate model.py)"
    )


# -- text ------------------------------------------------------------------------------------------
def _text(arch: str, config) -> Head:
    name = BASE
    for suffix, head in (
        ("ForCausalLM", CAUSAL_LM),
        ("LMHeadModel", CAUSAL_LM),
        ("ForMaskedLM", MASKED_LM),
        ("ForConditionalGeneration", SEQ2SEQ),
        ("ForSequenceClassification", SEQUENCE_CLASSIFICATION),
    ):
        if arch.endswith(suffix):
            name = head
            break
    max_pos = max_positions(config)
    max_seq, why = position_limit(config)
    return Head(name, min(DEFAULT_SEQ, max_pos or DEFAULT_SEQ), max_seq, why)


def max_positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def position_limit(config) -> tuple[int | None, str]:
    """The longest sequence the model takes, and what sets it (for the error message).

    - Learned (absolute) position embeddings (GPT-2's n_positions, BERT's max_position_embeddings): a
      table with one row per position; a longer sequence indexes past it and the real step crashes.
    - Rotary embeddings (Llama, Mistral): RoPE computes any position, so a longer sequence runs, but the
      model was configured (and trained) for max_position_embeddings; memest refuses it as well and says
      that it is the configured maximum (extend it in the config, e.g. with rope scaling, to go further).
    - Relative position buckets (T5): no maximum.
    """
    if getattr(config, "relative_attention_num_buckets", None) is not None:
        return None, ""
    rope = any(getattr(config, attr, None) for attr in ("rope_parameters", "rope_scaling", "rope_theta"))
    for attr in ("n_positions", "max_position_embeddings"):  # GPT-2's own name first (the other aliases it)
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            if rope:
                return value, (
                    f"{attr}, its configured maximum: RoPE computes positions beyond it, but the model was not "
                    "trained for them"
                )
            return value, attr
    return None, ""


# -- speech ----------------------------------------------------------------------------------------
def whisper_frames(config) -> int:
    """The mel frames Whisper's encoder takes: exactly max_source_positions x conv1 stride (1) x conv2
    stride (2) (WhisperEncoder.forward refuses any other length; 3000 frames = 30 s for the released models)."""
    return 2 * config.max_source_positions


def _whisper(arch: str, config) -> Head:
    frames, limit = whisper_frames(config), config.max_target_positions
    head = Head(SPEECH_SEQ2SEQ if arch.endswith("ForConditionalGeneration") else BASE, min(DEFAULT_SEQ, limit), limit,
                "max_target_positions, the decoder's learned positions", seq_means="decoder tokens")
    head.notes.append(
        f"inputs: input_features (batch, {config.num_mel_bins} mel bins, {frames} frames: the fixed window Whisper's "
        f"encoder takes, 2 x max_source_positions) and {'labels' if head.name == SPEECH_SEQ2SEQ else 'decoder_input_ids'} "
        f"of --seq decoder tokens (at most max_target_positions {limit})"
    )
    return head


def ctc_frames(config, samples: int) -> int:
    """Output frames of the convolutional feature encoder for ``samples`` audio samples
    (Wav2Vec2PreTrainedModel._get_feat_extract_output_lengths: floor((n - kernel) / stride) + 1 per layer)."""
    n = samples
    for kernel, stride in zip(config.conv_kernel, config.conv_stride, strict=True):
        n = (n - kernel) // stride + 1
    if getattr(config, "add_adapter", False):
        for _ in range(config.num_adapter_layers):
            n = (n - 1) // config.adapter_stride + 1
    return n


def ctc_label_length(config, samples: int) -> int:
    """Labels per example: one per two output frames. CTC needs at most one label per frame (plus one
    for each repeated label); speech runs ~15 characters/s against wav2vec2's 50 frames/s, so this is
    on the generous side. CTC's own buffers grow with it (log_alpha: batch x frames x (2 x labels + 1))."""
    return max(1, ctc_frames(config, samples) // 2)


def _ctc(arch: str, config) -> Head:
    ctc = arch.endswith("ForCTC")
    head = Head(CTC if ctc else BASE, DEFAULT_AUDIO_SAMPLES, seq_means="audio samples", reads_values=ctc)
    head.notes.append(
        "inputs: input_values (batch, --seq audio samples) and labels of frames // 2 tokens per example (the "
        "feature encoder makes about 1 frame per 320 samples); --seq counts audio samples, 16000 = 1 s at 16 kHz"
        if head.name == CTC
        else "inputs: input_values (batch, --seq audio samples)"
    )
    return head


# -- vision + text ---------------------------------------------------------------------------------
def _vision_text(config) -> Head:
    text, vision = getattr(config, "text_config", config), getattr(config, "vision_config", config)
    limit = getattr(text, "max_position_embeddings", None)
    head = Head(VISION_TEXT, min(DEFAULT_SEQ, limit or DEFAULT_SEQ), limit, "text_config.max_position_embeddings")
    head.notes.append(
        f"inputs: input_ids (batch, --seq text tokens), pixel_values (batch, {_image_shape(vision)}) and "
        "return_loss=True: the model's contrastive loss over the batch"
    )
    return head


def _image_shape(vision) -> str:
    size = getattr(vision, "image_size", 224)
    return f"{getattr(vision, 'num_channels', 3)}, {size}, {size}"


def llava_image_tokens(config) -> int:
    """Image features LLaVA puts in place of the image tokens, one per vision-tower position after
    LlavaModel.get_image_features: the patches, plus the CLS position for CLIP towers, less the first
    position with vision_feature_select_strategy "default" (modeling_llava.py)."""
    vision = config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2
    tokens = patches + (1 if vision.model_type == "clip_vision_model" else 0)
    if config.vision_feature_select_strategy == "default":
        tokens -= 1
    return tokens


def _llava(config) -> Head:
    vision = config.vision_config
    if vision.model_type not in ("clip_vision_model", "siglip_vision_model"):
        raise ModelLoadError(
            f"memest counts LLaVA's image tokens for CLIP and SigLIP vision towers; this config's is {vision.model_type}"
        )
    n = llava_image_tokens(config)
    limit = getattr(config.text_config, "max_position_embeddings", None)
    default = min(n + DEFAULT_SEQ, limit) if limit else n + DEFAULT_SEQ
    head = Head(VISION_LANGUAGE, default, limit, "text_config.max_position_embeddings", seq_means="image + text tokens",
                image_tokens=n, reads_values=True)
    head.notes.append(
        f"inputs: pixel_values (batch, {_image_shape(vision)}: one image per example) and input_ids of --seq tokens: "
        f"{n} image tokens (one per image feature) then text; labels skip the image tokens"
    )
    return head


def _llava_next(config) -> Head:
    _llava(config)  # the same towers
    side = config.vision_config.image_size
    tokens = llava_next_tokens(config, llava_image_tokens(config), (side, side))
    limit = getattr(config.text_config, "max_position_embeddings", None)
    head = Head(VISION_LANGUAGE, DEFAULT_SEQ, limit, "text_config.max_position_embeddings",
                seq_means="text tokens (image tokens added)", image_tokens=tokens, reads_values=True)
    head.notes.append(
        f"inputs: one {side}x{side} image per example (--images N --image-size HxW for others) as LlavaNextProcessor "
        f"cuts it (anyres tiles, {tokens} image tokens), pixel_values (images, tiles, C, H, W), image_sizes, "
        "input_ids of --seq text tokens after the image tokens; labels skip the image tokens"
    )
    return head


def check_seq(head: Head, seq: int, name: str) -> None:
    if head.name == VISION_LANGUAGE and head.seq_means == "image + text tokens" and seq <= head.image_tokens:
        raise ModelLoadError(
            f"{name} puts {head.image_tokens} image tokens in every sequence; --seq counts image + text tokens, so use "
            f"--seq {head.image_tokens + 1} or more"
        )


# -- the tensors -----------------------------------------------------------------------------------
def make_inputs(config, head: Head, batch: int, seq: int | None, reals=None) -> dict[str, Any]:
    import torch

    if head.name in (IMAGE_CLASSIFICATION, VISION):
        inputs = {"pixel_values": _pixels(config, batch)}
        if head.name == IMAGE_CLASSIFICATION:
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,))
        return inputs
    if config.model_type == "whisper":
        features = torch.randn(batch, config.num_mel_bins, whisper_frames(config))
        tokens = torch.randint(0, config.vocab_size, (batch, seq))
        key = "labels" if head.name == SPEECH_SEQ2SEQ else "decoder_input_ids"
        return {"input_features": features, key: tokens}
    if head.seq_means == "audio samples":
        inputs = {"input_values": torch.randn(batch, seq)}
        if head.name == CTC:
            inputs["labels"] = _ctc_labels(config, batch, ctc_label_length(config, seq))
        return inputs
    if head.name == VISION_TEXT:
        text = config.text_config
        return {
            "input_ids": torch.randint(0, text.vocab_size, (batch, seq)),
            "pixel_values": _pixels(config.vision_config, batch),
            "return_loss": True,
        }
    if head.name == VISION_LANGUAGE and config.model_type in QWEN_VL:
        return qwen_vl_inputs(config, batch, seq, 1, QWEN_VL_DEFAULT_IMAGE, reals)
    if head.name == VISION_LANGUAGE and config.model_type in LLAVA_NEXT:
        side = config.vision_config.image_size
        return llava_next_inputs(config, llava_image_tokens(config), batch, seq, 1, (side, side), reals)
    if head.name == VISION_LANGUAGE:
        return _llava_inputs(config, head, batch, seq)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    inputs = {"input_ids": ids}
    if head.name in (CAUSAL_LM, MASKED_LM, SEQ2SEQ):
        inputs["labels"] = ids.clone()
    elif head.name == SEQUENCE_CLASSIFICATION:
        inputs["labels"] = torch.randint(0, config.num_labels, (batch,))
    return inputs


def value_ranges(config, head: Head, inputs: dict) -> list[tuple[Any, int, int]]:
    """(tensor, lowest, highest) of the inputs whose values transformers checks (hf_values.py)."""
    if head.name == CTC:
        return [(inputs["labels"], 0, config.vocab_size - 1)]
    return []


def _pixels(vision, batch: int):
    import torch

    size = getattr(vision, "image_size", 224)
    return torch.randn(batch, getattr(vision, "num_channels", 3), size, size)


def _ctc_labels(config, batch: int, length: int):
    """Label ids in [0, vocab) without the blank (pad_token_id): ForCTCLoss drops blanks from the targets."""
    import torch

    blank = config.pad_token_id if config.pad_token_id is not None else 0
    return (torch.randint(0, config.vocab_size - 1, (batch, length)) + blank + 1) % config.vocab_size


def _llava_inputs(config, head: Head, batch: int, seq: int, images: int = 1) -> dict[str, Any]:
    import torch

    text, image_id = config.text_config, config.image_token_id  # alias of image_token_index
    n = head.image_tokens * images
    ids = torch.randint(0, text.vocab_size - 1, (batch, seq))
    ids = ids + (ids >= image_id).long()  # text tokens are never the image token
    ids[:, :n] = image_id
    labels = ids.clone()
    labels[:, :n] = IGNORE_INDEX
    return {"input_ids": ids, "pixel_values": _pixels(config.vision_config, batch * images), "labels": labels}


# -- --images: N images per example, turned into tokens as the model's processor does ---------------
def image_inputs(config, head: Head, batch: int, text: int, images: int, hw: tuple[int, int] | None,
                 reals=None, *, min_pixels: int = 0, max_pixels: int = 0, video_frames: int = 0,
                 pre_resized: bool = False) -> dict[str, Any]:
    """Inputs of ``batch`` examples of ``images`` images (``hw`` pixels each before the processor resizes them)
    and ``text`` text tokens: the image tokens are added, so the sequence is text + image tokens. Qwen2-VL and
    Qwen2.5-VL also take the processor's ``min_pixels`` / ``max_pixels`` (0: its default) and one video of
    ``video_frames`` frames of ``hw`` pixels per example (hf_qwen_vl.py); other models refuse them.
    ``pre_resized``: LLaMA-Factory resized ``hw`` (--pre-resize), so its Qwen2-VL plugin's own rules follow."""
    if head.name != VISION_LANGUAGE:
        raise ModelLoadError(f"--images: a {head.name} model takes no image tokens; memest builds them for {SUPPORTED}")
    hw = _plugin_hw(config, hw, pre_resized)
    if config.model_type in QWEN_VL:
        return qwen_vl_inputs(config, batch, text, images, hw or QWEN_VL_DEFAULT_IMAGE, reals,
                              min_pixels=min_pixels, max_pixels=max_pixels, video_frames=video_frames)
    check_vision_options(config, min_pixels, max_pixels, video_frames)
    if config.model_type in LLAVA_NEXT:
        side = config.vision_config.image_size
        return llava_next_inputs(config, llava_image_tokens(config), batch, text, images, hw or (side, side), reals)
    tokens = image_tokens(config, head, hw)
    return _llava_inputs(config, head, batch, text + images * tokens, images)


def _plugin_hw(config, hw: tuple[int, int] | None, pre_resized: bool) -> tuple[int, int] | None:
    """The size the processor gets after LLaMA-Factory's model plugin (Qwen2-VL's; LLaVA's plugins add no rule)."""
    return plugin_resized(hw) if pre_resized and hw is not None and config.model_type in QWEN_VL else hw


def check_vision_options(config, min_pixels: int, max_pixels: int, video_frames: int) -> None:
    """--min-pixels / --max-pixels and --video-frames are Qwen2-VL's processors' rules: refused on other models
    (LLaVA's processors resize to fixed tiles, and LLaVA and LLaVA-NeXT take no video)."""
    if config.model_type in QWEN_VL:
        return
    flags = [flag for flag, value in (("--min-pixels", min_pixels), ("--max-pixels", max_pixels),
                                      ("--video-frames", video_frames)) if value]
    if flags:
        raise ModelLoadError(
            f"{' and '.join(flags)}: a {config.model_type} model's processor has no such rule (memest models them "
            "for Qwen2-VL and Qwen2.5-VL: their processors' min_pixels/max_pixels and video inputs); drop "
            f"{'them' if len(flags) > 1 else 'it'}"
        )


def image_tokens(config, head: Head, hw: tuple[int, int] | None, min_pixels: int = 0, max_pixels: int = 0) -> int:
    """Image tokens of one image of ``hw`` pixels. LLaVA(-1.5): its processor (CLIPImageProcessor) resizes the
    shortest edge to the tower's image_size and center-crops a square of it, so every image gives the same
    tokens whatever its size (processing_llava.py, image_processing_clip.py)."""
    if config.model_type in QWEN_VL:
        grid_h, grid_w = qwen_vl_grid(config, hw or QWEN_VL_DEFAULT_IMAGE, *pixel_bounds(min_pixels, max_pixels))
        return grid_h * grid_w // config.vision_config.spatial_merge_size**2
    if config.model_type in LLAVA_NEXT and hw is not None:
        return llava_next_tokens(config, llava_image_tokens(config), hw)
    return head.image_tokens


# the vision tower's modules as transformers 5 names them (LLaVA: the CLIP/SigLIP tower and its projector)
TOWERS = {"llava": ("model.vision_tower", "model.multi_modal_projector"),
          "llava_next": ("model.vision_tower", "model.multi_modal_projector"),  # (image_newline: on the model itself)
          "qwen2_vl": ("model.visual",), "qwen2_5_vl": ("model.visual",)}
# --freeze vision / projector on these models: the modules LLaMA-Factory's freeze_vision_tower and
# freeze_multi_modal_projector freeze (hiyouga/LLaMA-Factory src/llamafactory/model/model_utils/visual.py,
# COMPOSITE_MODELS' vision_model_keys / projector_keys, at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30), as
# transformers 5 names them (Qwen2-VL's projector is its tower's merger; LLaVA-NeXT's image_newline is in neither)
FREEZE_GROUPS = {
    "llava": {"vision": ("model.vision_tower",), "projector": ("model.multi_modal_projector",)},
    "llava_next": {"vision": ("model.vision_tower",), "projector": ("model.multi_modal_projector",)},
    "qwen2_vl": {"vision": ("model.visual.patch_embed", "model.visual.blocks"), "projector": ("model.visual.merger",)},
    "qwen2_5_vl": {"vision": ("model.visual.patch_embed", "model.visual.blocks"), "projector": ("model.visual.merger",)},
}
LLAVA_PROCESSOR = ("CLIPImageProcessor: shortest edge to the tower's image_size, center crop, one token per patch "
                   "(transformers image_processing_clip.py, processing_llava.py)")


def image_facts(config, head: Head, images: int, hw: tuple[int, int] | None, *, min_pixels: int = 0,
                max_pixels: int = 0, video_frames: int = 0, pre_resized: bool = False) -> dict[str, Any]:
    """What --images N --image-size HxW (and --video-frames F) become, per image, as the processor cuts them (for
    the report)."""
    check_vision_options(config, min_pixels, max_pixels, video_frames)
    hw = _plugin_hw(config, hw, pre_resized)
    vision = config.vision_config
    bounds: tuple[int, int] | None = None
    video = None
    if config.model_type in QWEN_VL:
        size = hw or QWEN_VL_DEFAULT_IMAGE
        bounds = pixel_bounds(min_pixels, max_pixels)
        grid_h, grid_w = qwen_vl_grid(config, size, *bounds)
        resized = (grid_h * vision.patch_size, grid_w * vision.patch_size)
        processor = (f"Qwen2VLImageProcessor: smart_resize to multiples of {vision.patch_size * vision.spatial_merge_size} "
                     f"px within min_pixels {bounds[0]} / max_pixels {bounds[1]}, one token per "
                     "merged patch (transformers 5.24.0 image_processing_pil_qwen2_vl.py)")
        if video_frames:
            video = _video_facts(config, video_frames, size, min_pixels, max_pixels)
    elif config.model_type in LLAVA_NEXT:
        from transformers.image_processing_utils import select_best_resolution

        side = vision.image_size
        size = hw or (side, side)
        resized = select_best_resolution(list(size), config.image_grid_pinpoints)
        processor = (f"LlavaNextProcessor: anyres, {llava_next_tiles(config, size)} tiles of {side} px (the best of "
                     "image_grid_pinpoints, then the whole image); unpadded tile features + a newline per row + the "
                     "base tile's (transformers processing_llava_next.py, image_processing_llava_next.py)")
    else:
        side = getattr(vision, "image_size", 224)
        size, resized, processor = hw or (side, side), (side, side), LLAVA_PROCESSOR
    return {"per_example": images, "size": f"{size[0]}x{size[1]}", "resized": f"{resized[0]}x{resized[1]}",
            "tokens_per_image": image_tokens(config, head, hw, min_pixels, max_pixels), "processor": processor,
            "min_pixels": bounds[0] if bounds else None, "max_pixels": bounds[1] if bounds else None,
            "video": video, "tower": list(TOWERS.get(config.model_type, ()))}


def _video_facts(config, frames: int, size: tuple[int, int], min_pixels: int, max_pixels: int) -> dict[str, Any]:
    """One video per example as Qwen2VLVideoProcessor cuts it (hf_qwen_vl.py)."""
    vision = config.vision_config
    lo, hi = pixel_bounds(min_pixels, max_pixels, video=True)
    t, grid_h, grid_w = video_grid(config, frames, size, min_pixels, max_pixels)
    return {"frames": frames, "size": f"{size[0]}x{size[1]}",
            "resized": f"{grid_h * vision.patch_size}x{grid_w * vision.patch_size}", "grid_thw": [t, grid_h, grid_w],
            "tokens_per_video": t * grid_h * grid_w // vision.spatial_merge_size**2, "min_pixels": lo, "max_pixels": hi,
            "processor": (f"Qwen2VLVideoProcessor: each frame smart_resize'd within min_pixels {lo} / max_pixels {hi}, "
                          f"frames padded to a multiple of temporal_patch_size {vision.temporal_patch_size} and merged "
                          "in groups of it (transformers 5.24.0 video_processing_qwen2_vl.py)")}


# -- Qwen2-VL (the processors' rules: hf_qwen_vl.py) ----------------------------------------------
def _qwen_vl(config) -> Head:
    limit = getattr(config.text_config, "max_position_embeddings", None)
    tokens = image_tokens(config, Head(VISION_LANGUAGE, None), None)
    head = Head(VISION_LANGUAGE, DEFAULT_SEQ, limit, "text_config.max_position_embeddings",
                seq_means="text tokens (image tokens added)", image_tokens=tokens, reads_values=True)
    head.notes.append(
        f"inputs: one {QWEN_VL_DEFAULT_IMAGE[0]}x{QWEN_VL_DEFAULT_IMAGE[1]} image per example (--images N --image-size "
        f"HxW for others) as Qwen2VLImageProcessor makes it ({tokens} image tokens), input_ids of --seq text tokens "
        "plus <|vision_start|>, the image tokens and <|vision_end|> per image, image_grid_thw, mm_token_type_ids; "
        "labels skip the image tokens"
    )
    return head
