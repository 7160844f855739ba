"""Issue 21 ("Proof"): memest's uncalibrated figures against published per-rank GPU measurements of sharded
(FSDP / ZeRO-3) and QLoRA runs near a card's capacity.

Every row is a number a public source states for a run whose settings it also states (the address, pinned
to a commit where the source is a repository, is in the row). Each row is scored with the figure of the
type the source measured:

  reserved   torch.cuda.max_memory_reserved   -> memest's reserved peak (caching-allocator replay) on the row's
                                                 card: where the unconstrained replay holds more than the card
                                                 allows, the replay under the card's limit (usage.replay_under:
                                                 the allocator frees its cache and retries before an OOM), with
                                                 its [low, high] range (low: the allocator floor; high: the
                                                 replay's measured band, capped likewise)
  allocated  torch.cuda.max_memory_allocated  -> memest's allocated peak (no range)
  device     what nvidia-smi / the GPU monitor shows for the process -> memest's expected device use
                                                 (reserved + CUDA context + libraries) and its [low, high]

memest runs without calibration and never touches a GPU. Goals (issue 21): median |error| <= 5% and max <= 15%
per figure type; no run that ran is called "does not fit"; the measured value inside memest's range in >= 80%
of the rows that have one.

Published runs memest cannot express (selective op-level activation checkpointing, Float8, torch.compile under
FSDP, model code that is not transformers', DeepSpeed's own bucketing ...) are listed under "not scorable" with
what is missing: they are evidence too, and no number is made up for them.

    python scripts/bench_gpu_scale.py                 # -> benchmarks/gpu-scale.md and .json
    python scripts/bench_gpu_scale.py --only 7b-qlora --out /tmp/scale

Each row's result is cached (benchmarks/gpu-scale-cache.json) under a key of its spec and a hash of memest's
source, torch's, transformers' and peft's versions: a rerun after a code change retraces every row, a rerun
without one is instant. --no-cache retraces regardless. A full retrace took about 45 min on the shared 2-core
machine (7B rows 25-90 s each, Mistral 7B v0.2 at 24k tokens ~150 s, each Llama-2 70B row 3-10 min).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # memest never touches a GPU

MiB, GiB = 2**20, 2**30
CACHE = ROOT / "benchmarks" / "gpu-scale-cache.json"

# --- sources -------------------------------------------------------------------------------------------------
FQ_COMMIT = "05ed9f2a60f96a0795cb082bceab70a9b19fd213"
FQ_BENCH = f"https://github.com/AnswerDotAI/fsdp_qlora/blob/{FQ_COMMIT}/benchmarks_03_2024.md"
FQ_TRAIN = f"https://github.com/AnswerDotAI/fsdp_qlora/blob/{FQ_COMMIT}/train.py"
PEFT_COMMIT = "5d602fdbff04c33c1c4de55cda9d4ae1d7cb7e40"
PEFT_FSDP = f"https://github.com/huggingface/peft/blob/{PEFT_COMMIT}/docs/source/accelerate/fsdp.md"
PEFT_DS = f"https://github.com/huggingface/peft/blob/{PEFT_COMMIT}/docs/source/accelerate/deepspeed.md"
PEFT_SFT = f"https://github.com/huggingface/peft/blob/{PEFT_COMMIT}/examples/sft/utils.py"
TT_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"
TT_BENCH = f"https://github.com/pytorch/torchtitan/blob/{TT_COMMIT}/benchmarks/llama3_h100_202412_torchtitan.md"
TT_H200 = f"https://github.com/pytorch/torchtitan/blob/{TT_COMMIT}/benchmarks/llama3-8b_h200_202506_trainy-whitefiber.md"
TT_METRICS = "https://github.com/pytorch/torchtitan/blob/9dec370ad26b5f8e9a7333a0e36165018262644b/torchtitan/metrics.py"
TTUNE_README = "https://github.com/meta-pytorch/torchtune/blob/bd2a0fc7c31430972728494fa01aaeeb0ebf1ba1/README.md"

# Cards (nvidia-smi's total; compute capability from NVIDIA's CUDA GPUs list, https://developer.nvidia.com/cuda-gpus)
RTX3090 = ("RTX 3090 24GB", 24576 * MiB, (8, 6))
RTX4090 = ("RTX 4090 24GB", 24564 * MiB, (8, 9))
A100_40 = ("A100-SXM4 40GB", 40960 * MiB, (8, 0))
H100_80 = ("H100 80GB HBM3", 81559 * MiB, (9, 0))

# fsdp_qlora's train.py as benchmarks_03_2024.md ran it (its template command and train.py's defaults):
# --precision bf16 (model and LoRA weights in bf16, no autocast, no FSDP MixedPrecision), AdamW (torch, foreach),
# LoRA r=64 alpha=16 dropout=0.1 on q,k,v,gate,up,down ('all'), FSDP1 full_shard with FSDP's activation
# checkpointing of every decoder layer (reentrant, --reentrant_checkpointing True), bnb Linear4bit nf4 with
# compress_statistics (Linear4bit's default), quant_storage bf16; the loop keeps `output` alive through backward.
# peft ~0.9 left the adapters in the base weights' dtype (bf16): the fp32 upcast, get_peft_model's
# autocast_adapter_dtype=True, came with peft 0.12.0 (huggingface/peft#1706, 2024-05-16): --lora ...,dtype=base
PEFT_UPCAST = "https://github.com/huggingface/peft/pull/1706"
FQ_LORA = "r=64,alpha=16,dropout=0.1,dtype=base,targets=k_proj,q_proj,v_proj,up_proj,down_proj,gate_proj"
FQ_SETUP = ("fsdp_qlora train.py (Feb-Mar 2024; torch ~2.2, transformers 4.37-4.38, peft ~0.9, bitsandbytes 0.43 era), "
            "dummy dataset, 2 GPUs, --precision bf16, AdamW, LoRA r64/alpha16/dropout0.1 on q,k,v,gate,up,down, "
            "gradient checkpointing of every decoder layer (reentrant), no CPU offload unless stated; peak reserved "
            "logged for the first epoch (train.py: torch.cuda.max_memory_reserved)")
FQ_NOTES = [
    "LoRA weights: the run's peft (~0.9, March 2024) kept adapters in the base weights' bf16 (peft's fp32 upcast, "
    f"autocast_adapter_dtype, came in 0.12.0: {PEFT_UPCAST}); traced as the run held them: --lora ...,dtype=base "
    "(get_peft_model(..., autocast_adapter_dtype=False))",
    "checkpointing: the run's reentrant checkpointing of every decoder layer (train.py --reentrant_checkpointing "
    "True) traced as it ran: --checkpointing blocks-reentrant",
    "model code: transformers 4.37's Llama / Mistral where their memory differs from transformers 5's "
    "(scripts/models/hf437_causal_lm.py, transcribed from transformers 4.37.2; the repository's README then pinned 4.37, "
    "excluding 4.38 and 4.39): the logits upcast to fp32 in the model and kept in the output train.py holds through "
    "backward, the loss over a contiguous fp32 copy of the shifted logits, and each layer's rotary cos/sin cache "
    "(max_position_embeddings x head_dim, x2, per layer: bf16 for LoRA, built with torch_dtype; fp32 for QLoRA, built "
    "with from_config(cfg) under init_empty_weights)",
    "FSDP1 FULL_SHARD with use_orig_params False, traced as FSDP1 (--fsdp-version 1: torch's FullyShardedDataParallel, "
    "one flat parameter per decoder layer and per LoRA Linear, train.py's llama-recipes wrap policy); the wrap "
    "traced before the step as train.py runs it (--fsdp-sync-module-states: low_memory, its default, passes "
    "sync_module_states=True, device_id=the GPU; no empty_cache after the wrap, reset_peak_memory_stats before "
    "the first step)",
]


@dataclass
class Row:
    group: str
    label: str
    source: str
    setup: str
    spec: dict  # RunSpec fields
    card: tuple  # (name, bytes, compute capability); bytes None: the card is not stated
    figure: str  # reserved | allocated | device
    measured_bytes: int
    notes: list[str] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    measured_alt_bytes: int | None = None  # the source's figure under its other possible unit (GB = 10^9 B)


# the run's model code (transformers 4.37) by model and train.py's --train_type: scripts/models/hf437_causal_lm.py
ERA_FILE = "scripts/models/hf437_causal_lm.py"  # relative to the repository root (main() chdirs there)
ERA_MODELS = {
    ("hf:llama-2-7b", "lora"): f"{ERA_FILE}:llama2_7b_lora",
    ("hf:llama-2-7b", "qlora"): f"{ERA_FILE}:llama2_7b_qlora",
    ("hf:llama-2-70b", "qlora"): f"{ERA_FILE}:llama2_70b_qlora",
    ("hf:benchmarks/configs/mistral-7b-v0.2.json", "qlora"): f"{ERA_FILE}:mistral_7b_v02_qlora",
}


def _fq(label, card, train, batch, seq, measured_gib, *, figure="reserved", offload=False, ddp=False, source=FQ_BENCH,
        extra=(), model="hf:llama-2-7b", group="fsdp_qlora llama-2-7b"):
    spec = dict(model=ERA_MODELS[model, train], batch=batch, seq=seq, optim="adamw", precision="bf16", world_size=2,
                shard="none" if ddp else "zero3", checkpointing="blocks-reentrant", lora=FQ_LORA)
    if train == "qlora":
        spec.update(quant="nf4", double_quant=True)
    if offload:
        spec["offload"] = "params"
    spec["fsdp_version"] = "1"  # train.py wraps every strategy with FullyShardedDataParallel(use_orig_params=False)
    spec["fsdp_sync_module_states"] = True  # train.py: sync_module_states=args["low_memory"] (default True)
    notes = list(FQ_NOTES)
    if ddp:
        fsdp1 = next(k for k, n in enumerate(notes) if n.startswith("FSDP1 FULL_SHARD"))
        notes[fsdp1] = ("--sharding_strategy ddp is FSDP1 NO_SHARD (train.py: ``elif args['sharding_strategy'] == 'ddp': "
                    "sharding_strategy = ShardingStrategy.NO_SHARD``), traced as FSDP1 NO_SHARD (--shard none "
                    "--fsdp-version 1: every rank keeps each unit's whole flat parameter, flat gradients all-reduced; "
                    "the wrap with sync_module_states before the step)")
    if offload:
        notes.append("FSDP1 CPUOffload(offload_params=True) traced as --offload params: parameters, gradients and AdamW "
                     "state on the CPU, each layer's parameters copied in when used")
    return Row(group, label, source, f"{card[0]}; {FQ_SETUP}", spec, card, figure,
               round(measured_gib * GiB), notes + list(extra))


def fsdp_qlora_rows() -> list[Row]:
    """Answer.AI's benchmarks_03_2024.md, Llama-2 7B on two RTX 3090 (and two RTX 4090: the same table values)."""
    both = "the 2x4090 table (same file) states the same value for this setup"
    return [
        _fq("QLoRA bs1 ctx512", RTX3090, "qlora", 1, 512, 4.98),
        _fq("QLoRA bs1 ctx2048", RTX3090, "qlora", 1, 2048, 5.21),
        _fq("LoRA bs1 ctx512 (reserved)", RTX3090, "lora", 1, 512, 10.24),
        _fq("LoRA bs1 ctx512 (allocated)", RTX3090, "lora", 1, 512, 8.28, figure="allocated",
            extra=["the text below the table: 'the peak allocated memory is 8.28 GiB vs 9.16 GiB'"]),
        _fq("LoRA bs1 ctx2048 (reserved)", RTX3090, "lora", 1, 2048, 10.22),
        _fq("LoRA bs1 ctx2048 (allocated)", RTX3090, "lora", 1, 2048, 9.16, figure="allocated",
            extra=["the text below the table: 'the peak allocated memory is 8.28 GiB vs 9.16 GiB'"]),
        _fq("QLoRA bs4 ctx2048", RTX3090, "qlora", 4, 2048, 11.22),
        _fq("QLoRA bs10 ctx2048", RTX3090, "qlora", 10, 2048, 20.97, extra=[both]),
        _fq("LoRA bs4 ctx2048", RTX3090, "lora", 4, 2048, 16.14),
        _fq("LoRA bs6 ctx2048", RTX3090, "lora", 6, 2048, 21.35, extra=[both]),
        _fq("QLoRA DDP bs8 ctx2048", RTX3090, "qlora", 8, 2048, 20.94, ddp=True, extra=[both]),
        _fq("LoRA DDP bs4 ctx2048", RTX3090, "lora", 4, 2048, 22.04, ddp=True, extra=[both]),
        _fq("LoRA CPU offload bs10 ctx2048", RTX4090, "lora", 10, 2048, 22.69, offload=True),
        _fq("QLoRA CPU offload bs12 ctx2048", RTX4090, "qlora", 12, 2048, 22.38, offload=True),
        _fq("Llama-2 70B QLoRA CPU offload bs2 ctx2048", RTX3090, "qlora", 2, 2048, 14.92, offload=True,
            model="hf:llama-2-70b", group="fsdp_qlora llama-2-70b", extra=[both.replace("same value", "same value, 14.92,")]),
        _fq("Mistral 7B v0.2 QLoRA CPU offload bs12 ctx2048", RTX4090, "qlora", 12, 2048, 22.54, offload=True,
            model=MISTRAL_V02, group="fsdp_qlora mistral-7b-v0.2", extra=[MISTRAL_NOTE]),
        _fq("Mistral 7B v0.2 QLoRA CPU offload bs1 ctx24576", RTX4090, "qlora", 1, 24576, 22.54, offload=True,
            model=MISTRAL_V02, group="fsdp_qlora mistral-7b-v0.2", extra=[MISTRAL_NOTE]),
    ]


MISTRAL_V02 = "hf:benchmarks/configs/mistral-7b-v0.2.json"  # relative to the repository root (main() chdirs there)
MISTRAL_NOTE = ("config: benchmarks/configs/mistral-7b-v0.2.json (the bundled Mistral-7B shapes with the v0.2 card's "
                "rope_theta 1e6 and no sliding window; sources in benchmarks/configs/README.md); 'we can manage a "
                "respectable 24K tokens': both runs read 22.54 GiB, as the source states")


PEFT_QLORA_70B = dict(model=f"{ERA_FILE}:llama2_70b_bf16_cache", batch=2, seq=2048, grad_accum=2, optim="adamw", precision="bf16",
                      attention="flash", checkpointing="blocks-reentrant", outputs="freed", quant="nf4", double_quant=True,
                      lora="r=8,alpha=16,dropout=0.1,dtype=base,targets=all-linear", world_size=2, shard="zero3")
PEFT_SETUP = ("peft examples/sft/train.py (trl SFTTrainer, transformers Trainer) on Llama-2-70b-hf, --max_seq_len 2048 "
              "--packing True, per-device batch 2, gradient accumulation 2, --gradient_checkpointing True "
              "--use_reentrant True, --use_flash_attn True (flash_attention_2), LoRA r8/alpha16/dropout0.1 all-linear, "
              "4-bit nf4 with nested quant, quant storage and model dtype bfloat16 (utils.py), --bf16 True")
PEFT_NOTES = [
    "'GB' as the page writes it, read as GiB (the GPU monitor's unit; 10^9 B would make the measured 6.9% smaller)",
    "Trainer drops the model output before backward (--outputs freed); packing makes every row 2048 tokens",
    "trl skips prepare_model_for_kbit_training for sharded QLoRA (float quant storage): weights stay bf16",
    f"model dtype = quant storage dtype: {PEFT_SFT}",
    "model code: transformers 4.38's (the release of the page's dates; its Llama keeps 4.37's head and loss and, for "
    "backward compatibility, each layer's rotary cos/sin cache in the default dtype: bf16 as peft's utils.py loads "
    "the model, or as DeepSpeed casts it) where its memory differs from transformers 5's: "
    "scripts/models/hf437_causal_lm.py:llama2_70b_bf16_cache (Trainer drops the output, so the fp32 logits live "
    "through the forward's loss only)",
    "adapters in the base's bf16 (--lora ...,dtype=base): the page's figures were added 2024-02-26 and 2024-03-13 "
    "(huggingface/peft#1489, #1550), before peft 0.12.0's fp32 upcast (autocast_adapter_dtype, "
    f"{PEFT_UPCAST})",
]


# peft's examples/sft/configs/fsdp_config_qlora.yaml (huggingface/peft@1948110): fsdp_use_orig_params false,
# fsdp_sync_module_states true, fsdp_cpu_ram_efficient_loading true: FSDP1, flat parameters, rank 0's states broadcast
PEFT_FSDP1 = dict(fsdp_version="1", fsdp_sync_module_states=True)
PEFT_FSDP1_NOTE = ("FSDP1 as peft's fsdp_config_qlora.yaml sets it (fsdp_use_orig_params false, fsdp_sync_module_states "
                   "true, fsdp_cpu_ram_efficient_loading true): --fsdp-version 1 --fsdp-sync-module-states, the wrap "
                   "replayed before the step")


def peft_rows() -> list[Row]:
    """peft's docs (accelerate/fsdp.md, accelerate/deepspeed.md): Llama-2 70B QLoRA per-GPU memory."""
    return [
        Row("peft docs llama-2-70b", "FSDP QLoRA 2 GPUs, no CPU offload", PEFT_FSDP,
            f"GPU not stated (2 GPUs; 24 GB cards for the offload run); {PEFT_SETUP}; FSDP1 FULL_SHARD, "
            "use_orig_params False, BACKWARD_PRE prefetch; 'When disabling CPU offloading, the GPU memory usage is "
            "35.6 GB/GPU'", {**PEFT_QLORA_70B, **PEFT_FSDP1}, ("not stated", None, (8, 0)), "device",
            round(35.6 * GiB), PEFT_NOTES + [PEFT_FSDP1_NOTE, "card not stated: no verdict scored; compute capability taken as 8.0 (A100) for the "
                          "context cost"], measured_alt_bytes=round(35.6e9)),
        Row("peft docs llama-2-70b", "FSDP QLoRA 2x24GB, CPU offload", PEFT_FSDP,
            f"2x24GB GPUs (model not stated); {PEFT_SETUP}; FSDP1 FULL_SHARD with fsdp_offload_params true; "
            "'the memory consumed per GPU is 19.6 GB'", {**PEFT_QLORA_70B, **PEFT_FSDP1, "offload": "params"},
            ("24GB (model not stated)", 24 * 1000**3, (8, 6)), "device", round(19.6 * GiB),
            PEFT_NOTES + [PEFT_FSDP1_NOTE, "24 GB card, model not stated: capacity taken as 24e9 B, compute capability 8.6",
                          "FSDP1 CPU offload as --offload params"], measured_alt_bytes=round(19.6e9)),
        Row("peft docs llama-2-70b", "DeepSpeed ZeRO-3 QLoRA 2x A100 40GB", PEFT_DS,
            f"2x40GB GPUs; {PEFT_SETUP}; DeepSpeed ZeRO-3 (accelerate deepspeed_config_z3_qlora.yaml, no offload, "
            "mixed_precision bf16); 'the memory consumed per GPU is 36.6 GB'", PEFT_QLORA_70B, A100_40, "device",
            round(36.6 * GiB),
            PEFT_NOTES + ["DeepSpeed ZeRO-3 traced as --shard zero3 (FSDP2's per-layer gather): DeepSpeed's "
                          "prefetch bucket / max_live_parameters and its contiguous gradient buffers are not modelled"],
            measured_alt_bytes=round(36.6e9)),
        Row("peft docs llama-2-70b", "DeepSpeed ZeRO-3 LoRA 8x H100 80GB", PEFT_DS,
            "8x H100 80GB; peft examples/sft/train.py, Llama-2-70b-hf in fp32 (no quantization: utils.py loads "
            "dtype float32), accelerate mixed_precision bf16, DeepSpeed ZeRO-3 no offload, per-device batch 8, "
            "gradient accumulation 4, seq 2048 packed, gradient checkpointing non-reentrant, flash_attention_2, "
            "LoRA r8/alpha16/dropout0.1 all-linear; 'the memory consumed per GPU is 64 GB (80%)'",
            dict(model=f"{ERA_FILE}:llama2_70b_bf16_cache", batch=8, seq=2048, grad_accum=4, optim="adamw", precision="bf16",
                 attention="flash", checkpointing="blocks", outputs="freed",
                 lora="r=8,alpha=16,dropout=0.1,dtype=base,targets=all-linear", world_size=8, shard="zero3"),
            H100_80, "device", round(64 * GiB),
            PEFT_NOTES[:2] + PEFT_NOTES[4:] + ["DeepSpeed ZeRO-3 traced as --shard zero3 (FSDP2's per-layer gather): DeepSpeed's "
                              "prefetch bucket / max_live_parameters are not modelled",
                              "traced as --precision bf16: with bf16 enabled DeepSpeed casts the whole module to "
                              "bf16 (deepspeed/runtime/engine.py, _configure_distributed_model: self.module.bfloat16(); "
                              "https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/engine.py; the blanket "
                              "cast of the releases before 0.19.2, the 2024-25 era of the page), so "
                              "the fp32-loaded frozen weights are held in bf16; its fp32 master copies of the 0.1% "
                              "trainable LoRA weights are not modelled",
                              "80% of the 80 GB card: the monitor's figure, read from a screenshot by the page"],
            measured_alt_bytes=round(64e9)),
    ]


TT_TABLE2_SETUP = (
    "torchtitan 9dec370 (torch 1963fc8, 2024/12/23), Table 2 'FSDP + CP + torch.compile + Float8 ... Local batch size 1. "
    "Full activation checkpointing': Llama 3.1 8B on 8 H100 96GB, FSDP 8, CP 1, seq 32768, local batch 1, "
    "activation_checkpoint.mode 'full' (torchtitan wraps each TransformerBlock in ptd_checkpoint_wrapper, "
    "non-reentrant: --checkpointing blocks), AdamW, FSDP2 param bfloat16 / reduce float32, each block compiled, "
    "Float8 as in Table 1's Float8 row; 'Memory(GiB)' is the logged max_reserved_gib")


TT_MODEL = "scripts/models/titan_llama3_9dec370.py"  # torchtitan 9dec370's Llama 3.1 8B (relative to the root)


def torchtitan_rows() -> list[Row]:
    """torchtitan's Llama 3.1 8B H100 benchmark (end of 2024): the FSDP runs memest can express since issue 23 (op-level
    selective checkpointing, each block compiled, Float8 with its float8 all-gather): Tables 1 and 3 (the rows
    scripts/bench_gpu_recipes.py scores with transformers' Llama) and Table 2's CP 1 row (its CP 2-8 rows compile
    under context parallelism, which memest does not trace: NOT_SCORABLE). Traced here with the run's own model code,
    torchtitan 9dec370's Llama (scripts/models/titan_llama3_9dec370.py), as every row of this table is."""
    import bench_gpu_recipes as recipes  # here, not at the top: that script imports this one

    model_note = (f"model code: torchtitan {recipes.TT_RUN[:7]}'s Llama 3.1 8B ({TT_MODEL}: grouped-query attention "
                  "with repeat_kv, its fp32-upcasting RMSNorm, complex RoPE, bf16 logits upcast in train.py's loss_fn, "
                  "which train.py deletes before backward)")

    def titan(row: Row, factory: str = "build_model") -> Row:
        spec = {**row.spec, "model": f"{TT_MODEL}:{factory}"}
        if spec.get("fp8_skip") == "lm_head":
            spec["fp8_skip"] = "output"  # torchtitan's module_filter_fn: fqn != "output" (its name for the head)
        notes = [model_note if n.startswith("model code:") else
                 n.replace("--fp8-skip lm_head, transformers' name for it", "--fp8-skip output") for n in row.notes]
        return Row(row.group, row.label, row.source, row.setup, spec, row.card, row.figure, row.measured_bytes, notes)

    table2 = Row("torchtitan llama-3.1-8b full AC", "Table 2: FSDP 8, CP 1, seq 32768, full AC, torch.compile + Float8",
                 TT_BENCH, TT_TABLE2_SETUP,
                 {**recipes.TT_SPEC, "batch": 1, "seq": 32768, "checkpointing": "blocks", "world_size": 8,
                  **recipes.TT_FLOAT8},
                 recipes.H100_96, "reserved", round(83.9 * GiB),
                 [n for n in recipes.TT_NOTES if not n.startswith("SAC policy")]
                 + [recipes.TT_COMPILE_NOTE, recipes.TT_FLOAT8_NOTE,
                    "build_32k: train.py sets the model's max_seq_len to training.seq_len (32768 here)"])
    return [titan(r) for r in recipes.tt_rows()] + [titan(table2, "build_32k")]


GROUPS = {"fsdp_qlora": fsdp_qlora_rows, "peft": peft_rows, "torchtitan": torchtitan_rows}

NOT_SCORABLE = [  # published per-rank numbers with settings memest cannot express (yet): evidence, no figure made up
    dict(source=TT_BENCH, runs="Table 2: Llama 3.1 8B, FSDP 4 / 2 / 1 x CP 2 / 4 / 8 on 8 H100, seq 64k-256k: "
         "84.2 / 84.0 / 84.5 GiB (the CP 1 row is scored)", figure=f"reserved (torchtitan logs reserved_bytes.all.peak: "
         f"{TT_METRICS})",
         missing="torch.compile of each block under context parallelism (--compile-scope blocks with --cp is not "
                 "traced: not checked against real compiled runs); torchtitan's model code"),
    dict(source=TT_BENCH, runs="Table 4: Llama 3.1 70B, FSDP 32 x TP 8 on 256 H100, local batch 16: 71.9 / 67.6 GiB "
         "(AsyncTP)", figure="reserved", missing="torch.compile of each block under tensor parallelism (--compile-scope "
                 "blocks with --tp is not traced); Float8's tensor-parallel plan; AsyncTP (symmetric-memory buffers)"),
    dict(source=TT_BENCH, runs="Table 5-6: Llama 3.1 405B, FSDP 8 x TP 8 x PP 8 (x CP) on 512 H100: 72.7-84.9 GiB",
         figure="reserved (max over ranks)", missing="Float8, torch.compile, AsyncTP; 405B config not bundled"),
    dict(source=TT_H200, runs="Llama 3.1 8B, FSDP on 32 / 64 H200, local batch 2: 47.96 / 46.97 GiB",
         figure="reserved", missing="--float8.force_recompute_fp8_weight_in_bwd (torchao recomputes the float8 weight "
                 "in backward instead of saving it; not modelled); the run's toml (torchtitan e7c0cae, 2025/06/13) is not "
                 "among the stored sources (the one stored version of llama3_8b.toml is another commit's)"),
    dict(source="https://github.com/pytorch/torchtitan/pull/1884",
         runs="Llama 3 8B ('8B_flex_attn' flavour), 4 GPUs, FSDP 2 x CP 2, full AC, llama3_8b.toml: step 1 33.21 GiB, "
              "step 10 44.84 GiB", figure="reserved",
         missing="FlexAttention (memest traces SDPA / eager attention); torchtitan's model code"),
    dict(source=TTUNE_README, runs="Llama 3.1 8B/70B/405B full, LoRA, QLoRA: 7.4-44.8 GiB per GPU",
         figure="'Peak Memory per GPU' (type not stated)",
         missing="torch.compile on, packed batches; 70B full uses CPU offload + optimizer in backward; figure type "
                 "unstated; torchtune's model code"),
    dict(source=TTUNE_README, runs="Llama 3.2 3B single device on A100 (memory-optimisation ladder): 25.5-4.6 GiB",
         figure="peak memory active", missing="activation offloading, optimizer in backward, chunked CE with "
                 "compile; baseline on unpacked variable-length data (no fixed sequence length)"),
    dict(source=PEFT_FSDP, runs="Llama-2 70B LoRA, FSDP on 8 H100 80GB: '72-80 GB (90-98%)'",
         figure="device (a range over the run, including the FULL_STATE_DICT save at the end)",
         missing="a peak of the training step is not stated (the range includes saving)"),
    dict(source=FQ_BENCH, runs="Yi 34B QLoRA on 2x3090/4090, ctx 2048: 23.05 GiB (bs2) / 22.98 GiB (bs4, CPU offload)",
         figure="reserved", missing="Yi-34B's config.json: not bundled, and no published copy was found in the stored "
                 "sources (a config written from memory would be a made-up input)"),
]


# --- scoring -------------------------------------------------------------------------------------------------
def _source_hash() -> str:
    h = hashlib.sha256()
    for path in sorted((ROOT / "memest").rglob("*")):
        if path.is_file() and path.suffix in (".py", ".json"):
            h.update(str(path.relative_to(ROOT)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


def _versions() -> dict:
    import torch

    out = {"torch": torch.__version__}
    for name in ("transformers", "peft", "bitsandbytes"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            out[name] = None
    return out


def cache_key(row: Row, code: str, versions: dict) -> str:
    from memest.sources.model_file import _split_ref

    # a config under benchmarks/configs, or a model file under scripts/models (path.py:factory): its content counts
    local = ROOT / _split_ref(row.spec["model"].removeprefix("hf:"))[0]
    config = hashlib.sha256(local.read_bytes()).hexdigest()[:16] if local.is_file() else None
    blob = json.dumps({"spec": row.spec, "cc": row.card[2], "env": row.env, "code": code, "versions": versions,
                       **({"config": config} if config else {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def trace_row(row: Row) -> dict:
    """memest's figures for the row's setup (everything that does not depend on the measured number)."""
    from memest.device.usage import device_usage, replay_under
    from memest.estimator import estimate
    from memest.spec import RunSpec

    start = time.perf_counter()
    result = estimate(RunSpec(**row.spec, compute_capability=row.card[2]))
    spec = RunSpec(**row.spec, compute_capability=row.card[2])
    usage = device_usage(result.trace, row.card[2], env=dict(row.env), world_size=spec.world_size, dims=spec.parallel)
    # on the row's card the allocator frees its cache and retries before an OOM: the reserved peak a run there shows
    # is the replay under the card's limit (device/usage.replay_under), capped near the card where the unconstrained
    # replay holds more
    on_card = replay_under(result.trace, usage, row.card[1], env=dict(row.env)) if row.card[1] else None
    # the same with every cost outside the allocator at the low end of its evidence (device/overheads.py): the most
    # room the card can leave the allocator, the high end of what a run capped there can reserve
    room = sum(c.bytes - c.low for c in usage.fixed_costs if not c.in_allocator)
    roomy = replay_under(result.trace, usage, row.card[1] + room, env=dict(row.env)) if row.card[1] else None
    b = result.report.breakdown_at_peak
    return {
        "allocated": usage.allocated_peak_bytes, "reserved": usage.reserved_peak_bytes,
        "reserved_low": usage.reserved_bytes_low, "reserved_high": usage.reserved_bytes_high,
        "reserved_unconstrained": usage.reserved_peak_bytes,
        "reserved_on_card": None if on_card is None or on_card.oom else on_card.peak_reserved,
        # where the replay runs out of the card before the step ends: the reserved it reached there (near the card
        # less the costs outside the allocator, the most max_memory_reserved can read on it)
        "reserved_on_card_oom": on_card.peak_reserved if on_card is not None and on_card.oom else None,
        "reserved_on_card_roomy": None if roomy is None else roomy.peak_reserved,
        "device": usage.bytes_expected, "device_low": usage.bytes_low, "device_high": usage.bytes_high,
        "needed": [usage.needed_bytes_low, usage.needed_bytes_expected, usage.needed_bytes_high],
        # the does-not-fit line where memest has one (DeviceUsage.needed_bytes_floor: the allocator floor + fixed costs)
        "needed_floor": getattr(usage, "needed_bytes_floor", None),
        "breakdown_at_peak": {k: int(v) for k, v in b.items()},
        "at_peak": {"iteration": result.report.peak_iteration, "phase": str(result.report.phase_at_peak),
                    "module": result.report.module_at_peak, "op": result.report.op_at_peak},
        "seconds": round(time.perf_counter() - start, 1),
    }


def score(row: Row, traced: dict) -> dict:
    from memest.device.fit import verdict
    from memest.device.reservation import reservation_spread

    # on the safe side: the card's memory less the driver's reservation outside any process (device/reservation.py)
    card = None if row.card[1] is None else row.card[1] - reservation_spread().expected
    needed, floor = traced["needed"], traced.get("needed_floor")
    # memest's own verdict rule: with a needed floor, "does not fit" only below it (device/fit.py)
    said = None if card is None else (verdict(needed[1], needed[2], card) if floor is None else
                                      verdict(needed[1], needed[2], card, needed_low=floor))
    memest = {**traced, "verdict": None if said is None else str(said)}
    on_card = traced.get("reserved_on_card")
    # the run ran on that card, where the replay runs out before the step ends (verdict "tight" at most): memest's
    # figure for a run that completed there is the most the card lets it reserve, the replay's reserved at the limit
    on_card = on_card if on_card is not None else traced.get("reserved_on_card_oom")
    if on_card is not None and on_card < memest["reserved"]:  # the run was on that card: its reserved is capped there
        memest["reserved"] = on_card
        if memest["reserved_high"] is not None:
            # the band over the capped figure, and at most what the card's most room lets the replay reserve (the
            # costs outside the allocator at their low end): a capped reading moves with the room the card leaves
            band = traced["reserved_high"] - traced["reserved_unconstrained"]
            roomy = traced.get("reserved_on_card_roomy") or on_card
            memest["reserved_high"] = min(memest["reserved_high"], max(on_card, roomy) + band)
    figure = row.figure
    value = memest[figure]
    low, high = (memest.get(f"{figure}_low"), memest.get(f"{figure}_high")) if figure != "allocated" else (None, None)
    m = row.measured_bytes
    inside = None if low is None else (low <= m and (high is None or m <= high))
    return {
        "group": row.group, "label": row.label, "source": row.source, "setup": row.setup, "spec": row.spec,
        "card": {"name": row.card[0], "bytes": row.card[1], "compute_capability": list(row.card[2])},
        "figure": figure, "measured_bytes": m, "memest_bytes": value, "low": low, "high": high,
        "error_pct": 100 * (value - m) / m, "inside": inside, "notes": row.notes, "memest": memest,
        "measured_alt_bytes": row.measured_alt_bytes,
        "error_alt_pct": None if row.measured_alt_bytes is None else
        100 * (value - row.measured_alt_bytes) / row.measured_alt_bytes,
        "inside_alt": None if row.measured_alt_bytes is None or low is None else
        (low <= row.measured_alt_bytes and (high is None or row.measured_alt_bytes <= high)),
    }


def summary(scored: list[dict], figure: str) -> dict:
    rows = [r for r in scored if r["figure"] == figure]
    if not rows:
        return {}
    errors = [abs(r["error_pct"]) for r in rows]
    ranged = [r for r in rows if r["inside"] is not None]
    inside = sum(r["inside"] for r in ranged)
    return {"rows": len(rows), "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors),
            "with_range": len(ranged), "inside": inside,
            "goals": {"median_5pct": statistics.median(errors) <= 5, "max_15pct": max(errors) <= 15,
                      "inside_80pct": (inside >= 0.8 * len(ranged)) if ranged else None}}


def _g(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _compact(spec: dict) -> str:
    skip = {"model"}
    return spec["model"] + " " + " ".join(f"{k}={v}" for k, v in spec.items() if k not in skip)


def render(scored: list[dict], env: dict, failed: list[dict]) -> str:
    lines = ["# Published per-rank GPU measurements at scale: memest uncalibrated (issue 21)", "",
             f"Scored {env['date']} with memest {env['memest']} ({env['commit']}), torch {env['torch']}, transformers "
             f"{env['transformers']}, peft {env['peft']}, bitsandbytes {env['bitsandbytes']}, on a CPU (memest never "
             "touches a GPU; no calibration). Reproduce: "
             f"`{env.get('command', 'python scripts/bench_gpu_scale.py')}` (raw: {env.get('raw', 'gpu-scale.json')}).",
             "",
             "Each row is a per-rank figure a public source states, with the settings it states; memest's figure is "
             "the one of the same type: reserved = `max_memory_reserved` (memest's allocator replay, range = its "
             "measured band), allocated = `max_memory_allocated`, device = the GPU monitor / nvidia-smi (reserved + "
             "context + libraries, memest/device/overheads.py). Verdict: memest's three-way answer for the row's card.",
             "",
             "Goals: median |error| <= 5%, max <= 15% per figure type; no run that ran called \"does not fit\"; the "
             "measured value inside memest's range in >= 80% of rows.", "",
             "| figure | rows | median \\|error\\| | max \\|error\\| | inside range | goals |", "|---|---:|---:|---:|---:|---|"]
    for figure in ("reserved", "allocated", "device"):
        s = summary(scored, figure)
        if not s:
            continue
        goals = ", ".join(f"{k} {'met' if v else '**missed**'}" for k, v in s["goals"].items() if v is not None)
        inside = f"{s['inside']}/{s['with_range']}" if s["with_range"] else "-"
        lines.append(f"| {figure} | {s['rows']} | {s['median_abs_error_pct']:.2f}% | {s['max_abs_error_pct']:.2f}% | "
                     f"{inside} | {goals} |")
    dnf = [r["label"] for r in scored if r["memest"]["verdict"] == "does-not-fit"]
    lines += ["", f"Runs that ran called \"does not fit\": {len(dnf)}" + (f" ({', '.join(dnf)})" if dnf else "") + ".",
              "", "## Rows", ""] + rows_table(scored)
    lines += ["", "## Settings and notes per group", ""]
    seen = set()
    for r in scored:
        if r["group"] in seen:
            continue
        seen.add(r["group"])
        lines.append(f"- **{r['group']}**: {r['setup']}")
    lines += ["", "Per row, what memest traces differently from the run:", ""]
    for r in scored:
        lines.append(f"- {r['group']} / {r['label']}: " + "; ".join(r["notes"]))
    lines += ["", "## Misses and their causes", ""] + misses(scored)
    if failed:
        lines += ["", "## Rows memest could not trace", ""]
        lines += [f"- {f['group']} / {f['label']}: {f['error']}" for f in failed]
    lines += ["", "## Not scorable: published per-rank numbers memest cannot express", "",
              "| source | runs and stated per-rank memory | figure | what memest lacks |", "|---|---|---|---|"]
    lines += [f"| [{n['source'].split('/blob/')[0].split('github.com/')[-1]}]({n['source']}) | {n['runs']} | "
              f"{n['figure']} | {n['missing']} |" for n in NOT_SCORABLE]
    return "\n".join(lines) + "\n"


def rows_table(scored: list[dict]) -> list[str]:
    """The markdown table of scored rows (this script's and bench_gpu_recipes.py's)."""
    lines = ["| group | run | card | figure | measured GiB | memest GiB | error | memest range GiB | inside | verdict "
             "| trace s | settings traced | source |", "|---|---|---|---|---:|---:|---:|---|---|---|---:|---|---|"]
    for r in scored:
        rng = "-" if r["low"] is None else f"{_g(r['low'])}-{_g(r['high']) if r['high'] is not None else 'unbounded'}"
        inside = "-" if r["inside"] is None else ("yes" if r["inside"] else "**no**")
        lines.append(f"| {r['group']} | {r['label']} | {r['card']['name']} | {r['figure']} | {_g(r['measured_bytes'])} "
                     f"| {_g(r['memest_bytes'])} | {r['error_pct']:+.1f}% | {rng} | {inside} | "
                     f"{r['memest']['verdict'] or '-'} | {r['memest']['seconds']:.0f} | `{_compact(r['spec'])}` | "
                     f"[source]({r['source']}) |")
    return lines


def misses(scored: list[dict], causes: dict[str, str] | None = None) -> list[str]:
    """Each row off the goals (|error| > 5%, outside the range, or "does not fit"), with the numbers the causes rest
    on computed from the row; CAUSES adds what the sources say."""
    out = []
    for r in scored:
        bad = abs(r["error_pct"]) > 5 or r["inside"] is False or r["memest"]["verdict"] == "does-not-fit"
        if not bad:
            continue
        m = r["memest"]
        b = m["breakdown_at_peak"]
        parts = ", ".join(f"{k} {v / GiB:.2f}" for k, v in b.items() if v)
        why = []
        card = r["card"]["bytes"]
        unconstrained = m.get("reserved_unconstrained", m["reserved"])
        if r["figure"] == "reserved" and card is not None and unconstrained > 0.95 * card:
            capped = m.get("reserved_on_card") is not None and m["reserved"] < unconstrained
            ran_out = m.get("reserved_on_card") is None and m.get("reserved_on_card_oom") is not None
            roomy = m.get("reserved_on_card_roomy")
            why.append(f"near capacity: the unconstrained replay holds {unconstrained / GiB:.2f} GiB reserved "
                       f"({unconstrained / card:.0%} of the {card / GiB:.2f} GiB card); the real allocator, when "
                       "cudaMalloc fails, frees its unused cached blocks and retries (CUDACachingAllocator.cpp, "
                       "release_cached_blocks), so memest's figure is the replay under the card's limit"
                       + (f" ({m['reserved'] / GiB:.2f} GiB)" if capped else
                          f", where the replay runs out before the step ends (at {m['reserved'] / GiB:.2f} GiB "
                          "reserved, its figure here: the most the card lets a run that completed reserve)"
                          if ran_out else " (the step does not complete there)")
                       + (f"; with the costs outside the allocator at their low end the replay under the card "
                          f"reserves {roomy / GiB:.2f} GiB (the range's high end, with the band)"
                          if roomy is not None and (capped or ran_out) else "")
                       + f"; verdict '{m['verdict']}', needed {m['needed'][1] / GiB:.2f} GiB expected. Unconstrained "
                       f"reserved / allocated: {unconstrained / m['allocated']:.2f}.")
        if r["measured_alt_bytes"] is not None:
            why.append(f"Unit: read as 10^9 B the measured is {r['measured_alt_bytes'] / GiB:.2f} GiB and memest's "
                       f"error {r['error_alt_pct']:+.1f}% (measured {'inside' if r['inside_alt'] else 'outside'} "
                       "the range).")
        if m["verdict"] == "does-not-fit":
            why.append(f"memest calls a run that ran \"does not fit\" (a goal miss): its smallest budget for the step, "
                       f"{m['needed'][1] / GiB:.2f} GiB, is above the {card / GiB:.2f} GiB card.")
        cause = (CAUSES if causes is None else causes).get(r["label"], "")
        why.append(cause(scored) if callable(cause) else cause)  # a callable reads other rows of this table
        out.append(f"- {r['group']} / {r['label']}: {r['error_pct']:+.1f}% ({r['figure']}), measured "
                   f"{'inside' if r['inside'] else 'outside' if r['inside'] is False else 'no range for'} memest's "
                   f"range; memest's breakdown at its peak (GiB): {parts}"
                   + (" (peak: iteration {iteration}, {phase}, {module}, {op})".format(**m["at_peak"])
                      if m.get("at_peak") else "") + ". " + " ".join(w for w in why if w))
    return out or ["- none"]


def _offload_pair(scored: list[dict]) -> str:
    """peft's FSDP QLoRA guide rows with and without CPU offload, side by side (both in this table)."""
    pair = {r["label"]: r for r in scored if r["group"] == "peft docs llama-2-70b"}
    on, off = pair.get("FSDP QLoRA 2x24GB, CPU offload"), pair.get("FSDP QLoRA 2 GPUs, no CPU offload")
    if on is None or off is None:
        return ""
    gap_on, gap_off = on["measured_bytes"] - on["memest_bytes"], off["measured_bytes"] - off["memest_bytes"]
    return (f"memest's two figures differ by {(off['memest_bytes'] - on['memest_bytes']) / GiB:.2f} GiB "
            f"({off['memest_bytes'] / GiB:.2f} and {on['memest_bytes'] / GiB:.2f} GiB), so of this row's "
            f"{gap_on / GiB:.2f} GiB miss, {gap_off / GiB:.2f} GiB is the no-offload row's own gap.")


CAUSES: dict[str, object] = {  # a row's cause, or a function of the scored rows that writes it
    "QLoRA bs1 ctx512": "FSDP1's wrap before the step (fsdp1.load_events: each unit's parameters and buffers, the "
                        "4-bit quantization state and the era's fp32 rotary caches among them, moved, broadcast, "
                        "flattened, sharded) leaves 3.63 GiB reserved at memest's expected value and 3.98 GiB at its "
                        "high end (each broadcast bucket kept from reuse until rank 0's next blocking copy: "
                        "ProcessGroupNCCL's recordStream in the run's torch); the source states 3.72 GiB reserved "
                        "right after the wrap (reserved_after_model_wrap), between the two.",
    "QLoRA bs10 ctx2048": "Near the card's limit (above): memest's replay fragments more than the run did. In its "
        "first forward the reserved grows one 430 MiB segment per decoder layer: each layer's output (160 MiB, kept "
        "for the next layer's reentrant checkpoint) is carved from a freed 430 MiB MLP block, the smallest free block "
        "that fits (CUDACachingAllocator.cpp get_free_block's best fit), so the next layer's MLP needs a new segment; "
        "then the loss's four 2.4 GiB fp32 tensors (transformers 4.37's upcast logits, their shifted copy, the "
        "log-softmax and its gradient) take a segment each: 23.32 GiB unconstrained for an allocated peak of 18.42 "
        "GiB, 22.84 GiB under the card, where the run read 20.97 GiB. Which allocations the real step ordered "
        "differently is not isolated without a GPU run near capacity (scripts/validate_gpu.py).",
    "LoRA bs6 ctx2048": "Not isolated: the run reserved 0.20 GiB (1.0% of its peak) more than memest's replay; the "
        "range's high end (the replay's band, measured on this project's single-GPU runs, device/slack.py, over the "
        "worst case of the record_stream'd blocks, the wrap's broadcast buckets among them) ends 0.01 GiB below the "
        "run.",
    "LoRA CPU offload bs10 ctx2048": "Not isolated: the run reserved 0.56 GiB more than memest's replay, whose peak "
        "is the loss's forward (transformers 4.37's fp32 logits and their shifted copy); no allocated peak is "
        "published for the row to tell the allocator's cache from the step's tensors.",
    "QLoRA CPU offload bs12 ctx2048": "Near the card's limit (above): memest's replay under the card runs out "
        "before the step ends, also with the costs outside the allocator at the low end of their evidence, at 22.16 "
        "GiB reserved; the run completed and reserved 0.22 GiB more. The replay fragments more than the run did "
        "(the QLoRA batch 10 row's mechanism); no allocated peak is published for the row to tell the allocator's "
        "cache from the step's tensors.",
    "Llama-2 70B QLoRA CPU offload bs2 ctx2048": "Not isolated. The wrap is replayed (each 70B unit moved, "
        "broadcast, flattened and sharded on the GPU, then offloaded; its buckets pending at the high end); the run "
        "reserved 1.34 GiB more, 0.98 GiB above the range's top (2.05 GiB before the trace took transformers 4.37's "
        "model code: its fp32 logits and their shifted copy, and 320 MiB of fp32 rotary caches over 80 layers, moved "
        "in the wrap with their layers). Not the load: train.py's "
        "--low_memory load (its default) quantizes each layer on the GPU on rank 0 and places it on the CPU (meta on "
        "the other ranks), then calls torch.cuda.empty_cache() (train.py at 50efa1e, the commit that added the "
        "reserved_after_model_wrap logging the benchmark quotes), so nothing loaded stays reserved. The adapters are "
        "offloaded here, so their dtype does not count.",
    "Mistral 7B v0.2 QLoRA CPU offload bs12 ctx2048": "Both Mistral rows read exactly 22.54 GiB, the most the 24 GB "
        "card leaves the allocator once the context is in: the runs ran at the card's limit. memest's replay under "
        "the card runs out before the step ends (transformers 4.37's fp32 logits and their shifted copy, 2.9 GiB "
        "each at 12 x 2048 tokens, and the era's 1 GiB of fp32 rotary caches: Mistral v0.2's 32768 positions per "
        "layer), so its figure is the reserved it reached at the limit and its verdict 'tight', not 'fits'. The "
        "run may also have offloaded activations (--use_activation_cpu_offload is not stated for these rows).",
    "Table 2: FSDP 8, CP 1, seq 32768, full AC, torch.compile + Float8": "Not isolated: the run reserved 1.22 GiB "
        "more than memest's replay, 0.45 GiB above the range's top. memest's peak is the loss's backward (32768 x "
        "128256 logits: 15.7 GiB per fp32 tensor, three at once; train.py deletes the bf16 logits before backward). "
        "The model code counts here: with transformers' Llama in place of torchtitan's the row reads -5.5% (the "
        "same allocated peak within 0.4%, 3.4 GiB less reserved: the two models leave different blocks cached), where "
        "the Table 1 rows, the same toml at 8192 tokens, move by at most 0.3%.",
    "FSDP QLoRA 2 GPUs, no CPU offload": "Not isolated; the unit alone makes the measured 6.9% smaller (above). Traced "
        "as FSDP1 as peft's config runs it (whole wrapped units, the wrap with sync_module_states replayed before the "
        "step); the figure is the GPU monitor's over the whole run (load, training, evaluation, the final save), "
        "memest's is the training step's.",
    "DeepSpeed ZeRO-3 QLoRA 2x A100 40GB": "Not isolated; the unit alone makes the measured 6.9% smaller (above). "
        "DeepSpeed ZeRO-3 keeps up to stage3_max_live_parameters (1e9 by default) gathered and prefetches "
        "stage3_prefetch_bucket_size elements; memest gathers one decoder layer at a time (FSDP2's rule).",
    "FSDP QLoRA 2x24GB, CPU offload": lambda scored: "Not isolated. The figure is the GPU monitor's for the whole run (load, "
        "training, evaluation each epoch, the final save); memest's device figure is the training step's. With "
        "fsdp_cpu_ram_efficient_loading rank 0 loads the weights and FSDP broadcasts them (sync_module_states), which "
        "passes whole unsharded units through the GPU at load time. What offloading saves reads as the page states "
        "it: the same run without offload measured 35.6 GB, 16.0 GiB more; " + _offload_pair(scored),
    "DeepSpeed ZeRO-3 LoRA 8x H100 80GB": "Not isolated. DeepSpeed ZeRO-3's gathered-parameter budget "
        "(stage3_max_live_parameters 1e9, prefetch buckets) and its contiguous gradient partitions are not FSDP2's "
        "per-layer rule memest traces.",
}


def _environment(versions: dict) -> dict:
    from memest import __version__

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip()
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "memest": __version__, "commit": commit,
            "python": sys.version.split()[0], **versions}


def before_rows(scored: list[dict], before: dict) -> list[dict]:
    """Each scored row beside the same (group, label) row of an earlier run: its settings, figure and error."""
    earlier = {(r["group"], r["label"]): r for r in before["rows"]}
    out = []
    for r in scored:
        b = earlier.get((r["group"], r["label"]))
        out.append({"group": r["group"], "label": r["label"], "figure": r["figure"], "measured_bytes": r["measured_bytes"],
                    "before_bytes": None if b is None else b["memest_bytes"],
                    "before_error_pct": None if b is None else b["error_pct"],
                    "before_inside": None if b is None else b["inside"],
                    "before_spec": None if b is None else b["spec"],
                    "after_bytes": r["memest_bytes"], "after_error_pct": r["error_pct"], "after_inside": r["inside"]})
    return out


def render_before(data: dict, skipped: list[str]) -> str:
    lines = []
    if "before" in data:
        env = data["before"]["environment"]
        lines += ["", f"## Before and after (before: the run of {env['date']}, memest {env['commit']})", "",
                  "| group | run | figure | measured GiB | before GiB | before error | before inside | after GiB | "
                  "after error | after inside |", "|---|---|---|---:|---:|---:|---|---:|---:|---|"]
        for r in data["before"]["rows"]:
            def yes(v):
                return "-" if v is None else ("yes" if v else "no")
            b = "-" if r["before_bytes"] is None else _g(r["before_bytes"])
            be = "-" if r["before_error_pct"] is None else f"{r['before_error_pct']:+.1f}%"
            lines.append(f"| {r['group']} | {r['label']} | {r['figure']} | {_g(r['measured_bytes'])} | {b} | {be} | "
                         f"{yes(r['before_inside'])} | {_g(r['after_bytes'])} | {r['after_error_pct']:+.1f}% | "
                         f"{yes(r['after_inside'])} |")
    if skipped:
        lines += ["", "## Not retraced in this run", "", *[f"- {s}" for s in skipped]]
    return "\n".join(lines) + ("\n" if lines else "")


def trace_rows(rows: list[Row], cache_path: Path, *, no_cache: bool = False, cached_only: bool = False):
    """Trace (or read from the cache) and score each row: (scored, failed, not retraced, versions). A row memest
    refuses or cannot trace is reported in failed, never hidden."""
    code, versions = _source_hash(), _versions()
    cache = {} if no_cache or not cache_path.exists() else json.loads(cache_path.read_text())
    scored, failed, skipped = [], [], []
    for row in rows:
        key = cache_key(row, code, versions)
        if key not in cache and cached_only:
            from memest.errors import MemestError
            from memest.spec import RunSpec

            try:  # a row memest refuses fails here, without a trace
                RunSpec(**row.spec, compute_capability=row.card[2])
            except MemestError as exc:
                failed.append({"group": row.group, "label": row.label, "spec": row.spec,
                               "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"})
                continue
            skipped.append(f"{row.group} / {row.label}")
            continue
        if key not in cache:
            print(f"tracing {row.group} / {row.label} ...", file=sys.stderr, flush=True)
            try:
                cache[key] = trace_row(row)
            except Exception as exc:  # noqa: BLE001 - a row memest cannot trace is reported, not hidden
                failed.append({"group": row.group, "label": row.label, "spec": row.spec,
                               "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"})
                print(f"  failed: {failed[-1]['error']}", file=sys.stderr, flush=True)
                continue
            on_disk = json.loads(cache_path.read_text()) if cache_path.exists() else {}  # keep other runs' rows
            cache_path.write_text(json.dumps({**on_disk, **cache}, indent=1, sort_keys=True) + "\n")
            print(f"  {cache[key]['seconds']} s", file=sys.stderr, flush=True)
        scored.append(score(row, cache[key]))
    return scored, failed, skipped, versions


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="score only rows whose group or label contains this text")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-scale"),
                   help="output path without suffix (.json and .md are written)")
    p.add_argument("--no-cache", action="store_true", help="retrace every row")
    p.add_argument("--cache", default=str(CACHE), help="the per-row cache file (JSON)")
    p.add_argument("--cached-only", action="store_true",
                   help="score only the rows already traced at this code (the others are listed as not retraced)")
    p.add_argument("--before", default="", help="an earlier run's .json: each row's earlier figure beside this one's")
    args = p.parse_args(argv)
    os.chdir(ROOT)  # model paths in the rows are relative to the repository root (a stable cache key)

    rows = [r for make in GROUPS.values() for r in make()]
    if args.only:
        rows = [r for r in rows if args.only.lower() in f"{r.group} {r.label}".lower()]
    scored, failed, skipped, versions = trace_rows(rows, Path(args.cache), no_cache=args.no_cache,
                                                  cached_only=args.cached_only)
    env = _environment(versions)
    out = Path(args.out)
    if args.only or out != ROOT / "benchmarks" / "gpu-scale":  # a part of the table: the command that made it
        where = out.resolve().relative_to(ROOT) if out.resolve().is_relative_to(ROOT) else out
        env["command"] = ("python scripts/bench_gpu_scale.py" + (f" --only '{args.only}'" if args.only else "")
                          + f" --out {where}")
        env["raw"] = out.with_suffix(".json").name
    out.parent.mkdir(parents=True, exist_ok=True)
    before = json.loads(Path(args.before).read_text()) if args.before else None
    data = {"environment": env, "summary": {f: summary(scored, f) for f in ("reserved", "allocated", "device")},
            "rows": scored, "failed": failed, "not_scorable": NOT_SCORABLE, "not_retraced": skipped,
            **({"before": {"environment": before["environment"], "rows": before_rows(scored, before)}} if before else {})}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(scored, env, failed) + render_before(data, skipped))
    for f in ("reserved", "allocated", "device"):
        s = data["summary"][f]
        if s:
            print(f"{f}: {s['rows']} rows, median {s['median_abs_error_pct']:.2f}%, max {s['max_abs_error_pct']:.2f}%, "
                  f"inside {s['inside']}/{s['with_range']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
