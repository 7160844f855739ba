"""The Python API, for notebooks and training scripts:

    import memest
    est = memest.estimate("hf:gpt2", batch=8, seq=1024, optim="adamw", precision="bf16-mixed")
    est = memest.estimate(lambda: MyNet(), inputs=lambda b: (torch.randn(b, 3, 224, 224),), batch=64)
    est.peak_allocated_bytes, est.device_bytes, est.needed_bytes, est.breakdown, est.layers
    est.fits("11GB"), est.verdict("11GB"), est.needed_range, est.to_json()
    est = memest.estimate("hf:gpt2", batch=8, calibration="profiles/h100-cuda13.0-torch2.11.json")
    est = memest.estimate("hf:llama-3.1-8b", seq=2048, precision="bf16", quant="nf4",
                          lora={"r": 16, "alpha": 32, "targets": "all-linear"})   # QLoRA (needs peft)

The same pipeline as the CLI (app layer, estimator.estimate). It runs in the caller's process and
does not hide CUDA devices from torch (the CLI does); it allocates nothing on a GPU either way.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable
from typing import Any

from memest.app import load_calibration, run_serve, user_code
from memest.device.catalogue import DEFAULT_COMPUTE_CAPABILITY, compute_capability
from memest.device.fit import resolve_budget
from memest.errors import MemestError
from memest.report.views import serve_view
from memest.spec import RunSpec
from memest.spec.choices import Target
from memest.spec.config import spec_from_trainer
from memest.spec.options import as_keywords, serve_args, serve_names, step_fields, typed_serve, typed_spec


class _Default:
    """A keyword left out: RunSpec's default, or the from_file= run's value."""

    def __repr__(self) -> str:
        return "<RunSpec's default>"


_DEFAULT: Any = _Default()


def estimate(
    model: str | Callable[[], Any] | None = None,
    inputs: Callable[..., Any] | None = None,
    *,
    batch: int = _DEFAULT,
    seq: int | None = _DEFAULT,
    optim: str = _DEFAULT,
    precision: str = _DEFAULT,
    target: str = _DEFAULT,
    loss: Callable[[Any, Any], Any] | None = None,
    gpu: str | None = None,
    calibration: str | dict | None = None,
    from_file: str | os.PathLike | None = None,
    **options: Any,
):
    """Estimate one training (or inference) step. ``model``: a ``model.py[:factory]`` path, ``hf:NAME``,
    or a zero-argument model factory (then ``inputs`` is required: ``(batch_size[, seq_len]) -> inputs``).
    ``options``: the other RunSpec fields (grad_accum, checkpointing, mode, world_size, shard, ...).
    ``gpu``: the GPU generation to model, by card name (``"a100"``), and the default budget of
    ``fits()``. ``calibration``: a profile file from ``memest calibrate --out`` (or its dict): its
    measured costs replace the defaults, and its GPU generation is modelled unless ``gpu`` names a card.
    ``from_file``: a trainer config (axolotl, LLaMA-Factory, DeepSpeed JSON, ..., as the CLI's ``--from``): the run
    it describes, the keywords given here over it; ``model`` may then be left out (the file names it).
    Returns an estimator.Estimate. Its errors (MemestError) name this call's keywords, not the CLI's flags."""
    where = "memest.estimate(): "
    try:
        return _estimate(model, inputs, batch, seq, optim, precision, target, loss, gpu, calibration, from_file,
                         options, where)
    except MemestError as exc:  # issue 22 item 27; battery 30 #46, #49: was "unknown --rollout 'x'" from rollout='x'
        text = str(exc).removeprefix(where)
        raise type(exc)(where + as_keywords(text)) from None


def _estimate(model, inputs, batch, seq, optim, precision, target, loss, gpu, calibration, from_file, options,
              where: str):
    from memest.estimator import estimate as run

    named = {"batch": batch, "seq": seq, "optim": optim, "precision": precision, "target": target}
    step = typed_spec({**{k: v for k, v in named.items() if v is not _DEFAULT}, **options},
                      where, extra=("model", "inputs", "loss", "gpu", "calibration", "from_file"))
    if from_file is not None:
        model, step = _read_from(from_file, model, step, where)
    elif model is None:
        raise MemestError(f"{where}model: give a model.py path, hf:NAME or a zero-argument factory, or from_file= "
                          "(a trainer config: axolotl, LLaMA-Factory, DeepSpeed JSON, ...)")
    gpu = _card_or_size(gpu, where)
    chosen = step.get("target", RunSpec.target)
    if calibration is not None and Target.parse(chosen, "target") != Target.CUDA:
        raise MemestError(f"{where}calibration= replaces measured CUDA costs; target='{chosen}' has none of them")
    if not isinstance(model, str) and not callable(model):
        raise MemestError(f"{where}model: expected a model.py path, hf:NAME or a zero-argument factory, got {model!r}")
    if isinstance(model, str):
        if inputs is not None or loss is not None:
            raise MemestError("inputs= and loss= go with a model factory; a model file defines its own")
        from memest.sources import load_source

        with user_code(model, quiet_stdout=False):
            source = load_source(model)
        ref = model
    else:
        from memest.sources.callables import callable_source

        source = callable_source(model, inputs, loss)
        ref = source.origin
    profile = None
    if calibration is not None:

        profile = load_calibration(calibration)
    cc = step.pop("compute_capability", None)
    if cc is None:
        named = compute_capability(gpu) if gpu and not gpu[:1].isdigit() else None
        if named and profile and tuple(named) != tuple(profile["compute_capability"]):
            raise MemestError(f"the calibration profile was measured on {profile['gpu_name']}, not a {gpu}; pass a "
                              "profile measured on that card")
        cc = named or (profile["compute_capability"] if profile else None) or DEFAULT_COMPUTE_CAPABILITY
    spec = RunSpec(model=ref, compute_capability=cc, **step)
    with user_code(source.origin or ref, quiet_stdout=False):
        result = run(spec, calibration=profile if spec.target == Target.CUDA else None, source=source)
    result.default_budget = gpu
    return result


def _read_from(path, model, step: dict, where: str) -> tuple[str, dict]:
    """from_file=: the trainer config's run as the CLI's --from reads it (spec.config.spec_from_trainer), the
    keywords given (``step``, and ``model`` when a path) over it. Returns the model and the RunSpec fields."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise MemestError(f"{where}from_file: expected the path of a trainer config, got {path!r}")
    if model is not None and not isinstance(model, str):
        raise MemestError(f"{where}from_file= reads the model from the file; with it, model= is a model.py path or "
                          "hf:NAME (or leave it out), not a factory")
    defaults = {f.name: f.default for f in dataclasses.fields(RunSpec)}
    flags = {name: defaults[name] for name in step_fields("estimate") if name != "model"}
    flags.update(step, model=model)
    given = set(step) | ({"model"} if model is not None else set())
    try:
        _, values = spec_from_trainer(os.fspath(path), flags, given)
    except MemestError as exc:
        text = str(exc).replace("pass one (memest estimate hf:path/config.json --from FILE)",
                                "pass model='hf:path/config.json' beside from_file=")
        raise type(exc)(where + text.replace("--from ", "from_file ")) from None
    return values.pop("model"), values


def serve_capacity(model: str, gpu: str, **options: Any) -> dict:
    """Serving capacity, as ``memest serve`` computes it: ``memest.serve_capacity("hf:llama-3-8b", gpu="h100",
    max_model_len=8192)``. ``options``: max_model_len, utilization, tp, kv_dtype, block_size, max_num_seqs,
    max_num_batched_tokens, engine, cuda_graphs, non_torch_memory (GiB, measured: your vLLM log's non-torch figure),
    calibration (a profile file or dict from `memest calibrate --out`). Returns the command's JSON document as a dict (``kv_tokens``,
    ``blocks``, ``concurrency``, ``sequences``, ``longest_context``, ``verdict``, ``reasons``, ``fixes``, the
    budget steps under ``budget``)."""

    where = "memest.serve_capacity(): "
    try:
        return _serve_capacity(model, gpu, options, where)
    except MemestError as exc:  # its errors name this call's keywords, as memest.estimate's do
        raise type(exc)(where + as_keywords(str(exc).removeprefix(where))) from None


def _serve_capacity(model, gpu, options: dict, where: str) -> dict:
    known = {*serve_names(), "calibration"}
    unknown = sorted(set(options) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(sorted(known))}"
        raise MemestError(f"{where}unknown option(s) {', '.join(unknown)}; {hint}")
    if not isinstance(model, str):
        raise MemestError(f"{where}model: expected hf:NAME or hf:path/config.json, got {model!r}")
    if gpu is None:
        raise MemestError(f"{where}gpu: a card name (h100) or a size (80GB) is required")
    gpu = _card_or_size(gpu, where)
    calibration = options.pop("calibration", None)
    args = {"model": model, **serve_args(typed_serve(options, where))}
    return serve_view(run_serve(args, gpu, calibration=calibration)).doc


def _card_or_size(gpu, where: str) -> str | None:
    """gpu=: a card name or a size, checked now (never a device index: the API models a GPU, it queries none)."""
    if gpu is None:
        return None
    if not isinstance(gpu, str):
        raise MemestError(f"{where}gpu: expected a card name such as 'a100' or a size such as '11GB', got {gpu!r}")
    try:
        resolved = resolve_budget(gpu)
    except MemestError as exc:
        raise MemestError(f"{where}gpu: {exc}") from None
    if isinstance(resolved, int):
        raise MemestError(f"{where}gpu={gpu!r} is a device index; pass a size such as '{gpu.strip()}GB' or a card name")
    return gpu.strip()
