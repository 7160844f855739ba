"""Lower bounds of a pipeline layout's per-rank need, from traces of another layout, so `plan-parallel`
can leave a layout out before tracing it (memest/plan/parallel.py).

The activation floor. Under 1F1B with M = pp micro-batches (and under GPipe), a pipeline's first stage runs
the forward of every one of its M micro-batches before its first backward (torch's Schedule1F1B: warm-up
``min(M, pp - stage)`` forwards; GPipe: all forwards first). At that instant the rank holds, among other
storages,

- the activations of M micro-batches x D layers (its stage's layers), each micro-batch's bytes per layer
  the same (identical decoder layers, the same micro-batch shape), and
- its parameters and optimizer state (the step's second iteration: the optimizer state exists from the
  first optimizer step on; gradients do not, zero_grad(set_to_none=True)), at least the stage's layers'
  parameters x (bytes of parameter + optimizer state) / (dp x tp): FSDP2 pads its shards and TP keeps
  some parameters (norms) whole, both only add.

These two sets of storages are disjoint (one grows with the micro-batches in flight, the other does not),
so their sum is at most the live bytes at that instant, which are at most the step's peak allocated, which
is at most its need (the allocator replay's limit holds the peak; the CUDA context and libraries add).

The bytes per layer and micro-batch, ``a``, are measured on another pipeline layout with the same tensor
parallel degree and schedule, and FSDP2 over dp > 1 on both or on neither (what FSDP2 allocates inside a
layer per micro-batch, and autocast's cast cache of the parameters, could differ): its first stage traced
in m-stage pipelines of m micro-batches at m = 2 and 3; ``a`` = the live bytes allocated inside decoder
layers at the instant above, at m = 3 minus at m = 2, over the traced layers. Storages that do not grow
with m (parameters, a cast cache, FSDP2's unsharded parameters) cancel in the difference; what the
embedding and rotary tables hold per micro-batch is outside the layers and left out (the bound only
loses it). With data parallelism each rank's micro-batch is the same --batch, so ``a`` does not depend
on dp. tests/test_plan_parallel.py checks the floor against the traced need of every layout it could
rule out.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def in_flight_layer_bytes(trace, depth: int) -> int | None:
    """Live bytes allocated inside the ``depth`` decoder layers just before the last iteration's first
    backward (a pipeline stage's micro-batches in flight); None where the trace has no such instant or no
    module list of ``depth`` layers."""
    from memest.trace.events import Phase

    iteration = max((it for _, it, _ in trace.phase_marks), default=None)
    start = next((i for i, it, phase in trace.phase_marks if it == iteration and phase == Phase.BACKWARD), None)
    layers = _decoder_layers(trace, depth)
    if start is None or not layers:
        return None
    inside = re.compile("^(" + "|".join(re.escape(name) for name in layers) + r")(\.|$)")
    return sum(trace.storages[sid].nbytes for sid in trace.live_at(start - 1) if inside.match(trace.storages[sid].module))


def _decoder_layers(trace, depth: int) -> list[str]:
    """The shallowest module list of exactly ``depth`` numbered children (a decoder's layers)."""
    groups: dict[str, list[str]] = {}
    for name in trace.modules:
        parent, _, last = name.rpartition(".")
        if last.isdigit():
            groups.setdefault(parent, []).append(name)
    found = [names for parent, names in groups.items() if len(names) == depth]
    return min(found, key=lambda names: names[0].count("."), default=[])


@dataclass
class LayerBytes:
    """Bytes each micro-batch holds per decoder layer on a pipeline's first stage, measured on ``source``."""

    bytes_per_layer: int
    source: str


def layer_bytes(points: dict, depth: int, micros: tuple[int, ...], source: str) -> LayerBytes | None:
    """From a first stage's traced points ((depth, m) -> plan.parallel._Point, whose ``in_flight`` is
    ``in_flight_layer_bytes``) at two micro-batch counts."""
    if len(micros) < 2:
        return None
    low, high = (points[(depth, m)].in_flight for m in (micros[0], micros[-1]))
    if low is None or high is None or high <= low:
        return None
    return LayerBytes((high - low) // ((micros[-1] - micros[0]) * depth), source)


def activation_floor(per_layer: LayerBytes, depth: int, micro: int, layer_params: int, state_per_param: int,
                     dp: int, tp: int) -> int:
    """The first stage's live bytes before its first backward, from below (module docstring): ``micro``
    micro-batches x ``depth`` layers x the measured bytes, + the layers' parameters and optimizer state."""
    return micro * depth * per_layer.bytes_per_layer + depth * layer_params * state_per_param // (dp * tp)
