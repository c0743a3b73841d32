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

    def __init__(
        self, message: str, *, needed: int = 0, free: int = 0, evictable: int = 0, locked: int = 0
    ) -> None:
        super().__init__(message)
        self.needed = needed
        self.free = free
        self.evictable = evictable
        self.locked = locked


class PinLimitError(HiCacheError):
    """A pin would take a tier's pinned pages beyond ``HiCacheConfig.pin_max_share`` of its pool.

    Attributes:
        tier: "device" or "host".
        pinned: pages of that tier pinned before the call.
        requested: pages the pin would add (those of its prefix not pinned yet).
        limit: the most pages of that tier pins may hold.
    """

    def __init__(self, message: str, *, tier: str, pinned: int, requested: int, limit: int) -> None:
        super().__init__(message)
        self.tier, self.pinned, self.requested, self.limit = tier, pinned, requested, limit


class InvalidateLockedError(HiCacheError):
    """An invalidation would drop pages that requests in flight hold (a caller's lock, a
    load-back or an L3 prefetch landing there): nothing was dropped.

    Attributes:
        locked: ``[(tokens of the locked prefix, locks held by requests)]``, root-most first.
    """

    def __init__(self, message: str, *, locked: list[tuple[int, int]]) -> None:
        super().__init__(message)
        self.locked = locked


class GroupTimeoutError(HiCacheError):
    """A peer process did not reach an agreement within the group's timeout (it died, hangs,
    or stopped calling the cache), or could not be reached at all. ``process``: the missing
    one."""

    def __init__(self, message: str, *, process: int) -> None:
        super().__init__(message)
        self.process = process


class GroupDivergedError(HiCacheError):
    """Processes disagree: different calls at the same step, or a value that must be equal
    (a config field, the tree's digest) differs. ``field``: what differs first."""

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message)
        self.field = field


class GroupConnectError(GroupTimeoutError):
    """A group's socket transport could not listen on, or connect to, a process's address
    (a wrong ``host``, a firewall, an address another host cannot route to). ``process``: the
    one whose address failed."""
