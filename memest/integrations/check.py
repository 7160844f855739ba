"""The verdict of a preflight check, what it does when the step will not fit (``OnFail``), and the comparison
with what the GPU measured after the user's own steps (pure: ``measured_record`` takes the numbers)."""

from __future__ import annotations

import json
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any

from memest.errors import DoesNotFitError, MemestError
from memest.result import budget_bytes
from memest.spec.choices import OnFail, Verdict
from memest.spec.options import typed_spec
from memest.units import format_bytes
from memest.version import __version__

log = logging.getLogger("memest")

MEASURE_AFTER_STEP = 2  # the steady state: step 1 allocates the optimizer state, step 2 is the first full repeat


@dataclass
class Preflight:
    """A preflight check's answer: ``needed_bytes`` (the smallest budget the step runs in), ``budget_bytes`` (the
    device's, less ``margin``; None when no GPU was named and none is present), ``verdict`` (FITS / TIGHT /
    DOES_NOT_FIT, None without a budget) and the full ``estimate`` (memest.estimator.Estimate)."""

    estimate: Any
    budget_bytes: int | None
    budget_label: str | None
    verdict: Verdict | None
    settings: dict = field(default_factory=dict)  # what the estimate was asked (memest.estimate's keywords)
    measured: dict | None = None  # after_step's record, once read

    @property
    def needed_bytes(self) -> int:
        return self.estimate.needed_bytes

    @property
    def needed_range(self) -> tuple[int, int, int | None]:
        return self.estimate.needed_range

    @property
    def fits(self) -> bool | None:
        return None if self.verdict is None else self.verdict != Verdict.DOES_NOT_FIT

    def line(self) -> str:
        low, _, high = self.needed_range
        spread = f" (range {format_bytes(low)}-{format_bytes(high) if high is not None else 'unbounded'})"
        need = f"memest: the step needs {format_bytes(self.needed_bytes)}{spread}"
        if self.budget_bytes is None:
            return f"{need}; no GPU budget (pass gpu='a100' or gpu='80GB')"
        return f"{need} of {self.budget_label}: {self.verdict.value}"

    def after_step(self, step: int) -> dict | None:
        """Call after each of your optimizer steps: after step ``MEASURE_AFTER_STEP`` (counting from 1), when a
        GPU is present, reads torch.cuda.max_memory_allocated/reserved once, logs predicted vs measured on one
        line and returns the JSON record (also kept as ``measured``). Never touches torch.cuda without a GPU."""
        if step != MEASURE_AFTER_STEP or self.measured is not None:
            return None
        import torch

        if not torch.cuda.is_available():
            return None
        self.measured = measured_record(
            self, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved(),
            device_name=torch.cuda.get_device_name(), step=step, torch_version=torch.__version__,
        )
        log.info(measured_line(self.measured))
        return self.measured


def measured_record(result: Preflight, max_allocated: int, max_reserved: int, *, device_name: str, step: int,
                    torch_version: str = "") -> dict:
    """The record users can send to the project: memest's prediction of torch.cuda.max_memory_allocated and
    max_memory_reserved (the unconstrained replay, device/usage.py) beside the measured values, and the settings."""
    report = result.estimate.report
    device = report.device
    predicted_allocated = device.allocated_peak_bytes if device else report.peak_allocated_bytes
    predicted_reserved = device.reserved_peak_bytes if device else None
    return {
        "memest_version": __version__, "torch_version": torch_version, "device": device_name, "after_step": step,
        "model_type": report.model_type, "settings": {k: _plain(v) for k, v in result.settings.items()},
        "predicted_max_allocated_bytes": predicted_allocated, "measured_max_allocated_bytes": int(max_allocated),
        "predicted_max_reserved_bytes": predicted_reserved, "measured_max_reserved_bytes": int(max_reserved),
        "allocated_error": _ratio(predicted_allocated, max_allocated),
        "reserved_error": _ratio(predicted_reserved, max_reserved),
        "needed_bytes": result.needed_bytes,
    }


def measured_line(record: dict) -> str:
    def pct(x):
        return "n/a" if x is None else f"{x:+.1%}"

    reserved = record["predicted_max_reserved_bytes"]
    return (f"memest after step {record['after_step']} on {record['device']}: max allocated predicted "
            f"{format_bytes(record['predicted_max_allocated_bytes'])} measured "
            f"{format_bytes(record['measured_max_allocated_bytes'])} ({pct(record['allocated_error'])}); max reserved "
            f"predicted {format_bytes(reserved) if reserved is not None else 'n/a'} measured "
            f"{format_bytes(record['measured_max_reserved_bytes'])} ({pct(record['reserved_error'])}); record: "
            f"{json.dumps(record, sort_keys=True)}")


def check_margin(margin) -> float:
    """``margin``: a number from 0 up to (not including) 1, else a one-line MemestError (never a TypeError)."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
        raise MemestError(f"margin={margin!r}: a fraction of the budget kept free, from 0 up to (not including) 1")
    return margin


def check_arguments(where: str, gpu, margin, options: dict) -> None:
    """A callback's or preflight's own arguments checked when it is made, not at the trainer's first step: the
    budget, the margin and the memest.estimate keywords (names and types)."""
    check_margin(margin)
    if gpu is not None:
        try:
            budget_bytes(gpu)
        except MemestError as exc:
            raise MemestError(f"{where}gpu: {exc}") from None
    typed_spec({k: v for k, v in options.items() if k not in ("calibration", "loss")}, where,
               extra=("calibration", "loss"))  # memest.estimate's own keywords, checked there


def judge(estimate, budget: int | str | None, margin: float, settings: dict, label: str | None = None) -> Preflight:
    """The verdict of ``estimate`` against ``budget`` less ``margin`` (a fraction of it kept free)."""
    check_margin(margin)
    if budget is None:
        return Preflight(estimate, None, None, None, settings)
    total = budget_bytes(budget)
    usable = int(total * (1 - margin))
    label = label or (budget if isinstance(budget, str) else format_bytes(total))
    if margin:
        label = f"{label} less {margin:.0%} margin ({format_bytes(usable)})"
    return Preflight(estimate, usable, label, estimate.verdict(usable), settings)


def react(result: Preflight, on_fail: OnFail) -> bool:
    """Logs the verdict; when the step does not fit, warns (WARN) or raises DoesNotFitError (RAISE, and STOP
    for preflight). Returns True when the caller should stop (the callbacks' STOP)."""
    line = result.line()
    if result.verdict != Verdict.DOES_NOT_FIT:
        log.info(line)
        if result.verdict == Verdict.TIGHT:
            warnings.warn(f"{line}: the needed floor fits, the high end of the range does not", stacklevel=3)
        return False
    if on_fail == OnFail.WARN:
        log.warning(line)
        warnings.warn(line, stacklevel=3)
        return False
    if on_fail == OnFail.STOP:
        log.error(line)
        return True
    raise DoesNotFitError(line)


def gpu_budget(gpu: int | str | None) -> tuple[int | str | None, str | None, tuple[int, int] | None]:
    """(budget, label, compute capability): ``gpu`` as given, or with none, the present GPU's total memory and
    compute capability (torch.cuda is asked only when it reports a device; nothing is allocated)."""
    if gpu is not None:
        return gpu, None, None
    import torch

    if not torch.cuda.is_available():
        return None, None, None
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return props.total_memory, f"{props.name} ({format_bytes(props.total_memory)})", (props.major, props.minor)


def _ratio(predicted, measured) -> float | None:
    return None if predicted is None or not measured else predicted / measured - 1


def _plain(value):
    return value.value if hasattr(value, "value") else value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
