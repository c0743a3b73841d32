"""Peak memory of a long replay: flat, with events off and with events on and nobody reading.

Replays a Mooncake-format trace (issue 15: 12,000 requests of ~12K tokens, e.g. Mooncake's
``conversation_trace.jsonl``) through the public API (:func:`hicache_jax.replay.driver.replay`) in a
fresh subprocess per configuration, and reports the process's peak RSS beside its RSS after
imports (jax alone) and the bytes of the two pools. Target: peak - after-imports <= pools +
200 MB, with ``kv_events`` off and with ``{"publisher": "queue"}`` that nobody takes (its
buffer, bounded by ``buffer_steps`` and ``buffer_bytes``, drops the oldest batches and counts
them); ``--buffer-bytes N`` adds a queue row with another ``buffer_bytes``.

Usage: ``python -m benchmarks.bench_memory TRACE [--limit N] [--buffer-bytes N ...] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks.common import print_table, write_json

_CHILD = r"""
import json, resource, sys
from hicache_jax import HiCacheConfig
from hicache_jax.replay.driver import load_trace, parse_spec, replay
trace_path, limit, events = sys.argv[1], int(sys.argv[2]), sys.argv[3]
kv_events = None if events == "off" else {"publisher": "queue"}
if events.startswith("queue:"):  # queue:BYTES, a buffer_bytes other than the default
    kv_events["buffer_bytes"] = int(events.split(":")[1])
import jax  # noqa: F401  (counted in the baseline)
trace = load_trace(trace_path, limit=limit or None)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
spec = parse_spec(None, 512)
l1 = 3_000_000 // 512
cfg = HiCacheConfig(device_pages=l1, host_pages=4 * l1, load_back_threshold=512,
                    kv_events=kv_events)
r = replay(trace, spec, cfg)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"base_rss": base, "peak_rss": peak, "pool_bytes": (l1 + 4 * l1) * spec.page_bytes,
                  "requests": r["requests"], "prompt_tokens": r["prompt_tokens"],
                  "hit_ratio": r["hit_ratio"], "kv_events": kv_events}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--buffer-bytes", type=int, action="append", default=[],
                    help="another queue row with this kv_events buffer_bytes (repeatable)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows, results = [], {}
    for events in ["off", "queue"] + [f"queue:{b}" for b in args.buffer_bytes]:
        out = subprocess.run([sys.executable, "-c", _CHILD, args.trace, str(args.limit), events],
                             check=True, capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        results[events] = r
        growth = r["peak_rss"] - r["base_rss"]
        limit = r["pool_bytes"] + 200e6
        rows.append([events, r["requests"], r["base_rss"] / 1e6, r["peak_rss"] / 1e6,
                     r["pool_bytes"] / 1e6, growth / 1e6, limit / 1e6, growth / limit])
    print_table(["events", "requests", "RSS after imports MB", "peak RSS MB", "pools MB",
                 "growth MB", "limit MB (pools + 200)", "growth / limit"], rows,
                title="Peak RSS of a replay (target: growth / limit <= 1)")
    ok = all(r[-1] <= 1 for r in rows)
    print(f"\ntarget peak growth <= pools + 200 MB: {'met' if ok else 'NOT met'}")
    write_json(args.json, "bench_memory", vars(args), results)


if __name__ == "__main__":
    main()
