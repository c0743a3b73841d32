"""The window groups' pages of one tier, attached to the full-attention pages (numpy, no jax).

A spec with window groups (``KVSpec.window_groups``: sliding-window or chunked-attention
layers) keeps each group's pages in a pool of its own per tier (a ``DevicePagePool`` or a
``HostPagePool`` of the group's ``LayerGroup.spec``), and :class:`WindowPages` says which of
those pages belongs to which full-attention page of the tier: ``attach[g, page]`` is the group
``g`` page holding the same tokens as full-attention page ``page``, or -1 where that group's KV
is not kept (ARCHITECTURE.md, "Layer groups"). So the tree, the allocators, the eviction and
the write policies keep working in full-attention pages, and a window group's page follows its
full-attention page: freed with it (the full-attention allocator's ``on_free`` hook), copied
with it by the transfer engine, dropped alone where no continuation reads it any more.

Threading: the cache's thread only, like the allocators.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import LayerGroup

__all__ = ["BRANCH_RANK", "RANK_SHIFT", "WindowPages", "read_by_node_end", "spare_rank"]

#: A spare page's stamp is ``rank << RANK_SHIFT`` plus the count of markings so far.
RANK_SHIFT = 40
#: The rank of a checkpoint at the end of a node with children (a branch point): above
#: every interior one (cache/windows.py, ``checkpoint_ranks``).
BRANCH_RANK = 63


def spare_rank(stamps: np.ndarray) -> np.ndarray:
    """The ranks of spare stamps (``WindowPages.spare`` values > 0)."""
    return stamps >> RANK_SHIFT


def read_by_node_end(stamps: np.ndarray) -> np.ndarray:
    """Which of ``stamps`` (``WindowPages.spare`` values) mark pages a node end reads: not
    spare, or a checkpoint at a branch point (spare of :data:`BRANCH_RANK`)."""
    return (stamps == 0) | (spare_rank(stamps) >= BRANCH_RANK)


class WindowPages:
    """The window groups' pages of one tier.

    Args:
        groups: the spec's window groups (``KVSpec.window_groups``).
        pools: one page pool per group, of ``group.spec(page_size)``: ``DevicePagePool`` on
            the device tier, ``HostPagePool`` on the host tier.
        anchor: the tier's full-attention allocator. Its ``on_free`` is set here: a page freed
            there frees the group pages attached to it first.
        name: the tier, in errors ("device", "host").

    Attributes:
        attach: int32 ``[len(groups), anchor.num_pages]``: group page of each full-attention
            page, -1 where none.
        spare: int64 ``[len(groups), anchor.num_pages]``: > 0 where the attached group page is
            spare (no node end of the tree reads it: kept only while its pool has room, freed
            first, lowest stamp first: rank, then age, when a group page is needed), else 0.
        worth: float64 ``[len(groups), anchor.num_pages]`` once :meth:`value_groups` named
            groups (else None): a valued group's spare pages go by this worth alone (lowest
            first) instead of rank and age (the ``value`` eviction's checkpoints:
            cache/windows.py).
        worth_floor: the highest worth of a valued group's spare page freed to make room
            (GreedyDual's clock for them).
    """

    def __init__(
        self,
        groups: Sequence[LayerGroup],
        pools: Sequence[Any],
        anchor: PageAllocator,
        name: str,
    ) -> None:
        if len(groups) != len(pools) or not groups:
            raise ValueError(f"{len(groups)} window groups, {len(pools)} pools: one pool a group")
        self.groups = tuple(groups)
        self.pools = tuple(pools)
        self.name = name
        self.attach = np.full((len(groups), anchor.num_pages), -1, np.int32)
        self.spare = np.zeros((len(groups), anchor.num_pages), np.int64)
        self._spare_n = [0] * len(groups)
        self._stamp = 0
        #: spare group pages freed to make room
        self.spare_reclaimed = 0
        #: called with ``(g, anchor_ids)`` before :meth:`reclaim` frees spare pages (the KV
        #: events of the pages the tree held: events/groups.py)
        self.on_reclaim: Callable[[int, np.ndarray], None] | None = None
        #: called with ``(g, anchor_ids)`` after pages of group ``g`` were attached to tree
        #: pages from outside this class (an L3 fetch: cache/l3_port.py; KV events)
        self.on_attach: Callable[[int, np.ndarray], None] | None = None
        self._anchor = anchor
        anchor.on_free = self.detach
        self.valued = [False] * len(groups)
        self.worth: np.ndarray | None = None
        self.worth_floor = 0.0

    def value_groups(self, groups: Sequence[int]) -> None:
        """Order the spare pages of ``groups`` (indices) by worth (``mark_spare``'s
        ``worth``) instead of rank, then age."""
        for g in groups:
            self.valued[g] = True
        if self.worth is None and any(self.valued):
            self.worth = np.zeros(self.attach.shape, np.float64)

    def _by_stamp(self, g: int, ids: np.ndarray) -> np.ndarray:
        """``ids`` (spare) in the order their pages are freed: lowest stamp first, or for a
        valued group lowest worth (stable)."""
        if self.valued[g]:
            assert self.worth is not None
            return ids[np.argsort(self.worth[g, ids], kind="stable")]
        return ids[np.argsort(self.spare[g, ids], kind="stable")]

    @property
    def allocators(self) -> tuple[PageAllocator, ...]:
        return tuple(p.allocator for p in self.pools)

    def attach_new(self, anchor_ids: np.ndarray, groups: Sequence[int] | None = None) -> None:
        """Give each of ``anchor_ids`` (full-attention pages holding none) a fresh page of every
        group (of ``groups``, when given: indices): all or nothing.

        Raises:
            OutOfPagesError: a group's pool has fewer free pages; nothing taken.
        """
        n = int(anchor_ids.size)
        which = range(len(self.pools)) if groups is None else groups
        for g in which:
            p = self.pools[g]
            if p.allocator.num_free < n and self._spare_n[g]:
                self.reclaim(g, n - p.allocator.num_free)
        short = [
            (g, self.pools[g].allocator.num_free)
            for g in which
            if self.pools[g].allocator.num_free < n
        ]
        if short:
            g, free = short[0]
            raise OutOfPagesError(
                f"{self.name} window group {g} pool: {n} pages needed, {free} free",
                needed=n,
                free=free,
            )
        for g in which:
            self.attach[g, anchor_ids] = self.pools[g].allocator.alloc(n)

    def take(self, g: int, n: int) -> np.ndarray:
        """Up to ``n`` free pages of group ``g`` (spare ones freed first; fewer when fewer
        are free)."""
        alloc = self.pools[g].allocator
        if alloc.num_free < n and self._spare_n[g]:
            self.reclaim(g, n - alloc.num_free)
        return alloc.alloc(min(n, alloc.num_free))

    def take_for_copy(
        self, g: int, n_read: int, ranks: np.ndarray, worth: np.ndarray | None = None
    ) -> np.ndarray:
        """Group ``g``'s pages for a copy onto this tier of ``n_read`` pages a node end reads,
        then spare ones of ``ranks`` (spare ranks, descending): all of them where the pool has
        room; where it is short, the pages a node end reads may free any spare page here
        (lowest stamp first, as :meth:`take`), and each spare one only a spare page here of
        no higher rank, so a copy never frees the window of a rarer end (a multiple of a
        larger power of two) for a commoner one's. Returns the pages, fewer than asked
        where they do not fit: the first ``n_read`` for the pages a node end reads, then
        one for each of the first spare ones that fit. A valued group's (``worth``: theirs,
        descending) compare by worth alone."""
        alloc = self.pools[g].allocator
        n = n_read + int(ranks.size)
        free = alloc.num_free
        if free >= n or not self._spare_n[g]:
            return alloc.alloc(min(n, free))
        row = self.spare[g]
        ids = self._by_stamp(g, np.flatnonzero(row).astype(np.int32))  # as reclaim takes
        short = min(max(0, n_read - free), ids.size)  # freed for the pages a node end reads
        f = max(0, free - n_read)  # free pages left for the spare ones
        m = max(0, min(ids.size - short, int(ranks.size) - f))
        mine = ids[short : short + m]
        if worth is not None and self.valued[g]:
            assert self.worth is not None
            ok = self.worth[g, mine] <= worth[f : f + m]
        else:
            ok = spare_rank(row[mine]) <= ranks[f : f + m]
        if not ok.all():
            m = int(np.argmin(ok))
        self._free_spare(g, ids[: short + m])
        return alloc.alloc(min(n_read + f + m, alloc.num_free))

    def room(self, g: int) -> int:
        """Group ``g`` pages free or spare (what :meth:`take` can give)."""
        return self.pools[g].allocator.num_free + self._spare_n[g]

    def mark_spare(
        self,
        g: int,
        anchor_ids: np.ndarray,
        rank: np.ndarray | None = None,
        *,
        fresh: bool = False,
        worth: np.ndarray | None = None,
        refresh: bool = False,
    ) -> int:
        """Group ``g``'s pages attached to ``anchor_ids`` become spare (those that were
        keep their stamp); how many became. ``rank`` (ints in ``[0, 64)``, one per id): spare
        pages of a lower rank are reclaimed first, oldest first within a rank (the stamp is
        ``rank << RANK_SHIFT`` plus the marking's count; :func:`spare_rank` reads it back).
        ``fresh``: the caller vouches that every id holds a page just attached (none spare),
        as a transfer's destination does: no mask. ``worth`` (one per id): a valued group's
        order among spare pages (:meth:`value_groups`). ``refresh``: every attached page
        takes the new stamp and worth, spare already or not (returns those newly spare)."""
        if not anchor_ids.size:
            return 0
        row = self.spare[g]
        newly: int | None = None  # (refresh: those not spare before; else every one marked)
        if refresh:
            mask = self.attach[g, anchor_ids] >= 0
            sel = anchor_ids[mask]
            newly = int(np.count_nonzero(row[sel] == 0))
        elif fresh:
            mask = None
            sel = anchor_ids
        else:
            mask = (self.attach[g, anchor_ids] >= 0) & (row[anchor_ids] == 0)
            sel = anchor_ids[mask]
        if sel.size:
            self._stamp += 1
            stamp = np.int64(self._stamp)
            if rank is not None:
                rank = rank if mask is None else rank[mask]
            row[sel] = stamp if rank is None else (rank.astype(np.int64) << RANK_SHIFT) + stamp
            if worth is not None and self.worth is not None:
                self.worth[g, sel] = worth if mask is None else worth[mask]
        marked = int(sel.size) if newly is None else newly
        self._spare_n[g] += marked
        return marked

    def unmark_spare(self, g: int, anchor_ids: np.ndarray) -> None:
        """Group ``g``'s pages attached to ``anchor_ids`` are read again (not spare)."""
        row = self.spare[g]
        sel = anchor_ids[row[anchor_ids] > 0]
        if sel.size:
            row[sel] = 0
            self._spare_n[g] -= int(sel.size)

    def reclaim(self, g: int, n: int) -> int:
        """Free group ``g``'s ``n`` spare pages of the lowest stamps (rank, then age; fewer
        if fewer); how many."""
        ids = np.flatnonzero(self.spare[g]).astype(np.int32)
        if ids.size > n:
            if self.valued[g]:
                ids = self._by_stamp(g, ids)[:n]
            else:
                ids = ids[np.argpartition(self.spare[g, ids], n - 1)[:n]]
        return self._free_spare(g, ids)

    def _free_spare(self, g: int, ids: np.ndarray) -> int:
        """Free group ``g``'s spare pages attached to ``ids`` (their events first); how many."""
        if self.on_reclaim is not None and ids.size:
            self.on_reclaim(g, ids)
        if self.valued[g] and ids.size:
            assert self.worth is not None
            self.worth_floor = max(self.worth_floor, float(self.worth[g, ids].max()))
        freed = self.detach_group(g, ids)
        self.spare_reclaimed += freed
        return freed

    def spare_pages(self) -> list[int]:
        return list(self._spare_n)

    def detach(self, anchor_ids: np.ndarray) -> None:
        """Free every group page attached to ``anchor_ids`` (int32, distinct)."""
        if len(self.pools) == 1:  # (every page an anchor frees passes here: kept lean)
            self.detach_group(0, anchor_ids)
            return
        if not (self.attach[:, anchor_ids] >= 0).any():  # (one check for every group)
            return
        for g in range(len(self.pools)):
            self.detach_group(g, anchor_ids)

    def detach_group(self, g: int, anchor_ids: np.ndarray) -> int:
        """Free group ``g``'s pages attached to ``anchor_ids``; how many were attached."""
        row = self.attach[g]
        w = row[anchor_ids]
        sel = w >= 0
        k = int(np.count_nonzero(sel))
        if not k:
            return 0
        gone = anchor_ids
        if k < w.size:
            w, gone = w[sel], anchor_ids[sel]
        self.pools[g].allocator.free(w, validated=True)
        row[gone] = -1
        if self._spare_n[g]:  # (every page an anchor frees passes here: few numpy calls)
            stamps = self.spare[g]
            was = int(np.count_nonzero(stamps[gone]))
            if was:
                stamps[gone] = 0  # (zero where not spare already)
                self._spare_n[g] -= was
        return k

    def held(self, anchor_ids: np.ndarray) -> np.ndarray:
        """bool ``[len(groups), n]``: which of ``anchor_ids`` hold each group's page."""
        return self.attach[:, anchor_ids] >= 0

    def read_counts(self, anchor_ids: np.ndarray) -> list[int]:
        """Per group, how many of ``anchor_ids`` hold a page that is not spare (one a node end
        reads: what a copy of them to another tier must take there first)."""
        held = (self.attach[:, anchor_ids] >= 0) & (self.spare[:, anchor_ids] == 0)
        return [int(n) for n in np.count_nonzero(held, axis=1)]

    def adopt(self, dst: np.ndarray, src: np.ndarray) -> int:
        """Move group pages from ``src[i]`` to ``dst[i]`` where ``dst[i]`` holds none and
        ``src[i]`` holds one (the tree's page takes a caller's duplicate's window KV, which
        is bit-identical: same tokens, same model); pages moved."""
        moved = 0
        for g in range(len(self.pools)):
            row = self.attach[g]
            sel = (row[dst] < 0) & (row[src] >= 0)
            if sel.any():
                row[dst[sel]] = row[src[sel]]
                row[src[sel]] = -1
                moved += int(np.count_nonzero(sel))
        return moved

    def used_pages(self) -> list[int]:
        return [p.allocator.num_used for p in self.pools]

    def reset(self) -> None:
        self.attach[:] = -1
        self.spare[:] = 0
        self._spare_n = [0] * len(self.pools)
        if self.worth is not None:
            self.worth[:] = 0.0
        self.worth_floor = 0.0
        for p in self.pools:
            p.allocator.reset()

    def check(self) -> None:
        """Each group page is attached to exactly one allocated full-attention page, and
        every allocated group page is attached (nothing leaked).

        Raises:
            HiCacheError: naming the group and the first broken rule.
        """
        allocated = self._anchor.is_allocated(np.arange(self._anchor.num_pages))
        for g, pool in enumerate(self.pools):
            row = self.attach[g]
            on = row >= 0
            if (on & ~allocated).any():
                bad = np.flatnonzero(on & ~allocated)[:8].tolist()
                raise HiCacheError(f"{self.name} window group {g}: free pages {bad} hold one")
            ids = row[on]
            if np.unique(ids).size != ids.size:
                raise HiCacheError(f"{self.name} window group {g}: a page attached twice")
            if not pool.allocator.is_allocated(ids).all():
                raise HiCacheError(f"{self.name} window group {g}: a free page is attached")
            spare = self.spare[g] > 0
            if (spare & ~on).any() or int(spare.sum()) != self._spare_n[g]:
                raise HiCacheError(f"{self.name} window group {g}: spare pages miscounted")
            if ids.size != pool.allocator.num_used:
                raise HiCacheError(
                    f"{self.name} window group {g}: {pool.allocator.num_used} pages "
                    f"allocated, {ids.size} attached (leaked)"
                )
