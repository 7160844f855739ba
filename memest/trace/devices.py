"""Model code written for a GPU, run on memest's traced device.

memest traces on fake CPU tensors and models the GPU itself (``--target cuda``); the CLI hides CUDA
devices, and torch may be a CPU-only build. Model code asks for a GPU anyway — ``model.to(device)``,
``.cuda()``, ``torch.randn(..., device="cuda")`` in example_inputs or the forward — and on such a
torch these fail in torch's Python bindings, which initialise CUDA before any (fake) tensor is made.
So the request is rewritten where it is made, above the dispatcher, by :class:`CudaOnTracedDevice`,
a TorchFunctionMode (the mechanism of ``torch.set_default_device``, torch/utils/_device.py), which
sees every torch function and Tensor method call:

- a ``device=`` argument naming CUDA (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an index)
  becomes the CPU: factories (``torch.zeros``, ``x.new_empty``, ``nn.Linear(..., device=)``, which
  builds with ``torch.empty``), ``empty_like`` (``Module.to_empty``), ``Tensor.to(device=...)``;
- ``Tensor.to("cuda", ...)`` (positional device) keeps its other arguments: a dtype cast changes memory
  and is kept; ``Tensor.cuda()`` becomes ``Tensor.to("cpu")``, so a tensor moved to the GPU is still
  counted once, as the GPU copy of the real run is.

``Module.to/.cuda/.half/.float/.bfloat16`` call ``Tensor.to/.cuda`` on each parameter through
``nn.Module._apply``, which on fake parameters needs :func:`.dtype.convertible_fake_parameters` as well;
:func:`traced_device` enters both. The dispatch-level cost is one Python call per torch function
(measured on GPT-2 124M, batch 2 x 512: 0.64 s with and without it).

``device = "cuda" if torch.cuda.is_available() else "cpu"`` needs nothing: the CLI hides CUDA, so the
model file takes its CPU branch; where a GPU is visible (the Python API on a GPU machine), its CUDA
requests are mapped as above. Code that calls CUDA itself (``torch.cuda.synchronize()``, streams,
``torch.cuda.current_device()``) still fails on a CPU-only torch: trace/step.py says so.

The real CPU ground truth (validate/cpu_truth.py) runs the model file under the same context on real
tensors, so a model file that calls ``.cuda()`` runs there as it does in the trace: on the CPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from memest.spec.choices import Target
from memest.trace.dtype import convertible_fake_parameters

CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    """Whether a device argument names a CUDA device (an int is a CUDA index, as torch reads it)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":", 1)[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)


def _name(func) -> str:
    """'Tensor.to', 'torch.zeros', 'torch.nn.functional.one_hot': the call as model code writes it."""
    name = getattr(func, "__name__", repr(func))
    if name == "_parse_to":  # Module.to(device=..., dtype=...) parses its arguments with it
        return "Module.to"
    qualname = getattr(func, "__qualname__", "") or ""
    if qualname.startswith("TensorBase.") or qualname.startswith("Tensor."):
        return f"Tensor.{name}"
    module = getattr(func, "__module__", None)
    return f"{module}.{name}" if module and module.startswith("torch.") else f"torch.{name}"


@dataclass
class DeviceRequests:
    """The CUDA requests the model code made, by the call that made them (for the report's note)."""

    calls: dict[str, int] = field(default_factory=dict)

    def add(self, func) -> None:
        name = _name(func)
        self.calls[name] = self.calls.get(name, 0) + 1

    def note(self, target: str) -> str | None:
        if not self.calls:
            return None
        calls = ", ".join(sorted(self.calls))
        where = (
            "memest's traced device (fake CPU tensors; the GPU is modelled by --target cuda)"
            if target == Target.CUDA
            else "the CPU, as --target cpu asks"
        )
        return f"the model code asks for a CUDA device ({calls}): placed on {where}"


class CudaOnTracedDevice(TorchFunctionMode):
    """Rewrites CUDA device arguments to the CPU; records what it rewrote in ``requests``."""

    def __init__(self, requests: DeviceRequests) -> None:
        super().__init__()
        self.requests = requests

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            self.requests.add(func)
            return args[0].to(CPU, non_blocking=bool(kwargs.get("non_blocking", False)))
        if _is_cuda(kwargs.get("device")):
            self.requests.add(func)
            kwargs = {**kwargs, "device": CPU}
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            self.requests.add(func)
            args = (args[0], CPU, *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def traced_device():
    """Model code's device and dtype moves on the traced device; yields the :class:`DeviceRequests`.
    Always undone: the function mode popped, ``nn.Module._apply`` restored."""
    requests = DeviceRequests()
    with convertible_fake_parameters(), CudaOnTracedDevice(requests):
        yield requests
