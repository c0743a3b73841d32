"""Typed errors of the public contract (pure Python, importable by every room)."""

from __future__ import annotations


class HiCacheError(RuntimeError):
    """Misuse of cache state: unlock below zero, double free, foreign page ids."""


class OutOfPagesError(HiCacheError):
    """Pages could not be found even after eviction (everything left is locked).

    Attributes:
        needed: pages asked for.
        free: pages free at the time of the call.
        evictable: pages eviction could still free (0 when it has already tried).
        locked: pages held by locked (protected) nodes or owned by callers.
    """

    def __init__(self, message: str, *, needed: int = 0, free: int = 0,
                 evictable: int = 0, locked: int = 0) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.locked = locked
