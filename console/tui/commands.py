"""Command palette (ctrl+p): every view and, unless read-only, every action on the selected worker
and on the selected pool (Scaling view).

The provider knows the app only as ``PaletteHost`` (what it reads and calls), so the app can
import this module without this module importing the app back.
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

from textual.command import DiscoveryHit, Hit, Hits, Provider

from dynamod.console.actions.specs import ACTIONS, POOL_ACTIONS
from dynamod.console.state.scaling import PoolScaling
from dynamod.shared.protocol.worker_id import worker_id_hex


class PaletteHost(Protocol):
    """The app as the palette sees it (``ConsoleApp``)."""

    VIEWS: tuple[str, ...]
    read_only: bool

    def show_view(self, name: str) -> None: ...
    def selected_worker_id(self) -> int | None: ...
    def start_action(self, name: str) -> None: ...
    def selected_pool(self) -> PoolScaling | None: ...
    def start_pool_action(self, name: str) -> None: ...


class ConsoleCommands(Provider):
    def _entries(self) -> list[tuple[str, object, str]]:
        app: PaletteHost = self.app  # type: ignore[assignment]
        out: list[tuple[str, object, str]] = []
        for view in app.VIEWS:
            out.append((f"View: {view}", partial(app.show_view, view), f"jump to the {view} view"))
        if not app.read_only:
            target = app.selected_worker_id()
            where = f" {worker_id_hex(target)}" if target is not None else " (select a worker first)"
            for spec in ACTIONS:
                out.append((f"{spec.title}{where}", partial(app.start_action, spec.name), spec.help))
            pool = app.selected_pool()
            on = f" {pool.key}" if pool is not None else " (select a pool in the scaling view)"
            for pool_spec in POOL_ACTIONS:
                out.append((f"{pool_spec.title}{on}", partial(app.start_pool_action, pool_spec.name), pool_spec.help))
        return out

    async def discover(self) -> Hits:
        for title, callback, help_text in self._entries():
            yield DiscoveryHit(title, callback, help=help_text)  # type: ignore[arg-type]

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for title, callback, help_text in self._entries():
            score = matcher.match(title)
            if score > 0:
                yield Hit(score, matcher.highlight(title), callback, help=help_text)  # type: ignore[arg-type]
