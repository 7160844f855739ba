"""Reports: data computed from a trace (analysis), and its renderings (JSON, rich tables).

The names below load on first use, so ``memest.report.text`` (imported when the CLI starts) does not
pull in torch through ``analysis``.
"""

__all__ = ["LayerRow", "Report", "analyse"]


def __getattr__(name: str):
    if name in __all__:
        from memest.report import analysis

        return getattr(analysis, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
