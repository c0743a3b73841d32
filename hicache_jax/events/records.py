"""The event types a consumer reads (one per page and tier) and the compact records a recorder
keeps until a consumer reads them (views of the tree's arrays; see :mod:`hicache_jax.events`).
Pure Python and numpy."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np


class Medium(str, enum.Enum):
    """Tier holding a page. A ``str`` enum: ``Medium.DEVICE == "device"``.

    On the wire (vLLM's ``medium`` field) L1 is ``"GPU"`` as vLLM names it, whatever the
    accelerator, and L2 (pinned host memory) is ``"CPU"``: :data:`WIRE_MEDIUM`. L3 is announced
    only when ``kv_events={"l3_medium": ...}`` asks for it (off by default: a router that
    should route on L1 and L2 only then sees nothing of it), under the configured wire name
    (``"DISK"`` for ``file://``, ``"EXTERNAL"`` for a shared store with ``"auto"``).
    """

    DEVICE = "device"
    HOST = "host"
    L3 = "l3"


#: ``medium`` strings of the wire format for L1 and L2 (L3's is configured:
#: :func:`wire_media`).
WIRE_MEDIUM = {Medium.DEVICE: "GPU", Medium.HOST: "CPU"}


def wire_media(l3_medium: str | None) -> dict[Medium, str]:
    """The wire ``medium`` of every tier announced (L3 only when it has a name)."""
    return WIRE_MEDIUM if l3_medium is None else {**WIRE_MEDIUM, Medium.L3: l3_medium}


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


# typing.Union, not `|`: a public alias, whose runtime object (and repr) users may see.
KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007


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


# -- compact records -------------------------------------------------------------------------------


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


CLEARED = AllBlocksCleared()
Record = StoredRecord | RemovedRecord | AllBlocksCleared

#: Bytes counted per record beyond its arrays (the tuple, the arrays' headers): a rough figure,
#: so that batches of no tokens count too.
RECORD_OVERHEAD = 256


def held_bytes(a: np.ndarray) -> int:
    """Bytes of the memory a view keeps alive: its base array's (or buffer's), not its own."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    base: Any = a.base  # numpy's stubs say ndarray | None: bytes, mmap, ... at run time too
    if base is None:
        return a.nbytes
    try:
        return max(memoryview(base).nbytes, a.nbytes)
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


def expand(record: Record) -> list[KVEvent]:
    """A compact record as per-page events (what ``take_events()`` returns)."""
    if isinstance(record, StoredRecord):
        hashes = record.hashes.tolist()
        if not hashes:
            return []
        tokens = record.tokens.tolist()
        ps = len(tokens) // len(hashes)
        parents = [record.parent] + hashes[:-1]
        return [
            BlockStored(h, p, tuple(tokens[i * ps : (i + 1) * ps]), record.medium, record.extra_key)
            for i, (h, p) in enumerate(zip(hashes, parents))
        ]
    if isinstance(record, RemovedRecord):
        return [BlockRemoved(h, record.medium) for h in record.hashes.tolist()]
    return [record]


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
                raise ValueError(
                    f"page {ev.block_hash:#x} removed from {ev.medium.value} while not stored there"
                )
            state.remove(key)
    return state
