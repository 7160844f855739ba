"""--pp N: one pipeline rank's step, run by torch's own pipelining schedules
(``torch.distributed.pipelining``: PipelineStage + the schedule class of --pp-schedule,
parallel/pipeline_schedule.py) on the rank's stages. Shared by the trace (a fake process group, rank =
``spec.rank``) and validate/distributed_truth.py, so both run the same schedule.

A stage: a transformers decoder (embed_tokens, layers, norm, lm_head) with the layers of other stages
removed; the first stage keeps the embedding, the last the final norm and the LM head (their norm and
head are ``nn.Identity`` elsewhere, so other stages output hidden states). Layers are split evenly over
pp x stages-per-rank stages, the first stages taking one more when that does not divide them
(``--pp-split 3,3,2`` sets the counts). A rank with several stages (interleaved, V schedules) runs one
shallow copy of the model per stage, each holding its own layers (the modules are shared, not copied).
``--batch`` is the micro-batch; a step runs ``--microbatches M`` of them (the schedule splits a batch of
M x --batch), and the schedule decides how many micro-batches' activations a stage holds at once.

Pipeline x data / tensor parallel (torchtitan's recipe, torchtitan/distributed/pipeline_parallel.py):
the world is a ("pp", "dp", "tp") DeviceMesh; each stage's model is parallelised with TP on "tp"
(parallel/tensor_parallel.py), then FSDP2 ``fully_shard`` on "dp" (each layer and the stage module as
units, so PipelineStage sees an FSDPModule and defers the gradient reduce-scatter to the last
micro-batch, as torch's stage.py does), then wrapped in a PipelineStage on the "pp" group.

Adaptations for fake tensors, none of which changes memory: the stages are built with static shapes
(``input_args``/``output_args``: no shape exchange, which sends shapes as data) and the schedule's
start-up vote (a value read) is decided "static" as the real ranks decide it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from memest.errors import MemestError
from memest.parallel.pipeline_schedule import SCHEDULES, describe_in_flight, in_flight, rank_stages, torch_class
from memest.spec import RunSpec
from memest.spec.choices import PipelineSchedule
from memest.trace.dtype import HALF
from memest.trace.events import Phase


def split_layers(n_layers: int, spec: RunSpec) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers (pp x stages-per-rank stages)."""
    stages = spec.pp * spec.stages_per_rank
    if spec.pp_split:
        counts = [int(c) for c in spec.pp_split.split(",")]
        if len(counts) != stages or sum(counts) != n_layers or min(counts) < 0:
            raise MemestError(
                f"--pp-split {spec.pp_split}: give {stages} layer counts (one per stage) that add up to the model's {n_layers} layers"
            )
    else:
        if n_layers < stages:
            raise MemestError(f"--pp {spec.pp}: the model has {n_layers} layers, fewer than the {stages} stages")
        base, extra = divmod(n_layers, stages)
        counts = [base + (1 if i < extra else 0) for i in range(stages)]
    bounds, start = [], 0
    for c in counts:
        bounds.append((start, start + c))
        start += c
    return bounds


def _decoder_parts(model: nn.Module):
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    parts = [getattr(base, "embed_tokens", None), getattr(base, "layers", None), getattr(base, "norm", None), getattr(model, "lm_head", None)]
    if base is None or any(p is None for p in parts) or not isinstance(parts[1], nn.ModuleList):
        raise MemestError(
            f"--pp: {type(model).__name__} is not a transformers decoder memest can split into stages "
            "(embed_tokens, layers, norm, lm_head); model files are not split"
        )
    return base


class StageModule(nn.Module):
    """What a PipelineStage runs: the pruned model, from input ids (first stage) or hidden states."""

    def __init__(self, model: nn.Module, first: bool) -> None:
        super().__init__()
        self.module = model  # named like DDP's wrapper, so module names stay the model's own
        self.first = first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kwargs = {"input_ids": x} if self.first else {"inputs_embeds": x}
        return self.module(**kwargs, use_cache=False).logits


def stage_modules(model: nn.Module, spec: RunSpec) -> list[tuple[int, StageModule, tuple[int, int]]]:
    """This rank's stages (one; two or more for the interleaved and V schedules): (stage index, module,
    layers). ``model`` is pruned in place to this rank's layers (what the rank holds); a rank with several
    stages runs shallow copies of it, one per stage."""

    base = _decoder_parts(model)
    bounds = split_layers(len(base.layers), spec)
    n_stages = len(bounds)
    mine = rank_stages(spec.pp_schedule, spec.pp, spec.stages_per_rank, spec.pp_stage)
    empty = [s for s in mine if bounds[s][0] == bounds[s][1]]
    if empty and spec.pp_split:  # a user's split (the planner's proxy leaves only untraced stages empty)
        raise MemestError(
            f"--pp-split {spec.pp_split}: stage {empty[0]} holds no layer (an empty stage still takes a pipeline rank "
            "and a send/recv per micro-batch); give every stage at least one layer"
        )
    layers = list(base.layers)
    _prune(model, base, [layers[k] for s in mine for k in range(*bounds[s])], 0 in mine, n_stages - 1 in mine)
    if len(mine) == 1:
        return [(mine[0], StageModule(model, mine[0] == 0), bounds[mine[0]])]
    out = []
    for s in mine:
        part, part_base = _shallow(model), _shallow(base)
        part._modules[getattr(model, "base_model_prefix", "model")] = part_base
        _prune(part, part_base, layers[slice(*bounds[s])], s == 0, s == n_stages - 1)
        out.append((s, StageModule(part, s == 0), bounds[s]))
    return out


def _prune(model: nn.Module, base: nn.Module, layers: list, first: bool, last: bool) -> None:
    base.layers = nn.ModuleList(layers)
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        model.lm_head = nn.Identity()


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` sharing its parameters and submodules, with its own module, parameter and
    hook tables (so a stage's pruning and FSDP's hooks stay on its copy)."""
    import copy

    twin = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            twin.__dict__[key] = type(value)(value)
    return twin


def _static_args(model: nn.Module, spec: RunSpec, stage: int, n_stages: int, seq: int, dtype):
    """Example (input, output) of one micro-batch for the stage, shapes only (no exchange)."""
    config = model.config
    # with --sp the residual stream between stages is this rank's sequence shard (torchtitan's plan: the o/down
    # projections reduce-scatter to Shard(1) local tensors), the LM head's output the whole sequence
    if spec.sp and seq % spec.tp:
        raise MemestError(f"--pp with --sp: --seq {seq} must divide by --tp {spec.tp} (each stage sends its rank's "
                          "sequence shard; uneven shards are not traced)")
    hidden = torch.empty(spec.batch, seq // spec.tp if spec.sp else seq, config.hidden_size, dtype=dtype)
    x = torch.empty(spec.batch, seq, dtype=torch.long) if stage == 0 else hidden
    out = hidden if stage < n_stages - 1 else torch.empty(spec.batch, seq, config.vocab_size, dtype=dtype)
    return (x,), (out.requires_grad_(),)


def _stream_dtype(model: nn.Module, spec: RunSpec):
    """The residual stream's dtype between stages: the weights' (fp32 under autocast's -mixed), or the
    16-bit compute dtype when FSDP2's MixedPrecisionPolicy casts the weights (dp > 1)."""
    if spec.dp > 1 and spec.mixed:
        return HALF[spec.precision]
    return next(p for p in model.parameters()).dtype


class PipelineStep:
    """One training step of this rank's pipeline stages: M micro-batches through the schedule; the
    optimizer step and zero_grad are the caller's (trace/step.run_iteration). ``parallelize(module)``
    applies TP/FSDP2 to each stage module before its PipelineStage is built; ``group``: the "pp" group."""

    def __init__(self, model: nn.Module, spec: RunSpec, parallelize=None, group=None) -> None:
        self.parts = stage_modules(model, spec)
        self.dtype = _stream_dtype(model, spec)
        if parallelize is not None:
            for _, module, _ in self.parts:
                parallelize(module)
        self.model, self.spec, self.group = model, spec, group
        self.modules = [m for _, m, _ in self.parts]
        self.indices = [i for i, _, _ in self.parts]
        self.n_stages = spec.pp * spec.stages_per_rank
        self.first, self.last = 0 in self.indices, self.n_stages - 1 in self.indices
        self.microbatches = spec.microbatches_per_step
        self.schedule = None
        self._batch = None

    @property
    def module(self) -> nn.Module:
        return self.modules[0]

    def _schedule(self, seq: int):
        """The stages and their schedule, built at the first step (static shapes need the sequence length)."""
        from torch.distributed.pipelining import PipelineStage


        model, spec = self.model, self.spec
        stages = []
        for index, module, _ in self.parts:
            inputs, outputs = _static_args(model, spec, index, self.n_stages, seq, self.dtype)
            stages.append(PipelineStage(module, index, self.n_stages, torch.device("cpu"), input_args=inputs,
                                        output_args=outputs, group=self.group))
        vocab = model.config.vocab_size

        def loss_fn(out, labels):
            return model.loss_function(out, labels, vocab_size=vocab)

        cls = torch_class(spec.pp_schedule)
        try:
            if len(stages) == 1 and spec.pp_schedule in (PipelineSchedule.ONE_F_ONE_B, PipelineSchedule.GPIPE):
                schedule = cls(stages[0], n_microbatches=self.microbatches, loss_fn=loss_fn)
            else:
                schedule = cls(stages, n_microbatches=self.microbatches, loss_fn=loss_fn)
        except ValueError as exc:  # the schedule's own constraints (e.g. 1F1B: M >= N)
            raise MemestError(f"--pp-schedule {spec.pp_schedule} with --pp {spec.pp}, --microbatches {self.microbatches}: {exc}") from exc
        if _fake(model) or dist.get_backend(self.group) == "fake":
            schedule._warmup_p2p = _static_vote
        if not _fake(model) and dist.get_backend(self.group) == "fake":
            for stage in stages:
                _received_values(stage)
        return schedule, stages

    def __call__(self, inputs: dict, mark=None) -> None:
        """``mark(phase)``: called as each micro-batch's forward and backward start (the trace's phases)."""
        if self._batch is None:  # M micro-batches of --batch: the data loader's batch for the step
            self._batch = tuple(inputs[k].repeat(self.microbatches, 1) for k in ("input_ids", "labels"))
        ids, labels = self._batch
        self._mark = mark  # this step's (the patched stage methods call it)
        if self.schedule is None:
            self.schedule, stages = self._schedule(ids.shape[1])
            for stage in stages:
                _mark_phases(stage, lambda phase: self._mark(phase) if self._mark is not None else None)
            _mark_merge(self.schedule, lambda phase: self._mark(phase) if self._mark is not None else None)
        args = (ids,) if self.first else ()
        kwargs = {"target": labels, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)


def _mark_phases(stage, mark) -> None:

    for name, phase in (("forward_one_chunk", Phase.FORWARD), ("backward_one_chunk", Phase.BACKWARD),
                        ("backward_weight_one_chunk", Phase.BACKWARD)):
        original = getattr(type(stage), name)

        def marked(*args, _original=original, _phase=phase, **kwargs):
            if mark is not None:
                mark(_phase)
            return _original(stage, *args, **kwargs)

        setattr(stage, name, marked)


def _mark_merge(schedule, mark) -> None:
    """The last stage's step ends by merging its micro-batches' outputs (torch's ``_merge_outputs``: one tensor
    of all M while the M chunks are held), marked as the loss phase's end of step (plan/parallel.py fits the
    step's segments apart)."""

    merge = type(schedule)._merge_outputs

    def merged(*args, **kwargs):
        if mark is not None:
            mark(Phase.LOSS)
        return merge(schedule, *args, **kwargs)

    schedule._merge_outputs = merged


def _received_values(stage) -> None:
    """The real ground truth on a fake "pp" group (pytorch#132644): nothing arrives, so a received activation or
    gradient would hold whatever its buffer's memory held. A MoE router decides on those values how many rows each
    expert rank receives (parallel/expert_parallel.py), so they are set in place (no allocation) to what a stage of
    ``route_as``'s model sends: activations of ones (dimension 0 positive, as the embedding's output there; the router
    reads dimension 0 only) and zero gradients (the earlier stage's weights, routers included, keep their routing)."""

    def filled(retrieve, infos, value):
        def run(chunk):
            with torch.no_grad():
                for info in infos[chunk]:
                    if getattr(info, "buffer", None) is not None and not info.is_root_arg:
                        info.buffer.fill_(value)
            return retrieve(chunk)

        return run

    stage._retrieve_recv_activations = filled(stage._retrieve_recv_activations, stage.args_recv_info, 1.0)
    stage._retrieve_recv_grads = filled(stage._retrieve_recv_grads, stage.grad_recv_info, 0.0)


def _fake(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(getattr(p, "_local_tensor", p), FakeTensor) for p in model.parameters())


def _static_vote(stages, has_backward, p2p_done) -> None:
    """The schedule's start-up vote, as the ranks decide it when every stage has static shapes: the
    vote sends a value and reads it (``.item()``), which fake tensors do not have."""
    from torch.distributed.pipelining.stage import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def describe(step: PipelineStep, spec: RunSpec) -> str:

    parts = []
    for index, _, (lo, hi) in step.parts:
        what = [f"layers {lo}-{hi - 1}" if hi > lo else "no layers"]
        if index == 0:
            what.insert(0, "embedding")
        if index == step.n_stages - 1:
            what.append("norm + LM head + loss")
        parts.append(f"stage {index} ({', '.join(what)})")
    held = in_flight(spec.pp_schedule, spec.pp, spec.stages_per_rank, step.microbatches)[spec.pp_stage]
    return (
        f"pipeline rank {spec.pp_stage} of {spec.pp}: {'; '.join(parts)} of {step.n_stages}, torch.distributed.pipelining "
        f"{SCHEDULES[str(spec.pp_schedule)][0]}, {step.microbatches} micro-batches of {spec.batch}; by the schedule's own "
        f"action order it {describe_in_flight(held, step.microbatches)}"
    )
