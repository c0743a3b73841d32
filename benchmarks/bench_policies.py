"""Write policies on a production trace, against the exact LRU bounds of the same capacity.

Replays a Mooncake-format trace (e.g. ``FAST25-release/traces/synthetic_trace.jsonl`` of
kvcache-ai/Mooncake) through the real HiCache (:mod:`benchmarks.replay_driver`) for each write
policy, with L1 = ``--l1-tokens`` and L2 = ``--host-ratio`` x L1, and judges each against exact
block-LRU caches computed in the same run (:mod:`hicache_jax.replay.driver`):

* ``clean_ahead`` (the default): hit >= 0.97 of the LRU of L1 + L2 capacity, and at most 10% of
  evicted pages backed up on the eviction path (``stats()["eviction_backup_pages"]``);
* ``write_through``: hit >= 0.97 of the LRU of L2's capacity (the inclusive bound);
* ``write_back``: hit >= 0.98 of the LRU of L1 + L2;
* every policy's replay time beside write_through's (clean_ahead: <= 1.5x), medians of
  ``--repeats`` runs whose hit figures must be identical (replays are deterministic); the first
  replay of a process pays the jit compiles of the copy buckets, so quote times with
  ``--repeats`` >= 3.

``--reserve`` sweeps ``clean_ahead_pages`` (the backed-up window at L1's eviction end).
``--baseline REV`` runs every configuration against hicache_jax at git revision REV too (both
trees in worker subprocesses, alternating) and prints its hit ratio and replay time beside the
current tree's (a configuration that revision cannot build shows as n/a).

Usage: ``python -m benchmarks.bench_policies TRACE [--l1-tokens 3e6] [--repeats 3]
[--baseline REV] [--json P]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from benchmarks import replay_driver as rd
from benchmarks.common import print_table, write_json

POLICIES = ("write_through", "write_through_selective", "write_back", "clean_ahead")
HIT_FIGURES = (
    "hit_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "backups",
    "load_backs",
    "eviction_backup_pages",
    "evicted_pages",
)


def run_policy(prompts, spec, cfg, repeats: int) -> dict:
    runs = [rd.replay_counted(prompts, spec, cfg) for _ in range(repeats)]
    first = runs[0]
    same = all(all(r.get(k) == first.get(k) for k in HIT_FIGURES) for r in runs)
    return first | {
        "wall_s": statistics.median(r["wall_s"] for r in runs),
        "wall_s_runs": [r["wall_s"] for r in runs],
        "deterministic": same,
    }


def config(p: dict):
    """The HiCacheConfig of a worker payload (only the fields a revision may lack when set)."""
    from hicache_jax import HiCacheConfig

    kw = dict(
        device_pages=p["device_pages"],
        host_pages=p["host_pages"],
        write_policy=p["policy"],
        load_back_threshold=p["page_size"],
    )
    if p["reserve"] is not None:
        kw["clean_ahead_pages"] = p["reserve"]
    return HiCacheConfig(**kw)


def run_configured(prompts, p: dict) -> dict:
    """The configuration of payload ``p``, ``p["repeats"]`` replays of ``prompts``."""
    cfg = config(p)
    r = run_policy(prompts, rd.tiny_spec(p["page_size"]), cfg, p["repeats"])
    return r | {"clean_ahead_pages_cfg": getattr(cfg, "clean_ahead_pages", None)}


def worker(p: dict) -> dict:
    """A worker subprocess (the tree under test): one configuration over the prompts file."""
    return run_configured(rd.load_prompts(p["prompts"]), p)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--l1-tokens", type=float, default=3e6)
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--reserve", default="", help="comma list of clean_ahead_pages to sweep")
    rd.add_baseline_flags(ap)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is None and args.trace is None:
        ap.error("the following arguments are required: trace")
    return args


def measure(args, prompts, payloads: list[dict]) -> dict[str, dict[str, dict]]:
    """{tree label: {config name: result}}: in process without a baseline, else every
    configuration in a worker per tree, the trees alternating."""
    if not args.baseline:
        return {"current": {p["name"]: run_configured(prompts, p) for p in payloads}}
    out: dict[str, dict[str, dict]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="bench_policies_") as tmp,
        rd.Trees(args.baseline) as trees,
    ):
        path = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(prompts, path)
        for p in payloads:
            for tree in trees:
                try:
                    r = rd.run_worker(tree, "bench_policies", p | {"prompts": path})
                except rd.WorkerError as e:
                    r = {"error": str(e).splitlines()[-1]}
                out.setdefault(tree.label, {})[p["name"]] = r
    return out


def policy_rows(results: dict, refs: dict, prompt: int, l1: int, l2: int) -> list[list]:
    rows = []
    for name, r in results.items():
        policy = name.split("(")[0]
        rows.append(
            [
                name,
                (r["clean_ahead_pages_cfg"] or "auto") if policy == "clean_ahead" else "",
                r["hit_tokens"] / prompt,
                r["hit_tokens"] / refs[None],
                r["hit_tokens"] / refs[l1 + l2],
                r["hit_tokens"] / refs[l2],
                r["eviction_backup_pages"] / max(r["evicted_pages"], 1),
                r["bytes_to_host"] / 1e6,
                r["wall_s"],
                r["deterministic"],
            ]
        )
    base = results.get("write_through", {}).get("wall_s")
    for row in rows:
        row.append(row[-2] / base if base else float("nan"))
    return rows


def print_baseline(rev: str, cur: dict, base: dict, prompt: int) -> None:
    """Hit ratio and replay time of each configuration at ``rev`` beside the current tree's."""
    rows = []
    for name, c in cur.items():
        b = base.get(name, {})
        if "error" in b:
            rows.append([name, "n/a", c["hit_tokens"] / prompt, "n/a", "n/a", c["wall_s"], "n/a"])
            continue
        rows.append(
            [
                name,
                b["hit_tokens"] / prompt,
                c["hit_tokens"] / prompt,
                rd.ratio(c["hit_tokens"], b["hit_tokens"]),
                b["wall_s"],
                c["wall_s"],
                rd.ratio(c["wall_s"], b["wall_s"]),
            ]
        )
    print_table(
        [
            "policy",
            f"hit ratio {rev}",
            "hit ratio current",
            "hit current / base",
            f"wall s {rev}",
            "wall s current",
            "time current / base",
        ],
        rows,
        title=f"\nBeside hicache_jax at {rev} (same benchmark code, worker subprocesses "
        "alternating; n/a: that revision cannot build the configuration)",
    )


def checks(results: dict, refs: dict, l1: int, l2: int) -> list[tuple[str, bool]]:
    out = []
    base = results.get("write_through", {}).get("wall_s")
    if "clean_ahead" in results:
        c = results["clean_ahead"]
        out += [
            ("clean_ahead hit / LRU(L1+L2) >= 0.97", c["hit_tokens"] / refs[l1 + l2] >= 0.97),
            (
                "clean_ahead evict-backup <= 10% of evicted",
                c["eviction_backup_pages"] <= 0.1 * max(c["evicted_pages"], 1),
            ),
        ]
        if base:
            out.append(("clean_ahead time <= 1.5x write_through", c["wall_s"] <= 1.5 * base))
    if "write_through" in results:
        out.append(
            (
                "write_through hit / LRU(L2) >= 0.97",
                results["write_through"]["hit_tokens"] / refs[l2] >= 0.97,
            )
        )
    if "write_back" in results:
        out.append(
            (
                "write_back hit / LRU(L1+L2) >= 0.98",
                results["write_back"]["hit_tokens"] / refs[l1 + l2] >= 0.98,
            )
        )
    out.append(
        ("every replay identical across runs", all(r["deterministic"] for r in results.values()))
    )
    return out


def main() -> None:
    args = parse_args()
    if args.worker:
        return rd.worker_main(worker, args.worker)
    from hicache_jax.replay.block_lru import reference_hits
    from hicache_jax.replay.trace import load_trace

    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    ps = args.block_size
    l1 = int(args.l1_tokens) // ps
    l2 = int(round(args.host_ratio * l1))
    refs, distinct = reference_hits(trace, ps, [None, l1, l2, l1 + l2])
    prompt = sum(r.num_tokens for r in trace.requests)
    print(
        f"{args.trace}: {len(trace.requests)} requests, {prompt:,} prompt tokens, "
        f"{distinct:,} distinct pages; L1 {l1} pages, L2 {l2} pages"
    )
    print(
        f"references (hit ratio): infinite {refs[None] / prompt:.4f}, LRU(L1+L2) "
        f"{refs[l1 + l2] / prompt:.4f}, LRU(L2) {refs[l2] / prompt:.4f}, "
        f"LRU(L1) {refs[l1] / prompt:.4f}"
    )
    configs = [(p, None) for p in args.policies.split(",")]
    configs += [("clean_ahead", int(r)) for r in args.reserve.split(",") if r]
    payloads = [
        {
            "name": p if r is None else f"{p}({r})",
            "policy": p,
            "reserve": r,
            "device_pages": l1,
            "host_pages": l2,
            "page_size": ps,
            "repeats": args.repeats,
        }
        for p, r in configs
    ]
    by_tree = measure(args, rd.Prompts.from_trace(trace), payloads)
    results = by_tree["current"]
    print_table(
        [
            "policy",
            "reserve pg",
            "hit ratio",
            "/inf",
            "/LRU(L1+L2)",
            "/LRU(L2)",
            "evict-backup / evicted",
            "MB to host",
            "wall s (median)",
            "identical runs",
            "time / write_through",
        ],
        policy_rows(results, refs, prompt, l1, l2),
        title="\nWrite policies vs exact LRU of the same capacity (targets: clean_ahead "
        "/LRU(L1+L2) >= 0.97, evict-backup <= 0.10, time <= 1.5x; write_through "
        "/LRU(L2) >= 0.97; write_back /LRU(L1+L2) >= 0.98)",
    )
    if args.baseline:
        print_baseline(args.baseline, results, by_tree[args.baseline], prompt)
    for what, ok in checks(results, refs, l1, l2):
        print(f"target {what}: {'met' if ok else 'NOT met'}")
    write_json(
        args.json,
        "bench_policies",
        vars(args),
        {"references": {str(k): v for k, v in refs.items()}, "prompt_tokens": prompt}
        | results
        | ({"baseline": by_tree[args.baseline]} if args.baseline else {}),
    )


if __name__ == "__main__":
    main()
