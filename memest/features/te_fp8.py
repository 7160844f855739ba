"""--fp8 te-delayed: TransformerEngine's FP8 Linear under delayed scaling, a documented estimate.

TransformerEngine (TE) cannot run on this project's machines: ``import transformer_engine`` loads its compiled
CUDA libraries, and its kernels need an FP8 GPU. So this is the one FP8 recipe memest does not trace through the
library's own code: each eligible ``nn.Linear`` is replaced by a stand-in whose autograd function allocates, in TE's
order, the tensors TE's ``te.Linear`` allocates, as read from TE 2.20.2's source (``transformer_engine/pytorch/
module/linear.py``: ``_linear_forward_impl``, ``_linear_backward_impl``, and the shape-only twins TE registers for
torch.compile, ``_linear_forward_fake`` / ``_linear_backward_fake``; ``tensor/float8_tensor.py``; ``quantization.py``).
The swap is accelerate's (``accelerate.utils.transformer_engine.convert_model``: every nn.Linear becomes a te.Linear
with ``params_dtype`` = the weight's dtype), the forward runs under ``te.fp8_autocast(fp8_recipe=DelayedScaling())``
with no ``is_first_microbatch`` (Trainer's and accelerate's call), one process, no tensor parallelism.

What the stand-in allocates, per converted Linear (``Float8Quantizer``, per-tensor delayed scaling):

- forward: the input quantized to float8, its rowwise data (1 B/element) and, where the weight needs a gradient,
  its column-wise copy (the transpose, 1 B/element) on GPUs whose FP8 GEMM takes only the TN layout; from compute
  capability 10.0 (but not 12.x) one buffer serves both (``utils.is_non_tn_fp8_gemm_supported``; ``Float8Quantizer``'s
  ``inner_tensor_specs``: no ``_transpose`` there); a 4 B scale-inverse per quantized tensor; the weight quantized
  the same way (its transpose where the input needs a gradient); the GEMM output in the activation dtype (autocast's
  when autocast is on, else the input's: ``set_activation_dtype``); the bias cast to the activation dtype. After the
  GEMM the input's rowwise data is dropped (``update_usage(rowwise_usage=False, columnwise_usage=True)``). Saved for
  backward: the input's column-wise float8 data and the quantized weight (``wt_save = weightmat``, rowwise and
  transpose), each with its scale-inverse; the parameters themselves.
- backward: the output gradient quantized, rowwise and column-wise (``grad_output_preprocess``; with a bias,
  ``tex.bgrad_quantize`` also returns the bias gradient in the activation dtype); the dgrad GEMM output and the
  wgrad GEMM output, both in the activation dtype (autograd casts a gradient to its parameter's dtype where they
  differ, as for any function); the saved input freed after the wgrad GEMM (``clear_tensor_data``).
- state: ``DelayedScalingRecipeState`` for the forward (3 quantizers: input, weight, output) and the backward
  (2: output gradient, input gradient), each a ``scale`` (n float32) and an ``amax_history``
  (``amax_history_len`` x n float32; DelayedScaling's default length 1,024, ``--fp8-amax-history``), kept from the
  first forward on; the process's cuBLAS workspace for TE's GEMMs, ``torch.empty`` of 32 MiB + 1,024 B on compute
  capability 9.0+ and 4 MiB before (``cpp_extensions/gemm.py`` get_cublas_workspace_size_bytes), kept for the
  process's life. They are traced as buffers, there from the start.

Not traced: TE's per-step amax reduction (``torch.cat`` of every module's current amax, 4 B per quantizer, freed at
once), the FP8 weight cache across micro-batches (``is_first_microbatch``, Megatron-LM's), TE's own layers
(``LayerNormLinear``, ``LayerNormMLP``, ``TransformerLayer``, fused attention: the model's own code runs, as with
accelerate's swap), Megatron-LM's ``main_grad`` (fused wgrad accumulation), current scaling and TE's MXFP8/NVFP4
recipes. The figure is not measured on any GPU (docs/fp8.md "TransformerEngine").
"""

from __future__ import annotations

import torch

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.features.fp8 import eligible_linear, skip_parts

SOURCES = (
    "https://github.com/NVIDIA/TransformerEngine (transformer_engine 2.20.2: pytorch/module/linear.py "
    "_linear_forward_impl/_linear_backward_impl and their fakes, tensor/float8_tensor.py, quantization.py "
    "DelayedScalingRecipeState, cpp_extensions/gemm.py)",
    "accelerate/utils/transformer_engine.py convert_model (nn.Linear -> te.Linear)",
)
DIM_MULTIPLE = 16  # TE utils.assert_dim_for_fp8_exec: the last dimension a multiple of 16 ...
ROWS_MULTIPLE = 8  # ... and the product of the others a multiple of 8, for the input and the weight
AMAX_HISTORY_LEN = 1024  # transformer_engine/common/recipe DelayedScaling.amax_history_len default
FWD_QUANTIZERS = 3  # base.py: num_gemms * 3 forward (input, weight, output) ...
BWD_QUANTIZERS = 2  # ... num_gemms * 2 backward (output gradient, input gradient)
SCALE_INV_BYTES = 4  # one float32 scale-inverse per quantized tensor (Float8Quantizer inner_tensor_specs "_scale_inv": (1,))
WORKSPACE_HOPPER = 32 * 1024 * 1024 + 1024  # get_cublas_workspace_size_bytes: major >= 9 ("32 MiB ... plus 1024 B")
WORKSPACE_OLDER = 4_194_304  # ... every other architecture
FP8_FWD, FP8_BWD = torch.float8_e4m3fn, torch.float8_e5m2  # DelayedScaling's default Format.HYBRID


def non_tn_gemm(capability: tuple[int, int]) -> bool:
    """TE ``utils.is_non_tn_fp8_gemm_supported``: FP8 GEMMs take every layout on 10.x and 13+ (not 12.x)."""
    return (10, 0) <= tuple(capability) < (12, 0) or tuple(capability) >= (13, 0)


def workspace_bytes(capability: tuple[int, int]) -> int:
    return WORKSPACE_HOPPER if capability[0] >= 9 else WORKSPACE_OLDER


def _quantized(shape, with_rows: bool, with_cols: bool, non_tn: bool, dtype, device) -> list[torch.Tensor]:
    """A Float8Tensor's buffers as TE allocates them: ``_data`` (rowwise, or both usages where non-TN GEMMs exist),
    ``_transpose`` (column-wise, TN-only GPUs), ``_scale_inv``."""
    parts = []
    if with_rows or non_tn:
        parts.append(torch.empty(shape, dtype=dtype, device=device))
    if with_cols and not non_tn:
        parts.append(torch.empty((shape[-1], *shape[:-1]), dtype=dtype, device=device))
    parts.append(torch.empty(1, dtype=torch.float32, device=device))
    return parts


class _TEDelayedLinear(torch.autograd.Function):
    """TE 2.20.2's ``_Linear`` under delayed scaling, by its allocations (the module docstring)."""

    @staticmethod
    def forward(ctx, inp, weight, bias, act_dtype, non_tn, grad_enabled):
        shape = inp.shape
        needs_wgrad = grad_enabled and weight.requires_grad
        needs_dgrad = grad_enabled and inp.requires_grad
        x = _quantized(shape, True, needs_wgrad, non_tn, FP8_FWD, inp.device)
        w = _quantized(weight.shape, True, needs_dgrad, non_tn, FP8_FWD, weight.device)
        cast_bias = bias.to(act_dtype) if bias is not None else None  # cast_if_needed
        out = torch.empty((*shape[:-1], weight.shape[0]), dtype=act_dtype, device=inp.device)  # general_gemm
        del cast_bias
        if needs_wgrad and not non_tn:
            x = x[1:]  # rowwise data dropped, the transpose kept (update_usage(rowwise_usage=False))
        x = x if needs_wgrad else []
        ctx.save_for_backward(*((*x, *w) if grad_enabled else ()))
        ctx.meta = (shape, act_dtype, non_tn, needs_wgrad, needs_dgrad, bias is not None, max(len(x) - 1, 0))
        return out

    @staticmethod
    def backward(ctx, grad_output):
        shape, act_dtype, non_tn, needs_wgrad, needs_dgrad, has_bias, input_data = ctx.meta
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        rows = rows.contiguous()  # grad_output_preprocess
        grad_bias = torch.empty(rows.shape[-1], dtype=act_dtype, device=rows.device) if has_bias else None
        cols = needs_wgrad or has_bias  # column-wise usage dropped only with neither a bias nor a wgrad
        g = _quantized(rows.shape, True, cols, non_tn, FP8_BWD, rows.device)
        del rows
        saved = ctx.saved_tensors
        in_features = shape[-1]
        dgrad = (torch.empty((*shape[:-1], in_features), dtype=act_dtype, device=grad_output.device)
                 if needs_dgrad else None)
        wgrad = None
        if needs_wgrad:
            out_features = grad_output.shape[-1]
            wgrad = torch.empty((out_features, in_features), dtype=act_dtype, device=grad_output.device)
            for t in saved[:input_data]:  # clear_tensor_data(inputmat_total): the input's float8 data freed at
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)  # once (Float8TensorStorage.clear)
        del g, saved
        return dgrad, wgrad, grad_bias, None, None, None


class TELinear(torch.nn.Module):
    """A te.Linear in place of an nn.Linear (the same parameters), with its delayed-scaling state."""

    def __init__(self, linear: torch.nn.Linear, history: int, capability: tuple[int, int],
                 workspace: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.non_tn = non_tn_gemm(capability)
        device = linear.weight.device
        self.register_buffer("scale_fwd", torch.ones(FWD_QUANTIZERS, device=device), persistent=False)
        self.register_buffer("amax_history_fwd", torch.zeros(history, FWD_QUANTIZERS, device=device), persistent=False)
        self.register_buffer("scale_bwd", torch.ones(BWD_QUANTIZERS, device=device), persistent=False)
        self.register_buffer("amax_history_bwd", torch.zeros(history, BWD_QUANTIZERS, device=device), persistent=False)
        if workspace:  # the process's one cuBLAS workspace for TE's GEMMs (get_cublas_workspace, lru_cache'd)
            self.register_buffer("cublas_workspace", torch.empty(workspace_bytes(capability), dtype=torch.uint8,
                                                                 device=device), persistent=False)

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        device = inp.device.type
        act_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else inp.dtype
        if inp.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise MemestError(f"--fp8 te-delayed: a te.Linear input of dtype {inp.dtype}")
        rows = inp.numel() // inp.shape[-1] if inp.shape[-1] else 0
        if rows % ROWS_MULTIPLE or inp.shape[-1] % DIM_MULTIPLE:
            raise MemestError(
                f"--fp8 te-delayed: TransformerEngine's FP8 GEMM needs the input's last dimension to be a multiple of "
                f"{DIM_MULTIPLE} and the product of the others a multiple of {ROWS_MULTIPLE} (assert_dim_for_fp8_exec; "
                f"the real run fails the same way), got {list(inp.shape)}: choose --batch/--seq so batch x sequence "
                f"is a multiple of {ROWS_MULTIPLE}"
            )
        if not inp.is_contiguous():
            inp = inp.contiguous()  # prepare_forward
        return _TEDelayedLinear.apply(inp, self.weight, self.bias, act_dtype, self.non_tn, torch.is_grad_enabled())

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, te-delayed stand-in"


def convert(model, history: int, capability: tuple[int, int], skip: str = "") -> int:
    """``model``'s eligible nn.Linear layers replaced by TELinear stand-ins (in place); how many. accelerate's
    convert_model swaps every nn.Linear; one whose dimensions TE's FP8 GEMM refuses would fail in the real run, so
    those stay nn.Linear here (the report counts them), as do layers named by --fp8-skip."""
    parts = skip_parts(skip)
    names = [name for name, module in model.named_modules()
             if name and eligible_linear(module, name, DIM_MULTIPLE, parts) and module.weight.shape[0] % ROWS_MULTIPLE == 0]
    for i, name in enumerate(names):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, TELinear(getattr(parent, child), history, capability, workspace=i == 0))
    return len(names)


class TEFp8Feature(StepFeature):
    """Replaces the built model's eligible Linear layers by TE stand-ins (build hook); the report says so."""

    name = "te_fp8"

    def __init__(self) -> None:
        self.converted = 0
        self.others = 0
        self.history = AMAX_HISTORY_LEN
        self.capability = (9, 0)

    def build(self, built, spec) -> None:
        self.history, self.capability = spec.fp8_amax_history, tuple(spec.compute_capability)
        linears = sum(isinstance(m, torch.nn.Linear) for m in built.model.modules())
        self.converted = convert(built.model, self.history, self.capability, spec.fp8_skip)
        self.others = linears - self.converted
        if not self.converted:
            raise MemestError(f"--fp8 te-delayed: {built.where} has no nn.Linear layer whose dimensions TE's FP8 GEMM "
                              f"takes (multiples of {DIM_MULTIPLE}), so none is converted; drop --fp8")

    def finish(self, step) -> list[str]:
        layout = ("one float8 buffer per tensor serves both GEMM layouts (compute capability "
                  f"{self.capability[0]}.{self.capability[1]})" if non_tn_gemm(self.capability) else
                  "float8 transposes kept beside the rowwise data (TN-only FP8 GEMMs before compute capability 10.0)")
        others = f"; {self.others} other Linear layers stay high precision" if self.others else ""
        return [
            f"--fp8 te-delayed: {self.converted} Linear layers estimated as TransformerEngine te.Linear under "
            f"DelayedScaling (amax history {self.history}; {layout}; cuBLAS workspace "
            f"{workspace_bytes(self.capability):,} B{others}). A documented estimate, not a trace of TE: TE needs CUDA "
            f"to import, so stand-ins allocate what TE 2.20.2's Linear allocates, read from its source; not measured "
            f"on a GPU ({SOURCES[0]})"
        ]
