"""RunSpec: what to estimate. Built from CLI flags (later also from YAML run configs)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import MemestError

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw", "adafactor", "adam8bit")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed")
TARGETS = ("cuda", "cpu")
ATTENTIONS = ("auto", "flash", "efficient", "math")
ZERO_GRAD = ("none", "zeros")
MODES = ("train", "inference", "generate")
CACHES = ("dynamic", "static")
SHARDS = ("none", "zero1", "zero2", "zero3")
OFFLOADS = ("none", "optimizer", "params")


@dataclass(frozen=True)
class RunSpec:
    """One training configuration of one model.

    ``model`` is a model reference: ``path/to/model.py``, ``path.py:factory``, ``hf:NAME`` or
    ``hf:path/to/config.json``.
    """

    model: str
    batch: int = 1
    seq: int | None = None
    optim: str = "adam"
    lr: float = 1e-3
    precision: str = "fp32"
    target: str = "cuda"
    iterations: int = 2
    attention: str = "auto"  # --target cuda: SDPA backend (auto follows PyTorch's selection rules)
    fused: bool = False  # --target cuda: fused optimizer kernels instead of foreach
    compute_capability: tuple[int, int] = (9, 0)  # of the target GPU; decides e.g. flash availability
    grad_accum: int = 1  # micro-steps per optimizer step; batch is the micro-batch
    checkpointing: str = "none"  # none | blocks | every:N | module.name,other.name
    zero_grad: str = "none"  # after the step: grads set to None, or kept as zeros
    mode: str = "train"  # train | inference (no grad, no optimizer) | generate (decoder KV cache)
    new_tokens: int = 0  # --mode generate: tokens generated after a prompt of --seq tokens
    cache: str = "dynamic"  # --mode generate: dynamic (grows) or static (preallocated) KV cache
    world_size: int = 1  # data-parallel ranks; estimates are per rank
    shard: str = "none"  # zero1: optimizer state, zero2: + gradients, zero3 (FSDP full shard): + parameters
    offload: str = "none"  # optimizer: optimizer state (and step) on the CPU; params: params+grads+optimizer on the CPU

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise MemestError(f"--batch must be at least 1, got {self.batch}")
        if self.seq is not None and self.seq < 1:
            raise MemestError(f"--seq must be at least 1, got {self.seq}")
        _check_choice("--optim", self.optim, OPTIMIZERS)
        _check_choice("--precision", self.precision, PRECISIONS)
        _check_choice("--target", self.target, TARGETS)
        _check_choice("--attention", self.attention, ATTENTIONS)
        if self.target == "cpu" and (self.fused or self.attention != "auto"):
            raise MemestError("--fused and --attention describe CUDA kernels; use them with --target cuda")
        _check_choice("--zero-grad", self.zero_grad, ZERO_GRAD)
        _check_choice("--mode", self.mode, MODES)
        _check_choice("--cache", self.cache, CACHES)
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
        _check_choice("--shard", self.shard, SHARDS)
        _check_choice("--offload", self.offload, OFFLOADS)
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
        if self.iterations < 1:
            raise MemestError(f"iterations must be at least 1, got {self.iterations}")

    @property
    def training(self) -> bool:
        return self.mode == "train"

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    def to_dict(self) -> dict:
        return asdict(self)


def _check_choice(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise MemestError(f"unknown {flag} {value!r}; choose one of: {', '.join(choices)}")
