"""The ``hicache-jax`` commands (bench, replay, lower, size, compare): one parser, and the
dispatch.

Each command owns its flags and its run: ``bench`` (:mod:`hicache_jax.cli.bench`), ``replay``
(:mod:`hicache_jax.cli.replay`), ``lower`` (:mod:`hicache_jax.cli.lower`), ``size``
(:mod:`hicache_jax.cli.size`), ``compare`` (:mod:`hicache_jax.cli.compare`). :func:`main` is
the console script ``hicache-jax`` and ``python -m hicache_jax``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hicache_jax.cli import bench, compare, lower, replay, size

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-jax", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    bench.add_parser(sub)
    replay.add_parser(sub)
    lower.add_parser(sub)
    size.add_parser(sub)
    compare.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (``hicache-jax``, ``python -m hicache_jax``)."""
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what --processes relaunches
    return args.func(args, parser)
