"""The package structure: no import cycles between the parts of hpcrl, read from the source.

A part is a subpackage (``hpcrl/rollout/``), a top-level module (``hpcrl/prepare.py``), or the
configuration layer (``hpcrl/config.py``, every ``*/config.py``: the typed dataclasses the root config
composes, and every ``*/registry.py``: the choices they validate against). The entry points of the component processes (``*/main.py``, ``*/__main__.py``,
``hpcrl/colocated.py``) are the composition roots: they wire the parts together (the rollout job builds
the episode runner that ``rollout.episodes`` names) and may import any part, and no part imports them.
Every import counts, those inside functions and under ``TYPE_CHECKING`` too: a dependency is a dependency
wherever it is written. A registry's ``"module:attr"`` strings are not imports: they name implementations
that a component imports when it builds one (:mod:`hpcrl.plugins`), the way a config names a plugin.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hpcrl"


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


ENTRY = ("main", "__main__")


def is_entry(module: str) -> bool:
    return module.split(".")[-1] in ENTRY or module == "hpcrl.colocated"


def part_of(module: str) -> str | None:
    """The part a module ``hpcrl.x[.y...]`` belongs to (None: the package root, or an entry point)."""
    parts = module.split(".")
    if parts[0] != "hpcrl" or len(parts) < 2 or is_entry(module):
        return None
    if parts[-1] in ("config", "registry"):
        return "config"
    return parts[1]


def imports_of(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)  # `from hpcrl.x import y` may name a module
    return {m for m in out if m.startswith("hpcrl.")}


def part_graph() -> dict[str, dict[str, list[str]]]:
    """part -> {part it imports: [the files that import it]}."""
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    graph: dict[str, dict[str, list[str]]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        src = part_of(module_name(path))
        if src is None:
            continue
        for imported in imports_of(path):
            if imported not in modules:  # `from hpcrl.x import name`: the module is hpcrl.x
                continue
            dst = part_of(imported)
            if dst is not None and dst != src:
                graph.setdefault(src, {}).setdefault(dst, []).append(str(path.relative_to(ROOT)))
    return graph


def cycles(graph: dict[str, dict[str, list[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_parts_of_hpcrl_import_each_other_without_a_cycle() -> None:
    graph = part_graph()
    assert {"rollout", "trainer", "weights", "agent", "eval", "prepare", "config"} <= set(graph)  # it reads them
    found = cycles(graph)
    detail = [f"{a} -> {b}: {', '.join(sorted(set(files)))}" for c in found for a in c
              for b, files in sorted(graph.get(a, {}).items()) if b in c]
    assert not found, "import cycles between parts of hpcrl:\n" + "\n".join(detail)


def test_no_part_imports_an_entry_point() -> None:
    offenders = [f"{path.relative_to(ROOT)} imports {m}" for path in sorted(PACKAGE.rglob("*.py"))
                 if not is_entry(module_name(path)) for m in imports_of(path) if is_entry(m)]
    assert not offenders, offenders


def test_the_configuration_layer_imports_only_leaves() -> None:
    """Loading a config stays cheap and cannot pull a component in: besides other configs, it imports only
    parts that import nothing of hpcrl (``hpcrl/fs/atomic.py``)."""
    graph = part_graph()
    assert all(not graph.get(part) for part in graph.get("config", {})), graph.get("config")


def test_a_cycle_is_found() -> None:
    """The check itself: a made-up graph with a loop through three parts."""
    graph = {"a": {"b": ["x"]}, "b": {"c": ["y"]}, "c": {"a": ["z"], "d": ["w"]}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_no_module_is_over_450_lines() -> None:
    """A module that grows past this is split along its seams (the proxy's routes, submit's steps were)."""
    long = {str(p.relative_to(ROOT)): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 450}
    assert not long, long
