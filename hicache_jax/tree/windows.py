"""What a continuation reads of each window group, and the longest prefix it can be served
from (pure numpy, no jax).

A model's KV is a set of layer groups (``KVSpec.groups``): the full-attention group's pages are
the tree's pages (``TreeNode.value`` / ``host_value``); each window group (sliding window of
``W`` tokens, or chunked local attention) keeps pages of its own, attached to those pages on
each tier (:mod:`hicache_jax.memory.window`). A request that continues a prefix of ``n``
tokens reads, of a window group, only the tokens ``[group.need_start(n), n)``; so:

- a prefix of ``n`` tokens (a page multiple) is **servable** when, for every window group,
  every page overlapping ``[need_start(n), n)`` holds that group's page on the tier that serves
  it (:func:`servable_pages`);
- a node of the tree keeps a window group's pages only for the pages a continuation at its own
  end reads (:func:`kept_first_page`): the continuation at any deeper node end reads fewer of
  its pages (``need_start`` does not decrease), so no other node end needs more of them.

ARCHITECTURE.md, "Layer groups", states the rules these functions serve.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hicache_jax.spec import GroupKind, LayerGroup

__all__ = ["kept_first_page", "servable_pages"]


def kept_first_page(group: LayerGroup, end_tokens: int, page_size: int) -> int:
    """The first page (index from the root) that a continuation at ``end_tokens`` reads of
    ``group``: pages before it are never read again through this end. A ``STATE`` group's
    continuation reads the state slot of the page ending at ``end_tokens`` alone (the
    checkpoint there)."""
    if group.kind is GroupKind.STATE:
        return max(0, end_tokens // page_size - 1)
    return group.need_start(end_tokens) // page_size


def servable_pages(
    held: np.ndarray, groups: Sequence[LayerGroup], page_size: int, limit: int
) -> int:
    """The longest servable prefix, in pages, of at most ``limit`` pages.

    Args:
        held: bool ``[len(groups), n]`` (``n >= limit``): whether page ``i`` of the prefix
            holds group ``g``'s page on the tier that serves page ``i``.
        groups: the window groups, in ``held``'s order.
        page_size: tokens per page.
        limit: pages matched (the full-attention pages held on some tier).

    Returns:
        The largest ``k <= limit`` such that every group holds every page a continuation at
        ``k`` pages reads (a ``STATE`` group: the slot of page ``k - 1``, the checkpoint at
        ``k``); 0 always qualifies. Each step skips below the deepest missing page it found
        (a ``STATE`` group: to its previous checkpoint), so the cost is one slice per group
        per missing page met.
    """
    k = limit
    if (
        k > 0
        and all(  # the common case: every page the end reads is held
            held[g, kept_first_page(group, k * page_size, page_size) : k].all()
            for g, group in enumerate(groups)
        )
    ):
        return k
    while k > 0:
        nxt = k
        for g, group in enumerate(groups):
            if group.kind is GroupKind.STATE:
                if not held[g, k - 1]:  # the previous checkpoint's end
                    at = np.flatnonzero(held[g, : k - 1])
                    nxt = min(nxt, int(at[-1]) + 1 if at.size else 0)
                continue
            first = kept_first_page(group, k * page_size, page_size)
            missing = np.flatnonzero(~held[g, first:k])
            if missing.size:  # any servable end is at or before the missing page
                nxt = min(nxt, first + int(missing[-1]))
        if nxt == k:
            return k
        k = nxt
    return 0
