"""memest serve against vLLM's own start-up reports (issue 14) -> benchmarks/serve.md (+ .json).

Two checks per published start-up log:

1. arithmetic: the log's own components (total, utilization, weights, activation peak, non-torch) through
   memest's budget arithmetic (memest/serve/budget.py) -> blocks / tokens, against the blocks / tokens the
   same log reports;
2. prediction (models memest can build): memest's own figures (weights from the config, the traced profile
   run, evidence constants) -> tokens, against the log; and with the log's non-torch value put in, which
   isolates what memest traces.

Then the wall time of `memest serve` for 8B-class models (medians of --runs subprocess runs).

    python scripts/bench_serve.py [--runs 5] [--out benchmarks/serve.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GiB = 2**30

# Every figure below is copied from the log at the address given; GiB values are the log's 2-decimal roundings.
ROWS = [
    dict(id="vllm#10517 (20k)", url="https://github.com/vllm-project/vllm/issues/10517",
         setup="RTX 3090, meta-llama/Llama-3.1-8B-Instruct bf16, vLLM 0.6.x (V0 engine), --max-model-len 20000, "
               "utilization 0.90, block 16",
         total=23.58, util=0.90, parts={"weights + activation (peak_torch_memory)": 17.06, "non-torch": 0.35},
         kv=(32, 8, 128, 2), logged_blocks=1952, logged_starts=True,
         logged_activation=17.06 - 14.9888,
         predict=dict(model="hf:llama-3.1-8b", card="rtx3090", max_model_len=20000, max_num_batched_tokens=20000,
                      max_num_seqs=256, cuda_graphs="after"), log_non_torch=0.35),
    dict(id="vllm#10517 (29k, refused)", url="https://github.com/vllm-project/vllm/issues/10517",
         setup="as above, --max-model-len 29000: 'larger than the maximum number of tokens that can be stored in "
               "KV cache (23648)'",
         total=23.58, util=0.90, parts={"weights + activation (peak_torch_memory)": 17.98, "non-torch": 0.35},
         kv=(32, 8, 128, 2), logged_blocks=1478, logged_starts=False, max_model_len=29000,
         logged_activation=17.98 - 14.9888,
         predict=dict(model="hf:llama-3.1-8b", card="rtx3090", max_model_len=29000, max_num_batched_tokens=29000,
                      max_num_seqs=256, cuda_graphs="after"), log_non_torch=0.35),
    dict(id="vllm PR #10511 (TP 1)", url="https://github.com/vllm-project/vllm/pull/10511",
         setup="H100 80GB, meta-llama/Meta-Llama-3-8B bf16, vLLM main Dec 2024 (V0), defaults (max-model-len 8192)",
         total=79.22, util=0.90, parts={"weights": 14.96, "non-torch (incl. CUDA context in this build)": 1.79,
                                        "activation": 1.26},
         kv=(32, 8, 128, 2), logged_kv_gib=53.29, logged_starts=True, logged_activation=1.26,
         predict=dict(model="hf:llama-3-8b", card="h100", max_model_len=8192, max_num_batched_tokens=8192,
                      max_num_seqs=256, cuda_graphs="after"), log_non_torch=1.79),
    dict(id="vllm PR #12126", url="https://github.com/vllm-project/vllm/pull/12126",
         setup="H100 80GB, meta-llama/Llama-3.2-11B-Vision, --max-model-len 65536 --max-num-seqs 128 --enforce-eager "
               "(V0); arithmetic only (vision model)",
         total=79.22, util=0.90, parts={"weights": 19.86, "non-torch": 0.16, "activation": 36.63},
         kv=(40, 8, 128, 2), logged_blocks=6001, logged_starts=True),
    dict(id="vllm#13882 (refused)", url="https://github.com/vllm-project/vllm/issues/13882",
         setup="RTX 4060 8 GB, a Qwen2.5-7B 4-bit checkpoint (5.20 GiB weights), utilization 0.70, "
               "--max-model-len 4096 (V0): '# cuda blocks: 0'; arithmetic only (quantized weights)",
         total=8.00, util=0.70, parts={"weights": 5.20, "non-torch": 0.03, "activation": 1.42},
         kv=(28, 4, 128, 2), logged_blocks=0, logged_starts=False, max_model_len=4096),
    dict(id="vllm#21348 (TP 4)", url="https://github.com/vllm-project/vllm/issues/21348",
         setup="4x H100, Qwen3-235B-A22B-FP8, TP 4, defaults (V1): 'Available KV cache memory: 8.11 GiB', "
               "'GPU KV cache size: 178,880 tokens'; arithmetic only (FP8 weights)",
         total=None, util=None, available=8.11, kv=(94, 1, 128, 2), logged_tokens=178880, logged_starts=True),
]


# SGLang: "Load weight end. ... avail mem=A GB, mem usage=W GB" (GiB despite the label), then the pool.
SGLANG_ROWS = [
    dict(id="sglang PR #18263", url="https://github.com/sgl-project/sglang/pull/18263",
         setup="AMD GPU, Qwen3-30B-A3B, mem_fraction_static 0.911: 'avail mem=230.20 GB, mem usage=56.98 GB', "
               "'initial available_bytes 219721119039 / 204.63 GB' (the KV budget before that PR's own change)",
         avail=230.20, usage=56.98, fraction=0.911, logged_rest_bytes=219721119039, logged_starts=True),
    dict(id="InferenceX #2128 (refused)", url="https://github.com/SemiAnalysisAI/InferenceX/issues/2128",
         setup="8x H200, DeepSeek-V4-Pro FP8, TP 8, --mem-fraction-static 0.88: 'avail mem=12.25 GB, mem usage=125.65 "
               "GB', 'Loaded weights leave no GPU memory for the KV cache'; SGLang's own minimum: 0.9113",
         avail=12.25, usage=125.65, fraction=0.88, logged_rest_bytes=None, logged_starts=False, logged_minimum=0.9113),
]


def sglang_arithmetic(row: dict) -> dict:
    """rest = free after load - free before load x (1 - fraction), with free before = avail + usage; the
    smallest fraction with rest >= 0 is usage / free before (memest/serve/plan.py's fix)."""
    from memest.serve.budget import Part, sglang_budget

    before = int((row["avail"] + row["usage"]) * GiB)
    g = sglang_budget(before, row["fraction"], "log", Part.exact("context", 0, "log"), int(row["usage"] * GiB),
                      _kv(1, 1, 128, 2), 1)
    smallest = math.ceil(row["usage"] / (row["avail"] + row["usage"]) * 10000) / 10000
    out = {"rest_bytes": g.rest.bytes, "starts": g.rest.bytes > 0, "smallest_fraction": smallest}
    if row["logged_rest_bytes"]:
        out["error"] = (g.rest.bytes - row["logged_rest_bytes"]) / row["logged_rest_bytes"]
    return out


def _kv(layers: int, kv_heads: int, head_dim: int, nbytes: int):
    from memest.serve.kv import FULL, LayerKV, ModelKV

    return ModelKV([LayerKV(FULL, kv_heads, head_dim, nbytes)] * layers, "bf16")


def arithmetic(row: dict) -> dict:
    from memest.serve.budget import Part, kv_layout, vllm_budget

    kv = _kv(*row["kv"])
    max_len = row.get("max_model_len", 8192)
    if row.get("total") is None:
        layout = kv_layout(kv, int(row["available"] * GiB), 16, max_len, 8192)
        available = row["available"] * GiB
    else:
        parts = [Part.exact(k, int(v * GiB), "log") for k, v in row["parts"].items()]
        budget = vllm_budget(int(row["total"] * GiB), row["util"], parts, kv, 16, max_len, 8192)
        layout, available = budget.layout, budget.available.bytes
    logged_tokens = row.get("logged_tokens") or (row["logged_blocks"] * 16 if "logged_blocks" in row else None)
    if logged_tokens is None and "logged_kv_gib" in row:
        return {"kv_gib": available / GiB, "logged_kv_gib": row["logged_kv_gib"], "tokens": layout.tokens,
                "logged_tokens": None, "error": (available / GiB - row["logged_kv_gib"]) / row["logged_kv_gib"],
                "starts": layout.request_bytes <= available, "what": "KV GiB"}
    err = (layout.tokens - logged_tokens) / logged_tokens if logged_tokens else (0.0 if layout.tokens == 0 else None)
    return {"kv_gib": available / GiB, "tokens": layout.tokens, "logged_tokens": logged_tokens, "error": err,
            "starts": available > 0 and layout.request_bytes <= available, "what": "tokens"}


def prediction(row: dict, non_torch: float | None = None) -> dict:
    from memest.app import resolve_gpu, serve_total
    from memest.serve import evidence
    from memest.serve.budget import Part
    from memest.serve.plan import ServeSpec, plan_serve

    p = dict(row["predict"])
    ctx = resolve_gpu(p.pop("card"), need_budget=True)
    total, _ = serve_total(ctx)
    saved = evidence.non_torch
    if non_torch is not None:
        evidence.non_torch = lambda tp: Part.exact("non-torch increase", int(non_torch * GiB), "the log's value")
    try:
        plan = plan_serve(ServeSpec(total_bytes=total, card=ctx.flag, compute_capability=ctx.compute_capability, **p))
    finally:
        evidence.non_torch = saved
    b = plan.vllm
    logged_tokens = row.get("logged_tokens") or (row["logged_blocks"] * 16 if "logged_blocks" in row else None)
    out = {"tokens": b.layout.tokens, "tokens_low": b.layout_low.tokens, "tokens_high": b.layout_high.tokens,
           "kv_gib": b.available.bytes / GiB, "activation_gib": plan.profile.activation.bytes / GiB,
           "weights_gib": plan.weights.bytes / GiB, "starts": plan.starts, "verdict": plan.verdict,
           "longest_context": plan.longest_context}
    if logged_tokens:
        out["error"] = (b.layout.tokens - logged_tokens) / logged_tokens
        out["inside"] = b.layout_low.tokens <= logged_tokens <= b.layout_high.tokens
    else:
        out["error"] = (out["kv_gib"] - row["logged_kv_gib"]) / row["logged_kv_gib"]
    return out


def timing(runs: int) -> list[dict]:
    """Wall and CPU (user + sys of the child) per command; the README's gpt2 estimate (5.79 s on an idle
    machine, benchmarks/speed.md) is timed alongside as a yardstick of how loaded the machine is."""
    import resource

    rows = []
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    commands = (["serve", "hf:llama-3-8b", "--gpu", "h100"],
                ["serve", "hf:llama-3.1-8b", "--gpu", "h100", "--max-model-len", "32768"],
                ["serve", "hf:mistral-7b", "--gpu", "h100"],
                ["serve", "hf:llama-3-8b", "--gpu", "h100", "--engine", "sglang"],
                ["estimate", "hf:gpt2", "--batch", "8", "--seq", "1024", "--optim", "adamw"])
    for args in commands:
        walls, cpus = [], []
        for _ in range(runs):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-m", "memest", *args, "--json"], cwd=ROOT, env=env,
                           check=True, capture_output=True)
            walls.append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpus.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        rows.append({"command": "memest " + " ".join(args), "median_s": statistics.median(walls),
                     "min_s": min(walls), "max_s": max(walls), "cpu_median_s": statistics.median(cpus),
                     "runs": runs, "load_average": os.getloadavg()[0]})
    return rows


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "serve.md"))
    args = ap.parse_args()
    results = []
    for row in ROWS:
        r = {"id": row["id"], "url": row["url"], "setup": row["setup"], "arithmetic": arithmetic(row)}
        if "predict" in row:
            r["prediction"] = prediction(row)
            r["prediction_log_non_torch"] = prediction(row, row["log_non_torch"])
            r["logged_activation_gib"] = row["logged_activation"]
        r["logged_starts"] = row["logged_starts"]
        results.append(r)
        print(row["id"], json.dumps(r["arithmetic"]), file=sys.stderr)
    sglang = [{**{k: row[k] for k in ("id", "url", "setup", "logged_starts")}, "logged": row,
               "arithmetic": sglang_arithmetic(row)} for row in SGLANG_ROWS]
    times = timing(args.runs)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"rows": results, "sglang": sglang, "timing": times}, indent=2)
                                        + "\n")
    out.write_text(render(results, times, sglang))
    print(f"wrote {out}", file=sys.stderr)


def render(results: list[dict], times: list[dict], sglang: list[dict]) -> str:
    import torch
    import transformers

    from memest import __version__

    lines = ["# memest serve against vLLM's own start-up reports", "",
             f"`python scripts/bench_serve.py` (memest {__version__}, torch {torch.__version__}, transformers "
             f"{transformers.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs, no GPU). "
             "Every logged figure is copied from the address in its row; GiB figures in the logs are rounded to "
             "two decimals (+-0.005 GiB).", "",
             "## 1. The arithmetic, on the logs' own components", "",
             "The log's total, utilization and subtracted components through memest's budget arithmetic "
             "(memest/serve/budget.py: requested = total x utilization, minus the components, blocks = "
             "available // page // layers, tokens = blocks x 16) against what the same log reports.", "",
             "| log | setup | memest | vLLM's log | error | starts (memest / log) |", "|---|---|---:|---:|---:|---|"]
    for r in results:
        a = r["arithmetic"]
        mine = f"{a['tokens']:,} tokens" if a["what"] == "tokens" else f"{a['kv_gib']:.2f} GiB"
        theirs = (f"{a['logged_tokens']:,} tokens" if a["what"] == "tokens" else f"{a['logged_kv_gib']:.2f} GiB")
        lines.append(f"| [{r['id']}]({r['url']}) | {r['setup']} | {mine} | {theirs} | {pct(a['error'])} | "
                     f"{_yn(a['starts'])} / {_yn(r['logged_starts'])} |")
    lines += ["", "The TP-4 row: vLLM makes every rank use the smallest rank's block count (vllm/v1/core/kv_cache_utils.py "
              "`get_kv_cache_configs`: `min_num_blocks = min(...)` over the workers); the log shows rank 0's available "
              "memory, and its token count corresponds to about 8.02 GiB on the smallest rank. The other rows differ "
              "by the logs' two-decimal GiB rounding only."]
    lines += ["", "SGLang (`--engine sglang`): the KV pool from the log's free memory after loading and the weights' "
              "usage, through memest/serve/budget.py `sglang_budget`.", "",
              "| log | setup | memest | SGLang's log | error | starts (memest / log) |", "|---|---|---:|---:|---:|---|"]
    for r in sglang:
        a, logged = r["arithmetic"], r["logged"]
        if logged["logged_rest_bytes"]:
            theirs, err = f"{logged['logged_rest_bytes']:,} B", pct(a["error"])
        else:
            theirs, err = f"refused; minimum fraction {logged['logged_minimum']}", f"minimum {a['smallest_fraction']}"
        lines.append(f"| [{r['id']}]({r['url']}) | {r['setup']} | {a['rest_bytes']:,} B | {theirs} | {err} | "
                     f"{_yn(a['starts'])} / {_yn(r['logged_starts'])} |")
    lines += ["", "## 2. memest's own prediction", "",
              "memest's figures only (weights from the config, the profile run traced on fake tensors, the "
              "non-torch and CUDA-graph evidence constants), with the run's settings; then the same with the "
              "log's non-torch value put in, which leaves only what memest computes and traces.", "",
              "| log | memest tokens [range] | vLLM's log | error | with the log's non-torch | activation memest / log "
              "| weights | verdict (memest / log) |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        if "prediction" not in r:
            continue
        p, q, a = r["prediction"], r["prediction_log_non_torch"], r["arithmetic"]
        theirs = f"{a['logged_tokens']:,}" if a.get("logged_tokens") else f"{a.get('logged_kv_gib'):.2f} GiB KV"
        mine = (f"{p['tokens']:,} [{p['tokens_low']:,}-{p['tokens_high']:,}]" if a.get("logged_tokens") else
                f"{p['kv_gib']:.2f} GiB KV")
        lines.append(f"| [{r['id']}]({r['url']}) | {mine} | {theirs} | {pct(p['error'])} | {pct(q['error'])} | "
                     f"{p['activation_gib']:.2f} / {r['logged_activation_gib']:.2f} GiB | {p['weights_gib']:.4f} GiB | "
                     f"{p['verdict']} / {'starts' if r['logged_starts'] else 'refused'} |")
    lines += ["", "The goal (KV tokens within 1% of vLLM's report) is met by the arithmetic and by what memest computes "
              "and traces (weights to the byte of vLLM's logged 14.9888 GiB; the traced activation against the logged "
              "peaks in the table; tokens with the log's non-torch value put in), not by the uncalibrated non-torch "
              "constant: its expected 0.16 GiB (the median of the published TP-1 values) against these logs' 0.35 GiB "
              "and 1.79 GiB (the latter from a build that counted the CUDA context there) moves 0.2-1.6 GiB into the "
              "KV cache. The logged tokens fall inside memest's range on both #10517 rows. The #10511 row's activation "
              "reads low: that V0 build profiled 256 sequences of 32 tokens each, with per-sequence sampling tensors "
              "memest's single-sequence forward does not reproduce."]
    lines += ["", "## 3. Speed", "",
              "Wall time of the whole command (a fresh process: imports, config, trace, arithmetic, JSON) and its CPU "
              "time (user + sys), medians; the last row is the README's speed yardstick (5.79 s on an idle machine) "
              "timed alongside, to show how loaded the shared 2-core machine was.", "",
              "| command | wall median | min | max | CPU median | load average | runs |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for t in times:
        lines.append(f"| `{t['command']}` | {t['median_s']:.2f} s | {t['min_s']:.2f} s | {t['max_s']:.2f} s | "
                     f"{t['cpu_median_s']:.2f} s | {t['load_average']:.1f} | {t['runs']} |")
    lines.append("")
    return "\n".join(lines)


def _yn(x) -> str:
    return "-" if x is None else ("yes" if x else "no")


if __name__ == "__main__":
    main()
