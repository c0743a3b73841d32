"""Every script in benchmarks/ runs as ``python -m benchmarks.NAME`` from the repository root.

Each CPU benchmark runs once at its quick size in a subprocess (``PYTHONPATH`` = the root, cwd =
the root, as a user runs it), must exit 0, print its figure beside its limit (the ratio column or
target line named here) and write its JSON with the environment record. The GPU scripts
(``gpu_*.py``) only load and parse their flags here (``--help``). bench_control_plane,
bench_policies and bench_memory run at small sizes in test_bench_control_plane.py and
test_bench_policies.py; here only their ``-m`` entry point (``--help``), so no benchmark runs
twice in the suite.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

from hicache_jax.cli import results

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: name, arguments (the quick size), what the output must show (its ratio / limit), modules it needs
RUNS = [
    (
        "bench_events",
        ["--quick"],
        ["slowdown vs off", "target zmq with a live subscriber within 1.5x of events off:"],
        ["zmq", "msgspec"],
    ),
    (
        "bench_guard",
        ["--quick"],
        ["guard/match", "guard/IQR", "target guard < match_prefix noise:"],
        [],
    ),
    ("bench_hicache", ["--quick"], ["vs inf", "memcpy GB/s", "target hit/inf >= 0.95:"], []),
    (
        "bench_metrics",
        ["--quick"],
        ["on/off", "scrapes/run", "target on/off >= 0.95 (the exporter within 5% of off):"],
        ["prometheus_client"],
    ),
    ("bench_load_policy", ["--quick"], ["cost/better", "target cost/better <= 1.05"], []),
    ("bench_windows", ["--quick"], ["L1/formula", "target every tier within 5%"], []),
    ("bench_state_l3", ["--limit", "10"], ["node ends only", "L3 / all full"], []),
    (
        "bench_windows_control",
        ["--quick", "--limit", "60"],
        ["vs one group", "target two groups within 1.3x of one group", "window_spare=False"],
        [],
    ),
    (
        "bench_multihost",
        ["--requests", "40", "--processes", "1,2"],
        ["x 1 process", "agreement share", "(target <= 1.3x)"],
        [],
    ),
    (
        "bench_multihost",
        ["--requests", "20", "--processes", "1,2", "--in-flight"],
        ["agreements/req", "(target <= 1.3x)"],
        [],
    ),
    (
        "bench_multihost",
        ["--requests", "20", "--processes", "1,2", "--in-flight", "--completion-lag", "1"],
        ["completion lag 1:", "(target <= 1.3x)"],
        [],
    ),
    (
        "bench_pins",
        [],
        ["x limit", "target pinned system-prompt hit rate >= 0.95 of the limit:"],
        [],
    ),
    ("bench_pool", ["--quick"], ["x memcpy", "Targets: flat in pool size"], []),
    (
        "bench_simulate",
        ["--limit", "100"],
        ["cost/better mean", "cost/better p90", "split/better mean", "10% below both"],
        [],
    ),
    (
        "bench_step",
        ["--quick"],
        ["unrolled/scan", "memcpy weights ms", "target: the default path (unrolled at <="],
        [],
    ),
    (
        "bench_storage",
        ["--quick", "--backends", "file"],
        ["ratio", "target ratio >= 0.8", "vs infinite", "target with L3 >= 0.95 of infinite:"],
        [],
    ),
    (
        "bench_transfer",
        ["--quick"],
        ["memcpy GB/s", "ratio", "target >= 0.70 of memcpy for >= 128 pages:"],
        [],
    ),
    ("bench_tree", ["--quick"], ["hit/inf", "x the target"], []),
    (
        "bench_windows_replay",
        ["--limit", "100", "--capacities", "1e5", "--host-ratios", "2"],
        ["hit/LRU(r) >= 0.97", "LRU(= bytes)", "gain"],
        [],
    ),
    (
        "bench_state_replay",
        ["--limit", "100", "--capacities", "1e5", "--intervals", "default,16"],
        ["hit/oracle >= 0.95", "state bytes held", "default policy, L1"],
        [],
    ),
    ("bench_ttft", ["--quick"], ["/ recompute", "L2/recompute:", "(target <= 0.1)"], []),
    (
        "bench_state_bound",
        ["--limit", "200", "--capacities", "3e5", "--slots", "2,5", "--every", "4,0"],
        ["slots: any", "slots: every 4", "bound at the best fixed split"],
        [],
    ),
    (
        "bench_windows_bound",
        ["--limit", "200", "--capacities", "3e5", "--host-ratios", "4"],
        ["hit / LRU(r x B)", "fixed default, value:", "one budget, spare first, lru:"],
        [],
    ),
]

#: scripts that write their figures beside their limits themselves (the others: every number)
OWN_FIGURES = ("bench_events", "bench_guard", "bench_hicache", "bench_pins", "bench_transfer")

#: run elsewhere in the suite (see the module docstring), or GPU-only: entry point and flags only
HELP_ONLY = [
    ("bench_control_plane", []),
    ("bench_engine_processes", []),  # its 2-process comparison in test_bench_processes.py
    ("bench_instructions", []),  # minutes under valgrind: run by hand (RESULTS.md)
    ("bench_memory", []),
    ("bench_policies", []),
    ("collect", []),  # its CPU use (the recorded runs in tests/data) in test_results.py
    ("gpu_kernels", []),
    ("gpu_serve", ["--allow-cpu"]),  # its --tiny run on CPU is in test_cli.py
    ("gpu_transfer", []),
    ("gpu_ttft", ["--allow-cpu"]),  # without it, it refuses a non-GPU backend before parsing
    ("tpu_kernels", []),
]


def run_module(
    name: str, *args: str, timeout: float = 300, **env_vars: str
) -> subprocess.CompletedProcess:
    """``python -m benchmarks.NAME ARGS`` from the root, without the suite's 4 virtual devices."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **env_vars)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    return subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_every_script_is_covered():
    """A new script in benchmarks/ goes into RUNS (a CPU run at its quick size) or HELP_ONLY."""
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py")} - {
        "__init__",
        "common",
        "replay_driver",
    }
    listed = {r[0] for r in RUNS} | {h[0] for h in HELP_ONLY}
    assert scripts == listed, f"not listed: {scripts - listed}; gone: {listed - scripts}"


@pytest.fixture
def ram_tmpdir():
    """A fresh directory in /dev/shm (None where there is none), removed afterwards."""
    if not os.path.isdir("/dev/shm"):
        yield None
        return
    path = tempfile.mkdtemp(prefix="bench-smoke-", dir="/dev/shm")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("name, args, shows, needs", RUNS, ids=[r[0] for r in RUNS])
def test_benchmark_runs_at_its_quick_size(tmp_path, ram_tmpdir, name, args, shows, needs):
    for module in needs:
        pytest.importorskip(module)
    out = tmp_path / f"{name}.json"
    env_vars = {}
    if name == "bench_storage" and ram_tmpdir is not None:
        # Its file stores in a RAM-backed TMPDIR: the figures are not judged here, and on a disk
        # shared with other processes the run took 6x longer.
        env_vars["TMPDIR"] = ram_tmpdir
    proc = run_module(name, *args, "--json", str(out), **env_vars)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    missing = [s for s in shows if s not in proc.stdout]
    assert not missing, f"{name} did not print {missing}:\n{proc.stdout}"
    data = json.loads(out.read_text())
    assert data["benchmark"] == name and data["env"]["jax"] and data["results"]
    figures = results.figures_of(data)  # what hicache-jax compare reads of it
    assert figures and all(f["source"] == name for f in figures)
    if name in OWN_FIGURES:  # each beside its limit, as the script prints it
        assert all(f["limit"] is not None and f["ratio"] is not None for f in figures), figures


@pytest.mark.parametrize("name, args", HELP_ONLY, ids=[h[0] for h in HELP_ONLY])
def test_benchmark_entry_point_parses_its_flags(name, args):
    proc = run_module(name, *args, "--help", timeout=120)
    assert proc.returncode == 0, f"{name} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.startswith("usage:") and "--json" in proc.stdout, proc.stdout


def test_storage_servers_import_from_the_root():
    """bench_storage's Mooncake part imports tests/storage_servers.py as ``tests.storage_servers``
    (the quick run above uses the file backend only); the import itself needs no Mooncake."""
    code = "from tests.storage_servers import MooncakeServers"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


def test_bench_state_l3_reads_each_rows_put_rule():
    """bench_state_l3's rows name their ``storage_window_spare``: "every k pages" is ``k``,
    "checkpoint ends" the default (None), and no other row's name (the recurrent "every
    checkpoint") is read as a spacing."""
    from benchmarks.bench_state_l3 import _spare

    assert _spare("every 8 pages") == 8
    assert _spare("storage_window_spare") is True
    assert _spare("checkpoint ends") is None
    for mode in ("every checkpoint", "node ends only", "all full"):
        assert _spare(mode) is False
