"""Control plane at serving speed: requests/s of the bookkeeping, beside a baseline revision.

Replays a Mooncake-format trace through the public API one request at a time, with the request
flow of :mod:`benchmarks.replay_driver` (the request handle: ``begin``, ``extend``, ``flush``,
``finish``, ``flush``; a revision without it, the primitives it calls: ``match_prefix``,
``load_back``, ``lock``, ``alloc_pages``, ``insert``, ``flush``, ``unlock``, ``flush``; both
flushes count as ``flush``), a tiny KVSpec (8 bytes a token, so that bytes cost nothing and what
is timed is the Python), and prints requests/s and microseconds per request for each call, for
L1 only (``host_pages=0``) and L1 + L2 (host = ``--host-ratio`` x L1). With ``--flows`` the
current tree also replays through the primitives, alternating with the handle, and the handle's
requests/s are judged against theirs (target: >= 0.95x).

The same replay runs against hicache_jax at a baseline revision (``--baseline REV``, default
810ed44: before the control-plane work, events always recorded), in worker subprocesses
alternating with the current tree's in the same run (medians of ``--repeats``; the ratio is
what is judged; :mod:`benchmarks.replay_driver`).

* "events off" is the current default configuration (the baseline always records events);
  when ``HiCacheConfig`` has a ``kv_events`` field, a row with ``kv_events={"publisher":
  "queue"}`` is added.
* ``alloc`` includes the eviction it triggers. One extra run per row times the eviction round
  (``HiCache._evict_device`` or ``Evictor.evict_device``, whichever the tree has) through a
  wrapper (a profiling mode only, never in the timed medians) and reports it as ``evict``
  (part of ``alloc`` and ``load_back``).

Targets: L1 only, events off >= 5x the baseline's requests/s; L1 + L2 (host = 4x), events off
>= 4x. Hit figures of each row are printed so a change of behaviour shows.

Sweep (``--capacities 1e5,3e5,1e6,3e6 [--host-ratios 2,4,8]``): L1 + L2 only, events off, the
write policy ``--write-policy`` (default clean_ahead) at every L1 size x L2 ratio. One worker
per tree stays up (``replay_driver.WorkerProcess``) and the two take turns replay by replay,
``--repeats`` pairs a point back to back in ABBA order (each point warmed up on the first
``--warmup`` requests, untimed, then timed on all). Printed per point: the medians' requests/s,
the paired ratios current / baseline (a pair shares the machine's load) and their median, the
same for requests per CPU-second of the worker (``time.process_time``, XLA's threads included:
less moved by other sessions' load than wall time), and whether the two trees' hit and transfer
figures (``SWEEP_FIGURES``) agree: against a revision with the same decisions, a check that a
change kept them.

Usage: ``python -m benchmarks.bench_control_plane [TRACE] [--device-tokens 3e6] [--repeats 3]
[--inner N] [--baseline REV | --no-baseline] [--capacities TOKENS,... [--host-ratios R,...]]
[--json PATH]``; TRACE defaults to the shipped slice
``benchmarks/data/mooncake_synthetic_1000.jsonl`` (the full file:
``FAST25-release/traces/synthetic_trace.jsonl`` of kvcache-ai/Mooncake).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import statistics
import tempfile
import time

from benchmarks import replay_driver as rd

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.join(HERE, "data", "mooncake_synthetic_1000.jsonl")
BASE_COMMIT = "810ed44"
PHASES = rd.PHASES
HIT_FIGURES = ("device_hit_tokens", "host_hit_tokens", "backups", "load_backs", "evictions")
TARGETS = {"L1": 5.0, "L1+L2": 4.0}


# ------------------------------------------------------------------------------ worker side
# Runs in a subprocess against the tree under test: numpy, hicache_jax's public API and
# benchmarks.replay_driver only (an old revision has no hicache_jax.replay.driver).


def _time_evictions() -> list[float]:
    """Wrap the tree's eviction round so that its seconds add up in the returned cell (the
    round is HiCache's own in older revisions, its Evictor's since)."""
    from hicache_jax import HiCache

    owner, name = (
        (HiCache, "_evict_device")
        if hasattr(HiCache, "_evict_device")
        else (importlib.import_module("hicache_jax.cache.evictor").Evictor, "evict_device")
    )
    inner, spent = getattr(owner, name), [0.0]

    def timed(self, num_tokens):
        t = time.perf_counter()
        try:
            return inner(self, num_tokens)
        finally:
            spent[0] += time.perf_counter() - t

    setattr(owner, name, timed)
    return spent


def worker(p: dict) -> dict:
    from hicache_jax import HiCacheConfig

    if p.get("serve"):
        return sweep_worker(p)

    prompts = rd.load_prompts(p["prompts"])
    spec = rd.tiny_spec(prompts.block_size)
    kw = dict(device_pages=p["device_pages"], host_pages=p["host_pages"])
    if p["write_policy"]:
        kw["write_policy"] = p["write_policy"]
    if p["events"] != "off":
        kw["kv_events"] = {"publisher": p["events"]}
    cfg = HiCacheConfig(**kw)
    evict_s = _time_evictions() if p["split"] else None  # profiling mode: not in the medians
    tokens = [prompts.tokens(i) for i in range(len(prompts))]
    flow = p.get("flow") or None
    rd.replay(tokens, spec, cfg, flow=flow)  # warm-up: jit compiles of the copy buckets, untimed
    if evict_s is not None:
        evict_s[0] = 0.0
    probe = rd.new_cache(spec, cfg)
    flow = flow or rd.default_flow(probe)
    probe.close()
    runs = [
        rd.replay(tokens, spec, cfg, clock=rd.PhaseClock(flow), flow=flow)
        for _ in range(p.get("inner", 1))
    ]  # --inner: the median replay of this process
    cpu = [run["cpu_s"] for run in runs]  # the process's CPU seconds of the timed loop
    r = sorted(runs, key=lambda run: run["wall_s"])[len(runs) // 2]
    s = r["stats"]
    return {
        "requests": len(prompts),
        "wall_s": r["wall_s"],
        "phase_s": r["phase_s"],
        "flow": flow,
        "wall_s_inner": [run["wall_s"] for run in runs],
        "cpu_s": sorted(cpu)[len(cpu) // 2],
        "evict_s": None if evict_s is None else evict_s[0],
        "device_hit_tokens": r["device_hit_tokens"],
        "host_hit_tokens": r["host_hit_tokens"],
        "backups": s["backups"],
        "load_backs": s["load_backs"],
        "evictions": s["evictions"],
    }


# ------------------------------------------------------------------------------ driver side


def _run(tree: rd.Tree, npz: str, row: dict, split: bool = False, flow: str = "") -> dict:
    return rd.run_worker(
        tree,
        "bench_control_plane",
        {
            "prompts": npz,
            "device_pages": row["device_pages"],
            "host_pages": row["host_pages"],
            "events": row["events"],
            "write_policy": row["write_policy"],
            "split": split,
            "flow": flow,
            "inner": 1 if split else row.get("inner", 1),
        },
    )


def _summary(runs: list[dict], split: dict | None) -> dict:
    n = runs[0]["requests"]
    wall = statistics.median(r["wall_s"] for r in runs)
    us = {p: statistics.median(r["phase_s"][p] for r in runs) / n * 1e6 for p in runs[0]["phase_s"]}
    us["evict"] = split["evict_s"] / n * 1e6 if split else None
    same = all(all(r[k] == runs[0][k] for k in HIT_FIGURES) for r in runs)
    return {
        "requests_per_s": n / wall,
        "wall_s": wall,
        "wall_s_runs": [r["wall_s"] for r in runs],
        "cpu_s_runs": [r.get("cpu_s") for r in runs],
        "wall_s_best": min(min(r.get("wall_s_inner") or [r["wall_s"]]) for r in runs),
        "flow": runs[0].get("flow", "primitives"),
        "us_per_request": us,
        "deterministic": same,
        "hits_runs": [[r[k] for k in HIT_FIGURES] for r in runs],
    } | {k: runs[0][k] for k in HIT_FIGURES}


def _has_kv_events() -> bool:
    from hicache_jax import HiCacheConfig

    return any(f.name == "kv_events" for f in dataclasses.fields(HiCacheConfig))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--device-tokens", type=float, default=3e6, help="L1 size in tokens")
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--write-policy", default="", help="both trees (default: each tree's own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--inner",
        type=int,
        default=1,
        help="timed replays per worker process (its median is the repeat's figure)",
    )
    rd.add_baseline_flags(ap, BASE_COMMIT)
    ap.add_argument(
        "--flows",
        action="store_true",
        help="also run the current tree through the primitives (handle vs primitives)",
    )
    ap.add_argument(
        "--capacities",
        default=None,
        metavar="TOKENS,...",
        help="sweep: L1 sizes in tokens (L1 + L2 rows only, see the module doc)",
    )
    ap.add_argument(
        "--host-ratios",
        default="4",
        metavar="R,...",
        help="sweep: L2 = ratio x L1 pages, a comma list (default: 4)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=300,
        help="sweep: requests of each point's untimed warm-up (jit compiles)",
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return rd.worker_main(worker, args.worker)
    if args.capacities:
        return sweep_main(args)
    from hicache_jax.replay.trace import load_trace

    trace = load_trace(args.trace, limit=args.limit)
    if trace.format != "mooncake":
        raise SystemExit(f"{args.trace}: a Mooncake trace is needed, got {trace.format}")
    prompts = rd.Prompts.from_trace(trace)
    bs = prompts.block_size
    l1 = int(args.device_tokens) // bs
    rows = []
    for tier, host in (("L1", 0), ("L1+L2", int(round(args.host_ratio * l1)))):
        for events in ("off", "queue") if _has_kv_events() else ("off",):
            rows.append(
                {
                    "tier": tier,
                    "events": events,
                    "device_pages": l1,
                    "host_pages": host,
                    "write_policy": args.write_policy,
                    "inner": args.inner,
                }
            )
    print(
        f"{args.trace}: {len(prompts)} requests, {prompts.num_tokens:,} prompt tokens, page "
        f"{bs}; L1 {l1} pages, L2 {args.host_ratio:g} x L1; write policy "
        f"{args.write_policy or 'each tree default'}; {args.repeats} repeats, medians"
    )
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as tmp, rd.Trees(args.baseline) as trees:
        npz = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(prompts, npz)
        report = measure(rows, npz, trees, args.repeats, args.flows)
    print_report(report, args.baseline)
    if args.json:
        from benchmarks.common import env_info

        with open(args.json, "w") as f:
            json.dump(
                {
                    "env": env_info() | {"load_average": list(os.getloadavg())},
                    "config": vars(args) | {"device_pages": l1, "requests": len(prompts)},
                    "rows": report,
                },
                f,
                indent=1,
            )


def measure(
    rows: list[dict], npz: str, trees: list[rd.Tree], repeats: int, flows: bool = False
) -> list[dict]:
    """Each row's current summary, and the baseline's for the events-off rows (the baseline
    always records events: its one replay is what both rows of a tier are judged against)."""
    current, base = trees[0], trees[1] if len(trees) > 1 else None
    out = []
    for row in rows:
        base_row = dict(row, events="off")
        cur, bas, prim = [], [], []
        for i in range(repeats):  # alternate (ABBA): load changes hit both sides alike
            first_base = i % 2 == 1 and base is not None and row["events"] == "off"
            if first_base:
                bas.append(_run(base, npz, base_row))
            cur.append(_run(current, npz, row))
            if base is not None and row["events"] == "off" and not first_base:
                bas.append(_run(base, npz, base_row))
            if flows and row["events"] == "off":  # the same tree through the primitives
                prim.append(_run(current, npz, row, flow="primitives"))
        r = dict(row, current=_summary(cur, _run(current, npz, row, split=True)))
        if bas:
            r["base"] = _summary(bas, _run(base, npz, base_row, split=True))
        if prim:
            r["primitives"] = _summary(prim, None)
        out.append(r)
    for r in out:  # the queue row is judged against the same base replay
        if "base" not in r:
            r["base"] = next(
                (o.get("base") for o in out if o["tier"] == r["tier"] and "base" in o), None
            )
    return out


def print_report(report: list[dict], rev: str | None) -> None:
    phases = [
        p
        for p in PHASES + rd.HANDLE_PHASES
        if any(
            p in r[t]["us_per_request"]
            for r in report
            for t in ("base", "current", "primitives")
            if r.get(t)
        )
    ]
    phases = list(dict.fromkeys(phases))
    head = ["tier", "tree", "flow", "events", "req/s"] + [f"{p} us" for p in phases] + ["evict us"]
    lines = []
    for r in report:
        for tree in ("base", "current", "primitives"):
            s = r.get(tree)
            if s is None or (tree == "base" and r["events"] != "off"):
                continue
            us = s["us_per_request"]
            lines.append(
                [
                    r["tier"],
                    rev if tree == "base" else "current",
                    s["flow"],
                    "always" if tree == "base" else r["events"],
                    f"{s['requests_per_s']:.0f}",
                ]
                + [f"{us[p]:.0f}" if p in us else "-" for p in phases]
                + ["-" if us["evict"] is None else f"{us['evict']:.0f}"]
            )
    widths = [max(len(h), *(len(ln[i]) for ln in lines)) for i, h in enumerate(head)]
    print("  ".join(h.rjust(w) for h, w in zip(head, widths)))
    for ln in lines:
        print("  ".join(c.rjust(w) for c, w in zip(ln, widths)))
    print("\nhit figures (device hit tokens, host hit tokens, backups, load-backs, evictions):")
    for r in report:
        for tree in ("base", "current", "primitives"):
            s = r.get(tree)
            if s is not None and (tree == "current" or r["events"] == "off"):
                ev = "always" if tree == "base" else r["events"]
                print(
                    f"  {r['tier']:6} {rev if tree == 'base' else tree:8} events {ev:6}: "
                    f"{[s[k] for k in HIT_FIGURES]} deterministic={s['deterministic']}"
                )
    for r in report:
        if r.get("primitives"):
            ratio = r["current"]["requests_per_s"] / r["primitives"]["requests_per_s"]
            print(
                f"  {r['tier']:6}: the handle at {ratio:.3f}x the primitives' requests/s "
                f"(same tree, same run; target >= 0.95) "
                f"{'met' if ratio >= 0.95 else 'NOT met'}"
            )
    print(
        f"\ntargets, events off, requests/s vs the baseline {rev}:"
        if rev
        else "\ntargets: not judged (no baseline run)"
    )
    for r in report:
        if r["events"] == "off" and r.get("base") and r["tier"] in TARGETS:
            ratio = r["current"]["requests_per_s"] / r["base"]["requests_per_s"]
            want = TARGETS[r["tier"]]
            print(
                f"  {r['tier']:6}: {ratio:.2f}x (target >= {want:g}x) "
                f"{'met' if ratio >= want else 'NOT met'}"
            )
        elif r.get("base"):
            ratio = r["current"]["requests_per_s"] / r["base"]["requests_per_s"]
            print(
                f"  {r['tier']:6} events {r['events']}: {ratio:.2f}x the baseline (no target here)"
            )
    print("\nper repeat (current and baseline alternate), events off, requests/s ratio:")
    for r in report:
        if r["events"] == "off" and r.get("base"):
            pairs = paired_ratios(r)
            best = r["base"]["wall_s_best"] / r["current"]["wall_s_best"]
            print(
                f"  {r['tier']:6}: median {statistics.median(pairs):.3f}x, range "
                f"{min(pairs):.3f}-{max(pairs):.3f}x over {len(pairs)} pairs; best replay of "
                f"each side {best:.3f}x"
            )
            cpu = paired_ratios(r, "cpu_s_runs")
            print(
                f"  {'':6}  by CPU seconds: median {statistics.median(cpu):.3f}x, range "
                f"{min(cpu):.3f}-{max(cpu):.3f}x"
            )


def paired_ratios(row: dict, field: str = "wall_s_runs") -> list[float]:
    """current / baseline requests/s of each repeat (the runs alternate, so a pair shares the
    machine's load of its moment); ``field="cpu_s_runs"``: by the processes' CPU seconds (a
    busy machine stretches wall time, much less the CPU time a replay takes)."""
    return [b / c for c, b in zip(row["current"][field], row["base"][field])]


# ------------------------------------------------------------------------------------- sweep

SWEEP_FIGURES = HIT_FIGURES + (
    "evicted_pages",
    "host_evicted_pages",
    "eviction_backup_pages",
    "bytes_to_host",
    "bytes_to_device",
)


def sweep_worker(p: dict) -> dict:
    """The sweep's worker: it stays up (:func:`replay_driver.serve_main`) and replays one point
    per request (``[device_pages, host_pages]``), warmed up on the first ``p["warmup"]``
    prompts the first time it sees the point (untimed), then timed on all of them."""
    from hicache_jax import HiCacheConfig

    prompts = rd.load_prompts(p["prompts"])
    spec = rd.tiny_spec(prompts.block_size)
    tokens = [prompts.tokens(i) for i in range(len(prompts))]
    warm: set = set()

    def point(_: dict, req: list) -> dict:
        dev, host = req
        cfg = HiCacheConfig(device_pages=dev, host_pages=host, write_policy=p["write_policy"])
        if (dev, host) not in warm:
            rd.replay(tokens[: p["warmup"]], spec, cfg)
            warm.add((dev, host))
        cpu = time.process_time()  # every thread of the process: XLA's included
        r = rd.replay_counted(tokens, spec, cfg)
        cpu = time.process_time() - cpu
        return {k: r.get(k) for k in ("wall_s", "requests_per_s") + SWEEP_FIGURES} | {
            "requests_per_cpu_s": r["requests"] / cpu if cpu > 0 else 0.0
        }

    rd.serve_main(point, p)
    return {}


def sweep_main(args: argparse.Namespace) -> None:
    from benchmarks.common import write_json
    from hicache_jax.replay.trace import load_trace

    trace = load_trace(args.trace, limit=args.limit)
    prompts = rd.Prompts.from_trace(trace)
    bs = prompts.block_size
    policy = args.write_policy or "clean_ahead"
    points = [
        (int(float(c)) // bs, float(r))
        for c in args.capacities.split(",")
        for r in args.host_ratios.split(",")
    ]
    points = [[d, int(round(r * d))] for d, r in points]
    print(
        f"{args.trace}: {len(prompts)} requests, page {bs}; sweep of {len(points)} points, "
        f"write policy {policy}; {args.repeats} pairs a point in ABBA order",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench_cp_") as tmp, rd.Trees(args.baseline) as trees:
        npz = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(prompts, npz)
        payload = {"prompts": npz, "write_policy": policy, "warmup": args.warmup, "points": 1}
        runs: dict[str, list[list[dict]]] = {t.label: [[] for _ in points] for t in trees}
        workers = [rd.WorkerProcess(t, "bench_control_plane", payload) for t in trees]
        try:
            for j, pt in enumerate(points):  # a point's pairs back to back: A B, B A, A B ...
                for i in range(args.repeats):
                    for w in workers if i % 2 == 0 else workers[::-1]:
                        runs[w.tree.label][j].append(w.ask(pt))
        finally:
            for w in workers:
                w.__exit__()
    rows = sweep_rows(points, runs, [t.label for t in trees])
    print_sweep(rows, [t.label for t in trees])
    write_json(
        args.json,
        "bench_control_plane_sweep",
        vars(args)
        | {"points": points, "write_policy": policy, "load_average": list(os.getloadavg())},
        rows,
    )


def sweep_rows(points: list, runs: dict, labels: list[str]) -> list[dict]:
    """Per point: each tree's median requests/s and runs, the paired ratios current / baseline
    (pair i: run i of each) and their median, and whether the hit figures agree."""
    rows = []
    for j, (dev, host) in enumerate(points):
        row: dict = {"device_pages": dev, "host_pages": host}
        for label in labels:
            pts = runs[label][j]
            row[label] = {
                "requests_per_s": statistics.median(p["requests_per_s"] for p in pts),
                "requests_per_s_runs": [p["requests_per_s"] for p in pts],
                "requests_per_cpu_s_runs": [p["requests_per_cpu_s"] for p in pts],
                "deterministic": all(all(p[k] == pts[0][k] for k in SWEEP_FIGURES) for p in pts),
            } | {k: pts[0][k] for k in SWEEP_FIGURES}
        if len(labels) > 1:
            cur, base = row[labels[0]], row[labels[1]]
            pairs = [c / b for c, b in zip(cur["requests_per_s_runs"], base["requests_per_s_runs"])]
            row["paired_ratios"] = pairs
            row["ratio"] = statistics.median(pairs)
            row["cpu_ratios"] = [
                c / b
                for c, b in zip(cur["requests_per_cpu_s_runs"], base["requests_per_cpu_s_runs"])
            ]
            row["cpu_ratio"] = statistics.median(row["cpu_ratios"])
            row["same_hits"] = all(cur[k] == base[k] for k in SWEEP_FIGURES)
        rows.append(row)
    return rows


def print_sweep(rows: list[dict], labels: list[str]) -> None:
    from benchmarks.common import print_table

    head = ["L1 pages", "L2 pages"] + [f"{lb} req/s" for lb in labels]
    if len(labels) > 1:
        head += ["paired ratios", "median ratio", "per CPU-s ratios", "median", "same hits"]
    table = []
    for r in rows:
        line = [r["device_pages"], r["host_pages"]]
        line += [f"{r[lb]['requests_per_s']:.0f}" for lb in labels]
        if len(labels) > 1:
            line += [
                " ".join(f"{x:.2f}" for x in r["paired_ratios"]),
                f"{r['ratio']:.3f}",
                " ".join(f"{x:.2f}" for x in r["cpu_ratios"]),
                f"{r['cpu_ratio']:.3f}",
                str(r["same_hits"]),
            ]
        table.append(line)
    print_table(head, table)
    if len(labels) > 1:
        worst = min(r["ratio"] for r in rows)
        cpu = min(r["cpu_ratio"] for r in rows)
        print(
            f"target: requests/s >= the baseline {labels[1]}'s at every point (paired ratio "
            f">= 1): worst median ratio {worst:.3f}, {'met' if worst >= 1 else 'NOT met'}; "
            f"per CPU-second (less moved by the machine's load): worst {cpu:.3f}"
        )


if __name__ == "__main__":
    main()
