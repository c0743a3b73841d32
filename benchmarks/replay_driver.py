"""The one request flow of the benchmarks that replay a trace through HiCache, and their one
``--baseline REV``.

Request flow: :func:`serve` serves one prompt (``match_prefix``, ``prepare``, ``load_back``,
``lock``, ``alloc_pages``, ``insert``, ``flush``, ``unlock``, ``flush``); :func:`replay` serves
every prompt of a :class:`Prompts` through a fresh cache, in order, optionally timing each call
(:class:`PhaseClock`). It is the flow of :func:`hicache_jax.replay.driver.replay` (the same hit
figures for the same inputs): the flush between ``insert`` and ``unlock`` lets clean_ahead's pass
at the unlock see no load still in flight, the flush after it completes every transfer at the
request boundary, and the cache's clock is a counter, so a replay is deterministic.

Baseline: :func:`add_baseline_flags` gives a benchmark ``--baseline REV`` (alias ``--base``) and
``--no-baseline``; :class:`Trees` extracts ``hicache_jax/`` (and ``pallas_kernels/``) of REV
(``git archive``) into a temporary directory, and :func:`run_worker` runs the benchmark's worker
in a subprocess whose ``hicache_jax`` is that tree's and whose ``benchmarks`` package is this
one: the same benchmark code, side by side in the same run, against another revision's library.
The worker side (this module's :func:`replay`, :func:`load_prompts`, :func:`worker_main`)
therefore uses numpy and hicache_jax's public API only (``HiCache``, ``HiCacheConfig``,
``KVSpec``, ``cache.stats()``), which every revision measured so far has; a counter a revision
lacks reads None.

Prompts travel to workers as an ``.npz`` (:func:`save_prompts`): an older revision may have no
trace reader.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("match", "load_back", "lock", "alloc", "insert", "unlock", "flush")  # the primitives
HANDLE_PHASES = ("begin", "extend", "finish", "flush")  # the request handle (cache.begin)
FLOWS = ("handle", "primitives")
#: top-level packages a baseline revision contributes (pallas_kernels: where it has one)
LIBRARY_PACKAGES = ("hicache_jax", "pallas_kernels")


# ------------------------------------------------------------------------------------ prompts


@dataclasses.dataclass(frozen=True)
class Prompts:
    """The prompts of a trace, numpy only.

    Attributes:
        lengths: int64 ``[R]`` prompt lengths in tokens.
        offsets: int64 ``[R + 1]``: request i's ids are ``ids[offsets[i]:offsets[i + 1]]``.
        ids: int64 ``[N]``: Mooncake block ids (``block_size > 0``) or the token ids
            themselves (``block_size == 0``).
        block_size: tokens per Mooncake block; 0 for a token trace.
    """

    lengths: np.ndarray
    offsets: np.ndarray
    ids: np.ndarray
    block_size: int

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def tokens(self, i: int) -> np.ndarray:
        """Request ``i``'s prompt: int64 ``[lengths[i]]`` (made on demand for Mooncake ids)."""
        ids = self.ids[self.offsets[i] : self.offsets[i + 1]]
        if not self.block_size:
            return ids
        bs = self.block_size
        return (ids[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)[: self.lengths[i]]

    @classmethod
    def from_trace(cls, trace: Any) -> Prompts:
        """A :class:`hicache_jax.replay.trace.Trace`'s prompts (Mooncake or token trace)."""
        mooncake = trace.format == "mooncake"
        parts = [r.hash_ids if mooncake else r.token_ids for r in trace.requests]
        offsets = np.concatenate([[0], np.cumsum([p.size for p in parts])]).astype(np.int64)
        ids = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        lengths = np.array([r.num_tokens for r in trace.requests], np.int64)
        return cls(lengths, offsets, ids, trace.block_size if mooncake else 0)


def save_prompts(prompts: Prompts, path: str) -> None:
    """Write ``prompts`` as an ``.npz`` that :func:`load_prompts` reads back."""
    np.savez(
        path,
        lengths=prompts.lengths,
        offsets=prompts.offsets,
        ids=prompts.ids,
        block_size=prompts.block_size,
    )


def load_prompts(path: str) -> Prompts:
    with np.load(path) as d:
        return Prompts(d["lengths"], d["offsets"], d["ids"], int(d["block_size"]))


def tiny_spec(page_size: int) -> Any:
    """The replay's default page shape: one layer, one KV head, head_dim 1, float32 (8 bytes a
    token), so that a long trace fits in memory and what is timed is the bookkeeping."""
    from hicache_jax import KVSpec

    return KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", page_size=page_size)


# --------------------------------------------------------------------------------- the flow


class PhaseClock:
    """Seconds spent in each call of :func:`serve`, summed over requests (keys: the flow's
    phases, PHASES or HANDLE_PHASES; both flushes count as ``flush``)."""

    def __init__(self, flow: str = "primitives") -> None:
        self.flow = flow
        self.seconds = dict.fromkeys(HANDLE_PHASES if flow == "handle" else PHASES, 0.0)
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        t = time.perf_counter()
        self.seconds[phase] += t - self._t
        self._t = t


def _no_lap(phase: str) -> None:
    return None


def default_flow(cache: Any) -> str:
    """The request handle where the tree has it (``cache.begin``), else the primitives (older
    revisions, run as baselines)."""
    return "handle" if hasattr(cache, "begin") else "primitives"


def serve(
    cache: Any,
    tokens: np.ndarray,
    pages: int,
    clock: PhaseClock | None = None,
    flow: str | None = None,
) -> tuple[int, int, int]:
    """Serve one prompt of ``pages`` whole pages (int64 ``[pages * page_size]``, at most L1's
    pages) the way a server does: reuse its cached prefix, compute (allocate) the rest, cache it,
    through the request handle or the primitive calls it makes (``flow``, default
    :func:`default_flow`): the same calls in the same order, so the same figures.

    Returns:
        (device hit tokens, host hit tokens loaded back, host tokens whose load was declined).
    """
    flow = default_flow(cache) if flow is None else flow
    lap = _no_lap if clock is None else clock.lap
    if clock is not None:
        clock.start()
    if flow == "handle":
        with cache.begin(tokens) as req:
            lap("begin")
            req.extend(tokens.shape[0] - req.cached_len)
            lap("extend")
            cache.flush()  # the load-back's lock is gone before the unlock (clean_ahead's pass)
            lap("flush")
            req.finish(tokens)
            lap("finish")
        cache.flush()  # transfers complete at request boundaries: deterministic
        lap("flush")
        return req.cached_len - req.loaded_len, req.loaded_len, req.host_len_declined
    return _serve_primitives(cache, tokens, pages, lap)


def _serve_primitives(
    cache: Any, tokens: np.ndarray, pages: int, lap: Callable[[str], None]
) -> tuple[int, int, int]:
    m = cache.match_prefix(tokens)
    lap("match")
    on_device = m.device_len
    prepare = getattr(cache, "prepare", None)  # absent in a --baseline revision before it
    if prepare is not None:  # as begin() does: clean_ahead backs up what these pages evict
        prepare([m], pages - m.device_pages.shape[0])
    m = cache.load_back(m)
    lap("load_back")  # (prepare's time included)
    cache.lock(m.node)
    lap("lock")
    new = cache.alloc_pages(pages - m.device_pages.shape[0])
    lap("alloc")
    cache.insert(tokens, np.concatenate([m.device_pages, new]))
    lap("insert")
    cache.flush()  # the load-back's lock is gone before the unlock (clean_ahead's pass)
    lap("flush")
    cache.unlock(m.node)
    lap("unlock")
    cache.flush()  # transfers complete at request boundaries: deterministic
    lap("flush")
    return on_device, m.device_len - on_device, m.host_len


def new_cache(spec: Any, cfg: Any) -> Any:
    """A HiCache whose clock is a counter (eviction order follows the calls, not wall time)."""
    from hicache_jax import HiCache

    ticks = itertools.count()
    return HiCache(spec, cfg, clock=lambda: float(next(ticks)))


def replay(
    prompts: Prompts | Sequence[np.ndarray],
    spec: Any,
    cfg: Any,
    *,
    clock: PhaseClock | None = None,
    flow: str | None = None,
) -> dict[str, Any]:
    """Serve every prompt through a fresh cache, in order; a prompt longer than L1 caches its
    first ``cfg.device_pages`` pages, a partial last page is not cached.

    ``prompts``: a :class:`Prompts` (tokens made inside the timed loop) or a sequence of int64
    token arrays (made before it). Returns prompt and hit tokens (whole pages), wall seconds
    and the process's CPU seconds of the loop (``cpu_s``; the cache's construction and close
    are outside both),
    ``phase_s`` (``clock``'s seconds, or None) and the cache's ``stats()`` at the end.
    ``flow``: :func:`serve`'s.
    """
    cache = new_cache(spec, cfg)
    if flow is None and clock is not None:
        flow = clock.flow  # the phases it times
    ps, cap = spec.page_size, cfg.device_pages
    get = prompts.tokens if isinstance(prompts, Prompts) else prompts.__getitem__
    prompt = device_hit = host_hit = declined = 0
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for i in range(len(prompts)):
            tokens = get(i)
            prompt += tokens.shape[0]
            whole = min(tokens.shape[0] // ps, cap)  # a prompt beyond L1 caches what L1 holds
            d, h, x = serve(cache, tokens[: whole * ps], whole, clock, flow)
            device_hit, host_hit, declined = device_hit + d, host_hit + h, declined + x
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = cache.stats()
    finally:
        cache.close()
    n = len(prompts)
    return {
        "requests": n,
        "prompt_tokens": prompt,
        "device_hit_tokens": device_hit,
        "host_hit_tokens": host_hit,
        "host_declined_tokens": declined,
        "hit_tokens": device_hit + host_hit,
        "hit_ratio": (device_hit + host_hit) / prompt if prompt else 0.0,
        "wall_s": wall,
        "cpu_s": cpu,
        "requests_per_s": n / wall if wall > 0 else 0.0,
        "phase_s": None if clock is None else dict(clock.seconds),
        "stats": stats,
    }


def counters(stats: dict[str, Any], page_size: int) -> dict[str, int | None]:
    """The transfer and eviction counters of ``stats()``, pages where the cache counts tokens;
    None for a counter this revision of the cache does not keep."""

    def pages(key: str) -> int | None:
        return None if key not in stats else stats[key] // page_size

    return {
        "bytes_to_host": stats.get("bytes_to_host"),
        "bytes_to_device": stats.get("bytes_to_device"),
        "backups": stats.get("backups"),
        "load_backs": stats.get("load_backs"),
        "load_backs_declined": stats.get("load_backs_declined"),
        "evictions": stats.get("evictions"),
        "evicted_pages": pages("evicted_tokens"),
        "eviction_backup_pages": stats.get("eviction_backup_pages"),
        "host_evicted_pages": pages("host_evicted_tokens"),
        "clean_ahead_pages": stats.get("clean_ahead_pages"),
        "host_copies_dropped_pages": pages("host_copies_dropped_tokens"),
    }


def replay_counted(
    prompts: Prompts | Sequence[np.ndarray],
    spec: Any,
    cfg: Any,
    *,
    clock: PhaseClock | None = None,
    flow: str | None = None,
) -> dict[str, Any]:
    """:func:`replay` with ``stats`` replaced by :func:`counters` (JSON-able)."""
    r = replay(prompts, spec, cfg, clock=clock)
    return {k: v for k, v in r.items() if k != "stats"} | counters(r["stats"], spec.page_size)


# --------------------------------------------------------------------------------- baseline


def add_baseline_flags(ap: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--baseline REV`` (alias ``--base``; default ``default``) and ``--no-baseline``."""
    ap.add_argument(
        "--baseline",
        "--base",
        dest="baseline",
        default=default,
        metavar="REV",
        help="also run this benchmark against hicache_jax at git revision REV, side "
        f"by side, and print the ratio (default: {default or 'none'})",
    )
    ap.add_argument(
        "--no-baseline",
        "--no-base",
        dest="baseline",
        action="store_const",
        const=None,
        help="the current tree only",
    )


@dataclasses.dataclass(frozen=True)
class Tree:
    """A library under test: ``label`` ("current" or the revision), ``lib`` (the directory whose
    ``hicache_jax`` the worker imports)."""

    label: str
    lib: str


class Trees:
    """``with Trees(args.baseline) as trees``: [current] or [current, baseline REV]; the
    baseline's ``hicache_jax/`` is extracted with ``git archive`` and removed on exit."""

    def __init__(self, baseline: str | None) -> None:
        self.baseline = baseline
        self._tmp: str | None = None

    def __enter__(self) -> list[Tree]:
        trees = [Tree("current", REPO)]
        if self.baseline:
            self._tmp = tempfile.mkdtemp(prefix="bench_baseline_")
            # the library's packages only: REV's benchmarks/ must not shadow this checkout's
            packages = [
                p
                for p in LIBRARY_PACKAGES
                if subprocess.run(
                    ["git", "-C", REPO, "cat-file", "-e", f"{self.baseline}:{p}"],
                    capture_output=True,
                ).returncode
                == 0
            ] or list(LIBRARY_PACKAGES[:1])
            archive = subprocess.run(
                ["git", "-C", REPO, "archive", self.baseline, *packages],
                capture_output=True,
                check=False,
            )
            if archive.returncode:
                shutil.rmtree(self._tmp, ignore_errors=True)
                raise SystemExit(
                    f"--baseline {self.baseline}: git archive failed: "
                    f"{archive.stderr.decode(errors='replace').strip()}"
                )
            subprocess.run(["tar", "-x", "-C", self._tmp], input=archive.stdout, check=True)
            trees.append(Tree(self.baseline, self._tmp))
        return trees

    def __exit__(self, *exc: Any) -> None:
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)


class WorkerError(RuntimeError):
    """A worker failed (e.g. a baseline revision lacks a config field the row needs)."""


def run_worker(tree: Tree, module: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> --worker JSON`` against ``tree``'s hicache_jax; its
    ``RESULT {json}`` line, checked to come from that tree (the ``module`` field)."""
    path = tree.lib if tree.lib == REPO else tree.lib + os.pathsep + REPO
    env = dict(os.environ, PYTHONPATH=path, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--worker", json.dumps(payload)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tree.lib,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise WorkerError(
            f"worker {module} failed against {tree.label} ({tree.lib}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    res = json.loads(line[len("RESULT ") :])
    if not os.path.realpath(res["module"]).startswith(os.path.realpath(tree.lib)):
        raise WorkerError(f"worker imported {res['module']}, not the tree at {tree.lib}")
    return res


class WorkerProcess:
    """A worker that stays up (``python -m benchmarks.<module> --worker JSON``, the payload
    with ``"serve": true``) and answers requests one at a time: :meth:`ask` writes one JSON
    line to its stdin and returns its ``RESULT`` line (checked to come from ``tree``), so that
    two trees' workers can take turns request by request without a process start between
    (:func:`serve_main` is the worker side). ``with WorkerProcess(...) as w:`` closes it."""

    def __init__(self, tree: Tree, module: str, payload: dict[str, Any]) -> None:
        path = tree.lib if tree.lib == REPO else tree.lib + os.pathsep + REPO
        env = dict(
            os.environ, PYTHONPATH=path, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu")
        )
        self.tree = tree
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                f"benchmarks.{module}",
                "--worker",
                json.dumps(payload | {"serve": True}),
            ],
            env=env,
            cwd=tree.lib,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    def ask(self, request: dict[str, Any]) -> dict[str, Any]:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        for line in self._proc.stdout:
            if line.startswith("RESULT "):
                res = json.loads(line[len("RESULT ") :])
                if not os.path.realpath(res["module"]).startswith(os.path.realpath(self.tree.lib)):
                    raise WorkerError(f"worker imported {res['module']}, not {self.tree.lib}")
                return res
        self._proc.wait()
        raise WorkerError(
            f"worker against {self.tree.label} ended (rc {self._proc.returncode}):"
            f"\n{self._proc.stderr.read()[-4000:]}"
        )

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._proc.stdin.close()
        self._proc.wait(timeout=60)
        self._proc.stdout.close()
        self._proc.stderr.close()


def serve_main(
    fn: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]], payload: dict[str, Any]
) -> None:
    """The worker side of :class:`WorkerProcess`: ``fn(payload, request)`` for every JSON
    line of stdin, each printed as a ``RESULT`` line at once; returns at end of input."""
    import hicache_jax

    for line in sys.stdin:
        out = fn(payload, json.loads(line))
        print(
            "RESULT " + json.dumps(out | {"module": hicache_jax.__file__}, default=_jsonable),
            flush=True,
        )


def worker_main(fn: Callable[[dict[str, Any]], dict[str, Any]], payload: str) -> None:
    """The worker side of :func:`run_worker`: ``fn(json payload)``, printed as ``RESULT``."""
    import hicache_jax

    out = fn(json.loads(payload))
    print("RESULT " + json.dumps(out | {"module": hicache_jax.__file__}, default=_jsonable))


def _jsonable(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    return str(v)


def alternate(trees: Sequence[Tree], repeats: int) -> Iterator[tuple[int, Tree]]:
    """(repeat, tree) for every repeat, the trees alternating inside each: a drift of the
    shared machine's load hits every tree alike."""
    for r in range(repeats):
        for tree in trees:
            yield r, tree


def ratio(current: float | None, base: float | None) -> float:
    """``current / base`` (nan when either is missing or base is 0)."""
    if current is None or not base:
        return float("nan")
    return current / base
