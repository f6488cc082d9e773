"""Imports run one way (CONTRIBUTING.md, "Layering"): `soma_cluster` <- `workers` <- `pipelines`, with no circle
inside any of them and no Ray in `soma_cluster`.

The graph is read from the source with `ast`, not from `sys.modules`: every import counts, at module level,
inside a function, or under `if TYPE_CHECKING:`, because each is a dependency that a circle can close (an
import hidden in a function only moves the circle from import time to call time).
`python tests/test_layering.py` prints the measurements: modules, circles and floors (the longest import chain)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("soma_cluster", "workers", "pipelines")  # lowest first: a package imports only those before it
# a floor above the rest of its package: it imports the package's flat modules, none of them imports it back, and
# no code outside it reaches a private (_underscored) name of it
SUBPACKAGES = ("soma_cluster.inference",)


def module_files() -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the three packages."""
    out = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported_names(path: Path, module: str) -> set[str]:
    """Every dotted name the file imports, anywhere in it; `from a import b` gives `a.b` (b may be a module or a
    name in module a: the graph takes the longest prefix that is a module)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            names |= {f"{base}.{alias.name}" if alias.name != "*" else base for alias in node.names}
    return names


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(arrows between the packages' modules, every top-level name each module imports)."""
    files = module_files()
    arrows: dict[str, set[str]] = {}
    roots: dict[str, set[str]] = {}
    for module, path in files.items():
        names = imported_names(path, module)
        roots[module] = {name.split(".")[0] for name in names}
        targets = set()
        for name in names:
            parts = name.split(".")  # the longest prefix that is one of our modules
            hit = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in files), None)
            if hit is not None and hit != module:
                targets.add(hit)
        arrows[module] = targets
    return arrows, roots


def strongly_connected(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's components (iterative), each sorted; only those with a circle (two or more modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(arrows):
        if start in index:
            continue
        work = [(start, iter(sorted(arrows[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
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


def shortest_cycle(arrows: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest circle through the component's first module, as a path that ends where it starts."""
    start, inside = component[0], set(component)
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(arrows[node] & inside):
                if child == start:
                    path = [node]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{component} is no component")


def within(arrows: dict[str, set[str]], package: str) -> dict[str, set[str]]:
    inside = {m for m in arrows if m.split(".")[0] == package}
    return {m: arrows[m] & inside for m in inside}


def floors(arrows: dict[str, set[str]]) -> tuple[int, list[str]]:
    """The longest import chain (in modules) of an acyclic graph, and one such chain."""
    best: dict[str, list[str]] = {}

    def chain(module: str) -> list[str]:
        if module not in best:
            below = [chain(child) for child in sorted(arrows[module])]
            best[module] = [module, *max(below, key=len, default=[])]
        return best[module]

    longest = max((chain(m) for m in sorted(arrows)), key=len)
    return len(longest), longest


def circles_message(arrows: dict[str, set[str]], package: str) -> str:
    components = strongly_connected(within(arrows, package))
    lines = [
        f"  {' -> '.join(shortest_cycle(arrows, c))}   (all of {', '.join(c)} reach each other)" for c in components
    ]
    return "\n".join(lines)


def test_no_import_circle_in_any_package():
    arrows, _ = graph()
    found = {package: circles_message(arrows, package) for package in LAYERS}
    found = {package: text for package, text in found.items() if text}
    assert not found, (
        "import circles (move the code to the module it belongs with; an import inside a function or under "
        "TYPE_CHECKING closes a circle too):\n" + "\n".join(f"{package}:\n{text}" for package, text in found.items())
    )


def test_imports_never_run_up_a_layer():
    arrows, _ = graph()
    rank = {package: n for n, package in enumerate(LAYERS)}
    up = sorted(
        f"{module} -> {target}"
        for module, targets in arrows.items()
        for target in targets
        if rank[target.split(".")[0]] > rank[module.split(".")[0]]
    )
    assert not up, "imports that run up (soma_cluster <- workers <- pipelines):\n  " + "\n  ".join(up)


def test_soma_cluster_never_imports_ray():
    _, roots = graph()
    ray = sorted(module for module, names in roots.items() if module.split(".")[0] == "soma_cluster" and "ray" in names)
    assert not ray, f"soma_cluster is the library without Ray; these import it: {ray}"


def inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_a_subpackage_is_a_floor_of_its_own():
    """The rest of its package imports it nowhere; it imports nothing of a layer above (the test above)."""
    arrows, _ = graph()
    for sub in SUBPACKAGES:
        top = sub.split(".")[0]
        into = sorted(
            f"{m} -> {t}"
            for m, targets in arrows.items()
            if m.split(".")[0] == top and not inside(m, sub)
            for t in targets
            if inside(t, sub)
        )
        assert not into, f"{sub} is a floor above the rest of {top}; these import it:\n  " + "\n  ".join(into)
        assert any(inside(m, sub) for m in arrows), f"{sub} has no modules"


def private_names(package: str) -> set[str]:
    """The _underscored names a subpackage defines: its modules' functions, classes and globals, their methods and
    attributes (self._x = ...). Dunder names are Python's, not its."""
    names = set()
    for module, path in module_files().items():
        if not inside(module, package):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def reaches(path: Path, package: str, privates: set[str]) -> list[str]:
    """Where a file outside `package` reaches a private name of it: imports it (`from package.m import _x`), or
    reads it off an object (`lm._weights(...)`; `self._x` and `cls._x` are the file's own)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and inside(node.module, package):
            found += [f"{path.name}:{node.lineno} imports {a.name}" for a in node.names if a.name.startswith("_")]
        elif isinstance(node, ast.Attribute) and node.attr in privates:
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if not own:
                found.append(f"{path.name}:{node.lineno} reads .{node.attr}")
    return found


def outside_files(package: str) -> list[Path]:
    """Every module of the three packages outside `package`, and the benchmarks (users of the API, as any)."""
    mine = [p for m, p in module_files().items() if not inside(m, package)]
    return mine + sorted((ROOT / "benchmarks").glob("*.py"))


def test_nothing_outside_a_subpackage_reaches_its_private_names():
    for sub in SUBPACKAGES:
        privates = private_names(sub)
        found = [hit for path in outside_files(sub) for hit in reaches(path, sub, privates)]
        assert not found, f"private names of {sub} used outside it (make them public, or keep them inside):\n  " + (
            "\n  ".join(found)
        )


def test_a_reach_into_private_names_is_seen(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(
        "from soma_cluster.inference.lm import _Pending\ndef f(lm, u):\n    return lm._weights(u), self._weights(u)\n"
    )
    privates = private_names("soma_cluster.inference")
    assert {"_weights", "_Pending", "_slots"} <= privates
    found = reaches(path, "soma_cluster.inference", privates)
    assert found == ["user.py:1 imports _Pending", "user.py:3 reads ._weights"]


def test_the_graph_sees_every_kind_of_import():
    """The reader on the real packages: module-level and in-function imports, and a package's __init__'s."""
    arrows, roots = graph()
    assert len([m for m in arrows if m.startswith("soma_cluster.")]) > 30
    assert "soma_cluster.storage" in arrows["soma_cluster.checkpoint"]  # module level
    assert "workers.expert_worker" in arrows["workers"]  # a package's __init__
    assert "pipelines.campaign" in arrows["pipelines.cli"]  # inside a function
    assert "ray" in roots["workers.expert_worker"]


def test_relative_and_hidden_imports_are_read(tmp_path):
    """An import under TYPE_CHECKING, inside a function, and a relative one are all dependencies."""
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from soma_cluster.schedule import Scheduler\n"
        "def f():\n    from . import jobs\n    from .storage import Store\n    import ray.util\n"
    )
    names = imported_names(path, "soma_cluster.mod")
    assert {"soma_cluster.schedule.Scheduler", "soma_cluster.jobs", "soma_cluster.storage.Store", "ray.util"} <= names


if __name__ == "__main__":
    arrows, _ = graph()
    for package in LAYERS:
        inner = within(arrows, package)
        components = strongly_connected(inner)
        print(f"{package}: {len(inner)} modules, {len(components)} knots (sets of modules that import each other)")
        print(circles_message(arrows, package) or "  none")
        if not components:
            n, chain = floors(inner)
            print(f"  floors: {n} ({' -> '.join(chain)})")
