"""Ground truth for memest's CUDA device model, measured on a real GPU (issue 11 evidence).

Two probes, each case in a fresh process so the CUDA context and allocator start clean:

  overhead   whole-process GPU memory by stage of a training process (CUDA init, first cuBLAS GEMM,
             cuBLASLt bf16 GEMM, first cuDNN convolution forward+backward, flash SDPA, NCCL world of 1),
             under CUDA_MODULE_LOADING=LAZY (PyTorch's default) and EAGER: NVML's used memory for the
             process, torch's reserved and allocated; overhead = NVML - reserved.
  ops        per aten-level op, on CUDA and on CPU: bytes saved for backward (saved_tensors_hooks, one
             count per storage, inputs and parameters excluded), and on CUDA the forward / backward
             peak above what is live before (torch.cuda.max_memory_allocated): output + kernel scratch.

    python scripts/probe_cuda.py --out benchmarks/gpu-probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

STAGES = ["init", "cublas_fp32", "cublaslt_bf16", "cudnn_conv", "sdpa_flash", "nccl"]


def _nvml_used(pid: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == pid and proc.usedGpuMemory:
            return int(proc.usedGpuMemory)
    return 0


def overhead_child() -> dict:
    import torch
    import torch.nn.functional as F

    out = {}

    def record(stage):
        torch.cuda.synchronize()
        time.sleep(0.2)
        out[stage] = {
            "nvml_used": _nvml_used(os.getpid()),
            "reserved": torch.cuda.memory_reserved(),
            "allocated": torch.cuda.memory_allocated(),
        }

    torch.empty(1, device="cuda")
    record("init")
    a = torch.randn(1024, 1024, device="cuda")
    (a @ a).sum().item()
    record("cublas_fp32")
    b = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    bias = torch.randn(1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.linear(b, w, bias).sum().backward()
    record("cublaslt_bf16")
    x = torch.randn(8, 64, 56, 56, device="cuda", requires_grad=True)
    cw = torch.randn(64, 64, 3, 3, device="cuda", requires_grad=True)
    F.conv2d(x, cw, padding=1).sum().backward()
    record("cudnn_conv")
    q = torch.randn(4, 12, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    record("sdpa_flash")
    try:
        import torch.distributed as dist

        dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
        t = torch.ones(1024, device="cuda")
        dist.all_reduce(t)
        record("nccl")
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001
        out["nccl"] = {"error": repr(exc)}
    out["torch"] = torch.__version__
    out["cuda"] = torch.version.cuda
    out["cudnn"] = torch.backends.cudnn.version()
    out["gpu"] = torch.cuda.get_device_name(0)
    out["capability"] = list(torch.cuda.get_device_capability(0))
    return out


# ---------------------------------------------------------------------------------------------- ops


def _op_cases():  # noqa: C901 -- a table of small case factories
    """(name, make(device) -> (fn, inputs, params)); fn(*inputs) -> output (tensor or tuple)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    def t(*shape, dtype=torch.float32, grad=True, device="cpu"):
        return torch.randn(*shape, dtype=dtype, device=device, requires_grad=grad)

    def module_case(make_module, shape, dtype=torch.float32):
        def make(device):
            m = make_module().to(device=device, dtype=dtype)
            return m, (t(*shape, dtype=dtype, device=device),), list(m.parameters())
        return make

    def fn_case(fn, *shapes, dtype=torch.float32):
        def make(device):
            return fn, tuple(t(*s, dtype=dtype, device=device) for s in shapes), []
        return make

    cases = {
        "dropout_fp32": fn_case(lambda x: F.dropout(x, 0.1, True), (32, 512, 768)),
        "dropout_bf16": fn_case(lambda x: F.dropout(x, 0.1, True), (32, 512, 768), dtype=torch.bfloat16),
        "batch_norm2d_fp32": module_case(lambda: nn.BatchNorm2d(64), (32, 64, 56, 56)),
        "batch_norm2d_bf16": module_case(lambda: nn.BatchNorm2d(64), (32, 64, 56, 56), dtype=torch.bfloat16),
        "group_norm_fp32": module_case(lambda: nn.GroupNorm(32, 64), (32, 64, 56, 56)),
        "layer_norm_fp32": module_case(lambda: nn.LayerNorm(768), (8, 1024, 768)),
        "layer_norm_bf16": module_case(lambda: nn.LayerNorm(768), (8, 1024, 768), dtype=torch.bfloat16),
        "conv3x3_fp32": module_case(lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (32, 64, 56, 56)),
        "conv3x3_bf16": module_case(lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (32, 64, 56, 56), torch.bfloat16),
        "conv1x1_fp32": module_case(lambda: nn.Conv2d(256, 64, 1, bias=False), (32, 256, 56, 56)),
        "conv7x7s2_stem_fp32": module_case(lambda: nn.Conv2d(3, 64, 7, 2, 3, bias=False), (32, 3, 224, 224)),
        "conv3x3_c512_fp32": module_case(lambda: nn.Conv2d(512, 512, 3, padding=1, bias=False), (32, 512, 14, 14)),
        "lstm_fp32": module_case(lambda: nn.LSTM(512, 512, 2, batch_first=True), (32, 128, 512)),
        "gru_fp32": module_case(lambda: nn.GRU(512, 512, 1, batch_first=True), (32, 128, 512)),
        "max_pool2d_fp32": fn_case(lambda x: F.max_pool2d(x, 3, 2, 1), (32, 64, 112, 112)),
        "adaptive_avg_pool_fp32": fn_case(lambda x: F.adaptive_avg_pool2d(x, 1), (32, 2048, 7, 7)),
        "gelu_fp32": fn_case(F.gelu, (8, 1024, 3072)),
        "gelu_tanh_bf16": fn_case(lambda x: F.gelu(x, approximate="tanh"), (8, 1024, 3072), dtype=torch.bfloat16),
        "silu_bf16": fn_case(F.silu, (8, 1024, 3072), dtype=torch.bfloat16),
        "relu_fp32": fn_case(F.relu, (8, 1024, 3072)),
        "softmax_fp32": fn_case(lambda x: F.softmax(x, -1), (8, 12, 512, 512)),
        "log_softmax_fp32": fn_case(lambda x: F.log_softmax(x, -1), (4096, 50257)),
        "linear_bias_fp32": module_case(lambda: nn.Linear(768, 3072), (8, 1024, 768)),
        "linear_bias_bf16": module_case(lambda: nn.Linear(768, 3072), (8, 1024, 768), torch.bfloat16),
        "upsample_nearest_fp32": fn_case(lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), (16, 64, 64, 64)),
        "upsample_bilinear_fp32": fn_case(lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), (16, 64, 64, 64)),
        "mse_loss_fp32": fn_case(lambda x: F.mse_loss(x, torch.zeros_like(x)), (32, 1024, 1024)),
    }

    def cross_entropy(dtype):
        def make(device):
            logits = t(4096, 50257, dtype=dtype, device=device)
            target = torch.randint(0, 50257, (4096,), device=device)
            return (lambda x: F.cross_entropy(x, target)), (logits,), []
        return make

    def embedding(device):
        emb = nn.Embedding(50257, 768).to(device)
        idx = torch.randint(0, 50257, (8, 1024), device=device)
        return (lambda: emb(idx)), (), list(emb.parameters())

    def index_ops(kind):
        def make(device):
            x = t(65536, 768, device=device)
            idx = torch.randint(0, 65536, (32768,), device=device)
            if kind == "index_select":
                return (lambda v: v.index_select(0, idx)), (x,), []
            if kind == "gather":
                gidx = torch.randint(0, 768, (65536, 256), device=device)
                return (lambda v: v.gather(1, gidx)), (x,), []
            src = t(32768, 768, device=device)
            return (lambda v, s: v.index_add(0, idx, s)), (x, src), []
        return make

    def sdpa(dtype, backend):
        def make(device):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            q, k, v = (t(4, 12, 1024, 64, dtype=dtype, device=device) for _ in range(3))
            chosen = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                      "math": SDPBackend.MATH}[backend]

            def fn(q, k, v):
                backends = [chosen] if device == "cuda" else [SDPBackend.MATH]
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return fn, (q, k, v), []
        return make

    cases["cross_entropy_fp32"] = cross_entropy(torch.float32)
    cases["cross_entropy_bf16"] = cross_entropy(torch.bfloat16)
    cases["embedding_fp32"] = embedding
    for kind in ("index_select", "gather", "index_add"):
        cases[f"{kind}_fp32"] = index_ops(kind)
    cases["sdpa_flash_bf16"] = sdpa(torch.bfloat16, "flash")
    cases["sdpa_efficient_fp32"] = sdpa(torch.float32, "efficient")
    cases["sdpa_efficient_bf16"] = sdpa(torch.bfloat16, "efficient")
    cases["sdpa_math_fp32"] = sdpa(torch.float32, "math")
    return cases


def _nbytes(x) -> int:
    return x.untyped_storage().nbytes()


def op_measure(name: str, device: str, benchmark: bool) -> dict:
    import torch
    from torch.utils._pytree import tree_flatten

    torch.manual_seed(0)
    torch.backends.cudnn.benchmark = benchmark
    fn, inputs, params = _op_cases()[name](device)
    known = {t.untyped_storage().data_ptr() for t in list(inputs) + params}
    saved = {}

    def pack(x):
        ptr = x.untyped_storage().data_ptr()
        if ptr not in known and ptr not in saved:
            saved[ptr] = (_nbytes(x), str(x.dtype), list(x.shape))
        return x

    cuda = device == "cuda"
    if cuda:
        # warm-up (cuDNN / cuBLAS handles, benchmark search) outside the measurement
        out = fn(*inputs)
        (tree_flatten(out)[0][0].float().sum()).backward()
        for p in list(inputs) + params:
            p.grad = None
        del out
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(*inputs)
    outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
    out_bytes = sum(_nbytes(o) for o in outs if o.untyped_storage().data_ptr() not in known)
    result = {"saved_bytes": sum(v[0] for v in saved.values()), "saved": list(saved.values()), "output_bytes": out_bytes}
    if cuda:
        torch.cuda.synchronize()
        result["forward_peak_above_base"] = torch.cuda.max_memory_allocated() - base
        result["after_forward_above_base"] = torch.cuda.memory_allocated() - base
    head = outs[0]
    loss = head.float().sum()
    if cuda:
        torch.cuda.synchronize()
        before_bwd = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss.backward()
    if cuda:
        torch.cuda.synchronize()
        grads = sum(_nbytes(p.grad) for p in list(inputs) + params if p.grad is not None)
        result["backward_peak_above_start"] = torch.cuda.max_memory_allocated() - before_bwd
        result["input_and_param_grad_bytes"] = grads
    return result


def ops_child(benchmark: bool) -> dict:
    import torch

    results = {}
    for name in _op_cases():
        row = {}
        for device in ("cpu", "cuda"):
            try:
                row[device] = op_measure(name, device, benchmark)
            except Exception as exc:  # noqa: BLE001
                row[device] = {"error": repr(exc)[:500]}
            if device == "cuda":
                torch.cuda.empty_cache()
        results[name] = row
    return {"benchmark": benchmark, "cudnn": torch.backends.cudnn.version(), "ops": results}


def _spawn(args: list[str], env_extra: dict) -> dict:
    env = {**os.environ, **env_extra}
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, timeout=500)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"error": proc.stderr[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/gpu-probe.json")
    parser.add_argument("--child", choices=["overhead", "ops", "ops-benchmark"])
    args = parser.parse_args()
    if args.child == "overhead":
        print("RESULT " + json.dumps(overhead_child()))
        return
    if args.child in ("ops", "ops-benchmark"):
        print("RESULT " + json.dumps(ops_child(args.child == "ops-benchmark")))
        return
    import pynvml

    pynvml.nvmlInit()
    driver = pynvml.nvmlSystemGetDriverVersion()
    result = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "driver": driver.decode() if isinstance(driver, bytes) else driver, "overhead": {}}
    for loading in ("LAZY", "EAGER"):
        runs = [_spawn(["--child", "overhead"], {"CUDA_MODULE_LOADING": loading}) for _ in range(3)]
        result["overhead"][loading] = runs
        print(loading, json.dumps(runs[0])[:1500], flush=True)
    result["ops"] = _spawn(["--child", "ops"], {})
    result["ops_cudnn_benchmark"] = _spawn(["--child", "ops-benchmark"], {})
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    for name, row in result["ops"].get("ops", {}).items():
        cpu, cuda = row.get("cpu", {}), row.get("cuda", {})
        print(f"{name:26} saved cpu {cpu.get('saved_bytes', cpu.get('error'))!s:>12} cuda {cuda.get('saved_bytes', cuda.get('error'))!s:>12} "
              f"fwd peak {cuda.get('forward_peak_above_base')!s:>12} out {cuda.get('output_bytes')!s:>12} "
              f"bwd peak {cuda.get('backward_peak_above_start')!s:>12}", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
