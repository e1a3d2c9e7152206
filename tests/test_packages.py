"""devd's packages depend on each other one way: no import cycle runs through `server`, `agent`, `cli` or `acp`
(the wire dispatches to the agent runtime's port and knows nothing of it; the command line is on top). Read from the
source's syntax, every import counted (those under TYPE_CHECKING and those inside functions too), so that it stays
true as code is added."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import devd

ROOT = Path(devd.__file__).parent
LAYERED = ("server", "agent", "cli", "acp")


def _unit(parts: list[str]) -> str | None:
    """The package or top-level module of devd a dotted name under devd falls in (None: devd itself, or a name that
    is not a module, as `from devd import ABI`)."""
    if not parts:
        return None
    head = parts[0]
    return head if (ROOT / head).is_dir() or (ROOT / f"{head}.py").is_file() else None


def _imported(path: Path) -> list[tuple[list[str], int]]:
    """Each devd module path (parts after `devd`) that path imports, with the import's line."""
    here = list(path.relative_to(ROOT).with_suffix("").parts)
    found: list[tuple[list[str], int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name.split(".")[1:], node.lineno) for a in node.names if a.name.split(".")[0] == "devd"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package this module is in
                base = here[: len(here) - node.level] + (node.module.split(".") if node.module else [])
            elif node.module is not None and node.module.split(".")[0] == "devd":
                base = node.module.split(".")[1:]
            else:
                continue
            found += [(base + [a.name], node.lineno) for a in node.names] if not base else [(base, node.lineno)]
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """For each package or top-level module of devd, those it imports, each with where (`path:line`)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(ROOT.rglob("*.py")):
        source = _unit(list(path.relative_to(ROOT).with_suffix("").parts))
        for parts, line in _imported(path):
            target = _unit(parts)
            if source is not None and target is not None and target != source:
                graph[source][target].append(f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def _reach(graph: dict[str, dict[str, list[str]]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for after in graph.get(todo.pop(), {}):
            if after not in seen:
                seen.add(after)
                todo.append(after)
    return seen


def cycles_through(graph: dict[str, dict[str, list[str]]], units: tuple[str, ...]) -> dict[str, list[str]]:
    """For each of `units` in a cycle, the imports it makes of the packages that import it back (directly or not)."""
    found: dict[str, list[str]] = {}
    for unit in units:
        back = {other for other in _reach(graph, unit) if unit in _reach(graph, other)}
        lines = [line for other in sorted(back) for line in graph[unit].get(other, [])]
        if back:
            found[unit] = lines or sorted(back)
    return found


def test_no_import_cycle_runs_through_the_server_the_agent_the_cli_or_acp() -> None:
    assert cycles_through(package_graph(), LAYERED) == {}


def test_a_cycle_is_found_and_named_by_its_imports() -> None:
    graph: dict[str, dict[str, list[str]]] = {
        "server": {"agent": ["devd/server/methods.py:3"]},
        "agent": {"sessions": ["devd/agent/port.py:1"]},
        "sessions": {"server": ["devd/sessions/x.py:9"]},
    }
    assert cycles_through(graph, ("server", "cli")) == {"server": ["devd/server/methods.py:3"]}
