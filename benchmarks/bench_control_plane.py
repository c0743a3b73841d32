"""Control plane at serving speed (issue 15): requests/s of the bookkeeping, beside the commit
before the issue.

Replays a Mooncake-format trace through the public API one request at a time, with the request
flow of :func:`hicache_jax.replay.driver.replay` (``match_prefix``, ``load_back``, ``lock``,
``alloc_pages``, ``insert``, ``flush``, ``unlock``, ``flush``; both flushes count as
``flush``), a tiny KVSpec (8 bytes a token, so that
bytes cost nothing and what is timed is the Python), and prints requests/s and microseconds per
request for each call, for L1 only (``host_pages=0``) and L1 + L2 (host = ``--host-ratio`` x L1).

The same replay runs at the commit before issue 15 (``--base``, 810ed44), checked out with
``git worktree add --detach`` into a temporary directory, in subprocesses whose ``PYTHONPATH``
points at it, alternating with the current tree's subprocesses in the same run (medians of
``--repeats``; the ratio is what is judged). The worktree is removed at the end.

* "events off" is the current default configuration (the base commit always records events);
  when ``HiCacheConfig`` has a ``kv_events`` field, a row with ``kv_events={"publisher":
  "queue"}`` is added.
* ``alloc`` includes the eviction it triggers. One extra run per row times
  ``HiCache._evict_device`` through a wrapper (a profiling mode only, never in the timed
  medians) and reports it as ``evict`` (part of ``alloc`` and ``load_back``).

Targets (issue 15): L1 only, events off >= 5x the base commit's requests/s; L1 + L2 (host = 4x),
events off >= 4x. Hit figures of each row are printed so a change of behaviour shows.

Usage: ``python -m benchmarks.bench_control_plane [TRACE] [--device-tokens 3e6] [--repeats 3]
[--json PATH]``; TRACE defaults to the shipped slice ``benchmarks/data/mooncake_synthetic_1000.jsonl``
(the full file: ``FAST25-release/traces/synthetic_trace.jsonl`` of kvcache-ai/Mooncake).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_TRACE = os.path.join(HERE, "data", "mooncake_synthetic_1000.jsonl")
BASE_COMMIT = "810ed44"
PHASES = ("match", "load_back", "lock", "alloc", "insert", "unlock", "flush")
HIT_FIGURES = ("device_hit_tokens", "host_hit_tokens", "backups", "load_backs", "evictions")
TARGETS = {"L1": 5.0, "L1+L2": 4.0}


# ------------------------------------------------------------------------------ worker side
# Runs in a subprocess with PYTHONPATH at the tree under test: numpy and hicache_jax's public
# API only (the base commit has no hicache_jax.replay.driver).

def _tokens(hash_ids: np.ndarray, n: int, bs: int) -> np.ndarray:
    return (hash_ids[:, None] * bs + np.arange(bs, dtype=np.int64)).reshape(-1)[:n]


def worker(args: argparse.Namespace) -> None:
    import hicache_jax
    from hicache_jax import HiCache, HiCacheConfig, KVSpec

    data = np.load(args.worker)
    ids, offs, lens, bs = data["hash_ids"], data["offsets"], data["lengths"], int(data["block_size"])
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32", page_size=bs)
    kw = dict(device_pages=args.device_pages, host_pages=args.host_pages)
    if args.write_policy:
        kw["write_policy"] = args.write_policy
    if args.events != "off":
        kw["kv_events"] = {"publisher": args.events}
    cfg = HiCacheConfig(**kw)
    evict_s = [0.0]
    if args.split_eviction:  # profiling mode: one wrapper call per eviction, not in the medians
        # the eviction rounds: HiCache's own before issue 16, its Evictor's since
        owner, name = (HiCache, "_evict_device") if hasattr(HiCache, "_evict_device") else (
            importlib.import_module("hicache_jax.cache.evictor").Evictor, "evict_device")
        inner = getattr(owner, name)

        def timed(self, num_tokens):
            t = time.perf_counter()
            try:
                return inner(self, num_tokens)
            finally:
                evict_s[0] += time.perf_counter() - t
        setattr(owner, name, timed)
    prompts = [_tokens(ids[offs[i]:offs[i + 1]], int(lens[i]), bs) for i in range(lens.size)]
    _replay(HiCache, spec, cfg, prompts)  # warm-up: jit compiles of the copy buckets, untimed
    evict_s[0] = 0.0
    t, wall, hits, s = _replay(HiCache, spec, cfg, prompts)
    out = {"module": hicache_jax.__file__, "requests": int(lens.size), "wall_s": wall,
           "phase_s": t, "evict_s": evict_s[0] if args.split_eviction else None,
           "device_hit_tokens": hits[0], "host_hit_tokens": hits[1],
           "backups": s["backups"], "load_backs": s["load_backs"], "evictions": s["evictions"]}
    print("RESULT " + json.dumps(out))


def _replay(HiCache, spec, cfg, prompts) -> tuple:
    """One replay through a fresh cache: seconds per phase, wall, (device, host) hit tokens,
    stats."""
    ticks = iter(range(1 << 62))
    cache = HiCache(spec, cfg, clock=lambda: float(next(ticks)))
    bs, cap, t = spec.page_size, cfg.device_pages, dict.fromkeys(PHASES, 0.0)
    clock = time.perf_counter
    dev_hit = host_hit = 0
    t_start = clock()
    for tokens in prompts:
        whole = min(tokens.shape[0] // bs, cap)
        tokens = tokens[: whole * bs]
        t0 = clock()
        m = cache.match_prefix(tokens)
        t1 = clock()
        on_device = m.device_len
        m = cache.load_back(m)
        t2 = clock()
        cache.lock(m.node)
        t3 = clock()
        new = cache.alloc_pages(whole - m.device_pages.shape[0])
        t4 = clock()
        cache.insert(tokens, np.concatenate([m.device_pages, new]))
        t5 = clock()
        cache.flush()  # as replay.replay: the load-back's lock is gone before the unlock
        t5b = clock()
        cache.unlock(m.node)
        t6 = clock()
        cache.flush()
        t7 = clock()
        t["flush"] += t5b - t5
        t5 = t5b
        dev_hit += on_device
        host_hit += m.device_len - on_device
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4, t5, t6), (t1, t2, t3, t4, t5, t6, t7)):
            t[name] += b - a
    wall = clock() - t_start
    s = cache.stats()
    cache.close()
    return t, wall, (dev_hit, host_hit), s


# ------------------------------------------------------------------------------ driver side

def _run(tree: str, npz: str, row: dict, split: bool = False) -> dict:
    # The worker is this file run by path: the tree under test (PYTHONPATH, cwd) may be the base
    # commit, which has no benchmarks/bench_control_plane.py of its own to run with -m.
    cmd = [os.path.abspath(__file__), "--worker", npz,
           "--device-pages", str(row["device_pages"]), "--host-pages", str(row["host_pages"]),
           "--events", row["events"]]
    if row["write_policy"]:
        cmd += ["--write-policy", row["write_policy"]]
    if split:
        cmd.append("--split-eviction")
    from benchmarks.common import run_worker  # driver side only: the worker may be a base tree
    return run_worker(cmd, tree)


def _summary(runs: list[dict], split: dict | None) -> dict:
    n = runs[0]["requests"]
    wall = statistics.median(r["wall_s"] for r in runs)
    us = {p: statistics.median(r["phase_s"][p] for r in runs) / n * 1e6 for p in PHASES}
    us["evict"] = split["evict_s"] / n * 1e6 if split else None
    same = all(all(r[k] == runs[0][k] for k in HIT_FIGURES) for r in runs)
    return {"requests_per_s": n / wall, "wall_s": wall, "wall_s_runs": [r["wall_s"] for r in runs],
            "us_per_request": us, "deterministic": same,
            "hits_runs": [[r[k] for k in HIT_FIGURES] for r in runs]} | {
        k: runs[0][k] for k in HIT_FIGURES}


def _has_kv_events() -> bool:
    from hicache_jax import HiCacheConfig

    return any(f.name == "kv_events" for f in dataclasses.fields(HiCacheConfig))


def _write_npz(trace_path: str, limit: int | None, path: str) -> tuple[int, int, int]:
    from hicache_jax.replay.driver import load_trace

    trace = load_trace(trace_path, limit=limit)
    if trace.format != "mooncake":
        raise SystemExit(f"{trace_path}: a Mooncake trace is needed, got {trace.format}")
    ids = [r.hash_ids for r in trace.requests]
    offs = np.concatenate([[0], np.cumsum([a.size for a in ids])]).astype(np.int64)
    lens = np.array([r.num_tokens for r in trace.requests], np.int64)
    np.savez(path, hash_ids=np.concatenate(ids), offsets=offs, lengths=lens,
             block_size=trace.block_size)
    return len(trace.requests), int(lens.sum()), trace.block_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device-tokens", type=float, default=3e6, help="L1 size in tokens")
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--write-policy", default="", help="both trees (default: each tree's own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--base", default=BASE_COMMIT)
    ap.add_argument("--no-base", action="store_true", help="current tree only (profiling)")
    ap.add_argument("--tree", default=REPO, help="the tree measured as current (default: this one)")
    ap.add_argument("--json", default=None)
    # worker mode (internal)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--device-pages", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--host-pages", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--events", default="off", help=argparse.SUPPRESS)
    ap.add_argument("--split-eviction", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    tmp = tempfile.mkdtemp(prefix="bench_cp_")
    npz = os.path.join(tmp, "trace.npz")
    nreq, ntok, bs = _write_npz(args.trace, args.limit, npz)
    l1 = int(args.device_tokens) // bs
    rows = []
    for tier, host in (("L1", 0), ("L1+L2", int(round(args.host_ratio * l1)))):
        for events in ("off", "queue") if _has_kv_events() else ("off",):
            rows.append({"tier": tier, "events": events, "device_pages": l1, "host_pages": host,
                         "write_policy": args.write_policy})
    print(f"{args.trace}: {nreq} requests, {ntok:,} prompt tokens, page {bs}; L1 {l1} pages, "
          f"L2 {args.host_ratio:g} x L1; write policy {args.write_policy or 'each tree default'}; "
          f"{args.repeats} repeats, medians")
    base_tree = os.path.join(tmp, "base")
    if not args.no_base:
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", base_tree, args.base],
                       check=True, capture_output=True)
    try:
        report = measure(rows, npz, base_tree, args)
    finally:
        if not args.no_base:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", base_tree],
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print_report(report, rows)
    if args.json:
        from benchmarks.common import env_info

        with open(args.json, "w") as f:
            json.dump({"env": env_info() | {"load_average": list(os.getloadavg())},
                       "config": vars(args) | {"device_pages": l1, "requests": nreq},
                       "rows": report}, f, indent=1)


def measure(rows: list[dict], npz: str, base_tree: str, args) -> list[dict]:
    out = []
    for row in rows:
        base_row = dict(row, events="off")
        cur, base = [], []
        for _ in range(args.repeats):  # alternate: load changes hit both sides alike
            cur.append(_run(args.tree, npz, row))
            if not args.no_base and row["events"] == "off":
                base.append(_run(base_tree, npz, base_row))
        r = dict(row, current=_summary(cur, _run(args.tree, npz, row, split=True)))
        if base:
            r["base"] = _summary(base, _run(base_tree, npz, base_row, split=True))
        out.append(r)
    for r in out:  # the queue row is judged against the same base replay
        if "base" not in r:
            r["base"] = next((o.get("base") for o in out if o["tier"] == r["tier"]
                              and "base" in o), None)
    return out


def print_report(report: list[dict], rows) -> None:
    head = ["tier", "tree", "events", "req/s"] + [f"{p} us" for p in PHASES] + ["evict us"]
    lines = []
    for r in report:
        for tree in ("base", "current"):
            s = r.get(tree)
            if s is None or (tree == "base" and r["events"] != "off"):
                continue
            us = s["us_per_request"]
            lines.append([r["tier"], tree, "always" if tree == "base" else r["events"],
                          f"{s['requests_per_s']:.0f}"]
                         + [f"{us[p]:.0f}" for p in PHASES]
                         + ["-" if us["evict"] is None else f"{us['evict']:.0f}"])
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for ln in lines:
        print("  ".join(c.rjust(w) for c, w in zip(ln, widths)))
    print("\nhit figures (device hit tokens, host hit tokens, backups, load-backs, evictions):")
    for r in report:
        for tree in ("base", "current"):
            s = r.get(tree)
            if s is not None and (tree == "current" or r["events"] == "off"):
                ev = "always" if tree == "base" else r["events"]
                print(f"  {r['tier']:6} {tree:8} events {ev:6}: "
                      f"{[s[k] for k in HIT_FIGURES]} deterministic={s['deterministic']}")
    print("\ntargets (issue 15), events off, requests/s vs the base commit:")
    for r in report:
        if r["events"] == "off" and r.get("base") and r["tier"] in TARGETS:
            ratio = r["current"]["requests_per_s"] / r["base"]["requests_per_s"]
            want = TARGETS[r["tier"]]
            print(f"  {r['tier']:6}: {ratio:.2f}x (target >= {want:g}x) "
                  f"{'met' if ratio >= want else 'NOT met'}")
        elif r.get("base"):
            ratio = r["current"]["requests_per_s"] / r["base"]["requests_per_s"]
            print(f"  {r['tier']:6} events {r['events']}: {ratio:.2f}x the base (no target here)")


if __name__ == "__main__":
    main()
