"""Which kernel transformers' mixture-of-experts layers run, as on the device memest models.

transformers (>= 5) writes MoE experts once (``@use_experts_implementation``,
transformers/integrations/moe.py) and picks the kernel at run time:

- ``config._experts_implementation`` defaults to ``"grouped_mm"`` on every device
  (``PreTrainedModel.get_correct_experts_implementation``, transformers/modeling_utils.py), so
  ``grouped_mm_experts_forward`` runs: tokens sorted by expert, one grouped matmul per projection
  over all (token, expert) pairs, results summed per token.
- ``_can_use_grouped_mm`` (integrations/moe.py) then decides the matmul: on CPU with torch > 2.10,
  ``torch.nn.functional.grouped_mm`` (aten::_grouped_mm); on CUDA, the same if the GPU's compute
  capability is 8.0 or more, else transformers' own loop over experts
  (``transformers::grouped_mm_fallback``: a zeroed output, one ``mm`` per expert into its rows).

Fake tensors are CPU tensors, so a trace asks the CPU question. For ``--target cuda``,
``cuda_experts_dispatch`` answers the CUDA one for the target GPU while the step is traced.

Routing: in both kernels every buffer's size depends on tokens x experts-per-token, never on which
experts the router picks (the per-expert counts only move rows within the buffers), so the fake
trace is exact whatever the routing. The ``"eager"`` implementation, and MoE classes written
without the interface (DBRX, Switch Transformers, NLLB-MoE, ...), loop over the experts hit with
``nonzero``/``where``: buffer sizes there depend on the routing, which fake tensors do not have.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


def grouped_mm_on_cuda(compute_capability: tuple[int, int]) -> bool:
    """transformers' ``_can_use_grouped_mm`` on a CUDA device of this compute capability
    (integrations/moe.py: "torch.nn.functional.grouped_mm in torch>=2.10 and torch._grouped_mm in
    torch>=2.9 support SM80+ but older torch._grouped_mm in torch<=2.8 is Hopper-only")."""
    import torch

    cc = tuple(compute_capability)
    if hasattr(torch.nn.functional, "grouped_mm"):
        return cc >= (8, 0)
    if hasattr(torch, "_grouped_mm"):
        major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
        return cc >= (8, 0) if major_minor >= (2, 9) else cc[0] == 9
    return False


@contextlib.contextmanager
def cuda_experts_dispatch(compute_capability: tuple[int, int]) -> Iterator[None]:
    """While entered, transformers' MoE layers choose their matmul as on a GPU of this capability."""
    try:
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    original = getattr(moe, "_can_use_grouped_mm", None)
    if original is None:  # another transformers layout: leave it alone
        yield
        return
    use = grouped_mm_on_cuda(compute_capability)
    moe._can_use_grouped_mm = lambda input, weight, offs: use
    try:
        yield
    finally:
        moe._can_use_grouped_mm = original
