"""Strings from the network, made safe to print on an operator's terminal.

Model names, LoRA names and sources, worker names, labels, error messages: all of them come from
discovery records or control replies that a peer (or anyone who could write to discovery) chose.
Printed raw, ``\\x1b]0;...\\x07`` retitles the terminal, ``\\x1b[2J`` clears it, ``\\r`` overwrites
the line with a fake status, and bidi overrides (U+202E) reorder what is read. ``printable``
keeps the text readable and makes such characters visible as escapes instead: C0 and C1 controls,
DEL, bidi and other format characters (Unicode category Cf), line and paragraph separators, and
lone surrogates. Over-long values are cut with an ellipsis so one field cannot push a table off the
screen. Pure and cheap: the console and ``dynamoctl`` call it on every cell they draw.
"""

from __future__ import annotations

import unicodedata

DEFAULT_MAX_CHARS = 512
_UNSAFE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"})


def _escape(ch: str) -> str:
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def printable(value: object, max_chars: int = DEFAULT_MAX_CHARS) -> str:
    """``value`` as text with every control, format or separator character escaped (see the
    module docstring); cut to ``max_chars`` characters with a trailing ``…``."""
    text = value if isinstance(value, str) else str(value)
    if text.isprintable() and len(text) <= max_chars:
        return text  # the common case: nothing to do
    out: list[str] = []
    size = 0
    for ch in text:
        piece = ch if ch == " " or unicodedata.category(ch) not in _UNSAFE_CATEGORIES else _escape(ch)
        if size + len(piece) > max_chars:
            out.append("…")
            break
        out.append(piece)
        size += len(piece)
    return "".join(out)
