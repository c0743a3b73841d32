"""ThreadOwner: which thread may call a HiCache.

One thread owns the cache and makes every call but ``stats()``; a call from any other thread
raises :class:`HiCacheError`. The first call after construction takes ownership, so a cache built
on one thread may be served from another; :meth:`ThreadOwner.release` hands it over explicitly,
and the cache of an owner that has exited goes to the next caller. The fast path (the owner
calling) is one ``threading.get_ident()`` compared with :attr:`ThreadOwner.ident`, in the cache.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from hicache_jax.errors import HiCacheError


class ThreadOwner:
    """The owning thread of one cache (``ident`` None: not owned yet, or handed over)."""

    def __init__(self) -> None:
        self.ident: int | None = None
        self._thread = threading.current_thread()
        self._name = ""
        self._lock = threading.Lock()
        self.closed = False

    def take(self) -> None:
        """The slow path of a call from a thread other than ``ident``: take the cache if it is
        free (first call, released, or the owner exited), else raise."""
        with self._lock:
            if self.closed:
                raise HiCacheError(
                    "this HiCache is closed: build a new one (only stats() answers after close())"
                )
            if self.ident is not None and not self._thread.is_alive():
                # The owner exited, but its ident may now be a live thread's (CPython reuses
                # them at once), which passes the fast path: that thread owns the cache.
                heir = next((t for t in threading.enumerate() if t.ident == self.ident), None)
                if heir is not None:
                    self._thread, self._name = heir, heir.name
            # First call, handed over with release(), or the owner has exited.
            if self.ident is None or not self._thread.is_alive():
                self.ident = threading.get_ident()
                self._thread = threading.current_thread()
                self._name = self._thread.name
                return
        raise HiCacheError(
            f"this HiCache is owned by thread {self._name!r}, called from "
            f"{threading.current_thread().name!r}: a cache is not thread-safe. Call it from its "
            "owning thread, or hand it over: release_thread() on the owner, then the next call "
            "from any thread takes it"
        )

    def release(self) -> None:
        with self._lock:
            self.ident, self._name = None, ""

    def close(self) -> None:
        with self._lock:
            self.closed, self.ident = True, None


def publishes(method: Callable) -> Callable:
    """A public call that may record KV events: its events form one batch, sealed (published)
    when it returns. With events off that is one no-op call of the NullRecorder. It runs the
    owning-thread check (:meth:`HiCache._guard`) for the method and then, before the method
    changes anything, the agreement check when one is due."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        self._guard()  # first: another thread must not seal the owner's batch
        # cache/agreement.py: every N-th call compares the processes first (before any change)
        self._agreement.before_call(method.__name__)
        try:
            return method(self, *args, **kwargs)
        finally:
            self._events.end_call()

    return call
