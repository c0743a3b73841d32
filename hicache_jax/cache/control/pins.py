"""Pins: prefixes an operator keeps from eviction (ARCHITECTURE.md, "Control API").

* A **device pin** is a lock this part holds on the deepest device node of the prefix (device
  residency is prefix-closed, so it keeps the whole device part on device and, as every lock,
  its host copies): those pages count as protected, never as evictable.
* A **host pin** is the tree's host pin (:meth:`~hicache_jax.tree.tiers.TierIndex.pin_host`) on
  the deepest node of the prefix's part held on host continuously from the root: those host
  copies are never host-evicted nor dropped as redundant; their device pages may still be
  evicted (they are backed up, so the node stays host-only and a load-back revives it).

A pin names its node, so it survives splits (the node keeps its lower part), device eviction
and load-backs. Each tier's pinned pages -- the union of its pinned prefixes -- stay within
``cfg.pin_max_share`` of that pool; a pin beyond it raises :class:`PinLimitError` before any
change. Pins expire on the cache's clock, checked when the cache polls (the start of its calls
that may evict). ``reset()`` builds a new, empty part.

Threading: the cache's thread only.
"""

from __future__ import annotations

import collections
import enum
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError, PinLimitError
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.radix import RadixTree
from hicache_jax.validation import is_real, parse_enum


class PinTier(enum.Enum):
    DEVICE = "device"
    HOST = "host"


@dataclass(eq=False)
class Pin:
    node: TreeNode
    tier: PinTier
    tokens: int
    expires: float  # math.inf without a ttl


class Pins:
    """The pins of one cache (see the module docstring).

    Args:
        tree: the cache's tree.
        clock: the cache's clock (expiry).
        share: ``cfg.pin_max_share``.
        device_pages, host_pages: the pools' sizes (the limits are ``floor(share * pages)``).
    """

    def __init__(
        self,
        tree: RadixTree,
        clock: Callable[[], float],
        share: float,
        device_pages: int,
        host_pages: int,
    ) -> None:
        self._tree, self._clock = tree, clock
        self._limit = {
            PinTier.DEVICE: int(share * device_pages),
            PinTier.HOST: int(share * host_pages),
        }
        self._pins: dict[tuple, Pin] = {}
        self._next = math.inf  # earliest expiry

    @staticmethod
    def parse(tier: Any, ttl_s: Any) -> tuple[PinTier, float | None]:
        """Checked ``tier`` and ``ttl_s`` (ValueError / TypeError naming the argument)."""
        tier = parse_enum(PinTier, "tier", tier)
        if ttl_s is not None and (not is_real(ttl_s) or not math.isfinite(ttl_s) or ttl_s <= 0):
            raise ValueError(f"ttl_s={ttl_s!r} must be None or a finite number of seconds > 0")
        return tier, ttl_s

    def pin(self, arr: np.ndarray, extra_key: Hashable, tier: PinTier, ttl_s: float | None) -> int:
        """Pin the part of validated whole-page ``arr`` held on ``tier``; returns its tokens.
        A second pin of the same tokens, namespace and tier renews its ttl only."""
        self.expire()
        expires = math.inf if ttl_s is None else self._clock() + ttl_s
        key = (tier, extra_key, arr.tobytes())
        if key in self._pins:
            pin = self._pins[key]
            pin.expires = expires
            self._next = min(self._next, expires)
            return pin.tokens
        path = self._held_path(arr, extra_key, tier)
        if not path:
            raise HiCacheError(
                f"pin: no page of this prefix is held on {tier.value}: nothing "
                "to pin (lookup() says where it is)"
            )
        pinned = self._pinned_nodes(tier)
        have = sum(n.num_pages for n in pinned)
        add = sum(t // self._tree.page_size for n, t in path if n not in pinned)
        limit = self._limit[tier]
        if have + add > limit:
            raise PinLimitError(
                f"pin of {add} more {tier.value} pages would hold {have + add} pinned pages, "
                f"beyond pin_max_share's limit of {limit} ({have} pinned now): unpin some, or "
                "raise HiCacheConfig.pin_max_share",
                tier=tier.value,
                pinned=have,
                requested=add,
                limit=limit,
            )
        tokens = sum(t for _, t in path)
        node = self._tree.node_at(arr[:tokens], extra_key)
        (self._tree.lock if tier is PinTier.DEVICE else self._tree.pin_host)(node)
        self._pins[key] = Pin(node, tier, tokens, expires)
        self._next = min(self._next, expires)
        return tokens

    def unpin(self, arr: np.ndarray, extra_key: Hashable, tier: PinTier) -> int:
        """Undo the pin of exactly these tokens; returns the tokens it held.

        Raises:
            HiCacheError: no such pin (never pinned, unpinned, expired, or invalidated).
        """
        self.expire()
        pin = self._pins.get((tier, extra_key, arr.tobytes()))
        if pin is None:
            raise HiCacheError(
                f"unpin: these {arr.size} tokens (extra_key={extra_key!r}) are "
                f"not pinned on {tier.value} (never pinned, or unpinned, "
                "expired or invalidated since)"
            )
        self._release(pin)
        return pin.tokens

    def expire(self) -> None:
        """Drop the pins whose ttl has passed on the cache's clock (cheap when none has)."""
        if not self._pins or self._next == math.inf:
            return
        now = self._clock()
        if now < self._next:
            return
        for pin in [p for p in self._pins.values() if p.expires <= now]:
            self._release(pin)
        self._next = min((p.expires for p in self._pins.values()), default=math.inf)

    def drop_under(self, nodes: set[TreeNode]) -> int:
        """Release the pins whose node is in ``nodes`` (about to be invalidated); their count."""
        gone = [p for p in self._pins.values() if p.node in nodes]
        for pin in gone:
            self._release(pin)
        return len(gone)

    def device_locks(self, nodes: set[TreeNode]) -> collections.Counter:
        """Per node of ``nodes``: the locks device pins hold on it."""
        held: collections.Counter = collections.Counter()
        for pin in self._pins.values():
            if pin.tier is PinTier.DEVICE:
                for n in _chain(pin.node):
                    if n in nodes:
                        held[n] += 1
        return held

    def _release(self, pin: Pin) -> None:
        del self._pins[next(k for k, p in self._pins.items() if p is pin)]
        (self._tree.unlock if pin.tier is PinTier.DEVICE else self._tree.unpin_host)(pin.node)

    def _held_path(
        self, arr: np.ndarray, extra_key: Hashable, tier: PinTier
    ) -> list[tuple[TreeNode, int]]:
        """The root-first part of ``arr``'s cached path held on ``tier`` (continuously)."""
        out = []
        for node, tokens in self._tree.peek_path(arr, extra_key):
            held = node.value if tier is PinTier.DEVICE else node.host_value
            if held is None:
                break
            out.append((node, tokens))
        return out

    def _pinned_nodes(self, tier: PinTier) -> set[TreeNode]:
        # a copy first (in C): stats() may run on another thread while a pin is added
        return {n for p in tuple(self._pins.values()) if p.tier is tier for n in _chain(p.node)}

    # -- what the cache reports and checks ------------------------------------------------

    def stats(self) -> dict[str, int]:
        return {
            "pins": len(self._pins),
            "pinned_device_pages": sum(n.num_pages for n in self._pinned_nodes(PinTier.DEVICE)),
            "pinned_host_pages": sum(n.num_pages for n in self._pinned_nodes(PinTier.HOST)),
        }

    def locked_nodes(self) -> list[tuple[TreeNode, int]]:
        """``(node, 1)`` per device pin: the locks this part holds (for check_invariants)."""
        return [(p.node, 1) for p in self._pins.values() if p.tier is PinTier.DEVICE]

    def check(self, nodes: list[TreeNode]) -> None:
        """Every pin's node is in the tree; ``host_pins`` of every node equals the host pins
        at or below it. Raises HiCacheError."""
        expected: collections.Counter = collections.Counter()
        for pin in self._pins.values():
            if not self._tree.owns(pin.node) or pin.node is self._tree.root:
                raise HiCacheError(f"invariant: a pin names {pin.node!r}, not in the tree")
            if pin.tier is PinTier.HOST:
                for n in _chain(pin.node):
                    expected[n] += 1
        for n in nodes:
            if n.host_pins != expected[n]:
                raise HiCacheError(
                    f"invariant: {n!r} host_pins {n.host_pins} != "
                    f"{expected[n]} (host pins at or below it)"
                )


def _chain(node: TreeNode) -> list[TreeNode]:
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out
