"""Two fsdp_qlora rows of benchmarks/gpu-scale.md traced with non-reentrant and with reentrant checkpointing (the runs
used reentrant: --reentrant_checkpointing True), bf16 adapters as in the runs, at this code.

    python scripts/bench_gpu_scale_reentrant.py   # -> benchmarks/gpu-scale-reentrant.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_gpu_scale as bench  # noqa: E402


def main() -> int:
    rows = {r.label: r for r in bench.fsdp_qlora_rows()}
    out = {}
    for label in ["LoRA bs1 ctx512 (allocated)", "QLoRA bs1 ctx2048"]:
        row = rows[label]
        for policy in ("blocks", "blocks-reentrant"):
            row.spec = {**row.spec, "checkpointing": policy}
            traced = bench.trace_row(row)
            scored = bench.score(row, traced)
            out[f"{label} / {policy}"] = {"spec": row.spec, "traced": traced, "memest_bytes": scored["memest_bytes"],
                                          "error_pct": scored["error_pct"]}
            print(label, policy, traced["allocated"], traced["reserved"], round(scored["error_pct"], 2), flush=True)
            (bench.ROOT / "benchmarks" / "gpu-scale-reentrant.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
