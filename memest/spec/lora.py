"""What --lora and --freeze say, parsed without importing torch (RunSpec validates with it; the
application to a model is features/finetune.py).

``--lora`` is ``r=16,alpha=32,dropout=0.05,targets=q_proj,k_proj,v_proj,o_proj`` (``targets=all-linear``:
peft's every linear layer but the output head); keys left out take peft's defaults (r=8, alpha=8,
dropout=0, peft's target modules for the model type, fp32 adapters). ``dtype=base`` keeps the adapters in the base
layer's dtype: peft's ``get_peft_model(..., autocast_adapter_dtype=False)`` (``autocast_adapter_dtype=false`` is the
same key under peft's name; ``dtype=fp32`` is peft's default, autocast_adapter_dtype=True, peft >= 0.12.0). The YAML
``lora:`` mapping and the API's ``lora=`` (a dict, the same string, or True for peft's defaults) canonicalise to this
string.

``exclude=vision,projector`` keeps adapters out of those modules and everything under them (peft's
``exclude_modules``, given as a regular expression over module names): on the hf: vision-language models ``vision``
and ``projector`` are the parts ``--freeze`` names (features/finetune.py expand_freeze), other entries are module
names (``model.visual.patch_embed``). LLaMA-Factory builds its LoRA targets so (model_utils/visual.py
patch_target_modules)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from memest.errors import MemestError
from memest.spec.choices import AdapterDtype

_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "targets": "target_modules"}
_ALIASES = {"lora_alpha": "alpha", "lora_dropout": "dropout", "target_modules": "targets", "rank": "r",
            "exclude_modules": "exclude"}
_LISTS = ("targets", "exclude")  # keys whose value is a comma-separated list
_AUTOCAST = "autocast_adapter_dtype"  # peft's get_peft_model keyword: dtype=fp32 (true) | base (false)
_NAMES = (*_KEYS, "dtype", "exclude")


@dataclass(frozen=True)
class LoraSettings:
    r: int | None = None
    alpha: float | None = None
    dropout: float | None = None
    targets: tuple[str, ...] | None = None  # ("all-linear",) for peft's all-linear
    dtype: AdapterDtype | None = None  # None: peft's default (fp32)
    exclude: tuple[str, ...] | None = None  # modules (and their submodules) with no adapter: vision, projector, names

    def text(self) -> str:
        parts = [f"{k}={_num(getattr(self, k))}" for k in ("r", "alpha", "dropout") if getattr(self, k) is not None]
        if self.dtype is not None:
            parts.append(f"dtype={self.dtype}")
        if self.exclude:
            parts.append("exclude=" + ",".join(self.exclude))
        if self.targets:
            parts.append("targets=" + ",".join(self.targets))
        return ",".join(parts) or "on"

    @property
    def autocast_adapter_dtype(self) -> bool:
        """peft's get_peft_model keyword (True, its default, unless dtype=base)."""
        return (self.dtype or AdapterDtype.FP32).autocast

    def peft_kwargs(self) -> dict:
        out: dict = {}
        for key, peft_key in _KEYS.items():
            value = getattr(self, key)
            if value is not None:
                out[peft_key] = (value[0] if value == ("all-linear",) else list(value)) if key == "targets" else value
        return out


def _num(v) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else str(v)


def parse_lora(value) -> str:
    """Canonical --lora text ('' when off) from a flag string, a YAML mapping / API dict, or a bool."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "none", "off")):
        return ""
    if value is True or (isinstance(value, str) and value.strip().lower() in ("on", "true", "default")):
        return LoraSettings().text()
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, str):
        items, key = [], None
        for token in value.split(","):
            token = token.strip()
            if "=" in token:
                key, _, v = token.partition("=")
                items.append((key.strip(), [v.strip()]))
            elif key is not None and _ALIASES.get(key.lower(), key.lower()) in _LISTS and token:
                items[-1][1].append(token)
            else:
                raise MemestError(f"--lora {value!r}: write key=value pairs (r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj)")
        items = [(k, v if len(v) > 1 else v[0]) for k, v in items]
    else:
        raise MemestError(f"lora: expected a mapping (r:, alpha:, dropout:, targets:, dtype:) or a string, got {value!r}")
    return settings_from(items).text()


def _whole(v) -> int:
    """r: a whole number (8, '8', 8.0), never a bool or a fraction read as its floor."""
    if isinstance(v, bool) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError
    return int(v)


def _number(v) -> float:
    """alpha, dropout: a finite number, never a bool."""
    if isinstance(v, bool):
        raise ValueError
    out = float(v)
    if not math.isfinite(out):
        raise ValueError
    return out


def _adapter_dtype(key: str, v) -> AdapterDtype:
    """dtype=fp32|base, or peft's autocast_adapter_dtype=true|false."""
    if key == _AUTOCAST:
        text = str(v).strip().lower()
        if text not in ("true", "false"):
            raise ValueError
        return AdapterDtype.FP32 if text == "true" else AdapterDtype.BASE
    if str(v).strip().lower() not in AdapterDtype.values():
        raise ValueError
    return AdapterDtype.parse(v, "--lora dtype")


def settings_from(items) -> LoraSettings:
    fields: dict = {}
    for key, v in items:
        lowered = str(key).lower()
        name = "dtype" if lowered == _AUTOCAST else _ALIASES.get(lowered, lowered)
        if name not in _NAMES:
            raise MemestError(f"--lora: unknown key {key!r}; use r, alpha, dropout, targets, dtype, exclude")
        if name in fields:
            raise MemestError(f"--lora: {name} is given twice; give each of r, alpha, dropout, targets, dtype, "
                              "exclude once")
        try:
            if name == "dtype":
                fields["dtype"] = _adapter_dtype(lowered, v)
            elif name == "r":
                fields["r"] = _whole(v)
                if fields["r"] < 1:
                    raise ValueError
            elif name in ("alpha", "dropout"):
                fields[name] = _number(v)
                if name == "dropout" and not 0 <= fields[name] < 1:
                    raise ValueError
                if name == "alpha" and fields[name] <= 0:
                    raise ValueError
            else:
                targets = [v] if isinstance(v, str) else list(v)
                targets = tuple(t.strip() for t in targets for t in str(t).split(",") if t.strip())
                if not targets:
                    raise ValueError
                fields[name] = targets
        except (TypeError, ValueError):
            raise MemestError(f"--lora: bad value for {name}: {v!r} (r: a whole number >= 1, alpha: a number > 0, "
                              "dropout: 0 <= p < 1, targets: module names or all-linear, exclude: vision, projector or module names, dtype: fp32 (peft's default) or base "
                              "(the base layer's dtype: peft's autocast_adapter_dtype=False), "
                              "autocast_adapter_dtype: true or false)") from None
    return LoraSettings(**fields)


def lora_settings(text: str) -> LoraSettings | None:
    if not text:
        return None
    if text == "on":
        return LoraSettings()
    return settings_from((k, v) for k, _, v in (p.partition("=") for p in _split(text)))


def _split(text: str) -> list[str]:
    """'r=8,targets=a,b' -> ['r=8', 'targets=a,b']"""
    out: list[str] = []
    for token in text.split(","):
        if "=" in token or not out:
            out.append(token)
        else:
            out[-1] += "," + token
    return out


def freeze_patterns(text: str | list | tuple) -> list[str]:
    """Comma-separated glob patterns, or a list of them (YAML ``freeze: [a, b]``, the API's freeze=[...])."""
    if isinstance(text, (list, tuple)):
        bad = [p for p in text if not isinstance(p, str)]
        if bad:
            raise MemestError(f"freeze: expected parameter-name patterns (text), got {bad[0]!r} in {list(text)!r}")
        text = ",".join(text)
    elif text is not None and not isinstance(text, str):
        raise MemestError(f"freeze: expected parameter-name patterns (a, b.* or a list of them), got {text!r}")
    return [p.strip() for p in str(text or "").split(",") if p.strip()]
