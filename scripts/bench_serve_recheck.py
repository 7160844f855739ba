"""What re-checking serve's fixes costs: plan_serve with and without the re-check, each in a fresh process (no
cache carried over), median of N runs; wall and CPU seconds, and how many profile runs were traced.

    PYTHONPATH=$PWD python scripts/bench_serve_recheck.py [--runs 3] [--modes off,on,fixes-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

GiB = 2**30
CASES = {  # name -> (model, total bytes, card, ServeSpec extras)
    "tinyllama-1.1b on 1 GB (tp 2 cannot start)": ("hf:tinyllama-1.1b", 10**9, None,
                                                   {"max_num_batched_tokens": 256, "max_num_seqs": 8}),
    "llama-3-8b on 16 GiB (tp 2 starts)": ("hf:llama-3-8b", 16 * GiB, "rtx4080", {}),
    "llama-3-8b on 10 GiB (tp 8 starts)": ("hf:llama-3-8b", 10 * GiB, "rtx3080", {}),
}

CHILD = r"""
import json, sys, time
from memest.serve import profile as prof, vllm
from memest.serve.plan import ServeSpec, load_config, plan_serve
model, total, card, extra, mode = json.loads(sys.argv[1])
recheck = mode != "off"
if mode == "fixes-only":  # the engine's fixes re-checked, no larger-GPU search (what main re-checked)
    import memest.serve.plan as plan_module
    plan_module._larger_gpu = lambda *a: None
config = load_config(model)
traced = []
real = vllm.trace_profile_run
def counted(*a, **k):
    traced.append(a[1])
    return real(*a, **k)
vllm.trace_profile_run = counted
cc = {"rtx4080": (8, 9), "rtx3080": (8, 6)}.get(card, (9, 0))
spec = ServeSpec(model, total, card, compute_capability=cc, **extra)
w, c = time.perf_counter(), time.process_time()
plan = plan_serve(spec, config, recheck=recheck)
print(json.dumps({"wall": time.perf_counter() - w, "cpu": time.process_time() - c, "traced_tp": traced,
                  "verdict": plan.verdict, "fixes": plan.fixes,
                  "larger_gpu": getattr(plan, "larger_gpu", None)}))
"""


def _child(model, total, card, extra, mode) -> dict:
    for _ in range(2):  # one retry: a child that fails prints why on stderr
        done = subprocess.run([sys.executable, "-c", CHILD, json.dumps([model, total, card, extra, mode])],
                              capture_output=True, text=True)
        if done.returncode == 0:
            return json.loads(done.stdout.splitlines()[-1])
        print(f"child failed (rc {done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
    raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--modes", default="off,on", help="off: no re-check; on: the re-check; fixes-only: the re-check "
                    "without the larger-GPU search")
    args = ap.parse_args()
    runs = args.runs
    for name, (model, total, card, extra) in CASES.items():
        for mode in args.modes.split(","):
            out = [_child(model, total, card, extra, mode) for _ in range(runs)]
            wall = statistics.median(o["wall"] for o in out)
            cpu = statistics.median(o["cpu"] for o in out)
            print(f"{name} | re-check {mode} | wall {wall:.2f} s | cpu {cpu:.2f} s | traced at tp "
                  f"{out[0]['traced_tp']} | {out[0]['verdict']} | fixes {out[0]['fixes']} | larger GPU "
                  f"{out[0]['larger_gpu']}")


if __name__ == "__main__":
    main()
