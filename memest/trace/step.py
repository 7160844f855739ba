"""Run the training step on fake tensors under the storage tracker.

The step, as the user's loop writes it (``--outputs``, design.md §7):
    kept (the plain loop: PyTorch tutorial, nanoGPT, minGPT, accelerate's examples):
        out = model(*inputs); loss = compute_loss(out, inputs)
        loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
        -- ``out`` and ``loss`` stay referenced until the next forward / loss reassign them
    freed (HF Trainer's compute_loss, Lightning's training_step, torchtune's ``del logits``):
        out = model(*inputs); loss = compute_loss(out, inputs); del out
        loss.backward(); del loss; optimizer.step(); optimizer.zero_grad(set_to_none=True)
run ``spec.iterations`` times (2 by default: optimizer state exists from the first step on).
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from memest.imports import imports_without_gc
from memest.spec.choices import Mode, Preference, Shard, ZeroGrad
from memest.units import format_count

with imports_without_gc():
    import torch
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedOperatorException,
    )
    from torch.utils._pytree import tree_flatten

    from memest.errors import MemestError, TraceError
    from memest.sources.base import ModelSource, default_loss
    from memest.sources.hf_masks import holds_transformers_model, real_mask_branches
    from memest.spec import RunSpec
    from memest.spec.choices import Outputs
    from memest.trace.data_dependent import explain
    from memest.trace.devices import DeviceRequests, traced_device
    from memest.trace.dtype import HALF, cast_floating
    from memest.trace.empty_cache import recording as recording_empty_cache
    from memest.trace.events import Category, Phase, Trace
    from memest.trace.fake_kernels import OUTPUTS as FAKE_KERNEL_OUTPUTS
    from memest.trace.fake_kernels import real_fake_kernels
    from memest.trace.inference import check_generate, run_generate, run_inference
    from memest.trace.modules import ModuleStack, describe_modules
    from memest.trace.tracker import StorageTracker, TrackerRules, TrackingFakeMode
    from memest.trace.values import PlaceholderScalars


class _FakeMode(TrackingFakeMode):
    """One fake mode per trace, kept when a model deep-copies fake tensors (nn.TransformerEncoder
    clones its layer): Tensor.__deepcopy__ deep-copies each slot, ``fake_mode`` among them."""

    def __deepcopy__(self, memo):
        return self


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def model_dtype(spec: RunSpec) -> torch.dtype:
    return torch.float32 if spec.mixed else DTYPES[spec.precision]


def autocast_dtype(spec: RunSpec) -> torch.dtype:
    """The 16-bit dtype of a mixed-precision step."""
    return HALF[spec.precision]


def autocast_context(spec: RunSpec, device_type: str = "cpu", *, features: Sequence = ()):
    """Autocast for mixed precision. Traces run on CPU tensors; a real GPU run (validation) passes
    device_type="cuda". A feature may replace torch.autocast (the CUDA target's rules on CPU tensors)."""
    if not spec.mixed:
        return contextlib.nullcontext()
    for feature in features:
        if (context := feature.autocast(spec, device_type)) is not None:
            return context
    return torch.autocast(device_type=device_type, dtype=autocast_dtype(spec))


@dataclass
class Built:
    model: torch.nn.Module
    inputs: Any
    checkpointed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the model code did that the report should say
    compiled: Any = None  # the step runs torch.compile'd: a features/compiled.CompileRequest (set by its feature)
    dtype: torch.dtype = torch.float32  # the parameters' dtype (--precision)
    where: str = ""  # the model's name in messages
    lookup: Any = None  # name -> what the model file defines under it (None: not a model file); sources/base.py

    @property
    def runnable(self) -> torch.nn.Module:
        """What a real run calls: the compiled module (the model file's own, or torch.compile(model))."""
        return self.compiled.real_module(self.model) if self.compiled is not None else self.model


def build(source: ModelSource, spec: RunSpec, features: Sequence) -> Built:
    """Build the model and its inputs (in whatever tensor mode is active) in the spec's dtype, with each
    feature's model transforms (StepFeature.build: LoRA, checkpointing, ...), in train or eval mode."""
    seq = spec.seq if spec.seq is not None else source.default_seq
    check_positions(source, spec, seq)
    try:
        model = source.build_model()
    except MemestError:
        raise
    except Exception as exc:
        raise _build_error(source, "building the model", exc) from exc
    if not isinstance(model, torch.nn.Module):
        raise TraceError(f"{source.origin or source.name}: build_model() returned {type(model).__name__}, not a torch.nn.Module")
    if spec.training and next(model.parameters(), None) is None:
        raise TraceError(
            f"{source.origin or source.name}: build_model() returned a {type(model).__name__} with no parameters, so "
            "there is nothing to train; return the module whose parameters the step trains (frozen ones count), "
            "or use --mode inference"
        )
    if spec.training and spec.shard == Shard.ZERO3 and not _trainable(model):
        raise TraceError(
            f"{source.origin or source.name}: every parameter is frozen (requires_grad=False); memest does not "
            "model FSDP (--shard zero3) of a frozen model; use --shard none (each rank holds the whole model)"
        )
    dtype = model_dtype(spec)
    notes = [note] if (note := _own_cast_note(model, dtype)) else []
    if dtype != torch.float32:
        model = cast_floating(model, dtype)
    built = Built(model, None, notes=notes, dtype=dtype, where=source.origin or source.name, lookup=source.lookup)
    for feature in features:
        feature.build(built, spec)
    built.model.train(spec.training)
    try:
        inputs = _inputs(source, spec, seq)
    except MemestError:
        raise
    except Exception as exc:
        error = _build_error(source, f"example_inputs({spec.batch}, {seq})", exc)
        if seq is None:  # no --seq and no default: the model file's example_inputs got seq_len=None
            error = TraceError(f"{error}; no --seq was given and example_inputs has no seq_len default: pass --seq N "
                               "(or give seq_len a default)")
        raise error from exc
    if dtype != torch.float32:
        inputs = _cast_floats(inputs, dtype)
    if spec.mode == Mode.GENERATE and isinstance(inputs, dict):
        inputs = {k: v for k, v in inputs.items() if k != "labels"}  # decoding takes the prompt's ids only
    if spec.mode == Mode.INFERENCE and isinstance(inputs, dict) and "labels" in inputs:
        # the forward of the inputs built, labels kept (issue 22, 25a): dropping them traced a forward the
        # report did not describe (no loss: a batch x seq x vocab log_softmax less) and broke seq2seq heads
        built.notes.append(
            "--mode inference: the forward gets the labels memest built, so the model computes its loss as an "
            "evaluation step does (a causal LM's batch x seq x vocab log-softmax counts); a serving forward "
            "without labels holds less (--mode generate, memest serve)"
        )
    # under the source's trace context: the values it follows (a VLM's ids and image grid, sources/hf_values.py)
    # follow into the batch a feature builds (--preference dpo's attention and completion masks)
    with source.trace_context(spec) if source.trace_context else contextlib.nullcontext():
        for feature in features:
            inputs = feature.inputs(inputs, spec)
    built.inputs = inputs
    return built


def _own_cast_note(model: torch.nn.Module, dtype: torch.dtype) -> str | None:
    """A note when the model code built floating-point parameters in another dtype than float32 (``.half()``,
    ``.to(torch.bfloat16)`` in build_model): memory changes with it, so they are traced as built, unless
    ``--precision bf16/fp16`` (``dtype``) casts every parameter anyway."""
    def name(d: torch.dtype) -> str:
        return str(d).removeprefix("torch.")

    built = {p.dtype for p in model.parameters() if p.is_floating_point()} - {torch.float32}
    if not built or built == {dtype}:
        return None
    then = "traced as built" if dtype == torch.float32 else f"--precision casts them to {name(dtype)}"
    return f"the model code builds {' and '.join(sorted(map(name, built)))} parameters itself (e.g. .half()): {then}"


def check_positions(source: ModelSource, spec: RunSpec, seq: int | None) -> None:
    """Refuse a sequence longer than the model takes (``source.max_seq``: learned position embeddings
    end there; for RoPE models it is the configured maximum, see sources/hf.py). A generation counts
    the prompt and the new tokens: the sequence it produces must have a position for each token."""
    if spec.seq is not None and source.no_seq:
        raise MemestError(
            f"--seq {spec.seq}: {source.name} takes no sequence ({source.no_seq}), so --seq would change nothing; "
            "drop it (--batch sets the step's size)"
        )
    limit = source.max_seq
    if limit is None or seq is None:
        return
    name = source.name
    why = f" ({source.max_seq_why})" if source.max_seq_why else ""
    if spec.mode == Mode.GENERATE:
        total = seq + spec.new_tokens
        if total > limit:
            raise MemestError(
                f"--mode generate: the prompt (--seq {seq}) and --new-tokens {spec.new_tokens} make {total} positions; "
                f"{name} takes at most {limit} positions{why}; use --seq + --new-tokens of {limit} or less"
            )
    elif seq > limit:
        given = f"--seq {seq}: " if spec.seq is not None else ""  # the option named first (check: the YAML key)
        raise MemestError(f"{given}{name} takes at most {limit} positions{why}; use --seq {limit} or less")


def _build_error(source: ModelSource, what: str, exc: Exception) -> TraceError:
    where = source.origin or source.name
    return TraceError(f"{where}: {what} raised {type(exc).__name__}: {_first_line(exc)}{_cuda_hint(exc)}")


# torch's words for "there is no CUDA device here" (CPU-only builds, hidden or absent GPUs, no driver) and
# for CUDA tensors meeting CPU ones; an error that merely mentions "cuda" (an option name) is not one
_NO_CUDA_DEVICE = re.compile(
    r"not compiled with cuda|not linked with support for cuda|no cuda gpus are available|"
    r"no cuda-capable device|nvidia driver|cuda driver|"
    r"torch\.cuda\.is_available\(\) is false|cuda:?\d*,? (and )?cpu\b|\bcpu,? (and )?cuda",
    re.IGNORECASE,
)


def _cuda_hint(exc: Exception) -> str:
    """The hint for errors about an unavailable CUDA device, else ''."""
    if not _NO_CUDA_DEVICE.search(str(exc)):
        return ""
    return (
        " — it calls CUDA itself (torch.cuda.*, a CUDA stream or generator); memest places .cuda(), .to('cuda') and "
        "device='cuda' on its traced device (CPU fake tensors, the GPU modelled by --target cuda) but cannot run "
        "CUDA calls: guard them with torch.cuda.is_available()"
    )


def _sac_mutation_hint(exc: Exception) -> str:
    """The hint for torch's selective-checkpointing check on a saved op output written in place, else ''."""
    if "cached during selective activation checkpoint has been mutated" not in str(exc):
        return ""
    return (
        " — torch's selective checkpointing keeps the outputs of the ops its policy saves and refuses a step that "
        "writes into one in place (torch/utils/checkpoint.py _VersionWrapper); the real run raises the same (measured "
        "on CPU: transformers' Mixtral experts under torchtitan's policy). Use a policy that recomputes that op "
        "(--checkpointing selective:NAME) or --checkpointing blocks"
    )


def _dtensor_mix_hint(exc: Exception) -> str:
    """The hint for a foreach optimizer step over tensor-parallel DTensors mixed with plain parameters, else ''."""
    if "mixed torch.Tensor and DTensor" not in str(exc):
        return ""
    return (
        " — the optimizer's foreach step (torch's default on CUDA; DTensor is among its foreach-supported types, "
        "torch/distributed/tensor/__init__.py) refuses one list of tensor-parallel DTensors and the plain parameters "
        "the TP plan leaves whole (norms, embeddings, a MoE router); a real run with that optimizer is expected to "
        "fail the same way (not run on a GPU here). Layouts with --shard zero3 over dp > 1 ranks trace: FSDP2 makes "
        "every parameter a DTensor"
    )


def _cast_floats(inputs, dtype):
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, inputs)


def call_model(model: torch.nn.Module, inputs: Any):
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


# Micro-steps 2..K of gradient accumulation allocate and free exactly alike (gradients exist and are
# accumulated in place), so the tracer runs two of them; tests compare with real runs of all K.
TRACED_MICRO_STEPS = 2


@dataclass
class LoopState:
    """What the user's loop still references between steps. With --outputs kept (the plain loop) the
    model's output and the loss stay referenced after backward, through the optimizer step and
    zero_grad, until the next forward (and loss) reassign them: the old output is released when the new
    forward has returned, as ``out = model(x)`` releases it. Callers that run several steps pass one
    LoopState to every call; the last step's output is released when the caller drops it."""

    output: Any = None
    loss: Any = None


def run_iteration(
    model, inputs, optimizer, compute_loss, spec: RunSpec, on_phase=None, after=None, device_type: str = "cpu",
    max_micro_steps: int | None = None, loop: LoopState | None = None, *, features: Sequence,
) -> None:
    """One training step: ``spec.grad_accum`` micro-steps (loss / K each; at most ``max_micro_steps``
    run) then one optimizer step. ``on_phase(phase)`` marks phase starts; ``after(phase)`` runs after
    the loss (where a loop that frees outputs drops them), backward and the optimizer step (the tracer
    notes the held output and classifies gradients and state there). ``loop``: the references the
    loop keeps between steps (--outputs kept); a new one when not given. ``features``: the step's features
    (StepFeature.loop around the micro-steps, StepFeature.autocast).

    ``optimizer`` None: no parameter requires grad (a frozen model). Then there is no optimizer step,
    and backward runs only if the loss requires grad (inputs that do): a real ``loss.backward()``
    raises otherwise, so the step a real loop can run is forward + loss."""
    mark = on_phase or (lambda phase: None)
    done = after or (lambda phase: None)
    kept = spec.outputs == Outputs.KEPT
    loop = loop if loop is not None else LoopState()
    micro_steps = spec.grad_accum if max_micro_steps is None else min(spec.grad_accum, max_micro_steps)
    if spec.parallel.pp_enabled:  # a pipeline stage: the schedule runs forward, loss and backward of its micro-batches
        with autocast_context(spec, device_type, features=features):
            model(inputs, mark)  # marks each micro-batch's forward and backward
        done(Phase.BACKWARD)
        mark(Phase.OPTIMIZER)
        optimizer.step()
        done(Phase.OPTIMIZER)
        mark(Phase.ZERO_GRAD)
        optimizer.zero_grad(set_to_none=spec.zero_grad == ZeroGrad.NONE)
        return
    with contextlib.ExitStack() as scopes:
        for feature in features:  # e.g. --loss-head: the LM head and loss replaced
            scopes.enter_context(feature.loop(model, spec))
        for _ in range(micro_steps):
            mark(Phase.FORWARD)
            with autocast_context(spec, device_type, features=features):
                out = call_model(model, inputs)
                if kept:
                    loop.output = out  # `out = model(x)`: the previous output is released only now
                mark(Phase.LOSS)
                loss = compute_loss(out, inputs) if compute_loss else default_loss(out)
                if spec.grad_accum > 1:
                    loss = loss / spec.grad_accum
                if kept:
                    loop.loss = loss
            del out  # --outputs freed: the output goes here, before backward
            done(Phase.LOSS)
            backward = optimizer is not None or loss.requires_grad
            if not backward and spec.freeze:
                raise TraceError(
                    f"--freeze {spec.freeze!r} leaves no parameter trainable and the loss does not require grad: a "
                    "real training step raises at loss.backward(); freeze fewer parameters, or drop --freeze and "
                    "pass --mode inference to estimate the forward alone"
                )
            if backward:
                mark(Phase.BACKWARD)
                loss.backward()
            del loss
            if backward:
                done(Phase.BACKWARD)
        if optimizer is None:
            return
        mark(Phase.OPTIMIZER)
        optimizer.step()
        done(Phase.OPTIMIZER)
        mark(Phase.ZERO_GRAD)
        optimizer.zero_grad(set_to_none=spec.zero_grad == ZeroGrad.NONE)


def run_step(
    model, inputs, optimizer, compute_loss, spec: RunSpec, on_phase=None, after=None, device_type: str = "cpu",
    max_micro_steps: int | None = None, loop: LoopState | None = None, *, features: Sequence,
) -> None:
    """One step of ``spec.mode``: a training step, an inference forward, or a generation. ``loop``: see
    LoopState (pass the same one to every step of a run); ``features``: see run_iteration."""
    if spec.training:
        run_iteration(
            model, inputs, optimizer, compute_loss, spec, on_phase, after, device_type, max_micro_steps, loop,
            features=features,
        )
        return
    mark = on_phase or (lambda phase: None)
    with autocast_context(spec, device_type, features=features):
        if spec.mode == Mode.INFERENCE:
            run_inference(model, inputs, call_model, mark)
        else:
            run_generate(model, inputs, spec, mark)


def tensor_attributes(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(module name, tensor) for each tensor a module holds as a plain attribute (``self.table = ...``), neither
    parameter nor buffer: model state that exists before the step, like buffers (transformers' VideoMAE keeps its
    sinusoid position table so and copies it to the input's device in every forward)."""
    return [(name, t) for name, m in model.named_modules() for t in vars(m).values() if isinstance(t, torch.Tensor)]


def _storage_tensors(obj) -> list[torch.Tensor]:
    return [t for t in tree_flatten(obj)[0] if isinstance(t, torch.Tensor)]


def _storage_ids(tracker: StorageTracker, obj) -> set[int]:
    return {tracker.storage_id(t) for t in _storage_tensors(obj)} - {None}


def trace_step(source: ModelSource, spec: RunSpec, *, features: Sequence) -> Trace:
    """Trace ``spec.iterations`` training steps of ``source`` on fake tensors. Allocates no real
    parameter or activation memory and never touches a GPU. ``features``: the step features of the
    spec (features/registry.features_for), whose hooks run in list order (features/base.py).

    The trace runs in named stages (each below), entered in order on one ExitStack so that every
    hook, patch and mode is undone however a stage ends (the style of torch's mem_tracker)."""
    step = _Step(source, spec, list(features))
    with contextlib.ExitStack() as stages:
        stages.enter_context(_fake_world(step))
        stages.enter_context(_built(step))
        _track_storages(step)
        _register_storages(step)
        stages.enter_context(_step_errors(step))
        stages.enter_context(_instrumented(step))
        _run_iterations(step)
    _classify(step)
    return step.trace


@dataclass
class _Step:
    """What the stages of one trace share (and what the features' hooks read and set)."""

    source: ModelSource
    spec: RunSpec
    features: list
    trace: Trace = field(default_factory=Trace)
    fake_mode: _FakeMode = field(default_factory=lambda: _FakeMode(allow_non_fake_inputs=False))
    # the build stage
    model: Any = None
    inputs: Any = None
    runnable: Any = None  # what the loop calls: the model, or a feature's wrapper of it (DDP)
    wrapper: Any = None  # a wrapper module whose hooks the module stack follows too (DDP, a pipeline stage)
    params: list = field(default_factory=list)  # parameters that require grad
    owner_of_param: dict[int, str] = field(default_factory=dict)
    trainable_count: int = 0  # elements of the parameters that require grad
    optimizer: Any = None
    optimizer_state: Any = None  # () -> {param: state} where the optimizer keeps it elsewhere (ZeRO); else .state
    # the tracking stages
    stack: ModuleStack | None = None
    tracker: StorageTracker | None = None
    devices: DeviceRequests | None = None  # the model code's CUDA requests, placed on the traced device
    loop: LoopState = field(default_factory=LoopState)  # what the user's loop keeps between steps
    held_loss: set = field(default_factory=set)  # storage ids of the kept loss, until its backward ends

    @property
    def where(self) -> str:
        return self.source.origin or self.source.name


@contextlib.contextmanager
def _fake_world(step: _Step):
    """Stage 1: the fake tensor mode everything runs in, the model code's CUDA requests and module
    conversions on it (trace/devices.py), and the features' sessions (--world-size: a fake process group)."""
    with step.fake_mode, traced_device() as step.devices, contextlib.ExitStack() as sessions:
        for feature in step.features:
            sessions.enter_context(feature.session(step.spec))
        yield


@contextlib.contextmanager
def _built(step: _Step):
    """Stage 2: model and inputs (weight init reading values gets placeholders), the features' preparation
    (the data-parallel wrapper, a compiled forward), module records and owners, parameter counts and the
    optimizer; all dropped at exit."""
    trace, spec = step.trace, step.spec
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with PlaceholderScalars():  # weight init may read values (trunc_normal_'s rejection loop)
            built = build(step.source, spec, step.features)
            step.model, step.inputs = built.model, built.inputs
            trace.checkpointed = built.checkpointed
            trace.notes += built.notes
            trace.model_type = type(step.model).__name__
            step.runnable = step.model
            prepared = [context for feature in step.features if (context := feature.prepare(step)) is not None]
    model = step.model
    step.owner_of_param = describe_modules(model, trace)
    step.params = [p for p in model.parameters() if p.requires_grad]
    trace.param_count = sum(logical_numel(p) for p in model.parameters())
    trace.param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    step.trainable_count = trace.trainable_count = sum(p.numel() for p in step.params)
    step.optimizer = next((opt for feature in step.features if (opt := feature.optimizer(step)) is not None), None)
    if spec.mode == Mode.GENERATE:
        check_generate(model, step.inputs)
    try:
        with contextlib.ExitStack() as contexts:  # e.g. torch.compile: the step runs the compiled forward
            for context in prepared:
                contexts.enter_context(context)
            yield
    finally:
        step.model = step.inputs = step.runnable = step.wrapper = step.optimizer = step.optimizer_state = None
        step.params = []
        step.loop = LoopState()  # the last step's output, held by the loop, goes with the model


def _track_storages(step: _Step) -> None:
    """Stage 3: the module stack (following a wrapper's hooks too: DTensor shards, DDP's gradient buckets)
    and the storage tracker, with the kernel rules of the fake kernels and of every feature."""
    step.stack = ModuleStack(step.model, step.trace, wrapper=step.wrapper)
    # both targets: autograd's subclass-only paths; then each feature's (a target's kernels, --data-dependent)
    rules = [TrackerRules(outputs=FAKE_KERNEL_OUTPUTS)] + [feature.rules(step) for feature in step.features]
    step.tracker = StorageTracker(step.trace, step.stack.current, step.fake_mode, rules)


def _register_storages(step: _Step) -> None:
    """Stage 4: what exists before the step: the features' buffers (DDP's gradient buckets), parameters
    (owned by their module), buffers and plain tensor attributes, inputs."""
    tracker, trace, owner = step.tracker, step.trace, step.owner_of_param
    for feature in step.features:
        feature.register(step)
    for p in step.model.parameters():
        sid = tracker.register(p, Category.PARAMETERS, "parameter", module=owner[id(p)])
        if sid is not None:
            trace.owner_module[sid] = owner[id(p)]
    for name, b in step.model.named_buffers():
        tracker.register(b, Category.BUFFERS, "buffer", module=name.rpartition(".")[0])
    # held like buffers, but model.to(device) leaves them where they were made (nn.Module._apply moves parameters
    # and buffers): counted as device memory, the safe side (a model that keeps one on the host holds less)
    for name, t in tensor_attributes(step.model):
        tracker.register(t, Category.BUFFERS, "tensor attribute", module=name)
    for t in _storage_tensors(step.inputs):
        tracker.register(t, Category.INPUTS, "input", module="")


@contextlib.contextmanager
def _step_errors(step: _Step):
    """Stage 5: a failing step becomes one TraceError that says where it failed and what to change
    (entered outside the instrumentation, so hooks are gone when the message is made)."""
    try:
        yield
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        where = _where(step.stack, step.tracker)
        raise TraceError(f"{step.where}: {explain(where, _op_name(exc), step.source.values_hint)}") from exc
    except UnsupportedOperatorException as exc:
        raise TraceError(
            f"{step.where}: op {_op_name(exc)} has no fake-tensor implementation, so memest "
            "cannot trace it; replace it with standard torch ops or register a fake kernel (torch.library)"
        ) from exc
    except MemestError:
        raise
    except Exception as exc:
        fix = _cuda_hint(exc) or _sac_mutation_hint(exc) or _dtensor_mix_hint(exc) or _phase_hint(step)
        raise TraceError(
            f"{step.where}: {_where(step.stack, step.tracker)} raised {type(exc).__name__}: "
            f"{_first_line(exc)}{fix}"
        ) from exc


@contextlib.contextmanager
def _instrumented(step: _Step):
    """Stage 6: while the step runs: the source's context (transformers' mask branches, also for a
    transformers model that a model file builds), the module stack, the tracker, the model code's
    torch.cuda.empty_cache() calls recorded (trace/empty_cache.py), the features' contexts
    (--target cuda: SDPA backends, autocast rules also in backward, where checkpointing replays the forward;
    data-parallel instrumentation), and the saved-tensor hook that marks activations."""
    spec, tracker = step.spec, step.tracker

    def mark_saved(t: torch.Tensor):
        sid = tracker.storage_id(t)
        if sid is not None:
            step.trace.storages[sid].saved_for_backward = True
        # a detached alias (same storage): an op's saved output packed as itself would hold its own
        # grad_fn, a cycle through C++ that keeps the node and all it saved alive after the real step
        # frees them (an output the model computes and drops)
        return t.detach() if t.grad_fn is not None else t

    pack, unpack = _saved_hooks(step, mark_saved)
    with contextlib.ExitStack() as hooks:
        hooks.enter_context(_quiet_fake_tensor_log())
        hooks.enter_context(real_fake_kernels())
        if step.source.trace_context:
            hooks.enter_context(step.source.trace_context(spec))
        elif holds_transformers_model(step.model):  # a transformers model built by a model file
            hooks.enter_context(real_mask_branches())
        hooks.enter_context(step.stack)
        hooks.enter_context(tracker)
        # torch.cuda.empty_cache() in model code: recorded for the allocator replay, no device touched
        hooks.enter_context(recording_empty_cache(step.trace, lambda: (tracker.iteration, _where(step.stack, tracker))))
        for feature in step.features:
            for context in feature.contexts(step):
                hooks.enter_context(context)
        hooks.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
        yield


def _saved_hooks(step: _Step, mark_saved):
    """autograd's pack and unpack hooks: the activation mark, then the features' own (StepFeature.pack, in order;
    unpack in reverse) for the features that pack saved tensors (``packs_saved``)."""
    own = [feature for feature in step.features if feature.packs_saved]
    if not own:
        return mark_saved, lambda t: t

    def pack(t):
        packed = mark_saved(t)
        for feature in own:
            packed = feature.pack(step, packed)
        return packed

    def unpack(packed):
        for feature in reversed(own):
            packed = feature.unpack(step, packed)
        return packed

    return pack, unpack


def _run_iterations(step: _Step) -> None:
    """Stage 7: ``spec.iterations`` steps; gradients and optimizer state are classified as they appear."""
    spec, tracker = step.spec, step.tracker
    for it in range(1, spec.iterations + 1):
        step.stack.record_outputs = it == 1
        run_step(
            step.runnable,
            step.inputs,
            step.optimizer,
            step.source.compute_loss,
            spec,
            on_phase=lambda phase, it=it: tracker.set_phase(it, phase),
            after=lambda phase: _classify_after(step, phase),
            max_micro_steps=TRACED_MICRO_STEPS,
            loop=step.loop,
            features=step.features,
        )


def _classify_after(step: _Step, phase: Phase) -> None:
    """After the loss: the output the loop keeps (--outputs kept), from the point where a loop that
    frees it would have; after backward: the gradients; after the optimizer step: its state (owned by
    the parameter's module); then each feature's ``after``."""
    tracker, trace, owner = step.tracker, step.trace, step.owner_of_param
    if phase is Phase.LOSS:
        if step.loop.output is not None:
            # the loss (HF outputs carry it) is held through backward by either loop: it counts from there on
            step.held_loss = _storage_ids(tracker, step.loop.loss)
            held = _storage_ids(tracker, step.loop.output) - step.held_loss
            trace.held_outputs.append((len(trace.events), sorted(held)))
    elif phase is Phase.BACKWARD:
        if step.held_loss:
            trace.held_outputs.append((len(trace.events), sorted(step.held_loss)))
            step.held_loss = set()
        for p in step.params:
            if p.grad is not None:
                _own(tracker, trace, p.grad, Category.GRADIENTS, owner[id(p)])
    elif phase is Phase.OPTIMIZER:
        state_of = step.optimizer_state() if step.optimizer_state is not None else step.optimizer.state
        for p, state in state_of.items():
            for t in _storage_tensors(state):
                _own(tracker, trace, t, Category.OPTIMIZER_STATE, owner.get(id(p), ""))
    for feature in step.features:
        feature.after(step, phase)


def _classify(step: _Step) -> None:
    """Stage 8, after the step: the features' notes (attention backends chosen, kernels modelled),
    temporaries saved for backward are activations, and the storages the features keep in host memory
    (--offload, paged optimizer state) split from the device's."""
    trace, spec = step.trace, step.spec
    if spec.training and step.trainable_count < trace.param_count:
        trace.notes.append(_frozen_note(trace, step.trainable_count))
    if devices := step.devices.note(spec.target):
        trace.notes.append(devices)
    for feature in step.features:
        trace.notes.extend(feature.finish(step))
    for rec in trace.storages:
        if rec.saved_for_backward and rec.category is Category.TEMPORARIES:
            rec.category = Category.ACTIVATIONS
    for feature in step.features:
        for sid in feature.host(trace, spec):
            trace.storages[sid].host = True
    trace.split_host()  # nothing to split unless a storage is host memory


def logical_numel(p: torch.Tensor) -> int:
    """Elements of the weight a parameter stores (a 4-bit packed weight holds two per byte: features/quant.py)."""
    return getattr(p, "logical_numel", None) or p.numel()


def _trainable(model: torch.nn.Module) -> bool:
    return any(p.requires_grad for p in model.parameters())


def _frozen_note(trace: Trace, trainable: int) -> str:

    frozen = trace.param_count - trainable
    if trainable:
        return (
            f"{format_count(frozen)} of {format_count(trace.param_count)} parameters frozen (requires_grad=False): "
            f"gradients and optimizer state for the {format_count(trainable)} trainable ones only"
        )
    if any(phase is Phase.BACKWARD for _, _, phase in trace.phase_marks):
        return "every parameter is frozen (requires_grad=False): backward runs for the inputs that require grad; no optimizer step"
    return (
        "every parameter is frozen (requires_grad=False) and the loss does not require grad: traced forward + loss "
        "only, without backward or optimizer step (a real loss.backward() raises here); --mode inference traces "
        "the forward without autograd"
    )


@contextlib.contextmanager
def _quiet_fake_tensor_log():
    """FakeTensorMode logs a traceback when a meta kernel rejects its inputs; memest reports the
    error itself, in one line."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _own(tracker: StorageTracker, trace: Trace, t: torch.Tensor, category: Category, module: str) -> None:
    sid = tracker.storage_id(t)
    if sid is not None:
        trace.storages[sid].classify(category)
        trace.owner_module[sid] = module


def _phase_hint(step: _Step) -> str:
    """What to check for a failure in this phase: the inputs for the forward, compute_loss (or what the forward
    returns) for the loss; after the loss the inputs are not the cause."""
    phase = step.tracker.phase if step.tracker is not None else Phase.FORWARD
    if phase in (Phase.SETUP, Phase.FORWARD, Phase.DECODE):
        return f"; {step.source.inputs_hint}"
    if phase == Phase.LOSS:
        if step.source.compute_loss is not None:
            return "; check that compute_loss(output, inputs) matches what the model's forward returns"
        return ("; memest takes output.loss, else the mean of the output's first floating-point tensor: return one "
                "from forward, or define compute_loss(output, inputs) in the model file")
    return "; it failed after the loss, in the model's own backward or optimizer code (--debug shows the traceback)"


def _where(stack: ModuleStack, tracker: StorageTracker) -> str:
    """'the forward of module blocks.0.attn' — where a failing step was."""
    phase = {Phase.LOSS: "compute_loss", Phase.OPTIMIZER: "optimizer.step()"}.get(tracker.phase, f"the {tracker.phase.value}")
    module = stack.current()
    return f"{phase} of module {module!r}" if module and tracker.phase in (Phase.FORWARD, Phase.BACKWARD) else phase


def _op_name(exc: Exception) -> str:
    func = getattr(exc, "func", None)
    return str(func) if func is not None else type(exc).__name__


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _inputs(source, spec, seq):
    """The step's inputs: the source's example_inputs, or with --images its vision-language inputs. --preference dpo
    on a vision-language model: its 2 x --batch rows (chosen, then rejected), built as one batch so the image grid's
    real values follow (sources/hf_values.py); trl's DataCollatorForVisionPreference processes the images and prompts
    twice (trl 1.16.0, dpo_trainer.py:306, :317), and features/preference.py's batch keeps them."""
    batch = spec.batch * (2 if spec.preference == Preference.DPO and source.image_facts is not None else 1)
    if not (spec.images or spec.video_frames):
        return source.example_inputs(batch, seq)
    flag = "--images" if spec.images else "--video-frames"
    if source.image_inputs is None:
        raise TraceError(
            f"{flag}: {source.origin or source.name} is not a vision-language model memest builds image inputs for "
            f"(hf: LLaVA, LLaVA-NeXT, Qwen2-VL and Qwen2.5-VL configs); its inputs are its own (drop {flag})"
        )
    hw = spec.input_hw
    return source.image_inputs(batch, seq, spec.images, hw, **spec.vision_options)
