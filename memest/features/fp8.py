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

Over FSDP2 ranks (``--world-size N --shard zero2|zero3``) the converted model is sharded by FSDP2 after
checkpointing, torchtitan's order (parallel/distributed.py ``_fsdp``). ``--fp8-all-gather high-precision`` (the
default) leaves the weights plain: FSDP2 all-gathers the high-precision shard and Float8Linear casts the gathered
weight. ``--fp8-all-gather float8`` sets ``Float8LinearConfig.enable_fsdp_float8_all_gather`` (torchtitan's
``float8.enable_fsdp_float8_all_gather``): torchao wraps each weight in ``WeightWithDynamicFloat8CastTensor``
(torchao/float8/fsdp_utils.py), whose ``fsdp_pre_all_gather`` casts the local shard to float8 (its amax
all-reduced over the mesh) and whose ``fsdp_post_all_gather`` wraps the gathered uint8 data and the scale as a
Float8TrainingTensor; FSDP2 runs those hooks itself. ``float8-precomputed`` also runs torchao's
``precompute_float8_dynamic_scale_for_fsdp`` after every optimizer step (torchtitan's
``float8.precompute_float8_dynamic_scale_for_fsdp``, an optimizer step post-hook): one all-reduce of every weight's
amax, the scales kept on the weights for the next all-gather. The tracker follows the wrapper by its inner tensor
(``rules``), as it follows DTensor's local one.
"""

from __future__ import annotations

import dataclasses

from memest.errors import MemestError
from memest.features.base import StepFeature
from memest.imports import quiet_library_import
from memest.spec.choices import Fp8AllGather
from memest.trace.replay import Replays, replaying
from memest.trace.tracker import TrackerRules

SOURCES = (
    "https://github.com/pytorch/ao/blob/main/torchao/float8/README.md",
    "torchao/float8/float8_linear_utils.py convert_to_float8_training; torchao/float8/float8_linear.py",
    "torchtitan/components/quantization/float8.py (Float8LinearConverter, module_filter_fn)",
)
DIM_MULTIPLE = 16  # torch._scaled_mm: both matrix dimensions multiples of 16 (torchao/float8/README.md)


def skip_parts(skip: str) -> list[str]:
    """--fp8-skip's name parts (comma-separated, blanks dropped)."""
    return [part.strip() for part in skip.split(",") if part.strip()]


def fp8_filter(module, fqn: str, skip: list[str] | None = None) -> bool:
    """convert_to_float8_training's module_filter_fn, torchtitan's ``module_filter_fn``
    (torchtitan/components/quantization/utils.py): nn.Linear layers whose dimensions are multiples of 16 and whose
    name contains none of ``skip`` (its ``filter_fqns``, --fp8-skip)."""
    return eligible_linear(module, fqn, DIM_MULTIPLE, skip)


def eligible_linear(module, fqn: str, multiple: int, skip: list[str] | None) -> bool:
    """An nn.Linear whose two dimensions are multiples of ``multiple`` and whose name contains none of ``skip``."""
    import torch

    return (isinstance(module, torch.nn.Linear) and module.in_features % multiple == 0
            and module.out_features % multiple == 0 and not any(part in fqn for part in skip or ()))


def convert(model, recipe: str, all_gather: Fp8AllGather = Fp8AllGather.HIGH_PRECISION, skip: str = ""):
    """``model`` with its eligible Linear layers converted to torchao's Float8Linear (in place); the count.
    ``all_gather`` other than high-precision: ``enable_fsdp_float8_all_gather`` (torchtitan sets it with
    ``dataclasses.replace`` on the recipe's config, torchtitan/components/quantization/float8.py)."""
    try:
        # torchao 0.18 prints "Failed to load ... _C_mxfp8 ..." for its CUDA-only extensions on a CPU machine
        with quiet_library_import():
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
            from torchao.float8.float8_linear import Float8Linear
    except ImportError as exc:
        raise MemestError(f"--fp8 {recipe} traces torchao's float8 training and needs torchao: pip install torchao "
                          f"({exc})") from exc
    config = Float8LinearConfig.from_recipe_name(recipe)
    if all_gather != Fp8AllGather.HIGH_PRECISION:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    parts = skip_parts(skip)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fp8_filter(m, fqn, parts))
    return sum(isinstance(m, Float8Linear) for m in model.modules())


class Fp8Feature(StepFeature):
    """Converts the built model's Linear layers (build hook); the report says how many."""

    name = "fp8"

    def __init__(self) -> None:
        self.converted = 0
        self.recipe = ""
        self.all_gather = Fp8AllGather.HIGH_PRECISION
        self.skipped = ""
        self.replays: Replays | None = None

    def build(self, built, spec) -> None:
        self.recipe, self.all_gather = str(spec.fp8), spec.fp8_all_gather
        self.skipped = f" or named by --fp8-skip {spec.fp8_skip!r}" if spec.fp8_skip else ""
        self.converted = convert(built.model, self.recipe, self.all_gather, spec.fp8_skip)
        if not self.converted:
            skipped = f" and whose name contains none of --fp8-skip {spec.fp8_skip!r}" if spec.fp8_skip else ""
            raise MemestError(f"--fp8 {self.recipe}: {built.where} has no nn.Linear layer whose dimensions are "
                              f"multiples of {DIM_MULTIPLE}{skipped}, so torchao converts none; drop --fp8")
        if self.all_gather != Fp8AllGather.HIGH_PRECISION:
            _refuse_weights_read_outside_forward(built.model, built.where, self.all_gather)

    def rules(self, step) -> TrackerRules:
        """Under the float8 all-gather, torchao's weight wrapper is tracked by its inner tensor (a wrapper subclass
        owns no memory of its own; FSDP2's DTensor holds it as its local tensor)."""
        if self.all_gather == Fp8AllGather.HIGH_PRECISION:
            return TrackerRules()
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

        return TrackerRules(subclass_types=(WeightWithDynamicFloat8CastTensor,))

    def contexts(self, step) -> list:
        """torchao's float8 Linear autograd function (forward and backward), its casts and matmuls replayed from
        their first call with the same argument metadata (trace/replay.py): the same trace, most float8 code not run
        again. Not under --compile (Dynamo traces torchao's functions itself)."""
        if step.spec.compile:
            return []
        import torch
        import torchao.float8.float8_linear as float8_linear
        from torchao.float8.float8_ops import FLOAT8_OPS_TABLE

        self.replays = Replays()
        patches = [(float8_linear, "hp_tensor_to_float8_dynamic", "torchao hp_tensor_to_float8_dynamic")]
        if not any(feature.packs_saved for feature in step.features):  # (activation offloading: saved tensors' own
            function = float8_linear.matmul_with_hp_or_float8_args    # unpack, not replayed)
            patches += [(function, "forward", "torchao matmul_with_hp_or_float8_args.forward"),
                        (function, "backward", "torchao matmul_with_hp_or_float8_args.backward")]
        patches += [(FLOAT8_OPS_TABLE, op, f"torchao float8 {op}") for op in (torch.ops.aten.mm.default,
                                                                               torch.ops.aten.matmul.default)
                    if op in FLOAT8_OPS_TABLE]
        return [replaying(self.replays, patches)]

    def finish(self, step) -> list[str]:
        gather = "" if step.spec.world_size < 2 else (
            "; FSDP2 all-gathers each weight in high precision" if self.all_gather == Fp8AllGather.HIGH_PRECISION else
            "; FSDP2 all-gathers each weight in float8 (enable_fsdp_float8_all_gather"
            + (", precompute_float8_dynamic_scale_for_fsdp after each optimizer step)"
               if self.all_gather == Fp8AllGather.FLOAT8_PRECOMPUTED else ")"))
        return [
            f"--fp8 {self.recipe}: {self.converted} Linear layers traced as torchao Float8Linear "
            "(convert_to_float8_training, Float8LinearConfig.from_recipe_name; layers with dimensions that are not "
            f"multiples of {DIM_MULTIPLE}{self.skipped} stay high precision{gather}). torchao's float8 tensors and saved tensors are "
            f"traced through torchao's own code; the figure is not measured on a GPU ({SOURCES[0]})"
        ]


def _refuse_weights_read_outside_forward(model, where: str, all_gather: Fp8AllGather) -> None:
    """nn.MultiheadAttention reads its out_proj's weight with F.linear, not through out_proj's forward: under the
    float8 all-gather that weight is a Float8TrainingTensor, whose addmm torchao refuses (torchao 0.18
    torchao/float8/float8_ops.py float8_addmm asserts; the real run fails the same way: seen on 2 gloo ranks, torch 2.13)."""
    import torch
    from torchao.float8.float8_linear import Float8Linear

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.MultiheadAttention) and isinstance(module.out_proj, Float8Linear):
            raise MemestError(
                f"--fp8-all-gather {all_gather}: {where}'s nn.MultiheadAttention {name or '(root)'} reads its "
                "out_proj weight with F.linear outside Float8Linear's forward, and torchao's float8 addmm refuses the "
                "all-gathered float8 weight there (the real run fails too); use --fp8-all-gather high-precision"
            )


def precompute_scales_hook(model):
    """torchtitan's post-optimizer hook: torchao's ``precompute_float8_dynamic_scale_for_fsdp(model)`` after every
    optimizer step (an ``Optimizer.register_step_post_hook`` callable), for --fp8-all-gather float8-precomputed."""
    with quiet_library_import():
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(optimizer, args, kwargs) -> None:
        precompute_float8_dynamic_scale_for_fsdp(model)

    return hook
