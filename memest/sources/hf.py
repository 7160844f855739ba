"""``hf:NAME``, ``hf:org/name`` and ``hf:path/config.json``: a transformers model built from its
config alone — no weights.

- ``hf:NAME`` (no slash): a config bundled in memest/data/models (also reachable as configs/models).
- ``hf:path/config.json`` or ``hf:path/dir`` (an existing file or folder): that config.
- ``hf:org/name``: a Hugging Face Hub id, resolved by transformers' own config loading
  (``AutoConfig.from_pretrained``): the local Hugging Face cache first (HF_HOME / HF_HUB_CACHE), the
  hub when it can be reached. Only config.json is read; no code from the hub is run.

Inputs follow the model's head (sources/hf_inputs.py). Training runs with ``use_cache=False``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import re
import sys
from pathlib import Path
from types import SimpleNamespace

from memest.errors import ModelLoadError
from memest.imports import imports_without_gc, quiet_library_import
from memest.sources.base import ModelSource
from memest.sources.hf_auto import class_for, refuse_remote_code, unknown_model_type
from memest.sources.hf_experts import cuda_experts_dispatch
from memest.sources.hf_inputs import (
    CTC,
    DEFAULT_SEQ,
    VISION_LANGUAGE,
    check_seq,
    image_facts,
    image_inputs,
    make_inputs,
    value_ranges,
)
from memest.sources.hf_masks import real_mask_branches
from memest.sources.hf_values import known_values
from memest.spec.choices import Target
from memest.units import format_bytes

BUNDLED = Path(__file__).resolve().parent.parent / "data" / "models"
# huggingface_hub's repo id rule (utils/_validators.py, validate_repo_id): org/name of letters, digits, - _ .
HUB_ID = re.compile(r"^[\w.-]{1,96}/[\w.-]{1,96}$")

__all__ = ["BUNDLED", "DEFAULT_SEQ", "bundled_names", "load_hf_source"]


def bundled_names() -> list[str]:
    return sorted(p.stem for p in BUNDLED.glob("*.json"))


def _config_path(name: str) -> Path | None:
    """The config.json that ``name`` names on disk, or None for a hub id."""
    path = Path(name)
    if path.suffix == ".json" or path.is_dir():
        if path.is_dir():
            path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"hf config {str(path)!r} not found; pass an existing config.json")
        return path
    if "/" not in name:
        bundled = BUNDLED / f"{name}.json"
        if not bundled.exists():
            names = bundled_names()
            folded = [n for n in names if n.lower() == name.lower()]  # hf:Llama-2-7B is hf:llama-2-7b
            if len(folded) == 1:
                return BUNDLED / f"{folded[0]}.json"
            close = difflib.get_close_matches(name.lower(), names, n=3, cutoff=0.6)
            hint = f"did you mean {' or '.join(f'hf:{c}' for c in close)}? " if close else ""
            raise ModelLoadError(
                f"unknown hf model {name!r}; {hint}bundled: {', '.join(names)} — or pass a hub id "
                "hf:org/name or hf:path/to/config.json"
            )
        return bundled
    if not HUB_ID.match(name):
        raise ModelLoadError(
            f"hf:{name} is neither an existing path nor a Hugging Face Hub id (org/name); pass hf:org/name, "
            "hf:path/to/config.json or a bundled name"
        )
    return None


def load_hf_source(name: str) -> ModelSource:
    path = _config_path(name)
    # transformers imports its modules lazily: the config class here, the model's module on getattr
    with contextlib.nullcontext() if "transformers" in sys.modules else imports_without_gc():
        try:
            with quiet_library_import():
                import transformers
        except ImportError as exc:
            raise ModelLoadError("hf: models need transformers; install memest[hf] (pip install transformers)") from exc

        transformers.logging.set_verbosity_error()  # config warnings are noise for a config-only model
        display = (path.stem if path.parent == BUNDLED else str(path)) if path is not None else name
        config = _from_file(transformers, path, f"hf:{display}") if path is not None else _from_hub(transformers, name)
        refuse_remote_code(f"hf:{display}", config)
        built = class_for(transformers, config, f"hf:{display}")
    cls, arch, head = built.cls, built.arch, built.head
    config.use_cache = False
    notes = list(built.warnings) + list(head.notes) + _layerdrop_off(config) + _rms_norm_note(config)
    ranges = _weak_ranges() if head.reads_values else None
    reals = _weak_ranges() if head.reads_values else None  # fake input -> its real values (Qwen2-VL's ids, grid)

    def build_model():
        return cls(config)

    def example_inputs(batch_size: int, seq_len: int | None = None):
        seq = seq_len or head.default_seq or DEFAULT_SEQ
        check_seq(head, seq, f"hf:{display}")
        inputs = make_inputs(config, head, batch_size, seq, reals)
        if ranges is not None:
            for tensor, low, high in value_ranges(config, head, inputs):
                ranges[tensor] = (low, high)
        return inputs

    def images_inputs(batch_size: int, seq_len: int | None, images: int, hw: tuple[int, int] | None, **vision):
        return image_inputs(config, head, batch_size, seq_len or DEFAULT_SEQ, images, hw, reals, **vision)

    def images_facts(images: int, hw: tuple[int, int] | None, **vision) -> dict:
        return image_facts(config, head, images, hw, **vision)

    @contextlib.contextmanager
    def trace_context(spec):
        """While the step is traced: transformers' mask branches as on real tensors (hf_masks.py), its
        value checks on memest's inputs answered (hf_values.py) and, for --target cuda, its MoE kernel as
        on the target GPU (hf_experts.py)."""
        with contextlib.ExitStack() as stack:
            stack.enter_context(real_mask_branches())
            if spec.target == Target.CUDA:
                stack.enter_context(cuda_experts_dispatch(spec.compute_capability))
            if ranges is not None:
                stack.enter_context(known_values(ranges, ctc=head.name == CTC, real=reals))
            yield

    return ModelSource(
        name=display,
        build_model=build_model,
        example_inputs=example_inputs,
        default_seq=head.default_seq,
        origin=str(path) if path is not None else f"hf:{name}",
        trace_context=trace_context,
        max_seq=head.max_seq if head.default_seq is not None else None,
        max_seq_why=head.max_seq_why,
        notes=notes,
        inputs_hint=(
            f"memest built the inputs of a {head.name} head for {arch} ({'; '.join(head.notes) or 'input_ids, labels'}); "
            "if the model needs other inputs, memest does not support its head or config yet — estimate it from a "
            "model file with your own example_inputs() (memest estimate model.py)"
        ),
        values_hint=_values_hint(arch, config),
        image_inputs=images_inputs if head.name == VISION_LANGUAGE else None,
        image_facts=images_facts if head.name == VISION_LANGUAGE else None,
        default_input_notes=list(head.notes) if head.name == VISION_LANGUAGE else [],
        meta_build=True,
        warnings=list(built.warnings),
        no_seq=f"a {head.name} model: its inputs are images (pixel_values)" if head.default_seq is None else "",
    )


def _from_file(transformers, path: Path, where: str):
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ModelLoadError(
            f"{path}: cannot read config: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
            "config.json is JSON, which is UTF-8: save it as UTF-8"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read config: {exc}") from exc
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelLoadError(f"{path}: config has no \"model_type\"; it is not a transformers config.json")
    refuse_remote_code(where, SimpleNamespace(auto_map=raw.get("auto_map")))
    known = list(transformers.CONFIG_MAPPING.keys())
    if raw["model_type"] not in known:
        raise ModelLoadError(f"{path}: {unknown_model_type(raw['model_type'], known)}")
    try:
        return transformers.AutoConfig.for_model(**raw)
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(f"{path}: transformers cannot read this config: {first}") from exc


def _from_hub(transformers, repo_id: str):
    """transformers' own config loading: the local cache first (no network), then the hub."""
    try:
        return transformers.AutoConfig.from_pretrained(repo_id, local_files_only=True, trust_remote_code=False)
    except OSError:
        pass  # not in the local cache
    except ValueError as exc:
        raise _hub_error(repo_id, exc) from exc
    hub_log = logging.getLogger("huggingface_hub")  # its retry warnings: the error below says it in one line
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)
    try:
        return transformers.AutoConfig.from_pretrained(repo_id, trust_remote_code=False)
    except (OSError, ValueError) as exc:
        raise _hub_error(repo_id, exc) from exc
    finally:
        hub_log.setLevel(level)


def _hub_error(repo_id: str, exc: Exception) -> ModelLoadError:
    from huggingface_hub import constants, errors

    cause = exc.__cause__ or exc.__context__
    if isinstance(exc, ValueError) and "trust_remote_code" in str(exc):
        return ModelLoadError(
            f"hf:{repo_id} needs code from the hub (trust_remote_code), which memest does not run; download its "
            "modeling code and estimate it from a model file (memest estimate model.py)"
        )
    if isinstance(cause, errors.GatedRepoError):
        return ModelLoadError(
            f"hf:{repo_id} is a gated repository: accept its terms on https://huggingface.co/{repo_id} and log in "
            f"(hf auth login), or pass a local copy of its config: hf:path/to/config.json"
        )
    if isinstance(cause, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"hf:{repo_id}: no such model on the Hugging Face Hub (or a private one: log in with hf auth login)"
        )
    if isinstance(cause, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)) or "connect" in str(exc):
        where = "offline (HF_HUB_OFFLINE)" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        return ModelLoadError(
            f"hf:{repo_id}: its config.json is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and "
            f"{where}; make it available with `huggingface-cli download {repo_id} config.json` (or `hf download`), "
            "or pass a local path: hf:path/to/config.json (HF_HUB_OFFLINE=1 skips the hub)"
        )
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return ModelLoadError(f"hf:{repo_id}: transformers cannot load its config: {first}")


def _values_hint(arch: str, config) -> str:
    if getattr(config, "_experts_implementation", None) == "eager":
        return (
            'its config asks for experts_implementation "eager", which loops over the experts the router picked '
            "(buffer sizes depend on the routing); drop that key: transformers' default, grouped_mm, has buffers "
            "whose sizes do not depend on the routing"
        )
    return (
        f"transformers' {arch} reads them here (for example an MoE layer that loops over the experts its router "
        "picked, whose buffers depend on the routing), so memest cannot trace this model yet"
    )


def _layerdrop_off(config) -> list[str]:
    """LayerDrop skips each layer of a training step at random (wav2vec2: 0.1): memest traces the step in
    which every layer runs, the most memory a step takes, and says so."""
    notes = []
    for attr in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop"):
        value = getattr(config, attr, None)
        if isinstance(value, float) and value > 0:
            setattr(config, attr, 0.0)
            notes.append(
                f"{attr} {value}: traced with every layer running, the most memory a step takes (a real training "
                f"step skips each layer with probability {value})"
            )
    return notes


# Per hidden element per norm, with 16-bit weights: transformers' RMSNorm classes (explicit ops, LlamaRMSNorm:
# hidden_states.to(float32) ... weight * hidden_states.to(input_dtype)) keep the fp32 up-cast input (4 B) and the
# 16-bit normalized tensor (2 B) for backward; torch's own RMSNorm on CUDA (_fused_rms_norm, derivatives.yaml) keeps
# the 16-bit input alone (2 B, the tensor the layer holds anyway). Measured per saved tensor: benchmarks/llama-layer.md.
RMS_NORM_EXTRA_BYTES = 4
NORMS_PER_DECODER_LAYER = 2  # input_layernorm, post_attention_layernorm


def _rms_norm_note(config) -> list[str]:
    """Trainers that ship their own model code (torchtitan) use torch's fused RMSNorm: say what transformers' norm
    costs more, per token per layer (the trace prices transformers' code, as an hf: model runs it)."""
    hidden = getattr(config, "hidden_size", None)
    if getattr(config, "rms_norm_eps", None) is None or not isinstance(hidden, int):
        return []
    per_token = NORMS_PER_DECODER_LAYER * hidden * RMS_NORM_EXTRA_BYTES
    return [
        f"transformers' RMSNorm keeps an fp32 copy of its input for backward: with bf16 weights about "
        f"{format_bytes(per_token)} per token per un-checkpointed layer more than torch's fused RMSNorm on CUDA, which trainers with their own "
        "model code use (torchtitan's Llama): such a run holds that much less (benchmarks/llama-layer.md)"
    ]


def _weak_ranges():
    from torch.utils.weak import WeakTensorKeyDictionary

    return WeakTensorKeyDictionary()
