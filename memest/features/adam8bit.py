"""A memory model of bitsandbytes' Adam8bit (``bnb.optim.Adam8bit``: optim_bits=8, block-wise) and of its
paged AdamW optimizers (``PagedAdamW8bit``, ``PagedAdamW32bit``).

bitsandbytes is CUDA-only and not a memest dependency, so memest runs this stand-in on the fake
parameters. What is modelled, from bitsandbytes' Optimizer2State.init_state:
  - parameters with >= MIN_8BIT_SIZE (4096) elements: state1 and state2 as uint8 tensors shaped like
    the parameter, absmax1 and absmax2 as float32 tensors of ceil(numel / 256) blocks, and qmap1 /
    qmap2 (256 float32 values each) shared by all parameters;
  - smaller parameters: state1 and state2 in float32 (bitsandbytes' 32-bit fallback);
  - the step: bitsandbytes updates parameters and states in one fused kernel
    (optimizer_update_8bit_blockwise), which allocates nothing, so this step updates in place.
  - paged (``is_paged=True``, bitsandbytes optim/optimizer.py ``get_state_buffer``): state1 and state2 of a
    parameter with >= PAGED_MIN_NUMEL (1e5) elements are allocated by ``F.get_paged`` in CUDA unified
    memory (cudaMallocManaged), outside PyTorch's caching allocator, which the driver pages out to host
    memory under pressure: memest reports them as host-pageable memory, not device memory (``paged``
    lists them). Smaller states, absmax and qmaps are ordinary device tensors. On a CPU run bitsandbytes
    falls back to non-paged buffers (the same function), so ``--target cpu`` keeps them in the trace.
  - 32-bit (``optim_bits=32``): state1 and state2 in float32, updated in place (optimizer_update_32bit).
Not modelled: the update's numerics (values do not change memory), percentile clipping (gnorm_vec, 100
floats) and max_unorm.
"""

from __future__ import annotations

import torch

MIN_8BIT_SIZE = 4096
BLOCK_SIZE = 256
QMAP_SIZE = 256
PAGED_MIN_NUMEL = 1e5  # get_state_buffer: `if not self.is_paged or p.numel() < 1e5` -> a device buffer


class Adam8bitModel(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, bits: int = 8, paged: bool = False) -> None:
        super().__init__(params, {"lr": lr})
        self._qmaps: tuple[torch.Tensor, torch.Tensor] | None = None
        self.bits, self.is_paged = bits, paged
        self.paged: list[torch.Tensor] = []  # state buffers in unified memory (host-pageable)

    def _state_buffer(self, p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        buf = torch.zeros_like(p, dtype=dtype)
        if self.is_paged and p.numel() >= PAGED_MIN_NUMEL:
            self.paged.append(buf)
        return buf

    def _init_state(self, p: torch.Tensor) -> dict:
        n = p.numel()
        if self.bits == 32 or n < MIN_8BIT_SIZE:
            return {"step": 0, "state1": self._state_buffer(p, torch.float32),
                    "state2": self._state_buffer(p, torch.float32)}
        if self._qmaps is None:
            self._qmaps = (torch.zeros(QMAP_SIZE, device=p.device), torch.zeros(QMAP_SIZE, device=p.device))
        blocks = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
        return {
            "step": 0,
            "state1": self._state_buffer(p, torch.uint8),
            "qmap1": self._qmaps[0],
            "state2": self._state_buffer(p, torch.uint8),
            "qmap2": self._qmaps[1],
            "absmax1": torch.zeros(blocks, dtype=torch.float32, device=p.device),
            "absmax2": torch.zeros(blocks, dtype=torch.float32, device=p.device),
        }

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(self._init_state(p))
                state["step"] += 1
                p.add_(p.grad, alpha=-group["lr"])  # stands in for the fused in-place 8-bit update
        return None
