"""The one evict-and-retry path of a cache's tiers: free pages, else evict the shortfall once,
else raise :class:`~hicache_jax.errors.OutOfPagesError` -- before evicting anything when even
full eviction could not cover the request, so a call that raises leaves the cache as it was.

Both tiers take pages here: the device tier for callers and load-backs
(:class:`~hicache_jax.cache.evictor.Evictor`), the host tier for backups and L3 prefetches
(the write policy's :meth:`~hicache_jax.cache.write_policy.WriteStrategy.take_host`).

Threading: the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hicache_jax.cache.completion import Completion
from hicache_jax.cache.inflight import InFlight
from hicache_jax.errors import OutOfPagesError
from hicache_jax.memory.allocator import PageAllocator


@dataclass(frozen=True)
class Tier:
    """What the evict-and-retry path needs of one tier.

    Attributes:
        allocator: the tier's pool allocator.
        evict: tokens -> tokens freed (the tier's eviction, in its policy's order).
        evictable_pages: an upper bound of the pages eviction could free now.
        waits_for_locks: finishing loads in flight can free more (their locks) -- the device;
            otherwise host pages parked under copies in flight come free when they land.
    """

    allocator: PageAllocator
    evict: Callable[[int], int]
    evictable_pages: Callable[[], int]
    waits_for_locks: bool


def take_pages(
    tier: Tier, n: int, page_size: int, flight: InFlight, complete: Completion
) -> np.ndarray:
    """``n`` page ids of ``tier`` (int32), evicting as needed.

    Raises:
        OutOfPagesError: not enough free + evictable pages (``needed``, ``free``,
            ``evictable``, ``locked`` say why), before evicting anything.
    """
    alloc = tier.allocator
    if n <= alloc.num_free:  # the common case: no eviction bound to compute
        return alloc.alloc(n)
    if tier.waits_for_locks and len(flight) and n > alloc.num_free + tier.evictable_pages():
        complete.drain()  # loads in flight hold locks; their acknowledgements release them
    short = n - alloc.num_free
    if short > 0 and short <= tier.evictable_pages():
        tier.evict(short * page_size)
    if n > alloc.num_free and not tier.waits_for_locks and flight.num_parked:
        complete.drain()  # host pages parked under copies in flight
    if n > alloc.num_free:
        evictable = tier.evictable_pages()
        raise OutOfPagesError(
            f"{alloc.name} pool: {n} pages needed, {alloc.num_free} free, {evictable} "
            "evictable: unlock finished requests or free caller pages",
            needed=n,
            free=alloc.num_free,
            evictable=evictable,
            locked=alloc.num_used - evictable,
        )
    return alloc.alloc(n)
