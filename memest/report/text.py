"""Text that survives any terminal: when stdout or stderr cannot encode what memest prints (LANG=C,
PYTHONIOENCODING=ascii, an old CI console), characters degrade to ASCII instead of crashing."""

from __future__ import annotations

import codecs
import sys

# what memest (and rich's sparkline and notes) print beyond ASCII, and the ASCII that says the same
ASCII = {
    "—": "-", "–": "-", "−": "-", "×": "x", "…": "...", "²": "^2", "³": "^3", "≤": "<=", "≥": ">=", "→": "->",
    "←": "<-", "±": "+/-", "µ": "u", "·": ".", "≈": "~", "⁰": "^0", "¹": "^1", "√": "sqrt",
    "▁": "_", "▂": ".", "▃": "-", "▄": "-", "▅": "=", "▆": "=", "▇": "#", "█": "#",
    "✓": "ok", "✗": "x", "•": "*", "’": "'", "‘": "'", "“": '"', "”": '"',
}
_HANDLER = "memest-ascii"
_SAMPLE = "— × … ² ≤ ▁█"


def _to_ascii(err: UnicodeError):
    if not isinstance(err, UnicodeEncodeError):
        raise err
    text = err.object[err.start:err.end]
    return "".join(ASCII.get(ch, "?") for ch in text), err.end


def ascii_text(text: str) -> str:
    """``text`` with the characters above replaced by their ASCII (others by '?')."""
    return text.encode("ascii", errors=_HANDLER).decode("ascii")


def ascii_fallback_streams(*streams) -> list:
    """Reconfigure each stream (default: stdout and stderr) that cannot encode memest's characters to
    write their ASCII instead. Returns the streams changed."""
    changed = []
    for stream in streams or (sys.stdout, sys.stderr):
        encoding = getattr(stream, "encoding", None) or "ascii"
        try:
            _SAMPLE.encode(encoding)
        except (UnicodeEncodeError, LookupError):
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(errors=_HANDLER)
                changed.append(stream)
    return changed


codecs.register_error(_HANDLER, _to_ascii)
