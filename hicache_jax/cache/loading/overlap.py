"""The two-ended split of a host chain (ARCHITECTURE.md, "Load or recompute"): its back copied
from host into the request's own device pages while the serving loop recomputes its front.

Under ``HiCacheConfig(load_policy="cost", load_overlap=True)`` ``HiCache.begin`` lets the cost
rule weigh, for the host-only chain of
``h`` tokens after the device prefix of ``d``, a split at ``s``: recompute ``[d, d + s)`` while
``[d + s, d + h)`` is copied, time ``max(prefill(s | d), load(h - s)) + prefill(rest | d + h)``
(cache/loading/cost_model.py). Where the rule picks it, the chain is left as it is in the tree
(host-only: the load-back declined it) and :meth:`Overlap.start`:

* allocates the request's pages for all of ``[d, d + h)`` (``HiCache.alloc_pages``: pages the
  caller owns, as those it prefills into), and dispatches ONE copy of the back's host pages into
  its last ``(h - s) / page_size`` of them (no tree op: the copy changes no node);
* the request's lock (taken before) keeps the chain's host pages from host eviction, and the
  transfer engine marks them busy until the copy is acknowledged;
* the copy's bytes are tracked by the cost model (no decision record: the load and the prefill
  overlap, which the record's load + prefill does not describe; ``cost_splits`` counts them)
  and its acknowledgement is an L2 -> L1 sample, as a load-back's.

The request then holds the chain's positions as its own pages (``num_tokens`` = ``d + h``);
``Request.overlap`` is ``(d + s, d + h)``. The serving loop prefills ``[d, d + s)``, calls
``Request.wait_overlap()``, prefills from ``d + h``. At ``finish`` the tree's insert gives the
host-only nodes these pages as their device values (its revived nodes, as for a partial load's
recomputed rest). An abort or finish waits for the copy before the pages are freed.

This module owns the split's execution: :class:`Overlap`, the part that starts the copy, and
:class:`OverlapCopy`, the copy in flight that the request handle holds until it waits for it.

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np

from hicache_jax.cache.completion import Completion
from hicache_jax.cache.loading.cost_model import CostModel
from hicache_jax.cache.loading.load_many import host_chain_after
from hicache_jax.errors import OutOfPagesError
from hicache_jax.memory.transfer import TransferEngine, TransferHandle
from hicache_jax.tree.node import TreeNode

__all__ = ["Overlap", "OverlapCopy"]


class OverlapCopy:
    """The back of a two-ended split in flight, held by the request's handle until it waits.

    Attributes:
        pages: int32 the request's own device pages for all of the chain, root first (the
            back's copy writes the last of them).
        span: ``(start, end)`` tokens of the request being copied (``Request.overlap``);
            ``end`` is the chain's end.
    """

    __slots__ = ("pages", "span", "_handle", "_complete")

    def __init__(
        self, pages: np.ndarray, span: tuple[int, int], handle: TransferHandle, complete: Completion
    ) -> None:
        self.pages, self.span, self._handle, self._complete = pages, span, handle, complete

    def wait(self) -> None:
        """Wait for the copy (and so every transfer before it) and acknowledge it."""
        self._complete(upto=self._handle)


class Overlap:
    """Starts two-ended splits of one cache (see the module docstring).

    Args:
        page_size: tokens per page.
        engine: the cache's transfer engine (the copy).
        cost: the cost model (tracks the copy's bytes: its acknowledgement is an L2 -> L1
            sample).
        counters: the cache's counters (``overlap_loads``, ``overlap_load_tokens``).
        complete: applies finished transfers (a copy's wait).
    """

    def __init__(
        self,
        page_size: int,
        engine: TransferEngine,
        cost: CostModel,
        counters: collections.Counter,
        complete: Completion,
    ) -> None:
        self._ps, self._engine, self._cost = page_size, engine, cost
        self._n, self._complete = counters, complete

    def start(
        self,
        node: TreeNode,
        front: int,
        cached_len: int,
        declined: int,
        alloc: Callable[[int], np.ndarray],
        free: Callable[[np.ndarray], None],
    ) -> OverlapCopy | None:
        """Take the request's pages for the host chain ending at ``node`` and dispatch the copy
        of its back (the chain's tokens from ``front`` on); None where nothing was started
        (the chain changed, or no device pages: the request recomputes it all, as a declined
        load-back's). The request must hold its lock on ``node``.

        Args:
            node: the request's locked node (its host-only chain's last).
            front: the split's front, tokens after ``cached_len``.
            cached_len: the request's tokens on device at admission.
            declined: the request's host-only tokens the load-back declined.
            alloc, free: the cache's caller page calls (``alloc_pages``, ``free_pages``): the
                pages are the request's own, as those it prefills into.
        """
        ps = self._ps
        chain = host_chain_after(node, set())
        host = (
            np.concatenate([n.host_value for n in chain]).astype(np.int32)
            if chain
            else np.zeros(0, np.int32)
        )
        if host.size * ps != declined or not 0 < front < host.size * ps or front % ps:
            return None
        try:
            pages = alloc(host.size)
        except OutOfPagesError:
            return None
        lo = front // ps
        try:
            handle = self._engine.load(host[lo:], pages[lo:])
        except BaseException:
            free(pages)
            raise
        model = self._cost
        model.track([(None, model.load_nbytes(host.size - lo))])  # its ack: an L2 -> L1 sample
        self._n["overlap_loads"] += 1
        self._n["overlap_load_tokens"] += (host.size - lo) * ps
        end = cached_len + host.size * ps
        return OverlapCopy(pages, (cached_len + front, end), handle, self._complete)
