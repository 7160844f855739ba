"""The device meshes of a layout (``ParallelDims``, spec/parallel_dims.py): one builder every wrap path uses
(parallel/distributed.wrap, in the trace and in the real ground truth alike). The dense mesh has the dimensions
``ParallelDims.mesh_dims`` names, in the one order pp, dp, cp, tp; with --ep, transformers' expert mesh
(``expert_mesh_dims``) beside it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memest.spec.parallel_dims import ParallelDims, validate

__all__ = ["Meshes", "ParallelDims", "build_mesh", "real_values", "validate"]


def build_mesh(dims: ParallelDims) -> Meshes:
    """The device meshes of this layout (module doc), on the process group this process runs in (the trace's fake
    one, or gloo in validate/distributed_truth.py). Pipeline dimensions are fake groups in both:
    torch.distributed.pipelining's transfers hang on gloo (pytorch#132644), so they complete at once and move no
    data. DDP and a pipeline of one rank per stage get no mesh (nothing is built)."""
    if not dims.mesh_dims and not dims.ep_enabled:
        return Meshes()
    from torch.distributed.device_mesh import init_device_mesh

    if dims.pp_enabled:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  registers "fake"

    def mesh(layout: tuple[tuple[str, int], ...]):
        names, shape = zip(*layout, strict=True)
        override = {"backend_override": {"pp": "fake"}} if "pp" in names else {}
        return init_device_mesh("cpu", shape, mesh_dim_names=names, **override)

    out = Meshes()
    with real_values():  # meshes read their rank tables
        if dims.mesh_dims:
            world = mesh(dims.mesh_dims)
            names = world.mesh_dim_names
            out.world = world
            out.fsdp = world if world.ndim == 1 else world["dp"]
            out.tp = world["tp"] if "tp" in names else None
            out.cp = world["cp"] if "cp" in names else None
            out.pp_group = world["pp"].get_group() if "pp" in names else None
            if dims.cp_enabled and dims.tp_enabled:  # torchtitan's dp_shard_cp: FSDP2 over dp x cp
                out.fsdp = world["dp", "cp"]._flatten("dp_cp")
            elif dims.cp_enabled:  # FSDP2 over every rank
                out.fsdp = mesh((("dp_cp", dims.world_size),))
        if dims.ep_enabled:
            experts = mesh(dims.expert_mesh_dims)
            out.ep, out.efsdp = experts["ep"], experts["efsdp"]
            # the tp mesh AllToAllEP asks for (ranks sharing one batch): transformers' dense (fsdp, tp) mesh
            out.ep_tp = out.tp if out.tp is not None else mesh((("fsdp", dims.world_size), ("tp", 1)))["tp"]
    return out


@dataclass
class Meshes:
    """The meshes one rank's wrappers run on (None where the layout has no such dimension)."""

    world: Any = None  # the dense mesh (``ParallelDims.mesh_dims``)
    fsdp: Any = None  # the dense parameters' FSDP2 mesh: "dp", or dp x cp with --cp
    tp: Any = None
    cp: Any = None
    pp_group: Any = None  # the pipeline dimension's (fake) process group
    ep: Any = None  # --ep: transformers' expert mesh dimensions
    efsdp: Any = None
    ep_tp: Any = None  # --ep: the tensor-parallel mesh AllToAllEP splits a shared batch over


def real_values():
    """No dispatch mode while a mesh computes from its rank table: neither the fake mode nor the
    placeholder answers to value reads that the build runs under (trace/values.py), which would pick
    another rank's group."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()
