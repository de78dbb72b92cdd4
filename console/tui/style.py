"""Colours and cell styling shared by the views (status words, severities, imbalance marks)."""

from __future__ import annotations

from rich.text import Text

STATUS_STYLE = {
    "ready": "green",
    "draining": "yellow",
    "sleeping": "cyan",
    "gone": "red dim",
}
SEVERITY_STYLE = {"info": "", "warning": "yellow", "error": "bold red"}
CONN_STYLE = {"ok": "green", "connecting": "yellow", "lost": "bold red"}


_STATUS_TEXT: dict[str, Text] = {}


def status_text(status: str) -> Text:
    """One shared Text per status word: tables compare cells by identity first, so reuse is free."""
    text = _STATUS_TEXT.get(status)
    if text is None:
        text = _STATUS_TEXT[status] = Text(status, style=STATUS_STYLE.get(status, ""))
    return text


def severity_text(text: str, severity: str) -> Text:
    return Text(text, style=SEVERITY_STYLE.get(severity, ""))
