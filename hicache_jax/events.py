"""KV cache events: where each page of each cached prefix lives (pure Python; no jax).

A router that sends requests to the replica holding their prefix needs to know which pages each
replica caches and on which tier. :class:`~hicache_jax.HiCache` records one event per page and
per tier whenever a page appears or disappears there, in the spirit of vLLM's / SGLang's KV
events:

* :class:`BlockStored` — the page with hash ``block_hash`` is now held on ``medium``;
  ``parent_block_hash`` is the hash of the page before it in the same prefix (``None`` for the
  first page of a namespace), and ``token_ids`` are the page's tokens.
* :class:`BlockRemoved` — the page is no longer held on ``medium``.
* :class:`AllBlocksCleared` — everything is gone (``HiCache.reset``).

Page hashes come from the radix tree (``TreeNode.page_hashes``): ``h_i = H(h_{i-1}, tokens of
page i)`` with blake2b, the chain of a namespace seeded from its ``extra_key``, so two processes
that cache the same prefix report the same hashes. A node split changes no page hash, so events
are per page and never mention tree nodes.

Replaying the events in order over an empty set of ``(block_hash, medium)`` pairs gives exactly
the pages the cache holds on each tier (the state-machine test checks this after every step).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable, Union


class Medium(str, enum.Enum):
    """Tier holding a page. A ``str`` enum: ``Medium.DEVICE == "device"``."""

    DEVICE = "device"
    HOST = "host"


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


class EventLog:
    """Events recorded since the last :meth:`take` (owned by one cache; one thread)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[KVEvent] = []

    def stored(self, node: Any, medium: Medium, pages: slice = slice(None)) -> None:
        """Record :class:`BlockStored` for ``node``'s pages (a ``TreeNode``), root-first.

        Args:
            node: a tree node attached to the tree (its parent gives the first parent hash).
            medium: the tier the pages are now on.
            pages: which of the node's pages (default: all).
        """
        hashes = node.page_hashes.tolist()
        first, stop, _ = pages.indices(len(hashes))
        if first > 0:
            prev: int | None = hashes[first - 1]
        else:
            parent = node.parent
            prev = int(parent.page_hashes[-1]) if parent is not None and parent.num_pages else None
        ps = node.num_tokens // max(node.num_pages, 1)
        tokens = node.key.tolist()
        for i in range(first, stop):
            self._events.append(BlockStored(hashes[i], prev, tuple(tokens[i * ps:(i + 1) * ps]),
                                            medium, node.extra_key))
            prev = hashes[i]

    def removed(self, node: Any, medium: Medium) -> None:
        """Record :class:`BlockRemoved` for every page of ``node`` on ``medium``."""
        self._events.extend(BlockRemoved(h, medium) for h in node.page_hashes.tolist())

    def cleared(self) -> None:
        """Drop pending events and record :class:`AllBlocksCleared` (a reset supersedes them)."""
        self._events = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        """Return the events since the last call, oldest first, and forget them."""
        out, self._events = self._events, []
        return out


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
