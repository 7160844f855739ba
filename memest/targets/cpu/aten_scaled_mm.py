"""torch._scaled_mm on the CPU (torchao --fp8 with --target cpu): ATen's emulated float8 matmul.

torch's CPU kernel (aten/src/ATen/native/Blas.cpp, ``_scaled_mm_out_cpu_emulated``) has no float8 GEMM: it
makes each operand contiguous (a float8 copy where it is not), casts it to float32 and multiplies it by its scale
(``at::mul(mat.to(kFloat), scale)``: the cast freed after the product), then ``at::matmul`` in float32 and copies
the result into the output. Held at its peak, besides the output the fake kernel shows: the float8 contiguous
copies, the float32 scaled ``mat1`` (4 B x M x K) and ``mat2`` (4 B x K x N) and, the larger of, ``mat2``'s
float32 cast before its product is taken, or the float32 product (4 B x M x N, plus its cast to ``out_dtype``
where that is not float32). A tensorwise scale also makes three 4 B scalar tensors, live while ``mat2`` is cast (not at the product).
Checked byte for byte against torch.profiler on real CPU calls (tests/test_fp8.py, 2.13.0+cpu), contiguous and
transposed operands, tensorwise and rowwise scales, float32 and bfloat16 outputs. On CUDA cuBLASLt multiplies
the float8 operands directly (its workspace is the CUDA target's matmul workspace).

On a CPU with AMX, ``_scaled_mm_out_cpu`` takes oneDNN's float8 matmul instead (``mkldnn_scaled_mm``,
aten/src/ATen/native/mkldnn/Linear.cpp) where oneDNN is enabled, both scales are single elements (tensorwise), and
the CPU has AMX-INT8 (both operands one float8 dtype) or AMX-FP16 (mixed dtypes, as torchao's backward e4m3 x e5m2
matmuls are). It holds, besides the output, the contiguous copies of non-contiguous operands and three 4 B scale
tensors (``ideep::tensor(scale_t)`` for source, weights and destination); measured on an Intel Xeon with AMX-INT8
and AMX-BF16 (not AMX-FP16), torch 2.13.0+cpu, 6 shapes x 4 layouts x 2 output dtypes: output + copies + 12 B
every time (tests/test_fp8.py)."""

from __future__ import annotations

import functools

import torch

SCALAR_TEMPORARIES = 12  # B: three 4 B scalar tensors of a tensorwise call, live while mat2 is cast (torch.profiler, 2.13)
ONEDNN_SCALES = 12  # B: mkldnn_scaled_mm's three 1-element float32 scale tensors (src, weights, dst), at its peak


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), ()))
    except OSError:
        return frozenset()


def _has_amx_int8() -> bool:
    """cpuinfo_has_x86_amx_int8, which torch does not expose: Linux's 'amx_int8' CPU flag, else AMX tiles (every
    AMX CPU so far, Sapphire Rapids on, has AMX-INT8 with them)."""
    flags = _cpu_flags()
    return "amx_int8" in flags if flags else torch.cpu._is_amx_tile_supported()


def onednn_path(mat1, mat2, scale_a, scale_b) -> bool:
    """Whether torch 2.13's ``_scaled_mm_out_cpu`` runs oneDNN's float8 matmul for these operands (module docstring)."""
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if scale_a is None or scale_b is None or scale_a.numel() != 1 or scale_b.numel() != 1:
        return False
    return _has_amx_int8() if mat1.dtype == mat2.dtype else torch.cpu._is_amx_fp16_supported()


def scaled_mm_scratch(args, kwargs) -> list[int]:
    """Bytes the CPU kernel holds besides its output (the module docstring)."""
    mat1, mat2 = args[0], args[1]
    scale_a = args[2] if len(args) > 2 else kwargs.get("scale_a")
    scale_b = args[3] if len(args) > 3 else kwargs.get("scale_b")
    out_dtype = (args[6] if len(args) > 6 else kwargs.get("out_dtype")) or mat1.dtype
    m, k = mat1.shape
    n = mat2.shape[1]
    sizes = [mat.numel() * mat.element_size() for mat in (mat1, mat2) if not mat.is_contiguous()]
    if onednn_path(mat1, mat2, scale_a, scale_b):
        return [*sizes, ONEDNN_SCALES]
    product = 4 * m * n + (m * n * out_dtype.itemsize if out_dtype != torch.float32 else 0)
    scalars = SCALAR_TEMPORARIES if scale_a is not None and scale_a.numel() == 1 else 0
    return [*sizes, 4 * m * k, 4 * k * n, max(4 * k * n + scalars, product)]
