"""KV cache events: where each page of each cached prefix lives (pure Python; no jax).

A router that sends requests to the replica holding their prefix needs to know which pages each
replica caches and on which tier. With ``HiCacheConfig(kv_events=...)`` set,
:class:`~hicache_jax.HiCache` records an event whenever pages appear on or leave a tier, in the
spirit of vLLM's / SGLang's KV events:

* :class:`BlockStored` — the page with hash ``block_hash`` is now held on ``medium``;
  ``parent_block_hash`` is the hash of the page before it in the same prefix (``None`` for the
  first page of a namespace), and ``token_ids`` are the page's tokens.
* :class:`BlockRemoved` — the page is no longer held on ``medium``.
* :class:`AllBlocksCleared` — everything is gone (``HiCache.reset``).

Page hashes come from the radix tree (``TreeNode.page_hashes``, defined in
:mod:`hicache_jax.hashing`): ``h_i = xxh3_64(tokens of page i, seed=h_{i-1})``, the chain of a
namespace seeded from its ``extra_key``, so two processes that cache the same prefix report the
same hashes. A node split changes no page hash, so events
never depend on how the tree is split.

Off by default (``kv_events=None``): the cache then holds a :class:`NullRecorder` whose methods
do nothing, chosen once at construction. When on, the events of one public call form one batch
(sealed when the call returns) with a sequence number; a recorder holds them compactly (one
record per run of a node's pages: views of its page hashes and of its tokens, which the tree
never writes in place) and turns them into Python ints only when a consumer reads them or
they are serialized. A view keeps its whole array alive (a node key, after the node is gone),
so a record counts the bytes of the arrays it keeps alive, not of the view
(:func:`record_bytes`): an upper bound of what the buffer holds. Copying the tokens instead
(int32) cost ~9 us a record against ~0.3 us, for at most twice the records in a buffer.

* ``publisher="queue"`` (:class:`QueueRecorder`): in-process; ``HiCache.take_events()`` /
  ``take_event_batches()``. At most ``buffer_steps`` batches and ``buffer_bytes`` bytes of
  their hashes and tokens (:func:`record_bytes`) wait: beyond either, the oldest batches are
  dropped and counted (``kv_event_batches_dropped``), and the batches taken show the gap in
  their ``seq``. A batch larger than ``buffer_bytes`` by itself is dropped too.
* ``publisher="zmq"`` (:class:`~hicache_jax.events_zmq.ZmqRecorder`): published on a ZMQ PUB
  socket in vLLM's wire format by a publisher thread (see events_zmq.py).

Replaying the events in order over an empty set of ``(block_hash, medium)`` pairs gives exactly
the pages the cache holds on each tier (the state-machine test checks this after every step).

Threading: a recorder is used by the cache's owning thread only; ``stats()`` reads its counters.
The ZMQ recorder hands sealed batches to its publisher thread, which only reads their records
(views of arrays the tree never writes in place; see events_zmq.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NamedTuple, Union

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.validation import is_int


class Medium(str, enum.Enum):
    """Tier holding a page. A ``str`` enum: ``Medium.DEVICE == "device"``.

    On the wire (vLLM's ``medium`` field) L1 is ``"GPU"`` as vLLM names it, whatever the
    accelerator, and L2 (pinned host memory) is ``"CPU"``: :data:`WIRE_MEDIUM`. The L3 store
    is shared between instances and not reported: a router routes on L1 and L2.
    """

    DEVICE = "device"
    HOST = "host"


#: ``medium`` strings of the wire format.
WIRE_MEDIUM = {Medium.DEVICE: "GPU", Medium.HOST: "CPU"}


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A page is now held on ``medium``.

    Attributes:
        block_hash: uint64 chained hash of the prefix ending with this page (as a Python int).
        parent_block_hash: hash of the previous page of the prefix, ``None`` for the first page.
        token_ids: the page's ``page_size`` tokens.
        medium: the tier.
        extra_key: the namespace of the prefix (LoRA id, tenant salt) or ``None``.
    """

    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    medium: Medium
    extra_key: Any = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The page with ``block_hash`` is no longer held on ``medium``."""

    block_hash: int
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every page on every tier is gone (the cache was reset)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one public call (``HiCache.take_event_batches``).

    Attributes:
        seq: 0, 1, 2, ... per cache; a gap means batches were dropped (the buffer was full).
        ts: ``time.time()`` when the call returned.
        events: per page, in order.
    """

    seq: int
    ts: float
    events: tuple[KVEvent, ...]


# -- configuration ---------------------------------------------------------------------------

_ENDPOINT = re.compile(r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)$")


@dataclass(frozen=True)
class KVEventsConfig:
    """``HiCacheConfig(kv_events=...)``, parsed and checked (like SGLang's ``--kv-events-config``).

    Attributes:
        publisher: "queue" (in-process ``take_events()``) | "zmq" (vLLM's wire format).
        endpoint: zmq: the PUB socket's address, bound by the cache ("tcp://*:5557",
            "tcp://127.0.0.1:5557", "ipc:///tmp/kv").
        topic: zmq: the first frame of every message.
        replay_endpoint: zmq: a ROUTER address for replay requests, or None.
        buffer_steps: batches kept (queue: waiting to be taken; zmq: waiting for the
            publisher thread, and again sent, for replay).
        buffer_bytes: bytes those batches may hold (queue: their page hashes and tokens, see
            :func:`record_bytes`; zmq: the same while waiting, the encoded payloads for replay).
            Default 16 MiB: ~2M tokens of int64 keys, ~170 batches of 12K-token requests (with
            their host copies), a few hundred ms of a busy cache's events: enough for a
            consumer that takes them every scheduler step, and small beside the 200 MB over
            the pools that a long replay may use in all (``benchmarks/bench_memory.py``).
        data_parallel_rank: zmq: the ``data_parallel_rank`` of every batch.
    """

    publisher: str = "queue"
    endpoint: str = "tcp://*:5557"
    topic: str = "kv-events"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    buffer_bytes: int = 16 << 20
    data_parallel_rank: int = 0


_PUBLISHERS = ("queue", "zmq")


def _check_endpoint(field: str, value: Any) -> None:
    m = _ENDPOINT.match(value) if isinstance(value, str) else None
    if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ValueError(f"kv_events {field}={value!r} is not a ZMQ endpoint: use "
                         "'tcp://HOST:PORT' (HOST '*' for every interface, PORT 1-65535), "
                         "'ipc://PATH' or 'inproc://NAME'")


def parse_kv_events(value: Any) -> KVEventsConfig | None:
    """``HiCacheConfig.kv_events`` (None, a dict, its JSON string or a KVEventsConfig) checked.

    Raises:
        ValueError / TypeError: naming the field (unknown publisher or key, malformed endpoint,
            buffer_steps or buffer_bytes not an int >= 1, ...).
    """
    if value is None or isinstance(value, KVEventsConfig) and _checked(value):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events={value!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TypeError(f"kv_events={value!r} must be None, a dict or its JSON string, e.g. "
                        '{"publisher": "zmq", "endpoint": "tcp://*:5557"}')
    names = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"kv_events has unknown field(s) {unknown}; known: {sorted(names)}")
    cfg = KVEventsConfig(**value)
    _checked(cfg)
    return cfg


def _checked(cfg: KVEventsConfig) -> bool:
    if cfg.publisher not in _PUBLISHERS:
        raise ValueError(f"kv_events publisher={cfg.publisher!r} is not one of: "
                         f"{', '.join(map(repr, _PUBLISHERS))}")
    for field, low in (("buffer_steps", 1), ("buffer_bytes", 1), ("data_parallel_rank", 0)):
        v = getattr(cfg, field)
        if not is_int(v) or v < low:
            raise ValueError(f"kv_events {field}={v!r} must be an int >= {low}")
    if not isinstance(cfg.topic, str):
        raise TypeError(f"kv_events topic={cfg.topic!r} must be a str")
    _check_endpoint("endpoint", cfg.endpoint)
    if cfg.replay_endpoint is not None:
        _check_endpoint("replay_endpoint", cfg.replay_endpoint)
        if cfg.replay_endpoint == cfg.endpoint:
            raise ValueError(f"kv_events replay_endpoint={cfg.replay_endpoint!r} must differ "
                             "from endpoint")
    return True


# -- recorders -------------------------------------------------------------------------------

class StoredRecord(NamedTuple):
    """Compact BlockStored of a run of one node's pages (numpy arrays, not Python ints)."""

    hashes: np.ndarray  # uint64 [n], a view of the node's page hashes
    parent: int | None
    tokens: np.ndarray  # the key's int dtype [n * page_size], a view of the node's key
    medium: Medium
    extra_key: Any


class RemovedRecord(NamedTuple):
    hashes: np.ndarray  # uint64 [n]
    medium: Medium


_CLEARED = AllBlocksCleared()
Record = Union[StoredRecord, RemovedRecord, AllBlocksCleared]

#: Bytes counted per record beyond its arrays (the tuple, the arrays' headers): a rough figure,
#: so that batches of no tokens count too.
RECORD_OVERHEAD = 256


def held_bytes(a: np.ndarray) -> int:
    """Bytes of the memory a view keeps alive: its base array's (or buffer's), not its own."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    if a.base is None:
        return a.nbytes
    try:
        return max(memoryview(a.base).nbytes, a.nbytes)
    except TypeError:  # a base without the buffer protocol (numpy keeps what made the array)
        return a.nbytes


def record_bytes(record: Record) -> int:
    """What a record keeps alive: the arrays behind its views (:func:`held_bytes`, counted for
    each record that views them: an upper bound) plus :data:`RECORD_OVERHEAD`."""
    if isinstance(record, StoredRecord):
        return held_bytes(record.hashes) + held_bytes(record.tokens) + RECORD_OVERHEAD
    if isinstance(record, RemovedRecord):
        return held_bytes(record.hashes) + RECORD_OVERHEAD
    return RECORD_OVERHEAD


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


def _expand(record: Record) -> list[KVEvent]:
    """A compact record as per-page events (what ``take_events()`` returns)."""
    if isinstance(record, StoredRecord):
        hashes = record.hashes.tolist()
        if not hashes:
            return []
        tokens = record.tokens.tolist()
        ps = len(tokens) // len(hashes)
        parents = [record.parent] + hashes[:-1]
        return [BlockStored(h, p, tuple(tokens[i * ps:(i + 1) * ps]), record.medium,
                            record.extra_key) for i, (h, p) in enumerate(zip(hashes, parents))]
    if isinstance(record, RemovedRecord):
        return [BlockRemoved(h, record.medium) for h in record.hashes.tolist()]
    return [record]


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
        self._pending, self._pending_bytes = [_CLEARED], RECORD_OVERHEAD

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
        return [EventBatch(seq, ts, tuple(e for r in records for e in _expand(r)))
                for seq, ts, records in self._buffer.take()]

    def take(self) -> list[KVEvent]:
        """The events of :meth:`take_batches`, flattened."""
        return [e for batch in self.take_batches() for e in batch.events]


def make_recorder(cfg: KVEventsConfig | None) -> NullRecorder | Recorder:
    """The recorder a configuration asks for (binds the ZMQ sockets for ``"zmq"``)."""
    if cfg is None:
        return NullRecorder()
    if cfg.publisher == "queue":
        return QueueRecorder(cfg.buffer_steps, cfg.buffer_bytes)
    from hicache_jax.events_zmq import ZmqRecorder

    return ZmqRecorder(cfg)


def replay(events: Iterable[KVEvent], state: set | None = None) -> set:
    """Apply events to a set of ``(block_hash, medium)`` pairs (what a router would keep).

    Raises:
        ValueError: a page stored twice on the same medium or removed while not stored: the
            event stream is inconsistent.
    """
    state = set() if state is None else state
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            state.clear()
        elif isinstance(ev, BlockStored):
            key = (ev.block_hash, ev.medium)
            if key in state:
                raise ValueError(f"page {ev.block_hash:#x} stored twice on {ev.medium.value}")
            state.add(key)
        else:
            key = (ev.block_hash, ev.medium)
            if key not in state:
                raise ValueError(f"page {ev.block_hash:#x} removed from {ev.medium.value} "
                                 "while not stored there")
            state.remove(key)
    return state
