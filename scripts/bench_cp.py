"""Context parallel (--cp) per rank against real gloo runs: the rows of benchmarks/parallel.md's context-parallel
section. Every cp rank is traced (parallel/context_parallel.py) and compared with the ranks that run it in N real gloo
processes (memest/validate/distributed_truth.py: torch.profiler memory events); the data-parallel groups repeat the cp
ranks (global rank = dp index x cp + cp rank; with --tp M, (dp index x cp + cp rank) x M + tp rank). Also each
rank's traced peak without CP (FSDP2 over the same ranks, with --tp FSDP2 x TP, every rank a whole sequence), for
what CP saves at that length.

    python scripts/bench_cp.py            # prints the Markdown table
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from memest.features.registry import trace_step  # noqa: E402
from memest.sources import load_source  # noqa: E402
from memest.spec import RunSpec  # noqa: E402
from memest.validate.distributed_truth import measure_distributed_peaks  # noqa: E402

LLAMA = f"hf:{ROOT / 'tests/configs/llama-tiny.json'}"  # 2 layers, hidden 64, 4 heads / 2 key-value heads, vocab 1000
LONG = f"hf:{ROOT / 'tests/configs/llama-tiny-long.json'}"  # 2 layers, hidden 64, 4 heads (no GQA), vocab 512, 4096 positions
BASE = dict(model=LLAMA, batch=2, seq=32, optim="adamw", target="cpu", shard="zero3")
CASES = [  # (label, RunSpec changes)
    ("CP 2", dict(world_size=2, cp=2)),
    ("CP 2, alltoall rotation, bf16-mixed", dict(world_size=2, cp=2, cp_rotate="alltoall", precision="bf16-mixed")),
    ("CP 2, zero2 + checkpointing blocks", dict(world_size=2, cp=2, shard="zero2", checkpointing="blocks")),
    ("FSDP 2 x CP 2", dict(world_size=4, cp=2)),
    ("CP 4", dict(world_size=4, cp=4)),
    ("long: CP 2, batch 1, seq 2048", dict(model=LONG, world_size=2, cp=2, batch=1, seq=2048)),
    ("long: CP 2, batch 1, seq 2048, alltoall", dict(model=LONG, world_size=2, cp=2, batch=1, seq=2048, cp_rotate="alltoall")),
    ("long: CP 4, batch 1, seq 2048", dict(model=LONG, world_size=4, cp=4, batch=1, seq=2048)),
    ("long: FSDP 2 x CP 2, batch 1, seq 2048, bf16-mixed", dict(model=LONG, world_size=4, cp=2, batch=1, seq=2048,
                                                             precision="bf16-mixed")),
    ("CP 2 x TP 2", dict(world_size=4, cp=2, tp=2)),
    ("CP 2 x TP 2 + SP", dict(world_size=4, cp=2, tp=2, sp=True)),
    ("long: CP 2 x TP 2, batch 1, seq 2048", dict(model=LONG, world_size=4, cp=2, tp=2, batch=1, seq=2048)),
    ("long: CP 2 x TP 2 + SP, batch 1, seq 2048", dict(model=LONG, world_size=4, cp=2, tp=2, sp=True, batch=1, seq=2048)),
    ("FSDP 2 x CP 2 x TP 2", dict(world_size=8, cp=2, tp=2)),
    ("long: FSDP 2 x CP 2 x TP 2 + SP, zero2, bf16-mixed, batch 1, seq 1024",
     dict(model=LONG, world_size=8, cp=2, tp=2, sp=True, shard="zero2", precision="bf16-mixed", batch=1, seq=1024)),
]


def _specs() -> list[tuple[str, RunSpec]]:
    return [(label, RunSpec(**{**BASE, **changes})) for label, changes in CASES]


def main() -> None:
    rows = []
    cases = _specs()
    for world in sorted({s.world_size for _, s in cases}):
        group = [(label, s) for label, s in cases if s.world_size == world]
        start = time.perf_counter()
        measured = measure_distributed_peaks([s for _, s in group])
        real_seconds = time.perf_counter() - start
        for (label, spec), ranks in zip(group, measured, strict=True):
            source = load_source(spec.model)
            traced = [trace_step(source, dataclasses.replace(spec, cp_rank=r)).peak()[0] for r in range(spec.cp)]
            no_cp = trace_step(source, dataclasses.replace(spec, cp=1, cp_rotate="allgather")).peak()[0]
            for rank in ranks:
                r, real = rank["rank"], rank["peak_bytes"]
                mine = traced[r // spec.tp % spec.cp]  # the ("dp", "cp"[, "tp"]) mesh, tp innermost
                rows.append(
                    f"| {label} | {r} | {r // spec.tp % spec.cp} | {real:,} | {mine:,} | {100 * (mine - real) / real:+.3f}% | "
                    f"{no_cp:,} |"
                )
        print(f"world {world}: real runs {real_seconds:.1f} s", file=sys.stderr)
    print("| layout | rank | cp rank | measured peak (B) | memest traced (B) | error | traced without CP (B) |")
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
