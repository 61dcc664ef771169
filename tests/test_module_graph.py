"""The shape of the code, read from its source with ast: no import cycles between clipforge modules, no huge module.

Every ``.py`` file of every room folder that setup.cfg's ``package_dir`` installs counts, sub-packages
(``jobs/bench``, ``hpc/devcluster``) included. An import counts wherever it is written: at the top, inside
a function, under ``if TYPE_CHECKING:``, absolute or relative. A cycle is a design problem even where a
deferred import keeps it from failing at run time.
"""

from __future__ import annotations

import ast
import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 450


def rooms() -> dict[str, Path]:
    """Installed package name -> its folder, from setup.cfg's ``package_dir``."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    lines = [line.split("=") for line in config["options"]["package_dir"].strip().splitlines() if "=" in line]
    return {package.strip(): ROOT / folder.strip() for package, folder in lines}


def modules() -> dict[str, Path]:
    """Every clipforge module's dotted name -> its source file (a package by its ``__init__.py``)."""
    found = {}
    for package, folder in rooms().items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The clipforge modules that ``name`` (the module in ``path``) imports, anywhere in its source."""
    is_package = path.name == "__init__.py"
    targets: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            # ``from package import module`` is an edge to the module; ``from module import name`` to the module.
            candidates = [f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names]
        else:
            continue
        for candidate in candidates:
            target = nearest_module(candidate, known)
            if target is not None and target != name:
                targets.add(target)
    return targets


def nearest_module(dotted: str, known: set[str]) -> str | None:
    """``dotted`` if it is a clipforge module, else the closest enclosing one (an attribute of it), else None."""
    parts = dotted.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    found = modules()
    known = set(found)
    return {name: imported(name, path, known) for name, path in found.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to where it starts) for each group of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(shortest_cycle(graph, group) for group in groups)


def shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest way from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & group):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def test_the_cycle_finder_finds_each_cycle_once_and_nothing_in_a_tree() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_every_kind_of_import_is_an_edge(tmp_path: Path) -> None:
    source = tmp_path / "trainer.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "import clipforge.hpc.distenv\n"
        "from . import settings\n"
        "from .builders import create_model\n"
        "from clipforge import rundir\n"
        "if TYPE_CHECKING:\n"
        "    from clipforge.preprocess.reader import ClipDataset\n"
        "def late():\n"
        "    from ..registry import repo\n"
    )
    known = {"clipforge.hpc.distenv", "clipforge.models.settings", "clipforge.models.builders", "clipforge.rundir"}
    known |= {"clipforge.preprocess.reader", "clipforge.registry.repo"}
    packages = {"clipforge.models", "clipforge.registry"}  # importing a module of a package is no edge to it
    assert imported("clipforge.models.trainer", source, known | packages | {"clipforge.models.trainer"}) == known


def test_no_two_clipforge_modules_import_each_other_even_through_others() -> None:
    graph = import_graph()
    assert len(graph) > 50 and any(name.startswith("clipforge.jobs.bench.") for name in graph)
    found = cycles(graph)
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(cycle) for cycle in found)


def test_no_module_is_over_450_lines() -> None:
    sizes = {name: len(path.read_text().splitlines()) for name, path in modules().items()}
    over = sorted(f"{name}: {lines} lines" for name, lines in sizes.items() if lines > MAX_LINES)
    assert over == [], f"modules over {MAX_LINES} lines (split them by idea):\n" + "\n".join(over)


ORDER = ["base", "hpc", "preprocess", "rundir", "models", "inference", "train", ("ps", "registry"), "jobs"]
"""The rooms from the bottom up (docs/architecture.md): a room imports only rooms below it. Rooms that share a
level (in a tuple) import neither each other."""


def level(room: str) -> int:
    return next(i for i, step in enumerate(ORDER) if room == step or (isinstance(step, tuple) and room in step))


def uphill(graph: dict[str, set[str]]) -> list[str]:
    """Each import from a room to one at its level or above it, as ``importer -> imported``."""
    found = []
    for name, targets in graph.items():
        room = name.split(".")[1]
        for target in sorted(targets):
            other = target.split(".")[1]
            if other != room and level(other) >= level(room):
                found.append(f"{name} -> {target}")
    return sorted(found)


def test_the_order_of_rooms_names_every_room() -> None:
    named = {room for step in ORDER for room in (step if isinstance(step, tuple) else (step,))}
    assert named == {package.split(".")[1] for package in rooms()}


def test_an_import_up_the_order_of_rooms_is_found() -> None:
    graph = {"clipforge.models.builders": {"clipforge.train.settings"}, "clipforge.ps.run": {"clipforge.registry.x"}}
    graph |= {"clipforge.train.trainer": {"clipforge.models.builders", "clipforge.train.settings"}}
    assert uphill(graph) == [
        "clipforge.models.builders -> clipforge.train.settings",
        "clipforge.ps.run -> clipforge.registry.x",
    ]


def test_every_room_imports_only_the_rooms_below_it() -> None:
    found = uphill(import_graph())
    assert found == [], (
        "imports up the order of rooms (base < hpc < preprocess < rundir < models < inference < train < "
        "ps, registry < jobs):\n" + "\n".join(found)
    )
