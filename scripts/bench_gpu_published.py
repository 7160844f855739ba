"""Goal benchmark (issue 11): memest's uncalibrated device prediction against measured GPU runs.

Each row is a real training run on a GPU whose whole-process memory was measured (NVML: what
nvidia-smi shows), with its source and setup:

  v100-hf   Hugging Face's "Model training anatomy" / "efficient training on one GPU" runs: bert-large-
            uncased sequence classification, seq 512, Trainer, on a Tesla V100-SXM2 16GB (driver
            460.91.03, CUDA 11.2, January 2022): NVML device used after trainer.train().
  h100      this project's runs (benchmarks/gpu-validation.json, memest.device.measured_runs): NVML peak
            of the process over two training steps on an H100 80GB, CUDA 13.0, torch 2.11.
  oom       public out-of-memory reports (transformers#1750, stanford_alpaca#221 and #73).

memest runs without calibration and never touches a GPU. Per row: the expected device use (allocator
reserved + fixed costs from evidence) and its [low, high] range; the three-way verdict against the
row's card (the needed range); and the old default (reserved + a 400 MiB context, 1000 MiB eager) for
comparison. The h100 rows are also evidence for the ranges (library costs, allocator band), so they
are scored twice: in-sample, and leave-one-out (the row's own run removed from the evidence).

Goals: |expected - measured| / measured within 5% median and 12% max; measured inside [low, high] in
>= 90% of rows; no row where memest says "fits" and the measured run exceeded the card.

    pip install --target /tmp/peers --no-deps torchvision==0.28.0 timm   # the torchvision / timm rows
    pip install --target /tmp/tf416 --no-deps transformers==4.16.2 huggingface_hub==0.4.0 sacremoses \
        requests urllib3 idna certifi charset-normalizer click joblib     # the v100-hf rows' transformers
    python scripts/bench_gpu_published.py                  # -> benchmarks/gpu-published.md and .json
    python scripts/bench_gpu_published.py --groups v100-hf,oom

The v100-hf rows run in a subprocess with --era-transformers (default /tmp/tf416) first on PYTHONPATH:
their model file is transformers 4.16's own BERT (scripts/models/hf_bert_large_2022.py). The oom rows
are public reports of runs that ran out of memory at a stated setup on a stated card: only the
verdict is scored (memest must never say "fits").

torchvision and timm stay outside memest's environment (--peers, default /tmp/peers, is added to
sys.path); rows whose model code cannot be imported are listed as not scored, with the reason.
"""

from __future__ import annotations

import argparse
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

MiB = 2**20
HF_DOC = ("https://github.com/huggingface/transformers/blob/249ef8164cfbd8e288c2f6d8395539b9e90e8300/docs/source/en/"
          "model_memory_anatomy.md")
HF_DOC_ONE_GPU = ("https://github.com/huggingface/transformers/blob/57ddbf5ead36f05e6e77d4a34d0d838bddf2af9f/docs/source/"
                  "zh/perf_train_gpu_one.md (the same V100 runs as the anatomy page; the English page's 2022 numbers "
                  "are kept in this translation)")
V100_SETUP = ("Tesla V100-SXM2 16GB (16160 MiB), driver 460.91.03 (CUDA 11.2: kernels load eagerly), Jan 2022 "
              "(torch <= 1.10, not named by the source); transformers Trainer (4.16 era: its own AdamW, per-parameter; "
              "model.zero_grad() keeps zeroed gradients), bert-large-uncased ForSequenceClassification from the "
              "pretrained weights, seq 512, inputs without attention_mask, 512 samples, 1 epoch, batch sizes as given; "
              "NVML device used after train()")
V100_CARD = 16160 * MiB
H100_CARD = 81559 * MiB  # nvidia-smi total on the H100 80GB HBM3 these runs used
OLD_CONTEXT = {"lazy": 400 * MiB, "eager": 1000 * MiB}  # memest's previous defaults (context only)


@dataclass
class Row:
    group: str
    label: str
    source: str
    setup: str
    spec: dict  # RunSpec fields (model, batch, seq, optim, precision, ...)
    cc: tuple[int, int]
    env: dict
    card_bytes: int
    measured_bytes: int | None  # None: the run ran out of memory on card_bytes
    notes: list[str] = field(default_factory=list)
    run: object = None  # measured_runs.Run for this project's rows (leave-one-out)


ERA_MODEL = ROOT / "scripts" / "models" / "hf_bert_large_2022.py"
ERA_TRANSFORMERS = "/tmp/tf416"  # transformers 4.16.2 (pip --target), see the model file's docstring


def v100_rows() -> list[Row]:
    """HF's V100 runs: (label, batch, grad_accum, checkpointing, precision, optimizer, NVML MB).

    Traced as those runs ran the step, through memest's options and a model file, nothing per row:
    transformers 4.16's BERT code with torch < 1.11's softmax autograd (scripts/models/
    hf_bert_large_2022.py; its build_checkpointed is 4.16's reentrant gradient checkpointing);
    Trainer's loop: the output dropped before backward (--outputs freed, Trainer.training_step keeps only
    the loss) and `model.zero_grad()`, which before torch 2.0 kept the gradients as zeros
    (--zero-grad zeros; set_to_none became the default in pytorch/pytorch#92731, torch 2.0, and Trainer
    passes it itself since huggingface/transformers#22136, March 2023); eager module loading (CUDA 11.2:
    CUDA_MODULE_LOADING=EAGER)."""
    runs = [
        ("vanilla", 4, 1, False, "fp32", "adamw", 14949, HF_DOC),
        ("grad accumulation 4", 1, 4, False, "fp32", "adamw", 8681, HF_DOC_ONE_GPU),
        ("+ gradient checkpointing", 1, 4, True, "fp32", "adamw", 6775, HF_DOC_ONE_GPU),
        ("fp16", 4, 1, False, "fp16-mixed", "adamw", 13939, HF_DOC_ONE_GPU),
        ("accumulation + checkpointing + fp16", 1, 4, True, "fp16-mixed", "adamw", 7275, HF_DOC_ONE_GPU),
        ("adafactor", 4, 1, False, "fp32", "adafactor", 12295, HF_DOC_ONE_GPU),
        ("accumulation + checkpointing + fp16 + adafactor", 1, 4, True, "fp16-mixed", "adafactor", 4847,
         HF_DOC_ONE_GPU),
        ("8-bit Adam (bitsandbytes)", 4, 1, False, "fp32", "adam8bit", 13085, HF_DOC_ONE_GPU),
        ("accumulation + checkpointing + fp16 + 8-bit Adam", 1, 4, True, "fp16-mixed", "adam8bit", 5363,
         HF_DOC_ONE_GPU),
    ]
    proxies = {
        "adamw": "Trainer's adamw_hf (transformers.AdamW, one parameter at a time) as --fused: no multi-tensor "
                 "temporaries; its per-parameter sqrt temporary (at most the 119 MiB word embedding) is not counted",
        "adafactor": "torch.optim.Adafactor (foreach, memest's only Adafactor) stands in for transformers' "
                     "per-parameter Adafactor: its multi-tensor temporaries are counted where the real run had none",
        "adam8bit": "bitsandbytes Adam8bit as memest's model of its block-wise state",
    }
    rows = []
    for label, batch, accum, ckpt, precision, optim, mb, source in runs:
        model = f"{ERA_MODEL}:build_checkpointed" if ckpt else str(ERA_MODEL)
        spec = dict(model=model, batch=batch, seq=512, optim=optim, precision=precision, grad_accum=accum,
                    fused=optim == "adamw", zero_grad="zeros", outputs="freed")
        rows.append(Row("v100-hf", label, source, V100_SETUP, spec, (7, 0), {"CUDA_MODULE_LOADING": "EAGER"},
                        V100_CARD, mb * MiB, [proxies[optim]]))
    return rows


def h100_rows() -> list[Row]:
    from memest.device.measured_runs import H100_STACK, MEASURED_RUNS, VALIDATION_SOURCE

    rows = []
    for run in MEASURED_RUNS:
        ref = run.model if run.model.startswith("hf:") else str(ROOT / run.model)
        # the NVML peak was measured over memest's freed loop (validate_gpu.py's main loop)
        spec = dict(model=ref, batch=run.batch, seq=run.seq, optim=run.optim, precision=run.precision,
                    outputs="freed")
        notes = []
        if run.options.startswith("checkpointing="):
            spec["checkpointing"] = run.options.split("=", 1)[1]
        elif run.options == "cudnn_benchmark=True":
            spec["cudnn_benchmark"] = True  # the search's workspace is a range with no upper bound
        elif run.options:
            notes.append(f"{run.options}: not modelled")
        rows.append(Row("h100", run.label, f"this project: {VALIDATION_SOURCE}",
                        f"{H100_STACK}; memest's training loop, two steps", spec, (9, 0), {}, H100_CARD,
                        run.nvml_peak, notes, run))
    return rows


def oom_rows() -> list[Row]:
    """Public runs that ran out of memory on a stated card, at a stated setup (the goal: memest never says
    "fits" for them). Where the source leaves the batch or the sequence unstated, the smallest the source
    allows is traced: a step's memory only grows with both, so "does not fit" there holds for the run."""
    giB = 2**30
    return [
        Row("oom", "gpt2-xl fine-tune, batch 1, fp32 AdamW, GTX 1080 Ti 11GB",
            "https://github.com/huggingface/transformers/issues/1750",
            "2019, run_lm_finetuning.py (transformers 2.x, torch 1.3 era): 'I've tried running a batch size of 1 on a "
            "11GB 1080ti but that ran out of memory'; block_size unstated: the script's default, the model's 1024 "
            "positions; transformers' AdamW (as --fused), fp32, the loop keeps outputs, model.zero_grad() (zeros)",
            dict(model="hf:gpt2-xl", batch=1, seq=1024, optim="adamw", fused=True, precision="fp32",
                 zero_grad="zeros"),
            (6, 1), {"CUDA_MODULE_LOADING": "EAGER"}, 11 * giB, None),
        Row("oom", "LLaMA-7B full fine-tune, fp16 AMP, one A100 80GB",
            "https://github.com/tatsu-lab/stanford_alpaca/issues/221",
            "April 2023, stanford_alpaca-style train.py (transformers Trainer, fp16: GradScaler in the traceback, "
            "torch 2.0 era: torch.cuda.OutOfMemoryError), one process, model_max_length 512; batch unstated: 1; "
            "hf:llama-2-7b has LLaMA-7B's shapes (its longer position table holds no parameters); Trainer's "
            "adamw_hf as --fused, output dropped before backward, zero_grad to None (torch 2.0)",
            dict(model="hf:llama-2-7b", batch=1, seq=512, optim="adamw", fused=True, precision="fp16-mixed",
                 outputs="freed"),
            (8, 0), {}, 80 * giB, None),
        Row("oom", "LLaMA-7B, FSDP full_shard over 4 GPUs, bf16, batch 1, RTX 3090 24GB",
            "https://github.com/tatsu-lab/stanford_alpaca/issues/73",
            "March 2023, stanford_alpaca train.py via torchrun --nproc_per_node=4, --fsdp 'full_shard auto_wrap', "
            "--bf16 True, per_device_train_batch_size 1, model_max_length 512; OOM: '23.70 GiB total capacity; "
            "22.21 GiB already allocated'; traced per rank as --world-size 4 --shard zero3 (FSDP2), bf16-mixed, "
            "AdamW as --fused, output dropped before backward",
            dict(model="hf:llama-2-7b", batch=1, seq=512, optim="adamw", fused=True, precision="bf16-mixed",
                 outputs="freed", world_size=4, shard="zero3"),
            (8, 6), {}, int(23.70 * giB), None),
    ]


GROUPS = {"v100-hf": v100_rows, "h100": h100_rows, "oom": oom_rows}


def python_only_torchvision() -> None:
    """PyPI's torchvision wheels are built against CUDA torch; on a CPU-only torch their C ops (nms,
    roi_align, ...) cannot load. The classification models scored here use none of them, but importing
    torchvision registers fake kernels for nms and qnms, which needs their schemas: declare those two,
    only when the C extension does not load."""
    import importlib.util

    global _TORCHVISION_SCHEMAS
    if _TORCHVISION_SCHEMAS is not None:  # declared once per process
        return
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return
    import torch

    library = next(Path(spec.submodule_search_locations[0]).glob("_C*.so"), None)
    try:
        if library is not None:
            torch.ops.load_library(str(library))
            return
    except (OSError, RuntimeError):
        pass
    _TORCHVISION_SCHEMAS = torch.library.Library("torchvision", "DEF")
    for name in ("nms", "qnms"):
        _TORCHVISION_SCHEMAS.define(f"{name}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")


_TORCHVISION_SCHEMAS = None  # kept alive: a Library object unregisters its definitions when collected


def score(row: Row) -> dict:
    from memest.device.fit import verdict
    from memest.device.measured_runs import MEASURED_RUNS
    from memest.device.usage import device_usage
    from memest.estimator import estimate
    from memest.spec import RunSpec

    start = time.perf_counter()
    spec = RunSpec(**row.spec, compute_capability=row.cc)
    result = estimate(spec)
    env = {**row.env}
    usage = device_usage(result.trace, row.cc, env=env, world_size=row.spec.get("world_size", 1), dims=spec.parallel)
    if row.measured_bytes is None:  # an out-of-memory report: only the verdict can be scored
        return {"group": row.group, "label": row.label, "source": row.source, "setup": row.setup, "spec": row.spec,
                "compute_capability": list(row.cc), "env": row.env, "card_bytes": row.card_bytes, "oom": True,
                "expected": usage.bytes_expected, "low": usage.bytes_low, "high": usage.bytes_high,
                "needed": [usage.needed_bytes_low, usage.needed_bytes_expected, usage.needed_bytes_high],
                "model_states": _model_states(result),
                "verdict": verdict(usage.needed_bytes_expected, usage.needed_bytes_high, row.card_bytes),
                "seconds": time.perf_counter() - start}
    out = {
        "group": row.group, "label": row.label, "source": row.source, "setup": row.setup, "spec": row.spec,
        "compute_capability": list(row.cc), "env": row.env, "card_bytes": row.card_bytes,
        "measured_bytes": row.measured_bytes, "notes": row.notes,
        "allocated": usage.allocated_peak_bytes, "reserved": usage.reserved_peak_bytes,
        "cudnn_kernels": usage.cudnn_kernels,
        "fixed_costs": {c.name: [c.low, c.bytes, c.high] for c in usage.fixed_costs},
        "in_sample": _scores(usage, row, verdict),
        "old_default_bytes": usage.reserved_peak_bytes + OLD_CONTEXT[env.get("CUDA_MODULE_LOADING", "LAZY").lower()],
    }
    if row.run is not None:  # leave this run out of the evidence the ranges rest on
        others = tuple(r for r in MEASURED_RUNS if r is not row.run)
        out["leave_one_out"] = _scores(device_usage(result.trace, row.cc, env=env, evidence_runs=others), row, verdict)
    out["seconds"] = time.perf_counter() - start
    return out


def _model_states(result) -> int:
    """Parameters + gradients + optimizer state at the peak: what the verdict would be without activations."""
    b = result.report.breakdown_at_peak
    return int(b["parameters"] + b["gradients"] + b["optimizer_state"])


def _scores(usage, row: Row, verdict) -> dict:
    measured = row.measured_bytes
    return {
        "low": usage.bytes_low, "expected": usage.bytes_expected, "high": usage.bytes_high,
        "needed": [usage.needed_bytes_low, usage.needed_bytes_expected, usage.needed_bytes_high],
        "error_pct": 100 * (usage.bytes_expected - measured) / measured,
        # high None: unbounded (cuDNN's benchmark search may take all free memory)
        "inside": usage.bytes_low <= measured and (usage.bytes_high is None or measured <= usage.bytes_high),
        "verdict": verdict(usage.needed_bytes_expected, usage.needed_bytes_high, row.card_bytes),
    }


KNOWN_UNMODELLED = {  # runs whose memory comes from kernels memest does not model yet (issue 11 section 3)
    "cudnn_benchmark=True": "cudnn.benchmark on: the first step's algorithm search allocates the largest workspace that "
    "fits the free memory (Conv_v8.cpp), so memest's range has no upper bound and its expected value is the "
    "default heuristics' workspace (docs/cuda-kernels.md)",
    "lstm_lm": "cuDNN RNN workspace: a fit across 17 measured shapes (0.8x to 2.4x), kept as the range",
}


def unmodelled(row: dict) -> str | None:
    for key, why in KNOWN_UNMODELLED.items():
        if key in row["label"]:
            return why
    return None


def summary(rows: list[dict], key: str) -> dict:
    scored = [r[key] for r in rows if key in r]
    if not scored:
        return {}
    errors = [abs(s["error_pct"]) for s in scored]
    inside = sum(s["inside"] for s in scored)
    exceeded = [r["label"] for r in rows if key in r and r[key]["verdict"] == "fits" and r["measured_bytes"] > r["card_bytes"]]
    false_alarm = [r["label"] for r in rows if key in r and r[key]["verdict"] == "does-not-fit"
                   and r["measured_bytes"] <= r["card_bytes"]]
    old = [abs(100 * (r["old_default_bytes"] - r["measured_bytes"]) / r["measured_bytes"]) for r in rows if key in r]
    return {
        "rows": len(scored), "median_abs_error_pct": statistics.median(errors), "max_abs_error_pct": max(errors),
        "inside_range": inside, "inside_range_pct": 100 * inside / len(scored),
        "fits_but_exceeded": exceeded, "does_not_fit_but_ran": false_alarm,
        "old_default_median_abs_error_pct": statistics.median(old), "old_default_max_abs_error_pct": max(old),
        "goals": {"median_5pct": statistics.median(errors) <= 5, "max_12pct": max(errors) <= 12,
                  "inside_90pct": inside >= 0.9 * len(scored), "no_fits_but_exceeded": not exceeded},
    }


def _environment() -> dict:
    import torch

    from memest import __version__

    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = None
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=False).stdout.strip()
    except OSError:
        commit = ""
    peers = {}
    for name in ("torchvision", "timm"):
        try:
            peers[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            peers[name] = None
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "memest": __version__, "commit": commit,
            "torch": torch.__version__, "transformers": tf, "python": sys.version.split()[0], **peers}


def _gib(n: int | None) -> str:
    return "unbounded" if n is None else f"{n / 2**30:.2f}"


def misses(rows: list[dict], oom: list[dict] = ()) -> list[str]:
    """The analysis, with the numbers computed from the rows."""
    out = []
    h100 = [r for r in rows if r["group"] == "h100"]
    for r in h100:
        s = r.get("leave_one_out", r["in_sample"])
        if s["inside"] and abs(s["error_pct"]) <= 12:
            continue
        why = unmodelled(r) or MISS_REASONS.get(r["label"], "")
        out.append(f"- h100 {r['label']}: {s['error_pct']:+.1f}%, measured {'inside' if s['inside'] else 'outside'} "
                   f"[low, high] (leave-one-out). {why}")
    v100 = [r for r in rows if r["group"] == "v100-hf"]
    if v100:
        gaps = [(r["measured_bytes"] - r["reserved"]) / MiB for r in v100]
        out.append(
            f"- v100-hf: memest reads {min(r['in_sample']['error_pct'] for r in v100):+.1f}% to "
            f"{max(r['in_sample']['error_pct'] for r in v100):+.1f}% once the step is traced as those runs ran it "
            "(before, tracing today's transformers and torch with set_to_none and the CUDA 13 eager library cost: -18% to +20%, 4 of 9 inside; benchmarks/gpu-published.md at commit 02651d3). Three causes, each from its source, none "
            "fitted to these rows: "
            "(1) torch < 1.11 softmax autograd saved its input as well as its output (pytorch#64000, fixed by #65242 "
            "for 1.11): 24 layers x batch x 16 MiB of fp32 attention scores more than today's torch saves, reproduced "
            "in scripts/models/hf_bert_large_2022.py with transformers 4.16's own BERT; (2) Trainer's "
            "model.zero_grad() kept zeroed gradients before torch 2.0 (--zero-grad zeros: +1.25 GiB alive through "
            "forward and backward); (3) pre-1.13 torch wheels linked cuBLAS/cuDNN statically, so under eager loading "
            "their kernels were already in the 1341 MiB context the page measured (overheads.STATIC_LIBRARIES): "
            "memest now adds no eager library cost where its context evidence held them, where it added the CUDA 13 "
            f"probe's 582 MiB. Measured minus memest's reserved is {min(gaps):.0f}-{max(gaps):.0f} MiB over the rows "
            "(the context: 1341 MiB).")
        worst = max(v100, key=lambda r: abs(r["in_sample"]["error_pct"]))
        out.append(
            f"- v100-hf {worst['label']}: {worst['in_sample']['error_pct']:+.1f}%, the largest: "
            + ("torch.optim.Adafactor's foreach step (memest's Adafactor) holds multi-tensor temporaries that "
               "transformers' per-parameter Adafactor never allocates; torch's single-tensor Adafactor "
               "(foreach=False, not a memest option) reads -2.6% on this row." if "adafactor" in worst["label"]
               else "; ".join(worst["notes"])))
        fp16 = next((r for r in v100 if r["label"] == "fp16"), None)
        if fp16:
            out.append(f"- v100-hf fp16: {fp16['in_sample']['error_pct']:+.1f}%, the one batch-4 row below the "
                       "others: not explained (torch 1.10's autocast and GradScaler are not reproduced; memest "
                       "emulates today's CUDA autocast).")
    said_fits = [r["label"] for r in oom if r["verdict"] == "fits"]
    false_alarms = [r["label"] for r in rows if r["in_sample"]["verdict"] == "does-not-fit"
                    and r["measured_bytes"] <= r["card_bytes"]]
    out.append(f"- \"fits but exceeded\": {len(oom)} public runs that ran out of memory; memest says \"fits\" for "
               f"{len(said_fits)} of them{': ' + ', '.join(said_fits) if said_fits else ''}. Their model states alone "
               "exceed the card, so the goal is tested only far from the boundary: no report found states a setup "
               "complete enough to trace that ran out of memory close to it. memest said \"does not fit\" for "
               f"{len(false_alarms)} of the {len(rows)} measured runs that ran.")
    xl = [r for r in h100 if "gpt2-xl" in r["label"]]
    for r in xl:
        run = next((m for m in _measured_runs() if m.label == r["label"]), None)
        if run is not None:
            out.append(f"- allocator slack (issue 11 item 5), {r['label']}: real reserved / allocated "
                       f"{run.reserved / run.allocated:.3f}, the replay's {run.memest_reserved / run.memest_allocated:.3f} "
                       f"(reserved {100 * (run.memest_reserved - run.reserved) / run.reserved:+.1f}%).")
    return out


MISS_REASONS = {
    "examples/cnn.py b64 sgd-momentum fp32": "one backward-filter call where cuDNN's heuristics chose a workspace 9x its "
                                             "operands (memest's allocated peak -29%; the real value is inside the "
                                             "workspace range, docs/cuda-kernels.md).",
    "hf:gpt2-xl b1 s1024 adamw fp32": "the largest allocator error above the replay (+1.1% of the allocated peak); "
                                      "without this run the band's top is +0.4%, so it falls just outside.",
}


def _measured_runs():
    from memest.device.measured_runs import MEASURED_RUNS

    return MEASURED_RUNS


def markdown(env: dict, rows: list[dict], groups: dict, skipped: list[dict] = (), oom: list[dict] = ()) -> str:
    def goal_line(name: str, s: dict) -> str:
        g = s["goals"]
        mark = {True: "met", False: "**missed**"}
        return (f"| {name} | {s['rows']} | {s['median_abs_error_pct']:.2f}% ({mark[g['median_5pct']]}) | "
                f"{s['max_abs_error_pct']:.2f}% ({mark[g['max_12pct']]}) | {s['inside_range']}/{s['rows']} = "
                f"{s['inside_range_pct']:.0f}% ({mark[g['inside_90pct']]}) | {len(s['fits_but_exceeded'])} "
                f"({mark[g['no_fits_but_exceeded']]}) | {len(s['does_not_fit_but_ran'])} | "
                f"{s['old_default_median_abs_error_pct']:.2f}% / {s['old_default_max_abs_error_pct']:.2f}% |")

    lines = [
        "# What the GPU will show: memest vs measured GPU runs (uncalibrated)",
        "",
        f"Scored {env['date']} with memest {env['memest']} ({env['commit']}), torch {env['torch']}, transformers "
        f"{env['transformers']}"
        + (f" (v100-hf rows: {env['era_transformers']}, the code those runs used)" if env.get("era_transformers") else "")
        + ", on a CPU (memest never touches a GPU). Reproduce: `python scripts/bench_gpu_published.py` "
        "(raw numbers in gpu-published.json).",
        "",
        "Measured = NVML used memory (what nvidia-smi shows). memest = expected device use (caching-allocator reserved "
        "+ CUDA context + libraries, from evidence: memest/device/overheads.py, slack.py) and its [low, high] range; "
        "the verdict is against the row's card, from the needed range. Old default = reserved + 400 MiB context "
        "(1000 MiB eager), what memest said before.",
        "",
        "Goals: median |error| <= 5%, max <= 12%, measured inside [low, high] in >= 90% of rows, no \"fits\" where the "
        "measured run exceeded the card.",
        "",
        "| rows | n | median \\|error\\| | max \\|error\\| | measured in [low, high] | fits but exceeded | "
        "does not fit but ran | old default median / max |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in groups.items():
        if s and "verdicts" not in s:
            lines.append(goal_line(name, s))
    lines += ["", "## Rows", "",
              "| group | run | measured GiB | expected GiB | error | low-high GiB | inside | leave-one-out error, inside | "
              "verdict vs card | old default error | notes |",
              "|---|---|---:|---:|---:|---|---|---|---|---:|---|"]
    for r in rows:
        s = r["in_sample"]
        loo = r.get("leave_one_out")
        loo_text = f"{loo['error_pct']:+.2f}%, {'yes' if loo['inside'] else '**no**'}" if loo else "-"
        old = 100 * (r["old_default_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
        lines.append(
            f"| {r['group']} | {r['label']} | {_gib(r['measured_bytes'])} | {_gib(s['expected'])} | {s['error_pct']:+.2f}% "
            f"| {_gib(s['low'])}-{_gib(s['high'])} | {'yes' if s['inside'] else '**no**'} | {loo_text} | {s['verdict']} "
            f"| {old:+.2f}% | {'; '.join(r['notes'])} |")
    if skipped:
        lines += ["", "Not scored here: " + "; ".join(f"{s['group']} {s['label']} ({s['reason']})" for s in skipped)]
    if oom:
        s = next(v for v in groups.values() if "verdicts" in v)
        lines += ["", "## Runs that ran out of memory", "",
                  f"The goal here: memest never says \"fits\". {len(oom)} runs: {len(s['verdicts']['does-not-fit'])} "
                  f"does not fit, {len(s['verdicts']['tight'])} tight, {len(s['verdicts']['fits'])} fits "
                  f"({'met' if s['goals']['no_fits_but_exceeded'] else '**missed**'}). In "
                  f"{len(s['model_states_alone_exceed_card'])} of them parameters + gradients + optimizer state alone "
                  "exceed the card, so they test that memest does not miss the obvious, not its precision near the "
                  "boundary.", "",
                  "| run | card GiB | memest needs GiB (low-high) | model states GiB | verdict | source | setup |",
                  "|---|---:|---|---:|---|---|---|"]
        for r in oom:
            n = r["needed"]
            lines.append(f"| {r['label']} | {_gib(r['card_bytes'])} | {_gib(n[1])} ({_gib(n[0])}-{_gib(n[2])}) | "
                         f"{_gib(r['model_states'])} | {r['verdict']} | {r['source']} | {r['setup']} |")
    lines += ["", "## Where the goals are missed, and why", ""] + misses(rows, oom)
    lines += ["", "## Sources and setups", ""]
    seen = set()
    for r in rows:
        key = (r["group"], r["source"])
        if key not in seen:
            seen.add(key)
            lines.append(f"- **{r['group']}**: {r['source']}. {r['setup']}.")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-published.md"))
    parser.add_argument("--peers", default="/tmp/peers", help="folder with torchvision and timm (pip --target)")
    parser.add_argument("--era-transformers", default=ERA_TRANSFORMERS,
                        help="folder with transformers 4.16 (pip --target) for the v100-hf rows, run in a subprocess")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # score --groups here and write JSON to this path
    parser.add_argument("--render", action="store_true", help="rewrite the Markdown from --out's JSON, no scoring")
    args = parser.parse_args()
    if args.render:
        stored = json.loads(Path(args.out).with_suffix(".json").read_text())
        write(Path(args.out), stored["environment"], stored["rows"] + stored.get("oom_rows", []),
              stored.get("not_scored", []))
        return
    groups = args.groups.split(",")
    scored, skipped = [], []
    for name in groups:
        if name in ERA_GROUPS and not args.child:  # another transformers: its own process
            part = _score_in_subprocess(name, args)
        else:
            part = _score_groups([name], args.peers)
        scored += part["rows"]
        skipped += part["not_scored"]
    if args.child:
        Path(args.child).write_text(json.dumps({"rows": scored, "not_scored": skipped}, default=str))
        return
    env = _environment()
    env["era_transformers"] = _era_version(args.era_transformers)
    write(Path(args.out), env, scored, skipped)


ERA_GROUPS = {"v100-hf"}  # groups whose model code is another transformers than memest's own


def _score_groups(groups: list[str], peers: str) -> dict:
    if peers not in sys.path:
        sys.path.append(peers)
    python_only_torchvision()
    scored, skipped = [], []
    for row in (row for name in groups for row in GROUPS[name]()):
        try:
            scored.append(score(row))
        except Exception as exc:  # noqa: BLE001 -- a model whose code cannot be imported here is listed, not lost
            skipped.append({"group": row.group, "label": row.label, "reason": str(exc).splitlines()[0][:300]})
            print(f"{row.group:8} {row.label:60} NOT SCORED: {skipped[-1]['reason']}", flush=True)
            continue
        if scored[-1].get("oom"):
            r = scored[-1]
            print(f"{row.group:8} {row.label:60} ran out of memory on {_gib(row.card_bytes)} GiB; memest needs "
                  f"{_gib(r['needed'][1])} ({_gib(r['needed'][0])}-{_gib(r['needed'][2])}): {r['verdict']}", flush=True)
            continue
        s = scored[-1]["in_sample"]
        print(f"{row.group:8} {row.label:60} measured {_gib(row.measured_bytes)} GiB, expected {_gib(s['expected'])} "
              f"({s['error_pct']:+.2f}%), inside {s['inside']}, {s['verdict']}", flush=True)
    return {"rows": scored, "not_scored": skipped}


def _score_in_subprocess(group: str, args) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (args.era_transformers,
                                                                       os.environ.get("PYTHONPATH")) if p)}
        subprocess.run([sys.executable, __file__, "--groups", group, "--peers", args.peers, "--child", str(out)],
                       env=env, check=True)
        return json.loads(out.read_text())


def _era_version(folder: str) -> str | None:
    found = sorted(Path(folder).glob("transformers-*.dist-info"))
    return found[0].name.removeprefix("transformers-").removesuffix(".dist-info") if found else None


def oom_summary(rows: list[dict]) -> dict:
    said = {v: [r["label"] for r in rows if r["verdict"] == v] for v in ("fits", "tight", "does-not-fit")}
    trivial = [r["label"] for r in rows if r["model_states"] > r["card_bytes"]]
    return {"rows": len(rows), "verdicts": said, "fits_but_exceeded": said["fits"],
            "model_states_alone_exceed_card": trivial,
            "goals": {"no_fits_but_exceeded": not said["fits"]}}


def summaries(scored: list[dict]) -> dict:
    groups = {}
    for name in dict.fromkeys(r["group"] for r in scored):
        part = [r for r in scored if r["group"] == name]
        groups[f"{name} (in-sample)" if name == "h100" else name] = summary(part, "in_sample")
        if name == "h100":
            groups["h100 (leave-one-out)"] = summary(part, "leave_one_out")
            modelled = [r for r in part if not unmodelled(r)]
            groups["h100 leave-one-out, without cudnn.benchmark-on and LSTM runs"] = summary(modelled, "leave_one_out")
    groups["all rows (h100 in-sample)"] = summary(scored, "in_sample")
    loo_all = [{**r, "mixed": r.get("leave_one_out", r["in_sample"])} for r in scored]
    groups["all rows (h100 leave-one-out)"] = summary(loo_all, "mixed")
    return groups


def write(out: Path, env: dict, scored: list[dict], skipped: list[dict]) -> None:
    oom = [r for r in scored if r.get("oom")]
    measured = [r for r in scored if not r.get("oom")]
    groups = summaries(measured) if measured else {}
    if oom:
        groups["oom (ran out of memory on the card)"] = oom_summary(oom)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "summary": groups, "rows": measured,
                                                    "oom_rows": oom, "not_scored": skipped},
                                                   indent=2, default=str) + "\n")
    out.write_text(markdown(env, measured, groups, skipped, oom))
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
