"""Where a prefix lives, without touching the cache (ARCHITECTURE.md, "Control API").

:func:`lookup` reads the radix tree through its read-only descent: no node is split, no
``last_access`` stamped, no hit counted, no load-back or prefetch started.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from hicache_jax.cache.windows import Windows
from hicache_jax.tree.radix import RadixTree
from hicache_jax.validation import page_tokens


def lookup(
    tree: RadixTree,
    tokens: Any,
    extra_key: Hashable,
    page_size: int,
    l3: Any = None,
    windows: Windows | None = None,
) -> dict[str, int]:
    """Tokens of the longest cached whole-page prefix held per tier.

    Args:
        l3: the cache's L3 tier, to ask the store too (None: L1 and L2 only).
        windows: the cache's layer-group rules (with window or state groups): the figures
            are then those of the longest servable prefix, as ``match_prefix`` cuts it.

    Returns:
        ``{"device": n, "host": m}``: ``device`` tokens on device from the start (device
        residency is prefix-closed), then ``host`` further tokens on host only; the same
        figures :meth:`HiCache.match_prefix` would report, without its side effects. With
        ``l3``, also ``"l3"``: further tokens the store holds after those (one batched
        ``exists`` of the pages beyond L1 + L2; 0 without storage), nothing fetched or counted.

    Raises:
        TypeError / ValueError: bad ``tokens`` or ``extra_key`` (as ``match_prefix``).
    """
    arr = page_tokens(tokens, extra_key, page_size)
    if windows is None:
        device, host = tree.peek(arr, extra_key)
    else:  # only a servable prefix is a hit (window pages, checkpoints held)
        device, host = windows.servable_peek(tree.peek_path(arr, extra_key))
    if l3 is None:
        return {"device": device, "host": host}
    return {"device": device, "host": host, "l3": l3.held_beyond(arr, extra_key, device + host)}
