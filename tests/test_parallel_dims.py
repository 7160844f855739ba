"""ParallelDims (memest/parallel/dims.py): a RunSpec's layout as one value, its mesh, the rank traced, its refusals."""

import dataclasses
import itertools
import math
import re

import pytest

from memest.errors import MemestError
from memest.parallel.dims import ParallelDims, build_mesh, validate
from memest.plan.parallel import Layout
from memest.spec import RunSpec
from memest.spec.choices import Shard

# name -> (RunSpec changes, (dp, tp, pp, cp, ep), on: the *_enabled flags true, dense mesh dims, expert mesh dims)
LAYOUTS = {
    "dp": ({"world_size": 4}, (4, 1, 1, 1, 1), {"dp"}, (), ()),
    "fsdp": ({"world_size": 4, "shard": "zero3"}, (4, 1, 1, 1, 1), {"dp", "fsdp"}, (("dp", 4),), ()),
    "fsdp-x-tp": ({"world_size": 8, "tp": 2, "shard": "zero3"}, (4, 2, 1, 1, 1), {"dp", "fsdp", "tp"},
                  (("dp", 4), ("tp", 2)), ()),
    "tp-sp": ({"world_size": 2, "tp": 2, "sp": True}, (1, 2, 1, 1, 1), {"tp"}, (("dp", 1), ("tp", 2)), ()),
    "pp": ({"world_size": 2, "pp": 2}, (1, 1, 2, 1, 1), {"pp"}, (), ()),
    "pp-x-dp-x-tp": ({"world_size": 8, "pp": 2, "tp": 2, "shard": "zero3"}, (2, 2, 2, 1, 1), {"dp", "fsdp", "tp", "pp"},
                     (("pp", 2), ("dp", 2), ("tp", 2)), ()),
    "ep": ({"world_size": 4, "ep": 2, "shard": "zero3"}, (4, 1, 1, 1, 2), {"dp", "fsdp", "ep"}, (("dp", 4),),
           (("efsdp", 2), ("ep", 2))),
    "ep-x-tp": ({"world_size": 4, "ep": 2, "tp": 2, "shard": "zero3"}, (2, 2, 1, 1, 2), {"dp", "fsdp", "tp", "ep"},
                (("dp", 2), ("tp", 2)), (("efsdp", 2), ("ep", 2))),
    "ep-x-pp": ({"world_size": 4, "ep": 2, "pp": 2, "shard": "zero3"}, (2, 1, 2, 1, 2), {"dp", "fsdp", "pp", "ep"},
                (("pp", 2), ("dp", 2), ("tp", 1)), (("pp", 2), ("efsdp", 1), ("ep", 2))),
    "cp": ({"world_size": 4, "cp": 2, "shard": "zero3"}, (2, 1, 1, 2, 1), {"dp", "fsdp", "cp"},
           (("dp", 2), ("cp", 2)), ()),
    "cp-x-tp": ({"world_size": 8, "cp": 2, "tp": 2, "shard": "zero3"}, (2, 2, 1, 2, 1), {"dp", "fsdp", "cp", "tp"},
                (("dp", 2), ("cp", 2), ("tp", 2)), ()),
}
FLAGS = ("dp", "fsdp", "tp", "pp", "cp", "ep")


def _spec(**changes) -> RunSpec:
    return RunSpec(model="hf:llama-2-7b", **changes)


@pytest.mark.parametrize("name", LAYOUTS)
def test_dims_from_every_layout_the_cli_accepts(name):
    changes, (dp, tp, pp, cp, ep), on, mesh, experts = LAYOUTS[name]
    dims = _spec(**changes).parallel
    assert dims == ParallelDims.from_spec(_spec(**changes))
    assert (dims.dp, dims.tp, dims.pp, dims.cp, dims.ep) == (dp, tp, pp, cp, ep)
    assert {f for f in FLAGS if getattr(dims, f"{f}_enabled")} == on
    assert dims.non_data_parallel_size == tp * pp * cp
    assert dims.dp * dims.non_data_parallel_size == dims.world_size
    assert (dims.dp_shard, dims.dp_replicate) == ((dp, 1) if "fsdp" in on else (1, dp))
    assert dims.mesh_dims == mesh
    assert dims.expert_mesh_dims == experts
    if mesh:  # the dense mesh covers every rank, its dimensions in the one order pp, dp, cp, tp
        names = [n for n, _ in mesh]
        assert names == sorted(names, key=["pp", "dp", "dp_cp", "cp", "tp"].index)
        assert math.prod(s for _, s in mesh) == dims.world_size
    if ep > 1:
        assert dims.expert_copies * ep * pp == dims.world_size


def test_the_spec_reads_its_degrees_from_the_dims():
    spec = _spec(world_size=16, pp=2, tp=2, shard="zero3", ep=4, pp_stage=1)
    assert (spec.dp, spec.rank, spec.expert_copies) == (4, 8, 2)
    assert spec.parallel.shard is Shard.ZERO3


def _coordinates(dims: ParallelDims) -> dict[tuple, int]:
    """(pp, dp, cp, tp) coordinate -> global rank, the mesh laid out row-major in that order (tp innermost)."""
    shape = (dims.pp, dims.dp, dims.cp, dims.tp)
    return {c: r for r, c in enumerate(itertools.product(*(range(n) for n in shape)))}


@pytest.mark.parametrize(
    "changes",
    [
        {"world_size": 8, "pp": 2, "tp": 2, "shard": "zero3"},
        {"world_size": 8, "pp": 4, "shard": "zero3"},
        {"world_size": 4, "pp": 4},
        {"world_size": 8, "cp": 2, "tp": 2, "shard": "zero3"},
        {"world_size": 8, "cp": 4, "shard": "zero3"},
        {"world_size": 8, "tp": 4, "shard": "zero3"},
        {"world_size": 4, "ep": 2, "pp": 2, "shard": "zero3"},
    ],
)
def test_the_traced_rank_is_the_first_of_its_stage_and_cp_rank(changes):
    dims = _spec(**changes).parallel
    mesh = _coordinates(dims)
    for stage, cp_rank in itertools.product(range(dims.pp), range(dims.cp)):
        spec = _spec(**changes, pp_stage=stage, **({"cp_rank": cp_rank} if dims.cp_enabled else {}))
        rank = spec.parallel.rank
        assert rank == stage * dims.dp * dims.tp + cp_rank * dims.tp  # RunSpec.rank's formula before ParallelDims
        assert rank == mesh[(stage, 0, cp_rank, 0)] == spec.rank
        assert dims.stage_of(rank) == stage
        assert all(dims.stage_of(r) == c[0] for c, r in mesh.items())


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"tp": 0}, "--tp must be at least 1, got 0"),
        ({"pp": 0}, "--pp must be at least 1, got 0"),
        ({"world_size": 2, "pp": 2, "tp": 0}, "--tp must be at least 1, got 0"),  # before: a division by zero
        ({"ep": -1}, "--ep must be at least 1, got -1"),
        ({"cp": 0}, "--cp must be at least 1, got 0"),
        ({"world_size": 3, "tp": 2}, "--world-size 3 is not a multiple of --tp 2: the world is dp x tp ranks"),
        ({"world_size": 4, "tp": 2}, "is 2-way data parallel x TP 2: torch's 2-D recipe"),
        ({"world_size": 2, "tp": 2, "shard": "zero3"}, "--shard zero3 needs data-parallel ranks: --world-size 2 is all"),
        ({"world_size": 2, "tp": 2, "offload": "optimizer"}, "--offload with --tp is not traced"),
        ({"sp": True}, "--sp shards the sequence across the tensor-parallel ranks; it needs --tp 2 or more"),
        ({"world_size": 6, "pp": 4}, "--world-size 6 is not a multiple of --pp 4 x --tp 1"),
        ({"world_size": 4, "pp": 2}, "with --pp 2 is 2-way data parallel per stage"),
        ({"world_size": 2, "pp": 2, "shard": "zero3"}, "use --world-size 4 for 2-way FSDP per stage"),
        ({"world_size": 2, "pp": 2, "grad_accum": 2}, "--pp traces a training step of --microbatches micro-batches"),
        ({"world_size": 2, "pp": 2, "pp_stage": 2}, "pipeline stage 2 is not one of the 2 stages"),
        ({"world_size": 2, "pp": 2, "pp_virtual": 3}, "--pp-virtual 3: --pp-schedule 1f1b runs 1 stage"),
        ({"microbatches": 4}, "describe a pipeline; add --pp N"),
        ({"world_size": 2, "ep": 2, "pp": 2}, "each stage's 1 ranks"),
        ({"world_size": 3, "ep": 2, "shard": "zero3"}, "--world-size 3 is not a multiple of --ep 2"),
        ({"world_size": 4, "ep": 2, "tp": 4}, "--ep 2 must be a multiple of --tp 4"),
        ({"world_size": 2, "ep": 2}, "--ep 2 runs as transformers shards it"),
        ({"world_size": 2, "ep": 2, "shard": "zero3", "offload": "optimizer"}, "--offload with --ep is not traced"),
        ({"world_size": 8, "cp": 2, "pp": 2, "shard": "zero3"}, "--cp with --pp or --ep is not traced yet"),
        ({"world_size": 2, "cp": 2, "shard": "zero3", "cp_rank": 2}, "context-parallel rank 2 is not one of the 2"),
        ({"world_size": 6, "cp": 2, "tp": 2, "shard": "zero3"}, "not a multiple of --cp 2 x --tp 2: the world is dp x cp x tp"),
        ({"world_size": 3, "cp": 2, "shard": "zero3"}, "not a multiple of --cp 2: the world is dp x cp ranks"),
        ({"world_size": 2, "cp": 2}, "reduced over dp x cp ranks"),
        ({"world_size": 2, "cp": 2, "shard": "zero3", "seq": 30}, "--seq 30 does not divide into 4 chunks"),
        ({"world_size": 2, "cp": 2, "shard": "zero3", "loss_head": "chunked"}, "--cp with --loss-head is not traced"),
        ({"cp_rotate": "alltoall"}, "--cp-rotate describes context parallel's ring"),
    ],
)
def test_layouts_that_are_not_traced_are_refused_by_validate(changes, match):
    with pytest.raises(MemestError, match=re.escape(match)):
        _spec(**changes)


def test_validate_takes_the_dims_it_is_given():
    """validate judges the ParallelDims passed (a planner's candidate), with the spec's other options."""
    spec = _spec(world_size=4, tp=2, shard="zero3")
    validate(ParallelDims(8, tp=2, pp=2, shard=Shard.ZERO3), spec)
    with pytest.raises(MemestError, match=re.escape("--world-size 8 with --tp 2 is 4-way data parallel x TP 2")):
        validate(ParallelDims(8, tp=2), spec)


def test_a_planner_layout_is_the_same_value():
    layout = Layout(dp=2, tp=2, pp=2, sp=False)
    spec = dataclasses.replace(_spec(), **layout.changes())
    assert layout.dims == spec.parallel
    assert Layout(dp=1, tp=4, pp=1, sp=True).dims == _spec(world_size=4, tp=4, sp=True).parallel


@pytest.mark.parametrize("name", ["fsdp", "fsdp-x-tp", "tp-sp", "pp-x-dp-x-tp", "ep", "ep-x-tp", "ep-x-pp", "cp", "cp-x-tp"])
def test_build_mesh_gives_every_wrap_path_its_meshes(name):
    from memest.parallel.distributed import fake_process_group

    changes, (dp, tp, pp, cp, ep), on, mesh, experts = LAYOUTS[name]
    dims = _spec(**changes).parallel
    with fake_process_group(dims.world_size, rank=dims.rank):
        meshes = build_mesh(dims)
        names, shape = zip(*mesh, strict=True)
        assert meshes.world.mesh_dim_names == names
        assert tuple(meshes.world.shape) == shape
        assert meshes.fsdp.size() == dp * cp  # FSDP2 over dp, or dp x cp (torchtitan's dp_shard_cp)
        assert (meshes.tp.size() if meshes.tp is not None else 1) == tp
        assert (meshes.cp is not None) == (cp > 1) and (cp == 1 or meshes.cp.size() == cp)
        assert (meshes.pp_group is not None) == (pp > 1)
        if ep > 1:
            assert (meshes.ep.size(), meshes.efsdp.size(), meshes.ep_tp.size()) == (ep, dims.expert_copies, tp)
        else:
            assert meshes.ep is meshes.efsdp is meshes.ep_tp is None


def test_ddp_and_a_pipeline_alone_build_no_mesh():
    for changes in ({"world_size": 4}, {"world_size": 2, "pp": 2}):
        assert build_mesh(_spec(**changes).parallel).world is None
