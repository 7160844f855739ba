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

from collections.abc import Callable
from typing import Any

from memest.app import load_calibration, run_serve, user_code
from memest.device.catalogue import DEFAULT_COMPUTE_CAPABILITY, compute_capability
from memest.errors import MemestError
from memest.report.views import serve_view
from memest.spec import RunSpec
from memest.spec.choices import Target
from memest.spec.options import serve_args, serve_names


def estimate(
    model: str | Callable[[], Any],
    inputs: Callable[..., Any] | None = None,
    *,
    batch: int = RunSpec.batch,
    seq: int | None = RunSpec.seq,
    optim: str = RunSpec.optim,
    precision: str = RunSpec.precision,
    target: str = RunSpec.target,
    loss: Callable[[Any, Any], Any] | None = None,
    gpu: str | None = None,
    calibration: str | dict | None = None,
    **options: Any,
):
    """Estimate one training (or inference) step. ``model``: a ``model.py[:factory]`` path, ``hf:NAME``,
    or a zero-argument model factory (then ``inputs`` is required: ``(batch_size[, seq_len]) -> inputs``).
    ``options``: the other RunSpec fields (grad_accum, checkpointing, mode, world_size, shard, ...).
    ``gpu``: the GPU generation to model, by card name (``"a100"``), and the default budget of
    ``fits()``. ``calibration``: a profile file from ``memest calibrate --out`` (or its dict): its
    measured costs replace the defaults, and its GPU generation is modelled unless ``gpu`` names a card.
    Returns an estimator.Estimate."""
    from memest.estimator import estimate as run

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
    cc = options.pop("compute_capability", None)
    if cc is None:
        named = compute_capability(gpu) if gpu and not gpu[:1].isdigit() else None
        if named and profile and tuple(named) != tuple(profile["compute_capability"]):
            raise MemestError(f"the calibration profile was measured on {profile['gpu_name']}, not a {gpu}; pass a "
                              "profile measured on that card")
        cc = named or (profile["compute_capability"] if profile else None) or DEFAULT_COMPUTE_CAPABILITY
    spec = RunSpec(model=ref, batch=batch, seq=seq, optim=optim, precision=precision, target=target,
                   compute_capability=cc, **options)
    with user_code(source.origin or ref, quiet_stdout=False):
        result = run(spec, calibration=profile if spec.target == Target.CUDA else None, source=source)
    result.default_budget = gpu
    return result


def serve_capacity(model: str, gpu: str, **options: Any) -> dict:
    """Serving capacity, as ``memest serve`` computes it: ``memest.serve_capacity("hf:llama-3-8b", gpu="h100",
    max_model_len=8192)``. ``options``: max_model_len, utilization, tp, kv_dtype, block_size, max_num_seqs,
    max_num_batched_tokens, engine, cuda_graphs, non_torch_memory (GiB, measured: your vLLM log's non-torch figure),
    calibration (a profile file or dict from `memest calibrate --out`). Returns the command's JSON document as a dict (``kv_tokens``,
    ``blocks``, ``concurrency``, ``sequences``, ``longest_context``, ``verdict``, ``reasons``, ``fixes``, the
    budget steps under ``budget``)."""

    known = {*serve_names(), "calibration"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise MemestError(f"memest.serve_capacity(): unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    calibration = options.pop("calibration", None)
    args = {"model": model, **serve_args(options)}
    return serve_view(run_serve(args, gpu, calibration=calibration)).doc
