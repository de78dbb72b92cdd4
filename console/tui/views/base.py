"""What every view offers the app, and the DataTable row sync they share.

A view redraws from ``ClusterState`` when the versions it depends on moved (``refresh_from``),
keeps its own filter, and tells the app which worker is selected (the target of actions).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.text import Text
from textual.widgets import DataTable
from textual.widgets.data_table import CellKey, ColumnKey, RowKey

from dynamod.console.state.cluster import ClusterState

Cell = str | Text
Row = tuple[str, Sequence[Cell]]  # (row key, cells)


class ViewMixin:
    """Mixed into each view widget. ``name`` is what ``:`` jumps to."""

    view_name: str = ""
    filter_text: str = ""

    def refresh_from(self, state: ClusterState, *, force: bool = False) -> None:  # pragma: no cover - interface
        raise TypeError(f"{type(self).__name__} must implement refresh_from")

    def set_filter(self, text: str, state: ClusterState) -> None:
        self.filter_text = text
        self.refresh_from(state, force=True)

    def selected_worker_id(self) -> int | None:
        return None


class LiveTable(DataTable):
    """A DataTable that takes many cell changes with one repaint.

    ``DataTable.update_cell`` repaints per call; at 256 workers with load moving ten times a
    second that is thousands of repaints per refresh and the console's main cost. ``update_cells``
    writes the cells and invalidates the render caches once (the same steps ``update_cell`` takes
    with ``update_width=True``, done once), falling back to ``update_cell`` if the table's internals
    ever change.

    Auto-width columns grow to a wider value: a column first drawn with ``ready`` must not cut a
    later ``draining`` to ``draini``. Columns given a fixed width keep it (DataTable only widens
    auto-width ones).
    """

    def update_cells(self, changes: list[tuple[str, str, Cell]]) -> None:
        if not changes:
            return
        data = getattr(self, "_data", None)
        updated = getattr(self, "_updated_cells", None)
        if (
            not isinstance(data, dict)
            or not isinstance(getattr(self, "_update_count", None), int)
            or not isinstance(updated, set)
        ):
            for row, col, value in changes:
                self.update_cell(row, col, value, update_width=True)
            return
        for row, col, value in changes:
            data[row][col] = value  # RowKey/ColumnKey hash and compare equal to their strings
            updated.add(CellKey(RowKey(row), ColumnKey(col)))
        self._update_count += 1
        self._require_update_dimensions = True
        self.refresh()


def _update_changed_cells(
    table: DataTable, rows: Iterable[Row], cache: dict[str, tuple[Cell, ...]]
) -> None:
    """Updates in place the cells of ``rows`` (keys the table and ``cache`` already hold) that
    differ from ``cache``, in one batch on a ``LiveTable``, and records the new cells."""
    columns = [c.value for c in table.columns]
    changes: list[tuple[str, str, Cell]] = []
    for key, cells in rows:
        old = cache[key]
        for i, cell in enumerate(cells):
            before = old[i]
            if before is not cell and before != cell:
                changes.append((key, columns[i], cell))  # type: ignore[arg-type]
        cache[key] = tuple(cells)
    if isinstance(table, LiveTable):
        table.update_cells(changes)
    else:
        for key, col, cell in changes:
            table.update_cell(key, col, cell, update_width=True)


def sync_table(table: DataTable, rows: list[Row], cache: dict[str, tuple[Cell, ...]]) -> None:
    """Brings ``table`` to ``rows`` with the least work.

    Same keys in the same order: only changed cells are updated in place (the common case, load
    moving ten times a second). Otherwise the table is rebuilt and the cursor stays on the row it
    was on, by key, so a refresh never yanks the operator's selection.
    """
    keys = [k for k, _ in rows]
    if keys == list(cache):
        _update_changed_cells(table, rows, cache)
        return
    cursor_key = None
    if table.row_count and 0 <= table.cursor_row < table.row_count:
        try:
            cursor_key = table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
        except Exception:  # noqa: BLE001 - a stale coordinate just means "no selection to keep"
            cursor_key = None
    table.clear()
    cache.clear()
    for key, cells in rows:
        table.add_row(*cells, key=key)
        cache[key] = tuple(cells)
    if cursor_key is not None and cursor_key in cache:
        table.move_cursor(row=table.get_row_index(cursor_key), animate=False)


def sync_slots(table: DataTable, rows: list[Sequence[Cell]], cache: dict[str, tuple[Cell, ...]]) -> None:
    """Brings a newest-first log table to ``rows`` without rebuilding it.

    Rows are slots ``"0"``, ``"1"``... rather than tied to entries: a new entry at the top shifts
    the text of every slot down, which is a batch of cell updates, where inserting at the top
    would mean re-adding (and re-measuring) the whole table on every new event. Columns of such
    tables have fixed widths, so nothing is measured per update.
    """
    count = len(cache)
    if len(rows) < count:
        for i in range(len(rows), count):
            table.remove_row(str(i))
            del cache[str(i)]
    _update_changed_cells(table, [(str(i), cells) for i, cells in enumerate(rows[: len(cache)])], cache)
    for i in range(len(cache), len(rows)):
        table.add_row(*rows[i], key=str(i))
        cache[str(i)] = tuple(rows[i])


def selected_key(table: DataTable) -> str | None:
    if not table.row_count:
        return None
    try:
        return table.coordinate_to_cell_key(table.cursor_coordinate).row_key.value
    except Exception:  # noqa: BLE001 - empty or stale cursor
        return None
