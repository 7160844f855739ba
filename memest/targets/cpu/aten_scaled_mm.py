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
the float8 operands directly (its workspace is the CUDA target's matmul workspace)."""

from __future__ import annotations

import torch

SCALAR_TEMPORARIES = 12  # B: three 4 B scalar tensors of a tensorwise call, live while mat2 is cast (torch.profiler, 2.13)


def scaled_mm_scratch(args, kwargs) -> list[int]:
    """Bytes the CPU kernel holds besides its output (the module docstring)."""
    mat1, mat2 = args[0], args[1]
    scale_a = args[2] if len(args) > 2 else kwargs.get("scale_a")
    out_dtype = (args[6] if len(args) > 6 else kwargs.get("out_dtype")) or mat1.dtype
    m, k = mat1.shape
    n = mat2.shape[1]
    sizes = [mat.numel() * mat.element_size() for mat in (mat1, mat2) if not mat.is_contiguous()]
    product = 4 * m * n + (m * n * torch.empty((), dtype=out_dtype).element_size() if out_dtype != torch.float32 else 0)
    scalars = SCALAR_TEMPORARIES if scale_a is not None and scale_a.numel() == 1 else 0
    return [*sizes, 4 * m * k, 4 * k * n, max(4 * k * n + scalars, product)]
