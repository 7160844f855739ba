"""The cost of memest.preflight and of the Transformers callback's estimate (issue 25: "they cost under a few
seconds"): wall time, median of --runs runs after one warm-up run, and the peak resident-memory growth during
one run after them (sampled every 2 ms; a control run clones the weights to show the sampler sees a copy), for a tiny Llama (tests/configs/llama-tiny.json) and GPT-2 small (transformers'
GPT2Config() defaults: 124M parameters), both built for real on the CPU first. Writes one JSON line per case.

    PYTHONPATH=$PWD python scripts/bench_preflight.py --runs 5
    PYTHONPATH=$PWD python scripts/bench_preflight.py --cold 5   # first call in each of 5 fresh processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

import memest
from memest.integrations.transformers import estimate_config

ROOT = Path(__file__).resolve().parent.parent


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn):
    base, peak, done = rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        fn()
    finally:
        done.set()
        t.join()
    return max(peak[0], rss()) - base


def case(name, config, batch, seq, runs):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    sample = {"input_ids": ids, "labels": ids}

    def pre():
        memest.preflight(model, opt, sample, gpu="a100")

    def cb():
        estimate_config(model.config, "a100", 0.0, {"batch": batch, "seq": seq, "optim": "adamw"})

    out = {"case": name, "params": params, "param_bytes": params * 4, "batch": batch, "seq": seq}
    for label, fn in (("preflight", pre), ("trainer_callback_estimate", cb)):
        fn()  # warm-up: imports, caches
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        out[f"{label}_median_s"] = round(statistics.median(times), 3)
        out[f"{label}_runs_s"] = [round(t, 3) for t in times]
        out[f"{label}_rss_growth_bytes"] = peak_growth(fn)
    # the control: the same sampler sees a real copy of the weights
    out["control_weight_copy_rss_growth_bytes"] = peak_growth(lambda: [p.detach().clone() for p in model.parameters()])
    return out


COLD = """
import json, time, torch
from transformers import AutoConfig, AutoModelForCausalLM
import memest
m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**json.load(open("tests/configs/llama-tiny.json"))))
o = torch.optim.AdamW(m.parameters()); ids = torch.randint(0, 1000, (2, 32))
t = time.perf_counter(); memest.preflight(m, o, {"input_ids": ids, "labels": ids}, gpu="a100")
print(time.perf_counter() - t)
"""


def cold(n: int) -> None:
    """The first preflight (llama-tiny) in each of ``n`` fresh processes: torch, transformers, memest imported."""
    import subprocess
    import sys

    times = [float(subprocess.run([sys.executable, "-c", COLD], cwd=ROOT, capture_output=True, text=True,
                                  check=True).stdout.split()[-1]) for _ in range(n)]
    print(json.dumps({"case": "llama-tiny first call", "runs_s": [round(t, 3) for t in times],
                      "median_s": round(statistics.median(times), 3)}))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cold", type=int, default=0, help="time the first call in N fresh processes instead")
    args = parser.parse_args()
    if args.cold:
        return cold(args.cold)
    tiny = AutoConfig.for_model(**json.loads((ROOT / "tests/configs/llama-tiny.json").read_text()))
    print(json.dumps({"torch": torch.__version__, "cpus": os.cpu_count(), "load": os.getloadavg()}))
    for name, cfg, b, s in (("llama-tiny", tiny, 2, 32), ("gpt2-small", GPT2Config(), 8, 1024)):
        print(json.dumps(case(name, cfg, b, s, args.runs)), flush=True)


if __name__ == "__main__":
    main()
