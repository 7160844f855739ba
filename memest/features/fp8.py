"""--fp8 tensorwise|rowwise: torchao's float8 training, traced through torchao's own modules.

The model's ``nn.Linear`` layers are replaced by ``torchao.float8.convert_to_float8_training`` (torchao 0.18,
``torchao/float8/float8_linear_utils.py``) with ``Float8LinearConfig.from_recipe_name(recipe)``, as torchtitan's
``Float8LinearConverter`` (torchtitan/components/quantization/float8.py) does before checkpointing and FSDP. The
filter is torchtitan's ``auto_filter_small_kcn``'s hard rule: a layer is converted only where both of its dimensions
are multiples of 16 (``torch._scaled_mm``'s layout rule; torchao/float8/README.md); the others stay nn.Linear.

Nothing is modelled by formula: the trace runs ``Float8Linear.forward`` and its autograd function
(``torchao/float8/float8_linear.py`` matmul_with_hp_or_float8_args) on fake tensors, so the high-precision
weight kept as the parameter, the float8 casts (``Float8TrainingTensor`` ``_data`` 1 B/element and ``_scale``
float32: one per tensor, tensorwise; one per row, rowwise), the transposed copies made for the backward matmuls
and what autograd saves (torchao saves the high-precision input and weight and re-casts them in backward) are the
storages torchao allocates. ``torch._scaled_mm`` has a fake kernel in torch; its CUDA workspace (cuBLASLt's, the
same pool as every matmul) is the CUDA target's matmul workspace, not a separate constant.
"""

from __future__ import annotations

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.imports import quiet_library_import

SOURCES = (
    "https://github.com/pytorch/ao/blob/main/torchao/float8/README.md",
    "torchao/float8/float8_linear_utils.py convert_to_float8_training; torchao/float8/float8_linear.py",
    "torchtitan/components/quantization/float8.py (Float8LinearConverter, module_filter_fn)",
)
DIM_MULTIPLE = 16  # torch._scaled_mm: both matrix dimensions multiples of 16 (torchao/float8/README.md)


def fp8_filter(module, fqn: str) -> bool:
    """convert_to_float8_training's module_filter_fn: nn.Linear layers whose dimensions are multiples of 16."""
    import torch

    return (isinstance(module, torch.nn.Linear) and module.in_features % DIM_MULTIPLE == 0
            and module.out_features % DIM_MULTIPLE == 0)


def convert(model, recipe: str):
    """``model`` with its eligible Linear layers converted to torchao's Float8Linear (in place); the count."""
    try:
        # torchao 0.18 prints "Failed to load ... _C_mxfp8 ..." for its CUDA-only extensions on a CPU machine
        with quiet_library_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise MemestError(f"--fp8 {recipe} traces torchao's float8 training and needs torchao: pip install torchao "
                          f"({exc})") from exc
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=fp8_filter)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


class Fp8Feature(StepFeature):
    """Converts the built model's Linear layers (build hook); the report says how many."""

    name = "fp8"

    def __init__(self) -> None:
        self.converted = 0
        self.recipe = ""

    def build(self, built, spec) -> None:
        self.recipe = str(spec.fp8)
        self.converted = convert(built.model, self.recipe)
        if not self.converted:
            raise MemestError(f"--fp8 {self.recipe}: {built.where} has no nn.Linear layer whose dimensions are "
                              f"multiples of {DIM_MULTIPLE}, so torchao converts none; drop --fp8")

    def finish(self, step) -> list[str]:
        return [
            f"--fp8 {self.recipe}: {self.converted} Linear layers traced as torchao Float8Linear "
            "(convert_to_float8_training, Float8LinearConfig.from_recipe_name; layers with dimensions that are not "
            f"multiples of {DIM_MULTIPLE} stay high precision). torchao's float8 tensors and saved tensors are traced "
            f"through torchao's own code; the figure is not measured on a GPU ({SOURCES[0]})"
        ]
