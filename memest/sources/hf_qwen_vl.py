"""Qwen2-VL and Qwen2.5-VL inputs as their processors make them (transformers 5.24.0, models/qwen2_vl/).

- Images (Qwen2VLImageProcessor, image_processing_pil_qwen2_vl.py): each image resized by ``smart_resize`` (both
  sides multiples of patch_size x merge_size, its pixels within size["shortest_edge"] / size["longest_edge"], the
  ``min_pixels`` / ``max_pixels`` of the released preprocessor_config.json files and of ``--min-pixels`` /
  ``--max-pixels``), its one frame repeated to temporal_patch_size, cut in patch_size squares: grid [1, h, w].
- Videos (Qwen2VLVideoProcessor, video_processing_qwen2_vl.py; Qwen2.5-VL's processor uses the same): every frame
  resized by the same ``smart_resize`` within the video processor's own size (min 128 x 28 x 28, max 28 x 28 x 768
  pixels per frame by default), frames padded to a multiple of temporal_patch_size by repeating the last one
  (``patchify``) and merged in groups of temporal_patch_size: grid [frames / T, h, w], ``pixel_values_videos``
  (t x h x w rows of C x T x P x P), ``video_grid_thw``. The processor's per-frame cap (``cap_pixels_per_frame``)
  is off by default in 5.24.0 (it warns and keeps it off), and so it is here.
- Tokens (processing_qwen2_vl.py): per image <|vision_start|>, grid_t x h x w / merge^2 <|image_pad|>,
  <|vision_end|>; per video the same with <|video_pad|>; ``mm_token_type_ids`` 1 on image pads, 2 on video pads
  (ProcessorMixin.create_mm_token_type_ids, processing_utils.py).

Qwen2.5-VL's processor also passes ``second_per_grid_ts`` (temporal_patch_size / the sampled fps) for videos:
it changes the values of the rotary positions (get_rope_index), not any tensor's size; memest leaves it out
(the model's default: 1 s per temporal patch).
"""

from __future__ import annotations

from typing import Any

from memest.errors import MemestError

QWEN_VL = ("qwen2_vl", "qwen2_5_vl")
QWEN_VL_DEFAULT_IMAGE = (448, 448)  # memest's image without --image-size: 256 image tokens (a 32 x 32 patch grid / 2 x 2)

# Qwen2VLImageProcessor's defaults (transformers 5.24.0 image_processing_pil_qwen2_vl.py, size shortest_edge /
# longest_edge; the released Qwen2-VL preprocessor_config.json files set min_pixels 3136, max_pixels 12845056)
QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS = 56 * 56, 28 * 28 * 1280
# Qwen2VLVideoProcessor's defaults, per frame (transformers 5.24.0 video_processing_qwen2_vl.py, size)
QWEN_VL_VIDEO_MIN_PIXELS, QWEN_VL_VIDEO_MAX_PIXELS = 128 * 28 * 28, 28 * 28 * 768


def pixel_bounds(min_pixels: int = 0, max_pixels: int = 0, video: bool = False) -> tuple[int, int]:
    """(min_pixels, max_pixels) the processor resizes within: the given ones, else the image (or video)
    processor's defaults."""
    lo, hi = (QWEN_VL_VIDEO_MIN_PIXELS, QWEN_VL_VIDEO_MAX_PIXELS) if video else (QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS)
    return min_pixels or lo, max_pixels or hi


def plugin_resized(hw: tuple[int, int]) -> tuple[int, int]:
    """LLaMA-Factory's Qwen2VLPlugin._preprocess_image after its common resize (--pre-resize), for images and video
    frames alike (hiyouga/LLaMA-Factory src/llamafactory/data/mm_plugin.py lines 2260-2275 at
    ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30; Qwen3VLPlugin, GLM4VPlugin and Qwen2OmniPlugin inherit it): a side
    under 28 px raised to 28, then an aspect ratio over 200 cut to 180 (so smart_resize does not refuse it)."""
    height, width = hw
    if min(width, height) < 28:
        width, height = max(width, 28), max(height, 28)
    if width / height > 200:
        width, height = height * 180, height
    if height / width > 200:
        width, height = width, width * 180
    return height, width


def qwen_vl_grid(config, hw: tuple[int, int], min_pixels: int = QWEN_VL_MIN_PIXELS,
                 max_pixels: int = QWEN_VL_MAX_PIXELS) -> tuple[int, int]:
    """Patches (rows, columns) of one image or frame of ``hw`` pixels: resized by transformers' own ``smart_resize``
    (both sides multiples of patch_size x spatial_merge_size, pixels within min/max_pixels), then cut in
    patch_size squares (Qwen2VLImageProcessor._preprocess, Qwen2VLVideoProcessor.patchify)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    vision = config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    try:
        height, width = smart_resize(hw[0], hw[1], factor=factor, min_pixels=min_pixels, max_pixels=max_pixels)
    except ValueError as exc:  # was an internal error for --image-size 28x10000 (battery 31 #48)
        raise MemestError(f"--image-size {hw[0]}x{hw[1]}: the Qwen2-VL processors' smart_resize refuses it ({exc}), "
                          "as a real run's would; give a size whose longer side is under 200 times the shorter") from None
    return height // vision.patch_size, width // vision.patch_size


def video_grid(config, frames: int, hw: tuple[int, int], min_pixels: int = 0, max_pixels: int = 0) -> tuple[int, int, int]:
    """[t, h, w] of one video of ``frames`` frames of ``hw`` pixels (Qwen2VLVideoProcessor: frames padded to a
    multiple of temporal_patch_size, merged in groups of it)."""
    temporal = config.vision_config.temporal_patch_size
    grid_h, grid_w = qwen_vl_grid(config, hw, *pixel_bounds(min_pixels, max_pixels, video=True))
    return -(-frames // temporal), grid_h, grid_w


def qwen_vl_inputs(config, batch: int, text: int, images: int, hw: tuple[int, int], reals=None, *,
                   min_pixels: int = 0, max_pixels: int = 0, video_frames: int = 0) -> dict[str, Any]:
    """As Qwen2VLProcessor hands them to the model: each image (one frame, repeated to temporal_patch_size as
    the image processor does) as grid_h x grid_w rows of C x T x P x P values in ``pixel_values``, its
    ``image_grid_thw`` row [1, grid_h, grid_w]; with ``video_frames`` one video per example after the images,
    ``pixel_values_videos`` and ``video_grid_thw``; the tokens as the module docstring says."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    with unset_fake_temporarily():  # the real values (under the trace: known to hf_values.KnownValues)
        real = _ids(config, batch, text, images, hw, min_pixels, max_pixels, video_frames)
    shapes = {key: real.pop(key) for key in ("pixel_values", "pixel_values_videos") if key in real}
    pixels = {key: torch.randn(shape) for key, shape in shapes.items()}
    inputs = {name: torch.empty(t.shape, dtype=t.dtype) for name, t in real.items()}
    if reals is not None:
        for name, t in real.items():
            if name != "labels":
                reals[inputs[name]] = t
    if not any(isinstance(p, FakeTensor) for p in pixels.values()):  # a real run: the real values
        inputs = real
    return {**inputs, **pixels}


def _ids(config, batch: int, text: int, images: int, hw: tuple[int, int], min_pixels: int, max_pixels: int,
         video_frames: int) -> dict[str, Any]:
    import torch

    vision = config.vision_config
    merge = vision.spatial_merge_size**2
    blocks = []  # (pad token, mm_token_type, tokens) per image, then the video
    out: dict[str, Any] = {}
    patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    if images:
        grid_h, grid_w = qwen_vl_grid(config, hw, *pixel_bounds(min_pixels, max_pixels))
        blocks += [(config.image_token_id, 1, grid_h * grid_w // merge)] * images
        out["pixel_values"] = (batch * images * grid_h * grid_w, patch)
        out["image_grid_thw"] = torch.tensor([[1, grid_h, grid_w]] * (batch * images))
    if video_frames:
        t, grid_h, grid_w = video_grid(config, video_frames, hw, min_pixels, max_pixels)
        blocks.append((config.video_token_id, 2, t * grid_h * grid_w // merge))
        out["pixel_values_videos"] = (batch * t * grid_h * grid_w, patch)
        out["video_grid_thw"] = torch.tensor([[t, grid_h, grid_w]] * batch)
    special = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    vocab = config.text_config.vocab_size
    ordinary = torch.tensor([t for t in range(vocab) if t not in special])
    vision_tokens = sum(n + 2 for _, _, n in blocks)
    seq = text + vision_tokens
    ids = ordinary[torch.randint(0, len(ordinary), (batch, seq))]
    kind = torch.zeros(batch, seq, dtype=torch.long)
    start = 0
    for pad, type_id, n in blocks:
        ids[:, start] = config.vision_start_token_id
        ids[:, start + 1:start + 1 + n] = pad
        ids[:, start + 1 + n] = config.vision_end_token_id
        kind[:, start + 1:start + 1 + n] = type_id
        start += n + 2
    labels = ids.clone()
    labels[:, :vision_tokens] = -100  # transformers' IGNORE_INDEX (loss_utils.py)
    return {"input_ids": ids, **out, "mm_token_type_ids": kind, "labels": labels}
