"""``hicache-jax lower``: the lowering checks of :mod:`hicache_jax.lowering` as a command (its
flags, its table, its JSON, exit status 1 when a check fails)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache_jax.lowering.catalogue import LLAMA3_8B_KV, PLATFORMS, programs
from hicache_jax.lowering.checks import check, format_table, report_json
from hicache_jax.spec import KVSpec, pattern_state

__all__ = ["add_parser", "lower_command"]


def add_parser(sub: Any) -> None:
    """The ``lower`` subcommand's flags (``hicache-jax lower``)."""
    p = sub.add_parser(
        "lower",
        help="lower every device program for TPU or CUDA here and "
        "check donation, raw bits, kernels, callbacks, bounds",
        description="Lower every device program for TPU or CUDA on a machine "
        "without either, and check it.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--platform", choices=PLATFORMS, required=True)
    p.add_argument(
        "--spec",
        help="KV page shape, e.g. layers=32,kv_heads=8,head_dim=128,"
        "dtype=bfloat16,page_size=16; missing keys: Llama-3-8B's",
    )
    p.add_argument(
        "--layer-pattern",
        help="local:full layers, repeating (e.g. 5:1: five sliding-window layers, one "
        "global; R3:F1: three recurrent layers, one global); --spec's layers are then the "
        "model's layers",
    )
    p.add_argument("--window", type=int, help="with --layer-pattern: the window, in tokens")
    p.add_argument("--chunk", type=int, help="with --layer-pattern: chunked attention's chunk")
    p.add_argument(
        "--state",
        help="with --layer-pattern Ra:Fb: each recurrent layer's state arrays, "
        "name:AxB[:dtype],... (default: a Qwen3-Next-like conv:3x8192,ssm:32x128x128)",
    )
    p.add_argument("--device-pages", type=int, default=2048, help="L1 pages (shapes only)")
    p.add_argument("--host-pages", type=int, help="L2 pages (default 4 x L1)")
    p.add_argument("--host-layout", choices=["layer_first", "page_first"], default="layer_first")
    p.add_argument(
        "--only",
        help="lower only programs whose name starts with one of these "
        "comma-separated prefixes (the bounds are still checked)",
    )
    p.add_argument("--no-engine", action="store_true", help="leave out the engine steps")
    p.add_argument("--json", metavar="PATH", help="write every program's verdict as JSON")
    p.set_defaults(func=lower_command)


def lower_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hicache-jax lower``: print the table; exit status 1 when a check fails."""
    try:
        spec = KVSpec.parse(args.spec, LLAMA3_8B_KV)
        if args.layer_pattern is not None:
            spec = KVSpec.from_pattern(
                args.layer_pattern,
                num_layers=spec.num_layers,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                dtype=spec.dtype,
                page_size=spec.page_size,
                window=args.window,
                chunk=args.chunk,
                mla=spec.mla,
                state=pattern_state(args.layer_pattern, args.state),
            )
        elif args.window is not None or args.chunk is not None or args.state is not None:
            raise ValueError("--window / --chunk / --state need --layer-pattern")
        pset = programs(
            spec,
            args.platform,
            device_pages=args.device_pages,
            host_pages=args.host_pages,
            host_layout=args.host_layout,
            engine=not args.no_engine,
        )
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"hicache-jax lower: error: {exc}\n")
    only = [o.strip() for o in args.only.split(",") if o.strip()] if args.only else None
    report = check(pset, only=only)
    print(format_table(report), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report_json(report), f, indent=1)
        print(f"wrote {args.json}")
    return 0 if report.ok else 1
