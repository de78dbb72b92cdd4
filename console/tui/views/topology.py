"""Topology: namespace -> pool (engine workers by role) or component (frontends, routers,
planners) -> worker, each worker one row (id, status, role, model and LoRAs, node, age) with its
endpoints on one line beneath it. Dynamo registers nine endpoints per worker (``generate`` and its
control endpoints); one tree row each pushed the next worker off an 80x24 screen. Workers ``dynamod
up`` gave up on show under their pool as ``failed`` with their last death. Nodes are updated in
place, so expansion and the cursor survive every refresh; Enter opens a worker, space folds.

In a disaggregated cluster each pool's label also sums it (running, waiting, KV usage, KV transfer
rate, p99 and failures) and each worker that moves KV shows its transfer rate; those figures are
redrawn once a second, not on every load message."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from dynamod.console.present import fmt_age, fmt_bytes_rate, fmt_ms_value, fmt_pct
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.failed import STATUS_FAILED, FailedEntry
from dynamod.console.state.pools import PoolSummary, is_disaggregated, summarize_pools
from dynamod.console.state.records import POOL_ORDER, ROLE_ENCODE, Worker
from dynamod.console.state.transfers import TransferFigures
from dynamod.console.tui.details import failed_worker_detail
from dynamod.console.tui.messages import ShowDetail, ShowWorker
from dynamod.console.tui.style import STATUS_STYLE
from dynamod.console.tui.views.base import ViewMixin
from dynamod.shared.protocol import control
from dynamod.shared.security.printable import printable

Path = tuple[str, ...]
AGE_REFRESH_S = 5.0  # labels carry ages; redraw them this often even when nothing changed


def worker_label(worker: Worker, now: float, transfer: TransferFigures | None = None, *, role: bool = True) -> Text:
    """One worker in one line: id, status, role (outside a pool), transfer rate, model and LoRAs,
    node, age."""
    text = Text()
    text.append(worker.id_hex, style="bold")
    text.append("  ")
    text.append(worker.status, style=STATUS_STYLE.get(worker.status, ""))
    if role and worker.role:
        text.append(f"  {printable(worker.role)}")
    if transfer is not None and transfer.seen and worker.gone_at is None:
        text.append(f"  ⇄ {fmt_bytes_rate(transfer.bytes_per_s)}", style="cyan")
    if worker.model:
        text.append(f"  {printable(worker.model)}", style="magenta")
    if worker.loras:
        text.append(" +" + printable(",".join(sorted(worker.loras))), style="magenta dim")
    if worker.node:
        text.append(f"  {printable(worker.node)}", style="dim")
    started = worker.started_at
    end = worker.gone_at if worker.gone_at is not None else now
    text.append(f"  {fmt_age(end - started) if started else '-'}", style="dim")
    return text


MISSING_NAMED = 2  # control endpoints a worker may lack and still be summed up in a few words


def endpoints_line(worker: Worker) -> Text:
    """Every endpoint of the worker on one line; an endpoint whose status differs from the
    worker's says so (``drain (gone)``)."""
    text = Text("endpoints: ", style="dim")
    odd = {name: e.status for name, e in worker.endpoints.items() if e.status != worker.status}
    names = set(worker.endpoints)
    parts = []
    controls = set(control.CONTROL_ENDPOINTS)
    served, missing = controls & names, controls - names
    if served and len(missing) <= MISSING_NAMED and not odd.keys() & served:
        # The usual worker: say so in a few words instead of a list the screen cuts. One of an
        # older build lacks the newest endpoints (``traces``): named, since `dynamoctl trace` skips it.
        parts.append(f"all {len(controls)} control" if not missing
                     else f"{len(served)}/{len(controls)} control (no {', '.join(sorted(missing))})")
        names -= served
    for name in sorted(names, key=lambda n: (n != "generate", n)):
        parts.insert(0 if name == "generate" else len(parts), f"{name} ({odd[name]})" if name in odd else name)
    text.append(printable(", ".join(parts)))
    return text


def failed_label(f: FailedEntry) -> Text:
    text = Text(printable(f.name), style="bold")
    text.append("  ")
    text.append(STATUS_FAILED, style=STATUS_STYLE[STATUS_FAILED])
    text.append(f"  {printable(f.summary())}", style="red")
    return text


def pool_brief(p: PoolSummary) -> Text:
    """One pool's figures in a few words, for its label."""
    text = Text(f"run {p.running} wait {p.waiting} kv {fmt_pct(p.kv_avg)}")
    if p.transfers_seen:
        text.append(f" xfer {fmt_bytes_rate(p.bytes_per_s)} p99 {fmt_ms_value(p.p99_ms)}", style="cyan")
        if p.failures:
            text.append(f" fail {p.failures}", style="bold red")
    return text


def _counts_label(text: Text, statuses: list[str]) -> Text:
    counts = Counter(statuses)
    text.append(f" ({len(statuses)}", style="dim")
    sep = ": "
    for status in ("ready", "draining", "sleeping", "gone", STATUS_FAILED):
        if counts.get(status):
            text.append(sep, style="dim")
            text.append(f"{counts[status]} {status}", style=STATUS_STYLE.get(status, "dim"))
            sep = ", "
    text.append(")", style="dim")
    return text


class TopologyView(Tree[Any], ViewMixin):
    view_name = "topology"

    def __init__(self, *, id: str | None = None) -> None:  # noqa: A002
        super().__init__("cluster", id=id)
        self.show_root = False
        self.guide_depth = 2
        self.auto_expand = False  # Enter opens the worker; space folds
        self._path_nodes: dict[Path, TreeNode[Any]] = {}
        self._path_labels: dict[Path, Text] = {}
        self._seen: tuple[float, ...] = (-1.0,)
        self._state: ClusterState | None = None

    def _matches(self, worker: Worker) -> bool:
        needle = self.filter_text.lower()
        if not needle:
            return True
        hay = (f"{worker.namespace}/{worker.component} {worker.id_hex} {worker.role} {worker.status} {worker.model} "
               f"{' '.join(worker.loras)} {worker.node} {' '.join(worker.endpoints)}")
        return needle in hay.lower()

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        self._state = state
        now = state.clock()
        disaggregated = is_disaggregated(state.pools())
        # Pool figures move with load: once a second is often enough for a tree.
        seen = (float(state.versions.topology), float(int(now // AGE_REFRESH_S)), float(int(now)) if disaggregated else 0.0)
        if not force and seen == self._seen:
            return
        self._seen = seen
        # Desired tree: path -> (label, data, leaf), in display order.
        groups: dict[tuple[str, str], list[Worker]] = {}  # (namespace, group) -> workers
        for w in state.worker_list(workers_only=False):
            if w.endpoints and self._matches(w):
                group = f"pool:{w.pool}" if w.is_worker else "pool:encode" if w.is_encoder else f"component:{w.component}"
                groups.setdefault((w.namespace, group), []).append(w)
        failed: dict[tuple[str, str], list[FailedEntry]] = {}
        needle = self.filter_text.lower()
        for f in state.failed():
            if not needle or needle in f"{f.name} {f.namespace} {f.pool} {STATUS_FAILED} {f.record.reason}".lower():
                failed.setdefault((f.namespace, f"pool:{f.pool}"), []).append(f)
        tree: dict[Path, tuple[Text, Any, bool]] = {}
        order = {f"pool:{role}": i for i, role in enumerate((*POOL_ORDER, ROLE_ENCODE))}
        keys = sorted(set(groups) | set(failed), key=lambda k: (k[0], order.get(k[1], len(order)), k[1]))
        for ns, group in keys:
            members = groups.get((ns, group), [])
            gave_up = failed.get((ns, group), [])
            if (ns,) not in tree:
                count = sum(len(ws) for (n, _), ws in groups.items() if n == ns)
                label = Text(printable(ns), style="bold cyan")
                label.append(f" ({count} instances)", style="dim")
                tree[(ns,)] = (label, ("namespace", ns), False)
            kind, _, name = group.partition(":")
            if kind == "pool":
                label = Text(f"{name} pool", style="bold")
                components = sorted({w.component for w in members})
                if components:
                    label.append(f" · {printable(','.join(components))}", style="dim")
            else:
                label = Text(printable(name), style="bold")
            _counts_label(label, [w.status for w in members] + [STATUS_FAILED] * len(gave_up))
            if kind == "pool" and disaggregated and members:
                for pool in summarize_pools(members, state.transfers).values():
                    label.append("  ")
                    label.append_text(pool_brief(pool))
            tree[(ns, group)] = (label, ("group", ns, group), False)
            for w in members:
                transfer = state.transfers.figures(w.instance_id) if disaggregated else None
                path = (ns, group, f"{w.component}/{w.id_hex}")
                tree[path] = (worker_label(w, now, transfer, role=kind != "pool"), ("worker", w.instance_id), False)
                tree[(*path, "endpoints")] = (endpoints_line(w), ("endpoints", w.instance_id), True)
            for f in gave_up:
                tree[(ns, group, f"failed/{f.name}")] = (failed_label(f), ("failed", f.namespace, f.name), True)
        self._apply(tree)

    def _apply(self, tree: dict[Path, tuple[Text, Any, bool]]) -> None:
        for path in [p for p in self._path_nodes if p not in tree]:
            node = self._path_nodes.pop(path, None)
            self._path_labels.pop(path, None)
            if node is not None:
                node.remove()
            # Children of a removed node are gone with it.
            for child in [p for p in self._path_nodes if p[: len(path)] == path]:
                self._path_nodes.pop(child, None)
                self._path_labels.pop(child, None)
        for path, (label, data, leaf) in tree.items():
            node = self._path_nodes.get(path)
            if node is None:
                parent = self._path_nodes.get(path[:-1], self.root) if len(path) > 1 else self.root
                node = parent.add_leaf(label, data) if leaf else parent.add(label, data, expand=True)
                self._path_nodes[path] = node
                self._path_labels[path] = label
            elif self._path_labels.get(path) != label:
                node.set_label(label)
                self._path_labels[path] = label

    def selected_worker_id(self) -> int | None:
        node = self.cursor_node
        if node is not None and isinstance(node.data, tuple) and node.data[0] in ("worker", "endpoints"):
            return int(node.data[1])
        return None

    def on_tree_node_selected(self, event: Tree.NodeSelected[Any]) -> None:
        event.stop()
        data = event.node.data
        if not isinstance(data, tuple):
            return
        if data[0] in ("worker", "endpoints"):
            self.post_message(ShowWorker(int(data[1])))
        elif data[0] == "failed" and self._state is not None:
            entry = next((f for f in self._state.failed(data[1]) if f.name == data[2]), None)
            if entry is not None:
                title, body = failed_worker_detail(entry.namespace, entry.record, self._state.clock())
                self.post_message(ShowDetail(title, body))
