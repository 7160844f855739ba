"""Fine-tuning applied to the built model: ``--freeze PATTERN``, ``--quant nf4|fp4|int8`` (features/quant.py, features/quant_int8.py) and
``--lora`` through peft's own ``LoraConfig`` / ``get_peft_model`` (so adapter shapes, their dtype (fp32 by peft's
``autocast_adapter_dtype=True``, or the base layer's with ``--lora ...,dtype=base``: ``autocast_adapter_dtype=False``,
peft 0.21.2 peft/mapping_func.py get_peft_model, peft/tuners/tuners_utils.py cast_adapter_dtype), the input casts
and dropout are peft's). Applied in the order a QLoRA
script applies them: the model in its dtype, its linear layers quantized, then LoRA; the real CPU ground
truth runs the same function on real tensors.

What the flags say is parsed in memest/spec/lora.py."""

from __future__ import annotations

import fnmatch
import warnings

from memest.errors import MemestError
from memest.features import quant as quant_layers  # by module: tests stand in peft's bitsandbytes layer classes
from memest.features import quant_int8
from memest.features.base import StepFeature
from memest.features.quant import Linear4bitModel, quantize_linears
from memest.features.quant_int8 import Linear8bitModel
from memest.imports import quiet_library_import
from memest.sources.hf_inputs import FREEZE_GROUPS
from memest.spec.choices import Quant, Target
from memest.spec.lora import LoraSettings, freeze_patterns, lora_settings


def _matches(name: str, pattern: str) -> bool:
    """A parameter name matches a glob, or lies under a module the glob names."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:k]), pattern) for k in range(1, len(parts) + 1))


def unmatched_freeze(names: list[str], patterns: list[str], of: str = "") -> str | None:
    """The first pattern that matches none of the parameter ``names`` (of the model ``of``), in words (None: each
    matches one)."""
    for pattern in patterns:
        if not any(_matches(name, pattern) for name in names):
            examples = ", ".join(names[:3])
            model = f" of {of}" if of else ""
            group = (f"; {pattern} names a part of the hf: vision-language models memest knows ("
                     f"{', '.join(FREEZE_GROUPS)})" if pattern in FREEZE_GROUP_NAMES else "")
            return f"--freeze {pattern!r} matches no parameter{model} (names look like: {examples}, ...){group}"
    return None


FREEZE_GROUP_NAMES = ("vision", "projector")


def expand_freeze(model, patterns: list[str]) -> list[str]:
    """--freeze's named parts of a vision-language model, ``vision`` (the tower) and ``projector``, as the modules
    LLaMA-Factory freezes for them (sources/hf_inputs.py FREEZE_GROUPS); other patterns as given."""
    groups = FREEZE_GROUPS.get(getattr(getattr(model, "config", None), "model_type", None), {})
    return [module for p in patterns for module in (groups[p] if p in groups else (p,))]


def apply_freeze(model, patterns: list[str], where: str) -> int:
    """requires_grad=False for every parameter matching a pattern; each pattern must match one."""
    frozen = 0
    patterns = expand_freeze(model, patterns)
    missing = unmatched_freeze([name for name, _ in model.named_parameters()], patterns)
    if missing:
        raise MemestError(f"{where}: {missing}")
    for name, p in model.named_parameters():
        if any(_matches(name, pattern) for pattern in patterns) and p.requires_grad:
            p.requires_grad_(False)
            frozen += 1
    return frozen


def apply_lora(model, settings: LoraSettings, where: str, quant: str = "none"):
    """peft's get_peft_model with a LoraConfig of ``settings`` (memest's 4-bit / int8 stand-in registered
    with peft's LoRA layer for bitsandbytes' Linear4bit / Linear8bitLt)."""
    try:
        with quiet_library_import():  # peft imports bitsandbytes, which may log or print while it loads
            from peft import LoraConfig, get_peft_model
    except ImportError:
        raise MemestError("--lora runs peft's own LoRA: pip install 'memest[peft]' (or pip install peft)") from None
    kwargs = settings.peft_kwargs()
    if settings.exclude:
        kwargs["exclude_modules"] = lora_exclusion(model, settings.exclude, where)
    if type(model).__name__.endswith("ForCausalLM"):
        kwargs["task_type"] = "CAUSAL_LM"
    try:
        config = LoraConfig(**kwargs)
        if quant == Quant.INT8:

            config._register_custom_module({Linear8bitModel: quant_layers.lora_layer_class(clone=False)})
        elif quant != Quant.NONE:

            config._register_custom_module({Linear4bitModel: quant_layers.lora_layer_class()})
        with warnings.catch_warnings():  # exclude= that removes no target (vision with targets=q_proj on Qwen2-VL): as asked
            warnings.filterwarnings("ignore", message="You have passed exclude_modules")
            wrapped = get_peft_model(model, config, autocast_adapter_dtype=settings.autocast_adapter_dtype)
    except ValueError as exc:  # peft's own message: no target modules found, unknown model type, ...
        raise MemestError(f"{where}: peft's get_peft_model: {str(exc).strip().splitlines()[0]}") from exc
    _check_rank(wrapped, config.r, where)
    return wrapped


def lora_exclusion(model, exclude: tuple[str, ...], where: str) -> str:
    """--lora exclude=: peft's exclude_modules as a regular expression (peft fullmatches a string against each module
    name) for the named modules and everything under them; ``vision`` / ``projector`` are --freeze's parts of a
    vision-language model (expand_freeze). LLaMA-Factory's patch_target_modules drops a module whose name contains a
    forbidden key (model_utils/visual.py, hiyouga/LLaMA-Factory at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30); for its
    keys (visual.blocks, vision_tower, ...) that is the same set as these module prefixes."""
    import re

    names = {name for name, _ in model.named_modules()}
    prefixes = expand_freeze(model, list(exclude))
    missing = [p for p in prefixes if p not in names]
    if missing:
        examples = ", ".join(sorted(n for n in names if n and n.count(".") <= 1)[:6])
        raise MemestError(f"{where}: --lora exclude={missing[0]} names no module (module names look like: {examples}, "
                          f"...; vision and projector name the parts of {', '.join(FREEZE_GROUPS)})")
    return "(?:" + "|".join(re.escape(p) for p in prefixes) + r")(?:\..*)?"


def _check_rank(model, r: int, where: str) -> None:
    """A rank above min(in, out) of a targeted layer adds adapter parameters (memory) but no rank: refused
    (B @ A has rank at most min(in, out)), so a typo such as r=100000 is never estimated silently."""
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            smallest = min(module.in_features, module.out_features)
            if r > smallest:
                raise MemestError(
                    f"{where}: --lora r={r} is above the rank a targeted layer can hold ({name}: {module.in_features} "
                    f"in, {module.out_features} out, so at most r={smallest}); choose r <= {smallest} or other targets"
                )


def _prepare_kbit(model, where: str) -> str:
    """peft's own prepare_model_for_kbit_training (trl's SFTTrainer calls it for a 4-bit model): every fp16 /
    bf16 parameter that is not a packed 4-bit weight cast to fp32; memest's --checkpointing stays in charge of
    checkpointing, and no CUDA cache is emptied (none exists)."""
    import torch

    try:
        with quiet_library_import():
            from peft import prepare_model_for_kbit_training
    except ImportError:
        raise MemestError("--prepare-kbit runs peft's prepare_model_for_kbit_training: pip install 'memest[peft]'") from None
    before = sum(p.numel() for p in model.parameters() if p.dtype in (torch.float16, torch.bfloat16))
    try:
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False, auto_clear_cache=False)
    except Exception as exc:
        raise MemestError(f"{where}: peft's prepare_model_for_kbit_training raised {type(exc).__name__}: {exc}") from exc
    return (f"--prepare-kbit: peft's prepare_model_for_kbit_training cast {before:,} non-quantized 16-bit parameters "
            "(embeddings, norms, head) to fp32")


def _quantize(model, spec, dtype, where: str) -> str:
    """--quant: the base's linear layers replaced with the stand-in; the report's note."""
    import torch

    if spec.quant == Quant.INT8:

        n = quant_int8.quantize_linears(model, cuda_kernels=spec.target == Target.CUDA)
        kernels = ("MatMul8bitLt with bitsandbytes' CUDA ops: the input cast to float16 and quantised to int8, an "
                   "int32 product dequantised to float16 then to the input's dtype" if spec.target == Target.CUDA else
                   "MatMul8bitFp, bitsandbytes' CPU training path: the weight dequantised, F.linear")
        note = (f"--quant int8: {n} linear layers stored as bitsandbytes' Linear8bitLt stores them (LLM.int8: int8 "
                f"weight + a float32 scale per output row; modelled: features/quant_int8.py), the output head and "
                f"non-linear modules unquantized; forward: {kernels}; each layer keeps its input for backward as a "
                "ctx attribute, which activation checkpointing does not drop; backward dequantises the whole weight "
                f"in the input's dtype. Outlier columns (inputs with |x| >= {quant_int8.THRESHOLD}, data-dependent) are traced as "
                "none: each adds one input column per layer held until backward (at most one more copy of the "
                "layer's input)")
    else:

        compute = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(str(spec.precision), dtype)
        # FSDP-QLoRA: the packed weights stored as the model's dtype for FSDP to shard or flatten with the rest
        # (features/quant.py; FSDP1 under every --shard, NO_SHARD too)
        storage = dtype if spec.fsdp_wraps else torch.uint8
        n = quantize_linears(model, str(spec.quant), spec.double_quant, compute, storage)
        note = (
            f"--quant {spec.quant}: {n} linear layers stored as bitsandbytes' Linear4bit stores them (packed 4-bit, "
            f"block-wise absmax{', double quantization' if spec.double_quant else ''}; modelled: features/quant.py), "
            "the output head and non-linear modules unquantized; each layer's weight dequantised whole in forward "
            "and backward (bitsandbytes' dequant + F.linear path; at <= 1536 tokens per step bitsandbytes may pick a "
            "fused kernel on some GPUs that skips the forward copy)"
        )
        if storage != torch.uint8:
            note += (f"; FSDP-QLoRA: packed weights stored as {str(storage).removeprefix('torch.')} "
                     "(bnb_4bit_quant_storage) so FSDP shards them; the quantization state stays whole on every rank")
    if not n:
        raise MemestError(f"{where}: --quant {spec.quant} found no nn.Linear layer to quantize")
    return note


def apply_finetune(model, spec, dtype, where: str):
    """The model as the fine-tuning run trains it, and notes for the report."""
    notes: list[str] = []
    if spec.quant != Quant.NONE:
        notes.append(_quantize(model, spec, dtype, where))
    if spec.prepare_kbit:
        notes.append(_prepare_kbit(model, where))
    patterns = freeze_patterns(spec.freeze)
    if patterns:
        n = apply_freeze(model, patterns, where)
        notes.append(f"--freeze {spec.freeze}: {n} parameter tensors frozen")
    settings = lora_settings(spec.lora)
    if settings is not None:
        model = apply_lora(model, settings, where, quant=str(spec.quant))
        adapters = [p for p in model.parameters() if p.requires_grad]
        trainable = sum(p.numel() for p in adapters)
        dtypes = "/".join(sorted({str(p.dtype).removeprefix("torch.") for p in adapters})) or "none"
        kept = ("in fp32 by peft's autocast_adapter_dtype=True" if settings.autocast_adapter_dtype else
                "in the base layers' dtype (autocast_adapter_dtype=False, dtype=base)")
        notes.append(f"--lora {settings.text()}: peft's LoraConfig / get_peft_model applied ({trainable:,} trainable "
                     f"adapter parameters, {dtypes}: kept {kept})")
    return model, notes


class FinetuneFeature(StepFeature):
    """--quant, --freeze and --lora applied to the built model (in its dtype), as a QLoRA script does."""

    name = "finetune"

    def build(self, built, spec) -> None:
        built.model, notes = apply_finetune(built.model, spec, built.dtype, built.where)
        built.notes += notes
