"""Memory over the step: bytes alive per category after each event, downsampled for people to look at.

Downsampling keeps, per bucket of events, the event with the most bytes alive and the one with the
fewest (in event order), so spikes and dips both survive; the global peak, the first and last event and
the first event of every phase are always kept exactly (the last event of every phase too, when
``max_points`` leaves room).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import asdict, dataclass
from itertools import accumulate

from memest.report.analysis import _TO_BREAKDOWN, BREAKDOWN_KEYS
from memest.trace.events import Phase, Trace
from memest.units import format_bytes

# one letter per phase for the terminal view
PHASE_LETTERS = {
    Phase.SETUP.value: "·",
    Phase.FORWARD.value: "f",
    Phase.LOSS.value: "l",
    Phase.BACKWARD.value: "b",
    Phase.OPTIMIZER.value: "o",
    Phase.ZERO_GRAD.value: "z",
    Phase.DECODE.value: "d",
}
PHASE_NAMES = {
    Phase.SETUP.value: "setup",
    Phase.FORWARD.value: "forward",
    Phase.LOSS.value: "loss",
    Phase.BACKWARD.value: "backward",
    Phase.OPTIMIZER.value: "optimizer step",
    Phase.ZERO_GRAD.value: "zero_grad",
    Phase.DECODE.value: "decode",
}
BLOCKS = "▁▂▃▄▅▆▇█"


@dataclass
class PhaseSpan:
    start: int  # index of the span's first event
    end: int  # one past its last event
    iteration: int  # 0 for setup (storages alive before the step)
    phase: str  # a Phase value


@dataclass
class PeakPoint:
    index: int  # first event that reaches the peak
    bytes: int
    iteration: int
    phase: str
    op: str
    module: str


@dataclass
class Timeline:
    """Columns over the kept events: ``total[k]`` and ``series[cat][k]`` are the bytes alive just after
    event ``index[k]``; ``sum(series[c][k] for c in categories) == total[k]``."""

    n_events: int
    categories: tuple[str, ...]
    index: list[int]
    total: list[int]
    series: dict[str, list[int]]
    spans: list[PhaseSpan]
    peak: PeakPoint
    iterations: int = 0  # number of traced steps (highest iteration among the spans)

    def to_dict(self) -> dict:
        return asdict(self)


def phase_spans(trace: Trace) -> list[PhaseSpan]:
    """Contiguous, non-empty spans covering events ``0 .. len(trace.events)`` in order."""
    n = len(trace.events)
    starts = [(0, 0, Phase.SETUP)] + [(min(max(i, 0), n), it, ph) for i, it, ph in trace.phase_marks]
    spans: list[PhaseSpan] = []
    for k, (start, it, phase) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else n
        if end > start:
            spans.append(PhaseSpan(start, end, it, phase.value))
    return spans


def _bucket_points(total: list[int], lo: int, hi: int, buckets: int) -> set[int]:
    """Index of the max and of the min of ``total`` in each of ``buckets`` equal slices of [lo, hi)."""
    keep: set[int] = set()
    get = total.__getitem__
    width = hi - lo
    for b in range(buckets):
        a, z = lo + b * width // buckets, lo + (b + 1) * width // buckets
        if z > a:
            keep.add(max(range(a, z), key=get))
            keep.add(min(range(a, z), key=get))
    return keep


def _choose(total: list[int], spans: list[PhaseSpan], peak_i: int, max_points: int) -> list[int]:
    n = len(total)
    if n <= max_points:
        return list(range(n))
    required = {0, n - 1, peak_i} | {s.start for s in spans}
    if len(required) > max_points:
        raise ValueError(
            f"max_points={max_points} is below the {len(required)} points always kept (the peak, the first "
            "and last event and every phase start); pass a larger max_points"
        )
    ends = {s.end - 1 for s in spans} - required
    if len(required) + len(ends) <= max_points:
        required |= ends
    # two points (max and min) per bucket: at most len(required) + 2 * buckets <= max_points in all
    buckets = (max_points - len(required)) // 2
    return sorted(required | _bucket_points(total, 0, n, buckets))


def category_timeline(trace: Trace, max_points: int = 2000) -> Timeline:
    """Bytes alive per category (``BREAKDOWN_KEYS``: buffers and inputs as "other") after each event,
    at most ``max_points`` points, with the peak and the phase boundaries exact."""
    events = trace.events
    n = len(events)
    total = list(accumulate(delta for _, delta in events))
    spans = phase_spans(trace)
    peak_bytes = max(total) if total else 0
    peak_i = total.index(peak_bytes) if total else 0
    keep = _choose(total, spans, peak_i, max_points)

    slot = {key: k for k, key in enumerate(BREAKDOWN_KEYS)}
    cat_slot = [slot[_TO_BREAKDOWN[rec.category]] for rec in trace.storages]
    live = [0] * len(BREAKDOWN_KEYS)
    rows: list[tuple[int, ...]] = []
    if len(keep) == n:
        for sid, delta in events:
            live[cat_slot[sid]] += delta
            rows.append(tuple(live))
    else:
        k, next_i = 0, keep[0] if keep else -1
        for i, (sid, delta) in enumerate(events):
            live[cat_slot[sid]] += delta
            if i == next_i:
                rows.append(tuple(live))
                k += 1
                next_i = keep[k] if k < len(keep) else -1
    series = {key: [row[j] for row in rows] for j, key in enumerate(BREAKDOWN_KEYS)}

    if n:
        iteration, phase = trace.phase_at(peak_i)
        rec = trace.storages[events[peak_i][0]]
        peak = PeakPoint(peak_i, peak_bytes, iteration, phase.value, rec.op, rec.module)
    else:
        peak = PeakPoint(0, 0, 0, Phase.SETUP.value, "", "")
    return Timeline(
        n_events=n,
        categories=BREAKDOWN_KEYS,
        index=keep,
        total=[total[i] for i in keep],
        series=series,
        spans=spans,
        peak=peak,
        iterations=max((s.iteration for s in spans), default=0),
    )


def peak_label(timeline: Timeline) -> str:
    """'4.67 GiB at step 2, backward, op _log_softmax_backward_data, in h.3.attn'."""
    p = timeline.peak
    where = f"step {p.iteration}, {PHASE_NAMES.get(p.phase, p.phase)}"
    if p.op:
        where += f", op {_short_op(p.op)}"
    if p.module:
        where += f", in {p.module}"
    return f"{format_bytes(p.bytes)} at {where}"


def _short_op(op: str) -> str:
    return op[: -len(".default")] if op.endswith(".default") else op


# ---- terminal view -------------------------------------------------------------------------------


def _column_ranges(n: int, width: int) -> list[tuple[int, int]]:
    out = []
    for c in range(width):
        lo = c * n // width
        out.append((lo, max(lo + 1, (c + 1) * n // width)))
    return out


def _column_values(timeline: Timeline, ranges: list[tuple[int, int]]) -> list[int]:
    """Most bytes alive in each column (kept points inside it; else the value carried from before)."""
    idx, tot = timeline.index, timeline.total
    values = []
    for lo, hi in ranges:
        a, z = bisect_left(idx, lo), bisect_left(idx, hi)
        if z > a:
            values.append(max(tot[a:z]))
        else:
            values.append(tot[a - 1] if a > 0 else 0)
    return values


def _phase_row(timeline: Timeline, ranges: list[tuple[int, int]]) -> str:
    """The phase covering most of each column; a short phase with no column of its own is written at
    its start column when that does not erase the only column of another phase."""
    spans = timeline.spans
    starts = [s.start for s in spans]
    owner: list[int] = []  # span index per column
    for lo, hi in ranges:
        a = max(bisect_right(starts, lo) - 1, 0)
        best, best_len = a, -1
        j = a
        while j < len(spans) and spans[j].start < hi:
            overlap = min(hi, spans[j].end) - max(lo, spans[j].start)
            if overlap > best_len:
                best, best_len = j, overlap
            j += 1
        owner.append(best)
    for j, span in enumerate(spans):
        if j in owner:
            continue
        c = next((c for c, (lo, hi) in enumerate(ranges) if lo <= span.start < hi), None)
        if c is not None and owner.count(owner[c]) > 1:
            owner[c] = j
    return "".join(PHASE_LETTERS.get(spans[j].phase, "?") for j in owner)


def terminal_timeline(timeline: Timeline, width: int = 60) -> list[str]:
    """A text sparkline of total memory over the traced steps, ``width`` columns, with the phases
    labelled underneath and a caret under the peak column. Plain strings (no markup)."""
    if width < 8:
        raise ValueError(f"width must be at least 8 columns, got {width}")
    if not timeline.n_events:
        return ["no memory events traced"]
    ranges = _column_ranges(timeline.n_events, width)
    values = _column_values(timeline, ranges)
    top = timeline.peak.bytes or 1
    spark = "".join(BLOCKS[min(round(max(v, 0) * (len(BLOCKS) - 1) / top), len(BLOCKS) - 1)] for v in values)
    phases = _phase_row(timeline, ranges)
    peak_col = next(c for c, (lo, hi) in enumerate(ranges) if lo <= timeline.peak.index < hi)

    label = f"peak {peak_label(timeline)}"
    if peak_col + 2 + len(label) <= width or peak_col < len(label) + 1:
        caret = " " * peak_col + "^ " + label
    else:
        caret = " " * (peak_col - len(label) - 1) + label + " ^"
    steps = timeline.iterations
    header = (
        f"memory over {steps} traced step{'s' if steps != 1 else ''} "
        f"(0 to {format_bytes(timeline.peak.bytes)}, {timeline.n_events:,} events)"
    )
    seen = dict.fromkeys(s.phase for s in timeline.spans if s.phase != Phase.SETUP.value)
    legend = "  ".join(f"{PHASE_LETTERS[p]} {PHASE_NAMES[p]}" for p in seen if p in PHASE_LETTERS)
    return [header, spark, phases, caret, legend]
