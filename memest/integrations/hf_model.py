"""What a Trainer's live model and arguments say beyond batch, precision and optimizer (integrations/transformers.py):
a peft-wrapped model's LoRA (``PeftModel.peft_config``: r, alpha, dropout, targets), a bitsandbytes-quantized base
(``config.quantization_config`` / ``is_loaded_in_4bit``: nf4, fp4, int8, double quantization), and the layout of
the arguments (``deepspeed``: a dict or a path, read by the DeepSpeed reader; ``fsdp`` / ``fsdp_config``, read by
the TrainingArguments reader; ``world_size``), and what peft's ``prepare_model_for_kbit_training`` left on the live
model (its non-quantized weights in fp32; gradient checkpointing and its reentrant default; the input embeddings'
require-grads hook). Reads attributes only: nothing here imports peft or bitsandbytes."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from memest.errors import MemestError
from memest.spec.trainers import training_args

# LoraConfig fields memest does not model, with their off values (peft 0.21 peft/tuners/lora/config.py)
LORA_UNMODELLED = {"use_dora": False, "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                   "alpha_pattern": {}, "bias": "none", "use_qalora": False, "trainable_token_indices": None}


def base_model(model):
    """The model under a peft wrapper (``PeftModel.get_base_model``), else ``model``."""
    return model.get_base_model() if hasattr(model, "get_base_model") and hasattr(model, "peft_config") else model


def model_settings(model) -> dict:
    """memest.estimate's lora / quant / double_quant keywords for ``model`` (a PeftModel or a plain model)."""
    settings: dict = {}
    base = base_model(model)
    peft_config = getattr(model, "peft_config", None)
    if peft_config:
        active = getattr(model, "active_adapter", "default")
        active = active[0] if isinstance(active, (list, tuple)) else active
        settings["lora"] = lora_settings(peft_config[active], base)
    settings.update(quant_settings(base))
    return settings


def lora_settings(conf, base) -> dict:
    """A LoraConfig as memest's lora mapping (spec/lora.py). peft resolves ``all-linear`` to the full names of the
    layers it wrapped; they are given back as the layers' own names when every layer of that name is wrapped."""
    kind = getattr(conf.peft_type, "value", conf.peft_type)
    if kind != "LORA":
        raise MemestError(f"MemestCallback: a {kind} adapter; memest models LoRA only (peft's LoraConfig)")
    odd = [f"{k}={getattr(conf, k)!r}" for k, off in LORA_UNMODELLED.items()
           if getattr(conf, k, off) not in (off, None, {}, [], False)]
    if odd:
        raise MemestError(f"MemestCallback: LoraConfig {', '.join(odd)} is not modelled (memest models r, lora_alpha, "
                          "lora_dropout and target_modules)")
    targets = conf.target_modules
    if isinstance(targets, str):
        if targets != "all-linear":
            raise MemestError(f"MemestCallback: LoraConfig target_modules={targets!r} (a regex) is not modelled; "
                              "give the layer names")
        names: list[str] | str = "all-linear"
    else:
        names = _short_names(set(targets), base)
    return {"r": conf.r, "alpha": conf.lora_alpha, "dropout": conf.lora_dropout, "targets": names}


def _short_names(targets: set[str], base) -> list[str]:
    leaves = {t.rsplit(".", 1)[-1] for t in targets}
    every = {name for name, _ in base.named_modules() if name.rsplit(".", 1)[-1] in leaves}
    full = {t for t in targets if "." in t}
    return sorted(leaves) if not full or full == every else sorted(targets)


def quant_settings(base) -> dict:
    """bitsandbytes' quantization of ``base`` (its config's quantization_config) as memest's quant keywords."""
    qc = getattr(getattr(base, "config", None), "quantization_config", None)
    if qc is None:
        if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
            raise MemestError("MemestCallback: the model is loaded in 4 or 8 bits but its config has no "
                              "quantization_config; pass quant='nf4' (or fp4, int8) to MemestCallback")
        return {}
    qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)
    method = str(getattr(qc.get("quant_method"), "value", qc.get("quant_method")))
    if method != "bitsandbytes":
        raise MemestError(f"MemestCallback: quant_method {method!r}: memest models bitsandbytes' 4-bit and 8-bit only")
    if qc.get("load_in_4bit"):
        kind = str(qc.get("bnb_4bit_quant_type", "fp4"))  # BitsAndBytesConfig's default (transformers 5.24)
        if kind not in ("nf4", "fp4"):
            raise MemestError(f"MemestCallback: bnb_4bit_quant_type {kind!r} is not modelled (nf4, fp4)")
        return {"quant": kind, "double_quant": bool(qc.get("bnb_4bit_use_double_quant", False))}
    if qc.get("load_in_8bit"):
        return {"quant": "int8"}
    return {}


def kbit_prepared_dtype(base):
    """The 16-bit dtype a bitsandbytes-quantized ``base`` was loaded in, when peft's
    ``prepare_model_for_kbit_training`` has run on it, else None. Its mark (peft 0.21.2, peft/utils/other.py): every
    fp16 / bf16 parameter but bitsandbytes' packed ``Params4bit`` cast to fp32, so the base's non-quantized weights
    (embeddings, norms, head; LoRA's own layers aside: peft makes them fp32 anyway) are all fp32 while the model was
    loaded in 16 bits (``config.dtype``, or the dtype the 4-bit weights were quantized from). A base loaded in fp32
    gives None: prepare casts nothing there, the memory is the same either way."""
    import torch

    if not (getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False)):
        return None
    config = getattr(base, "config", None)
    loaded = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(loaded, str):
        loaded = getattr(torch, loaded, None)
    params = list(base.parameters())
    if loaded not in (torch.float16, torch.bfloat16):
        states = [p.quant_state for p in params if type(p).__name__ == "Params4bit" and getattr(p, "quant_state", None)]
        loaded = getattr(states[0], "dtype", None) if states else None
    if loaded not in (torch.float16, torch.bfloat16):
        return None
    adapters = {id(p) for m in base.modules() for name in getattr(m, "adapter_layer_names", ())
                if isinstance(getattr(m, name, None), torch.nn.Module) for p in getattr(m, name).parameters()}
    plain = [p for p in params if id(p) not in adapters and p.is_floating_point() and type(p).__name__ != "Params4bit"]
    return loaded if plain and all(p.dtype == torch.float32 for p in plain) else None


def checkpointing_settings(base) -> dict:
    """transformers' gradient checkpointing as the live ``base`` has it (``gradient_checkpointing_enable``, called
    by the Trainer or by peft's prepare_model_for_kbit_training, sets ``gradient_checkpointing`` and
    ``_gradient_checkpointing_func``, a partial of torch.utils.checkpoint.checkpoint, on its layers): memest's
    ``checkpointing``. ``use_reentrant`` not given is torch's default, True (torch 2.13 torch/utils/checkpoint.py;
    prepare_model_for_kbit_training passes no kwargs); the Trainer's own switch passes False (transformers 5.24
    modeling_utils.py). Checkpointing on some layers only, offloaded, or with other torch.utils.checkpoint keywords
    than use_reentrant / preserve_rng_state is warned about and left to the arguments."""
    from torch.utils.checkpoint import checkpoint

    flagged = [m for m in base.modules() if hasattr(m, "gradient_checkpointing")]
    on = [m for m in flagged if m.gradient_checkpointing is True]
    settings: dict = {}
    if not on:
        hooks = getattr(base, "_require_grads_hooks", None) or getattr(base, "_require_grads_hook", None)
        if hooks:
            warnings.warn("memest: the input embeddings' output requires grad (enable_input_require_grads, as peft's "
                          "prepare_model_for_kbit_training sets it) with checkpointing off: not modelled (backward "
                          "also computes the embedding output's gradient)", stacklevel=3)
        return settings
    func = getattr(on[0], "_gradient_checkpointing_func", None)
    keywords = dict(getattr(func, "keywords", {}) or {})
    odd = set(keywords) - {"use_reentrant", "preserve_rng_state"}
    if len(on) != len(flagged) or getattr(func, "func", func) is not checkpoint or odd:
        warnings.warn("memest: the model's gradient checkpointing (on some layers only, offloaded, or with "
                      f"{sorted(odd) or 'another function'}) is not modelled; pass checkpointing=...", stacklevel=3)
        return settings
    settings["checkpointing"] = "blocks-reentrant" if keywords.get("use_reentrant", True) else "blocks"
    return settings


def layout_settings(args) -> dict:
    """memest.estimate's world_size / shard / offload / checkpointing keywords for TrainingArguments ``args``: its
    ``deepspeed`` (a dict, or a JSON file's path) and ``fsdp`` / ``fsdp_config`` read by spec/trainers' readers."""
    data: dict = {"fsdp": getattr(args, "fsdp", None), "fsdp_config": getattr(args, "fsdp_config", None)}
    ds = getattr(args, "deepspeed", None)
    if isinstance(ds, (str, Path)):
        try:
            ds = json.loads(Path(ds).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise MemestError(f"MemestCallback: TrainingArguments.deepspeed {str(ds)!r}: not a readable JSON file "
                              f"({exc})") from None
    data["deepspeed"] = ds
    read = training_args.read(Path("TrainingArguments"), data)
    if read.unknown:  # DeepSpeed's buffers and prefetch settings, an FSDP option memest has no model of
        warnings.warn(f"memest: TrainingArguments: not modelled: {', '.join(read.unknown)}", stacklevel=3)
    settings = {k: read.keys[k] for k in ("shard", "offload", "checkpointing") if k in read.keys}
    world = int(getattr(args, "world_size", 1) or 1)
    if world > 1:
        settings["world_size"] = world
    return settings
