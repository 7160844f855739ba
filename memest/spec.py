"""RunSpec: what to estimate. Built from CLI flags (later also from YAML run configs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .choices import (
    Attention,
    Cache,
    CheckpointPolicy,
    LossHead,
    Mode,
    Offload,
    Optimizer,
    Outputs,
    Precision,
    Shard,
    Target,
    ZeroGrad,
)
from .errors import MemestError

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
    loss_head: str = "standard"  # standard | chunked[:N] | fused: LM head + loss chunk by chunk (trace/loss_head.py)
    # torch.compile (trace/compiled.py): None = as the model code does (a model file may return torch.compile(model));
    # True = compile an eager model as torch.compile(model) does (Inductor); False = trace a compiled model eager
    compile: bool | None = None

    def __post_init__(self) -> None:
        for name, (enum, flag) in _CHOICE_FIELDS.items():
            object.__setattr__(self, name, enum.parse(getattr(self, name), flag))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
        CheckpointPolicy.of(self.checkpointing)
        object.__setattr__(self, "loss_head", str(self.loss_head).strip().lower())
        if LossHead.of(self.loss_head)[0] != LossHead.STANDARD and not self.training:
            raise MemestError(f"--loss-head {self.loss_head} replaces a training loss; drop it with --mode {self.mode}")
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
        self._check_compile()
        if self.iterations < 1:
            raise MemestError(f"iterations must be at least 1, got {self.iterations}")

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
