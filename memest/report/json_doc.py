"""The ``--json`` document (design.md §5). Fields are added, never renamed."""

from __future__ import annotations

import json

from .. import __version__
from ..device.fit import FitRow
from .analysis import Report

SCHEMA_VERSION = 1


def json_document(report: Report, fits: list[FitRow], gpu_reason: str = "", needed_bytes: int | None = None) -> str:
    doc = {"schema_version": SCHEMA_VERSION, "memest_version": __version__}
    doc.update(report.to_dict())
    doc["peak_by_iteration"] = {str(k): v for k, v in report.peak_by_iteration.items()}
    doc["gpus"] = {
        "compared_bytes": report.peak_allocated_bytes if needed_bytes is None else needed_bytes,
        "rows": [f.to_dict() for f in fits],
        "fits": all(f.fits for f in fits) if fits else None,
        "reason": gpu_reason,
    }
    return json.dumps(doc, indent=2)
