"""The window groups' pages in KV events: which tree pages hold a window group's page on a tier,
announced per layer group (``kv_events={"groups": "all"}``, the default, with a spec that has
window groups; ARCHITECTURE.md, "Layer groups").

A window group's page follows its full-attention page (:mod:`hicache_jax.memory.window`):
``attach[g, page]`` on each tier. So a tree page holds a group's page on a medium exactly where
the tier's ``attach`` row of the group says so, and :class:`GroupEvents` reads it there at the
moments the full-attention pages' events are recorded:

* a BlockStored of a node's pages on a medium (an insert's new pages after the trim, a backup's
  host pages, a load's device pages: the transfer engine attaches the copied window pages at
  dispatch, before the event) also announces, per group, the runs of those pages that hold the
  group's page (:meth:`GroupEvents.stored`);
* a BlockRemoved of a node's pages (eviction, deletion, a dropped host copy, invalidation),
  recorded before the pages are freed, also removes the group pages they hold
  (:meth:`GroupEvents.removed`);
* an insert changes the attachments of pages already in the tree (the trim of
  ``Windows.after_insert``, the holes ``Windows.before_free_duplicates`` fills): the cache takes
  a :meth:`GroupEvents.snapshot` before and records the difference after
  (:meth:`GroupEvents.changes`).

A window group's event carries the same block hash as the full-attention page at that position
(vLLM's groups share block hashes), its parent the hash of the page before it in the prefix
(which the group may not hold: a window keeps only the tail a continuation reads).

Threading: the cache's owning thread only (called by the recorder).
"""

from __future__ import annotations

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
    """What one node's pages on one medium held of each group when a snapshot was taken."""

    node: Any
    medium: Medium
    ids: np.ndarray
    held: np.ndarray  # bool [groups, n]


class GroupEvents:
    """Announces the window groups' pages of tree nodes (see the module doc).

    Args:
        recorder: the recorder that keeps the records.
        tags: the tag of each window group, in ``KVSpec.window_groups`` order.
        device, host: each tier's window pages (``WindowPages``: their ``attach`` rows).
    """

    def __init__(self, recorder: Sink, tags: list[GroupTag], device: Any, host: Any) -> None:
        self._rec, self._tags = recorder, tags
        self._attach = {Medium.DEVICE: device.attach, Medium.HOST: host.attach}

    def stored(self, node: Any, medium: Medium, first: int, stop: int) -> None:
        """``node``'s pages ``[first, stop)`` are announced on ``medium``: announce, per group,
        the runs of them that hold the group's page there."""
        attach = self._attach.get(medium)
        ids = _ids(node, medium)
        if attach is None or ids is None:
            return
        held = attach[:, ids[first:stop]] >= 0
        for tag, row in zip(self._tags, held):
            for lo, hi in runs(row):
                self._rec.stored_run(node, medium, first + lo, first + hi, tag)

    def removed(self, node: Any, medium: Medium, ids: np.ndarray | None) -> None:
        """``node``'s pages ``ids`` on ``medium`` are about to be freed or given up: remove the
        group pages they hold."""
        attach = self._attach.get(medium)
        if attach is None or ids is None:
            return
        held = attach[:, ids] >= 0
        for tag, row in zip(self._tags, held):
            if row.any():
                self._rec.removed_pages(node.page_hashes[row], medium, tag)

    def snapshot(self, res: Any) -> list[Held]:
        """What the pages an insert found in the tree (``res``: its ``InsertResult``) hold of
        each group on each tier, where they are announced (a revived node's device pages are
        the caller's, announced after the insert)."""
        revived = {id(n) for n in res.revived_nodes}
        out = []
        for node in res.existing_nodes:
            for medium in (Medium.DEVICE, Medium.HOST):
                ids = _ids(node, medium)
                if ids is None or (medium is Medium.DEVICE and id(node) in revived):
                    continue
                out.append(Held(node, medium, ids, self._attach[medium][:, ids] >= 0))
        return out

    def changes(self, before: list[Held]) -> None:
        """Announce what changed since :meth:`snapshot`: group pages gained (a hole filled) and
        lost (trimmed)."""
        for node, medium, ids, was in before:
            now = self._attach[medium][:, ids] >= 0
            if np.array_equal(now, was):
                continue
            for tag, lost, gained in zip(self._tags, was & ~now, now & ~was):
                if lost.any():
                    self._rec.removed_pages(node.page_hashes[lost], medium, tag)
                for lo, hi in runs(gained):
                    self._rec.stored_run(node, medium, lo, hi, tag)


def _ids(node: Any, medium: Medium) -> np.ndarray | None:
    if medium is Medium.DEVICE:
        return node.value
    if medium is Medium.HOST:
        return node.host_value
    return None
