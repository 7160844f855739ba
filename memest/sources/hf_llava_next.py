"""LLaVA-NeXT (llava-v1.6) images as LlavaNextProcessor cuts them: "anyres" tiles.

Each image is resized to the best of ``image_grid_pinpoints`` (transformers' own ``select_best_resolution``: the
resolution that keeps the most of the image's pixels, then the least padding), cut in tower-sized tiles, plus one
tile of the whole image: ``pixel_values`` (images, tiles, C, S, S), ``image_sizes`` (images, 2) the original sizes.
Its tokens (processing_llava_next.py ``_get_number_of_features``): the base tile's features, plus the tiles'
features with the padding rows or columns taken off (``_get_unpadded_features``), plus one newline feature per
row. The model reads ``image_sizes``' values (tiles per image, the unpadding): memest built them and answers
with the real values (hf_values.KnownValues)."""

from __future__ import annotations

from typing import Any

LLAVA_NEXT = ("llava_next",)


def llava_next_tiles(config, hw: tuple[int, int]) -> int:
    """Tiles of one image of ``hw`` pixels, the base one included (modeling_llava_next.image_size_to_num_patches)."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    return image_size_to_num_patches(list(hw), config.image_grid_pinpoints, config.vision_config.image_size)


def llava_next_tokens(config, base: int, hw: tuple[int, int]) -> int:
    """Image tokens of one image of ``hw`` pixels: ``base`` (the whole-image tile's features, as LLaVA's) plus the
    unpadded tiles' features and their newlines, by transformers' own processor functions."""
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.llava_next.processing_llava_next import LlavaNextProcessor

    side = config.vision_config.image_size
    best_h, best_w = select_best_resolution(list(hw), config.image_grid_pinpoints)
    patches = side // config.vision_config.patch_size
    # _get_unpadded_features reads nothing from the processor instance
    unpadded, newlines = LlavaNextProcessor._get_unpadded_features(None, hw[0], hw[1], patches, patches,
                                                                    best_h // side, best_w // side)
    return base + unpadded + newlines


def llava_next_inputs(config, base: int, batch: int, text: int, images: int, hw: tuple[int, int],
                      reals=None) -> dict[str, Any]:
    """``images`` images per example: their tokens in front of ``text`` text tokens (labels skip them)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    vision, image_id = config.vision_config, config.image_token_id
    tokens, tiles = llava_next_tokens(config, base, hw), llava_next_tiles(config, hw)
    n = tokens * images
    ids = torch.randint(0, config.text_config.vocab_size - 1, (batch, text + n))
    ids = ids + (ids >= image_id).long()  # text tokens are never the image token
    ids[:, :n] = image_id
    labels = ids.clone()
    labels[:, :n] = -100  # transformers' IGNORE_INDEX
    pixels = torch.randn(batch * images, tiles, getattr(vision, "num_channels", 3), vision.image_size, vision.image_size)
    with unset_fake_temporarily():
        sizes = torch.tensor([list(hw)] * (batch * images))
    if isinstance(pixels, FakeTensor):  # traced: a fake image_sizes whose real values KnownValues answers with
        fake = torch.empty(sizes.shape, dtype=sizes.dtype)
        if reals is not None:
            reals[fake] = sizes
        sizes = fake
    return {"input_ids": ids, "pixel_values": pixels, "image_sizes": sizes, "labels": labels}
