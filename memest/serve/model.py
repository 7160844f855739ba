"""The transformers config of an hf: model, and its build on the meta device (no memory), for the serving
engines' weights and KV arithmetic."""

from __future__ import annotations

import contextlib
import sys

from memest.errors import MemestError
from memest.imports import imports_without_gc


def load_config(model: str):
    """The transformers config of an hf: reference, without building the model (imports with the garbage
    collector paused, as load_hf_source does)."""
    if not model.startswith("hf:"):
        raise MemestError(f"memest serve takes an hf: model (hf:NAME, hf:path/config.json, hf:org/name), not {model!r}")

    name = model[3:]
    with contextlib.nullcontext() if "transformers" in sys.modules else imports_without_gc():
        import transformers

        from memest.sources.hf import _config_path, _from_file, _from_hub

        transformers.logging.set_verbosity_error()
        path = _config_path(name)
        return _from_file(transformers, path, model) if path is not None else _from_hub(transformers, name)


def build_meta(config):
    """The model of ``config`` on the meta device."""
    import torch
    import transformers

    arch = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    with torch.device("meta"):
        return cls(config)


def require_decoder(config, model: str) -> None:
    """Refuse a config that is not a decoder-only causal LM (vLLM and SGLang serve those): an encoder-decoder, an
    architecture transformers has but not as a causal LM (BertForMaskedLM, ViTForImageClassification), or an encoder
    family (transformers also has a masked-LM head for it: BERT, RoBERTa, ...) without ``is_decoder: true``, which
    transformers' own causal-LM class of it needs to attend causally."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    kind = getattr(config, "model_type", "") or "this model"
    why = None
    causal = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in ((v,) if isinstance(v, str) else v)}
    arch = (getattr(config, "architectures", None) or [None])[0]
    if getattr(config, "is_encoder_decoder", False):
        why = "an encoder-decoder"
    elif arch and getattr(transformers, arch, None) is not None and arch not in causal:
        why = f"architecture {arch} is not a causal LM"
    elif (not arch or getattr(transformers, arch, None) is None) and kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        why = f"model_type {kind!r} has no causal-LM class in transformers"
    elif kind in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        why = f"{kind} is an encoder (bidirectional attention) unless its config sets is_decoder: true"
    if why:
        raise MemestError(f"{model}: memest serve sizes decoder-only causal LMs (what vLLM and SGLang serve); this "
                          f"config is not one ({why})")
