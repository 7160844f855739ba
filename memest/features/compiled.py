"""``torch.compile``: the compiled training step, traced on fake tensors.

A compiled step allocates differently from the eager one. AOTAutograd traces forward and backward as one
joint graph and Inductor's partitioner (``min_cut_rematerialization_partition``,
torch/_functorch/partitioners.py, after Inductor's joint-graph passes) chooses what the forward saves: a min
cut that recomputes cheap ops in backward rather than saving their outputs, within
``torch._functorch.config.activation_memory_budget``. Inductor then fuses the graph's ops into kernels: an
intermediate inside a fused kernel never exists; each kernel's output is a buffer the generated wrapper code
allocates (``empty_strided_cpu``), hands to the next kernels, reuses for a later buffer of the same size
(``config.allow_buffer_reuse``) and frees after its last use (``del buf``).

memest traces that step by running Inductor itself on its fake tensors: dynamo captures the model's forward,
``torch._inductor.compile_fx.compile_fx`` runs its whole pipeline (pre-grad passes, AOTAutograd with its
decompositions, joint-graph passes and partitioner, lowering, scheduling and fusion, wrapper code), with the
C++ kernels left uncompiled (:func:`inductor_without_kernels`). The wrapper code then runs on the tracked fake
tensors: every buffer Inductor plans is allocated and freed where the real run does, extern kernels (GEMMs,
SDPA) run their fake kernels, fused kernels are no-ops, and the tensors the compiled forward saves are marked
by the saved-tensor hooks like the eager ones. Measured against real Inductor runs on CPU (tests/test_compile.py):
exact on a nanoGPT-style GPT and an MLP, both loops, with activation_memory_budget 1 and 0.5.

What stays approximate (the report says so): a fused C++ kernel's own scratch outside torch's allocator (not
seen by torch.profiler either); for ``--target cuda`` the graphs are lowered for CPU tensors (C++ kernels and
CPU fusion rules, where a GPU run generates Triton kernels; CUDA graphs of ``mode="reduce-overhead"`` not
modelled); autotuning options (``max-autotune``) are dropped. Other backends: ``aot_eager_decomp_partition``
and ``aot_eager`` run their own partitions op by op as they do for real; ``eager`` and unknown backends are
traced eager.

Model files that return ``torch.compile(model)`` (nanoGPT compiles by default) are unwrapped here
(``OptimizedModule._orig_mod``) with their compile options; ``--compile`` compiles an eager model the way
``torch.compile(model)`` does (Inductor, default options); ``--no-compile`` traces a compiling file eager. The
real CPU ground truth (validate/cpu_truth.py) runs the identical loop with the real ``torch.compile``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

from memest.errors import MemestError, TraceError
from memest.features.base import StepFeature
from memest.features.checkpointing import repeated_blocks
from memest.spec.choices import CompileScope, LossHead, Shard, Target
from memest.trace.tracker import TrackingFakeMode

# torch's own AOTAutograd debugging backends (torch/_dynamo/backends/debugging.py): their graphs run op by op
# (boxed_nop), so memest runs them as registered, on its fake tensors; aot_eager_decomp_partition uses Inductor's
# decompositions and partitioner, aot_eager the min-cut partitioner without them, aot_eager_default_partitioner
# the default partition (what eager autograd would save, after functionalization)
OP_BY_OP_BACKENDS = ("aot_eager", "aot_eager_decomp_partition", "aot_eager_default_partitioner")
EAGER_BACKENDS = ("eager",)


@dataclass
class CompileRequest:
    """How the step is compiled: the backend's name, Inductor config options (``torch.compile(options=,
    mode=)``), ``dynamic`` / ``fullgraph``, and who asked (the model file or ``--compile``)."""

    backend: str = "inductor"
    inductor_config: dict[str, Any] = field(default_factory=dict)
    dynamic: bool | None = None
    fullgraph: bool = False
    by: str = "--compile"
    compiled_module: Any = None  # the model file's own OptimizedModule (the real run uses it as is)
    compiled_call_impl: Any = None  # the model file's ``model.compile()`` (in place), taken off for the trace
    scope: CompileScope = CompileScope.STEP  # blocks: each repeated block compiled in place (torchtitan)

    @property
    def traced_eager(self) -> bool:
        """dynamo's ``eager`` backend runs the model's own ops; other backends memest does not model are traced eager."""
        return self.backend != "inductor" and self.backend not in OP_BY_OP_BACKENDS

    @property
    def options(self) -> dict[str, Any]:
        return {"options": self.inductor_config} if self.backend == "inductor" and self.inductor_config else {}

    def real_module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module a real run calls: the model file's OptimizedModule, or ``torch.compile(model)``; for
        ``--compile-scope blocks`` the model with each repeated block compiled in place, as torchtitan 0.3.0's
        ``apply_compile`` does (torchtitan/distributed/compile.py: ``transformer_block.compile(backend=backend,
        fullgraph=True)``, after activation checkpointing wrapped the block and before FSDP2 shards it)."""
        if self.scope is CompileScope.BLOCKS:
            for block in compiled_blocks(model):
                block.compile(backend=self.backend, dynamic=self.dynamic, fullgraph=True, **self.options)
            return model
        if self.compiled_module is not None and self.compiled_module._orig_mod is model:
            return self.compiled_module
        if self.compiled_call_impl is not None:  # model.compile(): compiled in place, as the model file left it
            model._compiled_call_impl = self.compiled_call_impl
            return model
        return torch.compile(model, backend=self.backend, dynamic=self.dynamic, fullgraph=self.fullgraph, **self.options)


def compiled_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules ``--compile-scope blocks`` compiles: the repeated blocks (features/checkpointing.py's
    ``repeated_blocks``, the blocks ``--checkpointing blocks`` wraps; torchtitan's ``model.layers``)."""
    modules = dict(model.named_modules())
    names = repeated_blocks(model)
    if not names:
        raise TraceError(
            "--compile-scope blocks: the model has no repeated blocks (an nn.ModuleList, or an nn.Sequential of blocks, "
            "of same-class modules) to compile one by one; use --compile-scope step"
        )
    return [modules[name] for name in names]


def is_compiled(model: Any) -> bool:
    """Whether ``model`` is ``torch.compile(module)``'s OptimizedModule (dynamo is loaded once anything compiled)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def _backend_of(dynamo_ctx) -> Any:
    """The backend object ``torch.compile`` was given, under dynamo's wrappers (CatchErrorsWrapper ->
    ConvertFrame -> WrapBackendDebug -> the backend, each keeping the next in ``_torchdynamo_orig_backend``,
    torch/_dynamo/convert_frame.py)."""
    backend = dynamo_ctx.callback
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    return backend


def _dynamo_ctx_of(fn) -> Any:
    """The OptimizeContext of a function ``torch.compile`` returned (``nn.Module.compile()`` keeps one in
    ``_compiled_call_impl``): it is in the wrapper's closure (torch/_dynamo/eval_frame.py, ``_fn``)."""
    for cell in getattr(fn, "__closure__", None) or ():
        contents = cell.cell_contents
        if hasattr(contents, "callback") and hasattr(contents, "fullgraph"):
            return contents
    return None


def unwrap(model: Any) -> tuple[Any, CompileRequest | None]:
    """A model file's ``torch.compile(model)`` or ``model.compile()``: the module and how it was compiled.
    ``model.compile()`` is taken off the module for the trace (``real_module`` puts it back)."""
    if is_compiled(model):
        request = _request(model.dynamo_ctx, "the model file (torch.compile)")
        request.compiled_module = model
        return model._orig_mod, request
    impl = getattr(model, "_compiled_call_impl", None)
    if isinstance(model, torch.nn.Module) and impl is not None:
        ctx = _dynamo_ctx_of(impl)
        request = _request(ctx, "the model file (model.compile())") if ctx is not None else CompileRequest(
            by="the model file (model.compile(); backend not found, Inductor assumed)")
        request.compiled_call_impl = impl
        model._compiled_call_impl = None
        return model, request
    return model, None


def _request(dynamo_ctx, by: str) -> CompileRequest:
    backend = _backend_of(dynamo_ctx)
    name = getattr(backend, "compiler_name", None) or getattr(backend, "__name__", None) or type(backend).__name__
    return CompileRequest(
        backend=str(name),
        inductor_config=dict(getattr(backend, "config", {}) or {}),
        dynamic=getattr(backend, "dynamic", None),
        fullgraph=bool(getattr(dynamo_ctx, "fullgraph", False)),
        by=by,
    )


def _trace_backend(request: CompileRequest):
    """The dynamo backend of the traced step.

    Inductor: Inductor itself (``torch._inductor.compile_fx.compile_fx``: its pre-grad passes, AOTAutograd
    with its decompositions, joint-graph passes and min-cut partitioner, lowering, fusion, buffer reuse and
    the generated wrapper code), with the C++ kernels left uncompiled (:func:`inductor_without_kernels`):
    the wrapper allocates each buffer Inductor plans (``empty_strided_cpu``, extern kernels' outputs) on the
    tracked fake tensors, frees it where Inductor does (``del buf``), and its fused kernels are no-ops.
    torch's AOTAutograd debugging backends (OP_BY_OP_BACKENDS): themselves, as registered."""
    if request.backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        options = _inductor_options(request.inductor_config)
        return lambda gm, example_inputs: compile_fx(gm, example_inputs, config_patches=options)
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(request.backend)


def _inductor_options(config: dict[str, Any]) -> dict[str, Any]:
    """The user's Inductor options (``torch.compile(options=, mode=)``) that exist in this torch's config."""
    from torch._inductor import config as inductor_config

    return {
        k: v for k, v in config.items()
        if hasattr(inductor_config, k.split(".")[0]) and not k.startswith(_AUTOTUNE) and not k.startswith("triton.cudagraph")
    }


# Inductor options whose effect memest does not trace: autotuning benchmarks compiled kernels (none are compiled in a
# fake compile) and picks GEMM templates by measured time; memest traces Inductor's default (extern) kernels
_AUTOTUNE = ("max_autotune", "coordinate_descent_tuning")


def _no_kernel(*args, **kwargs) -> None:
    """A fused kernel's call in the traced step: its buffers are allocated by the wrapper, it computes nothing."""


def _kernel_stub(self, *args, **kwargs):
    return _no_kernel


def _reinterpret_tensor(base, size, stride, offset=0):
    """torch._C._dynamo.guards._reinterpret_tensor (torch/csrc/dynamo/guards.cpp: a view of ``base``'s storage
    at ``base.storage_offset() + offset``), as a view torch's fake mode can make."""
    return base.as_strided(size, stride, base.storage_offset() + offset)


def _empty_strided(device: str):
    def empty(size, stride, dtype):
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty


@contextlib.contextmanager
def inductor_without_kernels():
    """Inductor compiles the traced step's graphs into its wrapper code, without compiling kernels:

    - ``AsyncCompile.cpp`` / ``cpp_pybinding`` (torch/_inductor/async_compile.py) return a no-op for each fused
      C++ kernel (the buffers it writes are allocated by the wrapper before the call);
    - the wrapper's allocators, bound from ``torch._C._dynamo.guards`` when the wrapper module loads, allocate
      through the dispatcher (C++ ``_empty_strided_cpu`` would make a real tensor outside the fake mode) and
      views stay fake tensors; ``assert_alignment`` reads a data pointer a fake tensor has not: skipped;
    - ``config.cpp.vec_isa_ok`` and ``VecISA.check_build`` skip Inductor's gcc probes of the CPU's vector ISA
      (they choose kernel instructions, not buffers);
    - no cache is read or written (``force_disable_caches``), and the wrapper modules and ISA answers made here
      are dropped on exit, so a real compile in the same process (the CPU ground truth) compiles for real."""
    from unittest import mock

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.async_compile import AsyncCompile

    guards = torch._C._dynamo.guards
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(AsyncCompile, "cpp", _kernel_stub))
        stack.enter_context(mock.patch.object(AsyncCompile, "cpp_pybinding", _kernel_stub))
        stack.enter_context(mock.patch.object(guards, "_empty_strided_cpu", _empty_strided("cpu")))
        stack.enter_context(mock.patch.object(guards, "_reinterpret_tensor", _reinterpret_tensor))
        stack.enter_context(mock.patch.object(guards, "assert_alignment", _no_kernel))
        stack.enter_context(mock.patch.object(cpu_vec_isa.VecISA, "check_build", lambda self, code: True))
        stack.enter_context(
            inductor_config.patch({"force_disable_caches": True, "compile_threads": 1, "cpp.vec_isa_ok": True})
        )
        stack.callback(_drop_inductor_state)
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # force_disable_caches, asked for above
        yield


def _drop_inductor_state() -> None:
    """Forget the wrapper modules and CPU ISA answers of a fake compile (see inductor_without_kernels)."""
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codecache import PyCodeCache

    PyCodeCache.cache_clear(purge=False)
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for cls in [cpu_vec_isa.VecISA, *_subclasses(cpu_vec_isa.VecISA)]:
        for name in ("__bool__", "_VecISA__bool__impl"):
            cached = cls.__dict__.get(name)
            if hasattr(cached, "cache_clear"):
                cached.cache_clear()


def _subclasses(cls) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


_HOOK_DICTS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks",
)


@contextlib.contextmanager
def _without_global_module_hooks():
    """memest's module tracking (torch's ModTracker: global module hooks) off inside the compiled region:
    dynamo would trace the hooks and break the graph at each module, where the user's compiled step is
    one graph. The compiled region's allocations are attributed to the module that calls it."""
    from torch.nn.modules import module as nn_module

    saved = {name: dict(getattr(nn_module, name)) for name in _HOOK_DICTS}
    for name in _HOOK_DICTS:
        getattr(nn_module, name).clear()
    try:
        yield
    finally:
        for name, hooks in saved.items():
            getattr(nn_module, name).update(hooks)


class CompiledForward:
    """The traced model's forward, compiled by dynamo with :func:`_trace_backend`; installed as the
    module's ``forward`` (instance attribute) for the step and removed after it."""

    def __init__(self, model: torch.nn.Module, request: CompileRequest) -> None:
        self.model = model
        self.request = request
        forward = type(model).forward.__get__(model)
        if request.traced_eager:
            self._compiled = forward
        else:
            self._compiled = torch.compile(
                forward, backend=_trace_backend(request), dynamic=request.dynamic, fullgraph=request.fullgraph
            )

    def __call__(self, *args, **kwargs):
        with _without_global_module_hooks():
            return self._compiled(*args, **kwargs)


class CompiledBlock:
    """One repeated block's ``_call_impl`` compiled by dynamo with :func:`_trace_backend` and ``fullgraph=True``,
    installed as the block's ``_compiled_call_impl`` (what ``nn.Module.compile()`` sets: ``Module.__call__`` then
    calls it) for the step and removed after it. The block's call runs inside the compiled region, with its
    wrappers (a checkpoint wrapper around its forward is compiled with it, as torchtitan's order has it)."""

    def __init__(self, block: torch.nn.Module, request: CompileRequest, backend) -> None:
        # one backend object for every block, as the real run's backend="inductor": dynamo guards on the backend's
        # identity (BACKEND_MATCH), so a backend per block would recompile the shared _call_impl once per block
        self._compiled = torch.compile(block._call_impl, backend=backend, dynamic=request.dynamic, fullgraph=True)

    def __call__(self, *args, **kwargs):
        from torch._dynamo.exc import FailOnRecompileLimitHit

        with _without_global_module_hooks():
            try:
                return self._compiled(*args, **kwargs)
            except FailOnRecompileLimitHit as exc:
                raise MemestError(recompile_limit_message()) from exc


def recompile_limit_message() -> str:
    """Why ``--compile-scope blocks`` stopped: dynamo compiles every block from the same code (``Module._call_impl``)
    and recompiles it when a guard differs between blocks; past ``torch._dynamo.config.recompile_limit`` a
    ``fullgraph=True`` compile fails, in the real run as here (checked on a 10-layer transformers Llama, torch 2.13,
    run with ``use_cache=True``: each block updates the forward's DynamicCache at its own ``layer_idx``; memest's
    ``hf:`` training traces run with ``use_cache=False``, sources/hf.py)."""
    import torch._dynamo.config as dynamo_config

    return ("--compile-scope blocks: dynamo recompiled the blocks' shared forward once per block (a guard differs "
            "between the blocks, e.g. an int attribute such as a layer index that the forward branches or indexes "
            f"on) and hit torch._dynamo.config.recompile_limit ({dynamo_config.recompile_limit}) under "
            "fullgraph=True; the real block.compile(fullgraph=True) fails the same way. Make the blocks' forwards "
            "alike, or use --compile-scope step")


def _install_block_compiles(model: torch.nn.Module, request: CompileRequest, stack: contextlib.ExitStack) -> None:
    backend = _trace_backend(request)
    for block in compiled_blocks(model):
        block._compiled_call_impl = CompiledBlock(block, request, backend)
        stack.callback(setattr, block, "_compiled_call_impl", None)


@contextlib.contextmanager
def _ddp_optimizer_outside_tracking_modes():
    """Blocks compiled inside DDP's forward (--shard none/zero1 with --compile-scope blocks): dynamo's frame callback
    sees the active DDP module (``DistributedDataParallel._get_active_ddp_module()``, set by DDP's forward) and, with
    ``torch._dynamo.config.optimize_ddp`` at its default "ddp_optimizer" (torchtitan's apply_ddp sets it so when compiling),
    hands the frame to a clone of itself whose backend is ``DDPOptimizer.compile_fn`` (torch/_dynamo/convert_frame.py,
    ``CatchErrorsWrapper.__call__``; torch/_dynamo/backends/distributed.py), which splits each graph at DDP's bucket
    boundaries and compiles each piece with the real backend. Unlike the ordinary path, that clone is called without
    ``_disable_current_modes()``, so under memest's tracking fake mode dynamo's own fake tensors met memest's mode while
    tracing ("Mixing fake modes NYI"). Here the clone runs as the ordinary path does: with the dispatch modes off
    while dynamo compiles the frame (the compiled code then runs under them, as every compiled block does)."""
    from unittest import mock

    from torch._dynamo import convert_frame
    from torch.utils._python_dispatch import _disable_current_modes

    def outside_modes(clone):
        def with_backend(backend):
            callback = clone(backend)

            def call(*args, **kwargs):
                with _disable_current_modes():
                    return callback(*args, **kwargs)

            return call

        return with_backend

    with contextlib.ExitStack() as stack:
        for cls in (convert_frame.ConvertFrame, convert_frame.ConvertFrameAssert):
            original = cls._clone_with_backend
            stack.enter_context(mock.patch.object(
                cls, "_clone_with_backend", property(lambda self, original=original: outside_modes(original.fget(self)))))
        yield


@contextlib.contextmanager
def dynamo_session():
    """A clean dynamo for one step: caches reset before (no graph of another model or spec is reused)
    and after (none outlives the trace), however the step ends."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()


def _rng_hops_under_tracking_modes() -> None:
    """torch.utils.checkpoint inside a compiled step whose checkpointed region draws random numbers (dropout, SDPA
    with dropout_p; timm's ``set_grad_checkpointing()``): AOTAutograd's partitioner runs those ops through the
    ``run_and_save_rng_state`` / ``run_with_rng_state`` higher-order ops (torch/_prims/rng_prims.py) so the recompute
    in backward draws the same numbers. torch registers them for ``FakeTensorMode`` itself (``register_fake``), and a
    higher-order op looks a mode up by its exact type, so memest's tracking fake modes (subclasses) had no rule
    (NotImplementedError). Each is given torch's own fake rule: under the mode, the op's backend implementation —
    the saved state is the generator's state, a CPU tensor (``torch.get_rng_state()``; for CUDA
    ``torch.cuda.get_rng_state()``, also on the host), and the op runs on the fake tensors."""
    from torch._C import DispatchKey
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state

    for hop in (run_and_save_rng_state, run_with_rng_state):
        backend = hop.py_kernels[DispatchKey.BackendSelect]
        for cls in [TrackingFakeMode, *_subclasses(TrackingFakeMode)]:
            if cls not in hop.python_key_table:
                hop.py_impl(cls)(_under_mode(backend))


def _under_mode(backend):
    def rule(mode, *args, **kwargs):
        with mode:
            return backend(*args, **kwargs)

    return rule


@contextlib.contextmanager
def compiled_forward(model: torch.nn.Module, request: CompileRequest | None):
    """While entered, ``model(...)`` runs the compiled forward of the traced step."""
    if request is None:
        yield
        return
    with contextlib.ExitStack() as stack:
        stack.enter_context(dynamo_session())
        _rng_hops_under_tracking_modes()
        if request.backend == "inductor":
            stack.enter_context(inductor_without_kernels())
        if request.scope is CompileScope.BLOCKS and not request.traced_eager:
            stack.enter_context(_ddp_optimizer_outside_tracking_modes())
            _install_block_compiles(model, request, stack)
        else:
            model.forward = CompiledForward(model, request)
            stack.callback(delattr, model, "forward")
        yield


def compile_note(request: CompileRequest, target: str) -> str:
    """What the report says about the compiled step: how it was traced and what stays approximate."""
    who = request.by
    budget = torch._functorch.config.activation_memory_budget
    if request.backend in EAGER_BACKENDS:
        return f"compiled by {who} with backend 'eager' (dynamo runs the model's own ops): traced eager"
    if request.traced_eager:
        return (
            f"compiled by {who} with backend {request.backend!r}, which memest does not model: traced eager (a backend "
            "with its own AOTAutograd partition saves other tensors for backward; inductor and aot_eager* are modelled)"
        )
    if request.backend != "inductor":
        return (
            f"compiled step (backend {request.backend!r}, by {who}): that backend run as registered "
            f"(activation_memory_budget {budget:g}), its AOTAutograd graphs op by op, as it runs them"
        )
    dropped = sorted(set(request.inductor_config) - set(_inductor_options(request.inductor_config)))
    text = (
        f"compiled step (torch.compile, Inductor, by {who}): Inductor compiled the step under fake tensors — its "
        f"min-cut partitioner chose what the forward saves (activation_memory_budget {budget:g}; pointwise ops are "
        "recomputed in backward), and its wrapper code allocated and freed each buffer it plans (fused kernels not run, "
        "so their intermediates never exist, as in the real run); the compiled region's allocations are counted in the "
        "module that calls it. Not counted: a fused C++ kernel's own scratch outside torch's allocator"
    )
    if request.scope is CompileScope.BLOCKS:
        text = text.replace("compiled the step under", "compiled each repeated block under", 1) + (
            "; each repeated block compiled in place with fullgraph=True (block.compile(), after --checkpointing "
            "wrapped it: torchtitan 0.3.0's apply_compile, torchtitan/distributed/compile.py), the rest of the step "
            "eager"
        )
    if dropped:
        text += f"; not modelled: {', '.join(dropped)} (autotuned templates: Inductor's default kernels traced)"
    if target == Target.CUDA:
        text += (
            "; for --target cuda Inductor lowered the graphs for CPU tensors (C++ kernels and CPU fusion rules; a GPU "
            "run generates Triton kernels, whose buffers can differ, and mode='reduce-overhead' CUDA graphs are not "
            "modelled): measured against real compiled runs on CPU only"
        )
    return text


def _ddp_note(request: CompileRequest, spec) -> str:
    """What DDP does to the compiled blocks (--shard none/zero1 with --world-size; see
    :func:`_ddp_optimizer_outside_tracking_modes`)."""
    if request.scope is not CompileScope.BLOCKS or spec.world_size <= 1 or not spec.training or spec.shard not in (
            Shard.NONE, Shard.ZERO1):
        return ""
    return ("; DDP wraps the model after the blocks are compiled (torchtitan's apply_ddp), so each block compiles inside "
            "DDP's forward, where dynamo's DDPOptimizer (torch._dynamo.config.optimize_ddp 'ddp_optimizer', torch's "
            "default and torchtitan's setting with compile) splits the block's graph at DDP's bucket boundaries "
            "(bucket_cap_mb 25, first bucket 1 MiB) and Inductor compiles each piece: traced as run, DDP's reducer "
            "hooks outside the graphs")


class CompileFeature(StepFeature):
    """--compile / --no-compile and a model file's own torch.compile: the model unwrapped at build, the step
    run through the compiled forward (:func:`compiled_forward`), and the report's note on how it was traced."""

    name = "compile"

    def __init__(self) -> None:
        self.request: CompileRequest | None = None
        self.note: str | None = None

    def build(self, built, spec) -> None:
        built_compiled = is_compiled(built.model) or getattr(built.model, "_compiled_call_impl", None) is not None
        built.model, self.request = _compile_request(built.model, spec)
        built.compiled = self.request
        if self.request is not None:
            self.note = compile_note(self.request, spec.target) + _ddp_note(self.request, spec)
        elif built_compiled:  # --no-compile on a model file that compiles itself
            self.note = "the model file compiles the model (torch.compile): traced eager, as --no-compile asks"

    def prepare(self, step) -> contextlib.AbstractContextManager:
        if self.note:
            step.trace.notes.append(self.note)
        return compiled_forward(step.model, self.request)


def _compile_request(model, spec) -> tuple[Any, CompileRequest | None]:
    """The model unwrapped from the model file's torch.compile, and how the step is compiled (--compile)."""
    model, request = unwrap(model)
    if spec.compile is False:
        return model, None
    if spec.compile and request is None:
        request = CompileRequest()
    if spec.compile_scope is CompileScope.BLOCKS:
        if request.by != "--compile":
            raise TraceError(
                f"--compile-scope blocks on a model file that compiles itself ({request.by}): the file's own "
                "torch.compile is the whole model; drop --compile-scope, or return the eager model"
            )
        request.scope, request.fullgraph, request.by = CompileScope.BLOCKS, True, "--compile-scope blocks"
    if (request is not None and spec.checkpointing != "none" and not request.traced_eager
            and request.scope is not CompileScope.BLOCKS):
        raise TraceError(
            f"--checkpointing {spec.checkpointing} on a compiled step: torch.utils.checkpoint inside torch.compile runs "
            "higher-order ops that save the real RNG state, which memest's fake tensors cannot hold; drop "
            "--checkpointing, or trace eager with --no-compile (torch._functorch.config.activation_memory_budget is "
            "the compiled step's own recomputation, and is traced)"
        )
    if request is not None and not request.traced_eager and LossHead.of(spec.loss_head)[0] is not LossHead.STANDARD:
        # --loss-head replaces the causal LM's forward (features/loss_head.py) around the user's loop, which would
        # replace the compiled forward installed here: the step would run eager while the report said compiled
        raise TraceError(
            f"--loss-head {spec.loss_head} on a compiled step: memest does not trace the compiled model with a replaced "
            "loss head (torchtune compiles each layer and the loss separately, a partition memest does not model), "
            "and tracing it eager would report a step that was not compiled; use --loss-head standard with the "
            "compiled step, or --no-compile to trace the loss head eager"
        )
    if request is not None and spec.world_size > 1 and spec.training and request.scope is not CompileScope.BLOCKS:
        raise TraceError(
            "the model file compiles the whole model (torch.compile) with --world-size: not traced (dynamo's DDPOptimizer "
            "splits the graph at DDP's bucket boundaries, FSDP2 traces its collectives into it); use --no-compile to "
            "trace it eager, or return the eager model and use --compile-scope blocks (traced with --shard none, zero1, "
            "zero2 or zero3)"
        )
    return model, request
