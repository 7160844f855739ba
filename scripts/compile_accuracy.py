"""The compiled step (torch.compile, Inductor) against real compiled runs on CPU, both loops, and what the
alternatives would have read: the eager trace of the same model (--no-compile) and Inductor's debugging
backend aot_eager_decomp_partition (its decompositions and partitioner, graphs run op by op: no fusion).
Writes benchmarks/compile-accuracy.md (+ .json).

Usage: python scripts/compile_accuracy.py [--out benchmarks/compile-accuracy.md] [--render: the .md from the .json]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from pathlib import Path

from _machine import cpu_model  # noqa: E402  (scripts/ is on sys.path when run)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.validate.cpu_truth import measure_cpu_peak  # noqa: E402
from tests.conftest import model_ref  # noqa: E402

# (label, model, batch, seq, optimizer, activation_memory_budget, loops)
CASES = [
    ("nanoGPT-style GPT (tests/models/nanogpt.py)", "nanogpt", 4, 64, "adamw", 1.0, ("kept", "freed")),
    ("MLP, GELU (tests/models/gelu_mlp.py)", "gelu_mlp", 1024, None, "sgd", 1.0, ("kept", "freed")),
    ("MLP, GELU, activation_memory_budget 0.5", "gelu_mlp", 1024, None, "sgd", 0.5, ("kept",)),
    ("MLP (examples/mlp.py)", "mlp", 2048, None, "sgd", 1.0, ("kept",)),
    ("nn.TransformerEncoder LM (examples/transformer.py)", "transformer", 2, 64, "adamw", 1.0, ("kept", "freed")),
    ("transformers GPT-2, tiny config (hf:tests/configs/gpt2-tiny.json)", "hf:gpt2-tiny", 4, 64, "adamw", 1.0, ("kept",)),
    ("transformers Llama, tiny config (hf:tests/configs/llama-tiny.json)", "hf:llama-tiny", 2, 64, "adamw", 1.0,
     ("kept",)),
]


def _with_backend(source, backend: str):
    build = source.build_model
    return dataclasses.replace(source, build_model=lambda: torch.compile(build(), backend=backend))


def _peak(source, spec) -> int:
    return trace_step(source, spec).peak()[0]


def measure(name, batch, seq, optim, budget, outputs) -> dict:
    ref = model_ref(name)
    source = load_source(ref)
    compiled = RunSpec(model=ref, batch=batch, seq=seq, optim=optim, target="cpu", outputs=outputs, compile=True)
    eager = dataclasses.replace(compiled, compile=False)
    with torch._functorch.config.patch(activation_memory_budget=budget):
        start = time.perf_counter()
        estimate = _peak(source, compiled)
        seconds = time.perf_counter() - start
        real = measure_cpu_peak(source, compiled)["peak_bytes"]
        real_eager = measure_cpu_peak(source, eager)["peak_bytes"]
        eager_estimate = _peak(source, eager)
        op_by_op = _peak(_with_backend(source, "aot_eager_decomp_partition"), dataclasses.replace(compiled, compile=None))
    return {
        "real_compiled": real, "real_eager": real_eager, "memest_compiled": estimate, "memest_eager": eager_estimate,
        "aot_eager_decomp_partition": op_by_op, "trace_seconds": round(seconds, 1),
    }


def _pct(x: int, real: int) -> str:
    return f"{100 * (x - real) / real:+.2f}%"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "compile-accuracy.md"))
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the existing .json, no runs")
    args = parser.parse_args()
    if args.render:
        doc = json.loads(Path(args.out).with_suffix(".json").read_text())
        _write(doc["machine"], doc["rows"], Path(args.out))
        return
    rows = []
    for label, name, batch, seq, optim, budget, loops in CASES:
        for outputs in loops:
            row = {"case": label, "batch": batch, "seq": seq, "optim": optim, "budget": budget, "outputs": outputs}
            row.update(measure(name, batch, seq, optim, budget, outputs))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    machine = {"cpu": cpu_model(), "torch": torch.__version__, "python": platform.python_version(),
               "threads": torch.get_num_threads()}
    Path(args.out).with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=1) + "\n")
    _write(machine, rows, Path(args.out))


# What the rows do not show, found with scripts/probe_compile_retention.py (its output is quoted)
NOTES = [
    "",
    "Why the transformers GPT-2 row reads -11.4% (`python scripts/probe_compile_retention.py`: torch.profiler memory "
    "events and the garbage collector, torch 2.13.0, transformers 5.23.0). The real step holds one logits-sized buffer "
    "(batch 4 x seq 64 x vocab 1000 x 4 B = 1,024,000 B) more than the traced one: the first call's output. After "
    "one compiled step with the loop's reference dropped, its logits are still alive; the "
    "`CausalLMOutputWithCrossAttentions` holding them is the value of a dynamo `OrderedDictVariable` "
    "(source: the local `self` of a frame dynamo traced, an input) in dynamo's side-effects state, and "
    "`gc.collect()` frees it (8,796 unreachable objects): a reference cycle, released by Python's cyclic garbage "
    "collector, not when the loop drops the output. No collection ran during the two measured steps, so the "
    "first call's logits are alive at step 2's peak (profiler: step 1's forward allocates them in the compiled "
    "region `Torch-Compiled Region: 1/0 < 0/0` and nothing frees them in the window). The compiled forward of "
    "this model graph-breaks once, at transformers' `logger.warning_once` (`loss_type=None` ... in "
    "`loss_function`). memest traces the same compiled graphs and frees that output when the next forward returns; "
    "it does not model an output held until the collector runs (its lifetime is set by when CPython collects, "
    "not by the step), so on models whose compiled forward keeps such a cycle the estimate is low by the "
    "first call's output. The Llama row's -1.85% (98,304 B) is not analysed yet.",
    "",
    "An earlier note here read -0.03% for GPT-2 against a second compiled run in the same process. That was a "
    "measurement artefact, now fixed: in the second run the collector freed the first run's leftover logits "
    "(allocated while the first run was profiled, so known to the allocator's running total) during dynamo's "
    "tracing, which lowered the running total that memest/validate/cpu_truth.py measured the peak from by "
    "1,024,000 B (probe: 8,002,728 B from the running total, 9,026,732 B from blocks allocated in the window, "
    "without inputs). cpu_truth now counts only blocks allocated inside the profiled window (`_step_peak`); the "
    "first and the second run then read the same 9,026,732 B.",
]


def _write(machine: dict, rows: list[dict], out: Path) -> None:
    lines = [
        "# torch.compile: the compiled step against real compiled runs (CPU)",
        "",
        f"`python scripts/compile_accuracy.py` on {machine['cpu']}, torch {machine['torch']}, "
        f"{machine['threads']} threads. Real: the same loop through the real `torch.compile` (Inductor, C++ kernels "
        "built with gcc), peak from torch.profiler memory events (memest/validate/cpu_truth.py). Errors are against "
        "the real compiled run. memest compiled: `--compile` (features/compiled.py: Inductor run under fake tensors, "
        "kernels not compiled). Eager trace: what the eager step reads (`--no-compile`). aot_eager_decomp_partition: "
        "Inductor's decompositions and partitioner with every graph op run, unfused.",
        "",
        "| case | loop | real compiled | real eager | memest compiled | eager trace | aot_eager_decomp_partition | trace s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        real = r["real_compiled"]
        lines.append(
            f"| {r['case']} (batch {r['batch']}{', seq ' + str(r['seq']) if r['seq'] else ''}, {r['optim']}) | "
            f"{r['outputs']} | {real:,} | {r['real_eager']:,} ({_pct(r['real_eager'], real)}) | "
            f"{r['memest_compiled']:,} ({_pct(r['memest_compiled'], real)}) | {_pct(r['memest_eager'], real)} | "
            f"{_pct(r['aot_eager_decomp_partition'], real)} | {r['trace_seconds']} |"
        )
    lines += NOTES
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {out}", file=sys.stderr)




if __name__ == "__main__":
    main()
