"""Reports: data computed from a trace (analysis), and its renderings (JSON, rich tables)."""

from .analysis import LayerRow, Report, analyse

__all__ = ["LayerRow", "Report", "analyse"]
