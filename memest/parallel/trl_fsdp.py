"""--preference over FSDP2 (--shard zero3 | zero2): trl's preference step as trl + accelerate shard it.

Source: trl 1.16.0, accelerate 1.15.0, torch 2.13. What a run with an accelerate FSDP2 config
(``fsdp_version: 2``, ``fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP``, ``fsdp_reshard_after_forward: true`` for
zero3, ``false`` for zero2) does to the two models of a preference step:

- the policy: HF Trainer's ``accelerator.prepare(model, optimizer)`` -> ``Accelerator._prepare_fsdp2``
  (accelerate/accelerator.py) -> ``fsdp2_prepare_model`` (accelerate/utils/fsdp_utils.py): ``fully_shard`` on every
  ``_no_split_modules`` layer (the decoder layers) with the plugin's ``reshard_after_forward``; the input embedding
  its own unit when untied; the final norm and the LM head one grouped unit with ``reshard_after_forward=False``;
  the root with ``reshard_after_forward`` left unset (torch's heuristic: the root does not reshard after forward).
  The optimizer's parameters are swapped for the sharded ones (in the same order).
- the reference copy (``--reference copy``: DPOTrainer.__init__ and KTOTrainer.__init__, ``self.ref_model =
  prepare_fsdp(self.ref_model, self.accelerator)``, trl/trainer/dpo_trainer.py line 988, kto_trainer.py line 996):
  ``prepare_fsdp`` (trl/models/utils.py lines 292-342) for ``fsdp_version == 2`` calls ``fully_shard(model, ...)``
  ONCE on the whole reference, with the plugin's ``reshard_after_forward``, offload policy and
  ``MixedPrecisionPolicy()``: no auto-wrap policy (only its FSDP1 branch calls ``set_auto_wrap_policy``), so the
  reference is one FSDP unit: its no_grad forward all-gathers every reference parameter at once and, with
  ``reshard_after_forward=True`` (explicit, so torch's root heuristic does not apply), frees them after the forward;
  with ``False`` (zero2) they stay gathered (the reference never runs a backward to reshard them).
- ``--reference adapter`` (a peft policy, no ``ref_model``: dpo_trainer.py line 909): the reference forward is the
  sharded policy with its adapter disabled; nothing else is wrapped. ``--reference precomputed``: under FSDP trl
  loads and shards a reference to precompute the log-probs, then drops it (``self.ref_model = None``, line 1033):
  the training step holds no reference.
- ORPO / CPO / SimPO (trl.experimental): no reference; HF Trainer prepares the policy alone.
- GRPO (trl/trainer/grpo_trainer.py): the reference copy (beta != 0) by the same ``prepare_fsdp`` (GRPOTrainer.__init__,
  lines 1183-1186); generation runs on the SHARDED policy: ``unwrap_model_for_generation`` (trl/models/utils.py) returns
  ``accelerator.unwrap_model(model)``, the FSDP2 module itself (its parameter gather is DeepSpeed ZeRO-3's only), and
  ``self._dist.summon_full_params`` is a no-op for FSDP2 (trl/distributed.py lines 74-91). HF Trainer registers
  ``generate`` as a forward method of the root (transformers 5.24.0 trainer.py lines 1798-1801,
  ``register_fsdp_forward_method``), so generate's root pre-forward gathers the root unit's own parameters and every
  decoding step's forward gathers the units one at a time: nothing unshards the whole policy for generate (zero3:
  one decoder layer at a time, freed after its forward, in every decoding step; zero2: every unit stays gathered
  after the prefill, until the training step's backward reshards it). trl's gathers over the ranks:
  features/grpo.py's ``_Accelerator``. Each gloo rank and each phase: tests/test_grpo_fsdp.py.

memest runs accelerate's own ``fsdp2_prepare_model`` and trl's own ``prepare_fsdp`` with a stand-in accelerator that
carries a real ``FullyShardedDataParallelPlugin`` (``_accelerator``); the trace (fake process group) and the gloo
ground truth (validate/distributed_truth.py) both wrap through here. Not trl's whole DPOTrainer: on CPU ranks
accelerate never enables FSDP (accelerate/state.py, AcceleratorState.__init__: the fsdp_plugin is read only in the
branch for MULTI_GPU / MULTI_XPU / ... distributed types, not MULTI_CPU), so a gloo run of the trainer would take its
DDP path; the step itself is memest's transcription of trl's compute_loss (features/preference*.py, proven on one
process in tests/test_preference.py and tests/test_preference_methods.py). Each gloo rank's peak:
tests/test_preference_fsdp.py.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from memest.errors import MemestError
from memest.features.grpo import GRPOStep
from memest.features.optim import make_optimizer
from memest.features.preference_logits import MarkedStep
from memest.spec import RunSpec
from memest.spec.choices import Precision, Shard

MIXED = {Precision.BF16_MIXED: "bf16"}  # accelerate's mixed_precision for memest's --precision (fp32, bf16: "no")
ACCELERATE_CONFIG = ("accelerate FSDP2 (fsdp_version 2, fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP, "
                     "fsdp_reshard_after_forward {reshard})")


def is_preference_step(model: nn.Module) -> bool:
    """A preference step module (features/preference*.py): a ``policy``, and a ``reference`` where the method has one."""
    return isinstance(model, MarkedStep) and isinstance(getattr(model, "policy", None), nn.Module)


def _accelerator(spec: RunSpec, mesh):
    """What ``fsdp2_prepare_model`` and ``prepare_fsdp`` read of an Accelerator: its state's FSDP plugin (a real
    ``FullyShardedDataParallelPlugin``, as ``accelerate launch`` builds it from the config), ``mixed_precision``
    ("no" for --precision fp32 / bf16; "bf16" for bf16-mixed, where AcceleratorState calls the plugin's
    ``set_mixed_precision("bf16")``: MixedPrecisionPolicy(param_dtype, reduce_dtype and output_dtype bfloat16), for the
    policy and the reference alike, and fsdp2_prepare_model upcasts trainable parameters to float32; no autocast:
    features/preference_feature.py PreferenceFeature.autocast), ``is_main_process``, ``device``, and the mesh both index
    with ``torch_device_mesh[tuple(parallelism_config.fsdp_dim_names)]``: ``mesh``, memest's 1-D data-parallel mesh
    over every rank (parallel/dims.py build_mesh), the mesh fully_shard builds by default when accelerate has no
    parallelism_config (torch/distributed/fsdp/_fully_shard/_fsdp_init.py ``_init_default_mesh``), built here by
    memest's one mesh builder (the default's rank table would need real values under the trace's fake tensors)."""
    try:
        from accelerate.utils import FullyShardedDataParallelPlugin
    except ImportError as exc:
        raise MemestError(f"--preference {spec.preference} --shard {spec.shard} wraps with accelerate's own FSDP2 "
                          f"code; install accelerate (pip install 'memest[trl]'): {exc}") from exc
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=spec.shard == Shard.ZERO3, auto_wrap_policy="transformer_based_wrap",
        cpu_ram_efficient_loading=False)
    mixed = MIXED.get(spec.precision, "no")
    if mixed != "no":  # accelerate/state.py AcceleratorState.__init__: fsdp_plugin.set_mixed_precision(mixed_precision)
        plugin.set_mixed_precision(mixed)
    state = types.SimpleNamespace(fsdp_plugin=plugin)
    device = torch.device("cpu")
    names = tuple(mesh.mesh_dim_names)
    return types.SimpleNamespace(state=state, mixed_precision=mixed, is_main_process=True, device=device,
                                 torch_device_mesh={names: mesh},
                                 parallelism_config=types.SimpleNamespace(fsdp_dim_names=list(names)))


def wrap(step: nn.Module, spec: RunSpec, mesh):
    """``step``'s policy as accelerate shards it, its reference copy as trl's ``prepare_fsdp`` does, in place. Returns
    the optimizer over the policy's sharded trainable parameters, a description, and the FSDP units' names (for
    ``distributed.Parallel``; the step module is called as is)."""
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
    from trl.models.utils import prepare_fsdp

    accelerator = _accelerator(spec, mesh)
    policy = fsdp2_prepare_model(accelerator, step.policy)
    if policy is not step.policy:  # in place (cpu_ram_efficient_loading is off): the step keeps calling it
        raise MemestError("accelerate's fsdp2_prepare_model returned another module")
    if hasattr(policy, "generate"):  # HF Trainer's _inner_training_loop under FSDP (transformers 5.24.0
        # trainer.py lines 1798-1801, "Fix `got mixed torch.Tensor and DTensor` error in model.generate() for FSDP2 with
        # LoRA"): generate becomes one of the root's forward methods, its pre-forward all-gathers the root unit's
        # parameters (a peft policy's final norm: accelerate's _find_final_norm does not find it under PeftModel)
        register_fsdp_forward_method(policy, "generate")
    reference = getattr(step, "reference", None)
    if reference is not None:
        prepare_fsdp(reference, accelerator)  # fully_shard in place, then .eval()
    units = [name for name, module in step.named_modules() if isinstance(module, FSDPModule)]
    generates = isinstance(step, GRPOStep)
    params = [p for p in step.policy.parameters() if p.requires_grad]
    reshard = spec.shard == Shard.ZERO3
    what = (f"trl + {ACCELERATE_CONFIG.format(reshard=str(reshard).lower())}: the policy by accelerate's "
            f"fsdp2_prepare_model ({sum(u.startswith('policy') for u in units)} units)")
    if reference is not None:
        what += f", the reference copy by trl's prepare_fsdp (one unit, reshard_after_forward={reshard})"
    if generates:
        what += "; generate on the sharded policy (registered as a root forward method, as HF Trainer does)"
    return make_optimizer(spec, params), what, units
