"""Accuracy of memest --target cpu against peer estimators, all checked against real CPU runs.

A zoo of small training steps (MLPs, CNNs with BatchNorm, a U-Net-like conv net, LSTMs, encoder and
decoder transformers from transformers configs, a mixture of experts; several optimizers, batch sizes,
sequence lengths, gradient accumulation, checkpointing, bf16 mixed precision). For every case:

- ground truth: memest.validate.cpu_truth.measure_cpu_peak (the real step under torch.profiler);
- memest --target cpu: trace_step(source, spec).peak()[0];
- folklore: params x n + batch x layer outputs x 2 (memest's report computes it from the trace);
- torchinfo: "Estimated Total Size" = input size + params size + forward/backward pass size;
- accelerate: "4 x model size" for Adam-family training (n/a for other optimizers: not documented);
- DeepSpeed model states: (4+4+K) x Psi bytes fp32 / (2+2+K) x Psi mixed, no activations;
- PyTorch MemTracker under FakeTensorMode (scripts/bench_speed.py's memtracker_trace).

torchinfo is not a memest dependency: install it apart, e.g. `pip install --target /tmp/peers torchinfo`,
and pass --peers /tmp/peers (the default). Usage:
    python scripts/bench_accuracy.py [--out benchmarks/accuracy.md] [--peers /tmp/peers] [--skip-memtracker]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import platform
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

from _machine import cpu_model  # noqa: E402  (scripts/ is on sys.path when run)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memest.features.registry import build, trace_step  # noqa: E402
from memest.report.analysis import analyse  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.sources.base import ModelSource  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.validate.cpu_truth import measure_cpu_peak  # noqa: E402
from tests.conftest import model_ref  # noqa: E402


# -- models defined here ---------------------------------------------------------------------------
class UNet(nn.Module):
    """U-Net-like: two conv+BN+ReLU levels down, a bottleneck, transposed convs up with skip concats."""

    def __init__(self, c: int = 16):
        super().__init__()

        def double(i, o):
            return nn.Sequential(
                nn.Conv2d(i, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
                nn.Conv2d(o, o, 3, padding=1, bias=False), nn.BatchNorm2d(o), nn.ReLU(inplace=True),
            )

        self.down1, self.down2, self.mid = double(3, c), double(c, 2 * c), double(2 * c, 4 * c)
        self.pool = nn.MaxPool2d(2)
        self.up2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2)
        self.dec2 = double(4 * c, 2 * c)
        self.up1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec1 = double(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        m = self.mid(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], dim=1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], dim=1))
        return self.out(u1)


class MoELayer(nn.Module):
    """Top-k router + expert MLPs, dense dispatch: every expert sees every token, outputs weighted by
    the (sparse, renormalised) gates, so no shape depends on data."""

    def __init__(self, d: int, hidden: int, experts: int, top_k: int):
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(experts)
        )
        self.top_k = top_k
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        h = self.norm(x)
        probs = self.router(h).softmax(dim=-1)
        weights, index = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, index, weights)  # (B, S, E)
        out = torch.stack([expert(h) for expert in self.experts], dim=-2)  # (B, S, E, d)
        return x + (gates.unsqueeze(-1) * out).sum(dim=-2)


class MoEModel(nn.Module):
    def __init__(self, vocab=1000, d=128, hidden=256, experts=4, top_k=2, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(MoELayer(d, hidden, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _unet_source() -> ModelSource:
    return ModelSource(
        name="unet",
        build_model=lambda: UNet(16),
        example_inputs=lambda batch, seq=None: (torch.randn(batch, 3, 64, 64),),
        compute_loss=lambda out, inputs: nn.functional.mse_loss(out, torch.zeros_like(out)),
        origin=f"{__file__}:UNet",
    )


def _moe_source(top_k: int) -> ModelSource:
    return ModelSource(
        name=f"moe-top{top_k}",
        build_model=lambda: MoEModel(top_k=top_k),
        example_inputs=lambda batch, seq=None: (torch.randint(0, 1000, (batch, seq or 32)),),
        compute_loss=lambda out, inputs: nn.functional.cross_entropy(out.flatten(0, 1), inputs[0].flatten()),
        default_seq=32,
        origin=f"{__file__}:MoEModel",
    )


LOCAL = {"unet": _unet_source, "moe-top1": lambda: _moe_source(1), "moe-top2": lambda: _moe_source(2)}

# (family, model, batch, seq, extra RunSpec fields)
CASES = [
    ("MLP", "mlp", 8, None, {"optim": "sgd"}),
    ("MLP", "mlp", 64, None, {"optim": "adam"}),
    ("MLP", "mlp", 8, None, {"optim": "adamw", "precision": "bf16-mixed"}),
    ("MLP", "mlp", 8, None, {"optim": "adamw", "grad_accum": 3}),
    ("MLP", "mlp", 8, None, {"optim": "adafactor"}),
    ("CNN+BN", "cnn", 8, None, {"optim": "sgd-momentum"}),
    ("CNN+BN", "cnn", 32, None, {"optim": "adamw"}),
    ("U-Net", "unet", 4, None, {"optim": "adam"}),
    ("U-Net", "unet", 8, None, {"optim": "sgd"}),
    ("RNN", "lstm", 8, 32, {"optim": "adam"}),
    ("RNN", "lstm", 16, 64, {"optim": "sgd"}),
    ("MoE", "moe-top1", 8, 32, {"optim": "adam"}),
    ("MoE", "moe-top2", 8, 64, {"optim": "adamw"}),
    ("MoE", "moe-top2", 8, 32, {"optim": "adamw", "precision": "bf16-mixed"}),
    ("enc transformer", "transformer", 2, 64, {"optim": "adamw"}),
    ("enc transformer", "transformer_ckpt", 2, 64, {"optim": "adamw"}),
    ("decoder (GPT-2)", "hf:gpt2-tiny", 4, 64, {"optim": "adamw"}),
    ("decoder (GPT-2)", "hf:gpt2-tiny", 2, 128, {"optim": "adam", "grad_accum": 2}),
    ("decoder (GPT-2)", "hf:gpt2-tiny", 4, 64, {"optim": "adamw", "checkpointing": "blocks"}),
    ("decoder (GPT-2)", "hf:gpt2-tiny", 4, 64, {"optim": "adamw", "precision": "bf16-mixed"}),
    ("decoder (Llama)", "hf:llama-tiny", 2, 64, {"optim": "adamw"}),
    ("decoder (Llama)", "hf:llama-tiny", 4, 128, {"optim": "sgd"}),
    ("encoder (BERT)", "hf:bert-tiny", 4, 32, {"optim": "adam"}),
    ("encoder (BERT)", "hf:bert-tiny", 8, 128, {"optim": "adafactor"}),
    ("enc-dec (T5)", "hf:t5-tiny", 2, 32, {"optim": "adafactor"}),
    ("encoder (ViT)", "hf:vit-tiny", 4, None, {"optim": "adamw"}),
]

ESTIMATORS = ["memest", "folklore", "torchinfo", "accelerate", "deepspeed", "memtracker"]
ADAM = ("adam", "adamw")
DEEPSPEED_K = {"sgd": 0, "sgd-momentum": 4, "adam": 8, "adamw": 8}  # optimizer state bytes per param (fp32)


def load(name: str) -> ModelSource:
    return LOCAL[name]() if name in LOCAL else load_source(model_ref(name))


def _memtracker():
    spec = importlib.util.spec_from_file_location("bench_speed", ROOT / "scripts" / "bench_speed.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.memtracker_trace


def torchinfo_estimate(source: ModelSource, spec: RunSpec) -> int:
    """torchinfo's Estimated Total Size on the real model and inputs (train mode, forward only)."""
    import torchinfo

    torch.manual_seed(0)
    built = build(source, spec)
    inputs = built.inputs
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        stats = torchinfo.summary(built.model, input_data=inputs if isinstance(inputs, dict) else list(inputs),
                                  verbose=0, mode="train", device="cpu")
    return int(stats.total_input + stats.total_param_bytes + stats.total_output_bytes)


def run_case(case, memtracker, skip_memtracker: bool) -> dict:
    family, name, batch, seq, extra = case
    extra = {"optim": "adam", "precision": "fp32", **extra}
    spec = RunSpec(model=name, batch=batch, seq=seq, target="cpu", **extra)
    source = load(name)
    technique = ", ".join(f"{k}={v}" for k, v in extra.items() if k not in ("optim", "precision")) or "-"
    row = {"family": family, "model": name, "batch": batch, "seq": seq, "optim": spec.optim,
           "precision": spec.precision, "technique": technique, "estimates": {}, "seconds": {}, "notes": {}}

    start = time.perf_counter()
    truth = measure_cpu_peak(source, spec)
    row["measured_bytes"], row["measured_op_at_peak"] = truth["peak_bytes"], truth["op_at_peak"]
    row["seconds"]["ground_truth"] = time.perf_counter() - start

    start = time.perf_counter()
    trace = trace_step(source, spec)
    row["estimates"]["memest"] = trace.peak()[0]
    row["memest_op_at_peak"] = None
    row["seconds"]["memest"] = trace_seconds = time.perf_counter() - start

    start = time.perf_counter()
    report = analyse(trace, spec, name)
    row["estimates"]["folklore"] = report.folklore_bytes
    row["notes"]["folklore"] = report.folklore_formula
    row["memest_op_at_peak"] = report.op_at_peak
    row["seconds"]["folklore"] = trace_seconds + time.perf_counter() - start  # needs memest's trace

    # parameter count on the real model (Psi)
    torch.manual_seed(0)
    model = build(source, spec).model
    params = [p for p in model.parameters() if p.requires_grad]
    psi = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    row["params"], row["param_bytes"] = psi, param_bytes
    del model, params

    start = time.perf_counter()
    try:
        row["estimates"]["torchinfo"] = torchinfo_estimate(source, spec)
    except Exception as exc:  # noqa: BLE001 -- an estimator that cannot handle a case is n/a
        row["estimates"]["torchinfo"] = None
        row["notes"]["torchinfo"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    row["seconds"]["torchinfo"] = time.perf_counter() - start

    # accelerate: "4 x model size" (model size in the loaded dtype) for Adam training; nothing for others
    if spec.optim in ADAM:
        row["estimates"]["accelerate"] = 4 * param_bytes
    else:
        row["estimates"]["accelerate"] = None
        row["notes"]["accelerate"] = f"no documented rule for {spec.optim}"
    row["seconds"]["accelerate"] = 0.0

    # DeepSpeed ZeRO paper's model states: fp32 (4 + 4 + K) Psi; mixed (2 + 2 + K) Psi, K = 12 for Adam
    if spec.optim in DEEPSPEED_K:
        if spec.mixed and spec.optim in ADAM:
            row["estimates"]["deepspeed"] = (2 + 2 + 12) * psi
            row["notes"]["deepspeed"] = "2Psi+2Psi+12Psi (mixed Adam)"
        else:
            k = DEEPSPEED_K[spec.optim]
            row["estimates"]["deepspeed"] = (4 + 4 + k) * psi
            row["notes"]["deepspeed"] = f"4Psi+4Psi+{k}Psi"
    else:
        row["estimates"]["deepspeed"] = None
        row["notes"]["deepspeed"] = f"no K for {spec.optim}"
    row["seconds"]["deepspeed"] = 0.0

    if skip_memtracker:
        row["estimates"]["memtracker"] = None
        row["notes"]["memtracker"] = "skipped"
        row["seconds"]["memtracker"] = 0.0
    else:
        start = time.perf_counter()
        try:
            row["estimates"]["memtracker"] = int(memtracker(source, spec)[0])
        except Exception as exc:  # noqa: BLE001
            row["estimates"]["memtracker"] = None
            row["notes"]["memtracker"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        row["seconds"]["memtracker"] = time.perf_counter() - start

    real = row["measured_bytes"]
    row["error_pct"] = {k: (None if v is None else 100 * (v - real) / real) for k, v in row["estimates"].items()}
    return row


def headline(rows: list[dict]) -> dict:
    out = {}
    for est in ESTIMATORS:
        errors = [abs(r["error_pct"][est]) for r in rows if r["error_pct"].get(est) is not None]
        out[est] = {
            "median_abs_error_pct": statistics.median(errors) if errors else None,
            "max_abs_error_pct": max(errors) if errors else None,
            "handled": len(errors),
            "n_a": len(rows) - len(errors),
            "wall_seconds": sum(r["seconds"].get(est, 0.0) for r in rows),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "accuracy.md"))
    parser.add_argument("--peers", default="/tmp/peers", help="folder holding torchinfo (pip install --target)")
    parser.add_argument("--skip-memtracker", action="store_true")
    parser.add_argument("--only", default=None, help="comma-separated case indices (debugging)")
    args = parser.parse_args()
    sys.path.append(args.peers)  # torchinfo, only inside this benchmark
    memtracker = _memtracker()
    cases = CASES if args.only is None else [CASES[int(i)] for i in args.only.split(",")]
    rows = []
    start_all = time.perf_counter()
    for case in cases:
        try:
            row = run_case(case, memtracker, args.skip_memtracker)
        except Exception:
            traceback.print_exc()
            continue
        rows.append(row)
        errs = "  ".join(f"{k} {'n/a' if v is None else f'{v:+.1f}%'}" for k, v in row["error_pct"].items())
        print(f"{row['model']:16} b{row['batch']} s{row['seq']} {row['optim']:12} {row['precision']:10} "
              f"{row['technique']:24} {errs}", file=sys.stderr, flush=True)
    total = time.perf_counter() - start_all
    summary = headline(rows)
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_model(),
        "cores": _cores(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "torchinfo": _version("torchinfo", args.peers),
        "command": "pip install --target /tmp/peers torchinfo && python scripts/bench_accuracy.py",
        "total_seconds": total,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=2) + "\n")
    out.write_text(markdown(meta, summary, rows))
    print(f"wrote {out} ({total:.0f} s)", file=sys.stderr)


def _fmt_err(v):
    return "n/a" if v is None else f"{v:+.1f}%"


def _mib(v):
    return "n/a" if v is None else f"{v / 2**20:.2f}"


def markdown(meta: dict, summary: dict, rows: list[dict]) -> str:
    names = {
        "memest": "memest `--target cpu`",
        "folklore": "folklore (params×n + layer outputs×2)",
        "torchinfo": "torchinfo Estimated Total Size",
        "accelerate": "accelerate 4× model size (Adam)",
        "deepspeed": "DeepSpeed model states (16Ψ Adam)",
        "memtracker": "PyTorch MemTracker (FakeTensorMode)",
    }
    no_lstm = [r for r in rows if r["model"] != "lstm"]
    lines = [
        "# Accuracy: memest vs peer estimators, against real CPU runs",
        "",
        f"Measured {meta['date']} on {meta['cpu']}, {meta['cores']} cores ({meta['torch_threads']} torch threads); "
        f"Python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"torchinfo {meta['torchinfo']}. {len(rows)} cases, {meta['total_seconds']:.0f} s in all.",
        "",
        f"Reproduce: `{meta['command']}` (torchinfo stays outside memest's environment; the script adds "
        "/tmp/peers to sys.path itself).",
        "",
        "Ground truth: `memest.validate.cpu_truth.measure_cpu_peak` — the same two-iteration training step "
        "(forward, loss, backward, optimizer.step, zero_grad) run for real under torch.profiler memory events; "
        "parameters, buffers and inputs included. Error = (estimate − measured) / measured.",
        "",
        "| estimator | median \\|err\\| | max \\|err\\| | max \\|err\\| w/o LSTM | cases handled | n/a | wall time |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for est in ESTIMATORS:
        s = summary[est]
        errs = [abs(r["error_pct"][est]) for r in no_lstm if r["error_pct"].get(est) is not None]
        med = "n/a" if s["median_abs_error_pct"] is None else f"{s['median_abs_error_pct']:.1f}%"
        mx = "n/a" if s["max_abs_error_pct"] is None else f"{s['max_abs_error_pct']:.1f}%"
        mx2 = f"{max(errs):.1f}%" if errs else "n/a"
        lines.append(f"| {names[est]} | {med} | {mx} | {mx2} | {s['handled']}/{len(rows)} | {s['n_a']} | "
                     f"{s['wall_seconds']:.1f} s |")
    lines += [
        "",
        f"Ground truth itself took {sum(r['seconds']['ground_truth'] for r in rows):.1f} s. Wall times: memest is "
        "`trace_step` alone; folklore needs memest's trace (its time includes it); accelerate and DeepSpeed are "
        "closed formulas (≈0 s); torchinfo runs the real model forward once; MemTracker runs the step on fake tensors.",
        "",
        "## Per case",
        "",
        "Measured peak in MiB; each estimator's signed error.",
        "",
        "| family | model | batch | seq | optimizer | precision | technique | params | measured MiB | memest | folklore "
        "| torchinfo | accelerate | DeepSpeed | MemTracker |",
        "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        e = r["error_pct"]
        lines.append(
            f"| {r['family']} | {r['model']} | {r['batch']} | {r['seq'] or '-'} | {r['optim']} | {r['precision']} | "
            f"{r['technique']} | {r['params']:,} | {_mib(r['measured_bytes'])} | "
            + " | ".join(_fmt_err(e[k]) for k in ESTIMATORS) + " |"
        )
    failures = [(r, k, v) for r in rows for k, v in r["notes"].items()
                if k in ("torchinfo", "memtracker") and r["estimates"].get(k) is None]
    lines += [
        "",
        "## How each estimator is computed",
        "",
        "- **memest**: `trace_step(load_source(ref), RunSpec(..., target='cpu')).peak()[0]` — the step traced on "
        "fake tensors, every storage's allocation and free.",
        "- **folklore**: `analyse(trace, spec, name).folklore_bytes` = params bytes × n (n per optimizer, memest's "
        "`FOLKLORE_N`) + leaf-module output bytes × 2.",
        "- **torchinfo** (`torchinfo.summary(model, input_data=..., verbose=0, mode='train')`): input size + params "
        "size + forward/backward pass size (2 × every layer's output). Forward only, no optimizer, no autocast; "
        "the real model and inputs memest's ground truth uses.",
        "- **accelerate**: `accelerate estimate-memory`'s documented rule, training with Adam ≈ 4 × model size "
        "(params bytes in the loaded dtype; fp32 master weights for bf16-mixed). accelerate documents no rule for "
        "SGD or Adafactor: n/a there.",
        "- **DeepSpeed**: the ZeRO paper's model-state memory, no activations: fp32 (4+4+K)Ψ with K = 8 (Adam/AdamW: "
        "two fp32 states), 4 (SGD momentum), 0 (plain SGD); bf16-mixed Adam 2Ψ+2Ψ+12Ψ = 16Ψ (K = 12: fp32 master "
        "weights, momentum, variance). Adafactor: no K, n/a.",
        "- **MemTracker**: `torch.distributed._tools.mem_tracker.MemTracker` under FakeTensorMode on the same step "
        "(scripts/bench_speed.py's `memtracker_trace`: parameters, optimizer and inputs tracked as external), "
        "peak `get_tracker_snapshot('peak')[cpu]['Total']`.",
        "",
        "## Notes",
        "",
        "- CPU kernel scratch: on CPU nn.LSTM runs oneDNN's `mkldnn_rnn_layer` (a training workspace kept for "
        "backward, kernel scratch), convolutions run oneDNN primitives that reorder tensors into blocked layouts "
        "and use scratchpads, and `mse_loss` backs its reduced loss with input-sized storage; fake kernels show "
        "none of it. memest models these from ATen's, ideep's and oneDNN's sources (memest/trace/cpu/, per-kernel "
        "evidence in benchmarks/onednn-scratch.md); MemTracker, on the fake kernels, misses them (its LSTM, U-Net "
        "and CNN rows). CUDA runs use cuDNN instead.",
        "- MemTracker agrees with memest to the byte where no such kernel is at the peak: this harness "
        "(bench_speed.py's) runs it on memest's own step (same build, fake kernels, placeholder scalars), so "
        "both see the same storages. Its "
        "n/a cases: gradient accumulation (MemTracker refuses a module run twice within one iteration: "
        "`does not support memory tracking for multiple iterative calls`), Adafactor (a data-dependent scalar read "
        "under FakeTensorMode outside memest's placeholder scalars), and examples/transformer.py "
        "(`Mixing fake modes NYI` inside nn.MultiheadAttention's forward: a tensor from another FakeTensorMode "
        "reaches the attention call under this harness; not investigated further, memest traces the case). "
        "Its wall time includes the failed attempts.",
        "- The formula estimators (accelerate, DeepSpeed) ignore activations by design; on these small models "
        "activations and temporaries are a large share of the peak, so they underestimate most where batch × seq "
        "is large relative to the parameter count. torchinfo counts layer outputs but not the optimizer state, "
        "gradients, autograd's saved tensors beyond layer outputs, or temporaries.",
        "- Cases are tiny (CPU, 2 cores), so fixed costs such as inputs and small buffers weigh more than at "
        "full scale; relative errors of the formula estimators would differ on large models.",
    ]
    if failures:
        lines += ["", "n/a because the estimator failed:", ""]
        lines += [f"- {k} on {r['model']} b{r['batch']} {r['optim']} {r['technique']}: {v}" for r, k, v in failures]
    return "\n".join(lines) + "\n"


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _version(name: str, path: str | None = None) -> str:
    try:
        from importlib.metadata import distributions, version

        if path:
            for dist in distributions(path=[path]):
                if dist.metadata["Name"].lower() == name:
                    return dist.version
        return version(name)
    except Exception:
        return "not installed"


if __name__ == "__main__":
    main()
