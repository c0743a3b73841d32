"""``hicache-jax replay TRACE``: the command over the replay library (:mod:`hicache_jax.replay`).

This module owns the command's flags (:func:`add_parser`), their checks, and what it prints
and writes: the tables of :func:`hicache_jax.replay.driver.run` for every L2 ratio (through
:func:`hicache_jax.study.sweep`, as a notebook gets them), ``--check-ideal``'s verdict, and with
``--simulate`` the what-if TTFT of :mod:`hicache_jax.replay.simulate`. The replay itself is the
library's.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

import hicache_jax.study as study
from hicache_jax.cli.output import check_writable, require_matplotlib, write_json
from hicache_jax.replay import driver as replay_mod
from hicache_jax.replay import mixed as mmod
from hicache_jax.replay import simulate as sim
from hicache_jax.replay import states as smod
from hicache_jax.replay import windows as wmod
from hicache_jax.replay.block_lru import distinct_pages
from hicache_jax.replay.trace import MOONCAKE_BLOCK, TOKEN_PAGE_SIZE
from hicache_jax.spec import HiCacheConfig, KVSpec

__all__ = ["DEFAULT_POLICY", "add_parser", "replay_command"]

#: the write policy HiCacheConfig defaults to: the one ``--check-ideal`` checks
DEFAULT_POLICY = str(getattr(HiCacheConfig.write_policy, "value", HiCacheConfig.write_policy))


def add_parser(sub: Any) -> None:
    """The ``replay`` subcommand's flags (``hicache-jax replay TRACE``)."""
    r = sub.add_parser(
        "replay",
        help="replay a Mooncake / token JSONL trace through HiCache",
        description=replay_mod.__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    r.add_argument(
        "trace",
        metavar="TRACE",
        help="Mooncake JSONL (hash_ids) or token JSONL, or "
        "the name of a slice shipped in the repository (e.g. mooncake_synthetic_1000)",
    )
    t = r.add_argument_group("trace")
    t.add_argument(
        "--block-size", type=int, default=MOONCAKE_BLOCK, help="tokens per Mooncake hash id"
    )
    t.add_argument("--limit", type=int, help="replay only the first N requests")
    c = r.add_argument_group("cache")
    c.add_argument(
        "--page-size",
        type=int,
        help="tokens a page; unset: the block size for a Mooncake trace, "
        f"{TOKEN_PAGE_SIZE} for a token trace",
    )
    size = c.add_mutually_exclusive_group()
    size.add_argument(
        "--device-pages",
        type=int,
        help="L1 pages; with no size given, 1/8 of the trace's distinct pages "
        "(at least the longest prompt)",
    )
    size.add_argument("--device-tokens", type=float, help="L1 size in tokens (e.g. 3e6)")
    size.add_argument(
        "--capacities",
        metavar="TOKENS,...",
        help="capacity sweep: L1 sizes in tokens, e.g. 1e5,3e5,1e6",
    )
    c.add_argument(
        "--host-ratio",
        default="4",
        help="L2 pages = ratio x L1 pages (0: L1 only), or a comma list: every L1 "
        "size is replayed at every ratio, e.g. 2,4,8",
    )
    c.add_argument(
        "--policy", default="clean_ahead", help="write policy, or a comma list (each is run)"
    )
    c.add_argument(
        "--eviction",
        default="default",
        help="eviction strategy, or a comma list; default: the cache's (value for a "
        "--layer-pattern of full and one local kind, window or recurrent; else lru)",
    )
    c.add_argument("--load-back-threshold", type=int, default=16, help="tokens")
    c.add_argument(
        "--spec",
        help="page shape, e.g. layers=32,kv_heads=8,head_dim=128,"
        "dtype=bfloat16; unset: 1 layer, 1 kv head, head_dim 1, "
        "float32",
    )
    w = r.add_argument_group(
        "layer pattern (a sliding-window model at the all-full model's bytes; "
        'ARCHITECTURE.md, "Layer groups")'
    )
    w.add_argument(
        "--layer-pattern",
        metavar="A:B",
        help="A sliding-window layers then B full ones, repeating (e.g. 5:1, or S5:F1): the "
        "replay's spec becomes the pattern's (per layer: 1 kv head of dim 1, float32, one "
        "period of layers, unless --spec says otherwise); capacities stay tokens' worth of the "
        "all-full model's bytes, split between the full-attention and the window pools. "
        "Ra:Fb (e.g. R3:F1): a hybrid recurrent model (a recurrent layers then b full ones): "
        "capacities are tokens' worth of its full-attention KV bytes, split between pages and "
        "state slots (checkpoints); the hit ratio is judged against the exact LRU of the same "
        "bytes (every page boundary a free checkpoint). Ra:Sb:Fc (e.g. R2:S1:F1; letters "
        "recurrent, sliding-window, full, each once, in layer order): all three kinds, with "
        "--window; capacities are the all-full model's bytes, split between pages, window "
        "pages and state slots, and both kinds' figures are reported",
    )
    w.add_argument("--window", type=int, metavar="W", help="the sliding window in tokens")
    w.add_argument(
        "--window-share",
        type=float,
        metavar="F",
        help="fraction of each tier's bytes given to window pages, in (0, 1); unset: the "
        "default rule: the longest prompt's pages (L1, up to the all-full L1) plus ceil(W/page) "
        "pages of tail for every mean prompt's pages of full-attention pool",
    )
    h = r.add_argument_group(
        "recurrent state (with --layer-pattern Ra:Fb or Ra:Sb:Fc; hicache_jax/replay/states.py, "
        "hicache_jax/replay/mixed.py)"
    )
    h.add_argument(
        "--state-tokens",
        type=float,
        metavar="T",
        help="one checkpoint's bytes in tokens of the full-attention KV bytes; unset: "
        f"Qwen3-Next-80B-A3B's {smod.QWEN3_NEXT_STATE_TOKENS:g} (36 Gated DeltaNet layers' "
        "conv + fp32 recurrent state over 12 full layers' KV a token)",
    )
    h.add_argument(
        "--state-share",
        type=float,
        metavar="F",
        help="fraction of each tier's bytes given to state slots, in (0, 1); unset: the "
        "default rule: one request's checkpoints (L1) plus two per mean prompt's pages of "
        "the page pool",
    )
    h.add_argument(
        "--checkpoint-every",
        metavar="K",
        help="a checkpoint every K pages of a prefill besides the branch point, the tail "
        "and the prompt's end (HiCacheConfig.checkpoint_every_pages); 0: none; auto: "
        "ceil(pages / slots) of the pools (the slots spread over the pages); unset: the "
        "cache's default (none)",
    )
    m = r.add_argument_group("simulate (what-if TTFT on a simulated clock)")
    m.add_argument(
        "--simulate",
        action="store_true",
        help="TTFT per load policy (never, "
        "always, threshold, cost, cost+split) with modelled links and prefill",
    )
    m.add_argument("--l2-gbps", type=float, default=25.0, help="L2 -> L1 GB/s")
    m.add_argument("--l3-gbps", type=float, help="L3 -> L2 GB/s (unset: no L3)")
    m.add_argument("--prefill-tokens-per-s", type=float, default=20000.0)
    m.add_argument(
        "--model-spec",
        default="layers=32,kv_heads=8,head_dim=128,dtype=bfloat16",
        help="the modelled model's KV (its bytes a token), --spec's syntax",
    )
    m.add_argument("--seed", type=int, default=0, help="the modelled times' jitter")
    o = r.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    o.add_argument("--plot", metavar="PATH", help="hit ratio versus L1 capacity (needs matplotlib)")
    o.add_argument("--quiet", action="store_true", help="no progress bar")
    o.add_argument(
        "--check-ideal",
        type=float,
        metavar="X",
        help="exit 1, naming the point, where the default write policy's hit ratio "
        "is below X times LRU(L1+L2) of the same run",
    )
    o.add_argument(
        "--diagnose",
        action="store_true",
        help="a table of where each replay loses against LRU(L1+L2): pages it "
        "misses that the LRU hits, mean free and redundant pages of L1 / L2, "
        "pages cleaned, given up, copied on eviction, declined",
    )
    r.set_defaults(func=replay_command)


def _simulate(
    args: argparse.Namespace, parser: argparse.ArgumentParser, trace: Any, spec: Any, pages: int
) -> int:
    try:
        model = KVSpec.parse(
            args.model_spec, replay_mod.TINY_SPEC, page_size=1, flag="--model-spec"
        )
        regime = sim.Regime(
            l2_gbps=args.l2_gbps,
            l3_gbps=args.l3_gbps,
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            token_bytes=model.page_bytes,
        )
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"hicache-jax replay: error: {exc}\n")
    pools: wmod.Pools | smod.StatePools | mmod.MixedPools | None = None
    if spec.state_groups and len(spec.window_groups) > len(spec.state_groups):
        longest, mean = wmod.prompt_tokens(trace)
        pools = mmod.pools_for(
            spec,
            pages,
            args.host_ratios[0],
            window_share=args.window_share,
            state_share=args.state_share,
            longest_tokens=longest,
            mean_tokens=mean,
            checkpoint_every=args.checkpoint_every,
            distinct_pages=distinct_pages(trace, spec.page_size),
        )
    elif spec.state_groups:
        longest, mean = wmod.prompt_tokens(trace)
        pools = smod.pools_for(
            spec,
            pages,
            args.host_ratios[0],
            share=args.state_share,
            longest_tokens=longest,
            mean_tokens=mean,
            checkpoint_every=args.checkpoint_every,
        )
    elif spec.window_groups:
        longest, mean = wmod.prompt_tokens(trace)
        pools = wmod.pools_for(
            spec,
            pages,
            args.host_ratios[0],
            share=args.window_share,
            longest_tokens=longest,
            mean_tokens=mean,
            distinct_pages=distinct_pages(trace, spec.page_size),
        )
    kw: dict[str, Any] = dict(
        device_pages=pages,
        host_ratio=args.host_ratios[0],
        threshold=args.load_back_threshold,
        seed=args.seed,
        pools=pools,
    )
    report = sim.simulate_all(trace, spec, regime, **kw)
    print(
        f"simulate {trace.path}: {len(trace.requests)} requests, L1 {pages} pages"
        + (
            ""
            if pools is None
            else f" of the all-full model's bytes (full/window pages/state slots: L1 "
            f"{pools.device_pages}/{pools.window_device_pages}/{pools.state_device_slots}, L2 "
            f"{pools.host_pages}/{pools.window_host_pages}/{pools.state_host_slots}; a "
            "checkpoint every "
            f"{'default' if pools.checkpoint_every is None else pools.checkpoint_every} pages)"
            if isinstance(pools, mmod.MixedPools)
            else f" of the hybrid's bytes (pages/state slots: L1 {pools.device_pages}/"
            f"{pools.state_device_slots}, L2 {pools.host_pages}/{pools.state_host_slots}; "
            f"state slots {pools.share:.3f} of the bytes, a checkpoint every "
            f"{'default' if pools.checkpoint_every is None else pools.checkpoint_every} pages)"
            if isinstance(pools, smod.StatePools)
            else f" of the all-full model's bytes (full/window pages: L1 {pools.device_pages}/"
            f"{pools.window_device_pages}, L2 {pools.host_pages}/{pools.window_host_pages})"
        )
        + "; "
        f"L2 {args.l2_gbps:g} GB/s, L3 {args.l3_gbps or 'none'} GB/s, prefill "
        f"{args.prefill_tokens_per_s:g} tokens/s, {model.page_bytes:,} KV bytes a token"
    )
    print(sim.ttft_table(report), flush=True)
    if args.plot:
        report["sweep"] = sim.bandwidth_sweep(trace, spec, regime, **kw)
        sim.plot_sweep(report["sweep"], args.plot, "L3" if args.l3_gbps else "L2")
        print(f"wrote {args.plot}")
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "hicache-jax replay --simulate",
                "env": replay_mod.environment(),  # what hicache-jax compare labels a run with
                "config": {k: v for k, v in vars(args).items() if k != "func"},
                **report,
            },
        )
    return 0


def _replay_setup(args: argparse.Namespace) -> tuple[Any, Any, list[int]]:
    """Trace, spec and L1 sizes from the flags (through :mod:`hicache_jax.study`, as a notebook
    gets them); ValueError / OSError naming the problem."""
    args.host_ratios = _host_ratios(args.host_ratio)
    if args.check_ideal is not None and not (
        np.isfinite(args.check_ideal) and 0 < args.check_ideal <= 1
    ):
        raise ValueError(f"--check-ideal {args.check_ideal} must be in (0, 1]")
    if args.check_ideal is not None and DEFAULT_POLICY not in _split(args.policy):
        raise ValueError(
            f"--check-ideal checks the default policy {DEFAULT_POLICY}: add it to --policy"
        )
    if args.json:
        check_writable(args.json)
    _check_pattern_flags(args)
    trace = study.load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    ps = args.page_size if args.page_size is not None else trace.default_page_size()
    if _recurrent(args.layer_pattern):
        if args.spec is not None:
            raise ValueError(
                "--spec is not taken with a recurrent --layer-pattern (Ra:Fb, Ra:Sb:Fc)"
            )
        spec = smod.state_spec(args.layer_pattern, ps, args.state_tokens, window=args.window)
    elif args.layer_pattern is not None:
        period = wmod.pattern_period(args.layer_pattern)
        base = KVSpec.parse(
            args.spec, dataclasses.replace(replay_mod.TINY_SPEC, num_layers=period), page_size=ps
        )
        spec = wmod.pattern_spec(args.layer_pattern, args.window, ps, base=base)
    else:
        spec = KVSpec.parse(args.spec, replay_mod.TINY_SPEC, page_size=ps)
    if args.capacities:
        try:
            sizes = [float(x) for x in args.capacities.split(",") if x.strip()]
        except ValueError:
            raise ValueError(
                f"--capacities {args.capacities!r}: expected numbers, e.g. 1e5,3e5"
            ) from None
        pages = study.l1_pages(trace, ps, capacities=sizes, name="--capacities")
    elif args.device_tokens is not None:
        pages = study.l1_pages(trace, ps, capacities=[args.device_tokens], name="--device-tokens")
    else:
        pages = study.l1_pages(
            trace, ps, device_pages=None if args.device_pages is None else [args.device_pages]
        )
    # every configuration is valid before the first replay starts
    study.check_configs(
        pages,
        args.host_ratios,
        _split(args.policy),
        _split(args.eviction),
        args.load_back_threshold,
    )
    return trace, spec, pages


def _recurrent(pattern: str | None) -> bool:
    """Whether ``--layer-pattern`` names recurrent layers (``R3:F1``, ``R2:S1:F1``); a bad
    pattern raises ValueError naming the flag."""
    return pattern is not None and wmod.pattern_kind(pattern) in ("state", "mixed")


def _check_pattern_flags(args: argparse.Namespace) -> None:
    """``--window`` and ``--window-share`` need a --layer-pattern with sliding-window layers,
    the state flags one with recurrent layers; the shares are in (0, 1) and below 1 together.
    ValueError naming the flag."""
    kind = None if args.layer_pattern is None else wmod.pattern_kind(args.layer_pattern)
    state_flags = (
        ("--state-tokens", args.state_tokens),
        ("--state-share", args.state_share),
        ("--checkpoint-every", args.checkpoint_every),
    )
    if kind not in ("state", "mixed"):
        for flag, value in state_flags:
            if value is not None:
                raise ValueError(f"{flag} needs a recurrent --layer-pattern (e.g. R3:F1, R2:S1:F1)")
    if args.layer_pattern is None:
        for flag, value in (("--window", args.window), ("--window-share", args.window_share)):
            if value is not None:
                raise ValueError(f"{flag} needs --layer-pattern (e.g. --layer-pattern 5:1)")
        return
    if kind == "state":
        for flag, value in (("--window", args.window), ("--window-share", args.window_share)):
            if value is not None:
                raise ValueError(
                    f"{flag} is for a sliding-window --layer-pattern (e.g. 5:1, R2:S1:F1)"
                )
    if kind in ("state", "mixed"):
        smod.check_state_share(args.state_share)
        args.checkpoint_every = smod.check_interval(args.checkpoint_every)
    if kind == "state":
        return
    if args.window is None:
        raise ValueError(
            f"--layer-pattern {args.layer_pattern} needs --window (the sliding window in tokens)"
        )
    if args.window < 1:
        raise ValueError(f"--window {args.window} must be a positive number of tokens")
    wmod.check_share(args.window_share)
    shares = (args.window_share, args.state_share)
    if kind == "mixed" and None not in shares and sum(shares) >= 1:
        raise ValueError(
            f"--window-share {args.window_share:g} + --state-share {args.state_share:g} "
            "must be below 1 (the rest of the bytes are full-attention pages)"
        )


def _split(flag: str) -> list[str]:
    return [x.strip() for x in flag.split(",")]


def _host_ratios(flag: str) -> list[float]:
    """``--host-ratio 4`` or ``2,4,8`` -> the ratios; ValueError naming a bad one."""
    out = []
    for item in _split(str(flag)):
        try:
            ratio = float(item)
        except ValueError:
            raise ValueError(f"--host-ratio {item!r}: expected numbers, e.g. 2,4,8") from None
        if not (np.isfinite(ratio) and ratio >= 0):
            raise ValueError(f"--host-ratio {item} must be a finite number >= 0")
        out.append(ratio)
    return out


def _below_ideal(reports: Sequence[dict[str, Any]], floor: float) -> list[str]:
    """Each point (L2 ratio, L1 size, eviction) where the default write policy's hit ratio is
    below ``floor`` x LRU(L1+L2) of the same run, as a line naming it."""
    out = []
    for rep in reports:
        for r in rep["results"]:
            if r["write_policy"] != DEFAULT_POLICY or r["vs_lru_total"] is None:
                continue
            if r["vs_lru_total"] < floor:
                out.append(
                    f"{DEFAULT_POLICY}/{r['eviction']} at L1 "
                    f"{r['device_pages'] * r['page_size']} tokens, L2 = "
                    f"{rep['host_ratio']:g} x L1: {r['vs_lru_total']:.4f} of "
                    f"LRU(L1+L2) < {floor:g}"
                )
    return out


def replay_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hicache-jax replay TRACE``: see the module doc."""
    try:
        if args.plot:
            require_matplotlib()
        trace, spec, pages = _replay_setup(args)
    except (ValueError, TypeError, OSError, ImportError) as exc:
        parser.exit(2, f"hicache-jax replay: error: {exc}\n")
    if args.simulate:
        return _simulate(args, parser, trace, spec, pages[0])
    ps = spec.page_size
    budget = (
        "all-full model's pages"
        if len(spec.window_groups) > len(spec.state_groups)
        else "hybrid's full-attention pages"
    )
    print(
        f"trace {trace.path}: {trace.format}, {len(trace.requests)} requests, "
        f"{trace.num_tokens:,} prompt tokens; page {ps} tokens, "
        f"{spec.model_page_bytes:,} bytes a page ({spec.total_layers}L {spec.num_kv_heads}x"
        f"{spec.head_dim} {spec.dtype}"
        + (f"; {spec.describe_groups()}" if spec.window_groups else "")
        + f"); L1 {', '.join(f'{p} pages' for p in pages)}, "
        f"L2 = {', '.join(f'{x:g}' for x in args.host_ratios)} x L1"
        + (
            f" (the {budget}' bytes; a checkpoint {smod.slot_bytes(spec):,} bytes = "
            f"{smod.slot_bytes(spec) / spec.page_bytes:.2f} full-attention pages)"
            if spec.state_groups
            else " (the all-full model's pages' bytes)"
            if spec.window_groups
            else ""
        ),
        flush=True,
    )
    env = replay_mod.environment()  # date and load average at the start; the load at the end too
    reports = study.sweep(
        trace,
        device_pages=pages,
        policies=_split(args.policy),
        evictions=_split(args.eviction),
        host_ratios=args.host_ratios,
        spec=spec,
        load_back_threshold=args.load_back_threshold,
        progress=not args.quiet,
        diagnose=args.diagnose,
        window_share=args.window_share,
        state_share=args.state_share,
        checkpoint_every=args.checkpoint_every,
    ).reports
    for rep in reports:
        if len(reports) > 1:
            print(f"\n== L2 = {rep['host_ratio']:g} x L1", flush=True)
        print(replay_mod.tables(rep), flush=True)
    report = reports[0]
    below = _below_ideal(reports, args.check_ideal) if args.check_ideal is not None else []
    if args.json:
        env["load_average_end"] = replay_mod.environment()["load_average"]
        # one ratio: the report's keys at the top (as before); always every report in "reports"
        write_json(
            args.json,
            {
                "benchmark": "hicache-jax replay",
                "env": env,
                "config": {k: v for k, v in vars(args).items() if k != "func"},
                **(report if len(reports) == 1 else {}),
                "reports": reports,
                "check_ideal": None
                if args.check_ideal is None
                else {"floor": args.check_ideal, "below": below},
            },
        )
    if args.plot:
        replay_mod.plot(report, args.plot)
        print(f"wrote {args.plot}")
    if below:
        print("check-ideal failed:\n  " + "\n  ".join(below), file=sys.stderr, flush=True)
        return 1
    return 0
