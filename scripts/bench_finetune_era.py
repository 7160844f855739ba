"""The unsloth comparison of benchmarks/finetune.md traced with the transformers and peft of the published run's era.

unsloth's "Llama 3.1 (8B) max. context length" table (its Hugging Face + FA2 column) was published with the
Llama 3.3 release (unsloth.ai/blog/llama3-3, December 2024), when transformers 4.47 and peft 0.14 were
current (the Llama 3.1 release, July 2024, had transformers 4.43 and peft 0.12). memest traces the model's own
code, so tracing the same step with those versions shows what their code holds that today's does not. One
difference read in their source: transformers 4.43-4.47 compute the causal-LM loss as
``shift_logits = logits.float()[..., :-1, :].contiguous()`` (4.43 in LlamaForCausalLM.forward, 4.46+ in
loss/loss_utils.py ForCausalLMLoss): an extra float32 copy of the logits, vocab x 4 bytes per token (0.49 MiB for
Llama 3.1's 128,256 tokens), where transformers 5 pads the labels instead and shifts nothing.

    pip install --target /tmp/tf447 --no-deps transformers==4.47.1 peft==0.14.0 tokenizers==0.21.0 \
        huggingface_hub==0.27.0 accelerate==1.2.1 requests==2.32.3 urllib3==2.2.2 idna==3.7 \
        charset_normalizer==3.3.2 certifi==2024.7.4
    python scripts/bench_finetune_era.py --era /tmp/tf447     # -> benchmarks/finetune-era.json

The era's packages come first on PYTHONPATH in a child process; memest, torch and bitsandbytes are this
environment's. peft 0.14's own LoRA layer for bitsandbytes' Linear4bit wraps memest's stand-in (memest's copy
of the layer is peft 0.21's). Two precisions (PRECISIONS): the benchmark's pure bf16, and fp32 non-quantized
weights under bf16 autocast, which is what a trl SFTTrainer QLoRA run holds. What stays as today: memest's
non-reentrant checkpointing (the era's Trainer default was reentrant), SDPA flash attention in place of the
flash-attn package, unpadded inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "benchmarks" / "finetune-era.json"


PRECISIONS = {
    "bf16": "The model in bf16, no autocast (benchmarks/finetune.md's setting)",
    "bf16-mixed": "Non-quantized weights (embeddings, norms, head) in fp32 under bf16 autocast: a 4-bit model after "
                  "peft's prepare_model_for_kbit_training (trl's SFTTrainer calls it) trained with "
                  "TrainingArguments(bf16=True)",
}


def _era_lora_layer() -> None:
    from peft.tuners.lora import bnb as peft_bnb

    from memest.features import quant

    quant.lora_layer_class = lambda clone=True: peft_bnb.Linear4bit  # the era's own LoRA layer for Linear4bit


def checks() -> list[dict]:
    """The published longest sequences traced directly (bf16-mixed): memest's need at the run's own boundary."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_finetune import COMMON, LORA32, UNSLOTH_HF_FA2

    import memest

    _era_lora_layer()
    out = []
    for gb, pub in UNSLOTH_HF_FA2.items():
        est = memest.estimate("hf:llama-3.1-8b", **{**COMMON, "seq": pub, "optim": "adam8bit", "lora": LORA32,
                                                   "quant": "nf4", "precision": "bf16-mixed"})
        out.append({"card_gb": gb, "seq": pub, "needed": est.needed_range[1]})
        print(f"era bf16-mixed published seq {pub}: {est.needed_range[1] / 2**30:.2f} GiB", file=sys.stderr)
    return out


def child(grid: list[int]) -> dict:
    sys.path.insert(0, str(ROOT / "scripts"))
    import peft
    import transformers
    from bench_finetune import COMMON, LORA32, UNSLOTH_HF_FA2, longest_fitting

    import memest

    _era_lora_layer()
    variants = {}
    for precision, meaning in PRECISIONS.items():
        points = []
        for seq in grid:
            start = time.perf_counter()
            est = memest.estimate("hf:llama-3.1-8b", **{**COMMON, "seq": seq, "optim": "adam8bit", "lora": LORA32,
                                                       "quant": "nf4", "precision": precision})
            low, expected, high = est.needed_range
            points.append({"seq": seq, "needed": expected, "needed_low": low, "needed_high": high,
                           "peak_allocated": est.peak_allocated_bytes, "breakdown": est.breakdown,
                           "seconds": round(time.perf_counter() - start, 1)})
            print(f"era {precision} seq {seq}: {expected / 2**30:.2f} GiB", file=sys.stderr)
        curve = [(p["seq"], p["needed"]) for p in points]
        rows = [{"card_gb": gb, "published": pub, "memest_gb_decimal": longest_fitting(curve, gb * 10**9),
                 "memest_gb_binary": longest_fitting(curve, gb * 2**30)} for gb, pub in UNSLOTH_HF_FA2.items()]
        variants[precision] = {"meaning": meaning, "grid": points, "rows": rows}
    return {"transformers": transformers.__version__, "peft": peft.__version__, "variants": variants}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--era", default="/tmp/tf447", help="pip --target folder with the era's transformers + peft")
    parser.add_argument("--child", choices=["grid", "checks"])
    args = parser.parse_args()
    grid = [1024, 4096, 16384, 32768, 65536]
    if args.child:
        print(json.dumps(child(grid) if args.child == "grid" else checks()))
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([args.era, str(ROOT)]), "CUDA_VISIBLE_DEVICES": ""}
    out = {}
    for part in ("grid", "checks"):  # one process each: the long traces' memory is returned in between
        done = subprocess.run([sys.executable, __file__, "--child", part], env=env, stdout=subprocess.PIPE, text=True,
                              check=True)
        out[part] = json.loads(done.stdout.strip().splitlines()[-1])
    doc = out["grid"]
    doc["variants"]["bf16-mixed"]["checks"] = out["checks"]
    OUT.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
