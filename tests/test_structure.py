"""The shape of the package (ARCHITECTURE.md, "Layers"): each layer imports only the layers below
it, no module imports a private name of another, each public name has one home (no module
re-exports another's), the imports form no cycle (at import time, at run time, or counting the
type-only imports), and the public objects users meet are exported, by the same names.

There is no cap on a module's length: a module is cut where a concept ends."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

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
    bad = [
        f"{mod}:{node.lineno}: from {node.module} import {a.name}"
        for mod, tree in _modules().items()
        for node in _imports_from(tree)
        if node.module.startswith("hicache_jax")
        for a in node.names
        if a.name.startswith("_") and not a.name.startswith("__")
    ]
    assert bad == []


def _defined(tree: ast.Module) -> set[str]:
    """Names a module binds itself at top level (defs, classes, assignments), not imports."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, ast.If):  # e.g. a fallback definition under a version check
            names |= _defined(ast.Module(body=node.body + node.orelse, type_ignores=[]))
    return names


def _exported(tree: ast.Module) -> list[str]:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "__all__" for t in node.targets
        ):
            return [ast.literal_eval(e) for e in node.value.elts]
    return []


def test_each_public_name_has_one_home():
    """A module's ``__all__`` names only what it defines: no module re-exports another's half,
    so every public name has one import path (a package's ``__init__`` gathers its own)."""
    bad = {
        mod: sorted(set(_exported(tree)) - _defined(tree))
        for mod, tree in _modules().items()
        if not (PKG.parent / mod.replace(".", "/") / "__init__.py").exists()
    }
    assert {m: names for m, names in bad.items() if names} == {}


def test_the_re_export_rule_finds_an_imported_name():
    tree = ast.parse("from a import B\nC = 1\ndef d(): pass\n__all__ = ['B', 'C', 'd']\n")
    assert set(_exported(tree)) - _defined(tree) == {"B"}


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:`` (never executed)."""
    lines = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            lines.update(n.lineno for b in node.body for n in ast.walk(b) if hasattr(n, "lineno"))
    return lines


def _edges(mod: str, tree: ast.Module, run_time: bool = False, type_only: bool = False) -> set[str]:
    """Imports executed when the module is imported (not under TYPE_CHECKING, not in a
    function); with ``run_time``, also those inside functions (a lazy import of an optional
    extra still runs when its function does); with ``type_only`` also those under
    TYPE_CHECKING (a type-only back edge still ties the two modules into one)."""
    edges, skip = set(), set() if type_only else _type_checking_only(tree)
    for node in ast.walk(tree) if run_time else tree.body:
        if getattr(node, "lineno", None) in skip:
            continue
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.level == 0
            and node.module.startswith("hicache_jax")
            and node.module != mod
        ):
            edges.add(node.module)
        elif isinstance(node, ast.Import):
            edges.update(
                a.name for a in node.names if a.name.startswith("hicache_jax") and a.name != mod
            )
    return edges


@pytest.mark.parametrize(
    "run_time, type_only",
    [(False, False), (True, False), (True, True)],
    ids=["import time", "run time", "type-only imports too"],
)
def test_module_imports_form_no_cycle(run_time, type_only):
    mods = _modules()
    graph = {
        m: {d for d in _edges(m, t, run_time, type_only) if d in mods} for m, t in mods.items()
    }
    # a package's __init__ re-exports its submodules: the edges into it are not a cycle
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> bool:
        state[m] = 1
        for d in graph[m]:
            if m.startswith(d + "."):  # a submodule importing its own package
                continue
            if state.get(d) == 1:
                cycle.extend(path[path.index(d) :] + [m, d] if d in path else [m, d])
                return True
            if state.get(d) is None and visit(d, path + [m]):
                return True
        state[m] = 2
        return False

    for m in graph:
        if state.get(m) is None and visit(m, []):
            break
    assert cycle == []


def test_each_module_says_what_it_owns():
    """Every module of the package and of the kernels opens with a docstring (what it owns,
    ARCHITECTURE.md "Layers"): a module without one was cut where no concept ends."""
    kernels = PKG.parent / "pallas_kernels"
    missing = [
        str(path.relative_to(PKG.parent))
        for path in sorted([*PKG.rglob("*.py"), *kernels.rglob("*.py")])
        if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()
    ]
    assert missing == []


def test_the_public_objects_are_exported():
    from hicache_jax.l3.prefetch import PrefetchHandle
    from hicache_jax.l3.storage import StorageError, StorageUnavailableError

    assert hicache_jax.PrefetchHandle is PrefetchHandle
    assert issubclass(hicache_jax.StorageUnavailableError, hicache_jax.StorageError)
    assert hicache_jax.StorageUnavailableError is StorageUnavailableError
    assert hicache_jax.StorageError is StorageError
    assert all(hasattr(hicache_jax, name) for name in hicache_jax.__all__)


def test_the_front_door_names_are_unchanged():
    """What ``from hicache_jax import ...`` offers is the contract code outside the project is
    written against: moving a module inside the package changes none of it."""
    assert sorted(hicache_jax.__all__) == [
        "AllBlocksCleared",
        "BlockRemoved",
        "BlockStored",
        "GroupKind",
        "HiCache",
        "HiCacheConfig",
        "HiCacheError",
        "KVEvent",
        "KVSpec",
        "LayerGroup",
        "Match",
        "Medium",
        "NodeRef",
        "OutOfPagesError",
        "PoolSizes",
        "PrefetchHandle",
        "Request",
        "StateArray",
        "StorageError",
        "StorageUnavailableError",
        "size_pools",
    ]


# The layers, bottom first (ARCHITECTURE.md): a module imports its own layer and those below.
# The shared vocabulary (spec, errors, validation) is one layer; tree and memory are siblings;
# study (the notebook API over the replay) and sizing (pools of a byte budget by the replay's
# rules) sit below the engine; the lowering checks lower the
# engine's programs; the command line (cli) is on top and calls them all.
LAYER_RANK = {
    "vocabulary": 0,
    "tree": 1,
    "memory": 1,
    "events": 2,
    "l3": 3,
    "cache": 4,
    "replay": 5,
    "metrics": 5,
    "study": 6,
    "sizing": 6,
    "engine": 7,
    "lowering": 8,
    "cli": 9,
}
VOCABULARY = {"spec", "errors", "validation"}


def _layer(mod: str) -> str:
    part = mod.split(".")[1] if "." in mod else "__init__"
    return "vocabulary" if part in VOCABULARY else part


def test_each_layer_imports_only_the_layers_below_it():
    bad = []
    for mod, tree in _modules().items():
        a = _layer(mod)
        if a in ("__init__", "__main__"):  # the package's front door re-exports every layer
            continue
        assert a in LAYER_RANK, f"{mod} is in no layer: add it to ARCHITECTURE.md and here"
        for dep in _edges(mod, tree, run_time=True):
            b = _layer(dep)
            if b != a and not LAYER_RANK.get(b, 99) < LAYER_RANK[a]:
                bad.append(f"{mod} ({a}) imports {dep} ({b})")
    assert bad == []


def test_the_kernels_import_nothing_of_the_cache():
    kernels = pathlib.Path(hicache_jax.__file__).parent.parent / "pallas_kernels"
    bad = [
        f"{p.name}: {dep}"
        for p in kernels.glob("*.py")
        for dep in _edges("pallas_kernels", ast.parse(p.read_text()), run_time=True)
    ]
    assert bad == []


def test_the_layer_rule_finds_an_upward_import():
    tree = ast.parse("from hicache_jax.cache.hicache import HiCache\n")
    assert _layer("hicache_jax.tree.radix") == "tree"
    deps = _edges("hicache_jax.tree.radix", tree, run_time=True)
    assert deps == {"hicache_jax.cache.hicache"}
    assert not LAYER_RANK[_layer(next(iter(deps)))] < LAYER_RANK["tree"]


# The test suite's own shape: no test module imports another (shared code lives in helpers.py,
# storage_helpers.py, l3_helpers.py, storage_servers.py or conftest.py), statically, inside a
# function, by importlib, or in the code a test hands to a subprocess.
TESTS = pathlib.Path(__file__).parent
_CODE_IMPORT = re.compile(
    r"(?:^|[\s;(])"
    r"(?:from\s+(test_\w+)(?:\.\w+)*\s+import|import\s+(test_\w+))"
)


def _test_module_imports(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``test_*`` module in ``tree``: import statements
    anywhere, ``importlib.import_module`` / ``__import__`` of a constant, and import lines in
    string constants (code run by ``python -c``; f-strings included)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
        ):
            names = [str(node.args[0].value)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [a or b for a, b in _CODE_IMPORT.findall(node.value)]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0].startswith("test_")]
    return found


def test_no_test_module_imports_another():
    bad = [
        f"{p.name}:{line}: imports {mod}"
        for p in sorted(TESTS.glob("*.py"))
        for line, mod in _test_module_imports(ast.parse(p.read_text(), str(p)))
    ]
    assert bad == []


def test_the_test_import_rule_finds_every_form():
    other = "test_" + "radix"  # built, so that this file holds no such import itself
    code = (
        f"import {other}\nfrom {other} import x\ndef f():\n    import {other}.sub\n"
        f"importlib.import_module('{other}')\n"
        f"subprocess.run(['python', '-c', 'import sys; from {other} import *'])\n"
        "from helpers import serve\nimport storage_helpers\n"
    )
    found = _test_module_imports(ast.parse(code))
    assert [line for line, _ in found] == [1, 2, 4, 5, 6]
    assert {mod.split(".")[0] for _, mod in found} == {other}


def test_only_the_metrics_package_imports_prometheus_client():
    """prometheus_client is an optional extra: the library never imports it, at import time
    or inside a function, but in hicache_jax.metrics (and the command line's flag that serves
    it, ``bench --metrics-port``)."""
    bad = []
    for mod, tree in _modules().items():
        if _layer(mod) == "metrics" or mod == "hicache_jax.cli.bench_metrics":
            continue
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            bad += [f"{mod}:{node.lineno}" for n in names if n.split(".")[0] == "prometheus_client"]
    assert bad == []
