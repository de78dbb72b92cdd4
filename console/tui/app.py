"""``ConsoleApp``: the Textual app. It owns no cluster logic: collectors feed ``ClusterState``, the
views render it on a timer, and the action keys call the same ``ControlClient`` as dynamoctl.

Keys follow k9s: ``:`` jumps to a view, ``/`` filters, Enter drills in, Esc goes back, ``?`` is
help; single keys act on the selected worker (drain, sleep, wake, LoRA load/unload, clear KV), and
those that remove capacity ask first. In the Scaling view ``r`` and ``x`` act on the selected pool
(hold it at N replicas, clear that override), through the same ``ScaleClient`` as ``dynamoctl
scale``; every key means one thing in every view (``actions/specs.py``). ``--read-only`` hides and refuses every action.

The Requests view lists the frontends' slowest recent requests, polled (``SlowestPoller``) only
while it is the current view; Enter opens a request's waterfall (``TraceScreen``), gathered by the
same ``TraceGatherer`` as ``dynamoctl trace``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from functools import partial

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.suggester import SuggestFromList
from textual.widget import Widget
from textual.widgets import ContentSwitcher, DataTable, Footer, Input, Tree
from textual.worker import Worker as TextualWorker
from textual.worker import WorkerState

from dynamod.console.actions.control import ActionResult, ControlClient
from dynamod.console.actions.scaling import ScaleClient
from dynamod.console.actions.specs import ACTIONS, ACTIONS_BY_NAME, POOL_ACTIONS_BY_NAME, ActionSpec
from dynamod.console.actions.traces import TraceGatherer
from dynamod.console.collectors.connection import ClusterConnection
from dynamod.console.collectors.traces import (
    SlowestPoller,
    frontend_http,
    frontend_trace_urls,
    guessed_trace_urls,
)
from dynamod.console.present import fmt_budget
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.scaling import PoolScaling
from dynamod.console.tui.asks import Question, ask_body, confirm_text
from dynamod.console.tui.commands import ConsoleCommands
from dynamod.console.tui.messages import ActionFinished, JumpToView, ShowDetail, ShowTrace, ShowWorker
from dynamod.console.tui.screens import (
    ConfirmScreen,
    DetailScreen,
    HelpScreen,
    ScaleScreen,
    WorkerScreen,
)
from dynamod.console.tui.trace_screen import TraceScreen, TraceSource
from dynamod.console.tui.views.base import ViewMixin
from dynamod.console.tui.views.events import EventsView
from dynamod.console.tui.views.models import ModelsView
from dynamod.console.tui.views.requests import RequestsView
from dynamod.console.tui.views.router import RouterView
from dynamod.console.tui.views.scaling import ScalingView
from dynamod.console.tui.views.topology import TopologyView
from dynamod.console.tui.views.workers import WorkersView
from dynamod.console.tui.widgets import TopBar, ViewTabs, top_bar_text
from dynamod.shared.protocol.control import ControlBody
from dynamod.shared.protocol.worker_id import worker_id_hex
from dynamod.shared.security.printable import printable

logger = logging.getLogger(__name__)

ControlFactory = Callable[[], ControlClient | None]
ScaleFactory = Callable[[], ScaleClient | None]
PollerFactory = Callable[[], SlowestPoller | None]
TraceFactory = Callable[[], TraceSource | None]
REFRESH_SAMPLES = 100_000

class ConsoleApp(App[None]):
    TITLE = "dynamo-console"
    VIEWS: tuple[str, ...] = ("topology", "workers", "models", "events", "router", "scaling", "requests")
    COMMANDS = App.COMMANDS | {ConsoleCommands}
    ENABLE_COMMAND_PALETTE = True
    CSS = """
    Screen { layout: vertical; }
    #views { height: 1fr; }
    #prompt { height: 1; border: none; padding: 0 1; display: none; background: $boost; }
    #prompt.shown { display: block; }
    DataTable { scrollbar-size-vertical: 1; }
    """
    # Actions first: at 80 columns the footer has room for them and the two keys that lead to the
    # rest (``?`` lists everything, ``/`` filters); ``:``, the digits and ``q`` are in the help.
    BINDINGS = [
        *[Binding(a.key, f"act('{a.name}')", a.short, tooltip=a.help) for a in ACTIONS],
        Binding("colon", "prompt_view", "View", key_display=":", show=False),
        Binding("slash", "prompt_filter", "Filter", key_display="/"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("escape", "back", "Back", show=False),
        Binding("q", "quit", "Quit", show=False),
        *[Binding(str(i), f"show_view('{v}')", v, show=False) for i, v in enumerate(VIEWS, 1)],
    ]

    def __init__(
        self,
        state: ClusterState,
        *,
        connection: ClusterConnection | None = None,
        control_factory: ControlFactory | None = None,
        scale_factory: ScaleFactory | None = None,
        poller_factory: PollerFactory | None = None,
        trace_factory: TraceFactory | None = None,
        read_only: bool = False,
        refresh_s: float = 0.5,
        initial_view: str = "workers",
    ) -> None:
        super().__init__()
        self.state = state
        self.connection = connection
        self.read_only = read_only
        self.refresh_s = refresh_s
        self.current_view = initial_view if initial_view in self.VIEWS else "workers"
        self.refresh_times: deque[float] = deque(maxlen=REFRESH_SAMPLES)
        self._control_factory = control_factory
        self._control: ControlClient | None = None
        self._scale_factory = scale_factory
        self._poller_factory = poller_factory
        self._trace_factory = trace_factory
        self._poll_task: asyncio.Task[None] | None = None
        self._prompt_mode = ""
        self._top_seen: tuple[int, int] = (-1, -1)
        self._connection_task: asyncio.Task[None] | None = None

    # -- layout ---------------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield TopBar(id="topbar")
        yield ViewTabs(id="tabs")
        with ContentSwitcher(initial=self.current_view, id="views"):
            yield TopologyView(id="topology")
            yield WorkersView(id="workers")
            yield ModelsView(id="models")
            yield EventsView(id="events")
            yield RouterView(id="router")
            yield ScalingView(id="scaling")
            yield RequestsView(id="requests")
        yield Input(id="prompt", suggester=SuggestFromList(self.VIEWS, case_sensitive=False))
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        if self.connection is not None:
            # A plain task, not a Textual worker: on exit it must be cancelled *and awaited*, so the
            # runtime closes its sockets and lease before the loop ends (see on_unmount).
            self._connection_task = asyncio.create_task(self.connection.run(), name="console-connection")
            self._connection_task.add_done_callback(self._connection_ended)
        if self.connection is not None:
            self.query_one(WorkersView).empty_hint = (
                f"No workers registered ({self.connection.settings.describe()}).\n"
                "Start a local cluster with `dynamod up`, or point the console elsewhere with --discovery/--etcd/--file-kv."
            )
        self.set_interval(self.refresh_s, self.refresh_now)
        self.show_view(self.current_view)

    def view(self, name: str | None = None) -> ViewMixin:
        widget = self.query_one(f"#{name or self.current_view}")
        assert isinstance(widget, ViewMixin)
        return widget

    def _focus_target(self, name: str) -> Widget:
        widget = self.query_one(f"#{name}")
        if isinstance(widget, DataTable | Tree):
            return widget
        return widget.query(DataTable).first()

    # -- refresh --------------------------------------------------------------------------------

    def refresh_now(self) -> None:
        """Redraws what changed: the active view (or the worker screen) and the top bar. Timed,
        because refresh latency at 256 workers is the console's benchmark."""
        if self._exit or not self.is_running:
            return  # the timer may tick once more while the app tears its widgets down
        start = time.perf_counter()
        screen = self.screen
        if isinstance(screen, WorkerScreen):
            screen.refresh_from()
        elif screen is self.screen_stack[0]:
            self.view().refresh_from(self.state)
        top_seen = (self.state.versions.topology + self.state.versions.connection, self.size.width)
        if top_seen != self._top_seen:
            self._top_seen = top_seen
            self.query_one(TopBar).update(top_bar_text(self.state, read_only=self.read_only, width=self.size.width))
        self.refresh_times.append(time.perf_counter() - start)

    def on_resize(self) -> None:
        self._top_seen = (-1, -1)
        if self.is_mounted:
            self.refresh_now()

    # -- navigation -----------------------------------------------------------------------------

    def show_view(self, name: str) -> None:
        if name not in self.VIEWS:
            self.notify(f"no view {name!r}; views: {', '.join(self.VIEWS)}", severity="error")
            return
        while len(self.screen_stack) > 1:
            self.pop_screen()
        self.current_view = name
        self.query_one("#views", ContentSwitcher).current = name
        self._poll_requests(name == "requests")
        view = self.view()
        view.refresh_from(self.state, force=True)
        self._focus_target(name).focus()
        self._show_tabs()

    def _show_tabs(self) -> None:
        self.query_one(ViewTabs).show(self.VIEWS, self.current_view, self.view().filter_text)

    def action_show_view(self, name: str) -> None:
        self.show_view(name)

    def action_prompt_view(self) -> None:
        self._open_prompt("view", "view: " + " | ".join(self.VIEWS))

    def action_prompt_filter(self) -> None:
        self._open_prompt("filter", f"filter {self.current_view} (Enter keeps, Esc clears)", self.view().filter_text)

    def _open_prompt(self, mode: str, placeholder: str, value: str = "") -> None:
        if len(self.screen_stack) > 1:
            return
        prompt = self.query_one("#prompt", Input)
        self._prompt_mode = mode
        prompt.placeholder = placeholder
        with prompt.prevent(Input.Changed):
            prompt.value = value
        prompt.add_class("shown")
        prompt.focus()

    def _close_prompt(self) -> None:
        prompt = self.query_one("#prompt", Input)
        prompt.remove_class("shown")
        self._prompt_mode = ""
        self._focus_target(self.current_view).focus()

    @on(Input.Changed, "#prompt")
    def _prompt_changed(self, event: Input.Changed) -> None:
        if self._prompt_mode == "filter":
            self.view().set_filter(event.value.strip(), self.state)
            self._show_tabs()

    @on(Input.Submitted, "#prompt")
    def _prompt_submitted(self, event: Input.Submitted) -> None:
        mode, value = self._prompt_mode, event.value.strip().lower()
        self._close_prompt()
        if mode == "view" and value:
            matches = [v for v in self.VIEWS if v.startswith(value)]
            self.show_view(matches[0] if len(matches) == 1 else value)

    def action_back(self) -> None:
        if self._prompt_mode:
            mode = self._prompt_mode
            self._close_prompt()
            if mode == "filter":
                self.view().set_filter("", self.state)
                self._show_tabs()
            return
        if len(self.screen_stack) > 1:
            self.pop_screen()
            return
        if self.view().filter_text:
            self.view().set_filter("", self.state)
            self._show_tabs()

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.read_only))

    @on(ShowWorker)
    def _show_worker(self, message: ShowWorker) -> None:
        self.push_screen(WorkerScreen(self.state, message.instance_id))

    @on(ShowTrace)
    def _show_trace(self, message: ShowTrace) -> None:
        self.push_screen(TraceScreen(message.request_id, self.trace_source()))

    @on(ShowDetail)
    def _show_detail(self, message: ShowDetail) -> None:
        self.push_screen(DetailScreen(message.title, message.body, message.worker_id))

    @on(JumpToView)
    def _jump(self, message: JumpToView) -> None:
        self.show_view(message.view)
        self.view().set_filter(message.filter_text, self.state)
        self._show_tabs()

    # -- actions --------------------------------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "act" and (self.read_only or self.current_view == "scaling" and len(self.screen_stack) == 1):
            # The Scaling view has no worker to act on; its own keys (r, x) act on pools.
            return False
        if action == "act" and isinstance(self.screen, DetailScreen | TraceScreen):
            return False  # a detail pane shows text; Enter opens its worker, where the keys act
        return True

    def selected_worker_id(self) -> int | None:
        screen = self.screen
        if isinstance(screen, WorkerScreen):
            return screen.instance_id
        if screen is not self.screen_stack[0]:
            return None
        return self.view().selected_worker_id()

    def action_act(self, name: str) -> None:
        self.start_action(name)

    def start_action(self, name: str) -> None:
        """Starts action ``name`` on the selected worker: asks what it needs (``asks.py``),
        confirms if it removes capacity, then calls."""
        if self.read_only:
            self.notify("read-only console: actions are disabled", severity="warning")
            return
        spec = ACTIONS_BY_NAME[name]
        iid = self.selected_worker_id()
        if iid is None:
            self.notify(f"{spec.title}: select a worker first", severity="warning")
            return
        worker = self.state.find_worker(iid)
        target = worker_id_hex(iid)
        model = f" ({printable(worker.model)})" if worker is not None and worker.model else ""
        asked = ask_body(spec, target, worker)
        if isinstance(asked, str):
            self.notify(asked, severity="warning")
        elif isinstance(asked, Question):
            question = asked

            def answered(answer: object) -> None:
                if answer:
                    self._body_chosen(spec, iid, model, question.to_body(answer))

            self.push_screen(question.screen, answered)
        else:
            self._body_chosen(spec, iid, model, asked)

    def _body_chosen(self, spec: ActionSpec, iid: int, model: str, body: ControlBody) -> None:
        if not spec.removes_capacity:
            self._execute(spec, iid, body)
            return

        def answered(yes: bool | None) -> None:
            if yes:
                self._execute(spec, iid, body)
            else:
                self.notify(f"{spec.title} {worker_id_hex(iid)} cancelled")

        self.push_screen(ConfirmScreen(confirm_text(spec, worker_id_hex(iid), model, body)), answered)

    # -- pool actions (Scaling view) ----------------------------------------------------------

    def selected_pool(self) -> PoolScaling | None:
        view = self.query_one(ScalingView)
        return view.selected_pool() if self.current_view == "scaling" and self.screen is self.screen_stack[0] else None

    def start_pool_action(self, name: str) -> None:
        """Scales the selected pool (asks N, then confirms if that lowers capacity) or clears its
        override (confirms: the planner may then scale it down)."""
        spec = POOL_ACTIONS_BY_NAME[name]
        if self.read_only:
            self.notify("read-only console: actions are disabled", severity="warning")
            return
        pool = self.selected_pool()
        if pool is None:
            self.notify(f"{spec.title}: select a pool in the scaling view first", severity="warning")
            return
        if name == "scale":
            self.push_screen(ScaleScreen(pool), partial(self._scale_chosen, pool))
            return
        if pool.override is None:
            self.notify(f"{pool.key} has no override to clear", severity="warning")
            return
        question = (f"Clear the override of {pool.key} ({pool.override.replicas} replicas)? The planner sizes it "
                    f"again and may scale it down (budget {fmt_budget(pool)}).")
        self._confirm_pool(question, partial(self._execute_scale, pool.namespace, pool.pool, None, ""))

    def _scale_chosen(self, pool: PoolScaling, answer: tuple[int, str] | None) -> None:
        if answer is None:
            return
        replicas, reason = answer
        if replicas < pool.capacity:
            question = (f"Scale {pool.key} down to {replicas}? {pool.ready} ready now"
                        f"{f', target {pool.target}' if pool.target is not None else ''}: "
                        "workers are drained and stopped, and the planner keeps it there until cleared.")
            self._confirm_pool(question, partial(self._execute_scale, pool.namespace, pool.pool, replicas, reason))
        else:
            self._execute_scale(pool.namespace, pool.pool, replicas, reason)

    def _confirm_pool(self, question: str, then: Callable[[], None]) -> None:
        def answered(yes: bool | None) -> None:
            if yes:
                then()
            else:
                self.notify("scaling cancelled")

        self.push_screen(ConfirmScreen(question), answered)

    def scaler(self) -> ScaleClient | None:
        if self._scale_factory is not None:
            return self._scale_factory()
        if self.connection is not None and self.connection.runtime is not None:
            return ScaleClient(self.connection.runtime.store)
        return None

    def _execute_scale(self, namespace: str, pool: str, replicas: int | None, reason: str) -> None:
        what = f"clear {namespace}/{pool}" if replicas is None else f"scale {namespace}/{pool} to {replicas}"
        self.notify(f"{what}…", timeout=2)
        self.run_worker(self._scale_call(namespace, pool, replicas, reason), group="actions", name=f"action:{what}",
                        exit_on_error=False)

    async def _scale_call(self, namespace: str, pool: str, replicas: int | None, reason: str) -> ActionResult:
        client = self.scaler()
        if client is None:
            result = ActionResult("scale", f"{namespace}/{pool}", False, "not connected to a cluster")
        elif replicas is None:
            result = await client.clear_override(namespace, pool)
        else:
            result = await client.set_override(namespace, pool, replicas, reason=reason)
        self.post_message(ActionFinished(result))
        return result

    def control(self) -> ControlClient | None:
        if self._control_factory is not None:
            return self._control_factory()
        if self._control is None and self.connection is not None and self.connection.runtime is not None:
            self._control = ControlClient(self.connection.runtime)
        return self._control

    def _execute(self, spec: ActionSpec, iid: int, body: ControlBody) -> None:
        self.notify(f"{spec.title} {worker_id_hex(iid)}…", timeout=2)
        self.run_worker(self._call(spec, iid, body), group="actions", name=f"action:{spec.name}", exit_on_error=False)

    async def _call(self, spec: ActionSpec, iid: int, body: ControlBody) -> ActionResult:
        control = self.control()
        if control is None:
            result = ActionResult(spec.verb, worker_id_hex(iid), False, "not connected to a cluster")
        else:
            result = await control.run(spec, iid, body)
        self.post_message(ActionFinished(result))
        return result

    @on(ActionFinished)
    def _action_finished(self, message: ActionFinished) -> None:
        r = message.result
        self.state.record_action(r.action, r.target, r.ok, r.message)
        # The message is the worker's reply: shown as text (``printable``, no markup), never obeyed.
        text = printable(f"{r.action} {r.target}: {r.message}")
        if r.ok:
            self.notify(text, title="done", markup=False)
        else:
            self.notify(text, title="failed", severity="error", timeout=8, markup=False)

    @on(TextualWorker.StateChanged)
    def _worker_state(self, event: TextualWorker.StateChanged) -> None:
        """The one place a failed background job becomes visible."""
        if event.state is WorkerState.ERROR:
            error = event.worker.error
            logger.error("console job failed name=%s error=%s", event.worker.name, error)
            self.state.add_event("error", f"{event.worker.name} failed: {error}", severity="error")
            self.notify(f"{event.worker.name} failed: {error}", severity="error", timeout=10)

    def _connection_ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("console connection ended error=%s", exc)
            self.state.add_event("error", f"cluster connection ended: {exc}", severity="error")
            self.notify(printable(f"cluster connection ended: {exc}"), severity="error", timeout=30, markup=False)

    # -- requests (the frontends' traces) --------------------------------------------------------

    def _poll_requests(self, on: bool) -> None:
        """Starts the slowest-requests poller when the Requests view is shown, stops it when not:
        the frontends are asked only while someone looks."""
        running = self._poll_task is not None and not self._poll_task.done()
        if on and not running:
            poller = self._poller_factory() if self._poller_factory is not None else self._default_poller()
            if poller is not None:
                self._poll_task = asyncio.create_task(poller.run(), name="requests-poller")
                self._poll_task.add_done_callback(self._poller_ended)
        elif not on and self._poll_task is not None:
            self._poll_task.cancel()
            self._poll_task = None
        self.query_one(RequestsView).polling = self._poll_task is not None

    def _poller_ended(self, task: asyncio.Task[None]) -> None:
        """A poller only ends by being cancelled: anything else is shown, and the next visit to
        the view starts a new one."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("requests poller failed error=%s", exc)
            self.state.add_event("error", f"requests poller failed: {exc}", severity="error")

    @property
    def polling_requests(self) -> bool:
        return self._poll_task is not None and not self._poll_task.done()

    def _default_poller(self) -> SlowestPoller | None:
        if self.connection is None:
            return None
        settings = self.connection.settings
        return SlowestPoller(self.state.requests, lambda: frontend_trace_urls(self.state, settings.frontend_urls),
                             frontend_http(settings), guessed=guessed_trace_urls(settings))

    def trace_source(self) -> TraceSource | None:
        """What gathers a request's spans: the injected one (tests), else one on the live runtime."""
        if self._trace_factory is not None:
            return self._trace_factory()
        control = self.control()
        if control is None or self.connection is None:
            return None
        settings = self.connection.settings
        return TraceGatherer(control, lambda: frontend_trace_urls(self.state, settings.frontend_urls),
                             frontend_http(settings), guessed=guessed_trace_urls(settings))

    async def on_unmount(self) -> None:
        if self._poll_task is not None:
            self._poll_task.cancel()
        if self._control is not None:
            await self._control.close()
        task, self._connection_task = self._connection_task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await asyncio.wait_for(task, timeout=10)
            except (asyncio.CancelledError, TimeoutError):
                pass
