"""Every command-line option, declared once (torchtitan's model: a config field whose help is read by CLI,
config file and code alike). One row per option: its name (the command's parameter and, for a step option, the
RunSpec field), flags, help, type, default, the commands that take it and its YAML key. From this table come
the typer signatures of every command (cli.py), the YAML schema (spec/config.py), ``to_argv`` (every printed
reproduction command) and ``check``'s overrides.

An option whose meaning differs between commands has one row per meaning (whatif's ``--batch`` is a list of
sizes, estimate's one size). A step option's default is RunSpec's (``SPEC``), never a copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shlex
import typing
from dataclasses import dataclass
from typing import Any, Optional

from memest.errors import MemestError
from memest.spec.choices import (
    Choice,
    CudaGraphs,
    Engine,
    KvDtype,
    OutputFormat,
    optim_help,
)
from memest.spec.run import RunSpec

SPEC = object()  # default: RunSpec's own default for the field
REQUIRED = object()  # no default: the user must give it
SERVE = object()  # default: serve.engine.ServeSpec's own for the field (the CLI reads it; spec/ does not import serve/)

# the commands that trace one training (or inference) step and share its options; check takes each as an override
STEP = ("estimate", "whatif", "max-batch", "advise", "plan-parallel", "check")
OUTPUT = ("estimate", "check", "whatif", "max-batch", "advise", "serve", "plan-parallel", "gpus", "calibrate")
_FIELDS = {f.name: f for f in dataclasses.fields(RunSpec)}


def _field_type(hint) -> tuple[type, bool]:
    """(type, None allowed) of a RunSpec field's annotation (``int | None`` -> (int, True))."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return (args[0], True) if args else (hint, False)


_FIELD_TYPES = {name: _field_type(hint) for name, hint in typing.get_type_hints(RunSpec).items()}


@dataclass(frozen=True)
class Option:
    name: str  # the command's parameter; for a step option, the RunSpec field
    flags: tuple[str, ...]  # long flag first ("--x/--no-x" for a switch with both forms), short flags after
    help: str
    kind: Any = SPEC  # int | float | str | bool | a Choice enum (SPEC: the RunSpec field's type)
    commands: tuple[str, ...] = STEP
    default: Any = SPEC
    optional: bool | None = None  # None is a value (typer: Optional[kind]); None: as the RunSpec field's type says
    argument: bool = False  # positional
    searched: bool = False  # plan-parallel sets it per layout (it refuses a value the user gives)
    grid: bool = False  # a list of sizes (whatif), not the RunSpec field of the same name
    override: str = ""  # check's help ('' : "Override: " + help)
    yaml: str | None = None  # its key in a serving config's serve: block (a step option's YAML key is its name)

    def __post_init__(self) -> None:
        """A step option's type, and whether None is a value, are its RunSpec field's."""
        kind, optional = _FIELD_TYPES[self.name] if self.default is SPEC else (str, False)
        if self.kind is SPEC:
            object.__setattr__(self, "kind", kind)
        if self.optional is None:
            object.__setattr__(self, "optional", optional)

    @property
    def flag(self) -> str:
        return self.flags[0].split("/")[0]

    @property
    def spec_field(self) -> bool:
        """A RunSpec field (a step option), not a command's own option."""
        return self.name in _FIELDS and not self.grid

    @property
    def default_value(self) -> Any:
        if self.default is SPEC:
            return _FIELDS[self.name].default
        return self.default

    def as_override(self) -> Option:
        """check's form: None keeps the config's value; a switch gets its --no- form."""
        flags = self.flags
        if self.kind is bool and "/" not in flags[0]:
            flags = (f"{flags[0]}/--no-{flags[0][2:]}", *flags[1:])
        return dataclasses.replace(self, flags=flags, default=None, optional=True, commands=("check",),
                                   help=self.override or f"Override: {self.help}")

    def argv(self, value) -> list[str]:
        """The flags that give ``value``."""
        if self.kind is bool:
            on, _, off = self.flags[0].partition("/")
            return [on if value else (off or f"--no-{on[2:]}")]
        return [self.flag, str(value)]


OPTIONS: tuple[Option, ...] = (
    # --- the model
    Option("model", ("model",), "model.py[:factory], hf:NAME (bundled config) or hf:path/config.json",
           commands=STEP[:-1], default=None, optional=True, argument=True),
    Option("from_file", ("--from",), "A trainer config to read the run from: axolotl or LLaMA-Factory YAML, "
           "DeepSpeed JSON, torchtitan TOML, a TrainingArguments JSON dump, a Python script building "
           "TrainingArguments or a trl config (read, never run) or an accelerate config YAML "
           "(docs/trainer-configs.md); flags given beside it override it.", str, STEP[:-1], None,
           optional=True),
    Option("configs", ("configs",), "YAML run configs (see configs/ and README).", list[str], ("check",),
           REQUIRED, argument=True),
    Option("model", ("model",), "hf:NAME, hf:path/config.json or hf:org/name (a decoder LM config)", str, ("serve",),
           REQUIRED, argument=True),
    # --- the step (RunSpec fields), in the order to_argv writes them
    Option("batch", ("--batch", "-b"), "Batch size (per step).", commands=("estimate", "advise", "plan-parallel", "check"),
           override="Override every config's batch."),
    Option("batch", ("--batch", "-b"), "Batch when searching the sequence length.", commands=("max-batch",)),
    Option("batch", ("--batch", "-b"), "Batch sizes, e.g. 1,2,4,8.", str, ("whatif",), None, optional=True, grid=True),
    Option("seq", ("--seq", "-s"), "Sequence length (default: the model's own).",
           commands=("estimate", "max-batch", "advise", "plan-parallel", "check"), override="Override every config's seq."),
    Option("seq", ("--seq", "-s"), "Sequence lengths, e.g. 256,512,1024.", str, ("whatif",), None, optional=True,
           grid=True),
    Option("optim", ("--optim",), optim_help(), override="Override the optimizer."),
    Option("precision", ("--precision",), "Weights' dtype, or -mixed: fp32 weights + autocast.",
           override="Override the precision."),
    Option("target", ("--target",), "cuda: what a CUDA run allocates; cpu: CPU training."),
    Option("attention", ("--attention",), "--target cuda SDPA kernel (auto: PyTorch's rules)."),
    Option("fused", ("--fused",), "--target cuda: fused optimizer kernels instead of foreach."),
    Option("optim_in_backward", ("--optim-in-backward",), "One optimizer per parameter stepped in its "
           "post-accumulate-grad hook, each gradient freed as it steps (torchtune's optimizer_in_bwd); not with "
           "--grad-accum > 1.", override="Override the optimizer step in backward."),
    Option("grad_accum", ("--grad-accum",), "Micro-steps per optimizer step (--batch is the micro-batch).",
           override="Override accumulation steps."),
    Option("checkpointing", ("--checkpointing",), "none | blocks | blocks-reentrant (torch.utils.checkpoint "
           "use_reentrant=True) | every:N | selective (torchtitan's op-level SAC) | "
           "selective:NAME (the model file's policy NAME) | module.name,other.name",
           override="Override checkpointing."),
    Option("cudnn_benchmark", ("--cudnn-benchmark",), "--target cuda: the run sets torch.backends.cudnn.benchmark = "
           "True (cuDNN's algorithm search: see docs/cuda-kernels.md).",
           override="Override cuDNN's benchmark mode."),
    Option("outputs", ("--outputs",), "Your loop: kept (out = model(x) held through backward, the plain loop) | freed "
           "(dropped before backward: HF Trainer, Lightning).", override="Override the loop: kept | freed."),
    Option("empty_cache_steps", ("--empty-cache-steps",), "Your loop empties the device cache as transformers' "
           "Trainer does with torch_empty_cache_steps N: torch.cuda.empty_cache() after the loss of every micro-step "
           "of each step whose number is a multiple of N (steps 0, N, 2N...); 0 = never. Calls the model code makes "
           "itself are traced without it.", override="Override the loop's empty_cache steps."),
    Option("loss_head", ("--loss-head",), "hf: causal LMs: standard | chunked[:N] (torchtune, N chunks) | "
           "chunked-output[:N] (torchtune's CEWithChunkedOutputLoss) | fused (Liger-Kernel).",
           override="Override the loss head."),
    Option("lora", ("--lora",), "peft LoRA: r=16,alpha=32,dropout=0.05,targets=q_proj,v_proj (or targets=all-linear; "
           "dtype=base: adapters in the base layers' dtype, peft's autocast_adapter_dtype=False; default fp32; "
           "exclude=vision,projector: no adapters in those modules or under them, peft's exclude_modules: on hf: "
           "vision-language models vision and projector are --freeze's parts, else module names, as LLaMA-Factory "
           "keeps a frozen tower out of LoRA; needs memest[peft]).", override="Override LoRA (none: off)."),
    Option("freeze", ("--freeze",), "Freeze parameters by name: glob patterns, comma-separated "
           "(model.embed_tokens,model.layers.[0-9].*); on hf: LLaVA, LLaVA-NeXT, Qwen2-VL, Qwen2.5-VL also vision "
           "(the vision tower) and projector, as LLaMA-Factory's freeze_vision_tower / freeze_multi_modal_projector."),
    Option("quant", ("--quant",), "With --lora (QLoRA): base linear weights as bitsandbytes stores them: nf4 | fp4 | "
           "int8 (none: as built).", override="Override the base quantization."),
    Option("double_quant", ("--double-quant/--no-double-quant",), "--quant: bitsandbytes' double quantization of the "
           "absmax."),
    Option("prepare_kbit", ("--prepare-kbit",), "--quant: peft's prepare_model_for_kbit_training (trl's SFTTrainer "
           "calls it): the non-quantized 16-bit weights cast to fp32."),
    Option("compile", ("--compile/--no-compile",), "torch.compile the step as torch.compile(model) does (Inductor) / "
           "trace a model file that compiles itself eager; default: as the model code does."),
    Option("compile_scope", ("--compile-scope",), "What --compile compiles: step (the whole model, torch.compile(model)) "
           "| blocks (each repeated block in place after --checkpointing, torchtitan's apply_compile; implies "
           "--compile; the one scope traced with --world-size: --shard none, zero1, zero2 or zero3).",
           override="Override the compile scope: step | blocks."),
    Option("data_dependent", ("--data-dependent",), "Ops whose output size depends on values: refuse (an error naming "
           "the bound) | upper-bound (nonzero, x[mask], masked_select, unique traced at their bound: the estimate is "
           "an upper bound).",
           override="Override: refuse | upper-bound (size-bounded data-dependent ops at their bound)."),
    Option("images", ("--images",), "Vision-language hf: models: images per example, each turned into image tokens "
           "as the model's processor does (Qwen2-VL, Qwen2.5-VL: smart_resize; LLaVA: one tower-sized tile; LLaVA-NeXT: anyres tiles), added to --seq text tokens; "
           "0 = the model's default inputs."),
    Option("image_size", ("--image-size",), "--images: HEIGHTxWIDTH of each image before the processor resizes it "
           "(default: the vision tower's image size; --video-frames: of each frame)."),
    Option("min_pixels", ("--min-pixels",), "Qwen2-VL, Qwen2.5-VL with --images / --video-frames: the processor's "
           "min_pixels (size shortest_edge), the fewest pixels smart_resize keeps per image or frame; 0 = the "
           "processor's default (images 3136, video frames 100352)."),
    Option("max_pixels", ("--max-pixels",), "Qwen2-VL, Qwen2.5-VL with --images / --video-frames: the processor's "
           "max_pixels (size longest_edge), the most pixels per image or frame (fewer image tokens below it); 0 = "
           "the processor's default (images 1003520, video frames 602112)."),
    Option("pre_resize", ("--pre-resize",), "--images / --video-frames: each --image-size image (image=MIN:MAX) or "
           "frame (video=MIN:MAX) resized before the processor as LLaMA-Factory does (image_min/max_pixels, "
           "video_min/max_pixels; mm_plugin.py _preprocess_image): above MAX pixels both sides scaled by "
           "sqrt(MAX / pixels), below MIN by sqrt(MIN / pixels), int()-rounded; on Qwen2-VL then its plugin's rules (a "
           "side under 28 px raised to 28, an aspect ratio over 200 cut to 180); default none."),
    Option("video_frames", ("--video-frames",), "Qwen2-VL, Qwen2.5-VL: one video of F frames per example "
           "(--image-size each), merged in pairs as Qwen2VLVideoProcessor does (pixel_values_videos, "
           "video_grid_thw), its tokens added to --seq; 0 = none."),
    Option("zero_grad", ("--zero-grad",), "After the step: none (set to None) | zeros."),
    Option("mode", ("--mode",), "train | inference | generate (decoders, KV cache)."),
    Option("new_tokens", ("--new-tokens",), "--mode generate: tokens after a --seq prompt."),
    Option("cache", ("--cache",), "--mode generate: dynamic | static KV cache."),
    Option("world_size", ("--world-size",), "Data-parallel ranks (estimates are per rank).", searched=True),
    Option("shard", ("--shard",), "none | zero1 | zero2 | zero3 (FSDP full shard).", searched=True),
    Option("fsdp_version", ("--fsdp-version",), "With --world-size: which torch FSDP shards the model: 2 "
           "(fully_shard, per-parameter shards; --shard none is DDP) | 1 (FullyShardedDataParallel with "
           "use_orig_params=False: one flat parameter per unit, zero3 = FULL_SHARD, zero2 = SHARD_GRAD_OP, none = "
           "NO_SHARD (full replicas, flat gradients all-reduced); the FSDP of fsdp_qlora, and of accelerate and "
           "TrainingArguments unless fsdp_version: 2). Units: each repeated block and the root, and with frozen "
           "parameters each leaf module whose weight trains (peft's fsdp_auto_wrap_policy)."),
    Option("fsdp_sync_module_states", ("--fsdp-sync-module-states/--no-fsdp-sync-module-states",), "--fsdp-version "
           "1: the wrap runs FullyShardedDataParallel(sync_module_states=True), broadcasting rank 0's parameters in "
           "250 MiB buckets while each unit moves to the GPU (fsdp_qlora's --low_memory, its default; accelerate's "
           "fsdp_cpu_ram_efficient_loading). The wrap's cached blocks stay reserved into the step."),
    Option("offload", ("--offload",), "none | optimizer | params (params: --shard zero3)."),
    Option("activation_offload", ("--activation-offload",), "Tensors saved for backward moved to host memory in the "
           "forward, back in backward: none | save-on-cpu | save-on-cpu-pinned (torch.autograd.graph.save_on_cpu) | "
           "torchtune (torchtune 0.6.1's OffloadActivations: its size threshold, stream stashes and output head "
           "kept; --target cuda) | trl (trl 1.16's port of it, activation_offloading=True: around the whole "
           "training step, its own keep rules; --target cuda); pinned host memory counted in the host column.", override="Override activation offloading."),
    Option("fp8", ("--fp8",), "torchao float8 training: none | tensorwise | rowwise (convert_to_float8_training with "
           "that recipe; Linear layers whose dimensions are multiples of 16; needs torchao; --target cuda: compute "
           "capability 8.9+) | mxfp8 | mxfp8-wgrad-hp | mxfp8-emulated (torchao's MXFP8 training recipes "
           "mxfp8_rceil, mxfp8_rceil_wgrad_with_hp, mxfp8_emulated_rceil; Linear layers whose dimensions are multiples "
           "of 32; one process or FSDP2; --compile: mxfp8-emulated only; mxfp8 and mxfp8-wgrad-hp: compute "
           "capability 10.0+, e.g. --gpu b200) | te-delayed (TransformerEngine's te.Linear under DelayedScaling, "
           "as accelerate's convert_model swaps it in: a documented estimate from TE 2.20's source, TE cannot run "
           "here; one eager process, --target cuda, compute capability 8.9+).",
           override="Override float8 training."),
    Option("fp8_amax_history", ("--fp8-amax-history",), "With --fp8 te-delayed: DelayedScaling's amax_history_len, "
           "the float32 history each te.Linear keeps per quantizer (TransformerEngine's default 1024; Megatron-LM's "
           "--fp8-amax-history-len default 1).", override="Override the delayed-scaling amax history length."),
    Option("fp8_skip", ("--fp8-skip",), "With --fp8: Linear layers left in high precision, by name: comma-separated "
           "parts of module names (a layer is skipped where its name contains one; torchtitan's filter_fqns, e.g. "
           "lm_head or output).", override="Override the layers --fp8 skips."),
    Option("fp8_all_gather", ("--fp8-all-gather",), "With --fp8 tensorwise under --shard zero2/zero3: what FSDP2 "
           "all-gathers for each float8 weight: high-precision (the sharded weight as it is) | float8 (torchao's "
           "enable_fsdp_float8_all_gather: float8 data + scale, amax all-reduced per weight) | float8-precomputed (+ "
           "precompute_float8_dynamic_scale_for_fsdp after each optimizer step).",
           override="Override the float8 all-gather."),
    Option("preference", ("--preference",), "Preference training: none | dpo | orpo | kto | simpo | cpo | grpo "
           "(trl's trainers' steps. dpo: chosen and rejected in one 2x batch, per-token log-probs by trl's fused LM "
           "head, a frozen reference forward, sigmoid loss; kto: --batch unpaired examples plus a KL batch (no_grad), "
           "fused head, reference; orpo, simpo, cpo: chosen and rejected in one 2x batch, the whole logits, no "
           "reference; --batch counts pairs, for kto examples; grpo: trl's GRPOTrainer: generation (--rollout), "
           "reference log-probs, training step, each phase's peak; --batch counts completions; dpo, kto and grpo "
           "need trl)."),
    Option("reference", ("--reference",), "--preference dpo, kto or grpo: auto | copy | adapter | precomputed (a second frozen copy "
           "of the policy; the base with the LoRA adapter disabled; precompute_ref_log_probs; auto: adapter with "
           "--lora, else copy; --preference grpo: auto = trl's beta 0.0, no reference; copy or adapter: beta != 0)."),
    Option("generations", ("--generations",), "--preference grpo: completions sampled per prompt (trl "
           "num_generations; --batch counts completions and must be a multiple; 0 = trl's default 8)."),
    Option("rollout", ("--rollout",), "--preference grpo: who generates the completions: transformers (trl "
           "use_vllm=False: the policy's generate() on this GPU) | vllm (use_vllm=True: a vLLM engine; on this GPU "
           "with --colocate-serve, trl's colocate mode, else vllm_mode='server' on other GPUs)."),
    Option("completion_len", ("--completion-len",), "--preference grpo: tokens generated after the --seq prompt "
           "tokens (trl max_completion_length; 0 = trl's default 512)."),
    Option("generation_batch", ("--generation-batch",), "--preference grpo: completions generated at once (trl "
           "generation_batch_size, global over the ranks: a multiple of --batch x --world-size; 0 = trl's default "
           "--batch x --world-size x --grad-accum): each rank generates generation-batch / --world-size completions "
           "every generation-batch / (--batch x --world-size) micro-steps (trl steps_per_generation), buffered "
           "until the next; "
           "misaligned with the optimizer step, trl adds the policy's no-grad old log-probs."),
    Option("tp", ("--tp",), "Tensor-parallel ranks (--world-size = dp x tp).", searched=True),
    Option("sp", ("--sp",), "Sequence parallel with --tp (torchtitan's plan).", searched=True),
    Option("loss_parallel", ("--loss-parallel/--no-loss-parallel",), "--sp: torchtitan's loss parallel (logits kept "
           "sharded over the vocabulary, the loss under torch's loss_parallel()) / the head gathers whole logits "
           "(torchtitan's disable_loss_parallel); default: on with --sp (not with --pp, --cp, --loss-head)."),
    Option("pp", ("--pp",), "Pipeline ranks (--world-size = pp x dp x tp); every one is reported.", searched=True),
    Option("ep", ("--ep",), "Expert-parallel ranks for MoE models (experts over ep of the --world-size data-parallel "
           "ranks; with --shard zero3|zero2).", searched=True),
    Option("cp", ("--cp",), "Context-parallel ranks (--world-size = dp x cp, x tp with --tp; torch's ring attention, "
           "hf: decoders on SDPA, with --shard zero3|zero2); every one is reported.", searched=True),
    Option("cp_rotate", ("--cp-rotate",), "--cp: allgather | alltoall (torch's set_rotate_method).",
           searched=True),
    Option("pp_schedule", ("--pp-schedule",), "1f1b | gpipe | interleaved | looped-bfs "
           "(torch.distributed.pipelining's schedules).", searched=True),
    Option("pp_virtual", ("--pp-virtual",), "--pp: stages per rank of interleaved and looped-bfs (default 2).",
           searched=True),
    Option("microbatches", ("--microbatches",), "--pp: micro-batches of --batch per step (default: --pp).",
           searched=True),
    Option("pp_split", ("--pp-split",), "--pp: layers per stage, e.g. 3,3,2 (default even).", searched=True),
    # --- the GPU and what to compare with
    Option("gpu", ("--gpu",), "Budget (11GB = 10^9 B, 11GiB = 2^30 B), card (rtx2080ti, a100) or device index (0).",
           str, ("estimate", "check", "whatif"), None, optional=True),
    Option("gpu", ("--gpu",), "Budget (24GB, 24GiB), card name or device index.", str,
           ("max-batch", "advise", "serve", "plan-parallel"), REQUIRED),
    Option("margin", ("--margin",), "Headroom: 10% (or 0.1): needed x 1.1 must fit.", str, ("check",), None,
           optional=True),
    Option("calibration", ("--calibration",), "A profile from `memest calibrate --out FILE`: its measured costs "
           "replace the defaults.", str, ("estimate", "check", "whatif", "max-batch", "advise", "serve",
                                          "plan-parallel"), None, optional=True),
    Option("strict", ("--strict",), "A tight verdict (the needed floor fits, the high end of the needed range does "
           "not) counts as not fitting.", bool, ("estimate", "check"), False),
    # --- each command's own
    Option("depth", ("--depth",), "Module-tree depth shown in the table.", int, ("estimate",), 3),
    Option("expand", ("--expand",), "Show every repeated block instead of one row per run.", bool, ("estimate",),
           False),
    Option("plot", ("--plot",), "Write memory over the step to FILE.png/.svg/.html.", str, ("estimate",), None,
           optional=True),
    Option("fail_if_not_fits", ("--fail-if-not-fits",), "Exit 1 when it does not fit (CI).", bool, ("estimate",),
           False),
    Option("colocate_serve", ("--colocate-serve",), "A vLLM rollout engine at this gpu_memory_utilization shares the "
           "GPU, as in trl's GRPO colocate mode (trl's default: 0.3); needs --gpu.", float, ("estimate",), None,
           optional=True),
    Option("timeout", ("--timeout",), "Seconds the model code may run (loading and tracing, in a worker process) "
           "before memest stops it: exit 2 naming the file.", float, ("check", "estimate"), 1800.0),
    Option("timeout", ("--timeout",), "Seconds the command may run (in a worker process, with the model code) before "
           "memest stops it: exit 2 naming the model (default: no limit; a planner traces many steps).", float,
           ("whatif", "max-batch", "advise", "plan-parallel", "serve"), None, optional=True),
    Option("seq_search", ("--seq-search",), "Search the longest sequence instead.", bool, ("max-batch",), False),
    Option("limit", ("--limit",), "Largest size tried.", int, ("max-batch",), 65536),
    Option("gpus", ("--gpus",), "Also lay the model out on this many GPUs (plan-parallel's layouts; hf: models).", int,
           ("advise",), None, optional=True),
    Option("gpus", ("--gpus",), "How many GPUs to lay the model out on.", int, ("plan-parallel",), 8),
    Option("top", ("--top",), "Stop once this many layouts fit, searched least communication first (0: trace every "
           "layout).", int, ("plan-parallel",), 1),
    # --- serve (memest serve's options and a serving config's serve: keys)
    Option("max_model_len", ("--max-model-len",), "Tokens per sequence (default: the model's positions).", int,
           ("serve",), SERVE, optional=True, yaml="max_model_len"),
    Option("utilization", ("--gpu-memory-utilization",), "vLLM's share of the GPU (default 0.9); SGLang: "
           "mem_fraction_static.", float, ("serve",), SERVE, optional=True, yaml="gpu_memory_utilization"),
    Option("tp", ("--tp",), "Tensor-parallel GPUs (figures are per GPU).", int, ("serve",), SERVE, yaml="tp"),
    Option("kv_dtype", ("--kv-dtype",), "auto (model dtype) | fp8.", KvDtype, ("serve",), SERVE, yaml="kv_dtype"),
    Option("block_size", ("--block-size",), "Tokens per KV block (vLLM default 16).", int, ("serve",), SERVE,
           yaml="block_size"),
    Option("max_num_seqs", ("--max-num-seqs",), "Default: vLLM's for the GPU.", int, ("serve",), SERVE, optional=True,
           yaml="max_num_seqs"),
    Option("max_num_batched_tokens", ("--max-num-batched-tokens",), "Tokens of the profile forward (default: vLLM's "
           "for the GPU).", int, ("serve",), SERVE, optional=True, yaml="max_num_batched_tokens"),
    Option("engine", ("--engine",), "vllm | sglang (mem_fraction_static arithmetic).", Engine, ("serve",), SERVE, yaml="engine"),
    Option("cuda_graphs", ("--cuda-graphs",), "profiled (vLLM >= 0.21 subtracts them) | after (older vLLM) | none "
           "(--enforce-eager).", CudaGraphs, ("serve",), SERVE, yaml="cuda_graphs"),
    Option("non_torch_memory", ("--non-torch-memory",), "Measured non-torch memory in GiB (your vLLM log's "
           "'non_torch_memory' / 'non-torch' figure): replaces the evidence range.", float, ("serve",), None,
           optional=True, yaml="non_torch_memory"),
    Option("min_concurrency", (), "check: full-length sequences that must fit at once.", int, (), None,
           optional=True, yaml="min_concurrency"),
    Option("fail_if_not_starts", ("--fail-if-not-starts",), "Exit 1 unless it surely starts (may not start or will "
           "not start).", bool, ("serve",), False),
    # --- calibrate
    Option("device", ("--device",), "NVML/CUDA index of the GPU to measure.", int, ("calibrate",), 0),
    Option("out", ("--out",), "Also write a portable profile to FILE (for --calibration FILE on machines without this "
           "GPU).", str, ("calibrate",), None, optional=True),
    Option("nccl", ("--nccl/--no-nccl",), "Also measure NCCL (a world of one).", bool, ("calibrate",), True),
    # --- output
    Option("format", ("--format", "-f"), "table | markdown | json (one document on stdout).", OutputFormat, OUTPUT,
           OutputFormat.TABLE),
    Option("json", ("--json",), "Same as --format json.", bool, OUTPUT, False),
    Option("markdown", ("--markdown",), "Same as --format markdown.", bool,
           tuple(c for c in OUTPUT if c != "calibrate"), False),
    Option("debug", ("--debug",), "Also print tracebacks and what installed libraries warn, log or print (exit codes stay the same).", bool, OUTPUT, False),
)


def for_command(command: str) -> list[Option]:
    """The options ``command`` takes, in the table's order; check's step options as overrides."""
    out = []
    for opt in OPTIONS:
        if command in opt.commands:
            out.append(opt.as_override() if command == "check" and opt.spec_field else opt)
    return out


def annotation(opt: Option) -> Any:
    """The Python type of the parameter (typer's)."""
    return Optional[opt.kind] if opt.optional else opt.kind  # noqa: UP045 (typer reads typing.Optional)


def step_fields(command: str) -> list[str]:
    """The RunSpec fields ``command`` takes."""
    return [o.name for o in for_command(command) if o.spec_field]


def step_spec(params: dict, command: str) -> dict:
    """The RunSpec fields among a command's parsed options."""
    return {name: params[name] for name in step_fields(command)}


def spec_options() -> dict[str, Option]:
    """field -> its option (estimate's), for every RunSpec field a user sets."""
    return {o.name: o for o in for_command("estimate") if o.spec_field}


def as_yaml_keys(text: str, keep: typing.Iterable[str] = ()) -> str:
    """A message about options said of a YAML config: each flag named as its YAML key ("--tp 3: ..." ->
    "tp: 3: ...", "--lora: bad value" -> "lora: bad value", "--no-compile" -> "compile: false"); the options named in ``keep`` (given as flags
    beside the config, e.g. check's overrides) keep their flag."""
    keep = set(keep)
    for opt in OPTIONS:
        if not opt.flags or opt.argument or opt.name in keep or not (opt.spec_field or opt.yaml):
            continue
        key = opt.yaml or opt.name
        for flag in opt.flags[0].split("/"):
            if flag.startswith("--no-") and opt.kind is bool:  # was "compile_scope: blocks with compile: drop one"
                text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", f"{key}: false", text)
            else:
                text = re.sub(rf"(?<![\w-]){re.escape(flag)}(?![\w-]):?", f"{key}:", text)
    return text


# the Python API's own keyword for an option that is not a RunSpec field (memest.estimate's gpu=, calibration=,
# from_file=; serve_capacity's engine options); the CLI's other options (--json, --out, ...) have no keyword
_API_KEYWORDS = {"gpu": "gpu", "calibration": "calibration", "from": "from_file"}


def _keyword_rows() -> dict[str, tuple[str, Any]]:
    """flag -> (keyword, kind) for every option the Python API takes by name; a switch's --no-x too."""
    rows: dict[str, tuple[str, Any]] = {}
    for opt in OPTIONS:
        if not opt.flags or opt.argument or opt.grid:
            continue
        keyword = opt.name if opt.spec_field or opt.yaml else _API_KEYWORDS.get(opt.name)
        if keyword is None:
            continue
        for flag in opt.flags[0].split("/"):
            rows.setdefault(flag, (keyword, opt.kind))
    return rows


_NUMBER = re.compile(r"-?\d")


def _keyword_value(kind: Any, word: str) -> str | None:
    """The value a flag is followed by in a message ("--generations 8", "--rollout sglang"), as a keyword's value
    ("8", "'sglang'"); None when the next word is the message's own ("--batch counts completions")."""
    if not word:
        return None
    if kind in (int, float):
        return word if _NUMBER.match(word) else None
    if isinstance(kind, type) and issubclass(kind, Choice):
        known = word.lower() in kind.values() or word.lower().replace("_", "-") in kind.values()
        return repr(word) if known or _NUMBER.match(word) else None
    if kind is str and (_NUMBER.match(word) or re.search(r"[:=,/]", word)):
        return repr(word)
    return None


def as_keywords(text: str) -> str:
    """A message said of a Python API call, its flags named as the call's keywords: the flag it opens with as its
    keyword ("--pp-split a,b: ..." -> "pp_split a,b: ...", "--lora 'x': ..." -> "lora 'x': ...", "--preference dpo
    traces ..." -> "preference dpo traces ..."), every other flag
    as ``keyword=value`` where a value follows it ("unknown --rollout 'x'" -> "unknown rollout='x'", "a multiple of
    --generations 8, got --batch 1" -> "a multiple of generations=8, got batch=1", "--compile with --world-size 2"
    -> "compile=True with world_size=2") and ``keyword=`` where none does ("--batch counts completions" -> "batch=
    counts completions"; before a colon the keyword alone). The CLI's messages keep their flags (battery 30 #46, #49; issue 22 item 27)."""
    rows = _keyword_rows()
    head = ""
    match = re.match(r"(--[\w-]+)(?=(?: '[^']*'| [^ ]+?)?:)", text) or re.match(r"(--[\w-]+) ('[^']*'|[^ ]+)", text)
    if match and match.group(1) in rows and rows[match.group(1)][1] is not bool:
        name, kind = rows[match.group(1)]
        value = match.group(2) if match.re.groups == 2 else None
        if value is None:
            head, text = name, text[match.end():]
        elif value[:1] == "'" or _keyword_value(kind, value.rstrip(".,;:)")) is not None:
            head, text = f"{name} {value}", text[match.end():]  # "--preference dpo traces ..." -> "preference dpo ..."

    def keyword(m: re.Match) -> str:
        flag, token = m.group(1), m.group(2) or ""
        if flag not in rows:
            return m.group(0)
        name, kind = rows[flag]
        if kind is bool:
            return f"{name}={not flag.startswith('--no-')}" + (f" {token}" if token else "")
        if token[:1] in ("'", '"'):
            return f"{name}={token}"
        word = token.rstrip(".,;:)")
        value = _keyword_value(kind, word)
        if value is None:
            if not token and m.string[m.end():m.end() + 1] == ":":
                return name  # "--world-size: ..." -> "world_size: ..."
            return f"{name}=" + (f" {token}" if token else "")
        return f"{name}={value}{token[len(word):]}"

    return head + re.sub(r"(?<![\w-])(--[a-z][\w-]*)(?: (?!\(?--)('[^']*'|\"[^\"]*\"|[^ ]+))?", keyword, text)


def yaml_kind(key: str) -> type:
    """The type a run config's step key takes (int, bool or str)."""
    kind = spec_options()[key].kind
    return kind if kind in (int, bool) else str


def typed(name: str, value: Any, kind: Any, optional: bool, where: str = "", flag: str = "") -> Any:
    """``value`` checked against an option's type (spec/options' rows, RunSpec's fields): a whole number is an
    int (never a bool, "8" or 8.5), a number an int or float, a switch a bool, a choice its enum member or string;
    ``None`` only where None is a value. One-line MemestError naming ``where`` and ``name`` otherwise."""
    if value is None:
        if optional:
            return None
        raise MemestError(f"{where}{name}: a value is required, got None")
    if isinstance(kind, type) and issubclass(kind, Choice):
        if not isinstance(value, (str, kind)):
            raise MemestError(f"{where}{name}: expected one of {', '.join(kind.values())}, got {value!r}")
        return kind.parse(value, flag or name)
    wrong = {
        int: lambda v: isinstance(v, bool) or not isinstance(v, int),
        float: lambda v: isinstance(v, bool) or not isinstance(v, (int, float)),
        bool: lambda v: not isinstance(v, bool),
        str: lambda v: not isinstance(v, str),
    }.get(kind)
    if wrong is not None and wrong(value):
        what = {int: "a whole number", float: "a number", bool: "True or False", str: "a string"}[kind]
        raise MemestError(f"{where}{name}: expected {what}, got {value!r}")
    return value


def typed_spec(values: dict, where: str = "", extra: tuple[str, ...] = ()) -> dict:
    """RunSpec fields given by name (the Python API's keyword arguments), each checked by ``typed``; an unknown
    name gets a did-you-mean over the fields and ``extra`` (the caller's own parameters)."""
    out = {}
    for name, value in values.items():
        if name not in _FIELD_TYPES:
            known = sorted(spec_options()) + list(extra)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known)}"
            raise MemestError(f"{where}unknown option {name!r}; {hint}")
        kind, optional = _FIELD_TYPES[name]
        if name in ("lora", "compute_capability"):
            out[name] = value  # lora: a dict, True or the string (spec/lora.py checks it); compute_capability: a pair
        else:
            row = spec_options().get(name)
            out[name] = typed(name, value, kind, optional, where, row.flag if row else name)
    return out


def typed_serve(values: dict, where: str = "") -> dict:
    """memest serve's engine options by name (the Python API's serve_capacity), each checked by ``typed``."""
    rows = {o.name: o for o in OPTIONS if o.yaml and "serve" in o.commands}
    return {name: typed(name, value, rows[name].kind, True, where) for name, value in values.items()}


def serve_keys() -> dict[str, type]:
    """A serving config's serve: keys and their types (choices as their strings)."""
    return {o.yaml: (str if issubclass(o.kind, Choice) else o.kind) for o in OPTIONS if o.yaml}


def serve_names() -> list[str]:
    """memest serve's engine options (serve.engine.ServeSpec's fields, and non_torch_memory)."""
    return [o.name for o in OPTIONS if o.yaml and "serve" in o.commands]


def serve_args(params: dict) -> dict:
    """The engine options among ``params`` (None: the engine's default) as serve.engine.ServeSpec takes them."""
    return {n: (str(params[n]) if isinstance(params[n], Choice) else params[n]) for n in serve_names() if n in params}


def searched_set(values: dict) -> list[str]:
    """The flags of the options plan-parallel searches that ``values`` sets away from RunSpec's default."""
    return [o.flag for o in for_command("plan-parallel")
            if o.searched and o.name in values and values[o.name] != o.default_value]


def to_argv(spec: RunSpec, command: str = "estimate", **extra) -> list[str]:
    """The command line (after ``memest``) that reproduces ``spec``: every step option away from its default
    (--batch always, --seq when set), then ``extra`` (command options by name, e.g. gpu=, calibration=)."""
    argv = [command, spec.model]
    for opt in for_command(command):
        if not opt.spec_field or opt.argument:
            continue
        value = getattr(spec, opt.name)
        if value != opt.default_value or opt.name == "batch" or (opt.name == "seq" and value is not None):
            argv += opt.argv(value)
    known = {o.name: o for o in for_command(command)}
    for name, value in extra.items():
        if value is not None:
            argv += known[name].argv(value)
    return argv


def command_line(spec: RunSpec, command: str = "estimate", **extra) -> str:
    """``to_argv`` as one shell line, starting with ``memest``."""
    return shlex.join(["memest", *to_argv(spec, command, **extra)])
