"""The two status lines: the top bar (cluster counts and connection health) and the view tabs."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from dynamod.console.present import cluster_counts
from dynamod.console.state.cluster import ClusterState
from dynamod.console.tui.style import CONN_STYLE


def top_bar_text(state: ClusterState, *, read_only: bool, width: int) -> Text:
    counts = cluster_counts(state)
    text = Text(no_wrap=True, overflow="ellipsis")
    text.append(" dynamo ", style="bold reverse")
    text.append(f" {counts['workers']} workers", style="bold")
    short = {"ready": "ready", "draining": "drain", "sleeping": "sleep", "gone": "gone"} if width < 120 else {}
    statuses = ("ready", "draining", "sleeping", "gone", "failed")
    details = [f"{counts[s]} {short.get(s, s)}" for s in statuses if counts[s]]
    if details:
        text.append(" (" + ", ".join(details) + ")")
    text.append(f"  {len(state.models())} models")
    right = Text(no_wrap=True)
    if read_only:
        right.append(" READ-ONLY", style="bold yellow")
    for name, short in (("discovery", "disc"), ("events", "ev")):
        conn = state.connections.get(name)
        if conn is None:
            continue
        right.append(f" {short if width < 120 else name} ")
        right.append("●" if conn.state == "ok" else "○", style=CONN_STYLE.get(conn.state, ""))
        if conn.state != "ok":
            right.append(f" {conn.state}", style=CONN_STYLE.get(conn.state, ""))
    room = max(0, width - right.cell_len)
    if text.cell_len > room:
        text.truncate(room, overflow="ellipsis")
    text.append(" " * max(0, room - text.cell_len))
    text.append_text(right)
    return text


class TopBar(Static):
    DEFAULT_CSS = "TopBar { height: 1; background: $primary-background; }"


class ViewTabs(Static):
    DEFAULT_CSS = "ViewTabs { height: 1; background: $panel; }"

    def show(self, views: tuple[str, ...], current: str, filter_text: str) -> None:
        text = Text(no_wrap=True, overflow="ellipsis")
        for i, view in enumerate(views, 1):
            style = "bold reverse" if view == current else "dim"
            text.append(f" {i}:{view} ", style=style)
        if filter_text:
            text.append(f"  /{filter_text}", style="bold yellow")
        self.update(text)
