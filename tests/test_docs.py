"""The documentation site: the code of the getting-started and guide pages runs as written, and
the site builds with warnings as errors.

Each page's ```python blocks run in order in one namespace (a page's later blocks continue its
earlier ones), in a fresh temporary directory. A block right after a `<!-- not run -->` line is
skipped (it needs what a CPU test box lacks: several hosts, a device, a network service); a
page says in its text why. A block that imports a module of an extra that is not installed
skips the rest of its page, naming the extra. ```text and ```bash blocks are never run.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [DOCS / "getting-started.md", *sorted((DOCS / "guides").glob("*.md"))]
NOT_RUN = "<!-- not run -->"
# modules of pyproject's extras a page may import: without them its remaining blocks skip
EXTRAS = {
    "zmq": "events",
    "msgspec": "events",
    "pandas": "notebook",
    "matplotlib": "plot",
    "prometheus_client": "metrics",
}
BLOCK = re.compile(
    rf"^(?P<marker>{re.escape(NOT_RUN)}\n)?```python\n(?P<code>.*?)^```$", re.DOTALL | re.MULTILINE
)


def python_blocks(text: str) -> list[tuple[str, bool]]:
    """Each ```python block of a page as (code, runs), in order."""
    return [(m["code"], not m["marker"]) for m in BLOCK.finditer(text)]


def test_block_extraction():
    text = "a\n```python\nx = 1\n```\n<!-- not run -->\n```python\ny\n```\n```text\nz\n```\n"
    assert python_blocks(text) == [("x = 1\n", True), ("y\n", False)]


def test_every_page_has_running_code():
    """Pages with code run most of it: a marker is for what a CPU box cannot run."""
    assert PAGES, "no pages found under docs/"
    runs = [r for p in PAGES for _, r in python_blocks(p.read_text())]
    assert sum(runs) >= 3 * (len(runs) - sum(runs)), "most python blocks must run"


def _close_caches(namespace: dict) -> None:
    from hicache_jax import HiCache

    for value in namespace.values():
        if isinstance(value, HiCache) and not value.closed:
            value.close()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path, monkeypatch, capsys):
    blocks = [code for code, runs in python_blocks(page.read_text()) if runs]
    if not blocks:
        pytest.skip(f"{page.name} has no python block that runs on a CPU box")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))  # pages import examples/ as readers do
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    try:
        for i, code in enumerate(blocks):
            try:
                code_obj = compile(code, f"{page} (python block {i + 1})", "exec")
                exec(code_obj, namespace)
            except ModuleNotFoundError as e:
                if e.name not in EXTRAS:
                    raise
                pytest.skip(
                    f"{page.name} block {i + 1} needs {e.name}: "
                    f'pip install -e ".[{EXTRAS[e.name]}]"'
                )
    finally:
        _close_caches(namespace)
        namespace.clear()
        gc.collect()


def test_site_builds_strict(tmp_path):
    if (
        importlib.util.find_spec("mkdocs") is None
        or importlib.util.find_spec("mkdocstrings_handlers.python") is None
    ):
        pytest.skip('mkdocs or mkdocstrings-python is not installed: pip install -e ".[docs]"')
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "site" / "reference" / "hicache" / "index.html").exists()


STATS_PAGE = DOCS / "reference" / "stats.md"
STATS_ROW = re.compile(r"^\| `(?P<key>[a-z0-9_]+\*?)` \|", re.MULTILINE)


def documented_stats_keys() -> set[str]:
    """The keys the stats reference's tables name (``l3_store_*``: a family)."""
    return {m["key"] for m in STATS_ROW.finditer(STATS_PAGE.read_text())}


def _stats_of_every_kind(tmp_path) -> set[str]:
    """The keys ``stats()`` returns over configurations that between them return every key:
    no L3; L3 with KV events announcing it, after a prefetch (the store's own counters)."""
    import numpy as np

    from hicache_jax import HiCache, HiCacheConfig, KVSpec

    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", page_size=4)
    plain = HiCache(spec, HiCacheConfig(device_pages=8, host_pages=16))
    keys = set(plain.stats())
    plain.close()
    url = f"file://{tmp_path}/store"
    events = {"publisher": "queue", "l3_medium": "auto"}
    a, b = (
        HiCache(spec, HiCacheConfig(device_pages=8, host_pages=16, storage=url, kv_events=events))
        for _ in range(2)
    )
    toks = np.arange(8)
    for _ in range(2):  # the second access backs it up, then L3 stores it
        with a.begin(toks) as req:
            req.extend(len(toks) - req.cached_len)
            req.finish(toks)
    a.flush()
    b.prefetch(toks)
    b.flush()
    keys |= set(a.stats()) | set(b.stats())
    a.close(), b.close()
    windowed = KVSpec.from_pattern(  # window groups with L3: the l3_window_* keys
        "1:1", num_layers=2, num_kv_heads=1, head_dim=2, dtype="float32", page_size=4, window=4
    )
    c = HiCache(windowed, HiCacheConfig(device_pages=8, host_pages=16, storage=url))
    keys |= set(c.stats())
    c.close()
    assert any(k.startswith("l3_store_") for k in keys)
    return keys


def test_every_stats_key_is_documented_and_every_documented_key_exists(tmp_path):
    """docs/reference/stats.md is the one place stats() is documented: a key added to stats()
    without a row there fails here, and so does a row for a key stats() no longer returns."""
    documented = documented_stats_keys()
    families = {k[:-1] for k in documented if k.endswith("*")}
    exact = documented - {f + "*" for f in families}
    returned = _stats_of_every_kind(tmp_path)
    undocumented = {
        k for k in returned if k not in exact and not any(k.startswith(f) for f in families)
    }
    assert undocumented == set(), "stats() keys missing from docs/reference/stats.md"
    assert exact - returned == set(), "documented keys stats() does not return"
    assert all(any(k.startswith(f) for k in returned) for f in families)


def test_the_stats_key_check_finds_a_missing_row():
    assert "served_device_tokens" in documented_stats_keys()
    assert STATS_ROW.findall("| `new_key` | x |\n| not a row |\n") == ["new_key"]
