"""Pushed screens: the worker detail (Enter), the detail pane of any other row (Enter), the confirm dialog for capacity-removing actions,
the small forms actions need (sleep level, LoRA name and source, a pool's replica count), and help
(``?``). Dialog text wraps: at 80x24 a question longer than the dialog must not be cut."""

from __future__ import annotations

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, OptionList, Sparkline, Static

from dynamod.console.actions.scaling import check_replicas
from dynamod.console.actions.specs import ACTIONS, POOL_ACTIONS
from dynamod.console.present import (
    fmt_age,
    fmt_budget,
    fmt_bytes_rate,
    fmt_count,
    fmt_ms,
    fmt_ms_value,
    fmt_pct,
    fmt_rate,
)
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.records import fmt_id
from dynamod.console.state.scaling import PoolScaling
from dynamod.console.tui.messages import ShowWorker
from dynamod.console.tui.style import STATUS_STYLE, plain, severity_text
from dynamod.shared.protocol.routing import STAGE_AGG
from dynamod.shared.security.printable import printable


def _by_prefill(headline: float | None, by: dict[str, float]) -> str:
    """A latency figure, split by where prompts were prefilled when the worker has both kinds
    (``local 498ms / remote 20ms``): two populations, two numbers."""
    if len(by) < 2:
        return fmt_ms(headline)
    return " / ".join(f"{prefill} {fmt_ms(v)}" for prefill, v in sorted(by.items()))


class WorkerScreen(Screen[None]):
    """Everything about one worker: identity, load history, endpoints, LoRAs, its recent routing
    decisions and events. The app's action keys act on this worker while it is shown."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back")]
    DEFAULT_CSS = """
    WorkerScreen { layout: vertical; }
    WorkerScreen #title { height: 1; background: $primary-background; padding: 0 1; }
    WorkerScreen #body { height: 1fr; }
    WorkerScreen #facts { height: auto; padding: 0 1; }
    WorkerScreen Sparkline { height: 3; margin: 0 1; }
    WorkerScreen #more { height: auto; padding: 0 1; }
    WorkerScreen #history-label { height: 1; padding: 0 1; color: $text-muted; }
    """

    def __init__(self, state: ClusterState, instance_id: int) -> None:
        super().__init__()
        self.state = state
        self.instance_id = instance_id
        self._seen = -1
        # The app's refresh timer can tick between push_screen and this screen's mount, when it is
        # already ``app.screen`` but has no widgets yet; it draws only once mounted.
        self._mounted = False

    def compose(self) -> ComposeResult:
        yield Static("", id="title")
        with VerticalScroll(id="body"):
            yield Static("", id="facts")
            yield Static("", id="history-label")
            yield Sparkline([], summary_function=max, id="history")
            yield Static("", id="more")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self._mounted = True
        self.refresh_from(force=True)

    def refresh_from(self, *, force: bool = False) -> None:
        if not self._mounted:
            return
        seen = self.state.versions.total() + int(self.state.clock())
        if not force and seen == self._seen:
            return
        self._seen = seen
        w = self.state.find_worker(self.instance_id)
        title = self.query_one("#title", Static)
        if w is None:
            title.update(f"instance {fmt_id(self.instance_id)}: no longer known")
            return
        now = self.state.clock()
        st = w.stats
        head = Text(printable(f"{w.namespace}/{w.component}/{w.id_hex}  "), style="bold")
        head.append(w.status, style=STATUS_STYLE.get(w.status, ""))
        title.update(head)
        facts = Table.grid(padding=(0, 2))
        facts.add_column(style="dim")
        facts.add_column()
        facts.add_column(style="dim")
        facts.add_column()
        # Names from discovery as ``plain`` cells: a rich table reads a str as markup.
        facts.add_row("role", plain(w.role or "-"), "model", plain(w.model or "-"))
        facts.add_row("node", plain(w.node or "-"), "pid", str(w.pid or "-"))
        facts.add_row("age", fmt_age(now - w.started_at if w.started_at else None), "loras",
                      plain(", ".join(sorted(w.loras)) or "-"))
        facts.add_row("running", str(st.running) if st.loads else "-", "waiting", str(st.waiting) if st.loads else "-")
        facts.add_row("kv usage", fmt_pct(st.kv_usage), "prefix hits", fmt_pct(st.hit_rate))
        facts.add_row("ttft", _by_prefill(st.ttft_s, st.ttft_by), "itl", _by_prefill(st.itl_s, st.itl_by))
        # Cached blocks are the worker's own (kv_dump at start, then events); routing decisions
        # are only those this console heard, which the label says rather than a bare 0.
        facts.add_row("cached blocks", fmt_count(st.cached_blocks), "routed (seen)", fmt_count(st.routed))
        facts.add_row("status url", plain(w.system_url or "-"), "kv gaps", str(st.kv_gaps))
        xfer = self.state.transfers.figures(w.instance_id)
        if xfer is not None and xfer.seen:
            # Disaggregated workers only: a decode worker's pulls, a prefill worker's reads served.
            facts.add_row("kv transfer", f"{fmt_bytes_rate(xfer.bytes_per_s)} ({fmt_count(xfer.transfers)} total)",
                          "p50 / p99", f"{fmt_ms_value(xfer.p50_ms)} / {fmt_ms_value(xfer.p99_ms)}")
            facts.add_row("xfer failures", str(xfer.failures), "held blocks", fmt_count(xfer.held_blocks))
        for medium, tier in self.state.tiers.figures(w.instance_id).items():
            # Workers with KV offloading only: occupancy, prompt tokens served, traffic per tier.
            facts.add_row(f"kv {medium.lower()}", f"{fmt_pct(tier.usage)} of {fmt_count(tier.total_blocks)} blocks",
                          "hit tokens", fmt_count(tier.hit_tokens))
            facts.add_row(f"{medium.lower()} onboard", fmt_rate(tier.onboard_per_s),
                          "offload", fmt_rate(tier.offload_per_s))
        self.query_one("#facts", Static).update(facts)
        history = list(st.history)
        peak = max(history) if history else 0.0
        self.query_one("#history-label", Static).update(
            f"load (running + waiting), last {len(history)} s, peak {peak:g}, now {st.load_value:g}"
        )
        self.query_one("#history", Sparkline).data = history or [0.0]
        more = Text()
        statuses = {e.status for e in w.endpoints.values()}
        if len(statuses) == 1:
            more.append(f"endpoints (all {statuses.pop()}): ", style="dim")
            more.append(printable(", ".join(sorted(w.endpoints))) + "\n")
        else:
            more.append("endpoints: ", style="dim")
            more.append(printable(", ".join(f"{name} ({e.status})" for name, e in sorted(w.endpoints.items()))) + "\n")
        decisions = [d for d in reversed(self.state.decisions) if d.worker_id == w.instance_id][:5]
        if decisions:
            more.append("recent routing decisions:\n", style="dim")
            for d in decisions:
                stage = f"{d.stage}: " if d.stage != STAGE_AGG else ""
                more.append(f"  {fmt_age(now - d.ts):>4}  {stage}{printable(d.why())}\n")
        events = [e for e in self.state.recent_events(limit=200) if e.instance_id == w.instance_id][:8]
        if events:
            more.append("recent events:\n", style="dim")
            for e in events:
                more.append(f"  {fmt_age(now - e.ts):>4}  ")
                more.append_text(severity_text(printable(e.message), e.severity))
                more.append("\n")
        self.query_one("#more", Static).update(more)


class DetailScreen(Screen[None]):
    """The full text of one row (``tui/details.py``), wrapped and scrollable: Esc goes back; with a
    worker behind the row, Enter opens it."""

    BINDINGS = [Binding("escape", "app.pop_screen", "Back"), Binding("enter", "open_worker", "Worker", show=False)]
    DEFAULT_CSS = """
    DetailScreen { layout: vertical; }
    DetailScreen #detail-title { height: 1; background: $primary-background; padding: 0 1; }
    DetailScreen #detail-body { height: 1fr; }
    DetailScreen #detail-text { height: auto; padding: 0 1; }
    """

    def __init__(self, title: str, body: RenderableType, worker_id: int | None = None) -> None:
        super().__init__()
        self.title_text = title
        self.body = body
        self.worker_id = worker_id

    def compose(self) -> ComposeResult:
        yield Static(Text(self.title_text, style="bold"), id="detail-title")
        with VerticalScroll(id="detail-body"):
            yield Static(self.body, id="detail-text")
        yield Footer(compact=True, show_command_palette=False)

    def action_open_worker(self) -> None:
        if self.worker_id is not None:
            self.post_message(ShowWorker(self.worker_id))


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no for actions that remove capacity. Defaults to No; ``y`` confirms, ``n``/Esc cancel."""

    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"), Binding("escape", "answer(False)", "Cancel")]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 60; max-width: 95%; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    ConfirmScreen #question { width: 100%; margin-bottom: 1; }
    ConfirmScreen Horizontal { height: auto; align: center middle; }
    ConfirmScreen Button { margin: 0 2; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question", markup=False)
            with Horizontal():
                yield Button("Yes (y)", id="yes", variant="warning")
                yield Button("No (n)", id="no", variant="primary")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class SleepLevelScreen(ModalScreen[int | None]):
    """Picks the sleep level: 1 keeps weights in host memory (fast wake), 2 drops them. Its labels
    wrap (``width: 100%``): at 80 columns the question is longer than the dialog is wide."""

    BINDINGS = [Binding("1", "pick(1)", "Level 1"), Binding("2", "pick(2)", "Level 2"), Binding("escape", "pick(0)", "Cancel")]
    DEFAULT_CSS = """
    SleepLevelScreen { align: center middle; }
    SleepLevelScreen > Vertical { width: 60; max-width: 95%; height: auto; border: thick $warning; background: $surface; padding: 1 2; }
    SleepLevelScreen Label { width: 100%; }
    """

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Put worker {self.target} to sleep. It stops taking requests.")
            yield Label("1: level 1 (weights kept on host, fast wake)")
            yield Label("2: level 2 (weights dropped, slow wake)")
            yield Label("Esc: cancel", classes="dim")

    def action_pick(self, level: int) -> None:
        self.dismiss(level or None)


class LoraLoadScreen(ModalScreen[tuple[str, str] | None]):
    """Asks for the adapter's name and its source (a path or a URI such as file:// or s3://)."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    LoraLoadScreen { align: center middle; }
    LoraLoadScreen > Grid { grid-size: 2; grid-columns: 10 1fr; grid-rows: auto; width: 70; max-width: 98%; height: auto;
        border: thick $primary; background: $surface; padding: 1 2; }
    LoraLoadScreen #lora-error { column-span: 2; color: $error; height: auto; width: 100%; }
    LoraLoadScreen #lora-help { column-span: 2; height: auto; width: 100%; margin-bottom: 1; }
    """

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def compose(self) -> ComposeResult:
        with Grid():
            yield Label(f"Load a LoRA adapter on {self.target} (Enter to load, Esc to cancel)", id="lora-help")
            yield Label("name")
            yield Input(placeholder="adapter name", id="lora-name")
            yield Label("source")
            yield Input(placeholder="path or URI (file://, s3://, hf://)", id="lora-source")
            yield Label("", id="lora-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        name = self.query_one("#lora-name", Input).value.strip()
        source = self.query_one("#lora-source", Input).value.strip()
        if event.input.id == "lora-name" and not source:
            self.query_one("#lora-source", Input).focus()
            return
        if not name or "/" in name:
            self.query_one("#lora-error", Label).update("the name must be non-empty and contain no '/'")
            self.query_one("#lora-name", Input).focus()
            return
        if not source:
            self.query_one("#lora-error", Label).update("a source path or URI is needed")
            return
        self.dismiss((name, source))

    def action_cancel(self) -> None:
        self.dismiss(None)


class LoraUnloadScreen(ModalScreen[str | None]):
    """Picks one of the worker's loaded adapters."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    LoraUnloadScreen { align: center middle; }
    LoraUnloadScreen > Vertical { width: 60; max-width: 95%; height: auto; max-height: 80%; border: thick $warning;
        background: $surface; padding: 1 2; }
    LoraUnloadScreen Label { width: 100%; }
    LoraUnloadScreen OptionList { height: auto; max-height: 12; }
    """

    def __init__(self, target: str, loras: list[str]) -> None:
        super().__init__()
        self.target = target
        self.loras = loras

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Unload which adapter from {self.target}? (Enter picks, Esc cancels)")
            yield OptionList(*(plain(name) for name in self.loras), id="lora-options")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(self.loras[event.option_index])

    def action_cancel(self) -> None:
        self.dismiss(None)


class ScaleScreen(ModalScreen[tuple[int, str] | None]):
    """Asks for a pool's replica count (and, optionally, why): the operator's override."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    ScaleScreen { align: center middle; }
    ScaleScreen > Vertical { width: 70; max-width: 98%; height: auto; border: thick $primary; background: $surface;
        padding: 1 2; }
    ScaleScreen Label { width: 100%; }
    ScaleScreen Horizontal { height: auto; }
    ScaleScreen .field { width: 10; padding-top: 1; }
    ScaleScreen Input { width: 1fr; }
    ScaleScreen #scale-error { color: $error; height: auto; }
    """

    def __init__(self, pool: PoolScaling) -> None:
        super().__init__()
        self.pool = pool

    def compose(self) -> ComposeResult:
        p = self.pool
        now = f"{p.ready} ready"
        if p.desired is not None:
            now += f", planner wants {p.desired}"
        if p.override is not None:
            now += f", override {p.override.replicas}"
        with Vertical():
            yield Label(f"Hold {p.key} at how many replicas? ({now}; budget {fmt_budget(p)})")
            yield Label("Enter sets it until cleared (x), Esc cancels.", classes="dim")
            with Horizontal():
                yield Label("replicas", classes="field")
                yield Input(placeholder="0 or more", type="integer", id="scale-replicas")
            with Horizontal():
                yield Label("reason", classes="field")
                yield Input(placeholder="optional: shown beside the override", id="scale-reason")
            yield Label("", id="scale-error")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        text = self.query_one("#scale-replicas", Input).value.strip()
        try:
            replicas = int(text)
        except ValueError:
            self.query_one("#scale-error", Label).update("replicas must be a whole number")
            self.query_one("#scale-replicas", Input).focus()
            return
        bad = check_replicas(replicas)
        if bad is not None:
            self.query_one("#scale-error", Label).update(bad)
            self.query_one("#scale-replicas", Input).focus()
            return
        if event.input.id == "scale-replicas" and not self.query_one("#scale-reason", Input).value:
            self.query_one("#scale-reason", Input).focus()
            return
        self.dismiss((replicas, self.query_one("#scale-reason", Input).value.strip()))

    def action_cancel(self) -> None:
        self.dismiss(None)


HELP_KEYS: tuple[tuple[str, str], ...] = (
    (":", "jump to a view (topology, workers, models, events, router, scaling, requests); → completes"),
    ("1-7", "jump to view 1..7"),
    ("/", "filter the current view (Enter keeps it, Esc clears)"),
    ("Enter", "drill in: a worker's detail, a model's workers, the full text of an event, decision or pool, "
              "a request's waterfall (requests view) and a span's attributes"),
    ("Esc", "back / clear filter"),
    ("ctrl+p", "command palette: every action and view"),
    ("?", "this help"),
    ("q", "quit"),
)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [Binding("escape", "app.pop_screen", "Close"), Binding("question_mark", "app.pop_screen", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > VerticalScroll { width: 78; max-width: 100%; height: auto; max-height: 95%; border: thick $primary;
        background: $surface; padding: 0 1; }
    """

    def __init__(self, read_only: bool) -> None:
        super().__init__()
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold cyan", no_wrap=True)
        table.add_column()
        for key, text in HELP_KEYS:
            table.add_row(key, text)
        if self.read_only:
            table.add_row("", Text("read-only: actions are disabled", style="yellow"))
        else:
            for spec in ACTIONS:
                mark = " (asks to confirm)" if spec.removes_capacity else ""
                table.add_row(spec.key, f"{spec.title}: {spec.help}{mark}")
            table.add_row("", Text("in the scaling view, on the selected pool:", style="dim"))
            for pool_spec in POOL_ACTIONS:
                table.add_row(pool_spec.key, f"{pool_spec.title}: {pool_spec.help}")
        with VerticalScroll():
            yield Static(Text("dynamo-console keys", style="bold"))
            yield Static(table)
