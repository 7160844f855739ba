"""Issue 23 ("Proof", "Done when"): memest's uncalibrated figures against published GPU memory figures of the
recipes the reference trainers ship (op-level selective activation checkpointing, torch.compile, and the rest of
torchtune's memory-optimisation ladder).

The machinery is scripts/bench_gpu_scale.py's (rows, per-row cache keyed by memest's source and the library
versions, scoring by figure type, the misses' numbers); this script holds the rows, what is skipped and why, and
the markdown. Each row is a figure a public source states for a run whose settings it (or the trainer's pinned
config) states, scored with memest's figure of the same type:

  reserved   torch.cuda.max_memory_reserved (torchtitan logs reserved_bytes.all.peak) -> memest's reserved peak
  allocated  torch.cuda "active_bytes.all.peak" (torchtune's "Peak Memory Active") -> memest's allocated peak:
             active bytes are the allocated blocks plus any freed block a pending stream use keeps (none on one
             stream), so on one stream the two peaks are the same figure

memest never touches a GPU and is not calibrated here. Published runs whose settings memest cannot express, or
whose settings are not fully stated, are listed under "skipped" with the reason; no number is made up for them.

    python scripts/bench_gpu_recipes.py              # -> benchmarks/gpu-recipes.md and .json
    python scripts/bench_gpu_recipes.py --only torchtune --out /tmp/recipes

A full retrace took about 25 min on the shared 2-core machine (see each row's trace seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gpu_scale as scale  # noqa: E402  (the machinery: Row, trace_rows, summary, misses, _environment)

ROOT = scale.ROOT
CACHE = ROOT / "benchmarks" / "gpu-recipes-cache.json"
MiB, GiB = scale.MiB, scale.GiB
FIGURES = ("reserved", "allocated")

# --- sources -------------------------------------------------------------------------------------------------
TT_RUN = "9dec370ad26b5f8e9a7333a0e36165018262644b"  # the torchtitan commit the benchmark names (2024/12/26)
TT_BENCH = scale.TT_BENCH
TT_TOML = f"https://github.com/pytorch/torchtitan/blob/{TT_RUN}/train_configs/llama3_8b.toml"
TT_TRAIN = f"https://github.com/pytorch/torchtitan/blob/{TT_RUN}/train.py"
TT_PARALLEL = f"https://github.com/pytorch/torchtitan/blob/{TT_RUN}/torchtitan/parallelisms/parallelize_llama.py"
TT_CONFIG = f"https://github.com/pytorch/torchtitan/blob/{TT_RUN}/torchtitan/config_manager.py"
TUNE_README_AT = "1814feb17a9038e1a8053ce93111bd26774a8db6"  # the commit that added the optimisation table (#2003)
TUNE_README = f"https://github.com/meta-pytorch/torchtune/blob/{TUNE_README_AT}/README.md"
TUNE_RECIPE = f"https://github.com/meta-pytorch/torchtune/blob/{TUNE_README_AT}/recipes/full_finetune_single_device.py"
TUNE_CONFIG = (f"https://github.com/meta-pytorch/torchtune/blob/{TUNE_README_AT}/recipes/configs/llama3_2/"
               "3B_full_single_device.yaml")
TUNE_MODEL = f"https://github.com/meta-pytorch/torchtune/blob/{TUNE_README_AT}/torchtune/modules/transformer.py"
TUNE_COMPILE = f"https://github.com/meta-pytorch/torchtune/blob/{TUNE_README_AT}/torchtune/training/_compile.py"

# H100 96GB HBM2e (the benchmark's Grand Teton hosts): nvidia-smi's total for this card is not stated in any source
# found, so the card's capacity is left out (no verdict, no cap on the reserved replay); compute capability 9.0
# (NVIDIA's CUDA GPUs list, https://developer.nvidia.com/cuda-gpus)
H100_96 = ("H100 96GB HBM2e (capacity not stated)", None, (9, 0))
# "Hardware=A100": 40 or 80 GB not stated (the 60.0 GiB row needs the 80 GB card); compute capability 8.0
A100 = ("A100 (40/80 GB not stated)", None, (8, 0))

TT_SETUP = (f"torchtitan {TT_RUN[:7]} (torch 1963fc8, 2024/12/23), train_configs/llama3_8b.toml ({TT_TOML}): Llama 3.1 "
            "8B (torchtitan's model code), seq_len 8192, local batch 2 (the table), AdamW (foreach: optimizer.fused "
            "off by default), FSDP2 with MixedPrecisionPolicy param bfloat16 / reduce float32 (config_manager "
            "defaults), activation_checkpoint.mode 'selective' with selective_ac_option 'op' (the toml), grad-norm "
            "clip 1.0, no compile (but in the rows that say so), no Float8; the table's 'Memory(GiB)' is the logged "
            "max_reserved_gib "
            f"(train.py logs reserved_bytes.all.peak: {scale.TT_METRICS})")
TT_SPEC = dict(model="hf:llama-3.1-8b", batch=2, seq=8192, optim="adamw", precision="bf16-mixed", shard="zero3",
               checkpointing="selective", attention="flash", outputs="freed")
TT_NOTES = [
    "model code: transformers' LlamaForCausalLM with Llama 3.1 8B's config, not torchtitan's Llama (same shapes: "
    "separate wq/wk/wv, SwiGLU, RMSNorm; its rotary embedding is complex-valued where transformers' is cos/sin)",
    f"SAC policy: memest's is torchtitan's op list at b5bcd76 (memest/features/selective.py); the run's, at "
    f"{TT_RUN[:7]}, saves mm (every second one recomputed), SDPA and the reduce-scatter, the same rule ({TT_PARALLEL})",
    "train.py deletes the logits before backward ('need to free to before bwd to avoid peaking memory'): --outputs "
    f"freed ({TT_TRAIN})",
    "reshard_after_forward: torchtitan keeps the last block unsharded after forward (parallelize_llama.py: "
    "int(layer_id) < len(model.layers) - 1); memest reshards every block (FSDP2's default): one 8B block's bf16 "
    "weights, 0.41 GiB, are gathered again in memest's backward instead of held",
    "grad-norm clipping (max_norm 1.0) is not traced: its foreach norms are one fp32 scalar per parameter",
]

TUNE_SETUP = (f"torchtune README optimisation table ({TUNE_README}): recipe full_finetune_single_device, Llama 3.2 3B, "
              "batch 2, max sequence length 4096, bf16 (weights and AdamW states in bf16), one A100; 'Peak Memory "
              "Active (GiB)' (training.get_memory_stats: active_bytes.all.peak); each technique added to the previous "
              f"ones; config llama3_2/3B_full_single_device.yaml ({TUNE_CONFIG}) with the ladder's overrides")
TUNE_SPEC = dict(model="hf:benchmarks/configs/llama-3.2-3b.json", batch=2, seq=4096, optim="adamw", precision="bf16",
                 checkpointing="none", outputs="freed")
CHUNKED_LOSS = "scripts/models/llama32_3b_chunked_loss.py"  # relative to the repository root (main() chdirs there)
CHUNKED_COMPILED_LOSS = "scripts/models/llama32_3b_chunked_compiled_loss.py"
# torchtune compiles each layer (training.compile_model): --compile-scope blocks, and the loss's
# compute_cross_entropy (training.compile_loss): the chunked-loss model file with that function compiled
CHUNKED_SPEC = {**TUNE_SPEC, "model": CHUNKED_COMPILED_LOSS, "compile_scope": "blocks"}
TUNE_NOTES = [
    "config: benchmarks/configs/llama-3.2-3b.json (torchtune's llama3_2_3b shapes; benchmarks/configs/README.md)",
    "model code: transformers' LlamaForCausalLM; torchtune's TransformerDecoder returns fp32 logits "
    f"(self.output(h).float(), {TUNE_MODEL}) where transformers keeps bf16 logits and upcasts them in the loss",
    "packed: every row is 4096 tokens of packed samples; torchtune then uses FlexAttention with a block mask (A100, "
    "torch >= 2.5) where memest traces SDPA (flash on sm80): both save the output and the log-sum-exp",
    "optimizer: the ladder's baseline is torch.optim.AdamW (the QLoRA row's command overrides "
    "optimizer=torch.optim.AdamW keeping only lr), foreach by torch's default on CUDA; optimizer_in_bwd False, "
    "activation checkpointing off and plain cross-entropy until the rows that add them",
    f"the recipe deletes the logits before backward ('free logits otherwise it peaks backward memory', {TUNE_RECIPE})",
]


TT_COMPILE_NOTE = (
    f"compile: the rows 'with torch.compile' set training.compile true over the same toml; torchtitan {TT_RUN[:7]} "
    "then compiles each TransformerBlock after activation checkpointing wrapped it and before FSDP2 "
    "(parallelize_llama.py: apply_compile, torch.compile(transformer_block, fullgraph=True), Inductor defaults; the "
    f"loss compile is commented out in train.py; {TT_PARALLEL}): --compile-scope blocks, the embedding, norm, output "
    "projection and loss eager")


TT_FLOAT8 = {"compile_scope": "blocks", "fp8": "tensorwise", "fp8_all_gather": "float8-precomputed",
             "fp8_skip": "lm_head"}
TT_FLOAT8_NOTE = (
    f"Float8: torchtitan {TT_RUN[:7]}'s Float8Handler (torchtitan/float8.py): torchao's convert_to_float8_training "
    "with Float8LinearConfig(enable_fsdp_float8_all_gather=..., dynamic scaling: tensorwise) and module_filter_fn "
    "fqn != 'output' (the output projection stays bf16: --fp8-skip lm_head, transformers' name for it); the benchmark "
    "does not state the float8 FSDP flags: traced with those the repository's docs/float8.md at that commit launches "
    "with (--float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp: "
    "--fp8-all-gather float8-precomputed); the high-precision all-gather is in the Isolations table; conversion "
    "before activation checkpointing and compile (parallelize_llama.py), as memest orders them")


def tt_rows() -> list[scale.Row]:
    """torchtitan's Llama 3.1 8B H100 benchmark (end of 2024), the FSDP rows of Tables 1 and 3: eager, with
    torch.compile (each block compiled, --compile-scope blocks), and with torch.compile + Float8."""
    return [
        scale.Row("torchtitan llama-3.1-8b SAC", label, TT_BENCH, f"{gpus} H100 96GB; {TT_SETUP}",
                  {**TT_SPEC, "world_size": gpus, **extra}, H100_96, "reserved", round(gib * GiB),
                  list(TT_NOTES) + ([TT_COMPILE_NOTE] if extra else []) + ([TT_FLOAT8_NOTE] if "fp8" in extra else []))
        for label, gpus, gib, extra in (
            ("Table 1: FSDP 8 GPUs, selective AC (op)", 8, 82.4, {}),
            ("Table 3: FSDP 128 GPUs, selective AC (op)", 128, 67.0, {}),
            ("Table 1: FSDP 8 GPUs, selective AC (op), torch.compile", 8, 77.0, {"compile_scope": "blocks"}),
            ("Table 3: FSDP 128 GPUs, selective AC (op), torch.compile", 128, 62.0, {"compile_scope": "blocks"}),
            ("Table 1: FSDP 8 GPUs, selective AC (op), torch.compile + Float8", 8, 76.8, TT_FLOAT8),
            ("Table 3: FSDP 128 GPUs, selective AC (op), torch.compile + Float8", 128, 61.8, TT_FLOAT8))]


def torchtune_rows() -> list[scale.Row]:
    """torchtune's README optimisation ladder, the rows memest can express."""
    compile_note = ("torchtune compiles each decoder layer in place and the loss apart (training.compile_model: "
                    "every TransformerSelfAttentionLayer's m.compile(); compile_loss: torch.compile(loss); "
                    f"{TUNE_COMPILE}), the embedding, final norm, LM head and fp32 upcast run eager; traced with "
                    "--compile-scope blocks: each decoder layer compiled in place (Inductor defaults), the rest eager, "
                    "the loss too (transformers computes it inside forward; torchtune compiles it apart); the whole "
                    "step compiled as one graph is in the Isolations table")
    blocks_note = ("torchtune compiles each decoder layer in place and the loss apart (training.compile_model, "
                   f"training.compile_loss: {TUNE_COMPILE}); traced with --compile-scope blocks: each decoder layer "
                   "compiled in place (Inductor defaults), the embedding, final norm, LM head and the chunked loss eager "
                   "(the '+ Chunked Cross Entropy' row compiled the whole model before the model file was built with "
                   "use_cache=False: 43.71 GiB, +1.9%)")
    chunked_note = (f"model file {CHUNKED_COMPILED_LOSS} ({CHUNKED_LOSS} with its compute_cross_entropy compiled): "
                    "memest refuses --compile with --loss-head, so the chunked loss is written after the model, as "
                    "torchtune's recipe has it (the model returns bf16 logits, CEWithChunkedOutputLoss upcasts one "
                    "chunk at a time); its transformers Llama is built with use_cache=False, as memest's hf: source "
                    "builds it for training (with use_cache each block's cache index recompiled the shared block "
                    "forward); torchtune compiles compute_cross_entropy (one chunk's upcast and cross-entropy: "
                    f"training.compile_loss, {TUNE_COMPILE}) and so does the file (torch.compile of that function, "
                    "the chunking eager); traced with the loss eager before 2026-11-28 15:00 (the Isolations table)")
    ac_note = ("activation checkpointing: torchtune wraps each TransformerSelfAttentionLayer in torch's "
               "checkpoint_wrapper (training.set_activation_checkpointing -> apply_activation_checkpointing, "
               f"non-reentrant) after compiling it ({TUNE_RECIPE}: compile_model, then set_activation_checkpointing), "
               "so the checkpoint runs eager around the compiled layer; memest's --checkpointing blocks wraps each "
               "decoder layer (non-reentrant) and compiles the wrapper with it (torchtitan's order): the same tensors "
               "kept, each layer's input")
    oib_note = ("optimizer_in_bwd: torchtune's register_optim_in_bwd_hooks, one AdamW per parameter stepped in its "
                "post-accumulate-grad hook (memest --optim-in-backward); the hooks run eager after each compiled "
                "layer's backward, as under --compile-scope blocks")
    offload_note = ("activation offloading: the recipe's get_act_offloading_ctx_manager(model, True) around the "
                    "model's forward (torchtune's OffloadActivations with use_streams=True, pinned host memory, "
                    "min_offload_size 1024 B, max_fwd_stash_size 5; the output head under a NoOpManager); memest "
                    "--activation-offload torchtune runs torchtune 0.6.1's rules "
                    "(torchtune/training/_activation_offloading.py, PyPI wheel torchtune-0.6.1; the ladder's run used "
                    "the torchtune of its day, v0.4-v0.5: the class's version is not stated), proven to the byte "
                    "against the copied class on real CPU steps (tests/test_torchtune_offload.py); the streams' "
                    "timing (a freed block a pending copy still holds) is not modelled; the transformers head "
                    "(lm_head) stands for torchtune's model.output")
    return [
        scale.Row("torchtune llama-3.2-3b ladder", "+ Packed Dataset (eager, the ladder's base)", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: packed dataset, no compile", dict(TUNE_SPEC), A100, "allocated",
                  round(60.0 * GiB), TUNE_NOTES + ["not a recipe technique itself: the eager base the next row "
                                                   "compiles, scored to separate the model from the technique"]),
        scale.Row("torchtune llama-3.2-3b ladder", "+ Compile", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: packed dataset + compile=True", {**TUNE_SPEC, "compile_scope": "blocks"},
                  A100, "allocated", round(51.0 * GiB), TUNE_NOTES + [compile_note]),
        scale.Row("torchtune llama-3.2-3b ladder", "+ Chunked Cross Entropy", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: packed dataset + compile=True + "
                  "loss=torchtune.modules.loss.CEWithChunkedOutputLoss (8 chunks)", dict(CHUNKED_SPEC), A100,
                  "allocated", round(42.9 * GiB), TUNE_NOTES[:1] + TUNE_NOTES[2:] + [blocks_note, chunked_note]),
        scale.Row("torchtune llama-3.2-3b ladder", "+ Activation Checkpointing", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: the previous + enable_activation_checkpointing=True",
                  {**CHUNKED_SPEC, "checkpointing": "blocks"}, A100, "allocated", round(24.9 * GiB),
                  TUNE_NOTES[:1] + TUNE_NOTES[2:] + [blocks_note, chunked_note, ac_note]),
        scale.Row("torchtune llama-3.2-3b ladder", "+ Fuse optimizer step into backward", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: the previous + optimizer_in_bwd=True",
                  {**CHUNKED_SPEC, "checkpointing": "blocks", "optim_in_backward": True}, A100, "allocated",
                  round(23.1 * GiB), TUNE_NOTES[:1] + TUNE_NOTES[2:] + [blocks_note, chunked_note, ac_note, oib_note]),
        scale.Row("torchtune llama-3.2-3b ladder", "+ Activation Offloading", TUNE_README,
                  f"A100; {TUNE_SETUP}; this row: the previous + enable_activation_offloading=True",
                  {**CHUNKED_SPEC, "checkpointing": "blocks", "optim_in_backward": True,
                   "activation_offload": "torchtune"}, A100, "allocated", round(21.8 * GiB),
                  TUNE_NOTES[:1] + TUNE_NOTES[2:] + [blocks_note, chunked_note, ac_note, oib_note, offload_note]),
    ]


GROUPS = {"torchtitan": tt_rows, "torchtune": torchtune_rows}

TITAN_9DEC370 = "scripts/models/titan_llama3_9dec370.py"
EAGER_LOSS = "scripts/models/llama32_3b_eager_loss.py"


def isolation_rows() -> list[scale.Row]:
    """The same published run traced with one difference from its scored row changed: not scored (the published
    figure would count twice); the table shows how far that difference moves memest's figures."""
    return [scale.Row("isolation: model code", "Table 1 traced with torchtitan 9dec370's Llama 3.1 8B", TT_BENCH,
                      f"8 H100 96GB; {TT_SETUP}", {**TT_SPEC, "model": TITAN_9DEC370, "world_size": 8}, H100_96,
                      "reserved", round(82.4 * GiB),
                      [f"{TITAN_9DEC370}: torchtitan's model code at {TT_RUN[:7]} (grouped-query attention with "
                       "repeat_kv, its fp32-upcasting RMSNorm, complex RoPE, train.py's loss) in place of "
                       "transformers' LlamaForCausalLM"]),
            scale.Row("isolation: model code", "Table 1 with torch.compile traced with torchtitan 9dec370's Llama 3.1 "
                      "8B", TT_BENCH, f"8 H100 96GB; {TT_SETUP}",
                      {**TT_SPEC, "model": TITAN_9DEC370, "world_size": 8, "compile_scope": "blocks"}, H100_96,
                      "reserved", round(77.0 * GiB),
                      [f"{TITAN_9DEC370} in place of transformers' LlamaForCausalLM, each of its blocks compiled "
                       "(--compile-scope blocks), as the compiled Table 1 row"]),
            *[scale.Row("isolation: loss outside the compiled graph", label, TUNE_README, f"A100; {TUNE_SETUP}",
                        {**TUNE_SPEC, "model": EAGER_LOSS, **extra}, A100, "allocated", round(gib * GiB),
                        [f"{EAGER_LOSS}: the model returns bf16 logits; their fp32 upcast and the cross-entropy run "
                         "after it, eager (torchtune compiles its loss: here it is not)"])
              for label, extra, gib in (("+ Packed Dataset, the loss after the model (eager)", {}, 60.0),
                                        ("+ Compile, the loss after the compiled model", {"compile": True}, 51.0))],
            scale.Row("isolation: compile scope", "+ Compile, the whole step compiled as one graph (--compile-scope "
                      "step)", TUNE_README, f"A100; {TUNE_SETUP}", {**TUNE_SPEC, "compile": True}, A100, "allocated",
                      round(51.0 * GiB), ["what the '+ Compile' row read before --compile-scope blocks existed: "
                                          "transformers' loss inside forward is fused into the one compiled graph"]),
            scale.Row("isolation: float8 all-gather", "Table 1 with torch.compile + Float8, the high-precision "
                      "all-gather", TT_BENCH, f"8 H100 96GB; {TT_SETUP}",
                      {**TT_SPEC, "world_size": 8, **TT_FLOAT8, "fp8_all_gather": "high-precision"}, H100_96,
                      "reserved", round(76.8 * GiB),
                      ["--fp8-all-gather high-precision: torchtitan's default (enable_fsdp_float8_all_gather false), "
                       "where the scored row follows its docs/float8.md launch command; the benchmark states neither"]),
            scale.Row("isolation: AdamW kernel", "+ Activation Checkpointing, AdamW fused (fused=True)", TUNE_README,
                      f"A100; {TUNE_SETUP}", {**CHUNKED_SPEC, "checkpointing": "blocks", "fused": True}, A100,
                      "allocated", round(24.9 * GiB),
                      ["torch.optim.AdamW(fused=True) in place of torch's CUDA default (foreach): the ladder does not "
                       "state the full-finetune rows' optimizer settings; the QLoRA config its last command runs sets "
                       "fused: True (recipes/configs/llama3_2/3B_qlora_single_device.yaml at "
                       f"{TUNE_README_AT[:7]}); the fused kernel makes no list-wide temporaries"]),
            *[scale.Row("isolation: loss eager", f"{label}, compute_cross_entropy eager", TUNE_README,
                        f"A100; {TUNE_SETUP}", {**CHUNKED_SPEC, "model": CHUNKED_LOSS, **extra}, A100, "allocated",
                        round(gib * GiB),
                        [f"{CHUNKED_LOSS}: the chunked loss's compute_cross_entropy (one chunk's fp32 upcast and "
                         "cross-entropy) eager, where torchtune compiles it (training.compile_loss) and the scored row "
                         f"traces it compiled ({CHUNKED_COMPILED_LOSS}); both file shapes checked against the real "
                         "compiled step on CPU (tests/test_compile_blocks.py, bf16 tiny Llama: traced and real agree "
                         "to the byte with the loss compiled and eager)"])
              for label, extra, gib in (
                  ("+ Chunked Cross Entropy", {}, 42.9),
                  ("+ Activation Checkpointing", {"checkpointing": "blocks"}, 24.9),
                  ("+ Fuse optimizer step into backward", {"checkpointing": "blocks", "optim_in_backward": True}, 23.1),
                  ("+ Activation Offloading", {"checkpointing": "blocks", "optim_in_backward": True,
                                               "activation_offload": "torchtune"}, 21.8))]]

SKIPPED = [  # published figures of these recipes not scored, and why (no number is made up for them)
    dict(source=TUNE_README, runs="'+ 8-bit AdamW' 17.6 GiB (active)",
         why="the 8-bit AdamW is not named: the README says 'AdamW8bit' and links the memory-optimisations "
             "tutorial, which offers bitsandbytes' AdamW8bit / PagedAdamW8bit and torchao's AdamW8bit (different "
             "state layouts and, for the paged one, unified memory); the '+ Activation Offloading' row before it is "
             "scored"),
    dict(source=TUNE_README, runs="'LoRA' 8.5, 'QLoRA' 4.6 GiB (active)",
         why="not transcribed yet: the LoRA row's adapter settings (recipes/configs/llama3_2/3B_lora_single_device"
             ".yaml at the README's commit: which projections, rank, alpha, the LoRA recipe's own step) are not yet "
             "checked against memest's --lora, and QLoRA quantizes the base weights with torchao's NF4Tensor "
             "(torchtune's FrozenNF4Linear, its own dequantize in forward and backward) where memest's --quant nf4 "
             "traces bitsandbytes' Linear4bit; --activation-offload torchtune, which both rows use, is offered now"),
    dict(source=TUNE_README, runs="'Baseline' 25.5 GiB (active)",
         why="unpacked alpaca rows: the sequence length of the peak batch is not stated (padded to the batch's "
             "longest sample, at most 4096)"),
    dict(source=TUNE_README, runs="Llama 3.1 8B/70B/405B full, LoRA, QLoRA: 7.4-44.8 GiB 'Peak Memory per GPU'",
         why="compile on and the configs' defaults (optimizer_in_bwd, PagedAdamW8bit, CPU offload for 70B) with "
             "compile; the figure type is not stated"),
    dict(source=TT_BENCH, runs="Table 2 (FSDP x CP, 32k-256k tokens), Tables 4-6 (70B, 405B with TP/PP)",
         why="torch.compile and Float8 on in every row (AsyncTP too in 4-6)"),
    dict(source="https://github.com/pytorch/ao/pull/1629",
         runs="Llama 3 8B on 8 H100 (torchtitan), float8 rowwise: 67 -> 59 GiB with the FSDP workaround",
         why="the toml, compile and activation-checkpointing settings of the run are not stated (memest traces "
             "float8 under FSDP2 but refuses it with --compile)"),
    dict(source=scale.TT_H200, runs="Llama 3.1 8B FSDP on 32 / 64 H200: 47.96 / 46.97 GiB",
         why="torch.compile + Float8 with float8 all-gather"),
    dict(source="https://github.com/pytorch/torchtitan/pull/97",
         runs="Llama 7B, full AC vs selective AC: 'Reserved 40.61%, Alloc 28.12%' / 'Reserved 80.45%, Alloc 62.0%'",
         why="percentages of a card the PR does not name; batch, sequence length and GPU count not stated"),
    dict(source="https://github.com/pytorch/torchtitan/pull/996",
         runs="Llama3-8B, torchtitan's cross-entropy 49.58 GiB vs a chunked one 42.26 GiB (reserved)",
         why="GPU count, batch and sequence length not stated in the PR; its chunked loss was removed again "
             "(pytorch/torchtitan#1033), so the code that ran is not a release"),
    dict(source="https://github.com/meta-pytorch/torchtune/pull/527",
         runs="Llama-2 7B full single device, PagedAdamW + optimizer in backward: 13.99 GB allocated, 15.97 reserved",
         why="alpaca without packing: the sequence length of the peak batch is not stated"),
    dict(source="https://github.com/meta-pytorch/torchtune/pull/1530",
         runs="llama2/7B_full distributed, optimizer in backward: 31.5 -> 21.2 GB",
         why="GPU count, sequence length (unpacked alpaca) and figure type not stated"),
]

_TT_STREAMS = (
    "Until a81bcd4 memest read 2-8% below these four runs and outside its range: its caching-allocator replay kept "
    "one pool for every CUDA stream, while FSDP2 all-gathers on its copy-in stream and reduce-scatters on another (the "
    "fp32 gradient shards are views of the reduce-scatter output) and the real allocator re-uses a freed block only on "
    "its own stream. Replayed per stream (memest/device/allocator.py), the four rows moved to within 0.8%. Other "
    "candidates named before, none isolated: torchtitan keeps the last block unsharded after forward (+0.41 GiB at the "
    "loss, see the notes); the peak op (memest's is the log-softmax backward of the loss, the fp32 logits of 2 x 8192 "
    "tokens x 128256 are 7.83 GiB each; the run's is not stated). Ruled out by a trace: the model code (transformers' "
    "Llama in place of torchtitan's), the Isolations table.")
_TT_COMPILE = (
    "With compile: memest's compiled blocks hold 5.87 GiB less than its eager row at the same peak (the loss's "
    "log-softmax backward, iteration 2), on 8 and on 128 GPUs alike; the run's reserved figure drops {run} with "
    "compile on {gpus} GPUs, so all but {rest} GiB of this row's gap is the eager row's (above). That rest is in what "
    "the compiled blocks save, not isolated: memest lowers each block's graph for CPU tensors (C++ kernels and CPU "
    "fusion rules; the H100 run generates Triton kernels, whose buffers can differ). Ruled out by a trace: the model "
    "code (torchtitan 9dec370's own Llama compiled per block reads 71.04 GiB on 8 GPUs, +0.20 GiB over transformers' "
    "Llama, the Isolations table). The run's own compile saving "
    "differs by 0.4 GiB between its 8- and 128-GPU tables, where the activations a rank saves do not depend on the "
    "GPU count, so part of the rest is the run's allocator, not the compiled graph.")
CAUSES: dict[str, str] = {
    "Table 1: FSDP 8 GPUs, selective AC (op)": _TT_STREAMS + (
        " The run's drop from 8 to 128 GPUs is 15.4 GiB (82.4 -> 67.0); memest's is 11.2 GiB, of which 10.5 is the "
        "fp32 parameter and AdamW shards (1/8 -> 1/128 of 8.03B x 12 B). The 4.2 GiB rest of the run's drop also "
        "shrinks with the shard count, which fits sharded state memest does not hold at its peak, e.g. the fp32 "
        "gradient shards (3.74 GiB per rank at 8 GPUs) if the run's peak falls where they exist (inferred, not "
        "isolated); the 128-GPU row, where shards are small, is within 2.3%."),
    "Table 3: FSDP 128 GPUs, selective AC (op)": _TT_STREAMS,
    "Table 1: FSDP 8 GPUs, selective AC (op), torch.compile": _TT_STREAMS + " " + _TT_COMPILE.format(
        gpus=8, run="5.4 GiB (82.4 -> 77.0)", rest="0.47"),
    "Table 3: FSDP 128 GPUs, selective AC (op), torch.compile": _TT_STREAMS + " " + _TT_COMPILE.format(
        gpus=128, run="5.0 GiB (67.0 -> 62.0)", rest="0.87"),
    "+ Compile": (
        "Traced per layer (--compile-scope blocks), as torchtune compiles. Before that option memest compiled the "
        "whole step and read -15.3%; the Isolations table keeps that trace. Isolated by a trace (the Isolations table). The eager row before it is within 3.5%, so the miss is in what "
        "compile saves: the run's compile takes 9.0 GiB off the eager step (60.0 -> 51.0), memest's 14.7 GiB (57.92 "
        "-> 43.21). memest compiles the whole step as one graph, and transformers computes the loss inside forward, "
        "so the LM head's fp32 upcast and the cross-entropy are fused in it; torchtune compiles each decoder layer "
        "and the loss apart, and its model makes the fp32 logits eagerly between them (self.output(h).float()), the "
        "input the loss saves and whose gradient backward makes: 2 x 4096 x 128256 x 4 B = 3.91 GiB each, 7.83 GiB "
        "for the two, the size of the gap (7.79 GiB). Traced with the upcast and the loss after the compiled model "
        f"({EAGER_LOSS}, --compile), memest's figure is the Isolations table's; the rest of the difference is the "
        "loss itself (eager there, compiled by torchtune) and the per-layer graphs."),
    "+ Activation Checkpointing": (
        "Isolated by a trace (the Isolations table). memest's peak is the optimizer step of iteration 1 "
        "(_foreach_sqrt): torch's foreach AdamW (_multi_tensor_adamw, CUDA's default) makes exp_avg_sq.sqrt() for "
        "every parameter at once, one bf16 copy of a state, 3.21B x 2 B = 5.98 GiB, on top of the bf16 parameters, "
        "gradients and two AdamW states (23.9 GiB); the run's 24.9 GiB leaves no room for it. The ladder does not "
        "state the full-finetune rows' optimizer settings (the QLoRA config of its last command sets fused: True); "
        "traced with AdamW fused=True memest reads 25.42 GiB (+2.1%), its peak then in iteration 2's backward."),
}


# --- markdown ------------------------------------------------------------------------------------------------
def render(scored: list[dict], env: dict, failed: list[dict]) -> str:
    lines = ["# Published GPU memory of the 2026 training recipes: memest uncalibrated (issue 23)", "",
             f"Scored {env['date']} with memest {env['memest']} ({env['commit']}), torch {env['torch']}, transformers "
             f"{env['transformers']}, on a CPU (memest never touches a GPU; no calibration). Reproduce: `python "
             "scripts/bench_gpu_recipes.py` (raw: gpu-recipes.json; the machinery is scripts/bench_gpu_scale.py's).",
             "", "Each row is a figure a public source states, with the settings it (or the trainer's config at the "
             "run's commit) states; memest's figure is the one of the same type: reserved = `max_memory_reserved` "
             "(memest's caching-allocator replay, range = its measured band), allocated = `max_memory_allocated` "
             "(torchtune's 'Peak Memory Active' is `active_bytes.all.peak`, the same figure on one stream). No GPU "
             "figure here is memest's: every measured number is the source's.", "",
             "Goal (issue 23): median |error| <= 10% on reproducible published rows of these recipes.", "",
             "| figure | rows | median \\|error\\| | max \\|error\\| | inside range |", "|---|---:|---:|---:|---:|"]
    for figure in FIGURES:
        s = scale.summary(scored, figure)
        if s:
            inside = f"{s['inside']}/{s['with_range']}" if s["with_range"] else "-"
            lines.append(f"| {figure} | {s['rows']} | {s['median_abs_error_pct']:.2f}% | {s['max_abs_error_pct']:.2f}% "
                         f"| {inside} |")
    errors = [abs(r["error_pct"]) for r in scored]
    if errors:
        lines.append(f"| all | {len(errors)} | {statistics.median(errors):.2f}% | {max(errors):.2f}% | - |")
    lines += ["", "## Rows", ""] + scale.rows_table(scored)
    lines += ["", "## Settings and notes", ""]
    for group in dict.fromkeys(r["group"] for r in scored):
        lines.append(f"- **{group}**: " + next(r["setup"] for r in scored if r["group"] == group))
    lines += ["", "Per row, what memest traces differently from the run:", ""]
    lines += [f"- {r['group']} / {r['label']}: " + "; ".join(r["notes"]) for r in scored]
    lines += ["", "## Misses and their causes (|error| > 5% or outside the range)", ""] + scale.misses(scored, CAUSES)
    if failed:
        lines += ["", "## Rows memest could not trace", ""] + [f"- {f['group']} / {f['label']}: {f['error']}"
                                                                for f in failed]
    lines += ["", "## Skipped: published figures of these recipes not scored", "",
              "| source | runs and stated memory | why skipped |", "|---|---|---|"]
    lines += [f"| [{s['source'].split('github.com/')[-1].split('/blob/')[0]}]({s['source']}) | {s['runs']} | {s['why']} |"
              for s in SKIPPED]
    return "\n".join(lines) + "\n"


def render_isolations(iso: list[dict], scored: list[dict]) -> str:
    if not iso:
        return ""
    lines = ["", "## Isolations (memest against memest: one difference from a scored row changed, not scored)", "",
             "| isolation | run | memest allocated GiB | memest reserved GiB | the scored row's allocated / reserved GiB | "
             "published GiB | settings traced |", "|---|---|---:|---:|---|---:|---|"]
    for r in iso:
        base = next((b for b in scored if b["source"] == r["source"] and b["measured_bytes"] == r["measured_bytes"]),
                    None)
        was = "-" if base is None else f"{scale._g(base['memest']['allocated'])} / {scale._g(base['memest']['reserved'])}"
        lines.append(f"| {r['group']} | {r['label']} | {scale._g(r['memest']['allocated'])} | "
                     f"{scale._g(r['memest']['reserved'])} | {was} | {scale._g(r['measured_bytes'])} | "
                     f"`{scale._compact(r['spec'])}` |")
    lines += [""] + [f"- {r['label']}: " + "; ".join(r["notes"]) for r in iso]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="score only rows whose group or label contains this text")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-recipes"),
                   help="output path without suffix (.json and .md are written)")
    p.add_argument("--no-cache", action="store_true", help="retrace every row")
    p.add_argument("--cache", default=str(CACHE), help="the per-row cache file (JSON)")
    p.add_argument("--cached-only", action="store_true", help="score only the rows already traced at this code")
    args = p.parse_args(argv)
    scale.os.chdir(ROOT)  # model paths in the rows are relative to the repository root (a stable cache key)
    rows = [r for make in GROUPS.values() for r in make()]
    if args.only:
        rows = [r for r in rows if args.only.lower() in f"{r.group} {r.label}".lower()]
    scored, failed, skipped, versions = scale.trace_rows(rows, Path(args.cache), no_cache=args.no_cache,
                                                         cached_only=args.cached_only)
    isolations = [r for r in isolation_rows() if not args.only or args.only.lower() in f"{r.group} {r.label}".lower()]
    iso_scored, iso_failed, iso_skipped, _ = scale.trace_rows(isolations, Path(args.cache), no_cache=args.no_cache,
                                                              cached_only=args.cached_only)
    failed, skipped = failed + iso_failed, skipped + iso_skipped
    env = scale._environment(versions)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"environment": env, "summary": {f: scale.summary(scored, f) for f in FIGURES}, "rows": scored,
            "failed": failed, "skipped": SKIPPED, "not_retraced": skipped, "isolations": iso_scored}
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(scored, env, failed) + render_isolations(iso_scored, scored)
                                      + ("".join(f"\n- not retraced: {s}" for s in skipped) + "\n" if skipped else ""))
    for f in FIGURES:
        s = data["summary"][f]
        if s:
            print(f"{f}: {s['rows']} rows, median {s['median_abs_error_pct']:.2f}%, max {s['max_abs_error_pct']:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
