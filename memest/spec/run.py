"""RunSpec: what to estimate. Built from CLI flags (later also from YAML run configs)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from memest.errors import MemestError
from memest.spec.choices import (
    ActivationOffload,
    Attention,
    Cache,
    CheckpointPolicy,
    CompileScope,
    CpRotate,
    DataDependent,
    ExpertRouting,
    Fp8,
    Fp8AllGather,
    FsdpVersion,
    LossHead,
    Mode,
    Offload,
    Optimizer,
    Outputs,
    PipelineSchedule,
    Precision,
    Preference,
    Quant,
    Reference,
    Rollout,
    Shard,
    Target,
    ZeroGrad,
)
from memest.spec.lora import freeze_patterns, parse_lora
from memest.spec.parallel_dims import FSDP_SHARDS, ParallelDims, validate

# float8 matmuls (torch._scaled_mm, cuBLASLt FP8) need compute capability 8.9+ (Ada sm89, Hopper sm90): torch's own
# check, torch/testing/_internal/common_cuda.py PLATFORM_SUPPORTS_FP8 (SM89OrLater); torchao/float8/README.md
FP8_MIN_CAPABILITY = (8, 9)
# the compute capability of torchao's MXFP8 training kernels (features/mxfp8.py)
MX_MIN_CAPABILITY = (10, 0)  # torchao builds its MXFP8 kernels for is_sm_at_least_100(); torchtitan mx.py asserts it

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
    "fsdp_version": (FsdpVersion, "--fsdp-version"),
    "offload": (Offload, "--offload"),
    "activation_offload": (ActivationOffload, "--activation-offload"),
    "fp8": (Fp8, "--fp8"),
    "fp8_all_gather": (Fp8AllGather, "--fp8-all-gather"),
    "outputs": (Outputs, "--outputs"),
    "preference": (Preference, "--preference"),
    "rollout": (Rollout, "--rollout"),
    "reference": (Reference, "--reference"),
    "pp_schedule": (PipelineSchedule, "--pp-schedule"),
    "quant": (Quant, "--quant"),
    "data_dependent": (DataDependent, "--data-dependent"),
    "compile_scope": (CompileScope, "--compile-scope"),
    "ep_routing": (ExpertRouting, "ep_routing"),
    "cp_rotate": (CpRotate, "--cp-rotate"),
}


def quant_layout_unmodelled(spec) -> list[str]:
    """The options of ``spec``'s layout that memest does not model under a quantized base (--quant): --shard
    other than FSDP2's zero3 / zero2 over nf4/fp4 in fp32 or bf16, any --offload but params under that zero3, --tp,
    --pp, --cp or --ep (RunSpec refuses them; plan-parallel refuses --quant)."""
    out = []
    # FSDP-QLoRA (FSDP2: --shard zero3 or zero2 over a 4-bit base in fp32 or bf16, pure data parallel) is modelled
    # and checked against real gloo ranks (tests/test_fsdp_qlora.py); mixed precision would cast the packed storage
    # FSDP1 flattens every --shard (NO_SHARD too), so the packed weights are stored as the model's dtype there as well
    fsdp1 = spec.fsdp_version == FsdpVersion.V1
    fsdp = spec.fsdp_wraps and spec.quant in (Quant.NF4, Quant.FP4)
    fsdp_qlora = fsdp and spec.precision in (Precision.FP32, Precision.BF16)
    if spec.shard != Shard.NONE and not fsdp_qlora:
        out.append(f"--shard {spec.shard}" + (f" with --precision {spec.precision}" if fsdp else ""))
    elif fsdp1 and fsdp and not fsdp_qlora:
        out.append(f"--fsdp-version 1 --shard none with --precision {spec.precision}")
    # FSDP2's CPUOffloadPolicy over FSDP-QLoRA (--shard zero3 --offload params) is modelled and checked against real
    # gloo ranks (tests/test_fsdp_qlora.py): the sharded packed storage, the adapters' gradients and optimizer state on
    # the host; --offload optimizer (no FSDP2 policy: DeepSpeed's ZeRO offload) is not
    qlora_offload = fsdp_qlora and spec.shard == Shard.ZERO3 and spec.offload == Offload.PARAMS
    if spec.offload != Offload.NONE and not qlora_offload:
        out.append(f"--offload {spec.offload}")
    out += [f"--{name} {getattr(spec, name)}" for name in ("tp", "pp", "cp", "ep") if getattr(spec, name) > 1]
    return out


def refuse_combination(option: str, flags: tuple[tuple[str, bool], ...], reason: str, alternative: str = "") -> None:
    """Refuse ``option`` with every flag of ``flags`` that is set (each named with its value, so that the API's message
    names the keyword and its value), in one message: '{option} with {flags} {reason}; drop them|it{alternative}'."""
    on = [flag for flag, is_on in flags if is_on]
    if on:
        raise MemestError(f"{option} with {', '.join(on)} {reason}; drop {'them' if len(on) > 1 else 'it'}{alternative}")


def image_hw(text: str) -> tuple[int, int]:
    """(height, width) of --image-size HxW (e.g. 448x640), or MemestError."""
    parts = str(text).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise MemestError(f"--image-size takes HEIGHTxWIDTH in pixels, e.g. 448x448; got {text!r}")
    return int(parts[0]), int(parts[1])

def pre_resize_bounds(text: str) -> dict[str, tuple[int, int]]:
    """--pre-resize image=MIN:MAX,video=MIN:MAX -> {"image": (MIN, MAX), ...} (MIN 0: no lower bound)."""
    out: dict[str, tuple[int, int]] = {}
    for part in str(text).split(","):
        kind, _, bounds = part.strip().partition("=")
        lo, _, hi = bounds.partition(":")
        if kind not in ("image", "video") or kind in out or not (lo.strip().isdigit() and hi.strip().isdigit()) \
                or not 0 < int(hi) or int(lo) > int(hi):
            raise MemestError(f"--pre-resize takes image=MIN:MAX and/or video=MIN:MAX in pixels (MIN <= MAX, MAX > 0), "
                              f"e.g. image=1024:589824,video=256:65536; got {text!r}")
        out[kind] = (int(lo), int(hi))
    return out


def pre_resize_text(bounds: dict[str, tuple[int, int]]) -> str:
    return ",".join(f"{kind}={lo}:{hi}" for kind, (lo, hi) in bounds.items())


def pre_resized(hw: tuple[int, int], min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """LLaMA-Factory's resize before the processor (hiyouga/LLaMA-Factory src/llamafactory/data/mm_plugin.py
    MMPluginMixin._preprocess_image at ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30): above max_pixels both sides
    scaled by sqrt(max_pixels / (w * h)), then below min_pixels by sqrt(min_pixels / (w * h)), each int()-rounded
    (PIL's image.resize((width, height)))."""
    height, width = hw
    if width * height > max_pixels:
        factor = math.sqrt(max_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    if width * height < min_pixels:
        factor = math.sqrt(min_pixels / (width * height))
        width, height = int(width * factor), int(height * factor)
    return height, width


# trl 1.16.0, trl/trainer/grpo_config.py: GRPOConfig.num_generations's default (features/grpo.py reads trl's own
# GRPOConfig; tests/test_grpo.py checks this copy, which the spec layer keeps so it need not import trl)
TRL_NUM_GENERATIONS = 8
# --preference methods traced over FSDP2 ranks (RunSpec._preference_fsdp; parallel/trl_fsdp.py; each gloo rank proven
# in tests/test_preference_fsdp.py, GRPO's in tests/test_grpo_fsdp.py), and what the refusal of the rest says about them
PREFERENCE_FSDP = (Preference.DPO, Preference.KTO, Preference.ORPO, Preference.CPO, Preference.SIMPO, Preference.GRPO)
PREFERENCE_RANKS = ("; over ranks memest traces plain DDP (--shard none) and, for dpo, kto, orpo, cpo, simpo and grpo, "
                    "FSDP2 as trl and accelerate wrap it (--shard zero3 or zero2, --precision fp32, bf16 or bf16-mixed), with no --tp, "
                    "--pp, --cp or --ep")


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
    # one optimizer per parameter stepped in its post-accumulate-grad hook (features/optim_in_backward.py)
    optim_in_backward: bool = False
    cudnn_benchmark: bool = False  # --target cuda: torch.backends.cudnn.benchmark (cuDNN searches its algorithms)
    compute_capability: tuple[int, int] = (9, 0)  # of the target GPU; decides e.g. flash availability
    grad_accum: int = 1  # micro-steps per optimizer step; batch is the micro-batch
    checkpointing: str = "none"  # none | blocks | every:N | selective | selective:NAME | module.name,other.name
    zero_grad: ZeroGrad = ZeroGrad.NONE  # after the step: grads set to None, or kept as zeros
    mode: Mode = Mode.TRAIN  # train | inference (no grad, no optimizer) | generate (decoder KV cache)
    new_tokens: int = 0  # --mode generate: tokens generated after a prompt of --seq tokens
    cache: Cache = Cache.DYNAMIC  # --mode generate: dynamic (grows) or static (preallocated) KV cache
    world_size: int = 1  # data-parallel ranks; estimates are per rank
    shard: Shard = Shard.NONE  # zero1: optimizer state, zero2: + gradients, zero3 (FSDP full shard): + parameters
    fsdp_version: FsdpVersion = FsdpVersion.V2  # FSDP2 fully_shard, or FSDP1's flat parameters (1: --shard none too)
    # --fsdp-version 1: FullyShardedDataParallel(sync_module_states=True): rank 0's states broadcast while wrapping
    fsdp_sync_module_states: bool = False
    offload: Offload = Offload.NONE  # optimizer: state (and step) on the CPU; params: params+grads+optimizer on the CPU
    # tensors saved for backward moved to host memory in the forward (features/activation_offload.py)
    activation_offload: ActivationOffload = ActivationOffload.NONE
    fp8: Fp8 = Fp8.NONE  # torchao convert_to_float8_training with this recipe (features/fp8.py)
    # FSDP2's all-gather of the Float8Linear weights: high precision, or torchao's float8 all-gather (features/fp8.py)
    fp8_all_gather: Fp8AllGather = Fp8AllGather.HIGH_PRECISION
    # Linear layers left in high precision by --fp8: comma-separated name parts (torchtitan's filter_fqns, features/fp8.py)
    fp8_skip: str = ""
    # --fp8 te-delayed: DelayedScaling's amax_history_len (TransformerEngine's default 1024; features/te_fp8.py)
    fp8_amax_history: int = 1024
    # training loop: kept = the plain loop (out referenced through backward and into the next forward), the safe side;
    # freed = out dropped before backward (HF Trainer, Lightning, torchtune)
    outputs: Outputs = Outputs.KEPT
    # transformers Trainer's torch_empty_cache_steps: the device cache emptied after the loss of every micro-step of
    # each step whose number is a multiple of N (features/empty_cache.py); 0 = never
    empty_cache_steps: int = 0
    preference: Preference = Preference.NONE  # dpo, orpo, kto, simpo, cpo: trl's trainer step (features/preference*.py)
    reference: Reference = Reference.AUTO  # --preference: copy | adapter | precomputed reference log-probs
    # --preference grpo (features/grpo.py): completions sampled per prompt (trl num_generations; 0 = trl's default)
    # and the tokens generated after the --seq prompt tokens (max_completion_length; 0 = trl's default)
    generations: int = 0
    completion_len: int = 0
    # --preference grpo: completions generated at once (trl generation_batch_size; 0 = trl's default, --batch x
    # --grad-accum): generated every generation_batch / batch micro-steps (trl steps_per_generation)
    generation_batch: int = 0
    rollout: Rollout = Rollout.TRANSFORMERS  # --preference grpo: the policy's generate(), or a vLLM engine
    loss_head: str = "standard"  # standard | chunked[:N] | fused: LM head + loss chunk by chunk (features/loss_head.py)
    tp: int = 1  # tensor-parallel ranks (parallel/tensor_parallel.py); --world-size = dp x tp
    sp: bool = False  # sequence parallel on top of --tp (torchtitan's plan)
    # --sp: torchtitan's loss parallel (the head's logits stay vocabulary-sharded, the loss under loss_parallel());
    # None = torchtitan's default (on, unless parallelism.disable_loss_parallel) where memest models it, else off
    loss_parallel: bool | None = None
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
    # what --compile compiles: the whole model (step), or each repeated block in place (blocks: torchtitan's
    # apply_compile); blocks implies --compile
    compile_scope: CompileScope = CompileScope.STEP
    # ops whose output size depends on values: refuse (the error), or upper-bound (features/upper_bound.py)
    data_dependent: DataDependent = DataDependent.REFUSE
    # vision-language hf: models (sources/hf_inputs.py): images per example (0 = the model's default inputs) and
    # their size before the processor resizes them ("HxW"; "" = the vision tower's own image size)
    images: int = 0
    image_size: str = ""
    # Qwen2-VL / Qwen2.5-VL (sources/hf_qwen_vl.py): the processors' min_pixels / max_pixels (0 = the processor's
    # default) and one video of video_frames frames per example (0 = none)
    min_pixels: int = 0
    max_pixels: int = 0
    video_frames: int = 0
    # a trainer's own resize of --image-size before the processor ("image=MIN:MAX,video=MIN:MAX" pixels; "" = none):
    # LLaMA-Factory's image_min/max_pixels, video_min/max_pixels (pre_resized)
    pre_resize: str = ""

    def __post_init__(self) -> None:
        for name, (enum, flag) in _CHOICE_FIELDS.items():
            object.__setattr__(self, name, enum.parse(getattr(self, name), flag))
        object.__setattr__(self, "compute_capability", tuple(self.compute_capability))
        self._resolve_compile_scope()
        CheckpointPolicy.of(self.checkpointing)
        object.__setattr__(self, "loss_head", str(self.loss_head).strip().lower())
        if LossHead.of(self.loss_head)[0] != LossHead.STANDARD and not self.training:
            raise MemestError(f"--loss-head {self.loss_head} replaces a training loss; drop it with --mode {self.mode}")
        self._check_training_only()
        self._check_finetune()
        self._check_preference()
        if self.batch < 1:
            raise MemestError(f"--batch must be at least 1, got {self.batch}")
        if self.seq is not None and self.seq < 1:
            raise MemestError(f"--seq must be at least 1, got {self.seq}")
        self._check_images()
        if self.target == Target.CPU and (self.fused or self.attention != Attention.AUTO or self.cudnn_benchmark):
            raise MemestError(
                "--fused, --attention and --cudnn-benchmark describe CUDA kernels; use them with --target cuda"
            )
        if self.grad_accum < 1:
            raise MemestError(
                f"--grad-accum must be at least 1 (micro-steps per optimizer step), got {self.grad_accum}; "
                "use 1 for no accumulation"
            )
        if self.mode == Mode.GENERATE and self.new_tokens < 1:
            raise MemestError("--mode generate needs --new-tokens N (N >= 1 tokens generated after the prompt)")
        if self.mode != Mode.GENERATE and self.new_tokens:
            raise MemestError("--new-tokens applies to --mode generate only")
        if self.mode != Mode.TRAIN and (self.grad_accum > 1 or self.checkpointing != "none"):
            given = [f"--grad-accum {self.grad_accum}"] * (self.grad_accum > 1) + \
                [f"--checkpointing {self.checkpointing}"] * (self.checkpointing != "none")
            raise MemestError(  # only what the user gave is named (issue 22 item 29's rule)
                f"{' and '.join(given)}: training technique{'s' * (len(given) > 1)}; drop "
                f"{'them' if len(given) > 1 else 'it'} with --mode {self.mode}"
            )
        if self.world_size < 1:
            raise MemestError(f"--world-size must be at least 1, got {self.world_size}")
        if self.shard != Shard.NONE and self.world_size < 2:
            raise MemestError(
                f"--shard {self.shard} splits state across ranks and needs --world-size 2 or more; "
                "with one GPU use --shard none (or --offload to move state to the CPU)"
            )
        if self.shard != Shard.NONE and not self.training:
            raise MemestError(f"--shard applies to training; drop it with --mode {self.mode}")
        if self.offload == Offload.PARAMS and self.shard != Shard.ZERO3:
            raise MemestError("--offload params needs --shard zero3 (FSDP's CPU offload); use --offload optimizer otherwise")
        validate(self.parallel, self)
        self._check_fsdp_version()
        self._check_quant_layout()
        self._check_compile()
        self._check_optim_in_backward()
        self._check_fp8()
        if self.iterations < 1:
            raise MemestError(f"iterations must be at least 1, got {self.iterations}")

    @property
    def microbatches_per_step(self) -> int:
        return self.microbatches or self.pp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each rank runs (parallel/pipeline_schedule.py): 1, or --pp-virtual (default 2)."""
        fixed = self.pp_schedule.stages_per_rank
        return fixed if fixed is not None else (self.pp_virtual or 2)

    @property
    def parallel(self) -> ParallelDims:
        """The parallel layout as one value (parallel/dims.py): degrees, mesh, the rank traced."""
        return ParallelDims.from_spec(self)

    @property
    def rank(self) -> int:
        """The global rank traced (ParallelDims.rank)."""
        return self.parallel.rank

    @property
    def dp(self) -> int:
        """Data-parallel ranks: --world-size / (--tp x --pp x --cp)."""
        return self.parallel.dp

    @property
    def expert_copies(self) -> int:
        """--ep: copies of each expert group (ParallelDims.expert_copies)."""
        return self.parallel.expert_copies

    def _check_training_only(self) -> None:
        if self.empty_cache_steps < 0:
            raise MemestError(f"--empty-cache-steps must be 0 (never) or more, got {self.empty_cache_steps}")
        if self.empty_cache_steps and not self.training:
            raise MemestError(f"--empty-cache-steps {self.empty_cache_steps} is Trainer's training_step "
                              f"(torch_empty_cache_steps); drop it with --mode {self.mode}")
        if self.empty_cache_steps and self.pp > 1:
            raise MemestError(f"--empty-cache-steps {self.empty_cache_steps} is Trainer's training_step, which runs no "
                              "pipeline schedule: not traced with --pp; drop one of them")
        if self.activation_offload != ActivationOffload.NONE and not self.training:
            raise MemestError(f"--activation-offload {self.activation_offload} moves tensors saved for backward; "
                              f"--mode {self.mode} saves none: drop it")
        if self.activation_offload not in (ActivationOffload.NONE, ActivationOffload.TORCHTUNE) and self.compile:
            # the compiled backward asserts the saved tensors' strides; save_on_cpu_pinned's torch.empty(size) copy
            # is contiguous (traced: AssertionError in the backward); not measured for real here. torchtune's
            # torch.empty_like copy keeps them (tests/test_torchtune_offload.py: compiled blocks, real CPU step)
            raise MemestError(f"--activation-offload {self.activation_offload} with --compile is not traced yet "
                              "(docs/limitations.md); drop one of them")

    def _check_preference(self) -> None:
        """--preference: what memest traces of trl's preference trainers (features/preference*.py); the rest is refused."""
        if self.preference != Preference.GRPO and (self.generations or self.completion_len or self.generation_batch
                                                   or self.rollout != Rollout.TRANSFORMERS):
            raise MemestError("--generations, --completion-len, --generation-batch and --rollout describe GRPO's "
                              "rollouts; add --preference grpo")
        if self.preference == Preference.NONE:
            if self.reference != Reference.AUTO:
                raise MemestError(f"--reference {self.reference} is the reference of a preference step; add --preference dpo")
            return
        if not self.training:
            raise MemestError(f"--preference {self.preference} is a training step; drop --mode {self.mode}")
        other = [flag for flag, on in (
            ("--loss-head", LossHead.of(self.loss_head)[0] is not LossHead.STANDARD), ("--compile", bool(self.compile)),
            (self._preference_ranks_refused(), self.world_size > 1 and not self._preference_ddp()
             and not self._preference_fsdp()),
            ("--offload", self.offload != Offload.NONE),
            ("--activation-offload", self.activation_offload != ActivationOffload.NONE),
            # DPO on one process traces trl's vision batch (features/preference.py VISION_KEYS); the other methods'
            # batches are text only (was: images dropped, battery 30); DPO's over ranks is not proven yet
            ("--images", self.images > 0 and (self.preference != Preference.DPO or self.world_size > 1)),
        ) if on]
        if other:
            ranks = PREFERENCE_RANKS if self._preference_ranks_refused() in other else ""
            raise MemestError(f"--preference {self.preference} with {', '.join(other)} is not traced yet "
                              f"(docs/limitations.md){ranks}; drop it")
        if self.preference == Preference.GRPO:
            self._check_grpo()
        elif not self.preference.has_reference and self.reference != Reference.AUTO:
            raise MemestError(f"--preference {self.preference} has no reference model (trl's trainer trains the policy "
                              f"alone, no reference forward): drop --reference {self.reference}")
        if self.preference == Preference.KTO and self.batch < 2:
            raise MemestError("--preference kto needs --batch 2 or more: trl's KTOTrainer refuses "
                              "per_device_train_batch_size 1 (its KL term pairs each prompt with another's completion)")
        if self.reference == Reference.ADAPTER and not self.lora:
            raise MemestError("--reference adapter disables a LoRA adapter for the reference forward; add --lora, or "
                              "use --reference copy")
        if self.reference == Reference.COPY and self.lora:
            raise MemestError("--reference copy with --lora: trl's DPOTrainer and KTOTrainer use the base with the adapter "
                              "disabled when given a peft model and no ref_model; use --reference adapter (or auto)")

    def _preference_ddp(self) -> bool:
        """--preference dpo, kto, orpo, cpo or simpo over plain DDP (--world-size N, --shard none, no other parallel
        dimension). trl 1.16.0's DPOTrainer.__init__ (trl/trainer/dpo_trainer.py) and KTOTrainer.__init__
        (trl/trainer/kto_trainer.py) wrap the policy in DDP (accelerator.prepare) and prepare the reference with
        accelerator.prepare_model(ref_model, evaluation_mode=True), which accelerate 1.15.0 (accelerate/accelerator.py,
        Accelerator.prepare_model) does not wrap: a full frozen copy on every rank. memest wraps the step module, whose
        frozen reference DDP gives no bucket (the same bytes); KTO's loss all-gathers its KL term
        (features/preference_kto.py, gather_for_metrics). trl.experimental's ORPOTrainer and CPOTrainer (cpo, simpo)
        have no reference: HF Trainer's accelerator.prepare wraps the policy alone. GRPOTrainer.__init__
        (trl/trainer/grpo_trainer.py) prepares its reference as DPO's, generates on the unwrapped policy
        (unwrap_model_for_generation) and gathers over the ranks (features/grpo.py's _Accelerator); with --rollout
        transformers only, --generation-batch global as trl's (_check_grpo). Each of 2 real gloo ranks matches
        (tests/test_preference_ddp.py). Under ZeRO / FSDP trl prepares the reference too (trl/models/utils.py
        prepare_deepspeed / prepare_fsdp): FSDP2 in _preference_fsdp; ZeRO-1 and DeepSpeed are not measured, refused."""
        return (self.preference != Preference.NONE and self.shard == Shard.NONE and self.tp == 1
                and self.pp == 1 and self.cp == 1 and self.ep == 1)

    def _preference_ranks_refused(self) -> str:
        """What of this --world-size > 1 preference run is beyond what memest traces over ranks (its refusal's words)."""
        dims = [f"--{name} {n}" for name, n in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep))
                if n > 1]
        if dims:
            return f"--world-size {self.world_size} over {', '.join(dims)}"
        if self.shard in (Shard.ZERO3, Shard.ZERO2) and self.preference in PREFERENCE_FSDP:
            return f"--world-size {self.world_size} over FSDP2 (--shard {self.shard}) in --precision {self.precision}"
        return f"--world-size {self.world_size} over --shard {self.shard}"

    def _preference_fsdp(self) -> bool:
        """--preference dpo|kto|orpo|cpo|simpo|grpo over FSDP2 (--shard zero3|zero2, no other parallel dimension,
        --precision fp32, bf16 or bf16-mixed): the policy sharded by accelerate's fsdp2_prepare_model, the reference
        copy by trl's prepare_fsdp (trl/models/utils.py: fully_shard on the whole reference, one unit; GRPOTrainer.__init__
        calls it too, trl/trainer/grpo_trainer.py lines 1183-1186), parallel/trl_fsdp.py. GRPO generates on the
        sharded policy (unwrap_model_for_generation hands back the FSDP2 module; HF Trainer registers ``generate`` as
        a root forward method), with --rollout transformers (_check_grpo; --generation-batch global). Each of 2 real
        gloo ranks matches (tests/test_preference_fsdp.py; GRPO's step and each phase: tests/test_grpo_fsdp.py). Not
        measured, refused: --precision fp16-mixed (HF Trainer's gradient scaler), --shard zero1 (DDP +
        ZeroRedundancyOptimizer; trl under DeepSpeed ZeRO runs prepare_deepspeed)."""
        return (self.preference in PREFERENCE_FSDP and self.shard in (Shard.ZERO3, Shard.ZERO2)
                and self.precision != Precision.FP16_MIXED and self.tp == 1 and self.pp == 1 and self.cp == 1
                and self.ep == 1)

    def _check_grpo(self) -> None:
        """--preference grpo (features/grpo.py): trl GRPOTrainer's checks on its batch, and what is not traced yet."""
        if self.generations < 0 or self.generations == 1 or self.completion_len < 0:
            raise MemestError("--generations must be at least 2 (trl: GRPO needs 2 generations per prompt for the "
                              "advantages) and --completion-len at least 1 (0 = trl's defaults)")
        generations = self.generations or TRL_NUM_GENERATIONS
        if self.batch % generations:
            raise MemestError(f"--preference grpo: --batch counts completions (trl per_device_train_batch_size); "
                              f"it must be a multiple of --generations {generations} (trl's check on the generation "
                              f"batch), got --batch {self.batch}")
        self._check_generation_batch(generations)
        if self.world_size > 1 and self.rollout != Rollout.TRANSFORMERS:
            # trl's vLLM rollouts gather the prompts to one engine (server) or run one per rank (colocate): not measured
            raise MemestError("--preference grpo with --world-size > 1 is traced with --rollout transformers only "
                              "(trl's vLLM rollouts over ranks, server or colocate, are not measured); drop "
                              "--rollout vllm")
        if self.reference == Reference.PRECOMPUTED:
            raise MemestError("--reference precomputed is DPO's; GRPO's reference log-probs are of the sampled "
                              "completions: use --reference auto (trl's beta 0.0: none), copy or adapter")
        if CheckpointPolicy.of(self.checkpointing) not in (CheckpointPolicy.NONE, CheckpointPolicy.BLOCKS,
                                                           CheckpointPolicy.BLOCKS_REENTRANT):
            raise MemestError(f"--preference grpo with --checkpointing {self.checkpointing}: trl's GRPOTrainer has "
                              "gradient_checkpointing (every layer, re-enabled so after each generate) and its "
                              "use_reentrant kwarg only: use --checkpointing blocks or blocks-reentrant")

    def _check_generation_batch(self, generations: int) -> None:
        """--generation-batch (trl generation_batch_size, GRPOConfig.__post_init__'s checks,
        trl/trainer/grpo_config.py lines 1101-1109): global, a multiple of the global batch --batch x --world-size;
        steps_per_generation S = it / (--batch x --world-size). Each rank generates for S x --batch completions (its
        dataloader's batch, grpo_trainer.py line 1275), gathers the rewards, keeps its slice of the advantages and
        splits its buffer into S micro-steps (features/grpo.py). Traced: S a multiple of --grad-accum K (one
        generation every S / K optimizer steps; the trace runs S / K + 1 of them, so that one generation runs with the
        optimizer state held) or S = 1; other S < K generate at a micro-step past the two the trace runs."""
        if not self.generation_batch:
            return
        world_batch = self.batch * self.world_size
        if self.generation_batch < 0 or self.generation_batch % world_batch:
            raise MemestError(f"--generation-batch must be a multiple of --batch {self.batch} x --world-size "
                              f"{self.world_size} (trl's check: \"generation_batch_size ({self.generation_batch}) "
                              f"must be divisible by the global batch size ({world_batch})\"), got "
                              f"{self.generation_batch}")
        if self.generation_batch % generations:  # implied by --batch's check; trl checks it apart
            raise MemestError(f"--generation-batch must be a multiple of --generations {generations}")
        steps = self.generation_batch // world_batch
        if steps % self.grad_accum and steps != 1:
            raise MemestError(f"--generation-batch {self.generation_batch} generates every {steps} micro-steps, not a "
                              f"multiple of --grad-accum {self.grad_accum} (nor 1): not traced yet (docs/limitations.md)")
        # the steady state: a generation after an optimizer step (optimizer state held)
        object.__setattr__(self, "iterations", max(self.iterations, steps // self.grad_accum + 1))

    def _check_finetune(self) -> None:

        object.__setattr__(self, "lora", parse_lora(self.lora))
        object.__setattr__(self, "freeze", ",".join(freeze_patterns(self.freeze)))
        if self.quant != Quant.NONE and not self.lora:
            raise MemestError(f"--quant {self.quant} quantizes the frozen base of a QLoRA run; add --lora (e.g. "
                              "--lora r=16,alpha=32,targets=all-linear)")
        if not self.double_quant and self.quant not in (Quant.NF4, Quant.FP4):
            raise MemestError("--no-double-quant turns off bitsandbytes' 4-bit double quantization; it applies with "
                              f"--quant nf4 or fp4 only (here --quant {self.quant}); drop it")
        if self.prepare_kbit and self.quant == Quant.NONE:
            raise MemestError("--prepare-kbit prepares a quantized base (peft's prepare_model_for_kbit_training); "
                              "add --quant nf4")
        if (self.lora or self.freeze) and not self.training:
            raise MemestError(f"--lora and --freeze describe fine-tuning; drop them with --mode {self.mode}")

    def _check_quant_layout(self) -> None:
        """A quantized base under sharding, offload or model parallelism is refused where it is not modelled
        (quant_layout_unmodelled). Modelled, each against real gloo ranks (tests/test_fsdp_qlora.py): plain DDP
        (--world-size N, --shard none) and FSDP-QLoRA, --shard zero3 / zero2 over a 4-bit base in bf16 or fp32, whose
        packed weights are stored as the model's dtype (``bnb_4bit_quant_storage``, features/quant.py), with FSDP2's
        CPUOffloadPolicy under zero3 (--offload params: the sharded packed storage on the host)."""
        if self.quant == Quant.NONE:
            return
        unmodelled = quant_layout_unmodelled(self)
        if unmodelled:
            why = ("a bitsandbytes base laid out so is not checked against a real run"
                   if self.offload != Offload.OPTIMIZER else
                   # DeepSpeed ZeRO-3 QLoRA with offload_optimizer reads as --shard zero3 --offload optimizer
                   # (spec/trainers/deepspeed.py): DeepSpeed's own engine partitions and offloads it, not FSDP2
                   "--offload optimizer is DeepSpeed's ZeRO-Offload, which FSDP2 has no policy for; DeepSpeed ZeRO-3 "
                   "over a bitsandbytes base is not checked against a real run: memest's ground truth runs torch's "
                   "own wrappers on gloo ranks, not DeepSpeed's engine")
            fsdp = ("; so is --shard zero3 or zero2 in --precision bf16 or fp32, the FSDP-QLoRA recipe, with "
                    "--offload params (FSDP2's CPUOffloadPolicy) under zero3") if self.quant != Quant.INT8 else ""
            raise MemestError(
                f"--quant {self.quant} with {' and '.join(unmodelled)} is not modelled ({why}); "
                f"drop {unmodelled[0].split()[0]} (plain DDP, --world-size N --shard none, is modelled{fsdp}), "
                "or drop --quant to estimate a 16-bit base sharded"
            )

    def _check_images(self) -> None:
        if self.images < 0:
            raise MemestError(f"--images must be 0 or more images per example, got {self.images}")
        for flag, value in (("--min-pixels", self.min_pixels), ("--max-pixels", self.max_pixels),
                            ("--video-frames", self.video_frames)):
            if value < 0:
                raise MemestError(f"{flag} must be 0 (the default) or more, got {value}")
        if self.image_size:
            image_hw(self.image_size)
            if not (self.images or self.video_frames):
                raise MemestError("--image-size is the size of the --images inputs (or --video-frames' frames): give "
                                  "--images N or --video-frames F with it")
        if (self.min_pixels or self.max_pixels) and not (self.images or self.video_frames):
            raise MemestError("--min-pixels / --max-pixels bound the processor's resizing of --images (or --video-frames' "
                              "frames): give --images N or --video-frames F with them")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise MemestError(f"--min-pixels {self.min_pixels} is above --max-pixels {self.max_pixels}")
        if self.pre_resize:
            object.__setattr__(self, "pre_resize", pre_resize_text(pre_resize_bounds(self.pre_resize)))
            _ = self.input_hw  # one --image-size for images and frames: refused where their resizes differ

    @property
    def input_hw(self) -> tuple[int, int] | None:
        """(height, width) the processor gets: --image-size after --pre-resize (None: the model's default image)."""
        if not self.image_size:
            return None
        hw = image_hw(self.image_size)
        if not self.pre_resize:
            return hw
        bounds = pre_resize_bounds(self.pre_resize)
        sizes = {kind: pre_resized(hw, *bounds[kind]) for kind, on in (("image", self.images), ("video",
                 self.video_frames)) if on and kind in bounds}
        if len(set(sizes.values())) > 1:
            raise MemestError(f"--pre-resize {self.pre_resize}: --image-size {self.image_size} becomes "
                              f"{sizes['image'][0]}x{sizes['image'][1]} for the images and {sizes['video'][0]}x"
                              f"{sizes['video'][1]} for the video frames, and memest has one size for both: "
                              "estimate them apart")
        return next(iter(sizes.values()), hw)

    @property
    def vision_options(self) -> dict:
        """The Qwen2-VL processors' knobs a source's image_inputs / image_facts take (0: the processor's default)."""
        return {"min_pixels": self.min_pixels, "max_pixels": self.max_pixels, "video_frames": self.video_frames,
                "pre_resized": bool(self.pre_resize)}

    def _resolve_compile_scope(self) -> None:
        """--compile-scope blocks implies --compile (set before any check that reads it)."""
        if self.compile_scope == CompileScope.BLOCKS:
            if self.compile is False:
                raise MemestError("--compile-scope blocks with --no-compile: drop one (blocks compiles each block)")
            object.__setattr__(self, "compile", True)

    def _check_fsdp_version(self) -> None:
        """--fsdp-version 1: torch's FullyShardedDataParallel (use_orig_params=False) is traced for pure data
        parallelism under --shard zero3 (FULL_SHARD), zero2 (SHARD_GRAD_OP) or none (NO_SHARD: FSDP1's full replicas
        with one flat parameter per unit, all-reduced flat gradients; not DDP's buckets), each checked against real
        gloo ranks (tests/test_fsdp1.py); what it is not traced with is refused here."""
        if self.fsdp_version == FsdpVersion.V2:
            if self.fsdp_sync_module_states:
                raise MemestError("--fsdp-sync-module-states is FSDP1's FullyShardedDataParallel argument: add "
                                  "--fsdp-version 1 (FSDP2's fully_shard has no such argument)")
            return
        supported = ("traced: --shard zero3 (FULL_SHARD), zero2 (SHARD_GRAD_OP) or none (NO_SHARD), pure data "
                     "parallel, --precision fp32, bf16 or bf16-mixed, LoRA and a 4-bit base, --offload params "
                     "(CPUOffload(offload_params=True), with zero3)")
        if self.shard not in (Shard.ZERO3, Shard.ZERO2, Shard.NONE):
            raise MemestError(
                f"--fsdp-version 1 with --shard {self.shard}: FSDP1 is traced as FULL_SHARD (--shard zero3), "
                f"SHARD_GRAD_OP (--shard zero2) or NO_SHARD (--shard none); {supported}"
            )
        if self.world_size < 2 or not self.training:
            raise MemestError(
                f"--fsdp-version 1 wraps a training step over data-parallel ranks: it needs --world-size 2 or more "
                f"and --mode train (got --world-size {self.world_size}, --mode {self.mode}); {supported}"
            )
        refuse_combination("--fsdp-version 1", (
            (f"--tp {self.tp}", self.tp > 1), (f"--pp {self.pp}", self.pp > 1), (f"--cp {self.cp}", self.cp > 1),
            (f"--ep {self.ep}", self.ep > 1), (f"--fp8 {self.fp8}", self.fp8 != Fp8.NONE),
            ("--compile", bool(self.compile)), (f"--preference {self.preference}", self.preference != Preference.NONE),
            ("--optim-in-backward", self.optim_in_backward),
            (f"--offload {self.offload}", self.offload == Offload.OPTIMIZER),
            (f"--precision {self.precision}", self.precision == Precision.FP16_MIXED),
            (f"--activation-offload {self.activation_offload}", self.activation_offload != ActivationOffload.NONE),
        ), "is not traced (FSDP1 is modelled for pure data parallelism, checked against real gloo ranks)",
            f", or use --fsdp-version 2; {supported}")

    def _check_compile(self) -> None:
        if self.compile and self.world_size > 1:
            self._check_compile_parallel()
        if self.compile and self.mode == Mode.GENERATE:
            raise MemestError("--compile with --mode generate: a compiled decode loop is not modelled; drop --compile")

    def _check_compile_parallel(self) -> None:
        """--compile with --world-size: traced with each block compiled in place, then DDP (--shard none), DDP +
        ZeroRedundancyOptimizer (zero1) or FSDP2 (zero2/zero3) over the ranks, torchtitan's order; each checked
        against real gloo ranks (tests/test_compile_blocks.py)."""
        supported = ("traced: --compile-scope blocks with --shard none, zero1, zero2 or zero3 alone (each block "
                     "compiled, then DDP or FSDP2, torchtitan's order)")
        if self.compile_scope != CompileScope.BLOCKS:
            raise MemestError(
                "--compile with --world-size: the whole step compiled under DDP/FSDP is not traced (dynamo's DDPOptimizer "
                "splits the graph at DDP's bucket boundaries, FSDP2 traces its collectives into it); use --compile-scope "
                f"blocks, or drop --compile (--no-compile for a model file that compiles itself); {supported}"
            )
        refuse_combination("--compile-scope blocks", (
            (f"--tp {self.tp}", self.tp > 1), (f"--pp {self.pp}", self.pp > 1), (f"--cp {self.cp}", self.cp > 1),
            (f"--ep {self.ep}", self.ep > 1), (f"--offload {self.offload}", self.offload != Offload.NONE),
        ), "is not traced (not checked against real compiled runs)", f", or drop --compile-scope blocks; {supported}")

    def _check_fp8(self) -> None:
        if self.fp8_all_gather != Fp8AllGather.HIGH_PRECISION:
            flag = f"--fp8-all-gather {self.fp8_all_gather}"
            if self.fp8 != Fp8.TENSORWISE:
                # torchao 0.18 torchao/float8/config.py Float8LinearConfig.__post_init__ asserts tensorwise
                raise MemestError(f"{flag} is torchao's float8 all-gather of tensorwise-scaled weights (torchao asserts "
                                  f"'enable_fsdp_float8_all_gather only supports tensorwise scaling'); use --fp8 "
                                  f"tensorwise, not --fp8 {self.fp8}")
            if self.world_size < 2 or self.shard not in (Shard.ZERO2, Shard.ZERO3):
                raise MemestError(f"{flag} changes what FSDP2 all-gathers; it needs --world-size 2 or more with --shard "
                                  "zero2 or zero3")
            if self.fp8_all_gather == Fp8AllGather.FLOAT8_PRECOMPUTED and self.optim_in_backward:
                raise MemestError(f"{flag} runs after the optimizer step, which --optim-in-backward replaces by "
                                  "per-parameter steps; use --fp8-all-gather float8, or drop --optim-in-backward")
        if self.fp8_amax_history != 1024 and self.fp8 != Fp8.TE_DELAYED:
            raise MemestError(f"--fp8-amax-history {self.fp8_amax_history} is TransformerEngine's delayed-scaling "
                              "history; it needs --fp8 te-delayed")
        if self.fp8 == Fp8.NONE:
            if self.fp8_skip:
                raise MemestError(f"--fp8-skip {self.fp8_skip!r} names Linear layers --fp8 leaves in high precision; it "
                                  "needs --fp8")
            return
        if not self.training:
            raise MemestError(f"--fp8 {self.fp8} is FP8 training; drop it with --mode {self.mode}")
        if self.fp8.is_mx:
            self._check_mxfp8()
            return
        if self.fp8 == Fp8.TE_DELAYED:
            self._check_te_fp8()
            return
        if self.target == Target.CUDA and tuple(self.compute_capability) < FP8_MIN_CAPABILITY:
            major, minor = self.compute_capability
            raise MemestError(
                f"--fp8 {self.fp8} on a GPU of compute capability {major}.{minor}: float8 matmuls (torch._scaled_mm) "
                "need 8.9 or later (Ada, Hopper, Blackwell; torchao's float8 README: 'Hardware requirements: NVIDIA "
                "H100, B200 or later'); drop --fp8"
            )
        if self.lora or self.quant != Quant.NONE:
            raise MemestError(f"--fp8 {self.fp8} with --lora or --quant is not traced yet (traced: one process, with or "
                              "without --compile, and FSDP2 alone over ranks, docs/fp8.md); drop one of them")
        self._check_fp8_ranks()

    def _check_fp8_ranks(self) -> None:
        """--fp8 (float8 and MXFP8) over ranks: FSDP2 alone (--shard zero2|zero3), checked against real gloo ranks."""
        if self.world_size > 1:
            other = [flag for flag, on in ((f"--tp {self.tp}", self.tp > 1), (f"--pp {self.pp}", self.pp > 1),
                                           (f"--cp {self.cp}", self.cp > 1), (f"--ep {self.ep}", self.ep > 1),
                                           (f"--offload {self.offload}", self.offload != Offload.NONE),
                                           ("--optim-in-backward", self.optim_in_backward)) if on]
            if self.shard not in (Shard.ZERO2, Shard.ZERO3) or other:
                raise MemestError(
                    f"--fp8 {self.fp8} with --world-size {self.world_size} and "
                    f"{', '.join(other) if other else f'--shard {self.shard}'} is not traced (not checked against real "
                    "gloo ranks); over ranks memest traces float8 under FSDP2 alone: --shard zero2 or zero3 "
                    "(docs/fp8.md)"
                )

    def _check_te_fp8(self) -> None:
        """TransformerEngine's delayed scaling (features/te_fp8.py): a documented estimate of one eager process."""
        if self.fp8_amax_history < 1:
            raise MemestError(f"--fp8-amax-history {self.fp8_amax_history}: DelayedScaling's history holds at least 1 "
                              "step")
        if self.target != Target.CUDA:
            raise MemestError("--fp8 te-delayed is TransformerEngine, which runs on NVIDIA GPUs only; use --target cuda")
        if tuple(self.compute_capability) < FP8_MIN_CAPABILITY:
            major, minor = self.compute_capability
            raise MemestError(
                f"--fp8 te-delayed on a GPU of compute capability {major}.{minor}: TransformerEngine's FP8 needs 8.9 or "
                "later (transformer_engine/pytorch/quantization.py check_fp8_support: 'Device compute capability 8.9 "
                "or higher required for FP8 execution'); drop --fp8"
            )
        refuse_combination("--fp8 te-delayed", (
            ("--lora/--quant/--freeze", bool(self.lora) or self.quant != Quant.NONE or bool(self.freeze)),
            (f"--world-size {self.world_size}", self.world_size > 1), ("--compile", bool(self.compile)),
            (f"--offload {self.offload}", self.offload != Offload.NONE),
            (f"--preference {self.preference}", self.preference != Preference.NONE),
        ), "is not estimated: memest prices TransformerEngine's Linear in one eager process only (a documented "
           "estimate, TE cannot run here; docs/fp8.md)")

    def _check_mxfp8(self) -> None:
        """torchao's MXFP8 training (features/mxfp8.py): eager, a full-weight step, one process or FSDP2 alone."""
        if self.fp8 != Fp8.MXFP8_EMULATED and self.target == Target.CUDA and \
                tuple(self.compute_capability) < MX_MIN_CAPABILITY:
            major, minor = self.compute_capability
            raise MemestError(
                f"--fp8 {self.fp8} on a GPU of compute capability {major}.{minor}: torchao's MXFP8 cast kernels and "
                "cuBLAS's MXFP8 matmul need 10.0 or later (Blackwell: torchao builds them only where "
                "is_sm_at_least_100(); torchtitan's MXFP8Converter asserts has_cuda_capability(10, 0)); name the card "
                "(--gpu b200), or trace --fp8 mxfp8-emulated, torchao's path for other GPUs"
            )
        if self.compile and self.fp8 != Fp8.MXFP8_EMULATED:
            raise MemestError(
                f"--fp8 {self.fp8} with --compile is not traced: memest's compiled traces lower Inductor's graphs for "
                "the CPU, and Inductor's CPU code generation has no float8_e8m0fnu type for the MX scales (InductorError: "
                "KeyError: torch.float8_e8m0fnu, torch 2.13); trace it eager (drop --compile), or trace --fp8 "
                "mxfp8-emulated --compile"
            )
        refuse_combination(f"--fp8 {self.fp8}", (
            ("--lora", bool(self.lora)), (f"--quant {self.quant}", self.quant != Quant.NONE),
            (f"--offload {self.offload}", self.offload != Offload.NONE),
        ), "is not traced yet (MXFP8 is traced in one process, eager or compiled, and under FSDP2, the emulated recipe "
           "checked against real CPU steps and gloo ranks, docs/fp8.md)")
        self._check_fp8_ranks()

    def _check_optim_in_backward(self) -> None:
        if not self.optim_in_backward:
            return
        flag = "--optim-in-backward"
        if not self.training:
            raise MemestError(f"{flag} fuses the optimizer step into backward; drop it with --mode {self.mode}")
        if self.grad_accum > 1:
            raise MemestError(
                f"{flag} with --grad-accum {self.grad_accum}: each gradient is freed as its parameter steps, so none is "
                "left to accumulate over micro-steps (torchtune refuses optimizer_in_bwd with gradient accumulation); "
                "use --grad-accum 1"
            )
        if self.zero_grad != ZeroGrad.NONE:
            raise MemestError(
                f"{flag} with --zero-grad {self.zero_grad}: each gradient is set to None in its hook as it steps "
                "(torchtune's optimizer_in_bwd), which is the saving; drop --zero-grad"
            )
        if self.pp > 1:
            raise MemestError(f"{flag} with --pp: a pipeline stage accumulates gradients over its micro-batches; drop one")
        if self.world_size > 1 and self.shard != Shard.ZERO3:
            raise MemestError(
                f"{flag} with --world-size and --shard {self.shard}: the hook would step on the gradient before DDP's "
                "all-reduce (or ZeRO's own step); memest traces it under FSDP2 only: use --shard zero3"
            )
        if self.tp > 1 or self.cp > 1 or self.ep > 1:
            raise MemestError(f"{flag} with --tp, --cp or --ep is not traced; with --world-size use --shard zero3 alone")
        if self.offload != Offload.NONE:
            raise MemestError(f"{flag} with --offload is not traced (the step's host memory is marked by phase); drop one")
        if self.compile and self.compile_scope != CompileScope.BLOCKS:
            raise MemestError(
                f"{flag} with --compile (--compile-scope step): the whole step compiled as one graph would take the "
                "per-parameter hooks into it, which is not traced; use --compile-scope blocks (each block compiled, "
                "the hooks run eager after it, as torchtune compiles its layers) or drop one"
            )

    @property
    def training(self) -> bool:
        return self.mode == Mode.TRAIN

    @property
    def fsdp_wraps(self) -> bool:
        """An FSDP wraps the data-parallel ranks: FSDP2 under --shard zero2/zero3, or FSDP1 (--fsdp-version 1) under
        any --shard it takes, NO_SHARD too; its flat parameters take a 4-bit base's packed storage with the rest."""
        return self.shard in FSDP_SHARDS or self.fsdp_version == FsdpVersion.V1

    @property
    def mixed(self) -> bool:
        return self.precision.mixed

    def to_dict(self) -> dict:
        return asdict(self)
