"""Write policies of a HiCache (L1 -> L2 backups), one strategy object each, resolved once.

When: ``write_through`` backs a node up once its ``hit_count`` reaches the threshold, the
insert that creates it counting as its first access (as current SGLang counts it: threshold 1
backs up at insert, ``write_through_selective``'s 2 at the second access); L2 is then
inclusive of L1, and host copies are a continuous prefix from the root. ``write_back`` backs up
only what eviction takes, on the allocation path. ``clean_ahead`` (the default) does what an OS
page cache does with dirty pages, so that L1 + L2 behave like one cache of their summed size
without copies on the allocation path:

* at admission (:meth:`HiCache.prepare`, which ``begin`` / ``begin_many`` call before any of a
  request's pages are taken): what taking them will evict beyond the free pages, the
  requests' own matches excluded, is backed up now, so the allocations find it clean;
* after an ``insert``, once eviction is near (fewer free device pages than
  ``cfg.clean_ahead_pages``, by default twice the largest allocation that no admission
  announced, at most half of L1) and has taken a
  quarter of that reserve (or copied on its path, or, under strategies that evict new nodes
  first, a new leaf was inserted) since the last pass, the not-backed-up nodes among the first
  reserve pages that eviction would take (:func:`~hicache_jax.tree.eviction.eviction_order`) are
  backed up in one asynchronous transfer: eviction then finds them clean (what it still has to
  copy is counted in ``stats()["eviction_backup_pages"]``);
* when L2 is full, host copies of nodes still on device (loaded back, or cleaned then hit
  again) are what it gives up first, hottest first, never the window the last pass cleaned;
  host-only leaves go after them, least valuable first.

No continuous host prefix is kept under ``write_back`` or ``clean_ahead``.

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache_jax.cache.completion import Completion
from hicache_jax.cache.inflight import InFlight
from hicache_jax.cache.page_take import Tier, take_pages
from hicache_jax.cache.removal import Removal
from hicache_jax.events.recorder import NullRecorder, Recorder
from hicache_jax.events.records import Medium
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import HiCacheConfig, WritePolicy
from hicache_jax.tree.eviction import FRESH_FIRST, eviction_order, hottest_first, priority_key
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree


@dataclass(frozen=True)
class WriteContext:
    """What a write policy works with: the cache's parts (one cache, its thread)."""

    cfg: HiCacheConfig
    tree: RadixTree
    flight: InFlight
    counters: collections.Counter
    device_allocator: PageAllocator
    events: NullRecorder | Recorder
    host_allocator: PageAllocator
    removal: Removal  # deletes host-only leaves (the plain host room)
    complete: Completion  # waits for copies parked host pages are under
    l3: Any  # back_up_new: L3 write_through backs up new leaves


class WriteStrategy:
    """What every write policy shares: the reserve, claims, the plain host-room path. Its
    flags say when to back up (on hits, on eviction) and whether host copies must be a
    continuous prefix from the root."""

    backup_on_hit = False
    backup_on_evict = False
    continuous_prefix = False
    page_granular = False
    admission_pass = False  # before_admit needs the matched nodes (HiCache.prepare finds them)

    def __init__(self, ctx: WriteContext) -> None:
        self._ctx = ctx
        # read on every insert / unlock: bound once, not looked up through ctx each call
        self._cfg, self._dev, self._n = ctx.cfg, ctx.device_allocator, ctx.counters
        self._ps = ctx.tree.page_size
        self.largest_alloc = 0  # pages: clean_ahead's auto reserve follows it
        self.announced = 0  # pages the last admission announced, not yet allocated
        # Host eviction frees exactly the unlocked host-only nodes (and, under clean_ahead,
        # redundant host copies), and parked pages come free when their copies land, so a host
        # page request that cannot be met fails before deleting anything.
        self._host_tier = Tier(
            ctx.host_allocator,
            self.evict_host,
            lambda: self.host_evictable_pages() + ctx.flight.num_parked,
            False,
        )

    def take_host(self, n: int) -> np.ndarray:
        """``n`` host pages (int32 ids) for a backup or an L3 prefetch, evicting host pages in
        this policy's order as needed, else ``OutOfPagesError`` before evicting anything."""
        return take_pages(self._host_tier, n, self._ps, self._ctx.flight, self._ctx.complete)

    def granted(self, n_pages: int) -> None:
        """A device allocation of ``n_pages`` succeeded (one that raised changes nothing).
        The pages an admission announced (:meth:`before_admit`) are covered by its own pass:
        only what goes beyond them counts toward the reserve."""
        n_pages -= self.announced
        self.announced = max(0, -n_pages)
        if n_pages > self.largest_alloc:
            self.largest_alloc = n_pages

    def reserve_pages(self) -> int:
        """Pages the clean_ahead pass at unlock keeps backed up at the eviction end (see the
        config): twice the largest allocation no admission announced, at most half of L1."""
        cfg = self._cfg
        if cfg.clean_ahead_pages is not None:
            return cfg.clean_ahead_pages
        return min(2 * self.largest_alloc, cfg.device_pages // 2)

    def before_admit(self, need_pages: int, keep: list[TreeNode]) -> None:
        """Requests are about to take ``need_pages`` device pages (load-backs and uncached
        rest); ``keep``: their matched nodes (locked right after)."""
        self.announced = need_pages

    def claim(self, node: TreeNode) -> Any:
        return self._ctx.flight.claim_backup(node, self.continuous_prefix, self.take_host)

    def after_insert(self, res: Any, chunked: bool, in_request: bool) -> None:
        """An insert happened (``res``: the tree's InsertResult; ``in_request``: a caller lock
        is held)."""

    def after_unlock(self) -> None:
        """A request's end (its nodes are evictable again)."""

    def _backup_inserted(self, res: Any) -> None:
        """Backups an insert starts, in one transfer: write-through hits at the threshold
        (root-first), and the new leaf -- its creation is its first access -- or, with L3
        (``storage_write_policy="write_through"``, write-through and clean_ahead modes), so
        that computed pages go down to L3 now."""
        threshold, claims = self._cfg.write_through_threshold, []
        if self.backup_on_hit:
            claims = [
                self.claim(node) for node in res.existing_nodes if node.hit_count >= threshold
            ]
        last = res.last_node
        if (
            last.parent is not None
            and last not in res.existing_nodes
            and ((self.backup_on_hit and last.hit_count >= threshold) or self._ctx.l3.back_up_new)
        ):
            claims.append(self.claim(last))
        self._ctx.flight.dispatch_backups([c for c in claims if c is not None])

    # host room: the plain path deletes host-only leaves
    def evict_host(self, num_tokens: int) -> int:
        return self._ctx.removal.evict_host_leaves(num_tokens)

    def host_evictable_pages(self) -> int:
        return self._ctx.tree.host_evictable_tokens // self._ps


class WriteThrough(WriteStrategy):
    """Back up on hits (threshold); host copies a continuous prefix from the root."""

    backup_on_hit = True
    continuous_prefix = True

    def after_insert(self, res: Any, chunked: bool, in_request: bool) -> None:
        if not chunked:
            self._backup_inserted(res)


class WriteThroughSelective(WriteThrough):
    """Write-through at a threshold of hits (the config's ``write_through_threshold``)."""


class WriteBack(WriteStrategy):
    """Back up only what eviction takes; no continuous host prefix."""

    backup_on_evict = True


class CleanAhead(WriteBack):
    """Write-back, plus passes that back up the eviction end of L1 (see the module doc)."""

    page_granular = True
    admission_pass = True

    def __init__(self, ctx: WriteContext) -> None:
        super().__init__(ctx)
        self._key = priority_key(ctx.cfg.eviction)
        self._cold: tuple | None = None  # priority key of the last node the passes cleaned
        self._clean_mark = (0, 0, 0)  # (evicted, eviction-backup pages, fresh) at that pass
        self._fresh_tokens = 0  # tokens of new leaves (counted under FRESH_FIRST strategies)

    def after_insert(self, res: Any, chunked: bool, in_request: bool) -> None:
        if not chunked:
            self._backup_inserted(res)
        if self._cfg.eviction in FRESH_FIRST and res.last_node not in res.existing_nodes:
            self._fresh_tokens += res.last_node.num_tokens
        # Inside the request flow the pass runs at unlock, once this request's nodes are
        # evictable; an insert made outside it (no caller lock held) runs it here.
        if not chunked and not in_request:
            self.after_unlock()

    def after_unlock(self) -> None:
        if self._clean_due():
            self._clean(self.reserve_pages(), [], "clean_ahead_pages")
            n = self._n
            self._clean_mark = (n["evicted_tokens"], n["eviction_backup_pages"], self._fresh_tokens)

    def before_admit(self, need_pages: int, keep: list[TreeNode]) -> None:
        """The admission pass: back up what taking ``need_pages`` device pages will evict
        beyond the free ones (``keep``, the requests' matches, excluded), so that the
        allocations find it clean."""
        self.announced = need_pages
        short = need_pages - self._dev.num_free
        if short > 0:
            ahead = min(LOOK_AHEAD * need_pages, self._cfg.device_pages // 2)
            self._clean(short, keep, "admission_clean_pages", ahead)

    def _clean_due(self) -> bool:
        """A pass is due once eviction is near (fewer free device pages than the reserve) and,
        since the last, eviction has copied on its path or taken a quarter of the reserve, or
        (strategies that evict new nodes first) a new leaf was inserted."""
        reserve = self.reserve_pages()
        if self._dev.num_free >= reserve:
            return False
        n = self._n
        evicted, synced, fresh = self._clean_mark
        quarter = reserve * self._ps // 4
        return (
            self._cold is None
            or n["eviction_backup_pages"] > synced
            or n["evicted_tokens"] - evicted >= quarter
            or self._fresh_tokens > fresh
        )  # new pages went straight to the eviction end

    def _clean(self, pages: int, keep: list[TreeNode], counter: str, ahead: int = 0) -> None:
        """Back up the not-backed-up part of the first ``pages`` pages that eviction would take
        (one transfer; the last node trimmed to what is needed), so that eviction finds them
        clean; what eviction would take up to there is protected from host eviction. With
        ``ahead``, whole nodes of the next ``ahead`` pages ride in the same transfer where host
        room is free (:meth:`_take_spare`), outside the protected window."""
        ctx, tree = self._ctx, self._ctx.tree
        for node in keep:  # the requests' own matches: locked right after admission
            tree.lock(node)
        try:
            order = eviction_order(
                ctx.cfg.eviction, tree.evictable_device, (pages + ahead) * self._ps, tree.root
            )
        finally:
            for node in keep:
                tree.unlock(node)
        if not order:
            return
        order, extra = _cut(order, pages, ahead)
        over = sum(node.num_pages for node in order) - pages
        last = order[-1]
        if over > 0 and not last.backed_up and not last.host_pins and last.lock_ref == 0:
            tree.trim_tail(last, last.num_pages - over)  # its head stays dirty: not needed
        key = self._key(last)
        if self._cold is None or key > self._cold:
            self._cold = key
        # host room once for all of them (one round: fewer host-leaf rounds and splits)
        claims = ctx.flight.claim_backups(order, self.take_host)
        claims += ctx.flight.claim_spare(extra, self._take_spare)
        self._n[counter] += sum(node.num_pages for node, _ in claims)
        ctx.flight.dispatch_backups(claims)

    def _protected(self, node: TreeNode) -> bool:
        """A host copy eviction is about to use: its node is at or before the end the passes
        cleaned (a node split since shares its key)."""
        return self._cold is not None and self._key(node) <= self._cold

    def host_evictable_pages(self) -> int:
        tree = self._ctx.tree
        kept = sum(n.num_tokens for n in tree.redundant if self._protected(n))
        return (tree.host_evictable_tokens + tree.redundant_tokens - kept) // self._ps

    def evict_host(self, num_tokens: int) -> int:
        """Host room under clean_ahead: first give up host copies of nodes still on device,
        hottest first (not those the passes cleaned for eviction), then delete host-only
        leaves, least valuable first, only the pages needed of the last."""
        ctx, tree = self._ctx, self._ctx.tree
        freed = 0
        for node in hottest_first(
            ctx.cfg.eviction, [n for n in tree.redundant if not self._protected(n)]
        ):
            if freed >= num_tokens:
                break
            ids = tree.drop_host_value(node)
            ctx.flight.free_host(ids)  # parked while a backup into them is in flight
            ctx.events.removed(node, Medium.HOST, ids)  # ids: the node no longer holds them
            ctx.counters["host_copies_dropped_tokens"] += node.num_tokens
            freed += node.num_tokens
        if freed < num_tokens:
            freed += ctx.removal.evict_host_leaves(num_tokens - freed, True)
        return freed

    def _take_spare(self, n: int) -> np.ndarray | None:
        """``n`` free host pages for a backup ahead of need, or None: nothing in L2 (no host
        copy, no host-only node) is given up for a backup no admission needs yet."""
        alloc = self._ctx.host_allocator
        return alloc.alloc(n) if alloc.num_free >= n else None


#: The admission pass backs up, into free host pages, whole nodes of up to this many times
#: the admission's own pages beyond what it evicts (at most half of L1): the next admissions
#: then find them clean, one transfer serving several (``CleanAhead._clean``).
LOOK_AHEAD = 4


def _cut(order: list[TreeNode], pages: int, ahead: int) -> tuple[list, list]:
    """``order`` (eviction order over ``pages + ahead`` pages) split into the nodes that cover
    ``pages`` and the whole nodes of the next ``ahead`` pages after them."""
    got = taken = 0
    for node in order:
        got += node.num_pages
        taken += 1
        if got >= pages:
            break
    head, extra, room = order[:taken], [], pages + ahead - got
    for node in order[taken:]:
        if node.num_pages > room:
            break
        room -= node.num_pages
        extra.append(node)
    return head, extra


_STRATEGIES = {
    WritePolicy.WRITE_THROUGH: WriteThrough,
    WritePolicy.WRITE_THROUGH_SELECTIVE: WriteThroughSelective,
    WritePolicy.WRITE_BACK: WriteBack,
    WritePolicy.CLEAN_AHEAD: CleanAhead,
}


def make_write_policy(ctx: WriteContext) -> WriteStrategy:
    """The strategy of ``ctx.cfg.write_policy``; with no host pool (``host_pages=0``, a
    device-only radix cache) the plain strategy, which backs nothing up: every policy's claims
    would fail there, and clean_ahead would still sort the eviction end at every unlock."""
    if ctx.cfg.host_pages == 0:
        return WriteStrategy(ctx)
    policy = ctx.cfg.write_policy
    assert isinstance(policy, WritePolicy)  # parsed by HiCacheConfig
    return _STRATEGIES[policy](ctx)
