"""App-level messages: views post them upward, the app acts ("attributes down, messages up")."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import RenderableType
from textual.message import Message

from dynamod.console.actions.control import ActionResult


@dataclass
class ShowWorker(Message):
    """Drill into one worker (Enter on a worker row or topology instance)."""

    instance_id: int


@dataclass
class JumpToView(Message):
    """Switch view, optionally with a filter (Enter on a model jumps to its workers)."""

    view: str
    filter_text: str = ""


@dataclass
class ActionFinished(Message):
    result: ActionResult


@dataclass
class ShowDetail(Message):
    """Open the full text of a table row (Enter on an event, a routing decision, a pool, a failed
    worker): what the 80-column cell cut. ``worker_id``: Enter in the pane opens that worker."""

    title: str
    body: RenderableType
    worker_id: int | None = None


@dataclass
class ShowTrace(Message):
    """Open one request's waterfall (Enter in the Requests view)."""

    request_id: str
