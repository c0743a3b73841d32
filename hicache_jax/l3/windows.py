"""The window groups' entries in L3: their keys, their store lanes, and a prefetch's reads of
them (ARCHITECTURE.md, "Layer groups" and "A request's data flow").

A spec with window groups (``KVSpec.window_groups``) keeps each group's pages attached to the
full-attention pages on each tier (:mod:`hicache_jax.memory.window`). In L3 each group's page is
an entry of its own, next to the full-attention page's:

- **Keys** (:func:`window_keys`): the full-attention page's key with the group's index inserted
  before the page digest, ``hcj2_<fingerprint>_<namespace>_w<g>_<page digest>``. The digest
  chain, the namespace (and its generation) and the fingerprint are the full-attention page's,
  so a group entry names the same prefix of the same model; the fingerprint is the whole spec's
  (every group's layout in it), so ``w<g>`` names one group of it. Two groups whose pages have
  the same shape (their ``LayerGroup.spec`` fingerprints equal) still get their own keys, which a
  key built from the group spec's fingerprint alone would not give. Keys of a plain spec are
  unchanged, and a namespace's ``delete_prefix`` removes its group entries too (they share its
  prefix).
- **Lanes** (:class:`WindowLane`): the store opened once more per group, on that group's spec
  (``LayerGroup.spec``, this process's heads): an entry's size, header fingerprint and checksum
  are the group page's. Each lane has its own staging rows.
- **Fetches** (:class:`WindowedGet`): a prefetch reads, per group, the entries of the pages a
  continuation at the fetched prefix's end reads; its handle is done, and its pages land, only
  once those reads are done too, so the prefix attaches once, with the group pages it has.

Threading: the cache's thread only (the backends' workers read and write staging rows only).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hicache_jax.l3.storage import ENTRY_ROWS, StorageError, entry_pages, entry_rows, open_storage
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import KVSpec, LayerGroup

__all__ = ["WindowLane", "WindowPart", "WindowedGet", "open_lanes", "window_keys"]


def window_keys(keys: Sequence[str], g: int) -> list[str]:
    """The keys of window group ``g``'s entries of the full-attention pages ``keys``
    (``..._<digest>`` -> ``..._w<g>_<digest>``; see the module docstring)."""
    out = []
    for key in keys:
        head, _, digest = key.rpartition("_")
        out.append(f"{head}_w{g}_{digest}")
    return out


class WindowLane:
    """One window group's entries: its store, its staging rows.

    Args:
        g: the group's index in ``KVSpec.window_groups``.
        group: the group (its ``need_start`` says which pages a continuation reads).
        spec: the group's pages as stored (``LayerGroup.spec``, this process's heads).
        backend: the store opened on ``rows`` for ``spec``.
        rows: its staging rows (``entry_rows``).
    """

    def __init__(
        self, g: int, group: LayerGroup, spec: KVSpec, backend: Any, rows: np.ndarray
    ) -> None:
        self.g, self.group, self.spec, self.backend = g, group, spec, backend
        self.staging = entry_pages(spec, rows)  # [P, L, kvf, ps, H, D] bits
        self.alloc = PageAllocator(rows.shape[0], f"l3 window group {g} staging")

    def keys(self, keys: Sequence[str]) -> list[str]:
        """This group's keys of full-attention page ``keys``."""
        return window_keys(keys, self.g)

    def close(self) -> None:
        self.backend.close()


def open_lanes(
    url: str, groups: Sequence[LayerGroup], specs: Sequence[KVSpec], n_staging: int
) -> list[WindowLane]:
    """Open the store ``url`` once per window group (on ``specs[g]``, ``n_staging`` staging
    rows each); all or none (a failure closes those opened, then raises as ``open_storage``)."""
    lanes: list[WindowLane] = []
    try:
        for g, (group, spec) in enumerate(zip(groups, specs, strict=True)):
            rows = entry_rows(spec, n_staging)
            lanes.append(
                WindowLane(g, group, spec, open_storage(url, spec, rows, ENTRY_ROWS), rows)
            )
    except BaseException:
        for lane in lanes:
            lane.close()
        raise
    return lanes


@dataclass(eq=False)
class WindowPart:
    """One window group's read within a prefetch.

    Attributes:
        lane: the group's lane.
        pages: int offsets, within the prefetch's pages, of the pages read.
        sids: the lane's staging rows they are read into.
        get: the store's handle.
    """

    lane: WindowLane
    pages: np.ndarray
    sids: np.ndarray
    get: Any

    def landed(self) -> np.ndarray:
        """bool over ``pages``: read intact (all False while in flight or after an error)."""
        if not self.get.done():
            return np.zeros(self.pages.size, bool)
        try:
            return np.asarray(self.get.wait(0), bool)
        except StorageError:
            return np.zeros(self.pages.size, bool)


@dataclass(eq=False)
class WindowedGet:
    """A prefetch's full-attention read and its window groups' reads, as one store handle
    (``done``, ``wait``, ``landed``, ``cancel``: the full-attention pages' masks): done once
    every read is done, and nothing counts as landed before, so the prefetch attaches once,
    with every group page it read (see the module docstring)."""

    full: Any
    parts: list[WindowPart] = field(default_factory=list)

    def done(self) -> bool:
        return self.full.done() and all(p.get.done() for p in self.parts)

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Wait for every read (``TimeoutError`` after ``timeout`` s in all); the full-attention
        pages' mask (``StorageError`` as the full-attention read's)."""
        if timeout is None:
            for p in self.parts:
                with contextlib.suppress(StorageError):  # its pages are misses (landed())
                    p.get.wait()
            return self.full.wait()
        deadline = time.monotonic() + timeout
        ok = self.full.wait(timeout)
        for p in self.parts:
            with contextlib.suppress(StorageError):
                p.get.wait(max(0.0, deadline - time.monotonic()))
        return ok

    def landed(self) -> np.ndarray:
        if not self.done():
            return np.zeros(len(self.full.keys), bool)
        return self.full.landed()

    def cancel(self) -> None:
        self.full.cancel()
        for p in self.parts:
            p.get.cancel()

    def release(self) -> None:
        """Free the group reads' staging rows (the prefetch is closed: every read is done)."""
        for p in self.parts:
            p.lane.alloc.free(p.sids)
        self.parts = []
