"""`memest whatif`: peaks and device usage over a grid of batch sizes and sequence lengths.

A sweep does not trace every point. A model's step runs the same ops in the same order at every
size; only the storages' sizes change, and each storage's size is a polynomial in the batch B and
sequence s (products of dimensions: constants for weights and optimizer state, B·s for activations,
B·s² for materialised attention scores, s² for masks). So memest traces a few design points, fits
every storage's size with
    bytes = a + b·s + c·s² + B·(d + e·s + f·s²)
(least squares; exact when the sizes follow that form), and for any other grid point rebuilds the
trace with the predicted sizes: its peak is exact, and its device usage comes from replaying that
trace through the caching-allocator model, as for a traced point. One interpolated point is traced
directly and compared; if the ops differ between sizes, or the check fails (> 1%), every grid point
is traced directly instead, and the report says so.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import asdict, dataclass, field

from memest.device.usage import device_usage
from memest.errors import MemestError
from memest.plan.runner import Runner
from memest.spec.choices import Target
from memest.trace.events import Trace
from memest.units import format_bytes

MAX_GRID_POINTS = 400
FIT_TOLERANCE = 0.01


@dataclass
class GridPoint:
    batch: int
    seq: int | None
    peak_bytes: int  # tensor peak (peak allocated)
    needed_bytes: int  # smallest device budget the step runs in (cuda) or peak allocated (cpu)
    fits: bool | None  # None without a budget
    traced: bool  # traced directly (True) or rebuilt from the fit (False)


@dataclass
class Sweep:
    points: list[GridPoint]
    verification: dict | None  # batch, seq, predicted vs traced peak and device usage, errors
    fallback: str  # why every point was traced ('' when the fit was used)
    traces: int
    largest_batch: int | None = None  # at seq largest_batch_at_seq
    largest_seq: int | None = None  # at batch largest_seq_at_batch
    largest_batch_at_seq: int | None = None
    largest_seq_at_batch: int | None = None
    plain_words: list[str] = field(default_factory=list)
    largest_from: str = ""  # "fit" (the fitted sizes), "grid" (the largest traced point that fits: no fit here), ""

    def to_dict(self) -> dict:
        return asdict(self)


def parse_sizes(text: str | None, flag: str) -> list[int] | None:
    if text is None:
        return None
    values = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise MemestError(f"{flag} {text!r}: {item!r} is not a whole number >= 1; use a list such as 512,1024,2048")
        values.append(int(item))
    return sorted(set(values))


def _features(batch: float, seq: float) -> list[float]:
    return [1.0, seq, seq * seq, batch, batch * seq, batch * seq * seq]


def _design(values: list, count: int) -> list:
    if len(values) <= count:
        return list(values)
    picks = {values[0], values[-1]}
    while len(picks) < count:  # fill with the value farthest from those picked
        picks.add(max(values, key=lambda v: min(abs(v - p) for p in picks)))
    return sorted(picks)


def _structure(trace: Trace) -> tuple:
    """What a fitted trace copies from its template unchanged: equal at every design point, or no fit. The record_stream
    marks and the events before the step (FSDP1's wrap) are copied whole, so they must match too."""
    return (len(trace.storages), tuple((sid, delta > 0) for sid, delta in trace.events),
            tuple(m[:2] for m in trace.phase_marks), tuple((c.event, c.every) for c in trace.empty_caches),
            tuple(trace.stream_marks), tuple(trace.load_events), tuple(trace.load_marks))


class SizeModel:
    """Every storage's size as a polynomial of (batch, seq), fitted on traces of identical structure."""

    def __init__(self, traces: dict[tuple, Trace], active: list[int]) -> None:
        import torch

        self.template = next(iter(traces.values()))
        self.active = active
        keys = list(traces)
        x = torch.tensor([[_features(b, s or 0)[i] for i in active] for b, s in keys], dtype=torch.float64)
        sizes = torch.tensor([[r.nbytes for r in traces[k].storages] for k in keys], dtype=torch.float64)
        self.coeffs = torch.linalg.lstsq(x, sizes, driver="gelsd").solution  # (features, storages)
        self.residual = float((x @ self.coeffs - sizes).abs().max()) if len(keys) else 0.0

    def sizes(self, batch: int, seq: int | None) -> list[int]:
        import torch

        x = torch.tensor([[_features(batch, seq or 0)[i] for i in self.active]], dtype=torch.float64)
        return [max(0, int(round(v))) for v in (x @ self.coeffs).squeeze(0).tolist()]

    def trace(self, batch: int, seq: int | None) -> Trace:
        sizes = self.sizes(batch, seq)
        t = self.template
        return dataclasses.replace(
            t,
            storages=[dataclasses.replace(r, nbytes=n) for r, n in zip(t.storages, sizes, strict=True)],
            events=[(sid, sizes[sid] if delta > 0 else -sizes[sid]) for sid, delta in t.events],
        )


def sweep(runner: Runner, batches: list[int] | None, seqs: list[int] | None, capacity: int | None) -> Sweep:
    base = runner.base
    batches = batches or [base.batch]
    seq_values: list = seqs or [base.seq]
    grid = list(itertools.product(batches, seq_values))
    if len(grid) > MAX_GRID_POINTS:
        raise MemestError(
            f"a grid of {len(grid)} points is too many (at most {MAX_GRID_POINTS}); sweep fewer sizes, e.g. "
            "--seq 512,1024,2048,4096 --batch 1,2,4,8"
        )
    # size 1 often runs other ops (a batch-1 tensor is contiguous where a larger one needs a copy):
    # such points are traced directly and kept out of the fit
    fit_batches = [b for b in batches if b > 1] if len(batches) > 1 else batches
    fit_seqs = [x for x in seq_values if x is None or x > 1] if len(seq_values) > 1 else seq_values
    seq_design = _design(fit_seqs, 3) if fit_seqs and fit_seqs[0] is not None else [None]
    batch_design = _design(fit_batches, 2)
    design = list(itertools.product(batch_design, seq_design))
    fitted_region = set(itertools.product(fit_batches, fit_seqs))
    results: dict[tuple, object] = {}

    def trace(b, s):
        if (b, s) not in results:
            results[(b, s)] = runner.run(**({"batch": b} if s is None else {"batch": b, "seq": s}))
        return results[(b, s)]

    def direct_point(b, s) -> GridPoint:
        r = trace(b, s)
        return GridPoint(b, s, r.report.peak_allocated_bytes, r.needed_bytes,
                         r.fits(capacity) if capacity is not None else None, True)

    if len(fitted_region) <= len(design) + 1 or (len(batches) > 1 and len(batch_design) < 2) or (
        len(seq_values) > 1 and len(seq_design) < 3
    ):  # a fit would save nothing, or there are too few sizes to fit
        return _from_grid(Sweep([direct_point(b, s) for b, s in grid], None, "", runner.traces), capacity)

    for bs in design:
        trace(*bs)
    structures = {_structure(results[bs].trace) for bs in design}
    if len(structures) != 1:
        points = [direct_point(b, s) for b, s in grid]
        return _from_grid(Sweep(points, None, "the model runs different ops at different sizes; every point was traced",
                                runner.traces), capacity)
    active = [0] + ([1, 2] if len(seq_design) >= 3 else [])
    if len(batch_design) >= 2:
        active += [3] + ([4, 5] if len(seq_design) >= 3 else [])
    model = SizeModel({bs: results[bs].trace for bs in design}, active)
    estimate_of = _rebuild(runner)

    def fitted(b, s):
        return estimate_of(model.trace(b, s))

    others = [bs for bs in grid if bs not in results and bs in fitted_region]
    mid_b, mid_s = batches[len(batches) // 2], seq_values[len(seq_values) // 2]
    vb, vs = min(others, key=lambda bs: (abs(bs[0] - mid_b), abs((bs[1] or 0) - (mid_s or 0))))
    direct, predicted = trace(vb, vs), fitted(vb, vs)
    if _structure(direct.trace) not in structures:
        points = [direct_point(b, s) for b, s in grid]
        return _from_grid(Sweep(points, None, "the model runs different ops at different sizes; every point was traced",
                                runner.traces), capacity)
    err_peak = (predicted[0] - direct.report.peak_allocated_bytes) / direct.report.peak_allocated_bytes
    err_needed = (predicted[1] - direct.needed_bytes) / direct.needed_bytes
    verification = {"batch": vb, "seq": vs, "predicted_peak": predicted[0], "traced_peak": direct.report.peak_allocated_bytes,
                    "peak_error": err_peak, "predicted_needed": predicted[1], "traced_needed": direct.needed_bytes,
                    "needed_error": err_needed, "fit_residual_bytes": model.residual}
    if abs(err_peak) > FIT_TOLERANCE or abs(err_needed) > FIT_TOLERANCE:
        points = [direct_point(b, s) for b, s in grid]
        why = f"the fit missed the check point by {100 * max(abs(err_peak), abs(err_needed)):.2f}%; every point was traced"
        return _from_grid(Sweep(points, verification, why, runner.traces), capacity)

    points = []
    for b, s in grid:
        if (b, s) in results or (b, s) not in fitted_region:
            points.append(direct_point(b, s))
            continue
        peak, needed, check = fitted(b, s)
        points.append(GridPoint(b, s, peak, needed, check(capacity) if capacity is not None else None, False))
    result = Sweep(points, verification, "", runner.traces)
    result.plain_words = _plain_words(model, fit_batches[0], fit_seqs)
    result.largest_from = "fit"
    if capacity is not None:
        seq_max = (runner.source.max_seq or 1 << 20) if len(seq_design) >= 3 else None
        _largest_from_fit(result, lambda b, s: fitted(b, s)[2](capacity), fit_batches[0], fit_seqs[0], seq_max)
    return result


def _largest_from_fit(result: Sweep, fits, batch: int, seq: int | None, seq_max: int | None) -> None:
    """The largest batch (at ``seq``) and seq (at ``batch``, up to ``seq_max``: learned position embeddings
    end somewhere) that fit, from the fit (sizes > 1); `memest max-batch` finds the boundary with traces."""
    result.largest_batch = _largest(lambda b: fits(b, seq), 1 << 14)
    result.largest_batch_at_seq = seq
    if seq is not None and seq_max is not None:
        result.largest_seq = _largest(lambda s: fits(batch, s), seq_max)
        result.largest_seq_at_batch = batch


def _from_grid(result: Sweep, capacity: int | None) -> Sweep:
    """Where the sizes are not fitted (every point traced): the scaling in plain words from the traced points' peaks
    (slopes between the two largest sizes swept), and the largest traced batch (at the smallest seq) and seq (at the
    smallest batch) that fit: a traced point, not the boundary (memest max-batch finds that with traces)."""
    peak = {(p.batch, p.seq): p.peak_bytes for p in result.points}
    batches = sorted({p.batch for p in result.points})
    seqs = sorted({p.seq for p in result.points}, key=lambda s: s or 0)
    b0, s_top = batches[0], seqs[-1]
    words = []
    if len(seqs) > 1 and seqs[0] is not None:
        s1, s2 = seqs[-2], seqs[-1]
        per_token = (peak[(b0, s2)] - peak[(b0, s1)]) / (s2 - s1)
        words.append(f"at batch {b0}, seq {s1} to {s2}: each extra 1k tokens costs {format_bytes(per_token * 1024)} at "
                     "the peak (from the traced grid)")
    if len(batches) > 1:
        b1, b2 = batches[-2], batches[-1]
        per_sample = (peak[(b2, s_top)] - peak[(b1, s_top)]) / (b2 - b1)
        at = f" at seq {s_top}" if s_top is not None else ""
        words.append(f"each extra sample in the batch{at} ({b1} to {b2}) costs {format_bytes(per_sample)} at the peak "
                     "(from the traced grid)")
    result.plain_words = words
    if capacity is None:
        return result
    result.largest_from = "grid"
    fitting = [p for p in result.points if p.fits]
    result.largest_batch = max((p.batch for p in fitting if p.seq == seqs[0]), default=0)
    result.largest_batch_at_seq = seqs[0]
    if seqs[0] is not None:
        result.largest_seq = max((p.seq for p in fitting if p.batch == b0), default=0)
        result.largest_seq_at_batch = b0
    return result


def _rebuild(runner: Runner):
    """(peak, needed, fits(capacity)) of a rebuilt trace, computed as estimate() computes them."""
    base = runner.base

    def evaluate(trace: Trace):
        peak = trace.peak()[0]
        if base.target != Target.CUDA:
            return peak, peak, lambda cap: peak <= cap

        usage = device_usage(trace, base.compute_capability, world_size=base.world_size, calibration=runner.calibration,
                             dims=base.parallel)
        needed = usage.min_budget_bytes
        return peak, needed, lambda cap: needed <= cap

    return evaluate


def _largest(fits, limit: int) -> int:
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= limit and fits(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _plain_words(model: SizeModel, batch: int, seqs: list) -> list[str]:
    """Marginal costs at the peak of the largest swept size, from the fitted storage sizes."""

    seq = seqs[-1] or 0
    peak, index = model.trace(batch, seq).peak()
    live = model.trace(batch, seq).live_at(index)
    coeff = [0.0] * 6
    for sid in live:
        for row, feature in enumerate(model.active):
            coeff[feature] += float(model.coeffs[row, sid])
    a, b, c, d, e, f = coeff
    words = []
    if seqs[0] is not None:
        per_token = (b + 2 * c * seq) + batch * (e + 2 * f * seq)
        words.append(f"at batch {batch}, seq {seq}: each extra 1k tokens costs {format_bytes(per_token * 1024)} at the peak")
        if (c + batch * f) * seq > 0.05 * max(per_token, 1.0):
            words.append("part of it grows with seq²: attention scores (or a mask) are materialised")
    per_sample = d + e * seq + f * seq * seq
    words.append(f"each extra sample in the batch costs {format_bytes(per_sample)} at the peak")
    return words
