"""Recorders: what the cache calls when pages appear on or leave a tier (see
:mod:`hicache_jax.events`): :class:`NullRecorder` (events off), :class:`Recorder` (batches of
compact records, one per public call) and :class:`QueueRecorder` (in-process), and the bounded
buffer they keep batches in.

Threading: the cache's owning thread only; ``stats()`` reads the counters.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Iterator


from hicache_jax.errors import HiCacheError
from hicache_jax.events.records import (
    CLEARED, EventBatch, KVEvent, Medium, Record, RemovedRecord, StoredRecord,
    RECORD_OVERHEAD, expand, record_bytes)
from hicache_jax.spec import KVEventsConfig


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

    def removed(self, node: Any, medium: Medium) -> None:
        pass

    def cleared(self) -> None:
        pass

    def end_call(self) -> None:
        pass

    def take(self) -> list[KVEvent]:
        raise HiCacheError("KV events are not enabled: build the cache with "
                           "HiCacheConfig(kv_events={'publisher': 'queue'}) to take them "
                           "in-process, or {'publisher': 'zmq', 'endpoint': ...} to publish them")

    take_batches = take

    def stats(self) -> dict[str, int]:
        return {"kv_event_batches": 0, "kv_event_batches_dropped": 0,
                "kv_event_publish_errors": 0}

    def close(self) -> None:
        pass


class Recorder:
    """Records the events of the current public call; :meth:`end_call` seals them into a batch
    (seq, ts) and hands it to :meth:`_publish`. Subclasses publish."""

    def __init__(self) -> None:
        self._pending: list[Record] = []
        self._pending_bytes = 0
        self._seq = 0
        self._dropped = 0
        self._publish_errors = 0
        self.last_publish_error: str | None = None

    def stored(self, node: Any, medium: Medium, pages: slice | None = None) -> None:
        """Record a BlockStored of ``node``'s pages (a ``TreeNode``; default all), root-first.

        Args:
            node: a tree node attached to the tree (its parent gives the first parent hash).
            medium: the tier the pages are now on.
            pages: which of the node's pages (a slice; default: all).
        """
        n = node.num_pages
        first, stop, _ = (pages or slice(None)).indices(n)
        if stop <= first:
            return
        hashes = node.page_hashes
        if first > 0:
            prev: int | None = int(hashes[first - 1])
        else:
            parent = node.parent
            prev = int(parent.page_hashes[-1]) if parent is not None and parent.num_pages else None
        ps = node.num_tokens // n
        # Views: a node's key and hashes are never written in place (a split slices them).
        record = StoredRecord(hashes[first:stop], prev, node.key[first * ps:stop * ps], medium,
                         node.extra_key)
        self._pending.append(record)
        self._pending_bytes += record_bytes(record)

    def removed(self, node: Any, medium: Medium) -> None:
        """Record a BlockRemoved of every page of ``node`` on ``medium``."""
        if node.num_pages:
            record = RemovedRecord(node.page_hashes, medium)
            self._pending.append(record)
            self._pending_bytes += record_bytes(record)

    def cleared(self) -> None:
        """Drop the call's pending events and record AllBlocksCleared (a reset supersedes them)."""
        self._pending, self._pending_bytes = [CLEARED], RECORD_OVERHEAD

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

    def take(self) -> list[KVEvent]:
        raise HiCacheError("KV events are published to the ZMQ endpoint (kv_events publisher="
                           "'zmq'): subscribe there; take_events() needs publisher='queue'")

    take_batches = take

    def stats(self) -> dict[str, int]:
        return {"kv_event_batches": self._seq, "kv_event_batches_dropped": self._dropped,
                "kv_event_publish_errors": self._publish_errors}

    def close(self) -> None:
        pass


class QueueRecorder(Recorder):
    """``publisher="queue"``: batches wait in a buffer bounded by count and bytes until taken."""

    def __init__(self, buffer_steps: int, buffer_bytes: int = KVEventsConfig.buffer_bytes) -> None:
        super().__init__()
        self._buffer = BoundedBatches(buffer_steps, buffer_bytes)

    def _publish(self, seq: int, ts: float, records: list[Record], nbytes: int) -> None:
        self._dropped += self._buffer.append((seq, ts, records), nbytes)

    def take_batches(self) -> list[EventBatch]:
        """The batches since the last take, oldest first (a gap in ``seq``: dropped)."""
        self.end_call()
        return [EventBatch(seq, ts, tuple(e for r in records for e in expand(r)))
                for seq, ts, records in self._buffer.take()]

    def take(self) -> list[KVEvent]:
        """The events of :meth:`take_batches`, flattened."""
        return [e for batch in self.take_batches() for e in batch.events]


