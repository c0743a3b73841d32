"""A second server on the same L3 store: what a hybrid (recurrent or sliding-window layers)
serves from L3 that another cache put there, beside the same model as all full-attention
layers (ARCHITECTURE.md, "Recurrent state" and "Layer groups").

Server A replays the first half of a Mooncake-format trace (default: benchmarks/data's
``mooncake_synthetic_1000``; ``--limit`` N: its first N requests) with a ``file://`` store,
write-through to L3; server B, a fresh cache on the same store, replays the second half, each
request prefetched from L3 (waited for) before it begins. Three rows, each with its own store:

- ``--layer-pattern R3:F1`` (default; a checkpoint of Qwen3-Next's size against its KV:
  :mod:`hicache_jax.replay.states`; checkpoints written as the replay writes them):
  **every checkpoint** (the cache: every checkpoint a backup carries is put, and B's lookups
  fetch up to the deepest one L3 holds); **node ends only** (the put rule before: spare
  checkpoints inside a node not put, reproduced by patching the L3 port's page list);
- a window pattern (``5:1``, ``--window`` 1024): **node ends only** (the default: the window
  pages a node end reads), **every k pages** for each ``k`` of ``--spare-every`` (default 4,
  8, 16: ``storage_window_spare=k``, the spare pages the ends at multiples of ``k`` pages
  read put too) and **storage_window_spare** (``True``: every spare window page put too);
- all three kinds (``R2:S1:F1``, ``--window``): **checkpoint ends** (the default,
  ``storage_window_spare=None``: every checkpoint, and the window pages the interior
  checkpoints' ends read), **node ends only** (``False``: every checkpoint, the window pages
  node ends read) and **storage_window_spare** (``True``);
- **all full**: the reference, every page boundary servable: the window pattern's model with
  every layer full attention (its bytes the windows save), or the recurrent hybrid's
  full-attention pages alone (its bytes what the checkpoints add to; with sliding-window
  layers too, those as full ones).

Printed: B's tokens served from L3 (``l3_prefetch_hit_pages`` x page size, over B's prompt
tokens) and B's hit ratio, each row over the reference, and the bytes A put to L3 over the
reference's (what each rule costs the store). L1 and L2 are large enough to hold
what they are given (the point is what L3 serves a cache that never saw the prompts).

Usage: ``python -m benchmarks.bench_state_l3 [TRACE] [--layer-pattern R3:F1|5:1|R2:S1:F1]
[--window W] [--spare-every 4,8,16] [--limit N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from benchmarks.common import print_table, write_json
from hicache_jax import HiCache, HiCacheConfig, KVSpec
from hicache_jax.cache import l3_port
from hicache_jax.memory.window import BRANCH_RANK, spare_rank
from hicache_jax.replay.states import Checkpoints, is_state_pattern, state_spec
from hicache_jax.replay.windows import pattern_kind, pattern_spec
from hicache_jax.study import load_trace

NAME = "bench_state_l3"
REFERENCE = "all full"


@contextlib.contextmanager
def _node_ends_only() -> Iterator[None]:
    """The put rule before: spare checkpoints (inside a node) are not put to L3."""
    cls = l3_port.WindowHostPages
    every = cls.pages

    def pages(self: Any, g: int, host_ids: np.ndarray) -> np.ndarray:
        stamp = self._host.spare[g, host_ids]
        skip = (stamp > 0) & (spare_rank(stamp) < BRANCH_RANK)
        return np.where(skip, -1, every(self, g, host_ids)).astype(np.int32)

    cls.pages = pages  # type: ignore[method-assign]
    try:
        yield
    finally:
        cls.pages = every  # type: ignore[method-assign]


def _serve(cache: HiCache, requests: list[Any], prefetch: bool) -> tuple[int, int]:
    """Replay ``requests`` one at a time (checkpoints written as the replay writes them);
    (prompt tokens, hit tokens)."""
    ps = cache.spec.page_size
    ckpt = Checkpoints(cache) if cache.spec.state_groups else None
    prompt = hit = 0
    for req in requests:
        tokens = req.tokens()
        tokens = tokens[: tokens.shape[0] // ps * ps]
        prompt += tokens.shape[0]
        if prefetch:
            h = cache.prefetch(tokens)
            if h is not None:
                h.wait()
        with cache.begin(tokens) as r:
            hit += r.cached_len
            r.extend(tokens.shape[0] - r.cached_len)
            if ckpt is not None:
                ckpt.write(r, tokens)
            cache.flush()
            r.finish(tokens)
        cache.flush()
    return prompt, hit


def run(trace: Any, spec: KVSpec, mode: str) -> dict[str, Any]:
    """Server A on the first half, server B (fresh, same store) on the second; ``mode``: a
    row's name ("node ends only" on a recurrent spec: the put rule before,
    "storage_window_spare": the config flag on)."""
    ps = spec.page_size
    half = len(trace.requests) // 2
    pages = sum(r.tokens().shape[0] // ps for r in trace.requests) + 64
    with tempfile.TemporaryDirectory() as root:
        cfg = HiCacheConfig(
            device_pages=pages,
            host_pages=pages,
            storage=f"file://{root}",
            write_through_threshold=1,
            prefetch_policy="wait_complete",
            state_device_slots=pages if spec.state_groups else None,
            state_host_slots=pages if spec.state_groups else None,
            storage_window_spare=_spare(mode),
        )
        recurrent_only = len(spec.state_groups) == len(spec.window_groups) > 0
        patch = mode == "node ends only" and recurrent_only
        ctx = _node_ends_only() if patch else contextlib.nullcontext()
        with ctx:
            a = HiCache(spec, cfg)
            _serve(a, trace.requests[:half], prefetch=False)
            a.flush()
            a.close()
            l3_bytes = _store_bytes(root, spec)
            b = HiCache(spec, cfg)
            prompt, hit = _serve(b, trace.requests[half:], prefetch=True)
            st = b.stats()
            b.close()
    return {
        "mode": mode,
        "prompt_tokens": prompt,
        "hit_ratio": hit / prompt if prompt else 0.0,
        "l3_ratio": st["l3_prefetch_hit_pages"] * ps / prompt if prompt else 0.0,
        "l3_unservable_pages": st.get("l3_window_unservable_pages", 0),
        # the bytes A put: full-attention pages, and the window / state groups' entries
        "l3_bytes": l3_bytes,
    }


def _spare(mode: str) -> bool | int | None:
    """A row's ``storage_window_spare``: True for "storage_window_spare", ``k`` for "every k
    pages", None for "checkpoint ends" (the default), else False."""
    if mode == "storage_window_spare":
        return True
    if mode == "checkpoint ends":
        return None
    words = mode.split()
    if len(words) == 3 and words[0] == "every" and words[2] == "pages":
        return int(words[1])
    return False


def _store_bytes(root: str, spec: KVSpec) -> int:
    """The bytes server A put, from the ``file://`` store's entries: each full-attention page's
    and each window or state group's entry (named by its group, ``w0``, ``w1``, ...)."""
    sizes = [g.spec(spec.page_size).page_bytes for g in spec.window_groups]
    total = 0
    for folder in os.listdir(root):
        if folder.startswith("."):
            continue
        for name in os.listdir(os.path.join(root, folder)):
            parts = name.split("_")
            total += sizes[int(parts[3][1:])] if len(parts) == 5 else spec.page_bytes
    return total


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", default="mooncake_synthetic_1000")
    p.add_argument("--layer-pattern", default="R3:F1", help="R3:F1, a window pattern, or R2:S1:F1")
    p.add_argument("--window", type=int, default=1024, help="a window pattern's window")
    p.add_argument(
        "--spare-every",
        default="4,8,16",
        help="a window pattern's storage_window_spare spacings in pages (powers of two)",
    )
    p.add_argument("--limit", type=int, default=None, help="first N requests (default: all)")
    p.add_argument("--json")
    a = p.parse_args(argv)
    trace = load_trace(a.trace, block_size=512, limit=a.limit)
    if is_state_pattern(a.layer_pattern):
        hybrid = state_spec(a.layer_pattern, 512)
        modes: tuple[str, ...] = ("every checkpoint", "node ends only")
        layers = hybrid.num_layers  # the reference: its full-attention pages alone
    elif pattern_kind(a.layer_pattern) == "mixed":
        hybrid = state_spec(a.layer_pattern, 512, window=a.window)
        modes = ("checkpoint ends", "node ends only", "storage_window_spare")
        # the reference: its attention layers' pages alone, every one of them full
        layers = hybrid.total_layers - sum(
            len(hybrid.window_groups[g].layers) for g in hybrid.state_groups
        )
    else:
        hybrid = pattern_spec(a.layer_pattern, a.window, 512)
        every = [int(k) for k in a.spare_every.split(",") if k.strip()]
        modes = ("node ends only", *(f"every {k} pages" for k in every), "storage_window_spare")
        layers = hybrid.total_layers  # the reference: every layer full attention
    # one full-attention group of ``layers`` layers, 8 bytes a token each
    full = KVSpec.from_pattern(
        "full", num_layers=layers, num_kv_heads=1, head_dim=1, dtype="float32", page_size=512
    )
    rows = [run(trace, hybrid, m) for m in modes] + [run(trace, full, REFERENCE)]
    ref = rows[-1]
    print(
        f"{trace.path}: {len(trace.requests)} requests, {a.layer_pattern} "
        f"({hybrid.describe_groups()}); server A the first half, server B (fresh, the same "
        "file:// store) the second, prefetching each prompt from L3"
    )
    print_table(
        ["put rule", "B from L3", "B hit ratio", "L3 / all full", "hit / all full",
         "L3 pages not fetched", "L3 bytes / all full"],
        [
            [
                r["mode"],
                f"{r['l3_ratio']:.4f}",
                f"{r['hit_ratio']:.4f}",
                f"{r['l3_ratio'] / ref['l3_ratio']:.3f}" if ref["l3_ratio"] else "-",
                f"{r['hit_ratio'] / ref['hit_ratio']:.3f}" if ref["hit_ratio"] else "-",
                r["l3_unservable_pages"],
                f"{r['l3_bytes'] / ref['l3_bytes']:.3f}" if ref["l3_bytes"] else "-",
            ]
            for r in rows
        ],
        title=f"a second server on the same L3 store ({a.layer_pattern}, 512-token pages)",
    )  # fmt: skip
    config = {"trace": a.trace, "limit": a.limit, "layer_pattern": a.layer_pattern}
    write_json(a.json, NAME, config, {"rows": rows})


if __name__ == "__main__":
    main()
