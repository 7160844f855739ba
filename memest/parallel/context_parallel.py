"""--cp N: context parallel, with torch's own ring attention (torch.distributed.tensor.experimental, torch 2.13:
``_context_parallel/_attention.py``), on the "cp" dimension of a ("dp", "cp") mesh; the parameters FSDP2-sharded
over every rank of it (dp x cp), as torchtitan shards them (``dp_shard_cp``); with --tp on a ("dp", "cp", "tp")
mesh, the --tp plan on "tp" and FSDP2 over the flattened dp x cp (parallel/distributed._context_parallel; the meshes
from parallel.dims.build_mesh). Shared by the trace (fake process group, fake tensors) and
validate/distributed_truth.py (gloo), so both run one step.

What a rank runs, as transformers' Trainer + accelerate run it (trainer.py ``_prepare_context_parallel_inputs``):

  inputs     ``input_ids``, ``labels``, ``shift_labels`` (labels shifted before sharding, so no token loses its
             target at a shard boundary) and ``position_ids`` (the whole sequence's positions), each cut on the
             sequence with torch's head-tail load balancer (``_HeadTailLoadBalancer``: rank r holds chunks r and
             2N-1-r of 2N) by ``_context_parallel_buffers``; the sequence must divide by 2N.
  attention  ``F.scaled_dot_product_attention`` patched as ``context_parallel()`` patches it (q, k, v become
             sequence-sharded DTensors, ``_enable_context_parallel_dispatcher_impl``), and the ring attention
             (``_templated_ring_attention`` and its backward) run by DTensor's custom op handlers. torch registers
             them for the CUDA SDPA ops only (``_sdpa_handler``: flash, efficient, cuDNN); ``cpu_ring_attention``
             adds the same template with the CPU flash op as its per-block kernel
             (``_scaled_dot_product_flash_attention_for_cpu`` and its backward), which ``--target cpu`` and the
             CPU ground truth run. ``--target cuda`` traces torch's own CUDA handlers (memest's targets/cuda/sdpa.py
             calls the CUDA backend's op on the fake tensors). Key/value blocks rotate by all-gather (torch's
             default) or all-to-all (``--cp-rotate``, torch's ``set_rotate_method``); gradients of k/v always by
             all-to-all (torch's backward).
  masks      positions are one sequence cut in pieces, not packed sequences: transformers' packed-sequence check
             (``find_packed_sequence_indices``, which would see the head-tail jump) is answered "one sequence"
             and the causal mask left to SDPA's ``is_causal``, what accelerate's pre-hook on every ``self_attn``
             (``_attach_context_parallel_hooks``) achieves after transformers has built and dropped the mask.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from memest.errors import MemestError
from memest.spec import RunSpec
from memest.spec.choices import CpRotate, Target

SEQ_DIM = 2  # q, k, v are (batch, heads, seq, head dim); torch's CP hard-codes it (``seq_dim = 2``)
ROUND_ROBIN = 2  # head-tail: each rank holds 2 chunks of the sequence (_HeadTailLoadBalancer)


def check_model(model: nn.Module, spec: RunSpec) -> None:
    """A transformers decoder on SDPA attention (the only path torch's CP patches)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl != "sdpa":
        raise MemestError(
            f"--cp {spec.cp}: {type(model).__name__} runs attention as {impl or 'its own code'}; torch's context "
            "parallel replaces F.scaled_dot_product_attention, so the model must use SDPA attention (transformers: "
            "attn_implementation='sdpa')"
        )


def shard_inputs(inputs, cp_mesh, spec: RunSpec):
    """This rank's share of a batch (see the module doc): a dict of ``input_ids`` / ``labels`` ->
    the same keys plus ``shift_labels`` and ``position_ids``, each (batch, seq / N)."""
    from torch.distributed.tensor.experimental._context_parallel._attention import _context_parallel_buffers
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    if not isinstance(inputs, dict) or "input_ids" not in inputs:
        raise MemestError(f"--cp {spec.cp}: context parallel shards a causal LM's input_ids (hf: text models)")
    ids = inputs["input_ids"]
    batch, seq = ids.shape
    full = dict(inputs)
    full["position_ids"] = torch.arange(seq, device=ids.device).expand(batch, seq)
    if "labels" in full:  # transformers' Trainer: shift before sharding (ForCausalLMLoss takes shift_labels)
        full["shift_labels"] = nn.functional.pad(full["labels"], (0, 1), value=-100)[:, 1:].contiguous()
    names = [k for k, v in full.items() if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq]
    balancer = _HeadTailLoadBalancer(seq, spec.cp, ids.device)
    shards = _context_parallel_buffers(cp_mesh, [full[k] for k in names], [1] * len(names), balancer)
    return {**full, **dict(zip(names, shards, strict=True))}


@contextlib.contextmanager
def ring_attention(cp_mesh, spec: RunSpec) -> Iterator[None]:
    """While the step runs: SDPA patched for CP (torch's monkey-patch mode, as ``context_parallel()``), the
    head-tail load balance and the rotate method set, the CPU flash op's ring handlers added, transformers'
    packed-sequence check answered; all restored at exit."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    saved = (cp._dispatch_mode, cp._cp_options.enable_load_balance, cp._cp_options.rotate_method)
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._cp_options.enable_load_balance = True
    cp._cp_options.rotate_method = (
        cp._RotateMethod.ALL_TO_ALL if spec.cp_rotate == CpRotate.ALLTOALL else cp._RotateMethod.ALL_GATHER
    )
    try:
        cp._enable_context_parallel_dispatcher_impl(seq_dim=SEQ_DIM, mesh=cp_mesh)
        ring_sdpa = F.scaled_dot_product_attention  # torch's patch: q, k, v become sequence-sharded DTensors
        if spec.target == Target.CPU:
            F.scaled_dot_product_attention = _cpu_flash_only(ring_sdpa)
        try:
            with cpu_ring_attention(), _one_sequence_per_row():
                yield
        finally:
            F.scaled_dot_product_attention = ring_sdpa  # torch restores the original by its own patch
            cp._disable_context_parallel_dispatcher_impl()
    finally:
        cp._dispatch_mode, cp._cp_options.enable_load_balance, cp._cp_options.rotate_method = saved


def _cpu_flash_only(ring_sdpa):
    """The CPU ring runs where SDPA picks the CPU flash kernel; where it would pick the math path (dropout, which
    ``use_flash_attention_cpp`` rejects: aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, check_for_dropout),
    torch has no ring for it and a real run fails inside DTensor ("got mixed torch.Tensor and DTensor")."""

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        if dropout_p > 0:
            raise MemestError(
                f"--cp on --target cpu: attention dropout {dropout_p} makes CPU SDPA take the math path, which torch's "
                "context parallel has no ring for (a real run raises 'got mixed torch.Tensor and DTensor'); set the "
                "model's attention dropout to 0 (attention_dropout / attn_pdrop), or use --target cuda"
            )
        return ring_sdpa(query, key, value, attn_mask, dropout_p, *args, **kwargs)

    return sdpa


@contextlib.contextmanager
def cpu_ring_attention() -> Iterator[None]:
    """DTensor custom handlers for the CPU flash-attention op and its backward: torch's ring template with the
    CPU op as the per-block kernel (what ``_scaled_dot_product_ring_flash_attention`` does for the CUDA op)."""
    from torch.distributed.tensor import DTensor

    aten = torch.ops.aten
    dispatcher = DTensor._op_dispatcher
    added = {
        aten._scaled_dot_product_flash_attention_for_cpu.default: _cpu_flash_forward,
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _cpu_flash_backward,
    }
    previous = dispatcher._custom_op_handlers
    dispatcher._custom_op_handlers = {**previous, **added}
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = previous


def _local(args: tuple) -> tuple:
    """The DTensor arguments as their local shards (all on the cp mesh, Shard(2)) and that mesh."""
    from torch.distributed.tensor import DTensor, Shard

    mesh, out = None, []
    for a in args:
        if isinstance(a, DTensor):
            if a.placements != (Shard(SEQ_DIM),):
                raise MemestError(f"context parallel: attention input placed {a.placements}, expected Shard({SEQ_DIM})")
            mesh = a.device_mesh
            a = a._local_tensor
        out.append(a)
    return tuple(out), mesh


def _wrap(tensors, mesh):
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    placements = (Shard(SEQ_DIM),)
    out = []
    for t in tensors:
        shape, stride = compute_global_tensor_info(t, mesh, placements)
        spec = DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), t.dtype))
        out.append(DTensor(t, spec, requires_grad=False))
    return tuple(out)


def _cpu_flash_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention

    (query, key, value, *rest), mesh = _local(args)
    dropout_p = rest[0] if rest else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    if kwargs.get("attn_mask") is not None:
        raise MemestError("context parallel: torch's ring attention takes no attn_mask (causal masks only)")
    out, lse = _templated_ring_attention(
        mesh.get_group(), SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
        query=query, key=key, value=value, is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"),
    )
    return _wrap((out, lse), mesh)


def _cpu_flash_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention_backward,
    )

    (grad_out, query, key, value, out, lse, dropout_p, is_causal), mesh = _local(args)
    grads = _templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value, out=out, logsumexp=lse,
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"),
    )
    return _wrap(grads[:3], mesh)


@contextlib.contextmanager
def _one_sequence_per_row() -> Iterator[None]:
    try:
        from transformers import masking_utils as mu
    except ImportError:
        yield
        return
    original = getattr(mu, "find_packed_sequence_indices", None)
    if original is None:
        yield
        return

    def one_sequence(position_ids):
        return None  # a head-tail shard of one sequence, not packed sequences

    mu.find_packed_sequence_indices = one_sequence
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = original
