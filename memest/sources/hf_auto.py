"""Which transformers class an ``hf:`` config builds, and what memest says when its config does not name one.

- ``architectures`` names a class transformers has: that class.
- No ``architectures``, or one transformers does not have: the head the config's ``model_type`` implies, from
  transformers' own auto mappings (transformers/models/auto/modeling_auto.py, the ``MODEL_FOR_*_MAPPING_NAMES``
  tables behind ``AutoModelForCausalLM`` and its siblings), tried in the order below; memest says which one it
  built (a note in the report and a warning on stderr). When no mapping gives a head memest builds inputs for,
  the config is refused, naming the key; never a base model (no head, no loss) in its place.
- ``auto_map``: the model ships its own code (trust_remote_code), which memest does not run: refused.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from memest.errors import ModelLoadError
from memest.sources.hf_inputs import BASE, SUPPORTED, VISION_TEXT, Head, forward_params, head_of

# transformers/models/auto/modeling_auto.py: the task tables memest tries for a model_type, first match wins.
# Encoder-decoder and multimodal tasks first (whisper is also in the causal-LM table, as a decoder alone);
# encoders (bert, roberta: in both the masked- and the causal-LM tables) get their masked-LM head unless the
# config says is_decoder.
# A base class whose own forward computes a loss (CLIP's return_loss) comes first: CLIP is also in the
# image-classification table, which would drop its text tower.
BASE_TABLE = "MODEL_MAPPING_NAMES"
TASK_TABLES = (
    BASE_TABLE,  # only a vision-text head (see above)
    "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",  # encoders only (see above)
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    BASE_TABLE,  # a base class with a head memest builds inputs for (ViT-style vision models); never BASE
)
ENCODER_TABLE_INDEX = 6


@dataclass
class Built:
    """The class memest builds for a config, its head, and what memest says about the choice."""

    cls: type
    arch: str
    head: Head
    warnings: list[str] = field(default_factory=list)  # said on stderr and in the report


def refuse_remote_code(where: str, config) -> None:
    """A config with ``auto_map`` names code shipped with the model (trust_remote_code): memest does not run it,
    and transformers' own class of the same model_type may differ from that code, so it refuses."""
    auto_map = getattr(config, "auto_map", None)
    if not auto_map:
        return
    names = ", ".join(f"{k}: {v}" for k, v in list(dict(auto_map).items())[:3]) if isinstance(auto_map, dict) else ""
    raise ModelLoadError(
        f"{where}: its config has \"auto_map\" ({names or auto_map}): the model ships its own code "
        "(trust_remote_code), which memest does not run, and transformers' built-in class may differ from it; "
        "estimate the model's code from a model file (memest estimate model.py), or delete \"auto_map\" from a copy "
        "of config.json to estimate transformers' built-in class (what trust_remote_code=False runs)"
    )


def class_for(transformers, config, where: str) -> Built:
    """The class for ``config`` (see the module docstring), or ModelLoadError naming the key."""
    archs = getattr(config, "architectures", None) or []
    named = archs[0] if archs else None
    cls = getattr(transformers, named, None) if named else None
    if _is_model_class(transformers, cls):
        head = _head(named, config, cls, where)
        warnings = [] if head.name != BASE else [
            f"\"architectures\" names {named}, a model without a head: traced without an LM head and with the mean "
            "of its output as the loss; name a head class (e.g. ...ForCausalLM) in \"architectures\" to estimate it"
        ]
        return Built(cls, named, head, warnings)
    why = (f"\"architectures\" names {named}, which is not a model class of transformers {transformers.__version__}"
           if named else "its config has no \"architectures\"")
    model_type = getattr(config, "model_type", "")
    from transformers.models.auto import modeling_auto

    heads: dict[str, Head | None] = {}  # each class's head, None where memest builds no inputs for it
    for k, table in enumerate(TASK_TABLES):
        if k == ENCODER_TABLE_INDEX and getattr(config, "is_decoder", False):
            continue
        name = getattr(modeling_auto, table, {}).get(model_type)
        name = name[0] if isinstance(name, (tuple, list)) else name
        cls = getattr(transformers, name, None) if name else None
        if not _is_model_class(transformers, cls):
            continue
        if name not in heads:
            try:
                heads[name] = head_of(name, config, forward_params(cls))
            except ModelLoadError:
                heads[name] = None
        head = heads[name]
        if head is None or head.name == BASE or (k == 0 and head.name != VISION_TEXT):
            continue
        return Built(cls, name, head, [
            f"{why}: built {name}, the {head.name} head that transformers' auto mapping gives model_type "
            f"{model_type!r} ({table}); set \"architectures\" in the config to build another"
        ])
    tried = list(heads)
    raise ModelLoadError(
        f"{where}: {why}, and model_type {model_type!r} has no head memest builds inputs for (tried "
        f"{', '.join(tried) or 'none: transformers maps no task class to it'}); memest builds {SUPPORTED}: set "
        "\"architectures\" to such a class (e.g. LlamaForCausalLM), or estimate it from a model file with your own "
        "example_inputs() (memest estimate model.py)"
    )


def _is_model_class(transformers, cls) -> bool:
    return isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)


def _head(arch: str, config, cls, where: str) -> Head:
    try:
        return head_of(arch, config, forward_params(cls))
    except ModelLoadError as exc:
        raise ModelLoadError(f"{where}: {exc}") from None


def unknown_model_type(model_type, known: list[str]) -> str:
    """One short line for a model_type transformers does not know (its own message lists every type, 12 KB)."""
    close = difflib.get_close_matches(str(model_type).lower(), known, n=5, cutoff=0.6)
    hint = f"close: {', '.join(close)}" if close else f"{len(known)} types are known"
    return (f"model_type {model_type!r} is not one transformers knows ({hint}); fix \"model_type\", or upgrade "
            "transformers if the model is newer than it")
