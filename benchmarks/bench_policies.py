"""Write policies on a production trace, against the exact LRU bounds (issue 14's targets).

Replays a Mooncake-format trace (e.g. ``FAST25-release/traces/synthetic_trace.jsonl`` of
kvcache-ai/Mooncake) through the real HiCache for each write policy, with L1 = ``--l1-tokens``
and L2 = ``--host-ratio`` x L1, and judges each against exact block-LRU caches computed in the
same run (:mod:`hicache_jax.replay.driver`):

* ``clean_ahead`` (the default): hit >= 0.97 of the LRU of L1 + L2 capacity, and at most 10% of
  evicted pages backed up on the eviction path (``stats()["eviction_backup_pages"]``);
* ``write_through``: hit >= 0.97 of the LRU of L2's capacity (the inclusive bound);
* ``write_back``: hit >= 0.98 of the LRU of L1 + L2;
* every policy's replay time beside write_through's (clean_ahead: <= 1.5x), medians of
  ``--repeats`` runs whose hit figures must be identical (replays are deterministic).

``--reserve`` sweeps ``clean_ahead_pages`` (the backed-up window at L1's eviction end).

Usage: ``python -m benchmarks.bench_policies TRACE [--l1-tokens 3e6] [--repeats 3] [--json P]``.
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.common import print_table, write_json
from hicache_jax import HiCacheConfig
from hicache_jax.replay.driver import load_trace, parse_spec, reference_hits, replay

POLICIES = ("write_through", "write_through_selective", "write_back", "clean_ahead")
HIT_FIGURES = ("hit_tokens", "device_hit_tokens", "host_hit_tokens", "backups", "load_backs",
               "eviction_backup_pages", "evicted_pages")


def run_policy(trace, spec, cfg, repeats: int) -> dict:
    runs = [replay(trace, spec, cfg) for _ in range(repeats)]
    first = runs[0]
    same = all(all(r.get(k) == first.get(k) for k in HIT_FIGURES) for r in runs)
    return first | {"wall_s": statistics.median(r["wall_s"] for r in runs),
                    "wall_s_runs": [r["wall_s"] for r in runs], "deterministic": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("--l1-tokens", type=float, default=3e6)
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--reserve", default="", help="comma list of clean_ahead_pages to sweep")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    ps = args.block_size
    spec = parse_spec(None, ps)
    l1 = int(args.l1_tokens) // ps
    l2 = int(round(args.host_ratio * l1))
    refs, distinct = reference_hits(trace, ps, [None, l1, l2, l1 + l2])
    prompt = sum(r.num_tokens for r in trace.requests)
    print(f"{args.trace}: {len(trace.requests)} requests, {prompt:,} prompt tokens, "
          f"{distinct:,} distinct pages; L1 {l1} pages, L2 {l2} pages")
    print(f"references (hit ratio): infinite {refs[None] / prompt:.4f}, LRU(L1+L2) "
          f"{refs[l1 + l2] / prompt:.4f}, LRU(L2) {refs[l2] / prompt:.4f}, "
          f"LRU(L1) {refs[l1] / prompt:.4f}")
    results = {"references": {str(k): v for k, v in refs.items()}, "prompt_tokens": prompt}
    configs = [(p, None) for p in args.policies.split(",")]
    configs += [("clean_ahead", int(r)) for r in args.reserve.split(",") if r]
    rows = []
    for policy, reserve in configs:
        cfg = HiCacheConfig(device_pages=l1, host_pages=l2, write_policy=policy,
                            load_back_threshold=ps, clean_ahead_pages=reserve)
        r = run_policy(trace, spec, cfg, args.repeats)
        name = policy if reserve is None else f"{policy}({reserve})"
        results[name] = r
        rows.append([name, (cfg.clean_ahead_pages or "auto") if policy == "clean_ahead" else "",
                     r["hit_tokens"] / prompt, r["hit_tokens"] / refs[None],
                     r["hit_tokens"] / refs[l1 + l2], r["hit_tokens"] / refs[l2],
                     r["eviction_backup_pages"] / max(r["evicted_pages"], 1),
                     r["bytes_to_host"] / 1e6, r["wall_s"], r["deterministic"]])
    base = results.get("write_through", {}).get("wall_s")
    for row in rows:
        row.append(row[-2] / base if base else float("nan"))
    print_table(["policy", "reserve pg", "hit ratio", "/inf", "/LRU(L1+L2)", "/LRU(L2)",
                 "evict-backup / evicted", "MB to host", "wall s (median)", "identical runs",
                 "time / write_through"], rows,
                title="\nWrite policies vs exact LRU of the same capacity (targets: clean_ahead "
                      "/LRU(L1+L2) >= 0.97, evict-backup <= 0.10, time <= 1.5x; write_through "
                      "/LRU(L2) >= 0.97; write_back /LRU(L1+L2) >= 0.98)")
    checks = []
    if "clean_ahead" in results:
        c = results["clean_ahead"]
        checks += [("clean_ahead hit / LRU(L1+L2) >= 0.97", c["hit_tokens"] / refs[l1 + l2] >= 0.97),
                   ("clean_ahead evict-backup <= 10% of evicted",
                    c["eviction_backup_pages"] <= 0.1 * max(c["evicted_pages"], 1))]
        if base:
            checks.append(("clean_ahead time <= 1.5x write_through", c["wall_s"] <= 1.5 * base))
    if "write_through" in results:
        checks.append(("write_through hit / LRU(L2) >= 0.97",
                       results["write_through"]["hit_tokens"] / refs[l2] >= 0.97))
    if "write_back" in results:
        checks.append(("write_back hit / LRU(L1+L2) >= 0.98",
                       results["write_back"]["hit_tokens"] / refs[l1 + l2] >= 0.98))
    checks.append(("every replay identical across runs",
                   all(r["deterministic"] for k, r in results.items() if isinstance(r, dict)
                       and "deterministic" in r)))
    for what, ok in checks:
        print(f"target {what}: {'met' if ok else 'NOT met'}")
    write_json(args.json, "bench_policies", vars(args), results)


if __name__ == "__main__":
    main()
