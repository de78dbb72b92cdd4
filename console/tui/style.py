"""Colours and cell styling shared by the views (status words, severities, imbalance marks)."""

from __future__ import annotations

from rich.text import Text

from dynamod.shared.security.printable import printable

STATUS_STYLE = {
    "ready": "green",
    "draining": "yellow",
    "sleeping": "cyan",
    "gone": "red dim",
    "failed": "bold red",  # given up on by `dynamod up` after a crash loop
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


def plain(value: object, style: str = "") -> Text:
    """A string from the network as a table cell: ``printable`` (escapes made visible) and a
    ``Text``, because DataTable and rich tables read a ``str`` cell as markup (``[red]`` in a
    model name must show as typed, not restyle the row)."""
    return Text(printable(value), style=style)
