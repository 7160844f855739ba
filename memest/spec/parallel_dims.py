"""ParallelDims: a run's parallelism as one value (torchtitan's ``ParallelDims``, torchtitan/distributed/parallel_dims.py).

The degrees (data, tensor, pipeline, context and expert parallel) and what follows from them: which dimensions are
on, the device mesh's dimensions in their one order (pp, dp, cp, tp: a rank's tensor-parallel peers are its
neighbours, its pipeline peers the farthest), which global rank the trace is, the copies of each expert group, and
the layout checks of a RunSpec (``validate``). Plain data, at the spec's level (RunSpec checks a layout with it);
the meshes it describes are built by parallel/dims.build_mesh.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from memest.errors import MemestError
from memest.spec.choices import CpRotate, LossHead, Offload, PipelineSchedule, Shard

if TYPE_CHECKING:
    from memest.spec.run import RunSpec

FSDP_SHARDS = (Shard.ZERO2, Shard.ZERO3)  # the --shard values that run FSDP2 (parallel/distributed.py)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of one layout; ``dp`` is what the others leave of ``world_size`` (world = pp x dp x cp x tp).
    ``ep`` divides the experts over ep of a stage's data-parallel ranks (it is not a factor of the world).
    ``pp_stage`` and ``cp_rank`` pick the rank traced (``rank``)."""

    world_size: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    shard: Shard = Shard.NONE
    pp_stage: int = 0
    cp_rank: int = 0

    @classmethod
    def from_spec(cls, spec: RunSpec) -> ParallelDims:
        return cls(spec.world_size, spec.tp, spec.pp, spec.cp, spec.ep, Shard.parse(spec.shard, "--shard"),
                   spec.pp_stage, spec.cp_rank)

    # -- degrees ----------------------------------------------------------------------------------
    @property
    def non_data_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: --world-size / (--tp x --pp x --cp)."""
        return self.world_size // self.non_data_parallel_size

    @property
    def dp_shard(self) -> int:
        """Data-parallel ranks that shard the model (FSDP2: --shard zero2/zero3), else 1."""
        return self.dp if self.fsdp_enabled else 1

    @property
    def dp_replicate(self) -> int:
        """Data-parallel ranks that hold replicas (DDP, ZeRO-1), else 1."""
        return 1 if self.fsdp_enabled else self.dp

    @property
    def expert_copies(self) -> int:
        """--ep: copies of each expert group (transformers' efsdp mesh dimension): a stage's ranks / ep."""
        return self.world_size // (self.pp * self.ep)

    # -- which dimensions are on ------------------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp > 1

    @property
    def fsdp_enabled(self) -> bool:
        """The data-parallel ranks shard parameters, gradients and optimizer state with FSDP2."""
        return self.shard in FSDP_SHARDS

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    # -- ranks --------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """The global rank traced: the first of ``pp_stage``'s ranks on the ("pp", "dp", "tp") mesh; with --cp,
        the first tensor-parallel rank of ``cp_rank`` in the first data-parallel group on the ("dp", "cp", "tp")
        mesh (tp innermost; ("dp", "cp") without --tp)."""
        return self.pp_stage * self.dp * self.tp + self.cp_rank * self.tp

    def stage_of(self, rank: int) -> int:
        """The pipeline stage global ``rank`` runs (its "pp" coordinate)."""
        return rank // (self.world_size // self.pp)

    # -- the mesh -------------------------------------------------------------------------------------
    @property
    def mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """(name, size) of the dense device mesh, in the one order pp, dp, cp, tp; () where none is built (DDP,
        one rank, a pipeline of one rank per stage). dp is always a dimension; tp is one with --tp and with --pp
        (a stage's tensor-parallel mesh, of size 1 without --tp); without --pp, --cp or --tp the one dimension
        is every rank (FSDP2's mesh, "dp_cp" under --cp)."""
        if self.pp_enabled:
            return () if self.world_size == self.pp else (("pp", self.pp), ("dp", self.dp), ("tp", self.tp))
        if self.cp_enabled:
            return (("dp", self.dp), ("cp", self.cp)) + ((("tp", self.tp),) if self.tp_enabled else ())
        if self.tp_enabled:
            return (("dp", self.dp), ("tp", self.tp))
        if self.ep_enabled or self.fsdp_enabled:
            return (("dp", self.world_size),)
        return ()

    @property
    def expert_mesh_dims(self) -> tuple[tuple[str, int], ...]:
        """--ep: (name, size) of transformers' expert mesh (efsdp, ep innermost), per pipeline stage with --pp."""
        if not self.ep_enabled:
            return ()
        stage = (("pp", self.pp),) if self.pp_enabled else ()
        return stage + (("efsdp", self.expert_copies), ("ep", self.ep))


# -- the layout checks of a RunSpec ------------------------------------------------------------------
def validate(dims: ParallelDims, spec: RunSpec) -> None:
    """Refuse a layout memest does not trace (every message names the fix); ``spec`` for the options the
    checks read (mode, shard, offload, the pipeline's and ring's options)."""
    for name in ("pp", "ep", "cp", "tp"):  # every degree first: the checks below divide by them
        if getattr(dims, name) < 1:
            raise MemestError(f"--{name} must be at least 1, got {getattr(dims, name)}")
    _check_pipeline(dims, spec)
    _check_expert_parallel(dims, spec)
    _check_context_parallel(dims, spec)
    _check_tensor_parallel(dims, spec)


def _check_tensor_parallel(d: ParallelDims, spec: RunSpec) -> None:
    if spec.sp and d.tp < 2:
        raise MemestError("--sp shards the sequence across the tensor-parallel ranks; it needs --tp 2 or more")
    # each TP rank holds seq / tp positions (issue 22, item 29); a pipeline checks it per stage at trace time, with
    # the reason that holds there (pipeline_parallel.py: each stage sends its rank's slice)
    if spec.sp and spec.seq and spec.seq % d.tp and not d.pp_enabled:
        raise MemestError(f"--sp shards the sequence evenly over the --tp {d.tp} ranks: --seq {spec.seq} is not a multiple "
                          f"of {d.tp}; the sequence must divide by --tp {d.tp} "
                          f"(e.g. --seq {spec.seq + d.tp - spec.seq % d.tp})")
    _check_loss_parallel(d, spec)
    if not d.tp_enabled:
        return
    if LossHead.of(spec.loss_head)[0] != LossHead.STANDARD:  # was: TypeError "... missing 'labels'" (battery 30)
        raise MemestError(f"--loss-head {spec.loss_head} with --tp is not traced yet: the tensor-parallel plan wraps the "
                          "LM head, whose replacement then gets no labels; drop --loss-head or --tp")
    if d.world_size % d.tp:
        raise MemestError(
            f"--world-size {d.world_size} is not a multiple of --tp {d.tp}: the world is dp x tp ranks "
            f"(e.g. --world-size {d.tp} for tensor parallel alone, {2 * d.tp} for 2-way FSDP x TP {d.tp})"
        )
    if not spec.training:
        raise MemestError(f"--tp is traced for training steps; drop it with --mode {spec.mode}")
    if spec.offload != Offload.NONE:
        raise MemestError("--offload with --tp is not traced (not validated against a real run)")
    if d.cp_enabled:
        return  # --cp x --tp: FSDP2 over dp x cp, which _check_context_parallel requires
    if d.dp_enabled and not d.fsdp_enabled:
        raise MemestError(
            f"--world-size {d.world_size} with --tp {d.tp} is {d.dp}-way data parallel x TP {d.tp}: torch's "
            "2-D recipe shards that dimension with FSDP2; add --shard zero3 (or zero2)"
        )
    if d.dp == 1 and d.shard != Shard.NONE:
        raise MemestError(
            f"--shard {d.shard} needs data-parallel ranks: --world-size {d.world_size} is all tensor parallel "
            f"(--tp {d.tp}); use --world-size {2 * d.tp} for 2-way FSDP x TP"
        )


def _check_pipeline(d: ParallelDims, spec: RunSpec) -> None:
    if spec.microbatches < 0:
        raise MemestError(f"--microbatches must be at least 1, got {spec.microbatches}")
    if not d.pp_enabled:
        if spec.microbatches or spec.pp_split or spec.pp_virtual or spec.pp_schedule != PipelineSchedule.ONE_F_ONE_B:
            raise MemestError("--microbatches, --pp-split, --pp-virtual and --pp-schedule describe a pipeline; add --pp N "
                              "(N >= 2)")
        return
    _check_pipeline_sizes(d, spec)
    if spec.pp_virtual < 0 or (spec.pp_virtual > 1 and spec.stages_per_rank != spec.pp_virtual):
        raise MemestError(
            f"--pp-virtual {spec.pp_virtual}: --pp-schedule {spec.pp_schedule} runs {spec.stages_per_rank} stage(s) per "
            "rank; choose interleaved or looped-bfs for several"
        )
    if d.world_size % (d.pp * d.tp):
        raise MemestError(
            f"--world-size {d.world_size} is not a multiple of --pp {d.pp} x --tp {d.tp}: the world is pp x dp x tp "
            f"ranks (e.g. --world-size {d.pp * d.tp} for the pipeline alone)"
        )
    if d.dp_enabled and not d.fsdp_enabled:
        raise MemestError(
            f"--world-size {d.world_size} with --pp {d.pp} is {d.dp}-way data parallel per stage: each stage is "
            "sharded with FSDP2 (torchtitan's recipe); add --shard zero3 (or zero2)"
        )
    if d.dp == 1 and d.shard != Shard.NONE:
        raise MemestError(f"--shard {d.shard} needs data-parallel ranks: use --world-size {2 * d.pp * d.tp} for 2-way "
                          "FSDP per stage")
    if not spec.training or spec.grad_accum > 1 or LossHead.of(spec.loss_head)[0] != LossHead.STANDARD:
        raise MemestError("--pp traces a training step of --microbatches micro-batches (drop --grad-accum, --loss-head, "
                          "--mode)")
    if not 0 <= d.pp_stage < d.pp:
        raise MemestError(f"pipeline stage {d.pp_stage} is not one of the {d.pp} stages")


def _check_pipeline_sizes(d: ParallelDims, spec: RunSpec) -> None:
    """--pp-split and --microbatches, before the model is built (the errors name them, not the wrapping)."""
    if spec.pp_split:
        counts = [c.strip() for c in spec.pp_split.split(",")]
        stages = d.pp * spec.stages_per_rank
        if not all(c.isdigit() for c in counts):  # how many, and their sum, are checked against the model's layers
            raise MemestError(f"--pp-split {spec.pp_split}: give {stages} whole layer counts, one per stage, separated by "
                              f"commas (e.g. {','.join(['2'] * stages)})")
    # torch.distributed.pipelining.schedules.Schedule1F1B.__init__ refuses n_microbatches < num_stages (torch 2.13)
    if spec.pp_schedule == PipelineSchedule.ONE_F_ONE_B and 0 < spec.microbatches < d.pp:
        raise MemestError(f"--microbatches {spec.microbatches} with --pp {d.pp}: --pp-schedule 1f1b needs at least one "
                          f"micro-batch per stage (--microbatches {d.pp} or more; torch's Schedule1F1B)")


def _check_expert_parallel(d: ParallelDims, spec: RunSpec) -> None:
    if not d.ep_enabled:
        return
    if d.pp_enabled and (d.world_size // d.pp) % d.ep:
        raise MemestError(
            f"--ep {d.ep} with --pp {d.pp}: each stage's {d.world_size // d.pp} ranks (--world-size / --pp) must be "
            f"a multiple of --ep (the experts are divided over ep of them; e.g. --world-size {d.pp * d.ep})"
        )
    if d.world_size % d.ep:
        raise MemestError(
            f"--world-size {d.world_size} is not a multiple of --ep {d.ep}: expert parallel divides the experts "
            f"over ep of the data-parallel ranks (e.g. --world-size {d.ep}, or {2 * d.ep} for 2 copies of each "
            "expert group)"
        )
    if d.ep % d.tp:
        raise MemestError(f"--ep {d.ep} must be a multiple of --tp {d.tp} (transformers' DistributedConfig: the "
                          "ranks of a TP group share a batch and each dispatches its slice)")
    if not spec.training:
        raise MemestError(f"--ep is traced for training steps; drop it with --mode {spec.mode}")
    if spec.offload != Offload.NONE:
        raise MemestError("--offload with --ep is not traced (not validated against a real run)")
    if not d.tp_enabled and not d.fsdp_enabled and not d.pp_enabled:  # --tp, --pp: their checks decide
        raise MemestError(
            f"--ep {d.ep} runs as transformers shards it (DistributedConfig(fsdp_size=world, ep_size={d.ep})): the "
            "dense weights with FSDP2 over every rank, each expert group's copies with FSDP2 over the rest; add "
            "--shard zero3 (or zero2)"
        )


def _check_context_parallel(d: ParallelDims, spec: RunSpec) -> None:
    if not d.cp_enabled:
        if spec.cp_rotate != CpRotate.ALLGATHER:
            raise MemestError("--cp-rotate describes context parallel's ring; add --cp N (N >= 2)")
        return
    if d.pp_enabled or d.ep_enabled:
        raise MemestError("--cp with --pp or --ep is not traced yet (context parallel x FSDP2, and x --tp, are)")
    if not 0 <= d.cp_rank < d.cp:
        raise MemestError(f"context-parallel rank {d.cp_rank} is not one of the {d.cp} ranks")
    if d.world_size % (d.cp * d.tp):
        tp = f" x --tp {d.tp}" if d.tp_enabled else ""
        raise MemestError(
            f"--world-size {d.world_size} is not a multiple of --cp {d.cp}{tp}: the world is dp x cp"
            f"{' x tp' if d.tp_enabled else ''} ranks (e.g. --world-size {d.cp * d.tp} for context parallel"
            f"{tp} alone, {2 * d.cp * d.tp} for 2-way data parallel)"
        )
    if not spec.training:
        raise MemestError(f"--cp is traced for training steps; drop it with --mode {spec.mode}")
    if not d.fsdp_enabled:
        raise MemestError(
            f"--cp {d.cp}: each rank's gradients cover its part of the sequence and are reduced over dp x cp "
            "ranks; torchtitan shards the model with FSDP2 over all of them; add --shard zero3 (or zero2)"
        )
    if spec.offload != Offload.NONE:
        raise MemestError("--offload with --cp is not traced (not validated against a real run)")
    if spec.seq is not None and spec.seq % (2 * d.cp):
        raise MemestError(
            f"--seq {spec.seq} does not divide into {2 * d.cp} chunks: context parallel's head-tail load "
            f"balance gives each of the {d.cp} ranks two equal chunks of the sequence"
        )
    if LossHead.of(spec.loss_head)[0] != LossHead.STANDARD:
        raise MemestError("--cp with --loss-head is not traced (the head runs on the rank's shard of the sequence)")


def loss_parallel(spec: RunSpec) -> bool:
    """Whether the step runs torchtitan's loss parallel: --sp (torchtitan's plan, whose default it is: on unless
    parallelism.disable_loss_parallel) without --pp, --cp or a --loss-head, unless --no-loss-parallel."""
    if spec.loss_parallel is False or not spec.sp:
        return False
    return spec.pp == 1 and spec.cp == 1 and LossHead.of(spec.loss_head)[0] == LossHead.STANDARD


def _check_loss_parallel(d: ParallelDims, spec: RunSpec) -> None:
    if not spec.loss_parallel:
        return
    if not spec.sp:
        raise MemestError(
            "--loss-parallel is torchtitan's, with its plan (--sp); transformers' plan (--tp without --sp) gathers the "
            "head's output (lm_head: colwise_gather_output) and computes the loss on whole logits"
        )
    if d.pp_enabled or d.cp_enabled:
        raise MemestError("--loss-parallel with --pp or --cp is not traced (not validated against a real run): use "
                          "--no-loss-parallel (the head gathers whole logits)")
    if LossHead.of(spec.loss_head)[0] != LossHead.STANDARD:
        raise MemestError(f"--loss-parallel with --loss-head {spec.loss_head} is not modelled (the chunked and fused "
                          "heads compute the loss on local logits); use --no-loss-parallel")
