"""--pp N: one pipeline stage's step, run by torch's own pipelining schedules
(``torch.distributed.pipelining``: PipelineStage + Schedule1F1B / ScheduleGPipe /
ScheduleInterleaved1F1B) on the stage's rank. Shared by the trace (a fake process group, rank =
``spec.pp_stage``) and validate/distributed_truth.py (gloo), so both run the same schedule.

The stage: a transformers decoder (embed_tokens, layers, norm, lm_head) with the layers of other stages
removed; the first stage keeps the embedding, the last the final norm and the LM head (their norm and
head are ``nn.Identity`` elsewhere, so a middle stage outputs hidden states). Layers are split evenly, the
first stages taking one more when N does not divide them (``--pp-split 3,3,2`` sets the counts).
``--batch`` is the micro-batch; a step runs ``--microbatches M`` of them (the schedule splits a batch of
M x --batch), and the schedule decides how many micro-batches' activations a stage holds at once
(1F1B: stage i at most min(M, N - i); GPipe: all M).

Adaptations for fake tensors, none of which changes memory: the stages are built with static shapes
(``input_args``/``output_args``: no shape exchange, which sends shapes as data) and the schedule's
start-up vote (a value read) is decided "static" as the real ranks decide it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..errors import MemestError
from ..spec import RunSpec


def split_layers(n_layers: int, spec: RunSpec) -> list[tuple[int, int]]:
    """[start, end) of each stage's layers (virtual stages for the interleaved schedule)."""
    stages = spec.pp * spec.pp_virtual
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
    """This rank's stages (one; two or more for the interleaved schedule): (stage index, module, layers).
    ``model`` is pruned in place for a single stage; virtual stages share its modules."""
    base = _decoder_parts(model)
    bounds = split_layers(len(base.layers), spec)
    n_stages = len(bounds)
    mine = list(range(spec.pp_stage, n_stages, spec.pp))  # interleaved: stage i, i + N, ...
    keep = sorted({k for s in mine for k in range(*bounds[s])})
    layers = base.layers
    first, last = 0 in mine, n_stages - 1 in mine
    out = []
    for s in mine:
        lo, hi = bounds[s]
        if len(mine) == 1:
            base.layers = nn.ModuleList([layers[k] for k in keep])
            if not first:
                base.embed_tokens = None
            if not last:
                base.norm = nn.Identity()
                model.lm_head = nn.Identity()
            out.append((s, StageModule(model, first), (lo, hi)))
        else:
            raise MemestError("--pp-schedule interleaved is not traced yet (one stage per rank: 1f1b, gpipe)")
    del keep
    return out


def _static_args(model: nn.Module, spec: RunSpec, stage: int, n_stages: int, seq: int):
    """Example (input, output) of one micro-batch for the stage, shapes only (no exchange)."""
    config = model.config
    dtype = next(p for p in model.parameters()).dtype  # the residual stream's dtype (fp32 weights under -mixed)
    hidden = torch.empty(spec.batch, seq, config.hidden_size, dtype=dtype)
    x = torch.empty(spec.batch, seq, dtype=torch.long) if stage == 0 else hidden
    out = hidden if stage < n_stages - 1 else torch.empty(spec.batch, seq, config.vocab_size, dtype=dtype)
    return (x,), (out.requires_grad_(),)


class PipelineStep:
    """One training step of this rank's pipeline stage: M micro-batches through the schedule; the
    optimizer step and zero_grad are the caller's (trace/step.run_iteration)."""

    def __init__(self, model: nn.Module, spec: RunSpec) -> None:
        (index, module, layers), = stage_modules(model, spec)
        self.model, self.spec = model, spec
        self.module, self.layers, self.index = module, layers, index
        self.first, self.last = index == 0, index == spec.pp - 1
        self.microbatches = spec.microbatches_per_step
        self.schedule = None
        self._batch = None

    def _schedule(self, seq: int):
        """The stage and its schedule, built at the first step (static shapes need the sequence length)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        model, spec, index, n = self.model, self.spec, self.index, self.spec.pp
        inputs, outputs = _static_args(model, spec, index, n, seq)
        stage = PipelineStage(self.module, index, n, torch.device("cpu"), input_args=inputs, output_args=outputs)
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[str(spec.pp_schedule)]
        vocab = model.config.vocab_size

        def loss_fn(out, labels):
            return model.loss_function(out, labels, vocab_size=vocab)

        schedule = cls(stage, n_microbatches=self.microbatches, loss_fn=loss_fn)
        if _fake(model) or dist.get_backend() == "fake":
            schedule._warmup_p2p = _static_vote
        return schedule


    def __call__(self, inputs: dict, mark=None) -> None:
        """``mark(phase)``: called as each micro-batch's forward and backward start (the trace's phases)."""
        if self._batch is None:  # M micro-batches of --batch: the data loader's batch for the step
            self._batch = tuple(inputs[k].repeat(self.microbatches, 1) for k in ("input_ids", "labels"))
        ids, labels = self._batch
        if self.schedule is None:
            self.schedule = self._schedule(ids.shape[1])
        self._mark_phases(mark)
        args = (ids,) if self.first else ()
        kwargs = {"target": labels, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)


    def _mark_phases(self, mark) -> None:
        from .events import Phase

        stage = self.schedule._stage
        for name, phase in (("forward_one_chunk", Phase.FORWARD), ("backward_one_chunk", Phase.BACKWARD)):
            original = getattr(type(stage), name)

            def marked(*args, _original=original, _phase=phase, **kwargs):
                if mark is not None:
                    mark(_phase)
                return _original(stage, *args, **kwargs)

            setattr(stage, name, marked)
        # the last stage's step ends by merging its micro-batches' outputs (torch's _merge_outputs: one
        # tensor of all M while the M chunks are held), marked as the loss phase's end of step
        merge = type(self.schedule)._merge_outputs

        def merged(*args, _schedule=self.schedule, **kwargs):
            if mark is not None:
                mark(Phase.LOSS)
            return merge(_schedule, *args, **kwargs)

        self.schedule._merge_outputs = merged


def _fake(model: nn.Module) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for p in model.parameters())


def _static_vote(stages, has_backward, p2p_done) -> None:
    """The schedule's start-up vote, as the ranks decide it when every stage has static shapes: the
    vote sends a value and reads it (``.item()``), which fake tensors do not have."""
    from torch.distributed.pipelining.stage import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def describe(step: PipelineStep, spec: RunSpec) -> str:
    lo, hi = step.layers
    parts = [f"layers {lo}-{hi - 1}" if hi > lo else "no layers"]
    if step.first:
        parts.insert(0, "embedding")
    if step.last:
        parts.append("norm + LM head + loss")
    return (
        f"pipeline stage {step.index} of {spec.pp} ({', '.join(parts)}), torch.distributed.pipelining "
        f"{'Schedule1F1B' if spec.pp_schedule == '1f1b' else 'ScheduleGPipe'}, {spec.microbatches_per_step} micro-batches of {spec.batch}"
    )
