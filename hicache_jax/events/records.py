"""The event types a consumer reads (one per page, tier and, with window groups, layer group),
the layer groups' tags (:func:`group_tags`) and the compact records a recorder keeps until a
consumer reads them (views of the tree's arrays; see :mod:`hicache_jax.events`). Pure Python and
numpy."""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Union

import numpy as np

from hicache_jax.spec import GroupKind, KVSpec


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
        group_idx: with window groups (:func:`group_tags`), the layer group whose page this is
            (its index in ``KVSpec.groups``); ``None`` for a spec of full attention only.
        kv_cache_spec_kind: the group's kind as vLLM names it (:data:`SPEC_KINDS`), or None.
        kv_cache_spec_sliding_window: a sliding-window group's window in tokens, else None.
    """

    block_hash: int
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    medium: Medium
    extra_key: Any = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """The page with ``block_hash`` is no longer held on ``medium`` (by the layer group
    ``group_idx``, as in :class:`BlockStored`)."""

    block_hash: int
    medium: Medium
    group_idx: int | None = None


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


# -- layer groups ----------------------------------------------------------------------------------

#: ``kv_cache_spec_kind`` of each group kind, as vLLM names its cache specs (an MLA full group is
#: ``"mla_attention"``). A ``STATE`` group is vLLM's ``MambaSpec`` (Mamba, linear attention,
#: Gated DeltaNet, short conv: ``KVCacheSpecKind.MAMBA``), whose cached blocks are the ones
#: holding a state: its events announce the pages holding a checkpoint (a state slot), each
#: under the full-attention page's hash at that position.
SPEC_KINDS = {
    GroupKind.FULL: "full_attention",
    GroupKind.WINDOW: "sliding_window",
    GroupKind.CHUNK: "chunked_local_attention",
    GroupKind.STATE: "mamba",
}


class GroupTag(NamedTuple):
    """What an event says of its layer group: ``group_idx``, ``kv_cache_spec_kind`` and
    ``kv_cache_spec_sliding_window`` (the window of a sliding-window group; None otherwise:
    vLLM sends no chunk size for chunked local attention)."""

    idx: int
    kind: str
    sliding_window: int | None


def group_tags(spec: KVSpec) -> list[GroupTag]:
    """The tag of each of ``spec.groups``, in order (their index is ``group_idx``)."""
    out = []
    for i, g in enumerate(spec.groups):
        kind = GroupKind(g.kind)
        name = "mla_attention" if kind is GroupKind.FULL and g.mla else SPEC_KINDS[kind]
        out.append(GroupTag(i, name, g.window if kind is GroupKind.WINDOW else None))
    return out


# -- compact records -------------------------------------------------------------------------------


class StoredRecord(NamedTuple):
    """Compact BlockStored of a run of one node's pages (numpy arrays, not Python ints)."""

    hashes: np.ndarray  # uint64 [n], a view of the node's page hashes
    parent: int | None
    tokens: np.ndarray  # the key's int dtype [n * page_size], a view of the node's key
    medium: Medium
    extra_key: Any
    group: GroupTag | None = None  # None: a spec without window groups (no group fields)


class RemovedRecord(NamedTuple):
    hashes: np.ndarray  # uint64 [n]
    medium: Medium
    group: GroupTag | None = None


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
        m, key, tag = record.medium, record.extra_key, record.group
        if tag is None:
            return [
                BlockStored(h, p, tuple(tokens[i * ps : (i + 1) * ps]), m, key)
                for i, (h, p) in enumerate(zip(hashes, parents))
            ]
        return [
            BlockStored(h, p, tuple(tokens[i * ps : (i + 1) * ps]), m, key, *tag)
            for i, (h, p) in enumerate(zip(hashes, parents))
        ]
    if isinstance(record, RemovedRecord):
        idx = None if record.group is None else record.group.idx
        return [BlockRemoved(h, record.medium, idx) for h in record.hashes.tolist()]
    return [record]


def replay(events: Iterable[KVEvent], state: set | None = None) -> set:
    """Apply events to a set of ``(block_hash, medium)`` pairs (what a router would keep), or
    ``(block_hash, medium, group_idx)`` triples for events that name their layer group (a spec
    with window groups: each group's pages apart).

    Raises:
        ValueError: a page stored twice on the same medium (and group) or removed while not
            stored: the event stream is inconsistent.
    """
    state = set() if state is None else state
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            state.clear()
            continue
        g = ev.group_idx
        key = (ev.block_hash, ev.medium) if g is None else (ev.block_hash, ev.medium, g)
        where = ev.medium.value if g is None else f"{ev.medium.value} (group {g})"
        if isinstance(ev, BlockStored):
            if key in state:
                raise ValueError(f"page {ev.block_hash:#x} stored twice on {where}")
            state.add(key)
        else:
            if key not in state:
                raise ValueError(
                    f"page {ev.block_hash:#x} removed from {where} while not stored there"
                )
            state.remove(key)
    return state
