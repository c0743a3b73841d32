"""The shape of the package that DESIGN.md draws (issue 16): no module imports a private name of
another, every module stays under 500 lines, the module-level imports form no cycle, and the
public objects users meet are exported."""

from __future__ import annotations

import ast
import pathlib

import hicache_jax

PKG = pathlib.Path(hicache_jax.__file__).parent


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        name = ".".join(("hicache_jax",) + path.relative_to(PKG).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = ast.parse(path.read_text(), str(path))
    return out


def _imports_from(tree: ast.Module):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node


def test_no_module_imports_a_private_name_of_another():
    bad = [f"{mod}:{node.lineno}: from {node.module} import {a.name}"
           for mod, tree in _modules().items() for node in _imports_from(tree)
           if node.module.startswith("hicache_jax") for a in node.names
           if a.name.startswith("_") and not a.name.startswith("__")]
    assert bad == []


def test_every_module_is_under_500_lines():
    sizes = {p.relative_to(PKG).as_posix(): len(p.read_text().splitlines())
             for p in PKG.rglob("*.py")}
    assert {p: n for p, n in sizes.items() if n >= 500} == {}


def _top_level_edges(mod: str, tree: ast.Module) -> set[str]:
    """Imports executed when the module is imported (not under TYPE_CHECKING, not in a
    function: a lazy import of an optional extra is not an edge of the graph)."""
    edges = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.startswith("hicache_jax") and node.module != mod:
            edges.add(node.module)
        elif isinstance(node, ast.Import):
            edges.update(a.name for a in node.names
                         if a.name.startswith("hicache_jax") and a.name != mod)
    return edges


def test_module_imports_form_no_cycle():
    mods = _modules()
    graph = {m: {d for d in _top_level_edges(m, t) if d in mods} for m, t in mods.items()}
    # a package's __init__ re-exports its submodules: the edges into it are not a cycle
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for d in graph[m]:
            if m.startswith(d + "."):  # a submodule importing its own package
                continue
            if state.get(d) == 1:
                cycle.extend(path[path.index(d):] + [m, d] if d in path else [m, d])
                return True
            if state.get(d) is None and visit(d, path + [m]):
                return True
        state[m] = 2
        return False

    for m in graph:
        if state.get(m) is None and visit(m, []):
            break
    assert cycle == []


def test_the_public_objects_are_exported():
    from hicache_jax.l3.prefetch import PrefetchHandle
    from hicache_jax.l3.storage import StorageError, StorageUnavailableError

    assert hicache_jax.PrefetchHandle is PrefetchHandle
    assert issubclass(hicache_jax.StorageUnavailableError, hicache_jax.StorageError)
    assert hicache_jax.StorageUnavailableError is StorageUnavailableError
    assert hicache_jax.StorageError is StorageError
    assert all(hasattr(hicache_jax, name) for name in hicache_jax.__all__)
