"""The one emit path: a command's View rendered as rich tables, Markdown or one JSON document.

A View is data: its JSON document, and for people a list of blocks (tables and lines). Only
``emit`` writes, and only to the stream it is given (stdout); progress and errors go to stderr
elsewhere.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO, Any

from memest.spec.choices import OutputFormat
from memest.version import __version__

SCHEMA_VERSION = 1


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    left: tuple[str, ...] = ()  # headers of left-aligned columns (others are right-aligned numbers)


@dataclass
class View:
    doc: dict  # the JSON document (schema_version and memest_version are added by emit)
    blocks: list[Table | str] = field(default_factory=list)
    # commands with a view of their own (estimate): rich(console) and markdown() replace the blocks
    rich: Callable[[Any], None] | None = None
    markdown: Callable[[], str] | None = None


def json_text(doc: dict) -> str:

    full = {"schema_version": SCHEMA_VERSION, "memest_version": __version__, **doc}
    return json.dumps(full, indent=2, default=_jsonable)


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    if hasattr(value, "to_dict"):
        return value.to_dict()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def emit(view: View, fmt: OutputFormat, out: IO[str]) -> None:
    if fmt == OutputFormat.JSON:
        out.write(json_text(view.doc) + "\n")
        return
    if fmt == OutputFormat.MARKDOWN:
        out.write(_markdown(view) + "\n")
        return
    from memest.report.console import make_console

    console = make_console()  # writes to sys.stdout, which is ``out`` for the CLI
    if view.rich is not None:
        view.rich(console)
        return
    for block in view.blocks:
        if isinstance(block, Table) and _min_width(block) > console.width:  # never a number cut in two
            console.print(_table_as_records(block), markup=False, highlight=False, crop=False)
        elif isinstance(block, Table):
            console.print(_rich_table(block))
        else:
            console.print(block, markup=False, highlight=False)


class _Captured(io.StringIO):
    """A string that rich takes for ``like`` (the real stdout): the same terminal answer and encoding, so the
    text rendered into it is, byte for byte, what ``emit`` writes to ``like`` itself."""

    def __init__(self, like) -> None:
        super().__init__()
        self.like = like

    def isatty(self) -> bool:
        try:
            return bool(self.like.isatty())
        except (AttributeError, OSError, ValueError):
            return False

    @property
    def encoding(self) -> str:
        return getattr(self.like, "encoding", None) or "utf-8"

    @property
    def errors(self) -> str | None:
        return getattr(self.like, "errors", None)


def render(view: View, fmt: OutputFormat, like: IO[str] | None = None) -> str:
    """What ``emit(view, fmt, like)`` writes, as a string (memest's worker renders in the child and the parent
    writes it: a View holds renderers closed over the trace, a string crosses a pipe in microseconds)."""
    like = like if like is not None else sys.stdout
    out = _Captured(like)
    with contextlib.redirect_stdout(out):  # rich's Console writes to sys.stdout
        emit(view, fmt, out)
    return out.getvalue()


def _markdown(view: View) -> str:
    if view.markdown is not None:
        return view.markdown()
    from memest.report.markdown import table_markdown

    parts = []
    for block in view.blocks:
        if isinstance(block, Table):
            parts.append((f"**{block.title}**\n\n" if block.title else "") + table_markdown(block.headers, block.rows))
        else:
            parts.append(block)
    return "\n\n".join(parts)


def _longest_word(block: Table, j: int) -> int:
    texts = [block.headers[j], *(r[j] for r in block.rows)]
    return max(len(word) for text in texts for word in (str(text).split() or [""]))


def _min_width(block: Table) -> int:
    """The narrowest the table is with no word or number broken: each column its longest word, padding, borders."""
    return sum(min(_longest_word(block, j), 32) + 3 for j in range(len(block.headers))) + 1


def _table_as_records(block: Table) -> str:
    """A table too wide for the terminal: one record per row, 'header: value' a line."""
    pad = max(len(h) for h in block.headers)
    records = ["\n".join(f"  {h.ljust(pad)}  {v}" for h, v in zip(block.headers, r, strict=True)) for r in block.rows]
    return "\n\n".join(([block.title] if block.title else []) + records)


def _rich_table(block: Table):
    from rich.table import Table as RichTable

    table = RichTable(title=block.title or None, title_justify="left")
    for j, h in enumerate(block.headers):  # wrap between words, never inside a number or a word (issue 22, 35)
        table.add_column(h, justify="left" if h in block.left else "right", overflow="fold",
                         min_width=min(_longest_word(block, j), 32))
    for r in block.rows:
        table.add_row(*r)
    return table
