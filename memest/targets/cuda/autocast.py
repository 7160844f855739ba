"""CUDA autocast, emulated on CPU (fake) tensors.

memest traces on fake *CPU* tensors, but ``--precision bf16-mixed|fp16-mixed`` with a CUDA target must
see what ``torch.autocast("cuda")`` does: which ops run in fp16/bf16, which in fp32, which casts are
made, and which cast copies autograd saves. On a CPU-only build ``torch.autocast("cuda")`` disables
itself, and ``torch.autocast("cpu")`` follows other op lists (it keeps layer_norm and softmax in low
precision, promotes cat/stack, ...).

How the real thing works (aten/src/ATen/autocast_mode.{h,cpp}): kernels registered at the
``AutocastCUDA`` dispatch key, which sits above ``Autograd``, cast the inputs of listed aten ops and
redispatch with the autocast key excluded. Autograd therefore records the casts and saves the cast
copies. Ops not listed fall through; CompositeImplicitAutograd ops decompose with autocast still on, so
their inner ops are cast (``cross_entropy_loss`` -> ``log_softmax`` with an explicit dtype, then
``nll_loss`` in fp32).

How this emulation works: CPU tensors carry the ``AutocastCPU`` key. While installed, this module
registers Python kernels at ``AutocastCPU`` that apply the **CUDA** policies to the CUDA op list, and
fallthroughs for the ops only CPU autocast lists; enabling CPU autocast then runs CUDA autocast on CPU
tensors at the same place in the dispatcher as the real one. No Python-name mapping is involved: every
aten op is seen, including those reached from Python composites (``F.multi_head_attention_forward``,
``F.normalize``) and C++ composites (``cross_entropy_loss``, ``conv1d(padding="same")``). Ops outside
the table never enter Python (C++ fallthrough); a listed op costs one Python call.

Use::

    with cuda_autocast_scope():            # hold across forward AND backward (see below)
        with cuda_autocast(torch.bfloat16):
            loss = loss_fn(model(x))
        loss.backward()

``cuda_autocast(dtype)`` installs the kernels itself when no scope is held. Hold ``cuda_autocast_scope``
around the whole step when activation checkpointing recomputes in backward: torch.utils.checkpoint
replays the forward under ``torch.autocast("cpu", ...)`` (the device type of our CPU tensors), which
means CUDA autocast only while the kernels are installed.

Also emulated:
- the weight-cast cache (``cached_cast``): lower-precision casts of fp32 leaf tensors that require grad
  (parameters) are made once per outermost autocast region and held until it exits;
  ``torch.autocast`` regions nested inside do not clear it (they share the nesting counter), and while
  installed ``torch.clear_autocast_cache`` (called by an outermost ``torch.autocast`` exit, e.g. a
  checkpoint replay) clears it too;
- fp32 ``softmax``/``log_softmax`` of fp16 input runs as one ``_softmax(x, dim, half_to_float=True)``
  (what aten's softmax does on CUDA: no fp32 copy of the input, an fp16 gradient) — on fake tensors
  only, as the real CPU kernel refuses half_to_float;
- the autocast state model code can read: ``torch.is_autocast_enabled("cuda")`` is True and
  ``torch.get_autocast_dtype("cuda")`` is the dtype inside the region, as on a GPU;
- ``torch.autocast("cpu" | "cuda", enabled=False)`` in model code (HF rotary embeddings use the tensor's
  device type, here "cpu") disables the emulation inside it; ``torch.autocast("cpu", dtype=...)``
  changes the lower-precision dtype, as ``torch.autocast("cuda", dtype=...)`` would on a GPU.

Not handled / approximated (see also the tests):
- ``torch.autocast("cuda")`` *enabling* a region inside model code disables the emulation there (on a
  CPU-only build it warns and turns CUDA autocast off); ``enabled=False`` regions are right.
- cuDNN RNNs: a CUDA build also registers ``_cudnn_rnn`` (aten/src/ATen/cudnn/AutocastRNN.cpp: input,
  hx, cx cast to fp16 — fp16 even under bf16 autocast — and the weights copied into a new fp16 flat
  buffer on every call). Emulated one level up, at the ``lstm/gru/rnn_*`` ops that pick cuDNN on a GPU
  (``RNN_CUDNN``): every floating input, hidden state and weight is cast to fp16, weights uncached (one
  copy per call, as the flat buffer is). Not in a CPU binary, so not checked against one.
  Cost: on a CPU without fp16 oneDNN an fp16 LSTM runs as a per-timestep decomposition (a 2-layer,
  128-step LSTM: 12k ops, ~3 s fake forward+backward instead of 0.02 s), and its saved tensors are that
  decomposition's, not cuDNN's reserve space.
- the cache is looked up by source tensor alone, as in C++: a weight cached as fp16 comes back as fp16
  inside a nested ``torch.autocast(dtype=torch.bfloat16)`` (and the matmul then fails, as on a GPU).
- a checkpointed block run inside ``torch.autocast("cuda", enabled=False)`` is replayed with the
  emulation on (checkpoint records and restores the CPU autocast state only).
- kernel-internal differences between CUDA and CPU kernels (workspaces, SDPA backend choice) are not
  autocast's business and are not modelled here.
- the kernels are process-wide while installed: another thread running CPU autocast at the same time
  would get CUDA policies.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator

import torch

# ------------------------------------------------------------------------------------------------
# The CUDA op table. Sources: aten/src/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP,
# AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
# AT_FORALL_PROMOTE) and aten/src/ATen/autocast_mode.cpp (TORCH_LIBRARY_IMPL(aten, Autocast, m):
# cudnn_convolution*, binary_cross_entropy banned), torch 2.13. Names are aten "op.overload" as
# registered; tests/test_cuda_autocast.py checks this table against the AutocastCUDA kernels present
# in the installed torch binary, and each policy against torch's own autocast test lists.
# ------------------------------------------------------------------------------------------------

# Cast floating inputs to the autocast dtype (fp16/bf16).
LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose",
    "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear",
    "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
    "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
)

# Cast floating inputs to float32.
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
    "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus",
    "layer_norm", "native_layer_norm", "group_norm", "rms_norm",
    "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits",
    "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)

# Run in fp32 through the op's own ``dtype`` argument, unless the caller gave one; inputs not cast.
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
    "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList",
)

# Redispatch to the overload that takes a dtype, with dtype=float32 (fp32_append_dtype).
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
}

# Cast floating inputs to the widest floating dtype among them.
PROMOTE = (
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
    "tensordot", "scatter_add",
)

# Raise under autocast (autocast_mode.cpp: binary_cross_entropy_banned).
BANNED = ("binary_cross_entropy",)

# CUDA builds with cuDNN only (aten/src/ATen/cudnn/AutocastRNN.cpp, ``_cudnn_rnn``: always fp16, weights
# re-flattened per call), emulated one level up, at the ops that pick cuDNN on a GPU. Approximation.
RNN_CUDNN = (
    "lstm.input", "lstm.data", "gru.input", "gru.data",
    "rnn_tanh.input", "rnn_tanh.data", "rnn_relu.input", "rnn_relu.data",
)

BANNED_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)

LOWER_PRECISION_DTYPES = (torch.float16, torch.bfloat16)


def cuda_policy_table() -> dict[str, str]:
    """aten "op.overload" -> policy name, for every op the CUDA autocast registers (RNN_CUDNN aside)."""
    table: dict[str, str] = {}
    for policy, names in (
        ("lower_precision_fp", LOWER_PRECISION_FP),
        ("fp32", FP32),
        ("fp32_set_opt_dtype", FP32_SET_OPT_DTYPE),
        ("fp32_append_dtype", tuple(FP32_APPEND_DTYPE)),
        ("promote", PROMOTE),
        ("banned", BANNED),
    ):
        for name in names:
            assert name not in table, name
            table[name] = policy
    return table


# ------------------------------------------------------------------------------------------------
# Casting (cached_cast, prioritize, is_eligible in autocast_mode.h/.cpp)
# ------------------------------------------------------------------------------------------------

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
_float32 = torch.float32
_float64 = torch.float64

# id(source) -> (weakref to source, cast copy). Like the C++ cache, an entry (and its copy) lives until
# the cache is cleared, even if the source dies; the weakref guards against id reuse.
_cast_cache: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


def clear_cache() -> None:
    _cast_cache.clear()


def cast_cache() -> dict[int, tuple[weakref.ref, torch.Tensor]]:
    """The weight-cast cache itself (trace/recompute.py reads what a recomputation cached and caches it again)."""
    return _cast_cache


def _eligible(t: torch.Tensor) -> bool:
    # is_eligible: floating point, not double, on the autocast device (our CPU tensors stand for CUDA).
    return t.is_floating_point() and t.dtype != _float64 and t.is_cpu


def _cached_cast(t: torch.Tensor, to: torch.dtype, low: torch.dtype | None) -> torch.Tensor:
    if t.dtype == to or not _eligible(t):
        return t
    if (
        to == low
        and t.dtype == _float32
        and t.requires_grad
        and t.is_leaf
        and not t._is_view()
        and torch.is_autocast_cache_enabled()
    ):
        hit = _cast_cache.get(id(t))
        if hit is not None and hit[0]() is t:
            return hit[1]
        cast = t.to(to)
        _cast_cache[id(t)] = (weakref.ref(t), cast)
        return cast
    return t.to(to)


def _cast(x, to: torch.dtype, low: torch.dtype | None):
    if isinstance(x, torch.Tensor):
        return _cached_cast(x, to, low)
    if isinstance(x, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in x):
        return type(x)(_cached_cast(v, to, low) if isinstance(v, torch.Tensor) else v for v in x)
    return x


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from (v for v in x if isinstance(v, torch.Tensor))


def _promote_type(args, kwargs, low: torch.dtype) -> torch.dtype:
    current = low
    for t in _tensors(args, kwargs):
        if not (t.is_floating_point() and t.is_cpu):
            continue
        nxt = t.dtype
        if nxt == _float64:
            continue  # doubles are ignored
        if current == _float32 or nxt == _float32:
            current = _float32
        elif not (current == low and nxt == low):
            raise RuntimeError("Unexpected floating ScalarType in at::autocast::prioritize")
    return current


# ------------------------------------------------------------------------------------------------
# Region state
# ------------------------------------------------------------------------------------------------

_tls = threading.local()  # depth: cuda_autocast regions entered on this thread


def _emulating() -> bool:
    # Called only when CPU autocast is on (else the AutocastCPU key is excluded). Inside our regions a
    # nested torch.autocast("cuda", enabled=False) must switch us off; outside them (checkpoint
    # recomputation under torch.autocast("cpu")) the CPU state alone decides.
    return getattr(_tls, "depth", 0) == 0 or torch.is_autocast_enabled("cuda")


# ------------------------------------------------------------------------------------------------
# Kernels, one per op and policy
# ------------------------------------------------------------------------------------------------


def _overload(name: str):
    op, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, op, None)
    return None if packet is None else getattr(packet, overload or "default", None)


def _casting_kernel(op, target: Callable[[tuple, dict, torch.dtype], torch.dtype]) -> Callable:
    """lower_precision_fp, fp32 and promote: cached_cast every tensor argument to ``target(...)``."""

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _emulating():
                return op(*args, **kwargs)
            low = torch.get_autocast_dtype("cpu")
            to = target(args, kwargs, low)
            return op(*[_cast(a, to, low) for a in args], **{k: _cast(v, to, low) for k, v in kwargs.items()})

    return kernel


def _to_low(args, kwargs, low):
    return low


def _to_fp32(args, kwargs, low):
    return _float32


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _fp32_set_opt_dtype_kernel(op, name: str) -> Callable:
    arguments = op._schema.arguments
    slot = next(i for i, a in enumerate(arguments) if a.name == "dtype")
    positional = not arguments[slot].kwarg_only
    # aten's softmax/log_softmax (CompositeImplicit, SoftMax.cpp): on CUDA, Half input with dtype=Float
    # runs as _softmax(input, dim, half_to_float=True) instead of casting a copy first.
    half_to_float = {"softmax.int": torch.ops.aten._softmax.default,
                     "log_softmax.int": torch.ops.aten._log_softmax.default}.get(name)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _emulating() or not _eligible(args[0]):  # firstarg_is_eligible
                return op(*args, **kwargs)
            if positional and len(args) > slot:
                dtype = args[slot]
                if dtype is None:
                    args = (*args[:slot], _float32, *args[slot + 1:])
                    dtype = _float32
            else:
                dtype = kwargs.get("dtype")
                if dtype is None:
                    kwargs = {**kwargs, "dtype": _float32}
                    dtype = _float32
            x = args[0]
            if half_to_float is not None and dtype == _float32 and x.dtype == torch.float16 and _is_fake(x):
                return half_to_float(x, args[1], True)
            return op(*args, **kwargs)

    return kernel


def _fp32_append_dtype_kernel(op, redispatch) -> Callable:
    arguments = op._schema.arguments

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _emulating():
                return op(*args, **kwargs)
            full = [
                args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                for i, a in enumerate(arguments)
            ]
            self = full[0]
            out_type = _float32 if _eligible(self) else self.dtype  # type_from_firstarg
            return redispatch(*full, dtype=out_type)

    return kernel


def _rnn_cudnn_kernel(op) -> Callable:
    params = next(i for i, a in enumerate(op._schema.arguments) if a.name == "params")

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _emulating():
                return op(*args, **kwargs)
            # input/hx/cx: cached_cast(kHalf, ...); weights: copy_weights_to_flat_buf_views(kHalf), a new
            # flat fp16 buffer per call (so never the cache). fp16 whatever the autocast dtype.
            half, low = torch.float16, torch.get_autocast_dtype("cpu")
            args = [_cast(a, half, None if i == params else low) for i, a in enumerate(args)]
            return op(*args, **kwargs)

    return kernel


def _banned_kernel(op) -> Callable:
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            if not _emulating():
                return op(*args, **kwargs)
            raise RuntimeError(BANNED_MESSAGE)

    return kernel


def _kernels() -> dict[str, Callable]:
    """aten "op.overload" -> Python kernel, for the ops of this torch build (others are skipped)."""
    kernels: dict[str, Callable] = {}
    for name, policy in cuda_policy_table().items():
        op = _overload(name)
        if op is None:
            continue
        if policy == "lower_precision_fp":
            kernels[name] = _casting_kernel(op, _to_low)
        elif policy == "fp32":
            kernels[name] = _casting_kernel(op, _to_fp32)
        elif policy == "fp32_set_opt_dtype":
            kernels[name] = _fp32_set_opt_dtype_kernel(op, name)
        elif policy == "fp32_append_dtype":
            redispatch = _overload(FP32_APPEND_DTYPE[name])
            if redispatch is not None:
                kernels[name] = _fp32_append_dtype_kernel(op, redispatch)
        elif policy == "promote":
            kernels[name] = _casting_kernel(op, _promote_type)
        elif policy == "banned":
            kernels[name] = _banned_kernel(op)
    for name in RNN_CUDNN:
        op = _overload(name)
        if op is not None:
            kernels[name] = _rnn_cudnn_kernel(op)
    return kernels


_cpu_autocast_ops: list[str] | None = None


def cpu_autocast_ops() -> list[str]:
    """Ops with a C++ AutocastCPU kernel in this build (read once, before we register any)."""
    global _cpu_autocast_ops
    if _cpu_autocast_ops is None:
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        _cpu_autocast_ops = sorted(
            n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and has(n, "AutocastCPU")
        )
    return _cpu_autocast_ops


# ------------------------------------------------------------------------------------------------
# Installation (refcounted, process-wide) and the public context managers
# ------------------------------------------------------------------------------------------------

_install_lock = threading.Lock()
_install_count = 0
_library: torch.library.Library | None = None
_torch_clear_autocast_cache = torch.clear_autocast_cache


def _clear_both_caches() -> None:
    _torch_clear_autocast_cache()
    clear_cache()


def _install() -> None:
    global _install_count, _library
    with _install_lock:
        _install_count += 1
        if _install_count > 1:
            return
        lib = None
        try:
            cpu_ops = cpu_autocast_ops()
            kernels = _kernels()
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                for name, kernel in kernels.items():
                    lib.impl(name, kernel, "AutocastCPU")
                for name in cpu_ops:
                    if name not in kernels:
                        lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")
        except BaseException:
            _install_count -= 1
            if lib is not None:
                lib._destroy()
            raise
        _library = lib
        # torch.autocast.__exit__ calls torch.clear_autocast_cache() when the nesting count reaches 0
        # (checkpoint recomputation regions): clear our cache with it, as CUDA autocast would.
        torch.clear_autocast_cache = _clear_both_caches


def _uninstall() -> None:
    global _install_count, _library
    with _install_lock:
        _install_count -= 1
        if _install_count > 0:
            return
        torch.clear_autocast_cache = _torch_clear_autocast_cache
        if _library is not None:
            _library._destroy()
            _library = None
        clear_cache()


def installed() -> bool:
    return _install_count > 0


@contextlib.contextmanager
def cuda_autocast_scope() -> Iterator[None]:
    """Keep the CUDA policies installed at the AutocastCPU key: inside, any CPU autocast region behaves
    as CUDA autocast. Hold it across forward and backward when checkpointing recomputes."""
    _install()
    try:
        yield
    finally:
        _uninstall()


@contextlib.contextmanager
def cuda_autocast(
    dtype: torch.dtype = torch.float16, *, enabled: bool = True, cache_enabled: bool = True
) -> Iterator[None]:
    """``torch.autocast("cuda", dtype)`` for CPU (fake) tensors standing in for CUDA ones."""
    if dtype not in LOWER_PRECISION_DTYPES:
        raise ValueError(f"cuda_autocast: dtype must be torch.float16 or torch.bfloat16, not {dtype}")
    prev = (
        torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"),
        torch.is_autocast_cache_enabled(),
    )
    _install()
    _tls.depth = getattr(_tls, "depth", 0) + 1
    try:
        torch.set_autocast_enabled("cpu", enabled)
        torch.set_autocast_dtype("cpu", dtype)
        torch.set_autocast_enabled("cuda", enabled)
        torch.set_autocast_dtype("cuda", dtype)
        torch.autocast_increment_nesting()
        torch.set_autocast_cache_enabled(cache_enabled)
        try:
            yield
        finally:
            if torch.autocast_decrement_nesting() == 0:
                _clear_both_caches()
            torch.set_autocast_enabled("cpu", prev[0])
            torch.set_autocast_dtype("cpu", prev[1])
            torch.set_autocast_enabled("cuda", prev[2])
            torch.set_autocast_dtype("cuda", prev[3])
            torch.set_autocast_cache_enabled(prev[4])
    finally:
        _tls.depth -= 1
        _uninstall()
