"""Completion of the transfers in flight: the one place that polls the transfer engine and the
L3 tier and applies what finished, in dispatch order
(:class:`~hicache_jax.cache.inflight.InFlight`).

The facade calls it at the start of its public calls; the evict-and-retry path calls it when
copies in flight are what holds the pages it needs (their locks, or host pages parked under
them). Transfer completion is detected by polling ``is_ready()``, never signalled by a thread:
JAX calls on the pools stay on the cache's thread (ARCHITECTURE.md, "Rules that keep it fast").

Threading: the cache's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hicache_jax.cache.inflight import InFlight
from hicache_jax.memory.transfer import TransferEngine


class Completion:
    """Applies finished transfers of one cache.

    Args:
        engine: the cache's transfer engine (device <-> host copies).
        flight: the cache's operations in flight (what each copy's landing changes).
        l3: the cache's L3 tier (its puts and prefetches; a null tier without storage).
        expire: drops the pins whose ttl has passed (at the start of a public call only).
        sync: several processes: agrees the cache's clock (``AgreedClock.sync``) at the start
            of a call that starts a request (``match_prefix``, ``prefetch``), before anything
            reads it (other calls read it ticking on: one agreement per request, not per
            call; it rides on the request's first transfer or L3 agreement when there is
            one, so it costs none of its own); None: one process.
    """

    def __init__(
        self,
        engine: TransferEngine,
        flight: InFlight,
        l3: Any,
        expire: Callable[[], None],
        sync: Callable[[], None] | None = None,
    ) -> None:
        self._engine, self._flight, self._l3, self._expire = engine, flight, l3, expire
        self._sync = sync

    def __call__(
        self, upto: Any = None, *, wait: bool = False, attach: bool = False, sync: bool = False
    ) -> None:
        """Apply finished transfers in dispatch order, first waiting for the transfer ``upto``
        (a handle) or, with ``wait``, for all of them. ``attach``: also hang landed L3
        prefetches in the tree and expire pins -- only at the start of a public call, never
        inside an operation that holds nodes (an attach may split them). ``sync``: a request
        starts: agree the clock and the transfers landed (several processes; the other calls
        agree no transfer: what landed since is applied at the next request's start or at a
        wait)."""
        if attach and sync and self._sync is not None:
            self._sync()  # rides on the poll's agreement when copies are in flight
        # Waiting for all: every process has seen every copy land, so nothing to agree on
        # (a poll first would agree on part of them: an agreement for nothing). Several
        # processes: copies are agreed complete once a request, at its start; between, a copy
        # not yet agreed is one still in flight (what needs it waits: drain, upto).
        finished = [] if wait else self._engine.poll(agree=sync)
        if attach:
            self._expire()
        self._l3.poll(attach)
        if finished:
            self._flight.apply(finished)
        if wait or upto is not None:
            self._flight.apply(self._flight.wait(None if wait else upto))

    def drain(self) -> None:
        """Wait for every copy in flight and apply it (what holds pages that a caller needs)."""
        self(None, wait=True)
