"""--tp N / --sp: the model parallelised with torch's own tensor-parallel API
(``torch.distributed.tensor.parallel.parallelize_module``), on the tensor-parallel dimension of the
rank's DeviceMesh (parallel/distributed.py builds the mesh: a fake process group while tracing, gloo in
the real ground truth). Shared by the trace and validate/distributed_truth.py, so both run one plan.

Plans (module name -> parallel style), for transformers decoder models:

  --tp N         transformers' own ``config.base_model_tp_plan`` (e.g. LlamaConfig: q/k/v/gate/up
                 ``colwise``, o/down ``rowwise``), each string mapped to torch's style of the same
                 meaning (ColwiseParallel / RowwiseParallel); the model's ``_tp_plan`` for the head
                 (``lm_head: colwise_gather_output`` = ColwiseParallel(output_layouts=Replicate())),
                 unless the head is tied to the embedding. Embeddings and norms stay replicated.
  --tp N --sp    torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py,
                 ``apply_tp``) on transformers' module names: the embedding row-wise with a
                 sequence-sharded output, every norm SequenceParallel, attention and MLP inputs
                 all-gathered (PrepareModuleInput Shard(1) -> Replicate), o/down projections
                 reduce-scattered back to sequence shards (RowwiseParallel(output_layouts=Shard(1))),
                 the head column-wise from sequence shards. With loss parallel (torchtitan's default, on
                 unless ``parallelism.disable_loss_parallel``; --no-loss-parallel here) the head's output stays
                 sharded over the vocabulary (``ColwiseParallel(input_layouts=Shard(1),
                 output_layouts=Shard(-1), use_local_output=False)``: DTensor logits) and the step runs under
                 torch's ``loss_parallel()`` (distributed.py's step context, forward and backward, as
                 torchtitan's train_context), so transformers' loss (ForCausalLMLoss: float, shift, cross
                 entropy) runs on the rank's vocabulary shard; without it the head gathers whole logits
                 (``output_layouts=Replicate()``) and every rank computes the loss on them.

  --tp N         on a plan with transformers' own styles (the MoE families: Mixtral, Qwen2/3-MoE, OLMoE,
  (MoE plans)    DeepSeek-V3: ``packed_colwise`` for the experts' fused gate/up weight, ``moe_tp_experts`` for the
                 experts module, ``replicated_with_grad_allreduce``, ``rowwise_split_input``): transformers' own
                 tensor parallel (transformers/distributed/tensor_parallel.py, DTensor styles; the plan resolved as
                 from_pretrained(distributed_config=DistributedConfig(tp_size, fsdp_size)) does, embedding
                 vocabulary-sharded, ``apply_tensor_parallelism``), which runs on the fake process group as on gloo.

A model without such a plan is refused with the reason (model files: the plan would be theirs to write).
"""

from __future__ import annotations

import re

from torch import nn

from memest.errors import MemestError
from memest.spec import RunSpec
from memest.spec.parallel_dims import loss_parallel

# transformers' plan strings (transformers/integrations/tensor_parallel.py, ParallelInterface) that
# have a torch parallel style of the same meaning
_TORCH_STYLE = {"colwise", "rowwise", "colwise_gather_output"}


def tp_plan(model: nn.Module, spec: RunSpec) -> tuple[dict, str]:
    """(plan for parallelize_module, what it is in words)."""
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) if config is not None else None
    if not base:
        raise MemestError(
            f"--tp {spec.tp}: {type(model).__name__} has no tensor-parallel plan memest knows (transformers models whose "
            "config has base_model_tp_plan, e.g. Llama, Mistral, Qwen); a model file's plan is not guessed"
        )
    _check_heads(config, spec.tp)
    prefix = getattr(model, "base_model_prefix", "model")
    base_model = getattr(model, prefix, model)
    where = f"{prefix}." if base_model is not model else ""
    if spec.sp:
        lp = loss_parallel(spec)
        head = "loss parallel: vocabulary-sharded logits" if lp else "no loss parallel: the head gathers whole logits"
        return _titan_plan(model, where, config, lp), f"torchtitan's Llama TP plan with sequence parallel (apply_tp; {head})"
    unsupported = sorted({v for v in base.values() if v not in _TORCH_STYLE})
    if unsupported:  # transformers' own styles (MoE experts, packed gate/up): its own DTensor implementation
        plan = _transformers_plan(model, spec)
        styles = sorted(set(plan.values()) - _TORCH_STYLE - {"embedding_rowwise"})
        return plan, (
            f"transformers' own tensor parallel (base_model_tp_plan{' with ' + ', '.join(styles) if styles else ''}"
            f"{', experts by --ep' if spec.parallel.ep_enabled else ''}: transformers.distributed.tensor_parallel)"
        )
    plan = _expand({where + k: v for k, v in base.items()}, model)
    head = _untied_head(model)
    if head and (getattr(model, "_tp_plan", None) or {}).get(head) == "colwise_gather_output":
        plan[head] = "colwise_gather_output"
    return {k: _style(v) for k, v in plan.items()}, "transformers' base_model_tp_plan with torch's ColwiseParallel/RowwiseParallel"


class TransformersPlan(dict):
    """A plan of transformers' style names, applied with transformers' ``apply_tensor_parallelism``."""


def _transformers_plan(model: nn.Module, spec: RunSpec) -> TransformersPlan:
    """transformers' resolved TP plan (the config's base_model_tp_plan, the vocabulary-sharded embedding and the
    model's head rule; one entry per module or parameter), as from_pretrained with ``DistributedConfig(tp_size=tp,
    fsdp_size=dp)`` resolves it (DistributedMixin._resolve_parallel_plans)."""
    from transformers.distributed import DistributedConfig

    if not hasattr(model, "_resolve_parallel_plans"):
        raise MemestError(f"--tp {spec.tp}: {type(model).__name__} is not a transformers model with parallel plans")
    # with --ep, transformers drops the TP rules of the experts (its EP rules take precedence)
    plan, _, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=spec.tp, fsdp_size=spec.dp, ep_size=spec.ep))
    return TransformersPlan({k: v for k, v in plan.items() if _held(model, k)})


def _held(model: nn.Module, name: str) -> bool:
    """Whether a plan entry (a module or parameter name) is held by ``model``: a --pp stage holds the embedding only on
    the first stage, the head on the last (elsewhere None or nn.Identity; torchtitan's plan entries then match nothing)."""
    owner, _, leaf = name.rpartition(".")
    try:
        module = model.get_submodule(name)
    except AttributeError:
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            return False
        return isinstance(getattr(module, leaf, None), nn.Parameter)
    return module is not None and not isinstance(module, nn.Identity)


def _check_heads(config, tp: int) -> None:
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    for what, n in (("attention heads", heads), ("key/value heads", kv)):
        if n is not None and n % tp:
            raise MemestError(f"--tp {tp}: the model has {n} {what}, not divisible by {tp} (each rank needs whole heads)")


def _style(kind: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if kind == "colwise":
        return ColwiseParallel()
    if kind == "rowwise":
        return RowwiseParallel()
    return ColwiseParallel(output_layouts=Replicate())  # colwise_gather_output


def _expand(plan: dict[str, str], model: nn.Module) -> dict[str, str]:
    """Plan keys with ``*`` (``layers.*.mlp.up_proj``) -> the module names they match."""
    names = [n for n, _ in model.named_modules()]
    out: dict[str, str] = {}
    for pattern, kind in plan.items():
        rx = re.compile("^" + re.escape(pattern).replace(r"\*", r"\d+") + "$")
        matched = [n for n in names if rx.match(n)]
        if not matched:
            raise MemestError(f"tensor-parallel plan entry {pattern!r} matches no module of {type(model).__name__}")
        out.update(dict.fromkeys(matched, kind))
    return out


def _untied_head(model: nn.Module) -> str | None:
    head = getattr(model, "lm_head", None)
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if not isinstance(head, nn.Linear):  # none, or a pipeline stage's stand-in (nn.Identity)
        return None
    if (emb is not None and head.weight is emb.weight):
        return None
    return "lm_head"


def _titan_plan(model: nn.Module, where: str, config, loss_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    modules = dict(model.named_modules())
    layers = [n for n in modules if re.fullmatch(re.escape(where) + r"layers\.\d+", n)]
    needed = ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
              "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    missing = [f"{layers[0]}.{n}" for n in needed if layers and f"{layers[0]}.{n}" not in modules]
    base = getattr(model, where.rstrip("."), model) if where else model
    if not layers or missing or not hasattr(base, "embed_tokens") or f"{where}norm" not in modules:
        raise MemestError(
            f"--sp: {type(model).__name__} is not a Llama-style decoder (embed_tokens, layers.N.{{input_layernorm, self_attn."
            f"q/k/v/o_proj, post_attention_layernorm, mlp.gate/up/down_proj}}, norm); missing: {', '.join(missing) or 'layers'}"
        )
    plan = {
        f"{where}embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        f"{where}norm": SequenceParallel(),
    }
    head = _untied_head(model)
    if head is None and isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise MemestError("--sp: the LM head is tied to the embedding; torchtitan's plan shards them differently")
    if head:
        plan[head] = (
            ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False) if loss_parallel
            else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())
        )
    for layer in layers:
        plan.update({
            f"{layer}.input_layernorm": SequenceParallel(),
            f"{layer}.self_attn": PrepareModuleInput(
                input_kwarg_layouts={"hidden_states": Shard(1)}, desired_input_kwarg_layouts={"hidden_states": Replicate()},
            ),
            f"{layer}.self_attn.q_proj": ColwiseParallel(),
            f"{layer}.self_attn.k_proj": ColwiseParallel(),
            f"{layer}.self_attn.v_proj": ColwiseParallel(),
            f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{layer}.post_attention_layernorm": SequenceParallel(),
            f"{layer}.mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            f"{layer}.mlp.gate_proj": ColwiseParallel(),
            f"{layer}.mlp.up_proj": ColwiseParallel(),
            f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    # a --pp stage holds the embedding only on the first stage and the final norm and head on the last: the entries
    # it does not hold are left out, as for transformers' plans (_held)
    return {k: v for k, v in plan.items() if _held(model, k)}


def apply(model: nn.Module, spec: RunSpec, mesh) -> str:
    """Parallelise ``model`` in place on the 1-D tensor-parallel ``mesh``; what was applied, in words."""
    from torch.distributed.tensor.parallel import parallelize_module

    plan, what = tp_plan(model, spec)
    if isinstance(plan, TransformersPlan):
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        apply_tensor_parallelism(model, mesh, plan)
        return f"{what}, TP {spec.tp}"
    parallelize_module(model, mesh, plan)
    if spec.sp:
        _whole_positions(model, mesh)
    return f"{what}, TP {spec.tp}"


def _whole_positions(model: nn.Module, mesh) -> None:
    """With the embedding's output sharded on the sequence, transformers would number positions by the
    local shard's length (``arange(inputs_embeds.shape[1])``) and rotate queries of the whole sequence
    with the shard's cos/sin; torchtitan passes the whole sequence's positions, and so does this hook (a later
    pipeline stage, given its sequence shard as ``inputs_embeds``: the shard's length x tp)."""
    import torch

    base = getattr(model, getattr(model, "base_model_prefix", "model"), model)
    tp = mesh.size()

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if kwargs.get("position_ids") is not None:
            return args, kwargs
        if ids is not None:
            kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        elif kwargs.get("inputs_embeds") is not None:  # --pp: a later stage gets this rank's sequence shard
            embeds = kwargs["inputs_embeds"]
            kwargs["position_ids"] = torch.arange(embeds.shape[1] * tp, device=embeds.device).unsqueeze(0)
        return args, kwargs

    base.register_forward_pre_hook(hook, with_kwargs=True)
