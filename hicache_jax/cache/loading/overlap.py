"""The two-ended split of a host chain (ARCHITECTURE.md, "Load or recompute"): its back copied
from host into the request's own device pages while the serving loop recomputes its front.

Under ``HiCacheConfig(load_policy="cost", load_overlap=True)`` :func:`Request.begin
<hicache_jax.cache.request.begin>` lets the cost rule weigh, for the host-only chain of
``h`` tokens after the device prefix of ``d``, a split at ``s``: recompute ``[d, d + s)`` while
``[d + s, d + h)`` is copied, time ``max(prefill(s | d), load(h - s)) + prefill(rest | d + h)``
(cache/loading/cost_model.py). Where the rule picks it, the chain is left as it is in the tree
(host-only: the load-back declined it) and :func:`start_overlap`:

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

Threading: the cache's thread only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_jax.cache.loading.load_many import host_chain_after
from hicache_jax.errors import OutOfPagesError

if TYPE_CHECKING:
    from hicache_jax.cache.hicache import HiCache
    from hicache_jax.cache.request import Request

__all__ = ["start_overlap", "wait_overlap"]


def start_overlap(cache: "HiCache", req: "Request", front: int) -> Any:
    """Take the request's pages for its host chain and dispatch the copy of its back (the
    chain's tokens from ``front`` on); the copy's transfer handle, or None where nothing was
    started (the chain changed, or no device pages: the request recomputes it all, as a
    declined load-back's). The request must hold its lock on the chain's last node."""
    ps = cache.spec.page_size
    chain = host_chain_after(req._node._node, set())
    host = (np.concatenate([n.host_value for n in chain]).astype(np.int32) if chain
            else np.zeros(0, np.int32))
    if host.size * ps != req.host_len_declined or not 0 < front < host.size * ps \
            or front % ps or req.num_tokens != req.cached_len:
        return None
    try:
        pages = cache.alloc_pages(host.size)
    except OutOfPagesError:
        return None
    lo = front // ps
    try:
        handle = cache.transfer_engine.load(host[lo:], pages[lo:])
    except BaseException:
        cache.free_pages(pages)
        raise
    model = cache._cost
    model.track([(None, (host.size - lo) * model.page_bytes)])  # its ack: an L2 -> L1 sample
    cache._n["overlap_loads"] += 1
    cache._n["overlap_load_tokens"] += (host.size - lo) * ps
    req._pages = np.concatenate([req._pages, pages]).astype(np.int32, copy=False)
    req._len = req.cached_len + host.size * ps
    req.overlap = (req.cached_len + front, req._len)
    return handle


def wait_overlap(cache: "HiCache", handle: Any) -> None:
    """Wait for the copy ``handle`` (and so every transfer before it) and acknowledge it."""
    if handle is not None and not cache.closed:
        cache._complete(upto=handle)
