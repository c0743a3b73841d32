"""``hicache-jax size``: a model's pools for L1 and L2 bytes (:func:`hicache_jax.size_pools`:
full-attention pages, each window group's pages, each recurrent group's state slots), the
tokens of prefix they hold beside the all-full model's pages of the same bytes, and the
``HiCacheConfig`` fields that build them."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from typing import Any

from hicache_jax.cli.output import write_json
from hicache_jax.cli.spec_flags import add_spec_flags, spec_from_flags
from hicache_jax.sizing import PoolSizes, default_host_bytes, size_pools
from hicache_jax.spec import KVSpec, WritePolicy

__all__ = ["add_parser", "parse_bytes", "size_command"]

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_BYTES = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-z]*)\s*")


def add_parser(sub: Any) -> None:
    """The ``size`` subcommand's flags (``hicache-jax size``)."""
    p = sub.add_parser(
        "size",
        help="split L1 / L2 bytes between a model's pools (full-attention pages, window "
        "pages, state slots)",
        description="Split L1 and L2 bytes between a model's pools by the cache's default rule "
        "and print the HiCacheConfig fields that build them.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_spec_flags(p)
    p.add_argument(
        "--device-bytes", required=True, help="L1 bytes, e.g. 40GiB, 512MiB, 4e10 (all devices)"
    )
    p.add_argument("--host-bytes", help="L2 bytes (default 4 x L1; 0: no L2)")
    p.add_argument(
        "--longest-prompt",
        type=int,
        help="the most tokens one request holds (needed with window or recurrent layers)",
    )
    p.add_argument(
        "--mean-prompt", type=int, help="the mean prompt, in tokens (needed with them too)"
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help="with recurrent layers: interior checkpoints every this many pages "
        "(default: the cache's)",
    )
    p.add_argument(
        "--working-set",
        type=int,
        metavar="TOKENS",
        help="with window layers: the distinct tokens the workload comes back to; no "
        "full-attention pool holds more (the bytes past it in window pages)",
    )
    p.add_argument(
        "--write-policy",
        choices=[w.value for w in WritePolicy],
        help="with --working-set: the write policy the cache runs (the two tiers are capped "
        "together under clean_ahead and write_back; default: the cache's)",
    )
    p.add_argument(
        "--write-through-threshold",
        type=int,
        metavar="N",
        help="with --working-set: the cache's write_through_threshold (default: the write "
        "policy's; above 1, L2 does not copy every page L1 evicts)",
    )
    p.add_argument("--json", metavar="PATH", help="write the pools as JSON")
    p.set_defaults(func=size_command)


def parse_bytes(text: str, flag: str) -> int:
    """``text`` as bytes: a number with an optional unit (B, KB/MB/GB/TB: powers of 10;
    KiB/MiB/GiB/TiB: of 2; case-insensitive), rounded down.

    Raises:
        ValueError: naming ``flag``.
    """
    m = _BYTES.fullmatch(str(text).lower())
    if m is None or m[2] not in _UNITS:
        raise ValueError(
            f"{flag} {text!r} must be a number of bytes with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = float(m[1]) * _UNITS[m[2]]
    if not math.isfinite(value):
        raise ValueError(f"{flag} {text!r} is not a finite number of bytes")
    return int(value)


def size_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """``hicache-jax size``: print the pools; exit status 2 on a bad flag or budget."""
    try:
        spec = spec_from_flags(args)
        device = parse_bytes(args.device_bytes, "--device-bytes")
        host = None if args.host_bytes is None else parse_bytes(args.host_bytes, "--host-bytes")
        sizes = size_pools(
            spec,
            device,
            host,
            longest_prompt_tokens=args.longest_prompt,
            mean_prompt_tokens=args.mean_prompt,
            checkpoint_every_pages=args.checkpoint_every,
            working_set_tokens=args.working_set,
            write_policy=args.write_policy,
            write_through_threshold=args.write_through_threshold,
        )
    except (ValueError, TypeError) as exc:
        parser.exit(2, f"hicache-jax size: error: {exc}\n")
    budgets = (device, default_host_bytes(device) if host is None else host)
    print(format_sizes(spec, sizes, budgets), flush=True)
    if args.json:
        write_json(args.json, {"spec": spec.describe_groups(), **dataclasses.asdict(sizes)})
    return 0


def format_sizes(spec: KVSpec, sizes: PoolSizes, budgets: tuple[int, int]) -> str:
    """The table of :func:`size_command`: per tier, the pools, the bytes they take, the prefix
    tokens their full-attention pages hold and the all-full model's tokens at the same bytes
    (every attention layer keeping every token; a recurrent layer adds none)."""
    ps, model = spec.page_size, spec.model_page_bytes
    head = ["tier", "budget", "full pages", "window pages", "state slots", "bytes used",
            "tokens held", "all-full tokens", "x"]  # fmt: skip
    rows = [head]
    tiers = (
        ("L1", budgets[0], sizes.device_pages, sizes.window_device_pages,
         sizes.state_device_slots, sizes.device_bytes),
        ("L2", budgets[1], sizes.host_pages, sizes.window_host_pages,
         sizes.state_host_slots, sizes.host_bytes),
    )  # fmt: skip
    for name, budget, pages, windows, slots, used in tiers:
        held, full = pages * ps, budget // model * ps
        rows.append([
            name, f"{budget:,}", f"{pages:,}", "-" if windows is None else f"{windows:,}",
            "-" if slots is None else f"{slots:,}", f"{used:,}", f"{held:,}", f"{full:,}",
            f"{held / full:.2f}" if full else "-",
        ])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    groups = (
        spec.describe_groups()
        if spec.groups
        else (f"{spec.num_layers} full layers: {spec.num_kv_heads}x{spec.head_dim} {spec.dtype}")
    )
    lines = [f"{groups}; page {ps} tokens"]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    fields = {k: getattr(v, "value", v) for k, v in sizes.config_fields().items()}
    given = ", ".join(f"{k}={v!r}" for k, v in fields.items() if v is not None)
    lines.append(f"HiCacheConfig({given})")
    return "\n".join(lines)
