"""--pp-schedule: torch.distributed.pipelining's schedules, and how many micro-batches each rank holds.

Every schedule class of torch 2.13 builds its whole per-rank action order at construction, without
running anything (``pipeline_order``: rank -> [_Action(stage, F|B|I|W|OVERLAP_F_B, micro-batch) or
None for a bubble]; torch/distributed/pipelining/schedules.py: ``Schedule1F1B._get_pipeline_order``,
``ScheduleGPipe._get_pipeline_order``, and ``_calculate_single_rank_operations`` of the multi-stage
schedules, which ``_PipelineScheduleRuntime`` then executes with its send/receive actions added).
``in_flight`` builds the schedule torch runs on stand-in stages (the constructors read only stage
indices and group sizes) and walks that order: a forward (F) adds a micro-batch's activations to its
stage, a full backward (B) or a weight backward (W) frees them (an input backward, I, frees only what
the input gradient alone needed; the rest waits for W, so the micro-batch counts as held until W).
No formula is written here: 1F1B's rule, stage i holds min(M, N - i) (Narayanan et al. 2021), is what
the walk of Schedule1F1B's order gives (tests/test_pipeline_schedule.py).

Counts are taken per action, not per micro-batch index: torch's ``Schedule1F1B._get_pipeline_order``
numbers the last rank's forwards from 1 (F1..FM where its runtime runs F0..F(M-1)); the number of
forwards before each backward, which is what memory depends on, is the runtime's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# schedule -> (torch class, placement of stages on ranks: torch's generate_stage_to_rank_mapping style,
# stages per rank or None where --pp-virtual sets it). The zero-bubble ones are walked, not offered as
# --pp-schedule: their split backward fails on a transformers decoder in a real run (spec/choices.py)
SCHEDULES: dict[str, tuple[str, str, int | None]] = {
    "1f1b": ("Schedule1F1B", "loop", 1),
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "interleaved": ("ScheduleInterleaved1F1B", "loop", None),
    "looped-bfs": ("ScheduleLoopedBFS", "loop", None),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "loop", None),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
    "dualpipev": ("ScheduleDualPipeV", "v", 2),
}


def torch_class(schedule: str):
    from torch.distributed.pipelining import schedules

    return getattr(schedules, SCHEDULES[str(schedule)][0])


def rank_stages(schedule: str, pp: int, virtual: int, rank: int) -> list[int]:
    """The stage indices ``rank`` runs, in torch's own placement (``generate_stage_to_rank_mapping``:
    loop: r, r + N, ...; V: r and 2N - 1 - r)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    mapping = generate_stage_to_rank_mapping(pp, pp * virtual, style=SCHEDULES[str(schedule)][1])
    return sorted(s for s, r in mapping.items() if r == rank)


class _StandIn:
    """What the schedule constructors read of a stage (stage index, stage and group counts)."""

    def __init__(self, index: int, n_stages: int, pp: int, rank: int) -> None:
        from torch import nn

        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, n_stages, pp, rank
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        self.submod = nn.Module()  # the zero-bubble schedules check it is not torch.compile'd


def pipeline_order(schedule: str, pp: int, virtual: int, microbatches: int) -> dict[int, list]:
    """torch's action order for every rank (``pipeline_order``), built without running anything."""
    cls = torch_class(schedule)
    n_stages = pp * virtual
    stages = [_StandIn(s, n_stages, pp, 0) for s in rank_stages(schedule, pp, virtual, 0)]
    if SCHEDULES[str(schedule)][2] == 1:
        built = cls(stages[0], n_microbatches=microbatches)
    else:
        built = cls(stages, n_microbatches=microbatches)
    return built.pipeline_order


@dataclass
class RankInFlight:
    rank: int
    stages: list[int]
    peak: int = 0  # micro-batches (summed over the rank's stages) held at the rank's most
    at_peak: dict[int, int] = field(default_factory=dict)  # stage -> micro-batches held at that moment
    most: dict[int, int] = field(default_factory=dict)  # stage -> the most it ever holds


def _compute_actions(action):
    if action is None:
        return []
    if action.sub_actions is not None:  # OVERLAP_F_B (DualPipeV): a forward and a backward overlapped
        return [a for sub in action.sub_actions for a in _compute_actions(sub)]
    return [action]


def walk(order: list, rank: int, stages: list[int]) -> RankInFlight:
    """Micro-batches in flight on one rank, walking its actions in order."""
    held = dict.fromkeys(stages, 0)
    out = RankInFlight(rank, list(stages), at_peak=dict(held), most=dict(held))
    for action in order:
        for a in _compute_actions(action):
            kind = a.computation_type.value
            if kind == "F":
                held[a.stage_index] += 1
            elif kind in ("B", "W"):
                held[a.stage_index] -= 1
            else:
                continue
            for s, n in held.items():
                out.most[s] = max(out.most[s], n)
            if sum(held.values()) > out.peak:
                out.peak, out.at_peak = sum(held.values()), dict(held)
    return out


def in_flight(schedule: str, pp: int, virtual: int, microbatches: int) -> list[RankInFlight]:
    """Per rank, the micro-batches its stages hold at its peak, from torch's own order."""
    order = pipeline_order(schedule, pp, virtual, microbatches)
    return [walk(order[r], r, rank_stages(schedule, pp, virtual, r)) for r in range(pp)]


def describe_in_flight(one: RankInFlight, microbatches: int) -> str:
    if len(one.stages) == 1:
        return f"holds at most {one.peak} of the {microbatches} micro-batches' activations at once"
    held = ", ".join(f"stage {s}: {n}" for s, n in one.at_peak.items())
    return f"holds at most {one.peak} micro-batch activations at once over its stages ({held})"
