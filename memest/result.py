"""What an Estimate offers its readers (the Python API, the views): plain data, no printing."""

from __future__ import annotations

from typing import Any

from memest.device.fit import resolve_budget
from memest.errors import MemestError
from memest.report.emit import SCHEMA_VERSION
from memest.units import format_bytes
from memest.version import __version__


def budget_bytes(budget: int | str) -> int:
    """11GB (10^9 B), 11GiB (2^30 B), 11000MiB, a card name (rtx2080ti) or a byte count."""
    if isinstance(budget, bool) or not isinstance(budget, (int, str)):
        raise MemestError(f"a budget is a size such as '11GB', a card name or a number of bytes, not {budget!r}")
    if isinstance(budget, int):
        if budget <= 0:
            raise MemestError(f"a budget of {budget} bytes holds nothing; pass a positive size such as '11GB'")
        return budget

    resolved = resolve_budget(str(budget))
    if isinstance(resolved, int):
        raise MemestError(f"{budget!r} is a device index; pass a size such as '11GB' or a card name")
    return resolved[1]


class EstimateViews:
    """Mixed into estimator.Estimate: ``report`` and ``trace`` are the Estimate's."""

    report: Any
    default_budget: str | None = None  # the Python API's gpu=

    @property
    def peak_allocated_bytes(self) -> int:
        """The most bytes of tensors alive at once during the step."""
        return self.report.peak_allocated_bytes

    @property
    def trainable_param_count(self) -> int:
        """Elements of the parameters that require grad (all of them; with --lora the adapters, with --freeze
        the unfrozen ones)."""
        return self.report.trainable_param_count

    @property
    def device_bytes(self) -> int | None:
        """--target cuda: predicted device usage without a limit (allocator reserved + context, NVML's view)."""
        return self.report.device.device_bytes if self.report.device is not None else None

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes alive at the peak by category: parameters, gradients, optimizer_state, activations,
        temporaries, other."""
        return dict(self.report.breakdown_at_peak)

    @property
    def layers(self) -> list:
        """Per-module rows (report.analysis.LayerRow): params, bytes of state, saved activations, at the peak."""
        return list(self.report.layers)

    def to_dict(self) -> dict:
        """The --json document of `memest estimate` (without a GPU comparison)."""

        doc = {"schema_version": SCHEMA_VERSION, "memest_version": __version__, **self.report.to_dict()}
        doc["peak_by_iteration"] = {str(k): v for k, v in self.report.peak_by_iteration.items()}
        doc["needed_bytes"] = self.needed_bytes
        return doc

    def to_json(self, indent: int | None = 2) -> str:
        import json

        return json.dumps(self.to_dict(), indent=indent)

    def __repr__(self) -> str:

        spec = self.report.spec
        device = f", device {format_bytes(self.device_bytes)}" if self.device_bytes is not None else ""
        return (f"<memest Estimate {self.report.model} batch {spec['batch']}"
                + (f" seq {spec['seq']}" if spec.get("seq") else "")
                + f": peak allocated {format_bytes(self.peak_allocated_bytes)}{device}, "
                f"needed {format_bytes(self.needed_bytes)}>")
