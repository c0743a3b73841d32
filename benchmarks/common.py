"""Shared helpers of the benchmark scripts: timing, the memcpy limit, environment record, tables,
the reference decoder's size flags.

Every benchmark prints its figure beside the limit it is judged against, as a ratio measured in
the same run, and writes the raw figures as JSON with :func:`env_info` so tables from a CPU, a GPU
and a TPU can be put side by side.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np


def env_info() -> dict[str, Any]:
    """Backend, device kind and count, versions, date: recorded in every JSON."""
    import jax
    import jaxlib

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
    }


def median_time(
    fn: Callable[[], Any],
    *,
    repeats: int = 7,
    warmup: int = 1,
    setup: Callable[[], Any] | None = None,
) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` runs (``setup()`` untimed before each).

    ``fn`` must block until its work is done (call ``block_until_ready`` inside it).
    """
    for _ in range(warmup):
        if setup is not None:
            setup()
        fn()
    times = []
    for _ in range(repeats):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def aligned_bytes(nbytes: int, align: int = 4096) -> np.ndarray:
    """A zeroed (so already faulted in) ``uint8[nbytes]`` starting on an ``align`` boundary."""
    raw = np.zeros(nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start : start + nbytes]


def memcpy_fn(nbytes: int) -> Callable[[], None]:
    """``numpy.copyto`` of ``nbytes`` contiguous bytes between two page-aligned buffers.

    Both page-aligned on purpose: with numpy's default (malloc) placement the destination can
    start a few bytes after the source modulo 4 KiB, and then glibc's copy of 128-256 KiB ran
    ~10x slower on this machine (155 vs 15 us for 256 KiB, 4K aliasing), which made the limit
    of small rows look 10x easier than it is.
    """
    src = aligned_bytes(nbytes)
    src[:] = np.random.default_rng(0).integers(0, 255, size=nbytes, dtype=np.uint8)
    dst = aligned_bytes(nbytes)
    return lambda: np.copyto(dst, src)


def memcpy_seconds(nbytes: int, *, repeats: int = 7) -> float:
    """Median seconds of ``numpy.copyto`` of ``nbytes`` contiguous bytes (the CPU limit)."""
    return median_time(memcpy_fn(nbytes), repeats=repeats, warmup=2)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def add_model_flags(p: argparse.ArgumentParser, *, dtype: bool = True) -> None:
    """The reference decoder's size flags (defaults: the engine's default model)."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--ffn-dim", type=int, default=768)
    if dtype:
        p.add_argument("--dtype", default="float32")
    p.add_argument("--vocab", type=int, default=512)


def parse_quick(
    p: argparse.ArgumentParser, argv: Sequence[str] | None, quick: dict
) -> argparse.Namespace:
    """Add ``--json`` and ``--quick`` to ``p`` and parse ``argv``; with ``--quick`` the flags'
    defaults become ``quick`` (flags given on the command line still win)."""
    p.add_argument("--json", help="write the figures as JSON")
    p.add_argument("--quick", action="store_true", help="small sizes (QUICK); given flags win")
    args = p.parse_args(argv)
    if args.quick:
        p.set_defaults(**quick)
        args = p.parse_args(argv)
    return args


def model_config(a: argparse.Namespace) -> Any:
    """The ``ModelConfig`` of :func:`add_model_flags`' flags (float32 without ``--dtype``)."""
    from hicache_jax.engine.weights import ModelConfig

    return ModelConfig(
        num_layers=a.layers,
        d_model=a.d_model,
        num_heads=a.heads,
        num_kv_heads=a.kv_heads,
        head_dim=a.head_dim,
        ffn_dim=a.ffn_dim,
        vocab_size=a.vocab,
        dtype=getattr(a, "dtype", "float32"),
    )


def print_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], title: str | None = None
) -> str:
    """Print (and return) a plain-text table; floats get 3 significant digits."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    body = [[fmt(v) for v in r] for r in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)
    ]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def write_json(
    path: str | None,
    name: str,
    config: dict[str, Any],
    results: Any,
    figures: list[dict[str, Any]] | None = None,
) -> None:
    """Write ``{"benchmark", "env", "config", "results"}`` to ``path`` (skip when None), with
    ``figures`` (``hicache_jax.cli.results.figure``: each figure beside its limit) when given:
    ``hicache-jax compare`` reads those; without them it maps ``results`` by an adapter of
    ``hicache_jax/cli/results.py`` or every number of it, without a limit."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    doc = {"benchmark": name, "env": env_info(), "config": config, "results": results}
    if figures is not None:
        doc["figures"] = figures
    with open(path, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    print(f"wrote {path}")
