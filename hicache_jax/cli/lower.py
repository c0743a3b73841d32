"""``hicache-jax lower``: the lowering checks of :mod:`hicache_jax.lowering` as a command (its
flags, its table, its JSON, exit status 1 when a check fails)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from hicache_jax.cli.spec_flags import add_spec_flags, spec_from_flags
from hicache_jax.lowering.catalogue import PLATFORMS, programs
from hicache_jax.lowering.checks import check, format_table, report_json

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
    add_spec_flags(p)
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
        spec = spec_from_flags(args)
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
