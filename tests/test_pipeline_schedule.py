"""The micro-batches each pipeline rank holds, walked from torch's own schedule order
(memest/trace/pipeline_schedule.py), against the rules the papers state."""

import pytest

from memest.parallel.pipeline_schedule import SCHEDULES, in_flight, pipeline_order, rank_stages


@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_walking_1f1b_gives_min_m_n_minus_i(n, extra):
    """Schedule1F1B (Narayanan et al. 2021): stage i holds min(M, N - i) micro-batches (torch requires M >= N)."""
    m = n + extra
    assert [r.peak for r in in_flight("1f1b", n, 1, m)] == [min(m, n - i) for i in range(n)]


def test_walking_gpipe_holds_every_micro_batch():
    assert [r.peak for r in in_flight("gpipe", 4, 1, 6)] == [6] * 4


@pytest.mark.parametrize(("n", "v"), [(2, 2), (4, 2), (4, 3)])
def test_walking_interleaved_1f1b_gives_megatrons_warmup_plus_one(n, v):
    """Interleaved 1F1B with M = 2N: rank r runs (N - r - 1) * 2 + (V - 1) * N warm-up forwards before its
    first backward (Megatron-LM schedules.py, get_pp_rank_microbatches), then one more forward: that many
    micro-batches in flight, over its V stages."""
    m = 2 * n
    got = [r.peak for r in in_flight("interleaved", n, v, m)]
    assert got == [min(m * v, (n - r - 1) * 2 + (v - 1) * n + 1) for r in range(n)]


def test_stages_are_placed_as_torch_places_them():
    assert rank_stages("interleaved", 4, 2, 1) == [1, 5]
    assert rank_stages("zbv", 4, 2, 1) == [1, 6]  # V: r and 2N - 1 - r


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_every_forward_is_freed_by_the_end_of_the_step(schedule):
    """The walk's bookkeeping on every schedule torch offers: each of a rank's stages runs M forwards and
    frees them all (M full or weight backwards), and the most it holds lies between 1 and M per stage."""
    from memest.parallel.pipeline_schedule import _compute_actions, walk

    v = 1 if SCHEDULES[schedule][2] == 1 else 2
    order = pipeline_order(schedule, 4, v, 8)
    for rank in range(4):
        stages = rank_stages(schedule, 4, v, rank)
        kinds = [(a.stage_index, a.computation_type.value) for x in order[rank] for a in _compute_actions(x)]
        for s in stages:
            assert kinds.count((s, "F")) == 8
            assert kinds.count((s, "B")) + kinds.count((s, "W")) == 8
        one = walk(order[rank], rank, stages)
        assert all(1 <= one.most[s] <= 8 for s in stages) and one.peak == sum(one.at_peak.values())
