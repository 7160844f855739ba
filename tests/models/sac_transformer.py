"""examples/transformer.py with a selective-checkpointing policy of its own (--checkpointing
selective:checkpoint_policy, or selective:SAVE_ADDMM for the list form)."""

import importlib.util
from pathlib import Path

import torch
from torch.utils.checkpoint import CheckpointPolicy

_path = Path(__file__).resolve().parents[2] / "examples" / "transformer.py"
_spec = importlib.util.spec_from_file_location("memest_example_transformer_for_sac", _path)
_example = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_example)

build_model = _example.build_model
example_inputs = _example.example_inputs
compute_loss = _example.compute_loss

_SAVED = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)


def checkpoint_policy(ctx, op, *args, **kwargs):
    """Save every matmul's and the CPU attention kernel's outputs (torchtitan's list has the CUDA attention kernels
    only), recompute the rest (norms, activations, dropout) in backward."""
    return CheckpointPolicy.MUST_SAVE if op in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


SAVE_ADDMM = [torch.ops.aten.addmm.default]  # the list form: torch saves these ops' outputs
NOT_A_POLICY = 3
