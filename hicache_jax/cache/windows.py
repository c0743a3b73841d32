"""The window groups of a cache: which prefixes are servable, what the tree keeps of them.

A spec with window groups (``KVSpec.window_groups``) keeps each group's pages attached to the
full-attention pages on each tier (:mod:`hicache_jax.memory.window`). This part owns the rules
over the tree (ARCHITECTURE.md, "Layer groups"):

- **Servable prefixes** (:meth:`Windows.split_match`, :meth:`Windows.servable_device`):
  a matched prefix is cut back to the longest one whose window pages are held on the tier that
  serves each page (:func:`~hicache_jax.tree.windows.servable_pages`); never a prefix that
  would read a missing page, and never less than the deepest end that has them all (a missing
  page inside the window makes only the ends that read it unservable). A match's device part
  (``Match.device_len``) serves alone (a caller may lock it without loading the host part):
  where the tree's device pages go on past the longest prefix they serve alone (their end
  holds no checkpoint, or lacks window pages; the host part's end has them), the pages past
  it count in the host part (``Match.resident_len``: a load-back serves them, copying none).
- **What the tree keeps** (:meth:`Windows.after_insert`): of a node's pages a group keeps only
  those a continuation at the node's end reads; the rest are freed on every tier as soon as
  the node enters the tree, so they are never backed up, written to L3 or loaded back. Where the
  tree's page at a position lacks a group's page (its node was split, and the new end reads
  pages trimmed before) and the request inserting the same tokens holds one, the tree's page
  takes it (the same bytes: same tokens, same model).
- **Caller pages** (:meth:`Windows.attach_new`): a request's own pages hold every local
  group's page until they are inserted (its forward writes every layer).
- **Checkpoints** (``STATE`` groups, :meth:`Windows.checkpoint`): a slot is attached to the
  page ending at the checkpoint's position, only where the caller writes one; the rules above
  treat it as a group page a continuation at that page's end reads (``kept_first_page``), so a
  node keeps the slot at its end, an interior one is spare (or freed), a split keeps the slot
  where it was (the lower part's end is the same page), and a prefix is servable only at a
  page holding one.

Threading: the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from hicache_jax.cache.match import path_pages
from hicache_jax.errors import HiCacheError
from hicache_jax.memory.window import BRANCH_RANK, WindowPages, read_by_node_end, spare_rank
from hicache_jax.spec import GroupKind, KVSpec, LayerGroup, recurrent_only
from hicache_jax.tree.node import InsertResult, TreeMatch, TreeNode
from hicache_jax.tree.windows import kept_first_page, servable_pages

__all__ = ["Windows", "group_load_bytes"]

_EMPTY = np.zeros(0, np.int32)
#: memoized rank arrays of :meth:`Windows.trim` kept at most (then cleared)
_RANKS_KEPT = 4096


class Windows:
    """The window groups' rules over one cache's tree (see the module docstring).

    Args:
        spec: the cache's spec (with window groups).
        device, host: the window pages of each tier.
        spare: keep window pages and checkpoints no node end reads while there is room
            (``HiCacheConfig.window_spare``).
        worth_power: the ``value`` eviction's (``tree/eviction.py``), or None (rank and
            age). Given, every checkpoint of a ``STATE`` group is spare and goes by what it
            saves, as the tree's nodes do (GreedyDual of its own: a checkpoint ``p`` pages from
            the root is worth ``clock + p ** worth_power`` over its size in pages, the clock
            being the highest worth reclaimed on the host tier).
    """

    def __init__(
        self,
        spec: KVSpec,
        device: WindowPages,
        host: WindowPages,
        spare: bool = True,
        worth_power: float | None = None,
    ) -> None:
        self.groups = spec.window_groups
        #: indices of the local (window / chunk) groups: a caller's new page holds each
        self.local = tuple(
            g for g, grp in enumerate(self.groups) if grp.kind is not GroupKind.STATE
        )
        #: indices of the STATE groups: a slot only where the caller checkpoints
        self.states = spec.state_groups
        self.device, self.host = device, host
        self.spare = spare
        self._spec = spec
        self._ps = spec.page_size
        #: ``(g, start_page, num_pages, inner) -> ranks`` of :meth:`trim` (read-only arrays:
        #: a node's ranks depend on its place alone, and inserts meet the same places again)
        self._ranks: dict[tuple[int, int, int, bool], np.ndarray] = {}
        self._power = worth_power
        #: a STATE group's slot in pages (a checkpoint's size, for its worth)
        self._slot_pages = {g: self.groups[g].slot_bytes / spec.page_bytes for g in self.states}
        #: matches that ended at a checkpoint inside a node (a tail or interior one) and at
        #: a node's end: how much an interior checkpoint is worth beside an end (:meth:`_worth`)
        self.inner_hits = self.end_hits = 0
        if worth_power is not None and self.states:
            device.value_groups(self.states)
            host.value_groups(self.states)

    # -- servable prefixes -----------------------------------------------------------------
    def servable_device(self, device_pages: np.ndarray) -> int:
        """Tokens of the longest servable prefix of ``device_pages`` (a prefix's device pages,
        root first) from the device tier alone."""
        held = self.device.held(device_pages)
        return servable_pages(held, self.groups, self._ps, held.shape[1]) * self._ps

    def servable_peek(self, path: Sequence[tuple[TreeNode, int]]) -> tuple[int, int]:
        """``(device, host)`` tokens :meth:`HiCache.match_prefix` would return of a read-only
        descent (``RadixTree.peek_path``: nodes, root first, each with its tokens matched):
        ``Match.device_len`` and ``Match.host_len`` (:meth:`split_match`), changing nothing."""
        ps = self._ps
        dev: list[np.ndarray] = []
        host: list[np.ndarray] = []
        for node, ntok in path:
            if not host and node.value is not None:
                dev.append(node.value[: ntok // ps])
            else:
                assert node.host_value is not None  # a tree node is held on a tier
                host.append(node.host_value[: ntok // ps])
        dev_ids = np.concatenate(dev) if dev else _EMPTY
        held = self.device.held(dev_ids)
        if host:
            held = np.concatenate([held, self.host.held(np.concatenate(host))], axis=1)
        alone, whole = self._split(held, dev_ids.size)
        return alone * ps, (whole - alone) * ps

    def split_match(self, tm: TreeMatch) -> tuple[int, int]:
        """``(alone, whole)``: tokens of the longest prefix of a tree match that its device
        pages serve alone (no load-back), and of the longest servable prefix of it all; where
        the host part adds nothing servable, ``whole == alone``."""
        held = self.device.held(tm.device_pages)
        if tm.host_nodes:
            host = np.concatenate([n.host_value for n in tm.host_nodes])
            held = np.concatenate([held, self.host.held(host)], axis=1)
        alone, whole = self._split(held, tm.device_pages.size)
        return alone * self._ps, whole * self._ps

    def _split(self, held: np.ndarray, nd: int) -> tuple[int, int]:
        """:meth:`split_match` in pages, of ``held`` (``WindowPages.held`` of a match's
        device pages, ``nd`` of them, then its host pages)."""
        alone = servable_pages(held[:, :nd], self.groups, self._ps, nd)
        if held.shape[1] == nd:
            return alone, alone
        whole = servable_pages(held, self.groups, self._ps, held.shape[1])
        return alone, (whole if whole > nd else alone)

    def load_ends(self, chain: Sequence[TreeNode]) -> Callable[[int], int]:
        """For the host ``chain`` (host-only nodes, root first, after a device prefix): a
        function of ``ntok`` giving, of a load of the chain's first ``ntok`` tokens, the
        longest that serves: tokens from the chain's start to the deepest servable end within
        them (a checkpoint, and every window page a continuation there reads, held on the tier
        of each page), 0 where none is past the device prefix (loading any of it would serve
        nothing). For the cost rule, whose model prices a load as serving as far as it goes;
        what the tiers hold is read once, for every ``ntok`` it asks about."""
        if not chain:
            return lambda ntok: 0
        ps = self._ps
        assert chain[0].parent is not None  # (a host chain hangs below the root at least)
        dev_ids = path_pages(chain[0].parent)  # (a host chain's prefix is device-resident)
        host = np.concatenate([n.host_value for n in chain])
        held = np.concatenate([self.device.held(dev_ids), self.host.held(host)], axis=1)
        nd = dev_ids.size

        def end(ntok: int) -> int:
            if ntok <= 0:
                return 0
            limit = nd + min(ntok // ps, host.size)
            return max(0, servable_pages(held, self.groups, ps, limit) - nd) * ps

        return end

    def hold(
        self,
        device_pages: np.ndarray,
        host_nodes: Sequence[TreeNode] = (),
        alone: int | None = None,
    ) -> None:
        """A match ends after ``device_pages`` then the pages of ``host_nodes`` (at a node end:
        the tree split there): the pages a continuation there reads are not spare any more, on
        the tier holding each, so making room for another request (which frees spare pages)
        never takes them from under this one. With a host part, also those read at the end of
        the match's first ``alone`` device pages (default: all of them), the prefix a caller
        serves without loading the rest back (``Match.device_len``)."""
        if not self.spare:
            return
        host_pages = np.concatenate([n.host_value for n in host_nodes]) if host_nodes else _EMPTY
        nd = device_pages.size
        if not nd + host_pages.size:
            return
        end = (nd + host_pages.size) * self._ps
        alone = nd if alone is None else alone
        if self._power is not None and self.states:  # where the hits land (see _worth)
            if host_pages.size:
                self._count_hit(self.host, int(host_pages[-1]))
            else:
                self._count_hit(self.device, int(device_pages[-1]))
        for g, group in enumerate(self.groups):
            first = kept_first_page(group, end, self._ps)
            if first < nd:
                self.device.unmark_spare(g, device_pages[first:])
            self.host.unmark_spare(g, host_pages[max(0, first - nd) :])
            if host_pages.size and alone:
                lo = kept_first_page(group, alone * self._ps, self._ps)
                self.device.unmark_spare(g, device_pages[lo:alone])

    # -- caller pages and inserts ----------------------------------------------------------
    def attach_new(self, ids: np.ndarray) -> None:
        """Every local group's page for each of a caller's new pages (all or nothing); a
        ``STATE`` group's slot comes only with a checkpoint (:meth:`checkpoint`)."""
        if self.local:
            self.device.attach_new(ids, self.local)

    def checkpoint(self, g: int, ids: np.ndarray) -> np.ndarray:
        """State group ``g``'s device slot at the end of each of a caller's pages ``ids``
        (distinct): the one it holds, else a fresh one (all or nothing: ``OutOfPagesError``
        takes none). A caller's page is its own, so rewriting its slot mutates no checkpoint
        of the tree."""
        row = self.device.attach[g]
        fresh = ids[row[ids] < 0]
        if fresh.size:
            self.device.attach_new(fresh, (g,))
        return row[ids].copy()

    def positions(
        self, cached: int, held: int, end: int, every_pages: int | None, tail_pages: int = 0
    ) -> list[int]:
        """Where a request whose prompt is served up to ``cached`` tokens should checkpoint,
        as prefix lengths in ``(cached, end]`` (page multiples): ``held``, where the tree's
        pages go on past what it could serve (the request's checkpoint there becomes the
        tree's when it inserts: :meth:`before_free_duplicates`); ``tail_pages`` pages before
        ``end`` (0: none) where the device slots have room for it beside those; every
        ``every_pages`` pages from the root (None or 0: none) where
        the device slot pools have room (:meth:`_admit`); and ``end`` (the prompt's last
        whole page: its commit)."""
        ps = self._ps
        every_pages = interval_pages(self._spec, every_pages)
        out = {end} if end > cached else set()
        if cached < held <= end:
            out.add(held)
        tail = end - tail_pages * ps
        # (only where every state group's device slots have room beside the firm ones: free,
        # or holding a spare checkpoint; it never takes the end's slot)
        if (
            tail_pages
            and tail > cached
            and tail not in out
            and all(self.device.room(g) > len(out) for g in self.states)
        ):
            out.add(tail)
        if every_pages:
            step = every_pages * ps
            inner = [e for e in range((cached // step + 1) * step, end + 1, step) if e not in out]
            out.update(self._admit(inner, len(out)))
        return sorted(out)

    def _admit(self, inner: list[int], firm: int) -> list[int]:
        """Which of the interior checkpoint ends ``inner`` (prefix lengths, ascending) a
        request takes: as many as every state group's device pool has room for, counting a
        slot free or one that holds a spare checkpoint of no higher rank
        (:func:`checkpoint_ranks`) and setting ``firm`` slots aside first (the end and the
        held one), highest rank first. Taking more would reclaim spare checkpoints that
        thin out less evenly than the ones given up (a request's every-``2 K`` ones outrank
        its odd multiples of ``K``), or evict whole nodes for want of slots."""
        pages = np.asarray(inner, np.int64) // self._ps
        if not pages.size:
            return inner
        rank = end_ranks(pages)
        order = np.argsort(-rank, kind="stable")
        keep = len(inner)
        for g in self.states:
            room = self.device.pools[g].allocator.num_free - firm
            if room >= keep:  # free slots for all (no scan of the spare stamps)
                continue
            stamps = self.device.spare[g]
            held = np.sort(spare_rank(stamps[stamps > 0]))
            # the i-th taken (highest rank first) needs room + reclaimable(rank) > i
            reclaimable = np.searchsorted(held, rank[order], side="right")
            short = np.flatnonzero(room + reclaimable - np.arange(order.size) <= 0)
            keep = min(keep, int(short[0]) if short.size else order.size)
        return sorted(inner[i] for i in order[:keep])

    def before_free_duplicates(self, res: InsertResult, ids: np.ndarray) -> np.ndarray:
        """Where a caller's page duplicates the tree's at a position and the tree's page lacks
        a group's page, move the caller's there (before the duplicates are freed). Returns
        the tree's pages that may have taken one (empty: none did)."""
        if not res.duplicate_pages.size:
            return _EMPTY
        tree_ids = _device_pages(res.existing_nodes)
        mine = ids[: tree_ids.size]
        dup = tree_ids != mine
        return tree_ids[dup] if self.device.adopt(tree_ids[dup], mine[dup]) else _EMPTY

    def stale_host_copies(
        self, res: InsertResult, taken: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(device, host)`` page pairs of the inserted path's nodes on both tiers whose
        device page took a group page (``taken``: :meth:`before_free_duplicates`) that a
        continuation at the node's end reads and that the node's host copy lacks (it was
        backed up before: a branch point's checkpoint written by a later request, a window
        repaired after a split). Copied to host again, the pages carry it there; otherwise
        evicting the device copy, which the backup makes cheap, would lose it on both tiers.
        Call after :meth:`after_insert` (which marks what the node ends read)."""
        if not taken.size:
            return _EMPTY, _EMPTY
        dev_out, host_out = [], []
        for node in res.existing_nodes:
            if node.value is None or node.host_value is None:
                continue
            sel = np.isin(node.value, taken)
            if not sel.any():
                continue
            d, h = node.value[sel], node.host_value[sel]
            read = read_by_node_end(self.device.spare[:, d])
            need = (self.device.held(d) & read & ~self.host.held(h)).any(axis=0)
            if need.any():
                dev_out.append(d[need])
                host_out.append(h[need])
        if not dev_out:
            return _EMPTY, _EMPTY
        return np.concatenate(dev_out), np.concatenate(host_out)

    def after_insert(self, res: InsertResult) -> int:
        """Free, on both tiers, every group page of the inserted path's nodes that no
        continuation at the node's end reads; group pages freed."""
        nodes = list(res.existing_nodes)
        if res.last_node.parent is not None and res.last_node not in res.existing_nodes:
            nodes.append(res.last_node)
        freed, start = 0, 0
        for node in nodes:
            freed += self.trim(node, start)
            start += node.num_pages
        return freed

    def trim(self, node: TreeNode, start_page: int) -> int:
        """Drop the group pages of ``node`` (starting at page ``start_page`` of its prefix)
        that a continuation at its end does not read, on both tiers: freed, or marked spare
        (``spare``: kept while the group's pool has room, so a later split there still finds
        them); how many were dropped.

        Spare window pages are taken in :func:`window_ranks` order, so that the ends left
        servable inside a node thin out evenly.

        A ``STATE`` group's checkpoint at the end of a node with children is spare too: it
        serves only requests that branch exactly there, and losing it costs the recompute
        from the previous checkpoint (the request that does it checkpoints there again:
        :meth:`positions`), while a slot is worth many pages; so taking such slots comes
        before evicting any leaf for a checkpoint's room. A match that ends there holds it
        (:meth:`hold`). Spare checkpoints are taken in :func:`checkpoint_ranks` order."""
        end = (start_page + node.num_pages) * self._ps
        freed = 0
        for g, group in enumerate(self.groups):
            k = max(0, kept_first_page(group, end, self._ps) - start_page)
            state = group.kind is GroupKind.STATE
            inner = state and bool(node.children)
            if not self.spare:
                for side, ids in ((self.device, node.value), (self.host, node.host_value)):
                    if ids is not None and k:
                        freed += side.detach_group(g, ids[:k])
                continue
            if state and self._power is not None:  # every one by what it saves (below)
                rank, worth = self._worth(g, start_page, node.num_pages)
                for side, ids in ((self.device, node.value), (self.host, node.host_value)):
                    if ids is not None:
                        freed += side.mark_spare(g, ids, rank, worth=worth, refresh=True)
                continue
            rank = self._rank(g, group, start_page, node.num_pages if state else k, inner)
            for side, ids in ((self.device, node.value), (self.host, node.host_value)):
                if ids is None:
                    continue
                if inner:  # see below
                    freed += side.mark_spare(g, ids, rank)
                else:
                    freed += side.mark_spare(g, ids[:k], rank[:k])
                    side.unmark_spare(g, ids[k:])
        return freed

    def _worth(self, g: int, start: int, num_pages: int) -> tuple[np.ndarray, np.ndarray]:
        """The ranks and worths of STATE group ``g``'s checkpoints at pages ``start ..
        start + num_pages`` under the ``value`` eviction: rank 0 inside the node, and
        :data:`BRANCH_RANK` at its end (read by a node end: the rank that says so, not an
        order: valued pages go by worth alone), worth ``clock + p ** power / slot pages``
        for the checkpoint ``p`` pages from the root; inside the node that times how often
        matches ended at such a checkpoint so far against a node's end (at most 1, Laplace
        smoothed): a trace whose later requests leave prompts only at their ends (a
        conversation's turns) then keeps its ends' checkpoints over the tails', one whose
        requests leave them before their ends keeps both alike (Mooncake's synthetic trace:
        8 of 14 hits at 3e5 tokens ended inside a node; its conversation trace: 0 of 298)."""
        assert self._power is not None
        rank = np.zeros(num_pages, np.int64)
        if num_pages:
            rank[-1] = BRANCH_RANK
        clock = self.host.worth_floor  # (the last tier's: as the tree's clock)
        p = np.arange(start + 1, start + num_pages + 1, dtype=np.float64)
        worth = p**self._power / self._slot_pages[g]
        if num_pages > 1:  # inside the node: as often used as an end, at most
            worth[:-1] *= min(1.0, (self.inner_hits + 1) / (self.end_hits + 1))
        return rank, clock + worth

    def _count_hit(self, side: WindowPages, page: int) -> None:
        """A match ending at ``page`` of ``side``'s tier: at a checkpoint inside a node (spare
        below the branch rank: a tail or interior one) or at a node's end."""
        g = self.states[0]
        if side.attach[g, page] < 0:
            return
        stamp = side.spare[g, page]
        if stamp > 0 and spare_rank(stamp) < BRANCH_RANK:
            self.inner_hits += 1
        else:
            self.end_hits += 1

    def _rank(
        self, g: int, group: LayerGroup, start: int, num_pages: int, inner: bool
    ) -> np.ndarray:
        """:func:`checkpoint_ranks` or :func:`window_ranks` of group ``g``'s pages ``start ..
        start + num_pages``, memoized (bounded)."""
        key = (g, start, num_pages, inner)
        rank = self._ranks.get(key)
        if rank is None:
            if group.kind is GroupKind.STATE:
                rank = checkpoint_ranks(start, num_pages, inner)
            else:
                rank = window_ranks(group, start, num_pages, self._ps)
            rank.flags.writeable = False
            if len(self._ranks) >= _RANKS_KEPT:
                self._ranks.clear()
            self._ranks[key] = rank
        return rank

    # -- eviction ------------------------------------------------------------------------
    def make_host_room(self, device_ids: np.ndarray, evict_host: Callable[[int], int]) -> None:
        """Before a backup of ``device_ids``: evict host nodes (``evict_host(tokens) ->
        tokens freed``, the write policy's order; their group pages go with them) until each
        group's host pool has room (free or spare pages) for the pages of it that a node end
        reads, or nothing more can be evicted. Otherwise the copy would leave those behind and
        the nodes' host copies could not serve their own ends."""
        need = self.device.read_counts(device_ids)
        while True:
            short = max(n - self.host.room(g) for g, n in enumerate(need))
            if short <= 0 or evict_host(short * self._ps) == 0:
                return

    def cut_keeps_servable(self, node: TreeNode, tail_pages: int, on_device: bool) -> bool:
        """Whether cutting ``node``'s last ``tail_pages`` (page-granular eviction) leaves its
        head servable at its new end on that tier: the head holds every window page a
        continuation there reads (the parent's part of them is the parent's own kept tail).
        A head that is not would hold full-attention pages no request can use: eviction
        takes the whole node instead."""
        ids = node.value if on_device else node.host_value
        if ids is None:
            return False
        side = self.device if on_device else self.host
        start = _depth_pages(node) - node.num_pages
        cut = node.num_pages - tail_pages
        for g, group in enumerate(self.groups):
            first = max(0, kept_first_page(group, (start + cut) * self._ps, self._ps) - start)
            if not (side.attach[g, ids[first:cut]] >= 0).all():
                return False
        return True

    # -- checks --------------------------------------------------------------------------------
    def check(self, root: TreeNode) -> None:
        """Both tiers' attachments (nothing leaked, nothing shared), and no tree node holding
        a group page no continuation at its end reads.

        Raises:
            HiCacheError: naming the first broken rule.
        """
        self.device.check()
        self.host.check()
        stack = [(child, 0) for child in root.children.values()]
        while stack:
            node, start = stack.pop()
            end = (start + node.num_pages) * self._ps
            for g, group in enumerate(self.groups):
                k = kept_first_page(group, end, self._ps) - start
                if k <= 0:
                    continue
                for side, ids in ((self.device, node.value), (self.host, node.host_value)):
                    if (
                        ids is not None
                        and ((side.attach[g, ids[:k]] >= 0) & (side.spare[g, ids[:k]] == 0)).any()
                    ):
                        raise HiCacheError(
                            f"{node!r}: {side.name} window group {g} holds pages no "
                            "continuation at the node's end reads"
                        )
            stack.extend((c, start + node.num_pages) for c in node.children.values())


#: ``checkpoint_every_pages=None``: a checkpoint every this many tokens of a prefill.
#: The default interval of interior checkpoints, in tokens, of a spec with window groups beside
#: its state groups (``R2:S1:F1``); a recurrent hybrid's is none (``HiCacheConfig``).
MIXED_EVERY_TOKENS = 2048


def interval_pages(spec: KVSpec, checkpoint_every_pages: int | None) -> int:
    """Pages between a prefill's interior checkpoints (``HiCacheConfig.checkpoint_every_pages``;
    0: none). None, the default: none for a recurrent hybrid (:func:`recurrent_only`), every
    :data:`MIXED_EVERY_TOKENS` with window groups beside the state ones."""
    if checkpoint_every_pages is not None:
        return checkpoint_every_pages
    return 0 if recurrent_only(spec) else max(1, MIXED_EVERY_TOKENS // spec.page_size)


def storage_spare(spec: KVSpec, put: bool | int | None, checkpoint_every: int | None) -> bool | int:
    """What ``HiCacheConfig.storage_window_spare`` puts to L3 of the spare window pages: ``put``
    as given, or for None, False (the pages node ends read) unless the spec has ``STATE``
    groups beside window ones: then the pages the interior checkpoints' ends read (those at
    multiples of ``checkpoint_every`` pages from the root are at multiples of its largest
    power-of-two divisor), since every checkpoint goes to L3 and one whose window pages L3
    lacks serves nothing from there."""
    if put is not None:
        return put
    every = interval_pages(spec, checkpoint_every)
    if not (spec.state_groups and len(spec.state_groups) < len(spec.window_groups) and every):
        return False
    return every & -every


def checkpoint_ranks(start_page: int, num_pages: int, inner: bool) -> np.ndarray:
    """The reclaim ranks of the checkpoints a node of ``num_pages`` pages (from page
    ``start_page`` of its prefix) may hold, one per page: lower ranks go first. A checkpoint
    ending at page count ``e`` from the root has rank ``ctz(e)`` (the trailing zero bits), so
    as slots run short the interior checkpoints thin out evenly: every odd multiple of the
    interval goes before any multiple of twice the interval, and so on (the spacing doubles
    each time; oldest first within a rank). A node end with children (``inner``: a branch
    point, where an earlier request did diverge) ranks above them all."""
    rank = end_ranks(np.arange(start_page + 1, start_page + num_pages + 1, dtype=np.int64))
    if inner and num_pages:
        rank[-1] = BRANCH_RANK
    return rank


def end_ranks(e: np.ndarray) -> np.ndarray:
    """The reclaim ranks of interior checkpoints ending at page counts ``e`` (int64, > 0)
    from the root: ``ctz(e)``, at most :data:`BRANCH_RANK` (:func:`checkpoint_ranks`)."""
    return np.minimum(_log2_floor(e & -e), BRANCH_RANK)  # e & -e: the lowest set bit


def window_ranks(group: LayerGroup, start_page: int, num_pages: int, page_size: int) -> np.ndarray:
    """The reclaim ranks of a window (or chunk) group's spare pages ``start_page ..
    start_page + num_pages`` of a prefix, one per page: lower ranks go first. A page is read
    by the continuations at the ends ``e`` (page counts from the root) from the next page's
    start up to the last end whose window still reaches it; its rank is the largest ``ctz(e)``
    among them, so as window pages run short the ends that stay servable thin out evenly, as
    spare checkpoints do (:func:`checkpoint_ranks`): first every end that is not a multiple
    of 2, then of 4, and so on. A request that diverges inside a node whose spare pages were
    taken is then served up to the last surviving end before its branch point, at most one
    spacing back, rather than back to the node's start."""
    if num_pages <= 0:
        return np.zeros(0, np.int64)
    j = np.arange(start_page, start_page + num_pages, dtype=np.int64)
    if group.kind is GroupKind.WINDOW:
        assert group.window is not None
        last = j + 1 + (group.window - 1) // page_size  # the last end whose window holds j
    else:
        assert group.kind is GroupKind.CHUNK and group.chunk is not None
        # an end reads page j while the chunk boundary at or before it (chunk m) starts
        # before page j's end: m <= ceil((j + 1) * page_size / chunk) - 1
        c = group.chunk
        m = -(-(j + 1) * page_size // c) - 1
        last = np.maximum(j + 1, -(-(m + 1) * c // page_size) - 1)  # (j + 1: none reads j)
    # the largest ctz over the ends j + 1 .. last: the highest bit where j and last differ
    return np.minimum(_log2_floor(np.maximum(j ^ last, 1)), BRANCH_RANK - 1)


def _log2_floor(x: np.ndarray) -> np.ndarray:
    """``floor(log2(x))`` of positive int64s (the highest set bit's index)."""
    return np.floor(np.log2(x.astype(np.float64))).astype(np.int64)


def _depth_pages(node: TreeNode) -> int:
    """Pages from the root to the end of ``node``."""
    pages = 0
    while node.parent is not None:
        pages += node.num_pages
        node = node.parent
    return pages


def _device_pages(nodes: list[TreeNode]) -> np.ndarray:
    values = [n.value for n in nodes if n.value is not None]
    return np.concatenate(values) if values else _EMPTY


def group_load_bytes(spec: KVSpec) -> Callable[[np.ndarray], np.ndarray] | None:
    """What a load of ``pages`` pages of a prefix moves besides its full-attention pages,
    for the cost model: each window group's pages a continuation at its end reads (at most
    ``ceil(W / page_size)``; a chunk group's ``ceil(C / page_size)``) and each ``STATE``
    group's checkpoint slot at its end; None without groups."""
    ps, terms = spec.page_size, []
    for grp in spec.window_groups:
        size = grp.spec(ps).page_bytes
        if grp.kind is GroupKind.STATE:
            terms.append((0, size))
        else:
            span = grp.window if grp.kind is GroupKind.WINDOW else grp.chunk
            assert span is not None
            terms.append((-(-span // ps), size))
    if not terms:
        return None

    def nbytes(pages: np.ndarray) -> np.ndarray:
        out = np.zeros(pages.shape, np.float64)
        for k, size in terms:
            out += (np.minimum(pages, k) if k else (pages > 0)) * float(size)
        return out

    return nbytes
