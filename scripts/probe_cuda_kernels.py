"""Which aten op allocates what on a real GPU: the per-op ground truth behind memest's CUDA kernel
semantics (targets/cuda/kernels.py, docs/cuda-kernels.md).

A TorchDispatchMode sees each aten op at the level memest's tracker sees it (below autograd, one call
per op, composites already decomposed). For every op it records the memory allocated before and after
and the peak inside (torch.cuda.memory_allocated / max_memory_allocated), the bytes of the output
storages, and — from the caching allocator's own trace (torch.cuda.memory._record_memory_history) —
every allocation the op made, with the size requested, split into transient ones (freed before the op
returned: kernel workspaces, cuDNN/cub scratch) and the ones that outlive it (outputs, caches).
Allocations are attributed to ops by a uniquely named Python frame around each op call.

Groups (each in a fresh process so cuDNN's plan cache and the allocator start clean):
  ops          the cases of scripts/probe_cuda.py (forward + backward of each op)
  conv         a sweep of convolution shapes (forward, backward data, backward filter)
  rnn          cuDNN LSTM/GRU/RNN shapes: _cudnn_rnn reserve and workspace
  embedding    embedding backward (sort / segment scratch) with random and repeated tokens
  misc         mse_loss, linear with bias by dtype
  models       real models, two forward + backward steps (ResNet-50, small CNN, ConvNeXt-T, LSTM LM)
  *-bench      the same with torch.backends.cudnn.benchmark = True

    python scripts/probe_cuda_kernels.py --out /tmp/kernels.json [--groups ops,conv]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OP_FRAME = re.compile(r"^memest_op_(\d+)$")
GROUPS = ["ops", "conv", "rnn", "embedding", "misc", "models", "conv-bench", "models-bench"]


# ------------------------------------------------------------------------------------ the op probe


def _runner(i: int, cache: dict = {}):  # noqa: B006 -- a deliberate per-process cache
    """A function named memest_op_<i> that runs one op: its frame marks the op's allocations."""
    fn = cache.get(i)
    if fn is None:
        ns: dict = {}
        exec(f"def memest_op_{i}(func, args, kwargs):\n    return func(*args, **kwargs)\n", ns)  # noqa: S102
        fn = cache[i] = ns[f"memest_op_{i}"]
    return fn


def _short(x):
    import torch

    if isinstance(x, torch.Tensor):
        return f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
    if isinstance(x, (list, tuple)):
        return [_short(v) for v in x][:8]
    if isinstance(x, (int, float, bool, str)) or x is None:
        return x
    return type(x).__name__


def make_probe():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class OpProbe(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records: list[dict] = []
            self.phase = ""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            i = len(self.records)
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            out = _runner(i)(func, args, kwargs)
            peak, after = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
            outs, seen = [], set()
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    ptr = t.untyped_storage().data_ptr()
                    if ptr not in ins and ptr not in seen:
                        seen.add(ptr)
                        outs.append([t.untyped_storage().nbytes(), str(t.dtype).removeprefix("torch."), list(t.shape)])
            self.records.append({
                "i": i, "op": str(func), "phase": self.phase, "args": _short(list(args))[:6],
                "before": before, "after": after, "peak": peak, "outputs": outs,
                "transient": [], "kept": [],
            })
            return out

    return OpProbe()


def attribute(records: list[dict], snapshot: dict) -> dict:
    """Allocator trace entries -> each op's allocations (requested sizes)."""
    live: dict[int, tuple[int, int]] = {}  # addr -> (op index, size)
    unattributed = 0
    for trace in snapshot.get("device_traces", []):
        for entry in trace:
            op = None
            for frame in entry.get("frames", []) or []:
                m = OP_FRAME.match(frame.get("name", ""))
                if m:
                    op = int(m.group(1))
                    break
            action = entry.get("action")
            if action == "alloc":
                if op is None:
                    unattributed += 1
                    continue
                live[entry["addr"]] = (op, entry["size"])
                records[op]["kept"].append(entry["size"])
            elif action == "free_requested" and entry["addr"] in live:
                alloc_op, size = live.pop(entry["addr"])
                if op is not None and op == alloc_op:
                    records[op]["kept"].remove(size)
                    records[op]["transient"].append(size)
    return {"unattributed_allocs": unattributed}


def measure(run_steps, warmup: bool = True) -> dict:
    """run_steps(probe) runs the step(s) under the probe; a warm-up run first (handles, plans)."""
    import torch

    if warmup:
        run_steps(None)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    probe = make_probe()
    torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=2_000_000)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    overall = 0
    try:
        run_steps(probe)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    overall = max([r["peak"] for r in probe.records] + [torch.cuda.max_memory_allocated()])
    info = attribute(probe.records, snap)
    # ops that allocated nothing (views, in-place ops) are left out; "i" keeps each op's position
    records = [r for r in probe.records if r["outputs"] or r["transient"] or r["kept"]]
    return {"base": base, "peak_above_base": overall - base, "ops": len(probe.records), "records": records, **info}


def _with(probe, phase):
    import contextlib

    if probe is None:
        return contextlib.nullcontext()
    probe.phase = phase
    return probe


# ------------------------------------------------------------------------------------------ cases


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def fwd_bwd(fn, inputs, params):
    import torch
    from torch.utils._pytree import tree_flatten

    def run(probe):
        for p in list(inputs) + list(params):
            p.grad = None
        with _with(probe, "forward"):
            out = fn(*inputs)
            head = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)][0]
            loss = head.float().sum()
        with _with(probe, "backward"):
            loss.backward()
        del out, head, loss

    return run


def group_ops() -> dict:
    probe_cuda = _load(ROOT / "scripts" / "probe_cuda.py")
    out = {}
    for name, make in probe_cuda._op_cases().items():
        out[name] = _case(lambda make=make: fwd_bwd(*make("cuda")))
    return out


CONVS = [
    # name: (N, Cin, Cout, H, W, k, stride, pad, groups, dtype)
    ("c64_56_k3_fp32", (32, 64, 64, 56, 56, 3, 1, 1, 1, "float32")),
    ("c64_56_k3_bf16", (32, 64, 64, 56, 56, 3, 1, 1, 1, "bfloat16")),
    ("c64_56_k3_fp16", (32, 64, 64, 56, 56, 3, 1, 1, 1, "float16")),
    ("c256to64_56_k1_fp32", (32, 256, 64, 56, 56, 1, 1, 0, 1, "float32")),
    ("c64to256_56_k1_fp32", (32, 64, 256, 56, 56, 1, 1, 0, 1, "float32")),
    ("stem_224_k7s2_fp32", (32, 3, 64, 224, 224, 7, 2, 3, 1, "float32")),
    ("stem_224_k7s2_bf16", (32, 3, 64, 224, 224, 7, 2, 3, 1, "bfloat16")),
    ("c512_14_k3_fp32", (32, 512, 512, 14, 14, 3, 1, 1, 1, "float32")),
    ("c128_28_k3_b64_fp32", (64, 128, 128, 28, 28, 3, 1, 1, 1, "float32")),
    ("c128_56_k3s2_fp32", (32, 128, 128, 56, 56, 3, 2, 1, 1, "float32")),
    ("cifar_3to32_k3_b64", (64, 3, 32, 32, 32, 3, 1, 1, 1, "float32")),
    ("cifar_32to64_k3_b64", (64, 32, 64, 16, 16, 3, 1, 1, 1, "float32")),
    ("cifar_64to128_k3_b256", (256, 64, 128, 8, 8, 3, 1, 1, 1, "float32")),
    ("cifar_3to32_k3_b256", (256, 3, 32, 32, 32, 3, 1, 1, 1, "float32")),
    ("dw_96_56_k7_fp32", (32, 96, 96, 56, 56, 7, 1, 3, 96, "float32")),
    ("dw_96_56_k7_bf16", (32, 96, 96, 56, 56, 7, 1, 3, 96, "bfloat16")),
    ("patch16_768_bf16", (32, 3, 768, 224, 224, 16, 16, 0, 1, "bfloat16")),
    ("c64_112_k3_b16_fp32", (16, 64, 64, 112, 112, 3, 1, 1, 1, "float32")),
    ("c1024_7_k3_b64_fp32", (64, 1024, 1024, 7, 7, 3, 1, 1, 1, "float32")),
]


def group_conv() -> dict:
    import torch
    from torch import nn

    out = {}
    for name, (n, cin, cout, h, w, k, s, p, g, dt) in CONVS:
        def make(n=n, cin=cin, cout=cout, h=h, w=w, k=k, s=s, p=p, g=g, dt=dt):
            dtype = getattr(torch, dt)
            m = nn.Conv2d(cin, cout, k, s, p, groups=g, bias=False).to("cuda", dtype)
            x = torch.randn(n, cin, h, w, device="cuda", dtype=dtype, requires_grad=True)
            return fwd_bwd(m, (x,), list(m.parameters()))
        out[name] = _case(make)
    return out


RNNS = [
    # name: (mode, input, hidden, layers, seq, batch, bidirectional, dtype, proj)
    ("lstm_512_512_L2_T128_B32", ("LSTM", 512, 512, 2, 128, 32, False, "float32", 0)),
    ("lstm_512_1024_L2_T128_B32", ("LSTM", 512, 1024, 2, 128, 32, False, "float32", 0)),
    ("lstm_512_1024_L2_T128_B64", ("LSTM", 512, 1024, 2, 128, 64, False, "float32", 0)),
    ("lstm_512_512_L1_T128_B32", ("LSTM", 512, 512, 1, 128, 32, False, "float32", 0)),
    ("lstm_512_512_L1_T256_B32", ("LSTM", 512, 512, 1, 256, 32, False, "float32", 0)),
    ("lstm_512_512_L1_T128_B64", ("LSTM", 512, 512, 1, 128, 64, False, "float32", 0)),
    ("lstm_512_1024_L1_T128_B32", ("LSTM", 512, 1024, 1, 128, 32, False, "float32", 0)),
    ("lstm_256_512_L1_T128_B32", ("LSTM", 256, 512, 1, 128, 32, False, "float32", 0)),
    ("lstm_512_512_L1_T128_B32_bi", ("LSTM", 512, 512, 1, 128, 32, True, "float32", 0)),
    ("lstm_512_512_L4_T128_B32", ("LSTM", 512, 512, 4, 128, 32, False, "float32", 0)),
    ("lstm_512_512_L2_T128_B32_fp16", ("LSTM", 512, 512, 2, 128, 32, False, "float16", 0)),
    ("lstm_512_1024_L1_T128_B32_proj256", ("LSTM", 512, 1024, 1, 128, 32, False, "float32", 256)),
    ("lstm_128_128_L1_T50_B8", ("LSTM", 128, 128, 1, 50, 8, False, "float32", 0)),
    ("gru_512_512_L1_T128_B32", ("GRU", 512, 512, 1, 128, 32, False, "float32", 0)),
    ("gru_512_512_L2_T128_B32", ("GRU", 512, 512, 2, 128, 32, False, "float32", 0)),
    ("gru_512_1024_L1_T64_B16", ("GRU", 512, 1024, 1, 64, 16, False, "float32", 0)),
    ("rnn_tanh_512_512_L1_T128_B32", ("RNN", 512, 512, 1, 128, 32, False, "float32", 0)),
]


def group_rnn() -> dict:
    import torch
    from torch import nn

    out = {}
    for name, (mode, inp, hid, layers, seq, batch, bi, dt, proj) in RNNS:
        def make(mode=mode, inp=inp, hid=hid, layers=layers, seq=seq, batch=batch, bi=bi, dt=dt, proj=proj):
            dtype = getattr(torch, dt)
            kw = {"proj_size": proj} if proj else {}
            m = getattr(nn, mode)(inp, hid, layers, batch_first=True, bidirectional=bi, **kw).to("cuda", dtype)
            x = torch.randn(batch, seq, inp, device="cuda", dtype=dtype, requires_grad=True)
            return fwd_bwd(m, (x,), list(m.parameters()))
        out[name] = _case(make)
    return out


EMBEDDINGS = [
    # name: (vocab, dim, batch, seq, distinct tokens (0: uniform over the vocab), dtype)
    ("gpt2_b8_T1024_random", (50257, 768, 8, 1024, 0, "float32")),
    ("gpt2_b8_T1024_1000tok", (50257, 768, 8, 1024, 1000, "float32")),
    ("gpt2_b8_T1024_10tok", (50257, 768, 8, 1024, 10, "float32")),
    ("gpt2_b4_T512_random", (50257, 768, 4, 512, 0, "float32")),
    ("v10k_d512_b32_T128_random", (10000, 512, 32, 128, 0, "float32")),
    ("v32k_d2048_b4_T1024_bf16", (32000, 2048, 4, 1024, 0, "bfloat16")),
    ("small_b2_T1024", (50257, 768, 2, 1024, 0, "float32")),
    ("tiny_b1_T1024", (50257, 768, 1, 1024, 0, "float32")),
]


def group_embedding() -> dict:
    import torch
    from torch import nn

    out = {}
    for name, (vocab, dim, batch, seq, distinct, dt) in EMBEDDINGS:
        def make(vocab=vocab, dim=dim, batch=batch, seq=seq, distinct=distinct, dt=dt):
            emb = nn.Embedding(vocab, dim).to("cuda", getattr(torch, dt))
            idx = torch.randint(0, distinct or vocab, (batch, seq), device="cuda")
            return fwd_bwd(lambda: emb(idx), (), list(emb.parameters()))
        out[name] = _case(make)
    return out


def group_misc() -> dict:
    import torch
    import torch.nn.functional as F
    from torch import nn

    def t(*shape, dtype=torch.float32, grad=True):
        return torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=grad)

    out = {}
    for red in ("mean", "sum", "none"):
        def make(red=red):
            x, y = t(32, 1024, 1024), t(32, 1024, 1024, grad=False)
            return fwd_bwd(lambda v: F.mse_loss(v, y, reduction=red), (x,), [])
        out[f"mse_{red}_32M"] = _case(make)
    out["mse_mean_1M"] = _case(lambda: fwd_bwd(lambda v, y=t(8, 128, 1024, grad=False): F.mse_loss(v, y), (t(8, 128, 1024),), []))
    out["l1_mean_32M"] = _case(lambda: fwd_bwd(lambda v, y=t(32, 1024, 1024, grad=False): F.l1_loss(v, y), (t(32, 1024, 1024),), []))
    for dt in ("float32", "bfloat16", "float16"):
        for bias in (True, False):
            for dims in (3, 2):
                def make(dt=dt, bias=bias, dims=dims):
                    dtype = getattr(torch, dt)
                    m = nn.Linear(768, 3072, bias=bias).to("cuda", dtype)
                    shape = (8, 1024, 768) if dims == 3 else (8192, 768)
                    return fwd_bwd(m, (t(*shape, dtype=dtype),), list(m.parameters()))
                out[f"linear_{dt}_{'bias' if bias else 'nobias'}_{dims}d"] = _case(make)

    def linear_contig(dt):  # backward from a contiguous gradient (as inside a model), not an expanded one
        def make():
            dtype = getattr(torch, dt)
            m = nn.Linear(768, 3072).to("cuda", dtype)
            x = t(8, 1024, 768, dtype=dtype)
            g = torch.randn(8, 1024, 3072, device="cuda", dtype=dtype)

            def run(probe):
                for p in [x, *m.parameters()]:
                    p.grad = None
                with _with(probe, "forward"):
                    y = m(x)
                with _with(probe, "backward"):
                    y.backward(g)
            return run
        return make
    out["linear_bf16_bias_contig_grad"] = _case(linear_contig("bfloat16"))
    out["linear_fp32_bias_contig_grad"] = _case(linear_contig("float32"))
    for p in (0.1, 0.0):
        out[f"dropout_p{p}_fp32"] = _case(lambda p=p: fwd_bwd(lambda v: F.dropout(v, p, True), (t(32, 512, 768),), []))
    out["dropout_inplace_fp32"] = _case(lambda: fwd_bwd(lambda v: F.dropout(v * 1.0, 0.1, True, inplace=True), (t(32, 512, 768),), []))
    out["batch_norm_fp16"] = _case(lambda: fwd_bwd(*_module(nn.BatchNorm2d(64), (32, 64, 56, 56), torch.float16)))
    out["batch_norm_bf16_eval"] = _case(lambda: fwd_bwd(*_module(nn.BatchNorm2d(64).eval(), (32, 64, 56, 56), torch.bfloat16)))
    out["batch_norm1d_fp32"] = _case(lambda: fwd_bwd(*_module(nn.BatchNorm1d(768), (256, 768), torch.float32)))
    out["layer_norm_fp16"] = _case(lambda: fwd_bwd(*_module(nn.LayerNorm(768), (8, 1024, 768), torch.float16)))
    out["group_norm_bf16"] = _case(lambda: fwd_bwd(*_module(nn.GroupNorm(32, 64), (32, 64, 56, 56), torch.bfloat16)))
    out["rms_norm_bf16"] = _case(lambda: fwd_bwd(*_module(nn.RMSNorm(768), (8, 1024, 768), torch.bfloat16)))
    return out


def _module(m, shape, dtype):
    import torch

    m = m.to("cuda", dtype)
    x = torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True)
    return m, (x,), list(m.parameters())


MODELS = [
    # name: (model file, batch, seq, autocast dtype or None)
    ("resnet50_b64_fp32", ("scripts/models/tv_resnet50.py", 64, None, None)),
    ("resnet50_b64_bf16mixed", ("scripts/models/tv_resnet50.py", 64, None, "bfloat16")),
    ("cnn_b64_fp32", ("examples/cnn.py", 64, None, None)),
    ("cnn_b256_fp32", ("examples/cnn.py", 256, None, None)),
    ("convnext_tiny_b32_fp32", ("scripts/models/timm_convnext_tiny.py", 32, None, None)),
    ("lstm_lm_b32_T128", ("scripts/models/lstm_lm.py", 32, 128, None)),
]


def group_models(bench: bool) -> dict:
    import torch

    out = {}
    for name, (path, batch, seq, amp) in MODELS:
        if bench and "resnet" not in name and "cnn" not in name:
            continue

        def make(path=path, batch=batch, seq=seq, amp=amp):
            mod = _load(ROOT / path)
            torch.manual_seed(0)
            model = mod.build_model().cuda().train()
            inputs = tuple(x.cuda() for x in mod.example_inputs(batch, seq))
            torch.set_default_device("cuda")

            def run(probe):
                for _ in range(2):  # iteration 1 finds plans (benchmark); iteration 2 is the steady state
                    for p in model.parameters():
                        p.grad = None
                    with _with(probe, "forward"):
                        with torch.autocast("cuda", dtype=getattr(torch, amp or "float32"), enabled=amp is not None):
                            loss = mod.compute_loss(model(*inputs), inputs)
                    with _with(probe, "backward"):
                        loss.backward()
                    del loss
            return run
        out[name] = _case(make, warmup=False)  # the first step is part of what is measured (plan finding)
        torch.set_default_device("cpu")
    return out


def _case(make, warmup: bool = True) -> dict:
    import torch

    start = time.time()
    try:
        result = measure(make(), warmup=warmup)
    except Exception as exc:  # noqa: BLE001 -- one failing case must not lose the others
        result = {"error": repr(exc)[:800], "traceback": traceback.format_exc()[-3000:]}
    torch.cuda.empty_cache()
    result["seconds"] = round(time.time() - start, 2)
    return result


def run_group(group: str) -> dict:
    import torch

    bench = group.endswith("-bench")
    torch.backends.cudnn.benchmark = bench
    base = group.removesuffix("-bench")
    fn = {"ops": group_ops, "conv": group_conv, "rnn": group_rnn, "embedding": group_embedding, "misc": group_misc,
          "models": lambda: group_models(bench)}[base]
    return {"group": group, "cudnn_benchmark": bench, "cases": fn()}


def environment() -> dict:
    import torch

    return {"torch": torch.__version__, "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version(),
            "gpu": torch.cuda.get_device_name(0), "capability": list(torch.cuda.get_device_capability(0)),
            "allow_tf32_cudnn": torch.backends.cudnn.allow_tf32,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "gpu-kernels.json"))
    parser.add_argument("--groups", default=",".join(GROUPS))
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(run_group(args.child)), flush=True)
        return
    out = Path(args.out)
    result = {"environment": environment(), "groups": {},
              "note": "transient/kept: sizes requested from the caching allocator (its memory history); "
                      "before/after/peak: torch.cuda.memory_allocated / max_memory_allocated (block sizes)"}
    for group in args.groups.split(","):
        start = time.time()
        proc = subprocess.run([sys.executable, __file__, "--child", group], capture_output=True, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        result["groups"][group] = json.loads(line[7:]) if line else {"error": proc.stderr[-4000:]}
        out.write_text(json.dumps(result))  # after each group: a time limit keeps what is done
        print(f"{group}: {time.time() - start:.1f} s {'ok' if line else 'FAILED ' + proc.stderr[-800:]}", flush=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
