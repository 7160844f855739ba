"""RunSpec: what to estimate. Built from CLI flags (later also from YAML run configs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from memest.errors import MemestError
from memest.spec.choices import (
    Attention,
    Cache,
    CheckpointPolicy,
    CpRotate,
    DataDependent,
    ExpertRouting,
    LossHead,
    Mode,
    Offload,
    Optimizer,
    Outputs,
    PipelineSchedule,
    Precision,
    Quant,
    Shard,
    Target,
    ZeroGrad,
)

# field -> (enum, flag); values given as strings are turned into members in __post_init__
_CHOICE_FIELDS = {
    "optim": (Optimizer, "--optim"),
    "precision": (Precision, "--precision"),
    "target": (Target, "--target"),
    "attention": (Attention, "--attention"),
    "zero_grad": (ZeroGrad, "--zero-grad"),
    "mode": (Mode, "--mode"),
    "cache": (Cache, "--cache"),
    "shard": (Shard, "--shard"),
    "offload": (Offload, "--offload"),
    "outputs": (Outputs, "--outputs"),
    "pp_schedule": (PipelineSchedule, "--pp-schedule"),
    "quant": (Quant, "--quant"),
    "data_dependent": (DataDependent, "--data-dependent"),
    "ep_routing": (ExpertRouting, "ep_routing"),
    "cp_rotate": (CpRotate, "--cp-rotate"),
}


@dataclass(frozen=True)
class RunSpec:
    """One training configuration of one model.

    ``model`` is a model reference: ``path/to/model.py``, ``path.py:factory``, ``hf:NAME`` or
    ``hf:path/to/config.json``.
    """

    model: str
    batch: int = 1
    seq: int | None = None
    optim: Optimizer = Optimizer.ADAM
    lr: float = 1e-3
    precision: Precision = Precision.FP32
    target: Target = Target.CUDA
    iterations: int = 2
    attention: Attention = Attention.AUTO  # --target cuda: SDPA backend (auto follows PyTorch's selection rules)
    fused: bool = False  # --target cuda: fused optimizer kernels instead of foreach
    cudnn_benchmark: bool = False  # --target cuda: torch.backends.cudnn.benchmark (cuDNN searches its algorithms)
    compute_capability: tuple[int, int] = (9, 0)  # of the target GPU; decides e.g. flash availability
    grad_accum: int = 1  # micro-steps per optimizer step; batch is the micro-batch
    checkpointing: str = "none"  # none | blocks | every:N | module.name,other.name
    zero_grad: ZeroGrad = ZeroGrad.NONE  # after the step: grads set to None, or kept as zeros
    mode: Mode = Mode.TRAIN  # train | inference (no grad, no optimizer) | generate (decoder KV cache)
    new_tokens: int = 0  # --mode generate: tokens generated after a prompt of --seq tokens
    cache: Cache = Cache.DYNAMIC  # --mode generate: dynamic (grows) or static (preallocated) KV cache
    world_size: int = 1  # data-parallel ranks; estimates are per rank
    shard: Shard = Shard.NONE  # zero1: optimizer state, zero2: + gradients, zero3 (FSDP full shard): + parameters
    offload: Offload = Offload.NONE  # optimizer: state (and step) on the CPU; params: params+grads+optimizer on the CPU
    # training loop: kept = the plain loop (out referenced through backward and into the next forward), the safe side;
    # freed = out dropped before backward (HF Trainer, Lightning, torchtune)
    outputs: Outputs = Outputs.KEPT
    loss_head: str = "standard"  # standard | chunked[:N] | fused: LM head + loss chunk by chunk (features/loss_head.py)
    tp: int = 1  # tensor-parallel ranks (parallel/tensor_parallel.py); --world-size = dp x tp
    sp: bool = False  # sequence parallel on top of --tp (torchtitan's plan)
    pp: int = 1  # pipeline ranks (parallel/pipeline_parallel.py); --world-size = pp x dp x tp
    pp_schedule: PipelineSchedule = PipelineSchedule.ONE_F_ONE_B
    pp_virtual: int = 0  # --pp: stages per rank of the interleaved schedules (0 = the schedule's default)
    microbatches: int = 0  # --pp: micro-batches (of --batch) per step; 0 = --pp
    pp_split: str = ""  # --pp: layers per stage, e.g. "3,3,2" ("" = even)
    pp_stage: int = 0  # the stage traced (every stage is traced for a report; not a user option)
    ep: int = 1  # expert-parallel ranks (parallel/expert_parallel.py): MoE experts divided over ep of the dp ranks
    ep_routing: ExpertRouting = ExpertRouting.UNIFORM  # --ep: the routing split traced (both are; not a user option)
    cp: int = 1  # context-parallel ranks (parallel/context_parallel.py); --world-size = dp x cp
    cp_rotate: CpRotate = CpRotate.ALLGATHER  # --cp: how the ring passes key/value blocks
    cp_rank: int = 0  # --cp: the context-parallel rank traced (every one is traced for a report; not a user option)
    # fine-tuning (features/finetune.py): peft LoRA ('' off; canonical r=..,alpha=..,dropout=..,targets=a,b),
    # parameters frozen by name pattern, the base's linear weights quantized as bitsandbytes stores them
    lora: str = ""
    freeze: str = ""
    quant: Quant = Quant.NONE
    double_quant: bool = True  # --quant: bitsandbytes' compress_statistics (bnb_4bit_use_double_quant)
    prepare_kbit: bool = False  # --quant: peft's prepare_model_for_kbit_training (non-quantized weights to fp32)
    # torch.compile (features/compiled.py): None = as the model code does (a model file may return torch.compile(model));
    # True = compile an eager model as torch.compile(model) does (Inductor); False = trace a compiled model eager
    compile: bool | None = None
    # ops whose output size depends on values: refuse (the error), or upper-bound (features/upper_bound.py)
    data_dependent: DataDependent = DataDependent.REFUSE

    def __post_init__(self) -> None:
        for name, (enum, flag) in _CHOICE_FIELDS.items():
            object.__setattr__(self, name, enum.parse(getattr(self, name), flag))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
        CheckpointPolicy.of(self.checkpointing)
        object.__setattr__(self, "loss_head", str(self.loss_head).strip().lower())
        if LossHead.of(self.loss_head)[0] != LossHead.STANDARD and not self.training:
            raise MemestError(f"--loss-head {self.loss_head} replaces a training loss; drop it with --mode {self.mode}")
        self._check_finetune()
        if self.batch < 1:
            raise MemestError(f"--batch must be at least 1, got {self.batch}")
        if self.seq is not None and self.seq < 1:
            raise MemestError(f"--seq must be at least 1, got {self.seq}")
        if self.target == "cpu" and (self.fused or self.attention != "auto" or self.cudnn_benchmark):
            raise MemestError(
                "--fused, --attention and --cudnn-benchmark describe CUDA kernels; use them with --target cuda"
            )
        if self.grad_accum < 1:
            raise MemestError(
                f"--grad-accum must be at least 1 (micro-steps per optimizer step), got {self.grad_accum}; "
                "use 1 for no accumulation"
            )
        if self.mode == "generate" and self.new_tokens < 1:
            raise MemestError("--mode generate needs --new-tokens N (N >= 1 tokens generated after the prompt)")
        if self.mode != "generate" and self.new_tokens:
            raise MemestError("--new-tokens applies to --mode generate only")
        if self.mode != "train" and (self.grad_accum > 1 or self.checkpointing != "none"):
            raise MemestError(
                f"--grad-accum and --checkpointing are training techniques; drop them with --mode {self.mode}"
            )
        if self.world_size < 1:
            raise MemestError(f"--world-size must be at least 1, got {self.world_size}")
        if self.shard != "none" and self.world_size < 2:
            raise MemestError(
                f"--shard {self.shard} splits state across ranks and needs --world-size 2 or more; "
                "with one GPU use --shard none (or --offload to move state to the CPU)"
            )
        if self.shard != "none" and not self.training:
            raise MemestError(f"--shard applies to training; drop it with --mode {self.mode}")
        if self.offload == "params" and self.shard != "zero3":
            raise MemestError("--offload params needs --shard zero3 (FSDP's CPU offload); use --offload optimizer otherwise")
        self._check_model_parallel()
        self._check_compile()
        if self.iterations < 1:
            raise MemestError(f"iterations must be at least 1, got {self.iterations}")

    def _check_model_parallel(self) -> None:
        self._check_pipeline()
        self._check_expert_parallel()
        self._check_context_parallel()
        if self.tp < 1:
            raise MemestError(f"--tp must be at least 1, got {self.tp}")
        if self.sp and self.tp < 2:
            raise MemestError("--sp shards the sequence across the tensor-parallel ranks; it needs --tp 2 or more")
        if self.tp == 1:
            return
        if self.world_size % self.tp:
            raise MemestError(
                f"--world-size {self.world_size} is not a multiple of --tp {self.tp}: the world is dp x tp ranks "
                f"(e.g. --world-size {self.tp} for tensor parallel alone, {2 * self.tp} for 2-way FSDP x TP {self.tp})"
            )
        if not self.training:
            raise MemestError(f"--tp is traced for training steps; drop it with --mode {self.mode}")
        if self.offload != "none":
            raise MemestError("--offload with --tp is not traced (not validated against a real run)")
        if self.cp > 1:
            return  # --cp x --tp: FSDP2 over dp x cp, which _check_context_parallel requires
        if self.dp > 1 and self.shard not in ("zero2", "zero3"):
            raise MemestError(
                f"--world-size {self.world_size} with --tp {self.tp} is {self.dp}-way data parallel x TP {self.tp}: torch's "
                "2-D recipe shards that dimension with FSDP2; add --shard zero3 (or zero2)"
            )
        if self.dp == 1 and self.shard != "none":
            raise MemestError(
                f"--shard {self.shard} needs data-parallel ranks: --world-size {self.world_size} is all tensor parallel "
                f"(--tp {self.tp}); use --world-size {2 * self.tp} for 2-way FSDP x TP"
            )

    def _check_pipeline(self) -> None:
        if self.pp < 1:
            raise MemestError(f"--pp must be at least 1, got {self.pp}")
        if self.microbatches < 0:
            raise MemestError(f"--microbatches must be at least 1, got {self.microbatches}")
        if self.pp == 1:
            if self.microbatches or self.pp_split or self.pp_schedule != "1f1b":
                raise MemestError("--microbatches, --pp-split and --pp-schedule describe a pipeline; add --pp N (N >= 2)")
            return
        if self.pp_virtual < 0 or (self.pp_virtual > 1 and self.stages_per_rank != self.pp_virtual):
            raise MemestError(
                f"--pp-virtual {self.pp_virtual}: --pp-schedule {self.pp_schedule} runs {self.stages_per_rank} stage(s) per rank; "
                "choose interleaved or looped-bfs for several"
            )
        if self.world_size % (self.pp * self.tp):
            raise MemestError(
                f"--world-size {self.world_size} is not a multiple of --pp {self.pp} x --tp {self.tp}: the world is pp x dp x tp "
                f"ranks (e.g. --world-size {self.pp * self.tp} for the pipeline alone)"
            )
        if self.dp > 1 and self.shard not in ("zero2", "zero3"):
            raise MemestError(
                f"--world-size {self.world_size} with --pp {self.pp} is {self.dp}-way data parallel per stage: each stage is "
                "sharded with FSDP2 (torchtitan's recipe); add --shard zero3 (or zero2)"
            )
        if self.dp == 1 and self.shard != "none":
            raise MemestError(f"--shard {self.shard} needs data-parallel ranks: use --world-size {2 * self.pp * self.tp} for 2-way FSDP per stage")
        if not self.training or self.grad_accum > 1 or LossHead.of(self.loss_head)[0] != LossHead.STANDARD:
            raise MemestError("--pp traces a training step of --microbatches micro-batches (drop --grad-accum, --loss-head, --mode)")
        if not 0 <= self.pp_stage < self.pp:
            raise MemestError(f"pipeline stage {self.pp_stage} is not one of the {self.pp} stages")

    def _check_expert_parallel(self) -> None:
        if self.ep < 1:
            raise MemestError(f"--ep must be at least 1, got {self.ep}")
        if self.ep == 1:
            return
        if self.pp > 1 and (self.world_size // self.pp) % self.ep:
            raise MemestError(
                f"--ep {self.ep} with --pp {self.pp}: each stage's {self.world_size // self.pp} ranks (--world-size / --pp) must be "
                f"a multiple of --ep (the experts are divided over ep of them; e.g. --world-size {self.pp * self.ep})"
            )
        if self.world_size % self.ep:
            raise MemestError(
                f"--world-size {self.world_size} is not a multiple of --ep {self.ep}: expert parallel divides the experts "
                f"over ep of the data-parallel ranks (e.g. --world-size {self.ep}, or {2 * self.ep} for 2 copies of each "
                "expert group)"
            )
        if self.ep % self.tp:
            raise MemestError(f"--ep {self.ep} must be a multiple of --tp {self.tp} (transformers' DistributedConfig: the "
                              "ranks of a TP group share a batch and each dispatches its slice)")
        if not self.training:
            raise MemestError(f"--ep is traced for training steps; drop it with --mode {self.mode}")
        if self.offload != "none":
            raise MemestError("--offload with --ep is not traced (not validated against a real run)")
        if self.tp == 1 and self.shard not in ("zero2", "zero3") and self.pp == 1:  # --tp, --pp: their checks decide
            raise MemestError(
                f"--ep {self.ep} runs as transformers shards it (DistributedConfig(fsdp_size=world, ep_size={self.ep})): the "
                "dense weights with FSDP2 over every rank, each expert group's copies with FSDP2 over the rest; add "
                "--shard zero3 (or zero2)"
            )

    def _check_context_parallel(self) -> None:
        if self.cp < 1:
            raise MemestError(f"--cp must be at least 1, got {self.cp}")
        if self.cp == 1:
            if self.cp_rotate != CpRotate.ALLGATHER:
                raise MemestError("--cp-rotate describes context parallel's ring; add --cp N (N >= 2)")
            return
        if self.pp > 1 or self.ep > 1:
            raise MemestError("--cp with --pp or --ep is not traced yet (context parallel x FSDP2, and x --tp, are)")
        if not 0 <= self.cp_rank < self.cp:
            raise MemestError(f"context-parallel rank {self.cp_rank} is not one of the {self.cp} ranks")
        if self.world_size % (self.cp * self.tp):
            tp = f" x --tp {self.tp}" if self.tp > 1 else ""
            raise MemestError(
                f"--world-size {self.world_size} is not a multiple of --cp {self.cp}{tp}: the world is dp x cp"
                f"{' x tp' if self.tp > 1 else ''} ranks (e.g. --world-size {self.cp * self.tp} for context parallel"
                f"{tp} alone, {2 * self.cp * self.tp} for 2-way data parallel)"
            )
        if not self.training:
            raise MemestError(f"--cp is traced for training steps; drop it with --mode {self.mode}")
        if self.shard not in ("zero2", "zero3"):
            raise MemestError(
                f"--cp {self.cp}: each rank's gradients cover its part of the sequence and are reduced over dp x cp "
                "ranks; torchtitan shards the model with FSDP2 over all of them; add --shard zero3 (or zero2)"
            )
        if self.offload != "none":
            raise MemestError("--offload with --cp is not traced (not validated against a real run)")
        if self.seq is not None and self.seq % (2 * self.cp):
            raise MemestError(
                f"--seq {self.seq} does not divide into {2 * self.cp} chunks: context parallel's head-tail load "
                f"balance gives each of the {self.cp} ranks two equal chunks of the sequence"
            )
        if LossHead.of(self.loss_head)[0] != LossHead.STANDARD:
            raise MemestError("--cp with --loss-head is not traced (the head runs on the rank's shard of the sequence)")

    @property
    def microbatches_per_step(self) -> int:
        return self.microbatches or self.pp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank runs (parallel/pipeline_schedule.py): 1, or --pp-virtual (default 2)."""
        fixed = self.pp_schedule.stages_per_rank
        return fixed if fixed is not None else (self.pp_virtual or 2)

    @property
    def rank(self) -> int:
        """The global rank traced: the first of ``pp_stage``'s ranks on the ("pp", "dp", "tp") mesh; with --cp,
        the first tensor-parallel rank of ``cp_rank`` in the first data-parallel group on the ("dp", "cp", "tp")
        mesh (tp innermost; ("dp", "cp") without --tp)."""
        return self.pp_stage * self.dp * self.tp + self.cp_rank * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: --world-size / (--tp x --pp x --cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def expert_copies(self) -> int:
        """--ep: copies of each expert group (transformers' efsdp mesh dimension): a stage's ranks / ep."""
        return self.world_size // (self.pp * self.ep)

    def _check_finetune(self) -> None:
        from memest.spec.lora import freeze_patterns, parse_lora

        object.__setattr__(self, "lora", parse_lora(self.lora))
        object.__setattr__(self, "freeze", ",".join(freeze_patterns(self.freeze)))
        if self.quant != "none" and not self.lora:
            raise MemestError(f"--quant {self.quant} quantizes the frozen base of a QLoRA run; add --lora (e.g. "
                              "--lora r=16,alpha=32,targets=all-linear)")
        if self.prepare_kbit and self.quant == "none":
            raise MemestError("--prepare-kbit prepares a quantized base (peft's prepare_model_for_kbit_training); "
                              "add --quant nf4")
        if (self.lora or self.freeze) and not self.training:
            raise MemestError(f"--lora and --freeze describe fine-tuning; drop them with --mode {self.mode}")

    def _check_compile(self) -> None:
        if self.compile and self.world_size > 1:
            raise MemestError(
                "--compile with --world-size: memest does not model a compiled model under DDP/FSDP (DDPOptimizer splits "
                "the graph at bucket boundaries); drop --compile (or --no-compile for a model file that compiles itself)"
            )
        if self.compile and self.mode == "generate":
            raise MemestError("--compile with --mode generate: a compiled decode loop is not modelled; drop --compile")

    @property
    def training(self) -> bool:
        return self.mode == "train"

    @property
    def mixed(self) -> bool:
        return self.precision.mixed

    def to_dict(self) -> dict:
        return asdict(self)
