"""Peak memory of a long replay: flat, with events off and with events on and nobody reading.

Replays a Mooncake-format trace (12,000 requests of ~12K tokens, e.g. Mooncake's
``conversation_trace.jsonl``) through the request flow of :mod:`benchmarks.replay_driver` in a
fresh worker subprocess per configuration, and reports the process's peak RSS beside its RSS
after imports (jax and the loaded prompts) and the bytes of the two pools. Target: peak -
after-imports <= pools + 200 MB, with ``kv_events`` off and with ``{"publisher": "queue"}`` that
nobody takes (its buffer, bounded by ``buffer_steps`` and ``buffer_bytes``, drops the oldest
batches and counts them); ``--buffer-bytes N`` adds a queue row with another ``buffer_bytes``.
``--baseline REV`` runs every row against hicache_jax at git revision REV too and prints the
growth ratio (a row that revision cannot build shows as n/a).

Usage: ``python -m benchmarks.bench_memory TRACE [--limit N] [--buffer-bytes N ...]
[--baseline REV] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from benchmarks import replay_driver as rd
from benchmarks.common import print_table, write_json

PAGE = 512
L1_TOKENS = 3_000_000


def worker(p: dict) -> dict:
    """One replay in this (fresh) process: RSS after imports and the prompts, peak RSS."""
    import resource

    import jax  # noqa: F401  (counted in the baseline)

    from hicache_jax import HiCacheConfig

    events = p["events"]
    kv_events = None if events == "off" else {"publisher": "queue"}
    if events.startswith("queue:"):  # queue:BYTES, a buffer_bytes other than the default
        kv_events["buffer_bytes"] = int(events.split(":")[1])
    prompts = rd.load_prompts(p["prompts"])
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    spec = rd.tiny_spec(PAGE)
    l1 = L1_TOKENS // PAGE
    kw = {} if kv_events is None else {"kv_events": kv_events}
    cfg = HiCacheConfig(device_pages=l1, host_pages=4 * l1, load_back_threshold=PAGE, **kw)
    r = rd.replay(prompts, spec, cfg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "base_rss": base,
        "peak_rss": peak,
        "pool_bytes": (l1 + 4 * l1) * spec.page_bytes,
        "requests": r["requests"],
        "prompt_tokens": r["prompt_tokens"],
        "hit_ratio": r["hit_ratio"],
        "kv_events": kv_events,
    }


def row(events: str, r: dict) -> list:
    growth = r["peak_rss"] - r["base_rss"]
    limit = r["pool_bytes"] + 200e6
    return [
        events,
        r["requests"],
        r["base_rss"] / 1e6,
        r["peak_rss"] / 1e6,
        r["pool_bytes"] / 1e6,
        growth / 1e6,
        limit / 1e6,
        growth / limit,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument(
        "--buffer-bytes",
        type=int,
        action="append",
        default=[],
        help="another queue row with this kv_events buffer_bytes (repeatable)",
    )
    rd.add_baseline_flags(ap)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return rd.worker_main(worker, args.worker)
    if args.trace is None:
        ap.error("the following arguments are required: trace")
    from hicache_jax.replay.trace import load_trace

    results: dict[str, dict] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench_memory_") as tmp,
        rd.Trees(args.baseline) as trees,
    ):
        path = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(
            rd.Prompts.from_trace(load_trace(args.trace, limit=args.limit or None)), path
        )
        for events in ["off", "queue"] + [f"queue:{b}" for b in args.buffer_bytes]:
            for tree in trees:
                try:
                    r = rd.run_worker(tree, "bench_memory", {"prompts": path, "events": events})
                except rd.WorkerError as e:
                    r = {"error": str(e).splitlines()[-1]}
                results.setdefault(tree.label, {})[events] = r
    report(args, results)


def report(args, results: dict) -> None:
    cur = results["current"]
    rows = [row(events, r) for events, r in cur.items()]
    print_table(
        [
            "events",
            "requests",
            "RSS after imports MB",
            "peak RSS MB",
            "pools MB",
            "growth MB",
            "limit MB (pools + 200)",
            "growth / limit",
        ],
        rows,
        title="Peak RSS of a replay (target: growth / limit <= 1)",
    )
    if args.baseline:
        base = results[args.baseline]
        print_table(
            [
                "events",
                f"growth / limit {args.baseline}",
                "growth / limit current",
                "growth current / base",
            ],
            [
                [e, "n/a", row(e, r)[-1], "n/a"]
                if "error" in base[e]
                else [
                    e,
                    row(e, base[e])[-1],
                    row(e, r)[-1],
                    rd.ratio(
                        r["peak_rss"] - r["base_rss"], base[e]["peak_rss"] - base[e]["base_rss"]
                    ),
                ]
                for e, r in cur.items()
            ],
            title=f"\nBeside hicache_jax at {args.baseline} (same benchmark code)",
        )
    ok = all(r[-1] <= 1 for r in rows)
    print(f"\ntarget peak growth <= pools + 200 MB: {'met' if ok else 'NOT met'}")
    write_json(
        args.json,
        "bench_memory",
        vars(args),
        cur | ({"baseline": results[args.baseline]} if args.baseline else {}),
    )


if __name__ == "__main__":
    main()
