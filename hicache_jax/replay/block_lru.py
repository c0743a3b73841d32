"""Exact LRU references for replay, independent of the radix tree (pure Python + numpy).

:class:`BlockLRU` is a cache of ``C`` whole pages keyed by the prefix up to and including the
page (:class:`PageKeys`). A request hits its longest run of leading pages present; then all
its whole pages are touched deepest-first, so a prefix's ancestors are always more recent than
its descendants and the LRU evicts leaf-most pages as the radix tree must; pages beyond ``C``
are evicted least recent first. Infinite capacity gives the infinite-cache hit figure. Hits
count whole pages only.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from hicache_jax.replay.trace import Trace


class PageKeys:
    """Names every whole page by its prefix: page ``i`` of a prompt gets the id of (id of page
    ``i - 1``, 16-byte blake2b of page ``i``'s tokens), ids handed out in order of first sight."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ids: dict[tuple[int, bytes], int] = {}

    def __call__(self, tokens: np.ndarray) -> list[int]:
        ps, ids = self.page_size, self._ids
        n = tokens.shape[0] // ps
        data, step = np.ascontiguousarray(tokens[: n * ps], dtype="<i8").tobytes(), ps * 8
        parent, out = -1, []
        for start in range(0, n * step, step):  # one digest per page, not per token
            key = (parent, hashlib.blake2b(data[start : start + step], digest_size=16).digest())
            parent = ids.setdefault(key, len(ids))
            out.append(parent)
        return out

    def __len__(self) -> int:
        """Distinct pages seen (what an infinite cache ends up holding)."""
        return len(self._ids)


class BlockLRU:
    """Exact LRU of ``capacity`` whole pages (None: infinite) over prefix-keyed pages."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()

    def serve(self, keys: Sequence[int]) -> int:
        """Serve one prompt's page keys (root first); returns the pages hit."""
        pages = self._pages
        hit = 0
        for k in keys:
            if k not in pages:
                break
            hit += 1
        for k in reversed(keys):  # deepest first: ancestors end up more recent
            if k in pages:
                pages.move_to_end(k)
            else:
                pages[k] = None
        if self.capacity is not None:
            while len(pages) > self.capacity:
                pages.popitem(last=False)
        return hit

    def __len__(self) -> int:
        return len(self._pages)


def distinct_pages(trace: Trace, page_size: int) -> int:
    """The trace's distinct whole pages (what an infinite cache would end up holding)."""
    keys_of = PageKeys(page_size)
    for req in trace.requests:
        keys_of(req.tokens())
    return len(keys_of)


def default_device_pages(trace: Trace, page_size: int) -> int:
    """An L1 of 1/8 of the trace's distinct whole pages (what an infinite cache would end up
    holding), but at least the longest prompt's pages."""
    longest = max(r.num_tokens for r in trace.requests) // page_size
    return max(distinct_pages(trace, page_size) // 8, longest, 1)


def reference_hits(
    trace: Trace, page_size: int, capacities: Iterable[int | None]
) -> tuple[dict[int | None, int], int]:
    """Hit tokens of a :class:`BlockLRU` of each capacity (pages; None: infinite) over the
    trace, and the distinct pages of the trace."""
    lrus = {c: BlockLRU(c) for c in set(capacities)}
    hits = dict.fromkeys(lrus, 0)
    keys_of = PageKeys(page_size)
    for req in trace.requests:
        keys = keys_of(req.tokens())
        for c, lru in lrus.items():
            hits[c] += lru.serve(keys) * page_size
    return hits, len(keys_of)
