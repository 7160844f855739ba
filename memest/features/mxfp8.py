"""--fp8 mxfp8 | mxfp8-wgrad-hp | mxfp8-emulated: torchao's MXFP8 training, traced through torchao's own code.

MXFP8 (OCP Microscaling): float8 e4m3 values with one power-of-two (e8m0) scale per block of 32 consecutive
elements. torchao 0.18 applies it to training as torchtitan's ``MXFP8Converter`` does
(torchtitan/components/quantization/mx.py): ``quantize_(model, MXFP8TrainingOpConfig.from_recipe(recipe))``
swaps each Linear's parameters for ``MXFP8TrainingWeightWrapperTensor`` (torchao/prototype/moe_training/tensor.py),
whose ``__torch_function__`` sends ``F.linear`` to ``_to_mxfp8_then_scaled_mm`` (moe_training/mxfp8_linear.py
``mx_mm``): the weight stays in high precision (the parameter, its gradient and optimizer state as before), autograd
saves the high-precision input and weight, and each of the three matmuls casts its operands to MXFP8 just before it
(``MXTensor``: ``qdata`` 1 B/element and ``scale`` 1 B per 32 elements), the scales rearranged into cuBLAS's blocked
layout (``to_blocked``: padded to 128 x 4 tiles) for ``torch._scaled_mm``.

Recipes (torchao ``MXFP8TrainingRecipe``):
- ``mxfp8`` = ``mxfp8_rceil`` (torchtitan's only recipe name): every matmul in MXFP8, the real kernels
  (``KernelPreference.AUTO``: torchao's Triton cast along rows, its CUDA cast along columns, cuBLAS's MXFP8 GEMM).
- ``mxfp8-wgrad-hp`` = ``mxfp8_rceil_wgrad_with_hp``: the weight gradient's matmul in high precision.
- ``mxfp8-emulated`` = ``mxfp8_emulated_rceil``: torchao's hardware-agnostic path (``KernelPreference.EMULATED``:
  PyTorch casts, then each MXTensor dequantized back to high precision for a plain matmul); it runs on any GPU and
  on the CPU, where the trace is checked against real steps (tests/test_mxfp8.py).

The real kernels exist only for compute capability 10.0+ (torchao builds them where ``is_sm_at_least_100()``;
torchtitan asserts ``has_cuda_capability(10, 0)``), so on this machine torchao leaves them undefined. The trace
puts stand-ins in their place that allocate exactly what torchao's code allocates (``KERNEL_SOURCES``): the Triton
row cast ``triton_to_mxfp8_dim0`` (``torch.empty`` of the float8 values and of the uint8 scales, viewed as e8m0)
and the CUDA column cast ``mxfp8_quantize`` as its registered fake kernel shapes it (column-major float8 values,
column-major e8m0 scales; empty row-wise outputs). Everything else is torchao's own code on fake tensors. Not
modelled: any scratch those two kernels use inside (none is allocated through torch in their source).

Compiled (``--compile``, or ``--compile-scope blocks`` also under FSDP2; the emulated recipe only: the SM100 recipes'
e8m0 scales have no type in Inductor's CPU code generation, which memest's compiled traces use) the conversion comes
first and Inductor runs torchao's casts inside the compiled graphs.

Over FSDP2 ranks (``--world-size N --shard zero2|zero3``) the wrapped weights are sharded by FSDP2 after the
conversion; torchao's wrapper has FSDP2's extension hooks (``fsdp_pre_all_gather`` all-gathers the high-precision
shard in MixedPrecisionPolicy's param dtype, ``fsdp_post_all_gather`` wraps the gathered tensor again), which FSDP2
runs itself; the tracker follows the wrapper by its inner tensor inside FSDP2's DTensor (``rules``).

SIMPLIFICATION none beyond that; note that torchao 0.18's wrapper passes no bias to the MXFP8 matmul
(``MXFP8TrainingWeightWrapperTensor.__torch_function__`` reads only ``args[0], args[1]`` of ``linear``), so a
converted Linear's bias takes no part in the step, in the real run as in the trace (the report says so).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.features.fp8 import eligible_linear, skip_parts
from memest.imports import quiet_library_import
from memest.spec.choices import Fp8
from memest.trace.replay import Replays, replaying
from memest.trace.tracker import TrackerRules

BLOCK = 32  # MX block size: 32 elements per e8m0 scale (OCP MX spec v1.0; torchao mx_mm's block_size = 32)
RECIPES = {  # --fp8 value -> torchao MXFP8TrainingRecipe value (torchao/prototype/moe_training/config.py)
    Fp8.MXFP8: "mxfp8_rceil",
    Fp8.MXFP8_WGRAD_HP: "mxfp8_rceil_wgrad_with_hp",
    Fp8.MXFP8_EMULATED: "mxfp8_emulated_rceil",
}
SOURCES = (
    "torchao 0.18 torchao/prototype/moe_training/config.py (MXFP8TrainingOpConfig, MXFP8TrainingRecipe), "
    "mxfp8_linear.py (mx_mm), tensor.py (MXFP8TrainingWeightWrapperTensor)",
    "torchtitan/components/quantization/mx.py (MXFP8Converter: quantize_ with MXFP8TrainingOpConfig; SM100 asserted)",
)
KERNEL_SOURCES = (
    "torchao 0.18 torchao/prototype/mx_formats/kernels.py triton_to_mxfp8_dim0 (its torch.empty outputs) and "
    "_fake_mxfp8_quantize (the registered fake of torchao::mxfp8_quantize)"
)


def mx_filter(module, fqn: str, skip: list[str] | None = None) -> bool:
    """The Linear layers whose two dimensions are multiples of the MX block (torchao's casts assert it for the
    weight along both dimensions; the others would fail in the real run, so they stay high precision) and whose name
    contains none of ``skip`` (--fp8-skip: torchtitan's mx ``filter_fqns``)."""
    return eligible_linear(module, fqn, BLOCK, skip)


def convert(model, recipe: Fp8, skip: str = "") -> tuple[int, set[int]]:
    """``model``'s eligible Linear layers given torchao's MXFP8 weight wrapper (in place): how many, and the ids of
    the high-precision weights (the wrappers' ``_data``) of those with a bias."""
    import torch

    try:
        with quiet_library_import():
            from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
            from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor
            from torchao.quantization.quant_api import quantize_
    except ImportError as exc:
        raise MemestError(f"--fp8 {recipe} traces torchao's MXFP8 training and needs torchao >= 0.17: pip install "
                          f"torchao ({exc})") from exc
    config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(RECIPES[recipe]))
    parts = skip_parts(skip)
    quantize_(model, config, filter_fn=lambda m, fqn: mx_filter(m, fqn, parts))
    converted = [m for m in model.modules() if isinstance(m, torch.nn.Linear)
                 and isinstance(m.weight.data if isinstance(m.weight, torch.nn.Parameter) else m.weight,
                                MXFP8TrainingWeightWrapperTensor)]
    return len(converted), {id(m.weight.data._data) for m in converted if m.bias is not None}


def _rows_cols(x) -> tuple[int, int]:
    if x.dim() != 2:
        raise MemestError(f"MXFP8 cast of a {x.dim()}-d tensor: torchao's kernels take 2-d operands")
    return x.shape[0], x.shape[1]


def _check_blocks(what: str, rows: int, cols: int, need_rows: bool) -> None:
    if cols % BLOCK or (need_rows and rows % BLOCK):
        raise MemestError(
            f"--fp8 mxfp8 / mxfp8-wgrad-hp: an MXFP8 {what} of a {rows} x {cols} operand: torchao's kernels need "
            f"{'both dimensions' if need_rows else 'the last dimension'} to be multiples of {BLOCK} (the real run "
            f"fails the same way); for the activations that is batch x sequence tokens: choose --batch/--seq so "
            f"their product is a multiple of {BLOCK}"
        )


def triton_to_mxfp8_dim0(x, inner_block_size: int = 32, scaling_mode: str = "rceil"):
    """torchao's ``triton_to_mxfp8_dim0`` (mx_formats/kernels.py): float8 values in ``x``'s shape and one uint8
    scale per block along the last dimension (viewed as e8m0), both from ``torch.empty``; the kernel writes them."""
    import torch

    shape = x.shape
    rows, cols = x.reshape(-1, shape[-1]).shape
    _check_blocks("row cast", rows, cols, need_rows=False)
    output = torch.empty((rows, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((rows, cols // inner_block_size), dtype=torch.uint8, device=x.device)
    return output.reshape(shape), scale.reshape(*shape[:-1], scale.shape[-1]).view(torch.float8_e8m0fnu)


def mxfp8_quantize_cuda(x, rowwise: bool = False, colwise: bool = True, scaling_mode: str = "rceil"):
    """torchao's ``mxfp8_quantize_cuda`` as its registered fake kernel (``_fake_mxfp8_quantize``) shapes the
    outputs of ``torchao::mxfp8_quantize`` with ``scale_dim_y = 32``."""
    import torch

    rows, cols = _rows_cols(x)
    _check_blocks("column cast", rows, cols, need_rows=True)
    if rowwise:
        out_row = x.new_empty(rows, cols, dtype=torch.float8_e4m3fn)
        scale_row = x.new_empty(rows, cols // BLOCK, 1, dtype=torch.float8_e8m0fnu)
    else:
        out_row = x.new_empty(0, dtype=torch.float8_e4m3fn)
        scale_row = x.new_empty(0, dtype=torch.float8_e8m0fnu)
    if colwise:
        out_col = torch.empty_strided((rows, cols), (1, rows), dtype=torch.float8_e4m3fn, device=x.device)
        scale_col = torch.empty_strided((cols, rows // BLOCK), (1, cols), dtype=torch.float8_e8m0fnu, device=x.device)
    else:
        out_col = x.new_empty(0, dtype=torch.float8_e4m3fn)
        scale_col = x.new_empty(0, dtype=torch.float8_e8m0fnu)
    return out_row, out_col, scale_row, scale_col


@contextlib.contextmanager
def kernel_stand_ins() -> Iterator[None]:
    """torchao's two MXFP8 cast kernels replaced by the stand-ins above while the step runs (always restored)."""
    with quiet_library_import():
        from torchao.prototype.mx_formats import kernels, mx_tensor
    saved = mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda
    mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda = triton_to_mxfp8_dim0, mxfp8_quantize_cuda
    try:
        yield
    finally:
        mx_tensor.triton_to_mxfp8_dim0, kernels.mxfp8_quantize_cuda = saved


@contextlib.contextmanager
def block_errors(recipe: Fp8) -> Iterator[None]:
    """torchao's own shape assertions (the emulated casts) as the user's error, not a crash."""
    try:
        yield
    except AssertionError as exc:
        if "divisible by block_size" in str(exc) or "block" in str(exc):
            raise MemestError(f"--fp8 {recipe}: torchao refuses an MXFP8 cast ({exc}); the real run fails the same "
                              f"way: every matmul operand dimension MXFP8 casts along (the tokens, batch x sequence, "
                              f"among them) must be a multiple of {BLOCK}") from None
        raise


@contextlib.contextmanager
def counting_matmuls(seen: set[int]) -> Iterator[None]:
    """The weights whose matmul took torchao's MXFP8 path (``_to_mxfp8_then_scaled_mm``, which the weight wrapper's
    ``__torch_function__`` calls for ``linear``/``mm``/``matmul``/``addmm``), by ``id`` of the high-precision weight.
    A wrapped weight read inside another op's torch function (nn.MultiheadAttention's ``out_proj`` inside
    ``F.multi_head_attention_forward``) is unwrapped by the wrapper's ``__torch_dispatch__`` and multiplied in high
    precision: it is not counted."""
    from torchao.prototype.moe_training import tensor

    original = tensor._to_mxfp8_then_scaled_mm

    def counted(input_hp, weight_hp, *args, **kwargs):
        seen.add(id(weight_hp))
        return original(input_hp, weight_hp, *args, **kwargs)

    tensor._to_mxfp8_then_scaled_mm = counted
    try:
        yield
    finally:
        tensor._to_mxfp8_then_scaled_mm = original


class MxFp8Feature(StepFeature):
    """Gives the built model's Linear layers torchao's MXFP8 weight wrapper (build hook); the report says how many."""

    name = "mxfp8"

    def __init__(self, recipe: Fp8) -> None:
        self.recipe = recipe
        self.skipped = ""
        self.converted = 0
        self.biased: set[int] = set()  # ids of the high-precision weights of converted Linears with a bias
        self.ran: set[int] = set()  # ids of the weights whose matmul took the MXFP8 path (counting_matmuls)
        self.replays: Replays | None = None

    def build(self, built, spec) -> None:
        self.converted, self.biased = convert(built.model, self.recipe, spec.fp8_skip)
        self.skipped = f" or named by --fp8-skip {spec.fp8_skip!r}" if spec.fp8_skip else ""
        if not self.converted:
            raise MemestError(f"--fp8 {self.recipe}: {built.where} has no nn.Linear layer whose dimensions are "
                              f"multiples of {BLOCK}, so none is converted; drop --fp8")

    def rules(self, step) -> TrackerRules:
        """torchao's weight wrapper is tracked by its inner tensor (``_data``; a wrapper owns no memory)."""
        from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

        return TrackerRules(subclass_types=(MXFP8TrainingWeightWrapperTensor,))

    def contexts(self, step) -> list[contextlib.AbstractContextManager]:
        stand_ins = [] if self.recipe == Fp8.MXFP8_EMULATED else [kernel_stand_ins()]
        return [block_errors(self.recipe), counting_matmuls(self.ran), *stand_ins, *self._replaying(step)]

    def _replaying(self, step) -> list[contextlib.AbstractContextManager]:
        """torchao's MXFP8 autograd function (forward and backward), casts and matmuls replayed from their first call with the same argument metadata
        (trace/replay.py): the same trace, most MXFP8 ops not run again. Not under --compile (Dynamo traces them)."""
        if step.spec.compile:
            return []
        from torchao.prototype.moe_training import mxfp8_linear
        from torchao.prototype.mx_formats import mx_tensor

        self.replays = Replays()
        patches = [
            (mx_tensor.MXTensor, "to_mx", "torchao MXTensor.to_mx"),
            (mxfp8_linear, "_to_mxfp8_dim1_kernel_wrapper", "torchao _to_mxfp8_dim1_kernel_wrapper"),
            (mx_tensor, "_addmm_mx_dispatch", "torchao _addmm_mx_dispatch"),
        ]
        if not any(feature.packs_saved for feature in step.features):  # (activation offloading: not replayed)
            patches += [(mxfp8_linear.mx_mm, "forward", "torchao mx_mm.forward"),
                        (mxfp8_linear.mx_mm, "backward", "torchao mx_mm.backward")]
        return [replaying(self.replays, patches)]

    def finish(self, step) -> list[str]:
        kernels = ("torchao's PyTorch casts and dequantized matmuls (KernelPreference.EMULATED)"
                   if self.recipe == Fp8.MXFP8_EMULATED else
                   f"its Triton and CUDA cast kernels (compute capability 10.0+) traced as stand-ins that allocate "
                   f"what torchao's code allocates ({KERNEL_SOURCES}), cuBLAS's MXFP8 torch._scaled_mm on fake tensors")
        ran = len(self.ran)
        outside = (f"; {self.converted - ran} other wrapped weights are read outside their Linear's forward (e.g. "
                   "nn.MultiheadAttention's out_proj) and torchao's wrapper multiplies them in high precision, in the "
                   "real run too") if ran < self.converted else ""
        dropped = len(self.ran & self.biased)
        bias = (f"; {dropped} of the MXFP8 Linears have a bias, which torchao 0.18's wrapper does not pass to the "
                "MXFP8 matmul (in the real run too: the bias gets no gradient)") if dropped else ""
        gather = ("; FSDP2 all-gathers each wrapped weight in high precision (torchao's fsdp_pre_all_gather: the "
                  "shard in MixedPrecisionPolicy's param dtype) and casts it at each matmul") if step.spec.world_size > 1 else ""
        return [
            f"--fp8 {self.recipe}: {ran} Linear layers traced with torchao's MXFP8 matmuls (MXFP8TrainingOpConfig "
            f"recipe {RECIPES[self.recipe]}; layers with a dimension that is not a multiple of {BLOCK}{self.skipped} "
            f"stay high precision{outside}{bias}){gather}; {kernels}. The figure is not measured on a GPU ({SOURCES[0]})"
        ]
