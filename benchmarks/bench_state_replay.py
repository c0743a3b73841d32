"""A hybrid recurrent model at equal memory: Mooncake's trace through the cache with state
checkpoints, beside an oracle that has a checkpoint at every page boundary for free
(ARCHITECTURE.md, "Layer groups"; :mod:`hicache_jax.replay.states`).

A 3:1 hybrid (three recurrent layers, then one full-attention layer, repeating) with 512-token
pages, a checkpoint costing Qwen3-Next-80B-A3B's ratio of state bytes to KV bytes a token (3144
tokens' worth: 6.14 pages; ``--state-tokens``), at L1 capacities 3e5 and 3e6 tokens' worth of
the hybrid's full-attention KV bytes and L2 = 4x L1: each tier's bytes are split between the
page pool and the state slot pool (the default rule of :mod:`hicache_jax.replay.states`, or
``--state-share F``), and the trace is replayed through the real cache
(:func:`hicache_jax.replay.driver.run`, the replay of ``hicache-jax replay --layer-pattern
R3:F1``): every request writes checkpoints at ``cache.checkpoint_positions`` before it is
inserted.

Per row (one per L1 size and checkpoint interval ``K``: ``default`` = the cache's default,
``checkpoint_every_pages=None``: no interior checkpoints, a tail one 4 pages before each
prompt's end (``checkpoint_tail_pages``) and every checkpoint kept by what it saves (the
``value`` eviction); 0 = the same; ``K`` > 0 adds one every ``K`` pages, spare interior
checkpoints thinned evenly as slots run short; ``auto``:
``ceil(pages / slots)`` of the pools, a rule from the pools' numbers): the hybrid's hit ratio;
the oracle's (an exact LRU of L1 + L2 pages of the same bytes: every page boundary a free
checkpoint) and the ratio against the target (>= 0.95: met / NOT met, judged on the default K);
the exact LRU of the hybrid's pages alone (the bytes the slots took given up, where checkpoints
are ignored); the state slots' share of the bytes (pools) and of what the cache holds (mean
over the run); the checkpoints written; the tokens cut from matches for want of a checkpoint
(``cut tok``) and the hit ratio with them added back (``hit+cut``).

Usage: ``python -m benchmarks.bench_state_replay [TRACE] [--capacities 3e5,3e6]
[--host-ratio 4] [--intervals default,4,16,64,auto] [--state-tokens T] [--state-share F]
[--limit N] [--json P]`` (TRACE defaults to benchmarks/data's ``mooncake_synthetic_1000``).
"""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.common import print_table, write_json
from hicache_jax.cli.results import figure
from hicache_jax.replay.driver import run
from hicache_jax.replay.states import (
    QWEN3_NEXT_STATE_TOKENS,
    STATE_TARGET,
    check_interval,
    check_state_share,
    slot_bytes,
    state_spec,
)
from hicache_jax.study import l1_pages, load_trace

NAME = "bench_state_replay"


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _intervals(text: str) -> list[int | str | None]:
    return [check_interval(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default="mooncake_synthetic_1000")
    p.add_argument("--capacities", type=_floats, default=[3e5, 3e6])
    p.add_argument("--host-ratio", type=float, default=4.0)
    p.add_argument(
        "--intervals",
        type=_intervals,
        default=[None, 4, 16, 64, "auto"],
        help="K; default = the cache's default (none: a tail checkpoint instead), 0 = none, "
        "auto = "
        "ceil(pages / slots) of the pools",
    )
    p.add_argument("--layer-pattern", default="R3:F1")
    p.add_argument("--page-size", type=int, default=512)
    p.add_argument("--state-tokens", type=float, default=QWEN3_NEXT_STATE_TOKENS)
    p.add_argument("--state-share", type=float, help="unset: the default rule")
    p.add_argument("--limit", type=int, help="first N requests only")
    p.add_argument("--json")
    a = p.parse_args(argv)
    share = check_state_share(a.state_share)
    trace = load_trace(a.trace, block_size=512, limit=a.limit)
    spec = state_spec(a.layer_pattern, a.page_size, a.state_tokens)
    pages = l1_pages(trace, a.page_size, capacities=a.capacities, name="--capacities")
    sb = slot_bytes(spec)
    print(
        f"{trace.path}: {len(trace.requests)} requests, {trace.num_tokens:,} prompt tokens; "
        f"{a.layer_pattern}, page {a.page_size} tokens ({spec.describe_groups()}); a checkpoint "
        f"{sb:,} bytes = {sb / spec.page_bytes:.2f} pages ({a.state_tokens:g} tokens of KV); "
        "split: " + ("the default rule" if share is None else f"{share:g} of each tier's bytes"),
        flush=True,
    )
    rows, results, figures, verdicts = [], [], [], []
    for k in a.intervals:
        rep = run(
            trace,
            spec,
            device_pages=pages,
            host_ratio=a.host_ratio,
            state_share=share,
            checkpoint_every=k,
        )
        results.append(rep)
        for r in rep["results"]:
            tokens, vs = r["device_pages"] * a.page_size, r["vs_oracle"]
            ok = vs is not None and vs >= STATE_TARGET
            if k is None:
                verdicts.append((tokens, vs, ok))
            pools = r["pools"]
            cut = r["window_unservable_tokens"]
            rows.append(
                (
                    f"{tokens:,}",
                    f"{a.host_ratio:g}x",
                    f"{r['checkpoint_every']} (default)"
                    if k is None
                    else f"{r['checkpoint_every']} ({k})"
                    if k == "auto"
                    else k,
                    f"{pools['device_pages']}/{pools['state_device_slots']}",
                    f"{pools['host_pages']}/{pools['state_host_slots']}",
                    f"{pools['share']:.3f}",
                    f"{r['hit_ratio']:.4f}",
                    f"{r['oracle_hit_ratio']:.4f}",
                    "-" if vs is None else f"{vs:.3f} {'met' if ok else 'NOT met'}",
                    f"{r['lru_pages_hit_ratio']:.4f}",
                    f"{r['state_bytes_share']:.3f}",
                    r["checkpoints_written"],
                    cut,
                    f"{r['hit_ratio'] + cut / r['prompt_tokens']:.4f}",
                    f"{r['wall_s']:.1f}",
                )
            )
            figures.append(_figure(r, tokens, a.host_ratio, k))
    print_table(
        (
            "L1 tokens",
            "L2",
            "ckpt every K",
            "L1 pages/slots",
            "L2 pages/slots",
            "state pool share",
            "hit ratio",
            "oracle",
            f"hit/oracle >= {STATE_TARGET:g}",
            "LRU(pages)",
            "state bytes held",
            "ckpts written",
            "cut tok",
            "hit+cut",
            "wall s",
        ),
        rows,
        title="hybrid (state checkpoints) at equal bytes against the every-page oracle (exact "
        f"LRU of the same bytes); target >= {STATE_TARGET:g} at the default K",
    )
    for tokens, vs, ok in verdicts:
        print(
            f"default policy, L1 {tokens:,} tokens, L2 {a.host_ratio:g}x: hit/oracle "
            f"{'-' if vs is None else f'{vs:.3f}'} -> {'met' if ok else 'NOT met'}"
        )
    config = {k: v for k, v in vars(a).items() if k != "json"} | {"spec": spec.as_json()}
    write_json(a.json, NAME, config, results, figures)


def _figure(r: dict[str, Any], tokens: int, ratio: float, k: Any) -> dict[str, Any]:
    return figure(
        f"hit ratio hybrid L1 {tokens} L2 {ratio:g}x K {k}",
        "share",
        r["hit_ratio"],
        "exact LRU of the same bytes (a checkpoint at every page)",
        r["oracle_hit_ratio"],
        NAME,
        higher_is_better=True,
    )


if __name__ == "__main__":
    main()
