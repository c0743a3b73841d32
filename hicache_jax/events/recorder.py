"""Recorders: what the cache calls when pages appear on or leave a tier (see
:mod:`hicache_jax.events`): :class:`NullRecorder` (events off), :class:`Recorder` (batches of
compact records, one per public call) and :class:`QueueRecorder` (in-process), and the bounded
buffer they keep batches in.

Block ids: the tree's page hashes, or vLLM's (``block_hash="vllm:..."``,
:class:`~hicache_jax.events.block_ids.VllmIds`), resolved once at construction.

L3 (``l3_medium`` set, :class:`L3Announcer`): the tier hands the recorder a candidate per put
(:meth:`Recorder.l3_candidate`, taken while the node is in the tree) and, once the store
acknowledges it, the pages stored (:meth:`Recorder.l3_stored`). A page is announced once per
L3 residency, and only after its parent is announced on L3: a child whose put lands first
(``write_back`` puts leaves before their parents) waits until its parent lands, so a consumer
never sees a parent it does not know. A page whose parent never lands stays unannounced
(at most :data:`L3_WAITING` wait; beyond, the oldest are given up and counted in
``kv_event_l3_unannounced``).

Removals on L3 (BlockRemoved, leaves before their parents): a page announced there and every
page announced below it, once none of them is reachable any more by walking the chain from the
root (a consumer walks it the same way). The store does not say when it drops an entry; a
prefetch's lookup that misses an announced page reports it (:meth:`Recorder.l3_gone`).
``HiCache.invalidate`` reports the prefix or namespace it deleted from the store
(:meth:`Recorder.l3_invalidated`), and ``detach_storage`` every page announced on L3
(:meth:`Recorder.l3_detached`: this cache reaches none of them now). ``attach_storage`` announces
nothing (the protocol has no listing; what the store holds already is unknown): pages are
announced as this cache's puts land, as at construction (:meth:`Recorder.l3_attached` names the
wire medium of the new store). The announced set is a dict entry (the page's and its parent's
ints) and a list entry under its parent per page put since the last reset.

Layer groups (a spec with window groups, :meth:`Recorder.watch_groups`): every record carries
its group's tag (:class:`~hicache_jax.events.records.GroupTag`), the full-attention pages' that
of ``spec.full_group`` (on L3 too), and with ``kv_events={"groups": "all"}`` the window groups'
pages the tree holds are recorded too (:mod:`hicache_jax.events.groups`). Without window groups
records carry none, and the wire is as before.

Threading: the cache's owning thread only; ``stats()`` reads the counters.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.events.block_ids import VllmIds
from hicache_jax.events.groups import GroupEvents, Held
from hicache_jax.events.records import (
    CLEARED,
    RECORD_OVERHEAD,
    EventBatch,
    GroupTag,
    KVEvent,
    Medium,
    Record,
    RemovedRecord,
    StoredRecord,
    expand,
    group_tags,
    record_bytes,
)
from hicache_jax.spec import GroupKind, KVEventsConfig, KVSpec
from hicache_jax.tree.hashing import chain_hashes, namespace_hash


class BoundedBatches:
    """Batches, oldest first, within ``max_batches`` and ``max_bytes``: appending beyond either
    drops the oldest and says how many (a batch larger than ``max_bytes`` by itself is dropped
    at once, the others kept). Not thread-safe (its owner locks where it shares it)."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches, self.max_bytes = max_batches, max_bytes
        self.nbytes = 0
        self._items: collections.deque = collections.deque()

    def append(self, item: Any, nbytes: int) -> int:
        """Add ``item`` (of ``nbytes``); returns how many batches were dropped."""
        if nbytes > self.max_bytes:
            return 1
        items = self._items
        items.append((item, nbytes))
        self.nbytes += nbytes
        dropped = 0
        while len(items) > self.max_batches or self.nbytes > self.max_bytes:
            self.nbytes -= items.popleft()[1]
            dropped += 1
        return dropped

    def take(self) -> list:
        """Every item, oldest first; the buffer is empty after."""
        out = [item for item, _ in self._items]
        self._items.clear()
        self.nbytes = 0
        return out

    def items(self) -> list:
        """Every item, oldest first (a copy of the list; the buffer keeps them)."""
        return [item for item, _ in self._items]

    def __iter__(self) -> Iterator:
        return (item for item, _ in self._items)

    def __len__(self) -> int:
        return len(self._items)


class NullRecorder:
    """Events off (the default): every method does nothing, and nothing is kept."""

    __slots__ = ()

    def stored(self, node: Any, medium: Medium, pages: slice | None = None) -> None:
        pass

    def removed(self, node: Any, medium: Medium, ids: np.ndarray | None = None) -> None:
        pass

    def watch_groups(self, spec: KVSpec, device: Any, host: Any) -> None:
        pass

    def group_snapshot(self, res: Any) -> None:
        return None

    def group_changes(self, before: Any) -> None:
        pass

    def cleared(self) -> None:
        pass

    def l3_candidate(self, node: Any, pages: np.ndarray | None = None) -> None:
        return None

    def l3_stored(self, candidate: Any, ok: np.ndarray) -> None:
        pass

    def l3_gone(self, pages: np.ndarray, extra_key: Any) -> None:
        pass

    def l3_invalidated(self, pages: np.ndarray | None, extra_key: Any) -> None:
        pass

    def l3_attached(self, medium: str | None) -> None:
        pass

    def l3_detached(self) -> None:
        pass

    def end_call(self) -> None:
        pass

    _OFF = (
        "KV events are not enabled: build the cache with "
        "HiCacheConfig(kv_events={'publisher': 'queue'}) to take them "
        "in-process, or {'publisher': 'zmq', 'endpoint': ...} to publish them"
    )

    def take(self) -> list[KVEvent]:
        raise HiCacheError(self._OFF)

    def take_batches(self) -> list[EventBatch]:
        raise HiCacheError(self._OFF)

    def stats(self) -> dict[str, int]:
        return {"kv_event_batches": 0, "kv_event_batches_dropped": 0, "kv_event_publish_errors": 0}

    def close(self) -> None:
        pass


class Recorder:
    """Records the events of the current public call; :meth:`end_call` seals them into a batch
    (seq, ts) and hands it to :meth:`_publish`. Subclasses publish."""

    def __init__(self, ids: VllmIds | None = None, l3: bool = False) -> None:
        self._ids = ids
        self._l3 = L3Announcer(self, ids) if l3 else None
        #: the full-attention pages' tag with window groups (:meth:`watch_groups`), else None
        self.full_group: GroupTag | None = None
        #: ``kv_events`` ``groups``: which layer groups :meth:`watch_groups` announces
        self.announce_groups = "all"
        self._groups: GroupEvents | None = None
        self._pending: list[Record] = []
        self._pending_bytes = 0
        self._seq = 0
        self._dropped = 0
        self._publish_errors = 0
        self.last_publish_error: str | None = None

    def stored(self, node: Any, medium: Medium, pages: slice | None = None) -> None:
        """Record a BlockStored of ``node``'s pages (a ``TreeNode``; default all), root-first,
        and with window groups announced (:meth:`watch_groups`) those of each group they hold.

        Args:
            node: a tree node attached to the tree (its parent gives the first parent hash).
            medium: the tier the pages are now on.
            pages: which of the node's pages (a slice; default: all).
        """
        first, stop, _ = (pages or slice(None)).indices(node.num_pages)
        if stop <= first:
            return
        self.stored_run(node, medium, first, stop, self.full_group)
        if self._groups is not None:
            self._groups.stored(node, medium, first, stop)

    def stored_run(
        self, node: Any, medium: Medium, first: int, stop: int, group: GroupTag | None
    ) -> None:
        """Record a BlockStored of ``node``'s pages ``[first, stop)`` (``first < stop``) of the
        layer group ``group`` (None: a spec without window groups)."""
        hashes = node.page_hashes
        ps = node.num_tokens // node.num_pages
        if self._ids is not None:
            prev_d, digests = self._ids.digests(node, first, stop)
            ids = self._ids.acquire(hashes[first:stop], digests)
            prev = None if prev_d is None else int.from_bytes(prev_d[-8:], "big")
        else:
            ids, prev = hashes[first:stop], parent_hash(node, first)
        # Views: a node's key and hashes are never written in place (a split slices them).
        self.add(
            StoredRecord(ids, prev, node.key[first * ps : stop * ps], medium, node.extra_key, group)
        )

    def add(self, record: Record) -> None:
        self._pending.append(record)
        self._pending_bytes += record_bytes(record)

    def removed(self, node: Any, medium: Medium, ids: np.ndarray | None = None) -> None:
        """Record a BlockRemoved of every page of ``node`` on ``medium`` and, with window groups
        announced, of the group pages announced for them.

        Args:
            node: the tree node.
            medium: the tier the pages leave.
            ids: the node's page ids on that tier (default: its ``value`` / ``host_value``; a
                node taken out of the tree no longer holds them).
        """
        if not node.num_pages:
            return
        self.removed_pages(node.page_hashes, medium, self.full_group)
        if self._groups is not None:
            if ids is None:
                ids = node.value if medium is Medium.DEVICE else node.host_value
            self._groups.removed(node, medium, ids)

    def removed_pages(self, hashes: np.ndarray, medium: Medium, group: GroupTag | None) -> None:
        """Record a BlockRemoved of the pages of tree hashes ``hashes`` of the layer group
        ``group`` (None: a spec without window groups)."""
        ids = hashes if self._ids is None else self._ids.release(hashes)
        self.add(RemovedRecord(ids, medium, group))

    def watch_groups(self, spec: KVSpec, device: Any, host: Any) -> None:
        """A spec with window groups: from now on every event names its layer group (the
        full-attention pages' ``spec.full_group``), and with ``groups="all"`` each window
        group's pages the tree holds are announced too (:mod:`hicache_jax.events.groups`).

        Args:
            spec: the cache's spec.
            device, host: each tier's ``WindowPages``.
        """
        if not spec.window_groups:
            return
        tags = group_tags(spec)
        full = [t for t, g in zip(tags, spec.groups) if g.kind is GroupKind.FULL]
        self.full_group = full[0]
        if self.announce_groups == "all":
            windows = [t for t, g in zip(tags, spec.groups) if g.kind is not GroupKind.FULL]
            self._groups = GroupEvents(self, windows, device, host)

    def group_snapshot(self, res: Any) -> list[Held] | None:
        """Before an insert's window trim: what its path's pages hold (None: nothing to
        announce); see :meth:`GroupEvents.snapshot`."""
        return None if self._groups is None else self._groups.snapshot(res)

    def group_changes(self, before: list[Held] | None) -> None:
        """After an insert's window trim: what changed since :meth:`group_snapshot`."""
        if before is not None and self._groups is not None:
            self._groups.changes(before)

    def cleared(self) -> None:
        """Drop the call's pending events and record AllBlocksCleared (a reset supersedes them)."""
        self._pending, self._pending_bytes = [CLEARED], RECORD_OVERHEAD
        if self._groups is not None:
            self._groups.clear()
        if self._ids is not None:
            self._ids.clear()
        if self._l3 is not None:
            self._l3.clear()

    def l3_candidate(self, node: Any, pages: np.ndarray | None = None) -> L3Candidate | None:
        """What an L3 put of ``node``'s pages (int indices; default all) would announce, taken
        while ``node`` is in the tree; None when L3 is not announced."""
        if self._l3 is None or not node.num_pages:
            return None
        return self._l3.candidate(node, pages)

    def l3_stored(self, candidate: L3Candidate | None, ok: np.ndarray) -> None:
        """The store acknowledged the put of ``candidate``: ``ok`` (bool per page) are in L3."""
        if candidate is not None and self._l3 is not None:
            self._l3.stored(candidate, ok)

    def l3_gone(self, pages: np.ndarray, extra_key: Any) -> None:
        """The store no longer holds the last page of the prefix ``pages`` (``[n, page_size]``
        tokens; a lookup missed it): a BlockRemoved on L3 if it was announced there."""
        if self._l3 is not None:
            self._l3.gone(int(chain_hashes(namespace_hash(extra_key), pages)[-1]))

    def l3_invalidated(self, pages: np.ndarray | None, extra_key: Any) -> None:
        """``HiCache.invalidate`` deleted from the store the prefix ending with the last page of
        ``pages`` (``[n, page_size]`` tokens) and below, or (``pages=None``) the namespace
        ``extra_key``: what of it was announced on L3 is announced removed, and pages waiting for
        a parent there are forgotten."""
        if self._l3 is None:
            return
        if pages is None:
            self._l3.drop_namespace(extra_key)
        else:
            self._l3.gone(int(chain_hashes(namespace_hash(extra_key), pages)[-1]))

    def l3_attached(self, medium: str | None) -> None:
        """A store was attached at run time; ``medium``: its wire name (None: not announced).
        Nothing is announced now (see the module doc)."""

    def l3_detached(self) -> None:
        """The store was detached: every page announced on L3 is announced removed."""
        if self._l3 is not None:
            self._l3.drop_all()

    def end_call(self) -> None:
        """Seal the events of the call that returns (if any) into the next batch."""
        if self._pending:
            records, self._pending = self._pending, []
            nbytes, self._pending_bytes = self._pending_bytes, 0
            seq, self._seq = self._seq, self._seq + 1
            try:
                self._publish(seq, time.time(), records, nbytes)
            except Exception as e:  # the call has changed the cache: never raise now; the
                self._dropped += 1  # batch is counted dropped (a gap in seq) and the error kept
                self._publish_errors += 1
                self.last_publish_error = f"batch {seq}: {e!r}"

    def _publish(self, seq: int, ts: float, records: list[Record], nbytes: int) -> None:
        """Hand over one sealed batch (``nbytes``: the sum of its :func:`record_bytes`)."""
        raise NotImplementedError

    _NOT_QUEUED = (
        "KV events are published to the ZMQ endpoint (kv_events publisher="
        "'zmq'): subscribe there; take_events() needs publisher='queue'"
    )

    def take(self) -> list[KVEvent]:
        raise HiCacheError(self._NOT_QUEUED)

    def take_batches(self) -> list[EventBatch]:
        raise HiCacheError(self._NOT_QUEUED)

    def stats(self) -> dict[str, int]:
        out = {
            "kv_event_batches": self._seq,
            "kv_event_batches_dropped": self._dropped,
            "kv_event_publish_errors": self._publish_errors,
        }
        if self._l3 is not None:
            out["kv_event_l3_unannounced"] = self._l3.given_up
        return out

    def close(self) -> None:
        pass


class QueueRecorder(Recorder):
    """``publisher="queue"``: batches wait in a buffer bounded by count and bytes until taken."""

    def __init__(
        self,
        buffer_steps: int,
        buffer_bytes: int = KVEventsConfig.buffer_bytes,
        ids: VllmIds | None = None,
        l3: bool = False,
    ) -> None:
        super().__init__(ids, l3)
        self._buffer = BoundedBatches(buffer_steps, buffer_bytes)

    def _publish(self, seq: int, ts: float, records: list[Record], nbytes: int) -> None:
        self._dropped += self._buffer.append((seq, ts, records), nbytes)

    def take_batches(self) -> list[EventBatch]:
        """The batches since the last take, oldest first (a gap in ``seq``: dropped)."""
        self.end_call()
        return [
            EventBatch(seq, ts, tuple(e for r in records for e in expand(r)))
            for seq, ts, records in self._buffer.take()
        ]

    def take(self) -> list[KVEvent]:
        """The events of :meth:`take_batches`, flattened."""
        return [e for batch in self.take_batches() for e in batch.events]


def parent_hash(node: Any, first: int) -> int | None:
    """The tree hash of the page before page ``first`` of ``node`` (None: the namespace's
    first page)."""
    if first > 0:
        return int(node.page_hashes[first - 1])
    parent = node.hash_parent  # kept once the node is deleted
    return int(parent.page_hashes[-1]) if parent is not None and parent.num_pages else None


#: Pages an L3 announcer keeps waiting for their parent at most.
L3_WAITING = 1 << 16


class L3Candidate(NamedTuple):
    """The pages of one L3 put, as they were in the tree: tree hashes, each page's parent tree
    hash (None: first of its namespace), tokens ``[n, page_size]``, namespace, and with vLLM
    ids each page's 32-byte hash and its parent's (None: first)."""

    hashes: np.ndarray
    parents: list
    tokens: np.ndarray
    extra_key: Any
    digests: list | None
    parent_digests: list | None

    def part(self, lo: int, hi: int) -> L3Candidate:
        """Pages ``[lo, hi)`` (a put in parts)."""
        d, p = self.digests, self.parent_digests
        return L3Candidate(
            self.hashes[lo:hi],
            self.parents[lo:hi],
            self.tokens[lo:hi],
            self.extra_key,
            None if d is None else d[lo:hi],
            None if p is None else p[lo:hi],
        )


class L3Announcer:
    """The L3 side of a recorder (see the module doc): which pages are announced on L3 and
    which wait for their parent. The cache's thread only."""

    def __init__(self, recorder: Recorder, ids: VllmIds | None) -> None:
        self._rec, self._ids = recorder, ids
        self._known: dict[int, int | None] = {}  # announced: h -> parent h
        self._roots: dict[int, Any] = {}  # announced first pages: h -> namespace
        self._below: dict[int, list[int]] = {}  # announced children of an announced page
        self._waiting: collections.OrderedDict = collections.OrderedDict()  # h -> page
        self._children: dict[int, list[int]] = collections.defaultdict(list)
        self.given_up = 0

    def candidate(self, node: Any, pages: np.ndarray | None) -> L3Candidate:
        n = node.num_pages
        idx = np.arange(n) if pages is None else np.asarray(pages)
        tree = node.page_hashes
        parents = [parent_hash(node, 0)] + tree[:-1].tolist()
        tokens = node.key.reshape(n, -1)
        digests = pdigests = None
        if self._ids is not None:
            first, stop = int(idx.min()), int(idx.max()) + 1
            prev, run = self._ids.digests(node, first, stop)
            full = [prev] + run
            digests = [full[i - first + 1] for i in idx.tolist()]
            pdigests = [full[i - first] for i in idx.tolist()]
        return L3Candidate(
            tree[idx],
            [parents[i] for i in idx.tolist()],
            tokens[idx],
            node.extra_key,
            digests,
            pdigests,
        )

    def stored(self, c: L3Candidate, ok: np.ndarray) -> None:
        for i in np.flatnonzero(ok).tolist():
            h = int(c.hashes[i])
            if h in self._known or h in self._waiting:
                continue
            page = (
                h,
                c.parents[i],
                c.tokens[i],
                c.extra_key,
                None if c.digests is None else c.digests[i],
                None if c.parent_digests is None else c.parent_digests[i],
            )
            parent = c.parents[i]
            if parent is None or parent in self._known:
                self._announce(page)
            else:
                self._wait(page)

    def _wait(self, page: tuple) -> None:
        self._waiting[page[0]] = page
        self._children[page[1]].append(page[0])
        while len(self._waiting) > L3_WAITING:
            h, old = self._waiting.popitem(last=False)
            self.given_up += 1
            kids = self._children.get(old[1])
            if kids is not None and h in kids:
                kids.remove(h)

    def _announce(self, page: tuple) -> None:
        todo = [page]
        while todo:
            h, parent, tokens, extra_key, digest, pdigest = todo.pop()
            self._known[h] = parent
            if parent is None:
                self._roots[h] = extra_key
            else:
                self._below.setdefault(parent, []).append(h)
            if self._ids is None:
                ids, prev = np.array([h], np.uint64), parent
            else:
                ids = self._ids.acquire(np.array([h], np.uint64), [digest])
                prev = None if pdigest is None else int.from_bytes(pdigest[-8:], "big")
            self._rec.add(
                StoredRecord(ids, prev, tokens, Medium.L3, extra_key, self._rec.full_group)
            )
            for child in self._children.pop(h, ()):
                waiting = self._waiting.pop(child, None)
                if waiting is not None:
                    todo.append(waiting)

    def gone(self, h: int) -> None:
        """The store lost the page ``h``: it and every page announced below it are announced
        removed (none is reachable now); pages waiting below it are forgotten."""
        self._remove([h])

    def drop_namespace(self, extra_key: Any) -> None:
        """Every page of the namespace ``extra_key`` is announced removed / forgotten."""
        self._remove([h for h, key in self._roots.items() if key == extra_key])
        self._forget([h for h, page in self._waiting.items() if page[3] == extra_key])

    def drop_all(self) -> None:
        """Every page announced is announced removed; nothing waits any more."""
        self._remove(list(self._roots))  # every announced page descends from a root
        self.clear()

    def _remove(self, tops: list[int]) -> None:
        """One BlockRemoved of the announced subtrees under ``tops`` (leaves first), and the
        waiting pages below any of them forgotten."""
        order, stack = [], [h for h in tops if h in self._known]
        while stack:
            h = stack.pop()
            order.append(h)
            stack.extend(self._below.pop(h, ()))
        for h in order:
            parent = self._known.pop(h)
            self._roots.pop(h, None)
            kids = None if parent is None else self._below.get(parent)  # None: h was a root
            if parent is not None and kids is not None and h in kids:
                kids.remove(h)
                if not kids:
                    del self._below[parent]
        self._forget(order + list(tops))
        if order:
            tree = np.array(order[::-1], np.uint64)
            ids = tree if self._ids is None else self._ids.release(tree)
            self._rec.add(RemovedRecord(ids, Medium.L3, self._rec.full_group))

    def _forget(self, tops: list[int]) -> None:
        """Drop the waiting pages ``tops`` and those waiting below them."""
        stack = list(tops)
        while stack:
            h = stack.pop()
            self._waiting.pop(h, None)
            stack.extend(self._children.pop(h, ()))

    def clear(self) -> None:
        self._known.clear()
        self._roots.clear()
        self._below.clear()
        self._waiting.clear()
        self._children.clear()
