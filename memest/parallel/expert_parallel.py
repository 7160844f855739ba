"""--ep N: expert parallelism for transformers' mixture-of-experts models, with transformers' own expert-parallel
code (transformers/distributed/expert_parallel.py, transformers 5.21+), on the expert mesh transformers builds
(transformers/distributed/utils.py, initialize_distributed_mesh: dense (fsdp, tp), experts (efsdp, ep), ep
innermost). Shared by the trace and validate/distributed_truth.py, so both run one implementation.

  experts     the config's ``base_model_ep_plan`` (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...): ``grouped_gemm``
              shards each layer's 3-D expert weights in dim 0 (Shard(0) on the ep mesh: num_experts / ep whole
              experts per rank); ``ep_dispatch_experts`` runs transformers' ``AllToAllEP``: each (token, expert)
              pair sorted by expert and sent to the expert's rank with ``all_to_all_single`` (the counts first, one
              host read of the split sizes), the experts run on what arrived, the outputs sent back with a second
              all-to-all and weighted on the sender. Shared experts and the router stay dense.
  data        FSDP2 as transformers applies it with ep (distributed/fsdp.py, apply_fully_sharded_data_parallelism):
              each experts module ``fully_shard``-ed on the efsdp mesh (world / ep copies of each expert group),
              gradient divide factor = the data-parallel size, sum reduction when efsdp > 1; then memest's FSDP2
              units (the blocks, the root) on every data-parallel rank.
  with --tp   transformers' TP plan without the experts' rules (parallel/tensor_parallel.py), then EP (ep a multiple
              of tp: each rank of a TP group dispatches its slice of the shared batch), then FSDP over dp, the
              order of transformers' DistributedMixin.maybe_distribute_model.

Activations are not divided by ep: each rank runs its own batch. What each rank receives is data-dependent
(the router's choices). The trace answers AllToAllEP's one value read (the split sizes, ``tolist()``) with an
assumption (``spec.ep_routing``): ``uniform`` (each rank gets 1/ep of every rank's pairs, the expected balanced
router) or ``one-rank`` (every rank sends all its pairs to the traced rank: ep x tokens x top-k rows arrive and
run through its experts, the high end). The estimate traces both (estimator.py) and reports them as a range.
The real CPU runs of a routing (``route_as``) set router weights that make exactly that split for every token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from memest.errors import MemestError
from memest.spec import RunSpec
from memest.spec.choices import ExpertRouting

IMPLEMENTATION = "memest_assumed_routing"  # registered with transformers' EPImplementationInterface for the trace


def expert_counts(config) -> tuple[int, int]:
    """(routed experts per MoE layer, experts per token) of a transformers config object or its dict (config.json): the
    names the MoE families use (Mixtral ``num_local_experts``, Qwen-MoE / OLMoE ``num_experts``, DeepSeek-V3
    ``n_routed_experts``; ``num_experts_per_tok`` for all). (0, 0) for a dense model."""
    get = config.get if isinstance(config, dict) else (lambda name: getattr(config, name, None))
    experts = get("num_local_experts") or get("num_experts") or get("n_routed_experts") or 0
    return int(experts), int(get("num_experts_per_tok") or 0)


def ep_plan(model: nn.Module, spec: RunSpec) -> dict[str, str]:
    """transformers' resolved expert-parallel plan (one entry per module or parameter), as from_pretrained with
    ``DistributedConfig(tp_size=tp, fsdp_size=dp, ep_size=ep)`` resolves it (DistributedMixin._resolve_parallel_plans)."""
    from transformers.distributed import DistributedConfig

    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_ep_plan", None) if config is not None else None
    if not plan or not hasattr(model, "_resolve_parallel_plans"):
        raise MemestError(
            f"--ep {spec.ep}: {type(model).__name__} has no expert-parallel plan (transformers MoE models whose config has "
            "base_model_ep_plan: Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V3, ...)"
        )
    experts, _ = expert_counts(config)
    if experts and experts % spec.ep:
        raise MemestError(f"--ep {spec.ep}: the model has {experts} experts per layer, not divisible by {spec.ep}")
    _, resolved, _ = model._resolve_parallel_plans(DistributedConfig(tp_size=spec.tp, fsdp_size=spec.dp, ep_size=spec.ep))
    return resolved


def apply(model: nn.Module, spec: RunSpec, ep_mesh, tp_mesh, fake: bool) -> list[str]:
    """Shard the experts and install the dispatch (transformers' apply_expert_parallelism); the experts modules'
    names. ``fake``: the trace's implementation, answering the split sizes with ``spec.ep_routing``."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    plan = ep_plan(model, spec)
    implementation = _register(spec) if fake else "all_to_all"
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan, ep_implementation=implementation)
    return [name for name, style in plan.items() if style == "ep_dispatch_experts"]


def split_sizes(routing: str, pairs: int, ep: int, rank: int) -> list[list[int]]:
    """[rows sent to each rank, rows received from each rank] of one all-to-all, for ``pairs`` (token, expert) pairs
    on every rank (the ranks run equal batches)."""
    if routing == ExpertRouting.ONE_RANK:
        return [[pairs if r == rank else 0 for r in range(ep)], [pairs] * ep]
    send = [pairs // ep + (r < pairs % ep) for r in range(ep)]
    return [send, [send[rank]] * ep]


def _register(spec: RunSpec) -> str:
    from transformers.distributed.expert_parallel import AllToAllEP, EPImplementationInterface

    routing = str(spec.ep_routing)

    class AssumedRouting(AllToAllEP):
        """transformers' AllToAllEP, its one value read (the split sizes) answered by the routing assumption."""

        def _dispatch_tokens(self, hidden_states, top_k_index, top_k_weights):
            # with --tp the ranks of a TP group share the batch and each sends its slice (Replicate -> Shard(0))
            rows = torch.arange(hidden_states.size(0), device="meta").chunk(self.tp_mesh.size())
            local = rows[self.tp_mesh.get_local_rank()].numel() if self.tp_mesh.get_local_rank() < len(rows) else 0
            pairs = local * top_k_index.size(-1)
            sizes = split_sizes(routing, pairs, self.ep_mesh.size(), self.ep_mesh.get_local_rank())
            with _split_sizes_read(sizes):
                return super()._dispatch_tokens(hidden_states, top_k_index, top_k_weights)

    EPImplementationInterface.register(IMPLEMENTATION, AssumedRouting)
    return IMPLEMENTATION


@contextlib.contextmanager
def _split_sizes_read(sizes: list[list[int]]) -> Iterator[None]:
    """``torch.stack([send_counts.sum(1), recv_counts.sum(1)]).tolist()`` on fake tensors returns ``sizes``."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = FakeTensor.tolist
    shape = (2, len(sizes[0]))

    def tolist(self):
        if tuple(self.shape) == shape:
            return [list(s) for s in sizes]
        return original(self)

    FakeTensor.tolist = tolist
    try:
        yield
    finally:
        FakeTensor.tolist = original


def fsdp_experts(model: nn.Module, names: list[str], spec: RunSpec, efsdp_mesh, kwargs: dict) -> None:
    """Each experts module its own FSDP2 unit on the efsdp mesh, as transformers' apply_fully_sharded_data_parallelism
    does with ep > 1 (its gradient covers every data-parallel rank's batch: divide by dp, summed when efsdp > 1)."""
    from torch.distributed.fsdp import fully_shard

    modules = dict(model.named_modules())
    for name in names:
        module = modules[name]
        fully_shard(module, **{**kwargs, "mesh": efsdp_mesh})
        module.set_gradient_divide_factor(float(spec.dp))
        if spec.expert_copies > 1:
            module.set_force_sum_reduction_for_comms(True)


def describe(spec: RunSpec, names: list[str]) -> str:
    copies = spec.expert_copies
    return (f"transformers' expert parallel (base_model_ep_plan, AllToAllEP) EP {spec.ep} over {len(names)} MoE layers, "
            f"{copies} cop{'ies' if copies > 1 else 'y'} of each expert group, routing traced {spec.ep_routing}")


# -- real ground truth ---------------------------------------------------------------------------
def route_as(model: nn.Module, spec: RunSpec) -> None:
    """Set the weights of a real model so its router makes ``spec.ep_routing``'s split for every token (the ground
    truth of a routing assumption): the embedding's dimension 0 set to 1 and attention and MLP/expert outputs to 0, so
    every MoE layer sees the embedding (dimension 0 positive after the norm); the router reads dimension 0 only,
    with a positive weight for the chosen experts: uniform, expert ``i`` of the top-k on rank ``i % ep``; one-rank,
    the top-k experts all on rank 0. Values change no allocation but the all-to-all's split sizes."""
    experts, top_k = expert_counts(model.config)
    per_rank = experts // spec.ep
    if spec.ep_routing == ExpertRouting.ONE_RANK:
        chosen = list(range(top_k))
    else:
        chosen = [(i % spec.ep) * per_rank + i // spec.ep for i in range(top_k)]
    if max(chosen) >= experts or (spec.ep_routing == ExpertRouting.ONE_RANK and top_k > per_rank):
        raise MemestError(f"cannot route top-{top_k} of {experts} experts as {spec.ep_routing} over EP {spec.ep}")
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] = 1.0
        for name, p in model.named_parameters():
            if name.endswith(("self_attn.o_proj.weight", "experts.down_proj", "down_proj.weight")):  # + shared experts
                p.zero_()
            elif name.endswith("mlp.gate.weight"):
                p.zero_()
                p[chosen, 0] = 10.0
