"""Just enough PromQL reading for the dashboard tests: the metric names and label names an
expression uses. Not a parser: it strips strings, label matchers, ranges and grouping clauses, then
every identifier not followed by ``(`` (a function or aggregation) and not a keyword is a metric."""

from __future__ import annotations

import re

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')
_MATCHERS = re.compile(r"\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_IDENT = re.compile(r"(?<![\w.$])([A-Za-z_:][A-Za-z0-9_:]*)(\s*\()?")
_LEGEND_LABEL = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")
_LABEL_VALUES = re.compile(r"^\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*$")


def metric_names(expr: str) -> set[str]:
    s = _STRING.sub('""', expr)
    s = _MATCHERS.sub(" ", s)
    s = _RANGE.sub(" ", s)
    s = _GROUPING.sub(" ", s)
    return {m.group(1) for m in _IDENT.finditer(s) if not m.group(2) and m.group(1) not in KEYWORDS}


def label_names(expr: str) -> set[str]:
    s = _STRING.sub('""', expr)
    labels = set()
    for m in _MATCHERS.finditer(s):
        labels |= set(_MATCHER_LABEL.findall(m.group(1)))
    for m in _GROUPING.finditer(_MATCHERS.sub(" ", s)):
        labels |= {part.strip() for part in m.group(1).split(",") if part.strip()}
    return labels


def legend_labels(legend: str) -> set[str]:
    return set(_LEGEND_LABEL.findall(legend or ""))


def label_values_query(query: str) -> tuple[str, str] | None:
    """``label_values(selector, label)`` -> (selector, label)."""
    m = _LABEL_VALUES.match(query)
    return (m.group(1), m.group(2)) if m else None
