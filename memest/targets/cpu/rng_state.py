"""The CPU generator's state that activation checkpointing keeps (--target cpu).

torch.utils.checkpoint (preserve_rng_state=True, the default, also under transformers' own switch) calls
``torch.get_rng_state()`` in each checkpointed forward and keeps the result until the recompute, which
forks the RNG (``torch.random.fork_rng``: another ``get_rng_state()`` held while it runs). The state is a
real uint8 tensor made by the generator (``default_generator.get_state()``, 5,056 bytes for the
Mersenne-Twister CPU generator) through the CPU allocator, outside any aten op, so a fake trace does not see
it while the real CPU run does. While entered, ``get_rng_state`` returns a tensor of the same size made in
the active (fake, tracked) mode and ``set_rng_state`` ignores fake states. On a GPU run the CPU state is host
memory, so --target cuda leaves this out."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensor


@contextlib.contextmanager
def tracked_cpu_rng_state():
    get, set_ = torch.get_rng_state, torch.set_rng_state
    size = get().numel()

    def get_rng_state() -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8)

    def set_rng_state(state: torch.Tensor) -> None:
        if not isinstance(state, FakeTensor):
            set_(state)

    torch.get_rng_state, torch.set_rng_state = get_rng_state, set_rng_state
    try:
        yield
    finally:
        torch.get_rng_state, torch.set_rng_state = get, set_
