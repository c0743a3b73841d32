"""The model flags of the commands that take a KV layout without running a model (``lower``,
``size``): ``--spec`` (the page shape, Llama-3-8B's by default), ``--layer-pattern`` with
``--window`` / ``--chunk`` / ``--state``, and the ``KVSpec`` they give."""

from __future__ import annotations

import argparse
from typing import Any

from hicache_jax.lowering.catalogue import LLAMA3_8B_KV
from hicache_jax.spec import KVSpec, pattern_state

__all__ = ["add_spec_flags", "spec_from_flags"]


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    """``--spec``, ``--layer-pattern``, ``--window``, ``--chunk``, ``--state``."""
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


def spec_from_flags(args: Any) -> KVSpec:
    """The ``KVSpec`` of :func:`add_spec_flags`' flags.

    Raises:
        ValueError / TypeError: a bad shape or pattern (naming the flag), or ``--window`` /
            ``--chunk`` / ``--state`` without ``--layer-pattern``.
    """
    spec = KVSpec.parse(args.spec, LLAMA3_8B_KV)
    if args.layer_pattern is None:
        if args.window is not None or args.chunk is not None or args.state is not None:
            raise ValueError("--window / --chunk / --state need --layer-pattern")
        return spec
    return KVSpec.from_pattern(
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
