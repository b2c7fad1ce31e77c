"""The package's structure: no import cycles, no private names across modules.

A small import-graph walk over ``src/pergrad`` (module-level and function-level imports alike:
a lazy import that closes a cycle is still two modules that depend on each other).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pergrad

PACKAGE_ROOT = Path(pergrad.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}


def imports_of(path: Path, known: dict[str, Path]) -> set[str]:
    """The pergrad modules ``path`` imports: ``from a.b import c`` counts as ``a.b.c`` where
    that is a module, else as ``a.b``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in known else node.module)
    return {name for name in found if name in known}


def private_names_imported(path: Path) -> list[str]:
    """``from pergrad... import _name``: a leading underscore is private to its module."""
    return [
        f"{node.module}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pergrad")
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child) :] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycles_between_pergrad_modules():
    known = modules()
    graph = {name: imports_of(path, known) - {name} for name, path in known.items()}
    # A package's __init__ importing its own submodules is how packages re-export; a submodule
    # importing its package's __init__ back would be the cycle.
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_module_imports_another_modules_private_names():
    offenders = {
        module_name(path): names
        for path in PACKAGE_ROOT.rglob("*.py")
        if (names := private_names_imported(path))
    }
    assert not offenders, offenders


# The packages (and top-level modules) of ``_src`` in layers, lowest first: each may import
# only from its own layer and the layers below it. The analysed call at the bottom, then the
# capture engines and the strategies over them, the public entry points, DP and attribution
# above them, and the framework integrations (optax, torch.distributed, DPOptimizer) on top.
LAYERS = (
    ("errors",),
    ("backends",),
    ("core", "norms"),
    ("capture",),
    ("strategies",),
    ("api",),
    ("dp", "outliers", "monitor"),
    ("influence",),
    ("jax", "torch"),
)


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 3 or parts[1] != "_src":
        return None  # the public modules, above everything
    package = parts[2]
    return next(i for i, names in enumerate(LAYERS) if package in names)


def test_every_package_of_src_has_a_layer():
    packages = {name.split(".")[2] for name in modules() if name.startswith("pergrad._src.")}
    placed = {name for names in LAYERS for name in names}
    assert packages <= placed, sorted(packages - placed)


def test_packages_import_downwards_only():
    known = modules()
    upward = []
    for name, path in known.items():
        own = layer_of(name)
        if own is None:
            continue
        for target in imports_of(path, known):
            other = layer_of(target)
            if other is not None and other > own:
                upward.append(f"{name} -> {target}")
    assert not upward, "\n".join(sorted(upward))


def test_the_layering_check_finds_an_upward_import():
    assert layer_of("pergrad._src.dp.noise") > layer_of("pergrad._src.backends.secure")
    assert layer_of("pergrad._src.torch.dp_optimizer") > layer_of("pergrad._src.api.reductions")
    assert layer_of("pergrad.dp") is None
