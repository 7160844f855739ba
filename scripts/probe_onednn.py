"""Kernel-level evidence for memest's CPU kernel scratch rules (memest/trace/cpu/): run oneDNN LSTMs and
convolutions for real on this CPU, measure the bytes each aten call allocates (torch.profiler memory
events: memest.validate.op_truth) next to memest's rule for the same call, and record which oneDNN
implementation ran (oneDNN's verbose log). Writes benchmarks/onednn-scratch.md (+ .json).

Usage: python scripts/probe_onednn.py [--out benchmarks/onednn-scratch.md]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _machine import cpu_model  # noqa: E402  (scripts/ is on sys.path when run)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from memest.targets.cpu import conv_modelled, cpu_kernels  # noqa: E402
from memest.validate.op_truth import measure_ops  # noqa: E402

# (input, hidden, layers, bidirectional, batch_first, seq, batch, bias)
LSTMS = [
    (64, 128, 1, False, True, 32, 8, True),
    (64, 128, 2, False, True, 32, 8, True),
    (32, 96, 2, True, False, 24, 6, True),
    (100, 200, 2, False, True, 17, 5, True),
    (48, 256, 1, True, True, 9, 130, True),
    (300, 64, 1, False, False, 40, 3, False),
    (256, 256, 1, False, False, 12, 16, True),
    (7, 33, 3, True, True, 5, 2, True),
    (512, 1024, 1, False, True, 4, 64, True),
]
# bf16 LSTMs: oneDNN's brgemm RNN on CPUs with AVX512-BF16 or AMX (its small buffers not modelled)
LSTMS_BF16 = [(64, 128, 1, False, True, 32, 8, True), (32, 96, 2, True, False, 24, 6, True), (100, 200, 1, False, True, 17, 150, True)]

# (in, out, kernel, stride, padding, dilation, groups, dims, size, channels_last, transposed)
CONVS = [
    (16, 16, 3, 1, 1, 1, 1, 2, 16, False, False),
    (32, 64, 3, 1, 1, 1, 1, 2, 16, False, False),
    (40, 80, 3, 1, 1, 1, 1, 2, 16, False, False),
    (64, 128, 3, 1, 1, 1, 1, 2, 16, False, False),
    (3, 16, 3, 1, 1, 1, 1, 2, 16, False, False),
    (1, 8, 3, 1, 1, 1, 1, 2, 16, False, False),
    (8, 8, 3, 1, 1, 1, 1, 2, 16, False, False),
    (12, 20, 3, 1, 1, 1, 1, 2, 16, False, False),
    (32, 64, 3, 2, 1, 1, 1, 2, 16, False, False),
    (40, 80, 3, 2, 1, 1, 1, 2, 16, False, False),
    (32, 32, 5, 1, 2, 1, 1, 2, 16, False, False),
    (3, 64, 7, 2, 3, 1, 1, 2, 32, False, False),
    (64, 64, 1, 1, 0, 1, 1, 2, 16, False, False),
    (40, 24, 1, 1, 0, 1, 1, 2, 16, False, False),
    (64, 128, 1, 2, 0, 1, 1, 2, 16, False, False),
    (32, 32, 3, 1, 2, 2, 1, 2, 16, False, False),
    (16, 16, 3, 1, 1, 1, 16, 2, 16, False, False),
    (40, 40, 3, 1, 1, 1, 40, 2, 16, False, False),
    (13, 13, 3, 1, 1, 1, 13, 2, 16, False, False),
    (40, 40, 5, 1, 2, 1, 40, 2, 16, False, False),
    (40, 40, 7, 1, 3, 1, 40, 2, 16, False, False),
    (96, 96, 7, 1, 3, 1, 96, 2, 28, False, False),
    (40, 40, 3, 2, 1, 1, 40, 2, 16, False, False),
    (32, 32, 3, 1, 1, 1, 2, 2, 16, False, False),
    (64, 64, 3, 1, 1, 1, 4, 2, 16, False, False),
    (48, 48, 3, 1, 1, 1, 8, 2, 16, False, False),
    (48, 48, 3, 1, 1, 1, 3, 2, 16, False, False),
    (80, 96, 7, 1, 3, 1, 1, 1, 256, False, False),
    (96, 96, 1, 1, 0, 1, 1, 1, 256, False, False),
    (32, 64, 3, 2, 1, 1, 1, 1, 256, False, False),
    (96, 96, 7, 1, 9, 3, 1, 1, 256, False, False),
    (96, 1, 7, 1, 3, 1, 1, 1, 256, False, False),
    (3, 192, 16, 16, 0, 1, 1, 2, 64, False, False),
    (3, 40, 4, 4, 0, 1, 1, 2, 64, False, False),
    (40, 80, 2, 2, 0, 1, 1, 2, 16, False, False),
    (64, 32, 2, 2, 0, 1, 1, 2, 16, False, True),
    (32, 16, 4, 2, 1, 1, 1, 2, 16, False, True),
    (40, 40, 7, 1, 3, 1, 40, 2, 16, True, False),
    (40, 80, 2, 2, 0, 1, 1, 2, 16, True, False),
    (32, 64, 3, 1, 1, 1, 1, 2, 16, True, False),
    (3, 40, 4, 4, 0, 1, 1, 2, 64, True, False),
    (64, 64, 1, 1, 0, 1, 1, 2, 16, True, False),
    (32, 64, 3, 2, 1, 1, 1, 2, 16, True, False),
    (64, 64, 3, 1, 1, 1, 4, 2, 16, True, False),
    (48, 48, 3, 1, 1, 1, 8, 2, 16, True, False),
    (40, 40, 3, 1, 1, 1, 40, 2, 16, True, False),
    (40, 40, 3, 2, 1, 1, 40, 2, 16, True, False),
    (64, 32, 2, 2, 0, 1, 1, 2, 32, True, True),
    (32, 32, 3, 1, 2, 2, 32, 2, 16, False, False),
    (24, 24, 3, 1, 1, 1, 6, 2, 16, False, False),
    (16, 32, 3, 1, 1, 1, 2, 2, 16, False, False),
    (256, 256, 3, 1, 1, 1, 1, 2, 8, False, False),
    (64, 64, 5, 2, 2, 1, 64, 2, 16, False, False),
]
THREADS = [1, 4, 8]  # extra thread counts for the configs whose scratch is per thread (gemm)
GEMM_CONVS = [c for c in CONVS if (c[6] > 1 and c[2] > 3 and not c[9]) or c[2] == 16 or c[:7] == (48, 48, 3, 1, 1, 1, 8)]


@contextlib.contextmanager
def onednn_log():
    """oneDNN's verbose lines (printed on fd 1 by the library) while the block runs."""
    lines: list[str] = []
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                yield lines
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            lines += [line.strip() for line in tmp if line.startswith("onednn_verbose") and ",exec," in line]


def _impls(lines: list[str], kinds: tuple[str, ...]) -> list[str]:
    out = []
    for line in lines:
        f = line.split(",")
        if len(f) > 7 and f[5] in kinds:
            out.append(f"{f[6]} {f[7]}")
    return out


def _lstm_case(case, dtype=torch.float32):
    inp, hidden, layers, bidir, batch_first, seq, batch, bias = case
    torch.manual_seed(0)
    module = nn.LSTM(inp, hidden, num_layers=layers, bidirectional=bidir, batch_first=batch_first, bias=bias)
    x = torch.randn(batch, seq, inp) if batch_first else torch.randn(seq, batch, inp)
    module, x = module.to(dtype), x.to(dtype)
    label = f"LSTM in {inp} hidden {hidden} layers {layers}{' bidir' if bidir else ''}{' batch_first' if batch_first else ''} seq {seq} batch {batch}{'' if bias else ' no bias'}"
    return label + ("" if dtype == torch.float32 else " bf16"), module, x


def _conv_case(case):
    cin, cout, k, stride, pad, dil, groups, dims, size, channels_last, transposed = case
    torch.manual_seed(0)
    cls = {(1, False): nn.Conv1d, (2, False): nn.Conv2d, (2, True): nn.ConvTranspose2d}[dims, transposed]
    module = cls(cin, cout, k, stride=stride, padding=pad, dilation=dil, groups=groups)
    x = torch.randn(4, cin, *(size,) * dims)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    kind = f"ConvTranspose{dims}d" if transposed else f"Conv{dims}d"
    extra = "".join(
        [f" s{stride}" if stride > 1 else "", f" d{dil}" if dil > 1 else "", f" g{groups}" if groups > 1 else "",
         " channels_last" if channels_last else ""]
    )
    label = f"{kind} {cin}->{cout} k{k}{extra} on 4x{cin}x{'x'.join([str(size)] * dims)}"
    return label, module, x.requires_grad_()


def probe(label, module, x, kinds, threads=None):
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        scratch, outputs, conv = cpu_kernels()

        def step():
            out = module(x)
            out = out[0] if isinstance(out, tuple) else out
            out.float().backward(torch.ones_like(out, dtype=torch.float32))

        with onednn_log() as lines:
            calls = measure_ops(step, scratch, outputs)
    finally:
        torch.set_num_threads(saved)
    rows = []
    for i, call in enumerate(calls):
        prims = conv.history[i] if conv.history else []
        rows.append(
            {
                "case": label,
                "threads": threads or saved,
                "op": call.op.split(".")[0],
                "memest": [p.name for p in prims],
                "scratchpad_modelled": all(p.known for p in prims) and not label.endswith(" bf16"),
                "real_peak": call.real_peak,
                "model_peak": call.model_peak,
                "real_kept": call.real_kept,
                "model_kept": call.model_kept,
                "exact": call.exact,
            }
        )
    for row in rows:
        row["onednn"] = _impls(lines, kinds)  # per case: every primitive oneDNN ran, in order
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "onednn-scratch.md"))
    args = parser.parse_args()
    start = time.perf_counter()
    rows = []
    for case in LSTMS:
        rows += probe(*_lstm_case(case), kinds=("rnn",))
    for case in LSTMS_BF16:
        rows += probe(*_lstm_case(case, torch.bfloat16), kinds=("rnn",))
    if conv_modelled():
        for case in CONVS:
            rows += probe(*_conv_case(case), kinds=("convolution", "deconvolution"))
        for case in GEMM_CONVS:
            for threads in THREADS:
                rows += probe(*_conv_case(case), kinds=("convolution", "deconvolution"), threads=threads)
    for row in rows:
        print(f"{'exact' if row['exact'] else 'off  '} {row['case']:60} {row['op']:26} "
              f"{row['model_peak'] - row['real_peak']:+9d}", file=sys.stderr)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{cpu_model()}, {platform.machine()}, {torch.get_num_threads()} threads, "
        f"ATen CPU capability {torch.backends.cpu.get_cpu_capability()}",
        "torch": torch.__version__,
        "onednn": torch.backends.mkldnn.version() if hasattr(torch.backends.mkldnn, "version") else _onednn_version(),
        "seconds": round(time.perf_counter() - start, 1),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    out.write_text(markdown(meta, rows))
    print(f"wrote {out}", file=sys.stderr)


def _onednn_version() -> str:
    for line in torch.__config__.show().splitlines():
        if "MKL-DNN" in line or "oneDNN" in line:
            return line.strip(" -")
    return "unknown"


def _kib(n: int) -> str:
    return f"{n / 1024:,.1f}"


def _dedupe(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


def markdown(meta: dict, rows: list[dict]) -> str:
    lstm = [r for r in rows if r["op"].startswith("mkldnn_rnn") and r["scratchpad_modelled"]]
    lstm_bf16 = [r for r in rows if r["op"].startswith("mkldnn_rnn") and not r["scratchpad_modelled"]]
    bf16_short = [r["real_peak"] - r["model_peak"] for r in lstm_bf16]
    conv = [r for r in rows if r["op"].startswith("convolution")]
    known = [r for r in conv if r["scratchpad_modelled"]]
    unknown = [r for r in conv if not r["scratchpad_modelled"]]
    short = [r["real_peak"] - r["model_peak"] for r in unknown if not r["exact"]]
    high = [r for r in rows if r["model_peak"] > r["real_peak"]]
    lines = [
        "# oneDNN kernel scratch on CPU: memest's rules vs the real kernels",
        "",
        f"Measured {meta['date']} on {meta['machine']}; torch {meta['torch']}, {meta['onednn']}. "
        f"Reproduce: `python scripts/probe_onednn.py` ({meta['seconds']} s); every call in "
        "benchmarks/onednn-scratch.json.",
        "",
        "Every call of an aten op whose kernel-internal buffers memest models for `--target cpu` "
        "(memest/trace/cpu/), run for real under torch.profiler memory events: the peak (most bytes allocated "
        "inside the call at once, outputs included) and the bytes left when it returns, next to memest's rule "
        "for the same call (scratch + the outputs the fake kernel makes). `oneDNN ran`: the primitives "
        "oneDNN's verbose log reported; `memest assumes`: the implementations memest's rules picked.",
        "",
        f"- **LSTM** (`mkldnn_rnn_layer` and its backward, fp32 training): {sum(r['exact'] for r in lstm)} of "
        f"{len(lstm)} calls exact to the byte (workspace, scratchpad, weight reorders, bias and gradient copies)."
        + (
            f" bf16 (oneDNN's brgemm RNN on this CPU): workspace and layouts modelled, its brgemm buffers not: "
            f"{sum(r['real_kept'] == r['model_kept'] for r in lstm_bf16)} of {len(lstm_bf16)} calls keep the exact "
            f"bytes, peaks low by {_kib(min(bf16_short))} to {_kib(max(bf16_short))} KiB."
            if lstm_bf16
            else ""
        ),
        f"- **Convolutions** (fp32, AVX-512): {sum(r['exact'] for r in known)} of {len(known)} calls whose "
        "oneDNN implementations memest models completely are exact. "
        f"{len(unknown)} calls also run an implementation whose scratchpad memest leaves out (brgemm "
        "convolutions, strided 1x1 reduce-to-unit-stride buffers, jit_avx2 backward-weights); the layouts are "
        "modelled, so "
        f"{len(unknown) - len(short)} of them are exact anyway (the scratchpad is not at the call's peak) and "
        + (
            f"{len(short)} are low by {_kib(min(short))} to {_kib(max(short))} KiB "
            f"(median {_kib(int(statistics.median(short)))} KiB)."
            if short
            else "none is off."
        ),
        f"- Calls where memest's rule gives more than the real kernel used: {len(high)}.",
        "",
        "| case | threads | oneDNN ran | memest assumes | calls exact | real peak KiB (per call) | memest KiB |",
        "|---|---:|---|---|---:|---|---|",
    ]
    cases: dict[tuple[str, int], list[dict]] = {}
    for r in rows:
        cases.setdefault((r["case"], r["threads"]), []).append(r)
    for (case, threads), group in cases.items():
        onednn = "<br>".join(_dedupe(group[0]["onednn"])) or "-"
        assumed = _dedupe([name for r in group for name in r["memest"]]) or ["oneDNN reference RNN"]
        if not all(r["scratchpad_modelled"] for r in group):
            assumed.append("(a scratchpad not modelled)")
        lines.append(
            f"| {case} | {threads} | {onednn} | {', '.join(assumed)} | {sum(r['exact'] for r in group)}/{len(group)} | "
            f"{', '.join(_kib(r['real_peak']) for r in group)} | {', '.join(_kib(r['model_peak']) for r in group)} |"
        )
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
