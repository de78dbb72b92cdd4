"""Topology: namespace -> component -> endpoint -> instance, each instance with its role, status,
model and LoRAs, node and age. Nodes are updated in place, so expansion and the cursor survive
every refresh.

In a disaggregated cluster each component's label also sums its pools (per role: running, waiting,
KV usage, KV transfer rate, p99 and failures) and each instance that moves KV shows its transfer
rate; those figures are redrawn once a second, not on every load message."""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from dynamod.console.present import fmt_age, fmt_bytes_rate, fmt_ms_value, fmt_pct
from dynamod.console.state.cluster import ClusterState
from dynamod.console.state.pools import PoolSummary, is_disaggregated, summarize_pools
from dynamod.console.state.records import EndpointInstance, Worker
from dynamod.console.state.transfers import TransferFigures
from dynamod.console.tui.messages import ShowWorker
from dynamod.console.tui.style import STATUS_STYLE
from dynamod.console.tui.views.base import ViewMixin

Path = tuple[str, ...]
AGE_REFRESH_S = 5.0  # labels carry ages; redraw them this often even when nothing changed


def instance_label(entry: EndpointInstance, worker: Worker | None, now: float, transfer: TransferFigures | None = None) -> Text:
    rec = entry.record
    status = entry.status
    text = Text()
    text.append(f"{rec.instance_id:x}", style="bold")
    text.append("  ")
    text.append(status, style=STATUS_STYLE.get(status, ""))
    if rec.role:
        text.append(f"  {rec.role}")
    if transfer is not None and transfer.seen and entry.gone_at is None:
        text.append(f"  ⇄ {fmt_bytes_rate(transfer.bytes_per_s)}", style="cyan")
    model = rec.model or (worker.model if worker else "")
    if model:
        text.append(f"  {model}", style="magenta")
    if worker and worker.loras:
        text.append(" +" + ",".join(sorted(worker.loras)), style="magenta dim")
    if rec.node:
        text.append(f"  {rec.node}", style="dim")
    started = rec.started_at or (worker.first_seen if worker else 0.0)
    gone = entry.gone_at
    text.append(f"  {fmt_age((gone if gone is not None else now) - started) if started else '-'}", style="dim")
    return text


def pool_brief(p: PoolSummary) -> Text:
    """One pool in a few words, for a component's label."""
    text = Text(f"{p.role}:", style="bold")
    text.append(f" run {p.running} wait {p.waiting} kv {fmt_pct(p.kv_avg)}")
    if p.transfers_seen:
        text.append(f" xfer {fmt_bytes_rate(p.bytes_per_s)} p99 {fmt_ms_value(p.p99_ms)}", style="cyan")
        if p.failures:
            text.append(f" fail {p.failures}", style="bold red")
    return text


def _counts_label(name: str, statuses: list[str]) -> Text:
    counts = Counter(statuses)
    text = Text(name, style="bold")
    text.append(f" ({len(statuses)}", style="dim")
    sep = ": "
    for status in ("ready", "draining", "sleeping", "gone"):
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
        self._path_nodes: dict[Path, TreeNode[Any]] = {}
        self._path_labels: dict[Path, Text] = {}
        self._seen = (-1, -1.0)

    def _matches(self, entry: EndpointInstance, worker: Worker | None) -> bool:
        needle = self.filter_text.lower()
        if not needle:
            return True
        rec = entry.record
        loras = " ".join(worker.loras) if worker else ""
        hay = f"{rec.namespace}/{rec.component}/{rec.endpoint} {rec.instance_id:x} {rec.role} {entry.status} {rec.model} {loras} {rec.node}"
        return needle in hay.lower()

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:
        now = state.clock()
        disaggregated = is_disaggregated(state.pools())
        # Pool figures move with load: once a second is often enough for a tree.
        seen = (state.versions.topology, float(int(now // AGE_REFRESH_S)), float(int(now)) if disaggregated else 0.0)
        if not force and seen == self._seen:
            return
        self._seen = seen
        # Desired tree: path -> (label, data, leaf), in display order.
        tree: dict[Path, tuple[Text, Any, bool]] = {}
        grouped: dict[Path, list[tuple[EndpointInstance, Worker | None]]] = {}
        for entry in state.instances.values():
            rec = entry.record
            worker = state.workers.get((rec.namespace, rec.component, rec.instance_id))
            if self._matches(entry, worker):
                grouped.setdefault((rec.namespace, rec.component, rec.endpoint), []).append((entry, worker))
        for (ns, comp, ep), entries in sorted(grouped.items()):
            if (ns,) not in tree:
                iids = {e.record.instance_id for (n, _, _), es in grouped.items() if n == ns for e, _ in es}
                label = Text(ns, style="bold cyan")
                label.append(f" ({len(iids)} instances)", style="dim")
                tree[(ns,)] = (label, ("namespace", ns), False)
            if (ns, comp) not in tree:
                iids = {e.record.instance_id for (n, c, _), es in grouped.items() if (n, c) == (ns, comp) for e, _ in es}
                label = Text(comp, style="bold")
                label.append(f" ({len(iids)})", style="dim")
                if disaggregated:
                    members = [w for w in state.workers.values() if w.namespace == ns and w.component == comp]
                    for pool in summarize_pools(members, state.transfers).values():
                        label.append("  ")
                        label.append_text(pool_brief(pool))
                tree[(ns, comp)] = (label, ("component", ns, comp), False)
            tree[(ns, comp, ep)] = (_counts_label(ep, [e.status for e, _ in entries]), ("endpoint", ns, comp, ep), False)
            for entry, worker in sorted(entries, key=lambda ew: ew[0].record.instance_id):
                iid = entry.record.instance_id
                transfer = state.transfers.figures(iid) if disaggregated else None
                tree[(ns, comp, ep, f"{iid:x}")] = (instance_label(entry, worker, now, transfer), ("instance", iid), True)
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
                expand = len(path) <= 2 or (len(path) == 3 and path[2] == "generate")
                node = parent.add_leaf(label, data) if leaf else parent.add(label, data, expand=expand)
                self._path_nodes[path] = node
                self._path_labels[path] = label
            elif self._path_labels.get(path) != label:
                node.set_label(label)
                self._path_labels[path] = label

    def selected_worker_id(self) -> int | None:
        node = self.cursor_node
        if node is not None and isinstance(node.data, tuple) and node.data[0] == "instance":
            return int(node.data[1])
        return None

    def on_tree_node_selected(self, event: Tree.NodeSelected[Any]) -> None:
        event.stop()
        data = event.node.data
        if isinstance(data, tuple) and data[0] == "instance":
            self.post_message(ShowWorker(int(data[1])))
