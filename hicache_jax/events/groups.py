"""The window groups' pages in KV events: which tree pages hold a window group's page on a tier,
announced per layer group (``kv_events={"groups": "all"}``, the default, with a spec that has
window groups; ARCHITECTURE.md, "Layer groups").

A window group's page follows its full-attention page (:mod:`hicache_jax.memory.window`):
``attach[g, page]`` on each tier. A tree page holds a group's page on a medium where the tier's
``attach`` row of the group says so, spare pages included (kept while the pool has room; a
match may read them). :class:`GroupEvents` keeps what it announced, per tier, group and page
(``announced``, and each announced page's tree hash), and compares it with ``attach`` at the
moments the full-attention pages' events are recorded:

* a BlockStored of a node's pages on a medium (an insert's new pages after the trim, a backup's
  host pages, a load's device pages: the transfer engine attaches the copied window pages at
  dispatch, before the event) also announces, per group, the runs of those pages that hold the
  group's page (:meth:`GroupEvents.stored`);
* a BlockRemoved of a node's pages (eviction, deletion, a dropped host copy, invalidation) also
  removes the group pages announced for them (:meth:`GroupEvents.removed`);
* an insert changes the attachments of pages already in the tree (the trim of
  ``Windows.after_insert`` where it frees, the holes ``Windows.before_free_duplicates``
  fills): after it the path's pages are compared (:meth:`GroupEvents.changes`);
* a tier frees spare group pages to make room (``WindowPages.reclaim``, through its
  ``on_reclaim`` hook): those announced are removed (:meth:`GroupEvents.reclaimed`);
* an L3 fetch attaches group pages to host pages already announced (after the nodes it fills
  are): the host tier's ``on_attach`` hook names them, and their nodes are compared
  (:meth:`GroupEvents.attached`).

A window group's event carries the same block hash as the full-attention page at that position
(vLLM's groups share block hashes), its parent the hash of the page before it in the prefix
(which the group may not hold: a window keeps only the tail a continuation reads).

What it keeps: a bool per tier page and window group, a uint64 hash per tier page and a node
reference per host page (a few bytes a page beside the page's KV), made only with window groups
and ``groups="all"``.

Threading: the cache's owning thread only (called by the recorder).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Protocol

import numpy as np

from hicache_jax.events.records import GroupTag, Medium


class Sink(Protocol):
    """What :class:`GroupEvents` records into (a ``Recorder``; no import of it: it imports
    this module)."""

    def stored_run(
        self, node: Any, medium: Medium, first: int, stop: int, group: GroupTag | None
    ) -> None: ...

    def removed_pages(self, hashes: np.ndarray, medium: Medium, group: GroupTag | None) -> None: ...


def runs(row: np.ndarray) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each run of True in a 1-D bool array, in order."""
    if not row.size:
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], row.view(np.int8), [0]))))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


class Held(NamedTuple):
    """One node's pages on one medium, announced before an insert (see
    :meth:`GroupEvents.snapshot`)."""

    node: Any
    medium: Medium
    ids: np.ndarray


class GroupEvents:
    """Announces the window groups' pages of tree nodes (see the module doc).

    Args:
        recorder: the recorder that keeps the records.
        tags: the tag of each window group, in ``KVSpec.window_groups`` order.
        device, host: each tier's window pages (``WindowPages``: their ``attach`` rows; their
            ``on_reclaim`` is set here).
    """

    def __init__(self, recorder: Sink, tags: list[GroupTag], device: Any, host: Any) -> None:
        self._rec, self._tags = recorder, tags
        self._attach = {Medium.DEVICE: device.attach, Medium.HOST: host.attach}
        #: per tier: bool [groups, pages] announced, and each announced page's tree hash
        self._announced = {m: np.zeros(a.shape, bool) for m, a in self._attach.items()}
        self._hash = {m: np.zeros(a.shape[1], np.uint64) for m, a in self._attach.items()}
        #: the node of each announced host page (an L3 fetch names host pages only)
        self._host_node = np.empty(host.attach.shape[1], object)
        device.on_reclaim = functools.partial(self.reclaimed, Medium.DEVICE)
        host.on_reclaim = functools.partial(self.reclaimed, Medium.HOST)
        host.on_attach = self.attached

    def stored(self, node: Any, medium: Medium, first: int, stop: int) -> None:
        """``node``'s pages ``[first, stop)`` are announced on ``medium``: announce, per group,
        the runs of them that hold the group's page there (and are not announced yet)."""
        attach = self._attach.get(medium)
        ids = _ids(node, medium)
        if attach is None or ids is None:
            return
        if medium is Medium.HOST:
            self._host_node[ids[first:stop]] = node
        self._sync(node, medium, ids, first, stop)

    def removed(self, node: Any, medium: Medium, ids: np.ndarray | None) -> None:
        """``node``'s pages ``ids`` on ``medium`` are given up: remove the group pages
        announced for them."""
        announced = self._announced.get(medium)
        if announced is None or ids is None:
            return
        if medium is Medium.HOST:
            self._host_node[ids] = None
        for tag, row in zip(self._tags, announced):
            sel = row[ids]
            if sel.any():
                row[ids[sel]] = False
                self._rec.removed_pages(node.page_hashes[sel], medium, tag)

    def reclaimed(self, medium: Medium, g: int, ids: np.ndarray) -> None:
        """The tier is about to free group ``g``'s spare pages attached to ``ids``: remove
        those announced (a page freed with a node that left the tree was removed then)."""
        row = self._announced[medium][g]
        sel = ids[row[ids]]
        if sel.size:
            row[sel] = False
            self._rec.removed_pages(self._hash[medium][sel], medium, self._tags[g])

    def attached(self, g: int, host_ids: np.ndarray) -> None:
        """Group ``g``'s pages were attached to ``host_ids`` (an L3 fetch): announce them on
        the host tier where those pages are announced (their nodes compared whole)."""
        nodes = {id(n): n for n in self._host_node[host_ids].tolist() if n is not None}
        for node in nodes.values():
            if node.host_value is not None:
                self._sync(node, Medium.HOST, node.host_value, 0, node.host_value.size)

    def snapshot(self, res: Any) -> list[Held]:
        """The pages an insert found in the tree (``res``: its ``InsertResult``) that are
        announced on each tier (a revived node's device pages are the caller's, announced
        after the insert)."""
        revived = {id(n) for n in res.revived_nodes}
        out = []
        for node in res.existing_nodes:
            for medium in (Medium.DEVICE, Medium.HOST):
                ids = _ids(node, medium)
                if ids is None or (medium is Medium.DEVICE and id(node) in revived):
                    continue
                out.append(Held(node, medium, ids))
        return out

    def changes(self, before: list[Held]) -> None:
        """Announce what an insert changed of :meth:`snapshot`'s pages: group pages gained (a
        hole filled) and lost (trimmed)."""
        for node, medium, ids in before:
            self._sync(node, medium, ids, 0, ids.size)

    def _sync(self, node: Any, medium: Medium, ids: np.ndarray, first: int, stop: int) -> None:
        """Announce, per group, what ``node``'s pages ``[first, stop)`` gained or lost there
        since announced."""
        part = ids[first:stop]
        now = self._attach[medium][:, part] >= 0
        announced = self._announced[medium]
        was = announced[:, part]
        if np.array_equal(now, was):
            return
        self._hash[medium][part] = node.page_hashes[first:stop]
        announced[:, part] = now
        for tag, lost, gained in zip(self._tags, was & ~now, now & ~was):
            if lost.any():
                self._rec.removed_pages(node.page_hashes[first:stop][lost], medium, tag)
            for lo, hi in runs(gained):
                self._rec.stored_run(node, medium, first + lo, first + hi, tag)

    def clear(self) -> None:
        """Nothing is announced any more (AllBlocksCleared)."""
        for a in self._announced.values():
            a[:] = False
        self._host_node[:] = None


def _ids(node: Any, medium: Medium) -> np.ndarray | None:
    if medium is Medium.DEVICE:
        return node.value
    if medium is Medium.HOST:
        return node.host_value
    return None
