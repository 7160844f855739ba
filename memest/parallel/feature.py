"""Data and model parallelism as a step feature: the step as one rank of --world-size runs it.

The wrapping itself (DDP, ZeRO, FSDP2, TP, PP, CP, EP) is parallel/distributed.py's ``wrap``, shared with
the real multi-process ground truth; this module plugs it into the traced step."""

from __future__ import annotations

import contextlib

from memest.errors import MemestError, TraceError
from memest.features.base import StepFeature
from memest.parallel import distributed, fsdp1
from memest.spec.choices import FsdpVersion, Shard
from memest.trace.tracker import TrackerRules


class ParallelFeature(StepFeature):
    """--world-size/--shard/--offload/--tp/--pp/--cp/--ep: a fake process group around the build, the model
    wrapped (rank ``spec.rank``'s part), DTensor and collective rules for the tracker, FSDP's instrumentation
    while the step runs, and the CPU-offloaded state contributed to host memory."""

    name = "parallel"

    def __init__(self) -> None:
        self.parallel: distributed.Parallel | None = None

    @staticmethod
    def _data_parallel(spec) -> bool:
        return spec.world_size > 1 and spec.training  # inference ranks are plain replicas

    def session(self, spec) -> contextlib.AbstractContextManager:
        if not self._data_parallel(spec):
            return contextlib.nullcontext()
        return distributed.fake_process_group(spec.world_size, rank=spec.rank)

    def prepare(self, step) -> contextlib.AbstractContextManager | None:
        """The model wrapped; the wrapper is dropped with the model, when the returned context exits."""
        spec, trace = step.spec, step.trace
        if not self._data_parallel(spec):
            return None
        if not any(p.requires_grad for p in step.model.parameters()):
            # frozen: no gradients to synchronise, plain replicas (DDP refuses it)
            trace.notes.append(
                f"every parameter is frozen: the {spec.world_size} ranks are plain replicas"
                + (f" (--shard {spec.shard} has nothing to shard)" if spec.shard != Shard.NONE else "")
            )
            return None
        self.parallel = parallel = _wrap(step.where, spec, step.model)
        trace.parallel, trace.shard_units = parallel.description, list(parallel.units)
        step.runnable, step.wrapper, step.optimizer_state = parallel.module, parallel.wrapper, parallel.optimizer_state
        if parallel.shard_inputs is not None:  # --cp: this rank's part of the sequence
            step.inputs = parallel.shard_inputs(step.inputs)
        released = contextlib.ExitStack()
        released.callback(setattr, self, "parallel", None)
        return released

    def optimizer(self, step):
        return self.parallel.optimizer if self.parallel is not None else None

    def rules(self, step) -> TrackerRules:
        return distributed.tracker_rules(step.spec) if self.parallel is not None else TrackerRules()

    def register(self, step) -> None:
        if self.parallel is not None:
            distributed.register_buffers(step.tracker, self.parallel)

    def contexts(self, step) -> list:
        if self.parallel is None:
            return []
        if step.spec.fsdp_version == FsdpVersion.V1:
            # the wrap's device allocations, rebuilt now that the shards have their storage ids
            wrap = fsdp1.load_events(self.parallel.module, step.spec, step.tracker.storage_id)
            step.trace.load_events, step.trace.load_marks = wrap.events, wrap.marks
            step.trace.notes.append(wrap.what)
        contexts = [distributed.instrument(step.tracker, step.spec, step.owner_of_param)]
        if self.parallel.step_context is not None:  # --cp: the ring attention
            contexts.append(self.parallel.step_context())
        return contexts

    def host(self, trace, spec) -> list[int]:
        return distributed.offloaded(trace, spec)

    def finish(self, step) -> list[str]:
        step.trace.world_size, step.trace.rank = step.spec.world_size, step.spec.rank
        return []


def _wrap(where: str, spec, model) -> distributed.Parallel:
    """The model wrapped for --world-size/--shard, as a TraceError if it cannot be."""
    try:
        return distributed.wrap(model, spec, fake=True)
    except MemestError:
        raise
    except Exception as exc:
        raise TraceError(
            f"{where}: wrapping the model for --shard {spec.shard} (--world-size {spec.world_size}) raised "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from exc


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
