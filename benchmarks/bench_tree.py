"""Radix tree benchmark: a seeded multi-turn trace through match + insert + eviction.

Three tables:

1. Trace replay at a fixed device capacity, one row per eviction strategy: per-operation cost
   (median µs of match, insert, lock+unlock, and of one eviction call) and the hit-token ratio
   beside the infinite-capacity hit ratio of the same trace (the limit no strategy can beat).
2. Scaling with prefix length (1K, 8K, 32K tokens) and page size: match / insert cost and µs per
   page, for a prefix inserted in one call and one built from 1K-token turns. Cost must follow
   pages (and nodes), not tokens: no per-token Python work.
3. The target: matching a fully cached 32K-token prompt at page_size 16 under 0.5 ms.

The trace: ``--conversations`` conversations, each opening with one of ``--system-prompts``
shared system prompts, then ``--turns`` turns of (user message, reply); at most ``--concurrency``
conversations are active at once, and the next turn is taken from a random active one. A turn's
request is the history plus the user message; when it finishes, the whole sequence (request +
reply) is inserted, as a serving engine does. Device pages come from a ``PageAllocator`` of
``--capacity-pages``; when it runs dry, unlocked leaves are deleted in strategy order (no host
tier here: this measures the tree).

Usage: ``python -m benchmarks.bench_tree [--json PATH]`` (defaults finish in well under a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import env_info, median_time, print_table, write_json
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.tree.eviction import EvictionPolicy, VictimHeap
from hicache_jax.tree.radix import RadixTree

TARGET_MS = 0.5  # match of a fully cached 32K-token prompt, page_size 16
VOCAB = 32000


def make_trace(args) -> list[np.ndarray]:
    """Requests in arrival order; each is (prompt tokens, reply tokens) as int64 arrays."""
    rng = np.random.default_rng(args.seed)
    systems = [rng.integers(0, VOCAB, args.system_tokens) for _ in range(args.system_prompts)]
    pending = list(range(args.conversations))
    active: dict[int, list] = {}  # conversation -> [history, turns left]
    trace = []
    while pending or active:
        while pending and len(active) < args.concurrency:
            c = pending.pop(0)
            active[c] = [systems[c % args.system_prompts], args.turns]
        c = list(active)[rng.integers(len(active))]
        history, left = active[c]
        user = rng.integers(0, VOCAB, rng.integers(args.user_tokens // 4, args.user_tokens + 1))
        reply = rng.integers(0, VOCAB, rng.integers(args.reply_tokens // 4, args.reply_tokens + 1))
        prompt = np.concatenate([history, user])
        trace.append((prompt, reply))
        if left == 1:
            del active[c]
        else:
            active[c] = [np.concatenate([prompt, reply]), left - 1]
    return trace


def evict(tree: RadixTree, alloc: PageAllocator, policy: EvictionPolicy, need: int) -> int:
    """Delete unlocked leaves in strategy order until ``need`` pages are free; leaves deleted."""
    heap = VictimHeap(policy, tree.evictable_device)
    deleted = 0
    while alloc.num_free < need and heap:
        node = heap.pop()
        parent = node.parent
        value, _ = tree.delete_leaf(node)
        alloc.free(value)
        deleted += 1
        if parent in tree.evictable_device:  # its last device child just went
            heap.push(parent)
    if alloc.num_free < need:
        raise RuntimeError(f"capacity too small: {need} pages needed, {alloc.num_free} free")
    return deleted


def replay(trace, page_size: int, capacity: int, policy: EvictionPolicy) -> dict:
    """Serve the trace; return hit tokens and the per-operation times (seconds)."""
    tree, alloc = RadixTree(page_size), PageAllocator(capacity, "device")
    t = {"match": [], "insert": [], "lock": [], "evict": []}
    hit = total = leaves = 0
    pc = time.perf_counter
    for prompt, reply in trace:
        t0 = pc()
        m = tree.match(prompt)
        t1 = pc()
        tree.lock(m.node)
        t["lock"].append(pc() - t1)
        hit, total = hit + m.device_len, total + prompt.shape[0]
        seq = np.concatenate([prompt, reply])
        need = seq.shape[0] // page_size - m.device_pages.shape[0]
        t["match"].append(t1 - t0)
        if alloc.num_free < need:
            t2 = pc()
            leaves += evict(tree, alloc, policy, need)
            t["evict"].append(pc() - t2)
        pages = np.concatenate([m.device_pages, alloc.alloc(need)])
        t3 = pc()
        r = tree.insert(seq, pages)
        t4 = pc()
        t["insert"].append(t4 - t3)
        alloc.free(r.duplicate_pages)
        tree.unlock(m.node)
        t["lock"][-1] += pc() - t4
    return {
        "hit_tokens": hit,
        "prompt_tokens": total,
        "evicted_leaves": leaves,
        "device_tokens_end": tree.device_tokens,
        "times": t,
    }


def scaling(page_sizes, lengths, repeats: int, dtype: str = "int64") -> list[dict]:
    """Match / insert cost for fully cached prefixes of each length, two tree shapes."""
    rng = np.random.default_rng(1)
    rows = []
    for ps in page_sizes:
        for length in lengths:
            toks = rng.integers(0, VOCAB, length).astype(dtype)
            pages = np.arange(length // ps, dtype=np.int32)
            for shape, step in (("1 insert", length), ("1K turns", 1024)):
                tree = RadixTree(ps)
                for end in range(step, length + 1, step):
                    tree.insert(toks[:end], pages[: end // ps])
                nodes = sum(1 for _ in tree.nodes())
                # The lambdas bind this iteration's tree / toks / pages (called before the next).
                match_s = median_time(
                    lambda tree=tree, toks=toks: tree.match(toks), repeats=repeats, warmup=3
                )
                assert tree.match(toks).device_len == length
                cached_s = median_time(
                    lambda tree=tree, toks=toks, pages=pages: tree.insert(toks, pages),
                    repeats=repeats,
                    warmup=3,
                )
                box = {}
                new_s = median_time(
                    lambda box=box, toks=toks, pages=pages: box["t"].insert(toks, pages),
                    repeats=max(3, repeats // 4),
                    setup=lambda box=box, ps=ps: box.update(t=RadixTree(ps)),
                )
                npg = length // ps
                rows.append(
                    {
                        "page_size": ps,
                        "prefix_tokens": length,
                        "shape": shape,
                        "nodes": nodes,
                        "pages": npg,
                        "match_us": match_s * 1e6,
                        "match_us_per_page": match_s * 1e6 / npg,
                        "insert_cached_us": cached_s * 1e6,
                        "insert_new_us": new_s * 1e6,
                        "insert_new_us_per_page": new_s * 1e6 / npg,
                    }
                )
    return rows


def med_us(xs) -> float:
    return statistics.median(xs) * 1e6 if xs else float("nan")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=192)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=48, help="conversations active at once")
    ap.add_argument("--system-prompts", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--user-tokens", type=int, default=384, help="max user tokens per turn")
    ap.add_argument("--reply-tokens", type=int, default=384, help="max reply tokens per turn")
    ap.add_argument(
        "--capacity-pages", type=int, default=6144, help="device pages (fixed capacity)"
    )
    ap.add_argument("--policies", default=",".join(p.value for p in EvictionPolicy))
    ap.add_argument("--repeats", type=int, default=41, help="repeats of each scaling measurement")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="a small trace, fewer repeats")
    ap.add_argument(
        "--token-dtype",
        default="int64",
        choices=("int64", "int32"),
        help="dtype of the token arrays passed to the tree (it stores int32)",
    )
    ap.add_argument("--json", default=None, help="write raw figures to this path")
    args = ap.parse_args(argv)
    if args.quick:
        args.conversations, args.concurrency, args.repeats = 32, 16, 9
    ps = args.page_size
    policies = [EvictionPolicy.parse(p) for p in args.policies.split(",")]
    env = env_info()
    print(
        f"bench_tree: {env['date']}  python {env['python']}  numpy {env['numpy']}  "
        f"cpus {env['cpu_count']}  (pure Python + numpy; no jax in the tree)"
    )

    trace = [(p.astype(args.token_dtype), r.astype(args.token_dtype)) for p, r in make_trace(args)]
    longest = max(p.shape[0] + r.shape[0] for p, r in trace) // ps
    if longest > args.capacity_pages:
        raise SystemExit(
            f"--capacity-pages {args.capacity_pages} < longest request ({longest} pages)"
        )
    inf = replay(trace, ps, sum(p.shape[0] + r.shape[0] for p, r in trace) // ps + 1, policies[0])
    inf_ratio = inf["hit_tokens"] / inf["prompt_tokens"]
    print(
        f"trace: {len(trace)} requests, {inf['prompt_tokens']:,} prompt tokens, "
        f"{inf['device_tokens_end']:,} distinct cached tokens at infinite capacity; "
        f"capacity {args.capacity_pages} pages = {args.capacity_pages * ps:,} tokens"
    )
    rows, results = [], {"infinite": {k: v for k, v in inf.items() if k != "times"}}
    for policy in policies:
        r = replay(trace, ps, args.capacity_pages, policy)
        ratio = r["hit_tokens"] / r["prompt_tokens"]
        tm = r["times"]
        rows.append(
            [
                policy.value,
                med_us(tm["match"]),
                med_us(tm["insert"]),
                med_us(tm["lock"]),
                med_us(tm["evict"]),
                len(tm["evict"]),
                r["evicted_leaves"],
                ratio,
                inf_ratio,
                ratio / inf_ratio,
            ]
        )
        results[policy.value] = {
            "hit_ratio": ratio,
            "vs_infinite": ratio / inf_ratio,
            **{f"{k}_us_median": med_us(v) for k, v in tm.items()},
            "evict_calls": len(tm["evict"]),
            "evicted_leaves": r["evicted_leaves"],
        }
    print_table(
        [
            "policy",
            "match µs",
            "insert µs",
            "lock+unlock µs",
            "evict µs",
            "evict calls",
            "leaves",
            "hit ratio",
            "inf-cap ratio",
            "hit/inf",
        ],
        rows,
        title=f"\nTrace replay at fixed capacity (page_size {ps}; medians per call)",
    )

    scale = scaling([1, 16, 64], [1024, 8192, 32768], args.repeats, args.token_dtype)
    print_table(
        [
            "page",
            "prefix",
            "shape",
            "nodes",
            "pages",
            "match µs",
            "µs/page",
            "insert(cached) µs",
            "insert(new) µs",
            "new µs/page",
        ],
        [
            [
                s["page_size"],
                s["prefix_tokens"],
                s["shape"],
                s["nodes"],
                s["pages"],
                s["match_us"],
                s["match_us_per_page"],
                s["insert_cached_us"],
                s["insert_new_us"],
                s["insert_new_us_per_page"],
            ]
            for s in scale
        ],
        title="\nScaling with prefix length (fully cached prefix; medians)",
    )
    by = {(s["page_size"], s["prefix_tokens"], s["shape"]): s for s in scale}
    for shape in ("1 insert", "1K turns"):
        lo, hi = by[(16, 1024, shape)], by[(16, 32768, shape)]
        print(
            f"page 16, {shape}: 32x the tokens (32x the pages) costs "
            f"{hi['match_us'] / lo['match_us']:.1f}x to match, "
            f"{hi['insert_new_us'] / lo['insert_new_us']:.1f}x to insert new"
        )
    p1, p64 = by[(1, 32768, "1 insert")], by[(64, 32768, "1 insert")]
    print(
        f"32K tokens in one node: page 1 ({p1['pages']} pages) matches in "
        f"{p1['match_us']:.0f} µs, page 64 ({p64['pages']} pages) in {p64['match_us']:.0f} µs; "
        f"inserting new pages costs "
        f"~{by[(16, 32768, '1 insert')]['insert_new_us_per_page']:.1f} µs/page "
        f"(one blake2b per page)"
    )
    tgt = [s for s in scale if s["page_size"] == 16 and s["prefix_tokens"] == 32768]
    print(f"\nTarget: match of a fully cached 32K-token prompt, page_size 16, < {TARGET_MS} ms")
    for s in tgt:
        ms = s["match_us"] / 1e3
        print(
            f"  {s['shape']:>9} ({s['nodes']:>2} nodes): {ms:.3f} ms = {ms / TARGET_MS:.2f}x "
            f"the target -> {'PASS' if ms < TARGET_MS else 'FAIL'}"
        )
    results.update(
        scaling=scale,
        target_ms=TARGET_MS,
        target_measured_ms={s["shape"]: s["match_us"] / 1e3 for s in tgt},
    )
    write_json(args.json, "bench_tree", vars(args), results)


if __name__ == "__main__":
    main()
