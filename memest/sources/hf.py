"""``hf:NAME`` / ``hf:path/config.json``: a transformers model built from its config alone — no
weights, no network. Bundled configs live in memest/data/models (also reachable as configs/models).

Inputs follow the model's head: input_ids + labels for causal/masked LM and seq2seq, labels for
classification, pixel_values for vision. Training runs with ``use_cache=False``.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from ..errors import ModelLoadError
from .base import ModelSource
from .hf_masks import real_mask_branches

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "models"
DEFAULT_SEQ = 512  # when --seq is not given (capped by the model's maximum positions)


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.json"))


def _config_path(name: str) -> Path:
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"hf config {str(path)!r} not found; pass an existing config.json")
        return path
    bundled = BUNDLED / f"{name}.json"
    if not bundled.exists():
        raise ModelLoadError(
            f"unknown hf model {name!r}; bundled: {', '.join(bundled_names())} — or pass hf:path/to/config.json"
        )
    return bundled


def _head(arch: str) -> str:
    for suffix, head in (
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
        ("ForMaskedLM", "masked-lm"),
        ("ForConditionalGeneration", "seq2seq"),
        ("ForImageClassification", "image-classification"),
        ("ForSequenceClassification", "sequence-classification"),
    ):
        if arch.endswith(suffix):
            return head
    return "base"


def load_hf_source(name: str) -> ModelSource:
    path = _config_path(name)
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read config: {exc}") from exc
    if "model_type" not in raw:
        raise ModelLoadError(f"{path}: config has no \"model_type\"; it is not a transformers config.json")
    from ..trace.step import imports_without_gc

    # transformers imports its modules lazily: the config class here, the model's module on getattr
    with contextlib.nullcontext() if "transformers" in sys.modules else imports_without_gc():
        try:
            import transformers
        except ImportError as exc:
            raise ModelLoadError("hf: models need transformers; install memest[hf] (pip install transformers)") from exc

        transformers.logging.set_verbosity_error()  # config warnings are noise for a config-only model
        try:
            config = transformers.AutoConfig.for_model(**raw)
        except Exception as exc:
            raise ModelLoadError(f"{path}: transformers cannot read this config: {exc}") from exc
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        cls = getattr(transformers, arch, None) if arch else None
        if cls is None:
            cls = transformers.AutoModel
            arch = "AutoModel"
    config.use_cache = False
    head = _head(arch)
    max_pos = _max_positions(config)
    takes_seq = not (head == "image-classification" or raw.get("model_type") == "vit")
    default_seq = min(DEFAULT_SEQ, max_pos or DEFAULT_SEQ) if takes_seq else None
    max_seq, max_seq_why = _position_limit(config) if takes_seq else (None, "")

    def build_model():
        if cls is transformers.AutoModel:
            model = cls.from_config(config)
        else:
            model = cls(config)
        return model

    def example_inputs(batch_size: int, seq_len: int | None = None):
        return _inputs(config, head, batch_size, seq_len or default_seq or DEFAULT_SEQ)

    return ModelSource(
        name=path.stem if path.parent == BUNDLED else str(path),
        build_model=build_model,
        example_inputs=example_inputs,
        default_seq=default_seq,
        origin=str(path),
        trace_context=real_mask_branches,
        max_seq=max_seq,
        max_seq_why=max_seq_why,
    )


def _max_positions(config) -> int | None:
    for attr in ("max_position_embeddings", "n_positions"):
        value = getattr(config, attr, None)
        if isinstance(value, int):
            return value
    return None


def _position_limit(config) -> tuple[int | None, str]:
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


def _inputs(config, head: str, batch: int, seq: int) -> dict:
    import torch

    if head == "image-classification" or getattr(config, "model_type", "") in ("vit",):
        size = getattr(config, "image_size", 224)
        channels = getattr(config, "num_channels", 3)
        inputs = {"pixel_values": torch.randn(batch, channels, size, size)}
        if head == "image-classification":
            inputs["labels"] = torch.randint(0, config.num_labels, (batch,))
        return inputs
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    inputs = {"input_ids": ids}
    if head in ("causal-lm", "masked-lm", "seq2seq"):
        inputs["labels"] = ids.clone()
    elif head == "sequence-classification":
        inputs["labels"] = torch.randint(0, config.num_labels, (batch,))
    return inputs
