"""NCCL per process group (device/nccl.py) and the device-wide figure (device/reservation.py): the counts
come from the layout, each cost from the evidence rows, and the device-wide used adds the reservation."""

import statistics

from memest.device import nccl, reservation
from memest.device import overheads as oh
from memest.device.usage import device_usage
from memest.spec.choices import Shard
from memest.spec.parallel_dims import ParallelDims
from memest.units import MiB

from .test_device_overheads import hand_trace

ZERO3 = Shard("zero3")


def by_name(costs):
    return {c.name: c for c in costs}


def test_communicators_per_layout():
    count = nccl.communicator_count
    assert count(ParallelDims(1)).expected == 0
    ddp = count(ParallelDims(8))  # no mesh: DDP's default group
    assert (ddp.low, ddp.expected, ddp.high) == (1, 1, 1)
    fsdp = count(ParallelDims(8, shard=ZERO3))  # a 1-D mesh over every rank reuses the default group
    assert (fsdp.low, fsdp.expected, fsdp.high) == (1, 1, 1)
    fsdp_tp = count(ParallelDims(8, tp=2, shard=ZERO3))  # dp and tp groups; the world group only if used
    assert (fsdp_tp.low, fsdp_tp.expected, fsdp_tp.high) == (2, 2, 3)
    middle = count(ParallelDims(4, pp=4, pp_stage=1))  # one rank per stage: a send/recv pair each side
    assert (middle.low, middle.expected, middle.high) == (1, 2, 3)  # + the pp group's for mixed batches
    edge = count(ParallelDims(4, pp=4, pp_stage=3))
    assert (edge.low, edge.expected, edge.high) == (1, 1, 2)
    three_d = count(ParallelDims(16, tp=2, pp=2, pp_stage=0, shard=ZERO3))  # dp + tp + one send/recv
    assert (three_d.low, three_d.expected, three_d.high) == (3, 3, 5)
    experts = count(ParallelDims(8, ep=4, shard=ZERO3))  # dp + efsdp + ep (all-to-all)
    assert (experts.expected, experts.all_to_all) == (3, 1)
    assert "tp mesh dimension" in fsdp_tp.describe() and "range 2-3" in fsdp_tp.describe()


def test_per_communicator_spread_is_derived_from_the_rows():
    rows = tuple(r for r in nccl.NCCL_RUNS if r.collective == nccl.ALL_REDUCE)
    values = [r.state_bytes for r in rows]
    a100 = nccl.communicator_spread((8, 0))
    assert a100.expected == int(statistics.median([r.state_bytes for r in rows if r.compute_capability == (8, 0)]))
    # with the ring buffers overheads.py adds back, the A100 expected is the median of its two measurements
    assert a100.expected + nccl.DEFAULT_RING_BUFFERS == statistics.median(
        [r.bytes for r in rows if r.compute_capability == (8, 0)])
    probe = next(r for r in rows if not r.peers)  # a world of one holds no ring buffers: taken as measured
    assert probe.state_bytes == probe.bytes
    assert (a100.low, a100.high) == (min(values), max(values))
    unknown = nccl.communicator_spread((7, 5))  # no row for this generation: all rows' median
    assert unknown.expected == int(statistics.median(values))
    # a different table gives a different answer: nothing is typed in
    one = (nccl.NcclMeasurement(300 * MiB, "x", (8, 0), "x", "2", 1, nccl.ALL_REDUCE, "here", "made up"),)
    state = 300 * MiB - nccl.DEFAULT_RING_BUFFERS
    assert nccl.communicator_spread((8, 0), one) == nccl.CommSpread(state, state, state,
                                                                    nccl.communicator_spread((8, 0), one).basis)
    # the all-to-all row widens only expert-parallel layouts' high end
    low, expected, high, _, _ = nccl.nccl_cost(ParallelDims(8, ep=4, shard=ZERO3), (8, 0))  # sm80: no NVLS
    plain_high = nccl.nccl_cost(ParallelDims(8, ep=1, tp=4, pp=1, shard=ZERO3), (8, 0))[2]
    extra, _ = nccl.all_to_all_extra(3)  # ep 4: three peers
    assert extra > 0 and high == 3 * max(values) + extra and plain_high == 3 * max(values)
    row = next(r for r in nccl.NCCL_RUNS if r.collective == nccl.ALL_TO_ALL)
    assert nccl.all_to_all_extra(int(row.ranks) - 1)[0] == row.bytes - row.bytes % (int(row.ranks) - 1)


def test_fixed_costs_price_every_communicator_with_its_range():
    dims = ParallelDims(8, tp=2, shard=ZERO3)
    costs = by_name(oh.fixed_costs((8, 0), 8, env={}, dims=dims))
    per = nccl.communicator_spread((8, 0))
    comm = costs["nccl_communicator"]
    assert (comm.low, comm.bytes, comm.high) == (2 * per.low, 2 * per.expected, 3 * per.high)
    assert "2 NCCL communicator(s)" in comm.source and "nccl/issues/964" in comm.source
    one = oh.CONSTANTS["nccl_buffsize"][0] * oh.NCCL_CHANNELS_DEFAULT * 2
    assert (costs["nccl_buffers"].low, costs["nccl_buffers"].bytes, costs["nccl_buffers"].high) == (2 * one, 2 * one,
                                                                                                    3 * one)
    assert "nccl_communicator" not in by_name(oh.fixed_costs((8, 0), 1, env={}))


def test_nccl_environment_overrides():
    base = by_name(oh.fixed_costs((9, 0), 2, env={}))["nccl_buffers"].bytes
    more = by_name(oh.fixed_costs((9, 0), 2, env={"NCCL_MIN_NCHANNELS": "32"}))["nccl_buffers"].bytes
    assert more == 2 * base  # linear in channels: 16 assumed -> 32
    capped = by_name(oh.fixed_costs((9, 0), 2, env={"NCCL_MAX_NCHANNELS": "4", "NCCL_BUFFSIZE": str(MiB)}))
    assert capped["nccl_buffers"].bytes == MiB * 4 * 2


def test_a_calibrated_communicator_is_multiplied_by_the_count():
    cal = {"nccl_library_bytes": 500 * MiB}
    costs = by_name(oh.fixed_costs((9, 0), 8, env={}, calibration=cal, dims=ParallelDims(8, tp=2, shard=ZERO3)))
    comm = costs["nccl_communicator"]
    assert comm.calibrated and (comm.low, comm.bytes, comm.high) == (1000 * MiB, 1000 * MiB, 1500 * MiB)


def test_device_wide_used_is_the_process_plus_the_reservation():
    held = reservation.reservation_spread()
    values = [r.bytes for r in reservation.RESERVATIONS]
    assert (held.low, held.expected, held.high) == (min(values), int(statistics.median(values)), max(values))
    usage = device_usage(hand_trace([12 * MiB, -0, 14 * MiB]), (8, 0), env={})
    assert usage.process_bytes_expected == usage.device_bytes == usage.bytes_expected
    assert (usage.process_bytes_low, usage.process_bytes_high) == (usage.bytes_low, usage.bytes_high)
    assert usage.device_used_bytes_expected == usage.device_bytes + held.expected
    assert usage.device_used_bytes_low == usage.bytes_low + held.low
    assert usage.device_used_bytes_high == usage.bytes_high + held.high
    assert usage.nccl_communicators == 0
    dist = device_usage(hand_trace([12 * MiB]), (8, 0), env={}, world_size=8, dims=ParallelDims(8, tp=2, shard=ZERO3))
    assert dist.nccl_communicators == 2
    costs = by_name(dist.fixed_costs)
    nccl_bytes = costs["nccl_communicator"].bytes + costs["nccl_buffers"].bytes
    assert costs["nccl_communicator"].bytes == 2 * nccl.communicator_spread((8, 0)).expected
    assert (dist.device_bytes - dist.reserved_peak_bytes) - (usage.device_bytes - usage.reserved_peak_bytes) == nccl_bytes


def test_nvls_buffers_follow_the_gpu_the_group_size_and_the_setting():
    dims = ParallelDims(8, tp=4, shard=ZERO3)  # dp 2 and tp 4: one communicator of more than 2 ranks
    nvls = nccl.NVLS_PER_RANK[0]
    hopper = nccl.nccl_cost(dims, (9, 0), {})
    per = nccl.communicator_spread((9, 0))
    assert hopper[1] == 2 * per.expected and hopper[2] == 3 * per.high + nvls  # an NVSwitch system may use it
    on = nccl.nccl_cost(dims, (9, 0), {"NCCL_NVLS_ENABLE": "1"})
    assert on[1] == 2 * per.expected + nvls and on[2] == hopper[2]
    off = nccl.nccl_cost(dims, (9, 0), {"NCCL_NVLS_ENABLE": "0"})
    assert off[2] == 3 * per.high
    ampere = nccl.nccl_cost(dims, (8, 0), {})
    assert ampere[2] == 3 * nccl.communicator_spread((8, 0)).high  # no NVLS before sm90
    assert nccl.nccl_cost(ParallelDims(2), (9, 0), {})[2] == per.high  # 2 ranks: no NVLS


def test_the_summary_names_the_communicators_and_the_device_wide_figure():
    from types import SimpleNamespace

    from memest.report.summary import _device_rows

    usage = device_usage(hand_trace([12 * MiB]), (9, 0), env={}, world_size=8, dims=ParallelDims(8, tp=2, shard=ZERO3))
    rows = _device_rows(SimpleNamespace(device=usage))
    nccl_row = next(r for r in rows if r.value.startswith("+ nccl communicator"))
    assert "2 communicator(s)" in nccl_row.detail
    wide = next(r for r in rows if r.value.startswith("device-wide used"))
    assert "reservation" in wide.detail and [r.label for r in rows].count("predicted device use") == 1
