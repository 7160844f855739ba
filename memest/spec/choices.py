"""Every choice a user makes, declared once. RunSpec holds these enums; typer, the YAML config schema,
advise and the reports use them directly.

Members are strings (``Optimizer.ADAM == "adam"``, same hash, ``str()``/f-strings give the value), so
code and configs that compare with plain strings keep working.
"""

from __future__ import annotations

import difflib
import re
from enum import Enum

from memest.errors import MemestError


class Choice(str, Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __hash__(self) -> int:
        return hash(self.value)

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]

    @classmethod
    def parse(cls, value, flag: str):
        """The member for ``value`` (a member or its string), or a MemestError naming every choice."""
        if isinstance(value, cls):
            return value
        text = str(value).strip().lower()
        if text not in cls.values():
            text = text.replace("_", "-")  # paged_adamw_8bit, as transformers' TrainingArguments writes it
        for member in cls:
            if member.value == text:
                return member
        close = difflib.get_close_matches(text, cls.values(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise MemestError(f"unknown {flag} {value!r}{hint}; choose one of: {', '.join(cls.values())}")


class Optimizer(Choice):
    SGD = "sgd"
    SGD_MOMENTUM = "sgd-momentum"
    ADAM = "adam"
    ADAMW = "adamw"
    ADAFACTOR = "adafactor"
    ADAM8BIT = "adam8bit"
    PAGED_ADAMW_8BIT = "paged-adamw-8bit"  # bitsandbytes PagedAdamW8bit: large states in CUDA unified memory
    PAGED_ADAMW_32BIT = "paged-adamw-32bit"  # bitsandbytes PagedAdamW32bit


class Precision(Choice):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"
    BF16_MIXED = "bf16-mixed"
    FP16_MIXED = "fp16-mixed"

    @property
    def mixed(self) -> bool:
        return self.value.endswith("-mixed")


class Quant(Choice):
    """--quant: the base model's linear weights as bitsandbytes stores them (QLoRA; features/quant.py, quant_int8.py)."""

    NONE = "none"
    NF4 = "nf4"  # 4-bit NormalFloat (QLoRA's default)
    FP4 = "fp4"  # 4-bit float
    INT8 = "int8"  # LLM.int8: bitsandbytes' Linear8bitLt (features/quant_int8.py)


class AdapterDtype(Choice):
    """--lora dtype=: the LoRA adapters' dtype as peft's get_peft_model(..., autocast_adapter_dtype=) sets it (peft
    0.21.2, peft/tuners/tuners_utils.py: cast_adapter_dtype; the adapters are first moved to the base layer's device
    and dtype, _move_adapter_to_device_of_base_layer, a bitsandbytes Linear4bit's compute_dtype)."""

    FP32 = "fp32"  # autocast_adapter_dtype=True (peft's default since 0.12): fp16/bf16 adapters upcast to fp32
    BASE = "base"  # autocast_adapter_dtype=False: the base layer's dtype (peft < 0.12's only behaviour)

    @property
    def autocast(self) -> bool:
        """peft's autocast_adapter_dtype for this choice."""
        return self is AdapterDtype.FP32


class Target(Choice):
    CUDA = "cuda"  # what a CUDA run allocates (traced on CPU fake tensors, CUDA kernels modelled)
    CPU = "cpu"  # CPU training


class Attention(Choice):
    AUTO = "auto"  # PyTorch's SDPA backend selection rules
    FLASH = "flash"
    EFFICIENT = "efficient"
    MATH = "math"


class ZeroGrad(Choice):
    NONE = "none"  # grads set to None after the step
    ZEROS = "zeros"  # grads kept, filled with zeros


class Mode(Choice):
    TRAIN = "train"
    INFERENCE = "inference"
    GENERATE = "generate"


class Cache(Choice):
    DYNAMIC = "dynamic"
    STATIC = "static"


class Shard(Choice):
    NONE = "none"
    ZERO1 = "zero1"  # optimizer state
    ZERO2 = "zero2"  # + gradients
    ZERO3 = "zero3"  # + parameters (FSDP full shard)


class FsdpVersion(Choice):
    """--fsdp-version: which of torch's FSDP implementations shards the model under --shard zero2/zero3
    (parallel/distributed.py); 1 also wraps --shard none (FSDP1's NO_SHARD instead of DDP)."""

    V2 = "2"  # fully_shard: per-parameter DTensor shards (torchtitan, accelerate's fsdp_version 2)
    # FullyShardedDataParallel with use_orig_params=False: one flat parameter per wrapped unit (fsdp_qlora's train.py,
    # accelerate's and TrainingArguments' fsdp_version 1, their default)
    V1 = "1"


class PipelineSchedule(Choice):
    """--pp-schedule: torch.distributed.pipelining's schedules (parallel/pipeline_schedule.py); how many
    micro-batches each stage holds comes from walking the schedule's own action order."""

    ONE_F_ONE_B = "1f1b"  # Schedule1F1B
    GPIPE = "gpipe"  # ScheduleGPipe: every forward, then every backward
    INTERLEAVED = "interleaved"  # ScheduleInterleaved1F1B: --pp-virtual stages per rank
    LOOPED_BFS = "looped-bfs"  # ScheduleLoopedBFS: --pp-virtual stages per rank, breadth first
    # not offered: the zero-bubble schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
    # ScheduleDualPipeV) fail in a real CPU run of a transformers decoder in torch 2.13: their split
    # backward (stage_backward_input) raises "Can't detach views in-place" (parallel/pipeline_schedule.py
    # still walks their order)

    @property
    def stages_per_rank(self) -> int | None:
        """Stages each rank runs, or None where --pp-virtual chooses (default 2)."""
        return {"1f1b": 1, "gpipe": 1}.get(self.value)


class CpRotate(Choice):
    """--cp-rotate: how context parallel's ring attention passes key/value blocks between the cp ranks
    (torch's ``set_rotate_method``, torch/distributed/tensor/experimental/_context_parallel/_attention.py)."""

    ALLGATHER = "allgather"  # _AllGatherRotater (torch's default): every rank's k/v gathered once per attention
    ALLTOALL = "alltoall"  # _AllToAllRotater: the next block received while this one is used


class Offload(Choice):
    NONE = "none"
    OPTIMIZER = "optimizer"
    PARAMS = "params"


class ActivationOffload(Choice):
    """--activation-offload: tensors saved for backward moved to host memory in the forward and back in backward
    (features/activation_offload.py); separate from --offload, which moves model state."""

    NONE = "none"
    SAVE_ON_CPU = "save-on-cpu"  # torch.autograd.graph.save_on_cpu(pin_memory=False)
    SAVE_ON_CPU_PINNED = "save-on-cpu-pinned"  # torch.autograd.graph.save_on_cpu(pin_memory=True)
    TORCHTUNE = "torchtune"  # torchtune 0.6.1's OffloadActivations (use_streams=True) + NoOpManager on the output head
    TRL = "trl"  # trl 1.16's port of it (trl/models/activation_offloading.py), around the whole training_step


class Fp8(Choice):
    """--fp8: torchao's float8 training (features/fp8.py): nn.Linear layers converted by
    ``torchao.float8.convert_to_float8_training`` with the recipe of this name; or its MXFP8 training
    (features/mxfp8.py); or TransformerEngine's delayed scaling, estimated (features/te_fp8.py)."""

    NONE = "none"
    TENSORWISE = "tensorwise"  # Float8LinearConfig.from_recipe_name("tensorwise"): one scale per tensor
    ROWWISE = "rowwise"  # Float8LinearConfig.from_recipe_name("rowwise"): one scale per row (axiswise)
    # torchao's MXFP8 training (features/mxfp8.py): MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(...))
    MXFP8 = "mxfp8"  # mxfp8_rceil: every matmul MXFP8 on the SM100 kernels (torchtitan's MXFP8Converter recipe)
    MXFP8_WGRAD_HP = "mxfp8-wgrad-hp"  # mxfp8_rceil_wgrad_with_hp: the weight-gradient matmul in high precision
    MXFP8_EMULATED = "mxfp8-emulated"  # mxfp8_emulated_rceil: PyTorch casts, dequantized matmuls (any device)
    # TransformerEngine's te.Linear under DelayedScaling (features/te_fp8.py): stand-ins read from TE's source, not TE
    TE_DELAYED = "te-delayed"

    @property
    def is_mx(self) -> bool:
        """Whether this is one of torchao's MXFP8 recipes (features/mxfp8.py) rather than its float8 training."""
        return self in (Fp8.MXFP8, Fp8.MXFP8_WGRAD_HP, Fp8.MXFP8_EMULATED)


class Fp8AllGather(Choice):
    """--fp8-all-gather: what FSDP2 all-gathers for a Float8Linear's weight (features/fp8.py), torchtitan's
    float8.enable_fsdp_float8_all_gather and float8.precompute_float8_dynamic_scale_for_fsdp."""

    HIGH_PRECISION = "high-precision"  # the sharded weight as it is (its dtype, or MixedPrecisionPolicy's)
    FLOAT8 = "float8"  # Float8LinearConfig(enable_fsdp_float8_all_gather=True): float8 data + scale
    # + torchao's precompute_float8_dynamic_scale_for_fsdp after each optimizer step (one all-reduce of every amax)
    FLOAT8_PRECOMPUTED = "float8-precomputed"


class Preference(Choice):
    """--preference: a preference-training step as trl's trainer runs it (features/preference.py)."""

    NONE = "none"
    DPO = "dpo"  # trl DPOTrainer: chosen + rejected in one 2x batch, a frozen reference, sigmoid loss
    ORPO = "orpo"  # trl.experimental ORPOTrainer: full logits, chosen NLL + odds-ratio term, no reference
    KTO = "kto"  # trl KTOTrainer: unpaired examples + a KL batch (no_grad), a frozen reference
    SIMPO = "simpo"  # trl.experimental CPOTrainer, loss_type="simpo", cpo_alpha=0: length-normalised, no reference
    CPO = "cpo"  # trl.experimental CPOTrainer, loss_type="sigmoid", cpo_alpha=1: chosen NLL + sigmoid, no reference
    GRPO = "grpo"  # trl GRPOTrainer without vLLM: generation, reference log-probs, training step (features/grpo.py)

    @property
    def has_reference(self) -> bool:
        """Whether trl's trainer runs a frozen reference (DPO, KTO); ORPO, SimPO and CPO have none."""
        return self in (Preference.DPO, Preference.KTO)


class Rollout(Choice):
    """--rollout: who generates a GRPO step's completions (trl GRPOConfig use_vllm; features/grpo.py)."""

    TRANSFORMERS = "transformers"  # use_vllm=False: the policy's own generate() on the training GPU
    VLLM = "vllm"  # use_vllm=True: a vLLM engine (colocated: --colocate-serve; else vllm_mode="server", elsewhere)


class Reference(Choice):
    """--reference: where a preference step's reference log-probabilities come from (trl DPOTrainer)."""

    AUTO = "auto"  # adapter with --lora, else copy (trl: ref_model=None with a peft model, else a second copy)
    COPY = "copy"  # a second frozen copy of the policy (trl: ref_model)
    ADAPTER = "adapter"  # the policy's base with the LoRA adapter disabled (trl: use_adapter(model, None))
    PRECOMPUTED = "precomputed"  # precompute_ref_log_probs=True: two floats per pair in the batch, no reference forward


class Outputs(Choice):
    """--outputs: what the training loop does with the model's output (design.md §7)."""

    KEPT = "kept"  # out = model(x); loss = f(out); loss.backward(): out referenced until the next forward returns
    FREED = "freed"  # dropped before backward, as HF Trainer, Lightning and torchtune do


class DataDependent(Choice):
    """--data-dependent: ops whose output size depends on tensor values (trace/data_dependent.py)."""

    REFUSE = "refuse"  # a clear error naming the bound and the way out (default)
    UPPER_BOUND = "upper-bound"  # size-bounded ones (nonzero, x[mask], masked_select, unique) at their bound


class CompileScope(Choice):
    """--compile-scope: what torch.compile compiles (features/compiled.py)."""

    STEP = "step"  # the whole model, as torch.compile(model) does (default)
    # each repeated block in place, as torchtitan's apply_compile does (torchtitan 0.3.0,
    # torchtitan/distributed/compile.py: transformer_block.compile(backend=..., fullgraph=True), after
    # activation checkpointing is applied to the block)
    BLOCKS = "blocks"


class LossHead(Choice):
    """--loss-head: standard | chunked[:N] | chunked-output[:N] | fused (the kind of a value; features/loss_head.py)."""

    STANDARD = "standard"  # the model's own LM head and loss: whole logits
    CHUNKED = "chunked"  # torchtune's LinearCrossEntropyLoss: head + cross-entropy per chunk, autograd as usual
    # torchtune's CEWithChunkedOutputLoss: every chunk's logits made (the model's chunked_output), each upcast to
    # fp32 and cross-entropied one at a time
    CHUNKED_OUTPUT = "chunked-output"
    FUSED = "fused"  # Liger-Kernel's fused linear cross entropy: gradients computed in forward, chunk by chunk

    @classmethod
    def of(cls, text: str) -> tuple[LossHead, int | None]:
        """The kind and the chunk count (chunked:N; None: the kind's default)."""
        text = str(text).strip().lower()
        if text in ("standard", "chunked", "chunked-output", "fused"):
            return cls(text), None
        if re.fullmatch(r"chunked(-output)?:[1-9][0-9]*", text):
            kind, _, chunks = text.partition(":")
            return cls(kind), int(chunks)
        raise MemestError(
            f"--loss-head {text!r}: choose standard, chunked, chunked:N (N chunks, a whole number >= 1), "
            "chunked-output[:N] or fused"
        )


class Engine(Choice):
    """memest serve --engine: whose start-up arithmetic sizes the KV cache."""

    VLLM = "vllm"
    SGLANG = "sglang"


class KvDtype(Choice):
    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # one byte per element (vLLM --kv-cache-dtype fp8)


class CudaGraphs(Choice):
    """How the serving engine's CUDA graphs meet the KV budget (memest/serve/evidence.py)."""

    PROFILED = "profiled"  # vLLM >= 0.21: estimated and subtracted before the KV cache
    AFTER = "after"  # older vLLM: captured after the KV cache, on top of the utilization
    NONE = "none"  # --enforce-eager


class ExpertRouting(Choice):
    """--ep: how many of the routed (token, expert) pairs reach the traced rank (parallel/expert_parallel.py). The real
    split is data-dependent; an estimate traces both and reports them as its range. Not a user option."""

    UNIFORM = "uniform"  # every rank receives 1/ep of every rank's pairs (the expected, balanced router)
    ONE_RANK = "one-rank"  # every rank sends all its pairs to the traced rank (the high end)


class OutputFormat(Choice):
    TABLE = "table"
    MARKDOWN = "markdown"
    JSON = "json"


class CheckpointPolicy(Choice):
    """--checkpointing: none | blocks | blocks-reentrant | every:N | selective | selective:NAME | module.name,other.name
    (the policy of a value; features/checkpointing.py, features/selective.py)."""

    NONE = "none"
    BLOCKS = "blocks"
    # every repeated block under torch.utils.checkpoint(use_reentrant=True): FSDP's checkpoint_wrapper with
    # CheckpointImpl.REENTRANT, transformers' gradient_checkpointing_kwargs={"use_reentrant": True}
    BLOCKS_REENTRANT = "blocks-reentrant"
    EVERY = "every"
    SELECTIVE = "selective"  # op-level SAC of every repeated block, torchtitan's op policy
    SELECTIVE_USER = "selective-user"  # selective:NAME, the model file's policy NAME
    NAMES = "names"

    @classmethod
    def of(cls, text: str) -> CheckpointPolicy:
        text = text.strip()
        if text in ("none", "blocks", "blocks-reentrant", "selective"):
            return cls(text)
        if text.startswith("every:"):
            if not re.fullmatch(r"every:[1-9][0-9]*", text):
                raise MemestError(f"--checkpointing {text!r}: write every:N with N a whole number >= 1, e.g. every:2")
            return cls.EVERY
        if text.startswith("selective:"):
            if not text.partition(":")[2].isidentifier():
                raise MemestError(f"--checkpointing {text!r}: write selective:NAME with NAME a function of the model "
                                  "file, e.g. selective:checkpoint_policy")
            return cls.SELECTIVE_USER
        if not text or not all(part.strip() for part in text.split(",")):
            raise MemestError(
                f"--checkpointing {text!r}: choose none, blocks, every:N, selective, selective:NAME or module names "
                "separated by commas"
            )
        return cls.NAMES


class ServeVerdict(Choice):
    """memest serve: does the engine start (serve/engine.py ServePlan.verdict)?"""

    STARTS = "starts"  # one max_model_len sequence fits with every cost at the high end of its range
    MAY_NOT_START = "may-not-start"  # it fits only with the expected or the low-end costs
    WILL_NOT_START = "will-not-start"  # not even then, or a refusal that does not depend on the ranges


# --optim's help: the state each optimizer keeps (features/optim.py models it); every member listed
_OPTIM_STATE = {
    Optimizer.ADAM: "2 fp32 states", Optimizer.ADAMW: "2 fp32 states", Optimizer.SGD_MOMENTUM: "1",
    Optimizer.SGD: "none", Optimizer.ADAFACTOR: "factored", Optimizer.ADAM8BIT: "bitsandbytes 8-bit state",
    Optimizer.PAGED_ADAMW_8BIT: "bitsandbytes paged 8-bit state", Optimizer.PAGED_ADAMW_32BIT: "bitsandbytes paged "
    "32-bit state",
}


def optim_help() -> str:
    """--optim's help, from the Optimizer enum: members that keep the same state share an entry."""
    groups: dict[str, list[str]] = {}
    for member in Optimizer:
        groups.setdefault(_OPTIM_STATE[member], []).append(member.value)
    return "; ".join(f"{'/'.join(names)}: {state}" for state, names in groups.items()) + "."


class OnFail(Choice):
    """What a preflight check (memest.preflight, memest.integrations' callbacks) does when the step will not fit."""

    WARN = "warn"  # warnings.warn and a log record; training goes on
    RAISE = "raise"  # raise errors.DoesNotFitError
    STOP = "stop"  # the callbacks: ask the trainer to stop before its first step (preflight: as raise)


class Verdict(Choice):
    """Does a training step fit a budget? Read on its needed range (low, expected, high; device/fit.py).
    Declared best to worst."""

    FITS = "fits"  # the high end of the range fits
    TIGHT = "tight"  # the needed floor (allocator floor + fixed costs) fits, the high end does not
    DOES_NOT_FIT = "does-not-fit"  # the expected need does not fit

    @classmethod
    def worst(cls, verdicts) -> Verdict | None:
        """The worst of ``verdicts`` (members or their strings); None for none."""
        order = list(cls)
        return max((cls(v) for v in verdicts), key=order.index, default=None)
