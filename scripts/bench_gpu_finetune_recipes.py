"""Issue 24 ("Proof", published figures): memest's uncalibrated figures against published GPU memory figures of the
fine-tuning recipes issue 24 asked for: preference training (trl DPO/ORPO/KTO/SimPO/CPO, `--preference`), GRPO
(`--preference grpo`) and vision-language inputs (`--images`); FSDP-QLoRA, the fourth, is scored in
benchmarks/gpu-scale.md and its rows are summarised here from benchmarks/gpu-scale.json (not retraced).

The machinery is scripts/bench_gpu_scale.py's (its Row, cache key, trace, scoring and summary, imported, not
copied): a row is a figure a public source states for a run whose settings it also states in full, scored with
memest's figure of the same type (reserved = torch.cuda.max_memory_reserved, allocated = max_memory_allocated,
device = nvidia-smi / the GPU monitor).

A published figure is scored only when everything memest needs to trace the step is stated: model (a config that
is bundled or pinned), precision, batch, every sequence length (prompt, chosen/rejected, completion; image sizes),
the trainer's settings that change memory, and the figure's type. Preference, RL and VLM runs read their lengths
from a data set (padded per batch, truncated at a maximum), so most published figures are of runs whose shapes are
data-dependent; those are listed under NOT_SCORABLE with what is missing, and no number is made up for them.
Where the stored sources are only partly readable (an issue thread cut short in the stored copy), that is said.

    python scripts/bench_gpu_finetune_recipes.py          # -> benchmarks/gpu-finetune-recipes.md and .json

Searched (2026-11-27, this session's stored copies of GitHub issues, docs and pages; fetched snapshots of
huggingface/trl at f2cd577 and read hiyouga/LlamaFactory README at 142e1ce, modelscope/ms-swift examples): the trl
threads the issue names (#3168, #5200) and their neighbours (#3456, #3678), trl's docs ("Reducing memory usage":
no figures, only charts) and example notebooks (one prints a peak for a recipe memest offers; the Qwen3-VL SFT
notebook's memory cells have no saved output), LLaMA-Factory's README table
and #10175, ms-swift's RLHF example scripts, Qwen-VL fine-tuning threads (QwenLM/Qwen3-VL #938, #958), unsloth's
GRPO post. LLaMA-Factory #7099 and 2U1/Qwen-VL-Series-Finetune #51 (named in the issue) did not come up in the
stored issue corpus.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_scale import (  # noqa: E402 - the sibling script's machinery
    ROOT,
    Row,
    _environment,
    _g,
    _source_hash,
    _versions,
    cache_key,
    score,
    summary,
    trace_row,
)

CACHE = ROOT / "benchmarks" / "gpu-finetune-recipes-cache.json"
SCALE_JSON = ROOT / "benchmarks" / "gpu-scale.json"
FIGURES = ("reserved", "allocated", "device")

# --- sources (pinned where the source is a repository) -------------------------------------------------------
TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
TRL_GRPO_NB = f"https://github.com/huggingface/trl/blob/{TRL_COMMIT}/examples/notebooks/grpo_trl_lora_qlora.ipynb"
TRL_MEMORY_DOC = f"https://github.com/huggingface/trl/blob/{TRL_COMMIT}/docs/source/reducing_memory_usage.md"
LF_README = "https://github.com/hiyouga/LlamaFactory/blob/142e1ce4a0f99a05e11f2b1f10fb384c7eb49892/README.md"
SWIFT_DPO_LORA = ("https://github.com/modelscope/ms-swift/blob/2b631802bbfb8ea6719ffe4a14830e5fb638a331/examples/train/"
                  "rlhf/dpo/lora.sh")
SWIFT_DPO_FULL = ("https://github.com/modelscope/ms-swift/blob/09b2151682771e6d94895c3954280459f2bd2bf6/examples/train/"
                  "rlhf/dpo/full.sh")


def recipe_rows() -> list[Row]:
    """Published figures of issue 24's recipes with every setting stated: none found (NOT_SCORABLE says why for
    each candidate). A row added here is traced, cached and scored like bench_gpu_scale.py's rows."""
    return []


NOT_SCORABLE = [  # published figures for issue 24's recipes that cannot be scored: evidence, no figure made up
    dict(recipe="dpo", source="https://github.com/huggingface/trl/issues/5200",
         runs="Qwen2.5-0.5B DPO, trl 0.12.0, 4-bit nf4 with double quantization (fp16 compute), flash_attention_2, "
              "LoRA r64/alpha32/dropout0.1 on q,k,v,o,gate,up,down, prepare_model_for_kbit_training; synthetic pairs "
              "(prompt 'you are person' x 500, chosen '1', rejected '0'): '17GB'",
         figure="not stated ('GB', no tool named)",
         missing="the DPOConfig (batch, max_length / max_prompt_length, fp16/bf16, gradient checkpointing) is not in "
                 "the stored copy of the thread, which ends at prepare_model_for_kbit_training; the prompt's token "
                 "count needs Qwen2.5's tokenizer (not available offline) and trl 0.12's truncation settings",
         spec=dict(preference="dpo", quant="nf4", double_quant=True,
                   lora="r=64,alpha=32,dropout=0.1,targets=k_proj,gate_proj,v_proj,up_proj,q_proj,o_proj,down_proj",
                   prepare_kbit=True, batch=1, seq=1000)),
    dict(recipe="dpo", source="https://github.com/huggingface/trl/issues/3168",
         runs="Qwen2.5-0.5B-Instruct, trl's DPO quick start (DPOConfig defaults, model loaded in fp32, reference a "
              "second copy) on an A100 80GB: out of memory at step 0; the bf16 runs' GPU use only as screenshots",
         figure="an outcome (OOM), and screenshots whose numbers are not in the text",
         missing="the trl version (so DPOConfig's defaults: batch, max_length, precision) is not stated by the "
                 "reporter (the DPOConfig printed in the thread is another user's run); UltraFeedback pairs are "
                 "padded to the longest in each batch, so the failing batch's length is unknown",
         spec=dict(preference="dpo", reference="copy", precision="fp32")),
    dict(recipe="dpo", source="https://github.com/huggingface/trl/pull/5926",
         runs="a trl PR's benchmark (merged 2026-06-03, in trl from v1.6.0): Qwen2.5-0.5B-Instruct, bf16, batch 4, "
              "max_length 512, precompute_ref_log_probs False (a second copy as reference), 3 steps, 'A100 44GB': "
              "peak memory 18289 MB before the PR, 15531 MB after",
         figure="not stated ('Peak memory', MB)",
         missing="the reproduce script (data set, so whether every batch reaches 512 tokens; gradient checkpointing; "
                 "which peak it reads) is in a collapsed block the stored copy of the PR does not hold; 'A100 44GB' "
                 "is no A100 model, so the card is uncertain",
         spec=dict(preference="dpo", reference="copy", precision="bf16", batch=4, seq=512)),
    dict(recipe="grpo", source="https://github.com/huggingface/trl/issues/3456",
         runs="GRPO, per-device batch 4, max_prompt_length 2048, max_completion_length 1024: Qwen3-0.6B "
              "49273 MiB / 81920 MiB, Qwen3-1.7B 78147 MiB / 81920 MiB (A100 80GB)",
         figure="device (nvidia-smi's format)",
         missing="num_generations, vLLM or not, model dtype, gradient checkpointing and the trl version are not "
                 "stated; prompts (up to 2500 tokens, truncated) and completions (stop at EOS) are data-dependent; "
                 "Qwen3-0.6B's and 1.7B's configs are not bundled"),
    dict(recipe="grpo", source="https://github.com/huggingface/trl/issues/3678",
         runs="a comment's measurement on one H100: trl-internal-testing/tiny-Qwen2ForCausalLM-2.5, B=2, "
              "logits_to_keep=256, bf16: peak allocated 902 MB across _get_per_token_logps_and_entropies, 44 MB "
              "before it",
         figure="allocated, of one log-prob forward (not a training step)",
         missing="the prompt length is not stated; the tiny test model's config is not bundled; the stated logits "
                 "size (310 MB for 2 x 256 x 151665 in bf16) is twice that product in bf16 (155 MB), so the measured "
                 "tensor's dtype is unclear; memest reports a step's peak, not one forward's"),
    dict(recipe="grpo", source=TRL_GRPO_NB,
         runs="trl's GRPO QLoRA notebook: Qwen2-7B-Instruct on a Tesla T4, nf4 + double quantization (fp16 compute), "
              "model dtype float32, sdpa, LoRA r32/alpha32 on 7 projections, per-device batch 8, num_generations 8, "
              "max_completion_length 256, paged_adamw_8bit, use_liger_kernel, 500 steps: 'Peak reserved memory = "
              "8.832 GB' (torch.cuda.max_memory_reserved / 1024^3, so GiB; 6.773 GiB before training); its table: "
              "~9.2 GB (T4), 9.6 GB (A100), naive FP16 62 GB (A100 80GB)",
         figure="reserved (the printed peak); the table's type is not stated",
         missing="prompt lengths come from AI-MO/NuminaMath-TIR (500 prompts drawn over the run; the data set and "
                 "Qwen2's tokenizer are not available offline) and completions stop at EOS, so the longest step's "
                 "shapes are unknown; the peak is the process's over loading and 500 steps; Qwen2-7B's config is "
                 "not bundled; memest does not trace GRPO with --loss-head yet (--quant and --checkpointing: traced since the grpo30 merge)",
         spec=dict(preference="grpo", quant="nf4", double_quant=True, precision="fp32",
                   lora="r=32,alpha=32,dropout=0.0,targets=q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", batch=8, generations=8, completion_len=256, optim="paged-adamw-8bit",
                   loss_head="fused")),
    dict(recipe="dpo", source=SWIFT_DPO_LORA,
         runs="ms-swift example: Qwen2.5-7B-Instruct DPO, LoRA r8/alpha32 all-linear, batch 1 (accumulation 16), "
              "max_length 2048, bf16, rpo_alpha 0.1: '# 24GiB'",
         figure="not stated (a comment; ms-swift logs memory(GiB) but the script does not say which)",
         missing="pairs from hjh0119/shareAI-Llama3-DPO-zh-en-emoji padded per batch (length data-dependent); the card "
                 "and gradient checkpointing are not stated; rpo_alpha adds an NLL term on the chosen logits that "
                 "memest's DPO step (trl's sigmoid loss) does not trace",
         spec=dict(preference="dpo", precision="bf16", lora="r=8,alpha=32,targets=all-linear", batch=1, seq=2048)),
    dict(recipe="dpo", source=SWIFT_DPO_FULL,
         runs="ms-swift example: Qwen2.5-7B-Instruct full DPO on 4 GPUs, DeepSpeed ZeRO-3, batch 4, max_length "
              "8192, flash-attn, rpo_alpha 0.1: '4 * 57GiB' without padding_free, '4 * 47GiB' with it",
         figure="not stated (a comment)",
         missing="DeepSpeed ZeRO-3 is not modelled (memest traces FSDP2's per-layer rule); lengths are "
                 "data-dependent; padding-free packing is not offered with --preference; rpo_alpha's NLL term; "
                 "memest traces --preference over several ranks over plain DDP or FSDP2 as trl and accelerate wrap "
                 "it (the reference one unit: trl's prepare_fsdp), not DeepSpeed ZeRO-3 (trl's prepare_deepspeed)",
         spec=dict(preference="dpo", precision="bf16", attention="flash", world_size=4, shard="zero3", batch=4,
                   seq=8192)),
    dict(recipe="vlm", source="https://github.com/QwenLM/Qwen3-VL/issues/938",
         runs="Qwen2.5-VL-7B LoRA with max_pixels=12800 out of memory on a 24 GB card and on 4 x 16 GB V100; ran once "
              "lm_head was frozen",
         figure="an outcome (OOM)",
         missing="no framework (own code), batch, text length or image sizes stated; no figure"),
    dict(recipe="vlm", source="https://github.com/QwenLM/Qwen3-VL/issues/958",
         runs="a question: GPU memory for full fine-tuning of Qwen2.5-VL-72B-Instruct", figure="none",
         missing="unanswered in the stored copy: no measurement"),
    dict(recipe="dpo", source="https://github.com/hiyouga/LlamaFactory/issues/10175",
         runs="a 4B model, LoRA r8, one A800 80GB: SFT fits at batch 4, DPO runs out of memory at batch 2 (batch 1 "
              "fits below 64 accumulation steps)",
         figure="outcomes (fits / OOM)",
         missing="the model is not named, nor the data set's lengths; no figure"),
    dict(recipe="all", source=LF_README,
         runs="'Hardware Requirement' table: 7B full bf16 120GB, LoRA 16GB, QLoRA 4-bit 6GB, ... ('x'B rules)",
         figure="an estimate ('* estimated'), not a measurement",
         missing="not measured; no batch or length; SFT, not a preference recipe"),
    dict(recipe="grpo", source="https://www.reddit.com/r/MachineLearning/comments/1iyv12c/p_train_your_own_reasoning_model_grpo_works_on/",
         runs="unsloth's GRPO post (its blog: https://unsloth.ai/blog/grpo): 'TRL + FA2' GRPO on Llama 3.1 8B at 20K "
              "context, num_generations 8: 510.8 GB; unsloth 54.3 GB",
         figure="a computed breakdown, not a measurement",
         missing="the TRL figure is arithmetic, not a run; unsloth's figure is for its own kernels and offloaded "
                 "checkpointing, which memest does not trace"),
    dict(recipe="dpo", source=TRL_MEMORY_DOC,
         runs="trl's 'Reducing memory usage' page (truncation, padding-free, Liger, activation offloading)",
         figure="charts only", missing="no number and no run settings in the text"),
]


SPEC_MODEL = "hf:qwen2.5-7b"  # a bundled config standing in for the source's model: only the flags are checked


def memest_accepts(spec: dict) -> bool | str:
    """Whether memest takes the source's stated settings (RunSpec's checks, no trace): True, or its refusal."""
    from memest.errors import MemestError
    from memest.spec import RunSpec

    try:
        RunSpec(model=SPEC_MODEL, **spec)
    except MemestError as exc:
        return str(exc).strip().splitlines()[0]
    return True


def not_scorable() -> list[dict]:
    """NOT_SCORABLE, each with the settings it states (where memest has flags for them) checked against memest."""
    return [{**n, **({"memest": memest_accepts(n["spec"])} if "spec" in n else {})} for n in NOT_SCORABLE]


# --- FSDP-QLoRA: issue 24's first recipe, scored in gpu-scale.json ------------------------------------------------
def fsdp_qlora_from_scale(scale: dict) -> dict:
    """The QLoRA rows over several GPUs that scripts/bench_gpu_scale.py scored (its run, its commit), and the
    QLoRA rows it could not trace; summarised per figure type, not retraced."""
    rows = [r for r in scale["rows"] if r["spec"].get("quant") and r["spec"].get("world_size", 1) > 1]
    kept = [{"group": r["group"], "label": r["label"], "source": r["source"], "figure": r["figure"],
             "shard": r["spec"].get("shard"), "measured_bytes": r["measured_bytes"], "memest_bytes": r["memest_bytes"],
             "error_pct": r["error_pct"], "inside": r["inside"], "verdict": r["memest"]["verdict"]} for r in rows]
    refused = [{"group": f["group"], "label": f["label"], "error": f["error"]} for f in scale["failed"]
               if f["spec"].get("quant")]
    return {"from": "benchmarks/gpu-scale.json", "environment": scale["environment"], "rows": kept,
            "summary": {f: abs_summary(kept, f) for f in FIGURES}, "refused": refused}


def abs_summary(rows: list[dict], figure: str) -> dict:
    errors = [abs(r["error_pct"]) for r in rows if r["figure"] == figure]
    if not errors:
        return {}
    return {"rows": len(errors), "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors)}


# --- report ----------------------------------------------------------------------------------------------------
def render(data: dict) -> str:
    env, scored = data["environment"], data["rows"]
    lines = ["# Published GPU memory figures for issue 24's fine-tuning recipes: memest uncalibrated", "",
             f"Written {env['date']} with memest {env['memest']} ({env['commit']}), torch {env['torch']}, transformers "
             f"{env['transformers']}, peft {env['peft']}, bitsandbytes {env['bitsandbytes']}, on a CPU (memest never "
             "touches a GPU; no calibration). Reproduce: `python scripts/bench_gpu_finetune_recipes.py` (raw: "
             "gpu-finetune-recipes.json).", "",
             "Recipes: preference training (`--preference dpo|orpo|kto|simpo|cpo`, `--reference`), GRPO "
             "(`--preference grpo`), vision-language images (`--images`, `--image-size`), FSDP-QLoRA. A published "
             "figure is scored only against memest's figure of the same type (reserved = `max_memory_reserved`, "
             "allocated = `max_memory_allocated`, device = nvidia-smi) and only where the source states every "
             "setting the step's memory depends on, sequence lengths and image sizes included.", ""]
    lines += ["## Preference training, GRPO, vision-language inputs", ""]
    if scored:
        lines += ["| figure | rows | median \\|error\\| | max \\|error\\| | inside range |", "|---|---:|---:|---:|---:|"]
        for f in FIGURES:
            s = data["summary"][f]
            if s:
                lines.append(f"| {f} | {s['rows']} | {s['median_abs_error_pct']:.2f}% | {s['max_abs_error_pct']:.2f}% "
                             f"| {s['inside']}/{s['with_range']} |")
        lines += ["", "| recipe | run | card | figure | measured GiB | memest GiB | error | memest range GiB | verdict "
                  "| source |", "|---|---|---|---|---:|---:|---:|---|---|---|"]
        for r in scored:
            rng = "-" if r["low"] is None else f"{_g(r['low'])}-{_g(r['high'])}"
            lines.append(f"| {r['group']} | {r['label']} | {r['card']['name']} | {r['figure']} | "
                         f"{_g(r['measured_bytes'])} | {_g(r['memest_bytes'])} | {r['error_pct']:+.1f}% | {rng} | "
                         f"{r['memest']['verdict'] or '-'} | [source]({r['source']}) |")
    else:
        lines += [f"Rows scored: 0. Of the {len(data['not_scorable'])} published sources found for these recipes, none "
                  "comes with every setting its step's memory depends on (below): the runs read their lengths from "
                  "data sets, padded per batch, or the thread does not state the trainer's configuration, or the "
                  "figure is an estimate or an outcome (OOM). No median is given for them: none was measured. "
                  "memest's own checks of these recipes are the CPU ground truth (docs/accuracy.md: to the byte but "
                  "for the residuals named there); no GPU run of them has been measured by this project."]
    if data["failed"]:
        lines += ["", "Rows memest could not trace:", ""] + [f"- {f['group']} / {f['label']}: {f['error']}"
                                                           for f in data["failed"]]
    lines += ["", "## Cannot score: published figures and what they lack", "",
              f"memest: whether memest takes the settings the source states (its option checks, no trace; model "
              f"{SPEC_MODEL} standing in, lengths at their stated maximum): 'takes' or its refusal; '-' where the "
              "source states too little to write them (only what it states is set; the rest is memest's default).", "",
              "| recipe | source | run and stated memory | figure | missing | memest |", "|---|---|---|---|---|---|"]
    for n in data["not_scorable"]:
        name = n["source"].split("/blob/")[0].split("github.com/")[-1].split("://")[-1]
        said = "-" if "memest" not in n else ("takes" if n["memest"] is True else f"refuses: {n['memest']}")
        lines.append(f"| {n['recipe']} | [{name}]({n['source']}) | {n['runs']} | {n['figure']} | {n['missing']} | "
                     f"{said} |")
    fq = data["fsdp_qlora"]
    fenv = fq["environment"]
    lines += ["", "## FSDP-QLoRA (scored in gpu-scale.md, not retraced here)", "",
              f"The QLoRA rows over several GPUs of [gpu-scale.md](gpu-scale.md) (scored {fenv['date']}, memest "
              f"{fenv['commit']}): Answer.AI's fsdp_qlora benchmarks and peft's FSDP / DeepSpeed guides.", "",
              "| figure | rows | median \\|error\\| | max \\|error\\| |", "|---|---:|---:|---:|"]
    for f in FIGURES:
        s = fq["summary"][f]
        if s:
            lines.append(f"| {f} | {s['rows']} | {s['median_abs_error_pct']:.2f}% | {s['max_abs_error_pct']:.2f}% |")
    lines += ["", "| group | run | shard | figure | measured GiB | memest GiB | error | inside | verdict | source |",
              "|---|---|---|---|---:|---:|---:|---|---|---|"]
    for r in fq["rows"]:
        inside = "-" if r["inside"] is None else ("yes" if r["inside"] else "no")
        lines.append(f"| {r['group']} | {r['label']} | {r['shard']} | {r['figure']} | {_g(r['measured_bytes'])} | "
                     f"{_g(r['memest_bytes'])} | {r['error_pct']:+.1f}% | {inside} | {r['verdict'] or '-'} | "
                     f"[source]({r['source']}) |")
    if fq["refused"]:
        lines += ["", f"Refused (not modelled), {len(fq['refused'])} rows: "
                  + "; ".join(f"{r['group']} / {r['label']}" for r in fq["refused"])
                  + f" ({fq['refused'][0]['error'].split(' (')[0]})."]
    lines += ["", "The misses and their causes are in [gpu-scale.md](gpu-scale.md) (\"Misses and their causes\")."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-finetune-recipes"),
                   help="output path without suffix (.json and .md are written)")
    p.add_argument("--no-cache", action="store_true", help="retrace every row")
    args = p.parse_args(argv)

    rows = recipe_rows()
    scored, failed = [], []
    if rows:
        code, versions = _source_hash(), _versions()
        cache = {} if args.no_cache or not CACHE.exists() else json.loads(CACHE.read_text())
        for row in rows:
            key = cache_key(row, code, versions)
            if key not in cache:
                try:
                    cache[key] = trace_row(row)
                except Exception as exc:  # noqa: BLE001 - a row memest cannot trace is reported, not hidden
                    failed.append({"group": row.group, "label": row.label, "spec": row.spec,
                                   "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}"})
                    continue
                CACHE.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
            scored.append(score(row, cache[key]))
    else:
        versions = _versions()
    data = {"environment": _environment(versions), "summary": {f: summary(scored, f) for f in FIGURES},
            "rows": scored, "failed": failed, "not_scorable": not_scorable(),
            "fsdp_qlora": fsdp_qlora_from_scale(json.loads(SCALE_JSON.read_text()))}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(data))
    print(f"scored {len(scored)} rows, {len(failed)} failed, {len(NOT_SCORABLE)} not scorable; FSDP-QLoRA from "
          f"gpu-scale.json: " + ", ".join(f"{f} median {s['median_abs_error_pct']:.2f}% ({s['rows']} rows)"
                                           for f, s in data["fsdp_qlora"]["summary"].items() if s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
