#!/usr/bin/env python3
"""Reads the import graph of the product code (``shared/``, ``daemon/``, ``console/``, imported as
``dynamod.shared`` ...) and prints what the house rules forbid; exits 1 when anything is found.

Three rules (issue 29):
- circles: no set of modules that import each other, directly or around a loop. Every import
  counts, at module level, inside a function or under ``TYPE_CHECKING``: a function-local import
  hides a circle from the interpreter, not from the reader (``--runtime-only`` ignores the
  ``TYPE_CHECKING`` ones).
- private names: no ``from X import _name`` (nor ``X._name`` on an imported module) of another
  module's private name; a name two modules share is public.
- layers: ``shared`` imports neither ``daemon`` nor ``console``; ``console`` does not import
  ``daemon``; ``daemon/engines`` imports neither ``daemon/worker`` nor ``daemon/frontend``.
- roles: a role (frontend, router, worker, planner, global_router) imports no other role, only the
  libraries under the roles (``router/core``, ``engines``, ``perf``, ``models``, ``lifecycle``), and
  a library imports no role. The tools that run or simulate roles (``supervisor`` for ``up``,
  ``replay``, ``profile``, ``cli``) may import them.

Only the source is read (``ast``), nothing is imported, so a broken module cannot hide an edge.
An import of a package counts as an import of its ``__init__``; the implicit import of a module's
parent packages does not (else every ``__init__`` that names a submodule would make a circle).

    python scripts/import_graph.py                 # all rules, text report, exit 1 on findings
    python scripts/import_graph.py --rule circles  # one rule (repeatable)
    python scripts/import_graph.py --json          # the findings as one JSON object
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT_PACKAGE = "dynamod"
LAYERS = ("shared", "daemon", "console")
RULES = ("circles", "private", "layers", "roles")

# (importer prefix, forbidden imported prefix, why)
LAYER_RULES = (
    ("dynamod.shared", "dynamod.daemon", "shared imports daemon"),
    ("dynamod.shared", "dynamod.console", "shared imports console"),
    ("dynamod.console", "dynamod.daemon", "console imports daemon"),
    ("dynamod.daemon.engines", "dynamod.daemon.worker", "an engine imports the worker"),
    ("dynamod.daemon.engines", "dynamod.daemon.frontend", "an engine imports the frontend"),
)


@dataclass(frozen=True, slots=True)
class Edge:
    """One import statement's reference from one module to another."""

    source: str
    target: str
    line: int
    type_checking: bool


@dataclass(slots=True)
class Graph:
    modules: dict[str, Path] = field(default_factory=dict)  # module name -> file
    packages: set[str] = field(default_factory=set)  # module names that are packages
    edges: list[Edge] = field(default_factory=list)
    private: list[tuple[str, int, str, str]] = field(default_factory=list)  # (module, line, from, name)


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """``daemon/engines/mocker/tiers.py`` -> (``dynamod.daemon.engines.mocker.tiers``, False)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join([ROOT_PACKAGE, *parts]), is_package


def discover(root: Path) -> Graph:
    graph = Graph()
    for layer in LAYERS:
        for path in sorted((root / layer).rglob("*.py")):
            name, is_package = module_name(root, path)
            graph.modules[name] = path
            if is_package:
                graph.packages.add(name)
    return graph


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base.pop()
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, target] if target else base)


class _Visitor(ast.NodeVisitor):
    """Collects the imports of one module, noting which sit under ``if TYPE_CHECKING:``."""

    def __init__(self, graph: Graph, module: str) -> None:
        self.graph = graph
        self.module = module
        self.is_package = module in graph.packages
        self.type_checking = 0
        self.module_aliases: dict[str, str] = {}  # local name -> project module it is bound to

    def _known(self, name: str) -> str | None:
        """The nearest project module ``name`` is or lies in (``a.b.func`` -> ``a.b``)."""
        while name:
            if name in self.graph.modules:
                return name
            name = name.rpartition(".")[0]
        return None

    def _add(self, target: str, line: int) -> None:
        if target != self.module:
            self.graph.edges.append(Edge(self.module, target, line, self.type_checking > 0))

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        guarded = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        if guarded:
            self.type_checking += 1
            for child in node.body:
                self.visit(child)
            self.type_checking -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            target = self._known(alias.name)
            if target is None:
                continue
            self._add(target, node.lineno)
            if alias.asname and target == alias.name:
                self.module_aliases[alias.asname] = target

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _resolve_relative(self.module, self.is_package, node.level, node.module)
        else:
            base = node.module or ""
        if self._known(base) is None:
            return
        for alias in node.names:
            full = f"{base}.{alias.name}"
            if full in self.graph.modules:  # ``from pkg import submodule``
                self._add(full, node.lineno)
                self.module_aliases[alias.asname or alias.name] = full
                continue
            target = self._known(base)
            assert target is not None
            self._add(target, node.lineno)
            if _is_private(alias.name):
                self.graph.private.append((self.module, node.lineno, target, alias.name))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and _is_private(node.attr):
            target = self.module_aliases.get(node.value.id)
            if target is not None and target != self.module:
                self.graph.private.append((self.module, node.lineno, target, node.attr))
        self.generic_visit(node)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def read_imports(graph: Graph) -> None:
    for module, path in graph.modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        _Visitor(graph, module).visit(tree)


def strongly_connected(nodes: list[str], succ: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative (the graph is deep enough to trouble recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(succ.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(succ.get(child, ())))))
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def circles(graph: Graph, *, runtime_only: bool) -> list[dict[str, object]]:
    succ: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], int] = {}
    for e in graph.edges:
        if runtime_only and e.type_checking:
            continue
        succ.setdefault(e.source, set()).add(e.target)
        lines.setdefault((e.source, e.target), e.line)
    out = []
    for component in strongly_connected(sorted(graph.modules), succ):
        members = set(component)
        inner = sorted(
            f"{_short(a)}:{lines[(a, b)]} -> {_short(b)}" for a in component for b in succ.get(a, ()) if b in members
        )
        out.append({"modules": [_short(m) for m in component], "imports": inner})
    return out


def private_imports(graph: Graph) -> list[str]:
    return sorted({f"{_short(m)}:{line} uses {_short(src)}.{name}" for m, line, src, name in graph.private})


def layer_violations(graph: Graph) -> list[str]:
    out = set()
    for e in graph.edges:
        for importer, imported, why in LAYER_RULES:
            if _under(e.source, importer) and _under(e.target, imported):
                out.add(f"{_short(e.source)}:{e.line} -> {_short(e.target)} ({why})")
    return sorted(out)


ROLE_PACKAGES = tuple(f"dynamod.daemon.{r}" for r in ("frontend", "router", "worker", "planner", "global_router"))
LIBRARIES = tuple(f"dynamod.daemon.{lib}" for lib in ("router.core", "engines", "perf", "models", "lifecycle"))


def _role_of(module: str) -> str | None:
    """The role package ``module`` belongs to, "library" for a library under the roles, else None."""
    if any(_under(module, lib) for lib in LIBRARIES):
        return "library"
    return next((role for role in ROLE_PACKAGES if _under(module, role)), None)


def role_violations(graph: Graph) -> list[str]:
    out = set()
    for e in graph.edges:
        source, target = _role_of(e.source), _role_of(e.target)
        if source is None or target in (None, "library") or source == target:
            continue
        who = "a library" if source == "library" else _short(source)
        out.add(f"{_short(e.source)}:{e.line} -> {_short(e.target)} ({who} imports the {_short(target)} role)")
    return sorted(out)


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _short(module: str) -> str:
    return module.removeprefix(ROOT_PACKAGE + ".")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="the repository root (holding shared/, daemon/, console/) [default: this checkout]")
    parser.add_argument("--rule", action="append", choices=RULES, help="check only this rule (repeatable) [default: all]")
    parser.add_argument("--runtime-only", action="store_true", help="ignore imports under `if TYPE_CHECKING:`")
    parser.add_argument("--json", action="store_true", help="print the findings as JSON")
    args = parser.parse_args(argv)
    missing = [layer for layer in LAYERS if not (args.root / layer).is_dir()]
    if missing:
        print(f"import_graph: {args.root} has no {', '.join(missing)} folder", file=sys.stderr)
        return 2
    graph = discover(args.root)
    try:
        read_imports(graph)
    except SyntaxError as exc:
        print(f"import_graph: cannot parse {exc.filename}:{exc.lineno}: {exc.msg}", file=sys.stderr)
        return 2
    rules = args.rule or list(RULES)
    found: dict[str, list] = {}
    if "circles" in rules:
        found["circles"] = circles(graph, runtime_only=args.runtime_only)
    if "private" in rules:
        found["private"] = private_imports(graph)
    if "layers" in rules:
        found["layers"] = layer_violations(graph)
    if "roles" in rules:
        found["roles"] = role_violations(graph)
    if args.json:
        print(json.dumps({"modules": len(graph.modules), "imports": len(graph.edges), **found}, indent=2))
    else:
        print(f"{len(graph.modules)} modules, {len(graph.edges)} imports")
        for rule, items in found.items():
            print(f"{rule}: {len(items)}")
            for item in items:
                if isinstance(item, dict):
                    print("  " + " <-> ".join(item["modules"]))
                    for edge in item["imports"]:
                        print(f"      {edge}")
                else:
                    print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
