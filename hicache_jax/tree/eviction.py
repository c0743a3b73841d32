"""Eviction priority keys (pure Python; no jax import).

A strategy maps a tree node to a sort key; the node with the *smallest* key is the least
valuable and is evicted first. Selection is a heap over the tree's evictable set, so picking
k victims costs O(n + k log n) for n evictable leaves, and parents that become evictable while
an eviction runs are pushed onto the same heap (see :class:`VictimHeap`).

Nodes are duck-typed: any object with ``id``, ``last_access``, ``created``, ``hit_count`` and
``priority`` attributes works (the tree's ``TreeNode`` has them).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any, Generic, Protocol, TypeVar

from hicache_jax.spec import EvictionPolicy


class _Rankable(Protocol):
    id: int
    last_access: float
    created: float
    hit_count: int
    priority: int


_N = TypeVar("_N", bound=_Rankable)


#: The ``value`` eviction (GreedyDual): a node touched by a prompt of ``n`` whole pages is worth
#: at least ``clock + n ** WORTH_POWER`` (its recompute: a prefill's attention grows with the
#: square of its length), the clock being the highest worth of a node that left the host tier
#: or whose tail an eviction cut while the host tier held it (``RadixTree.worth_clock``,
#: ``RadixTree.trim_tail``). The least worth
#: goes first: a long prompt's pages outlive a short one's used as recently, and every node
#: ages as the clock rises. Measured on Mooncake's trace with a recurrent hybrid
#: (``bench_state_replay``), where a hit needs a checkpoint that costs six pages: power 2 keeps
#: the long prompts whose reuse pays for their checkpoints (1 and 3 measured lower).
WORTH_POWER = 2.0

#: hit_count at which an SLRU node moves from the probationary to the protected segment.
SLRU_PROTECTED_HITS = 2

# The one definition of each strategy's order: the key's fields, then the id tie-break, then
# the node, in one flat tuple (one call per node, no nested tuple: the heap's entries). Ids are
# unique, so two entries never compare their nodes.
_ENTRIES: dict[EvictionPolicy, Callable[[Any], tuple]] = {
    EvictionPolicy.LRU: lambda n: (n.last_access, n.id, n),
    EvictionPolicy.LFU: lambda n: (n.hit_count, n.last_access, n.id, n),
    EvictionPolicy.FIFO: lambda n: (n.created, n.id, n),
    EvictionPolicy.MRU: lambda n: (-n.last_access, n.id, n),
    EvictionPolicy.FILO: lambda n: (-n.created, n.id, n),
    EvictionPolicy.PRIORITY: lambda n: (n.priority, n.last_access, n.id, n),
    EvictionPolicy.VALUE: lambda n: (n.worth, n.last_access, n.id, n),
    EvictionPolicy.SLRU: lambda n: (
        int(n.hit_count >= SLRU_PROTECTED_HITS),
        n.last_access,
        n.id,
        n,
    ),
}


def priority_key(policy: str | EvictionPolicy | None) -> Callable[[_Rankable], tuple]:
    """Return ``key(node) -> tuple``; smaller keys are evicted first.

    The node id is *not* part of the key; :class:`VictimHeap` appends it as the tie-break so
    that the order is deterministic for equal keys (older node ids first).
    """
    entry = _ENTRIES[EvictionPolicy.parse(policy)]
    return lambda n: entry(n)[:-2]


class VictimHeap(Generic[_N]):
    """Min-heap of eviction candidates under one strategy.

    Args:
        policy: the eviction strategy.
        nodes: initial candidates (typically the tree's evictable set).

    Keys are computed at push time; a caller that mutates a node after pushing it must check
    the node is still eligible when it pops it (eviction loops do: a popped node may have been
    locked or removed in the meantime).
    """

    __slots__ = ("_entry", "_heap")

    def __init__(self, policy: str | EvictionPolicy | None, nodes: Iterable[_N] = ()) -> None:
        self._entry = _ENTRIES[EvictionPolicy.parse(policy)]
        self._heap = list(map(self._entry, nodes))
        heapq.heapify(self._heap)

    def push(self, node: _N) -> None:
        heapq.heappush(self._heap, self._entry(node))

    def pop(self) -> _N:
        """Remove and return the least valuable node; IndexError when empty."""
        return heapq.heappop(self._heap)[-1]

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)


#: Strategies under which a node just inserted is among the first to go (newest, or fewest hits,
#: or probationary): new pages land at the eviction end itself.
FRESH_FIRST = frozenset(
    {EvictionPolicy.MRU, EvictionPolicy.FILO, EvictionPolicy.LFU, EvictionPolicy.SLRU}
)


def eviction_order(
    policy: str | EvictionPolicy | None, leaves: Iterable[Any], budget_tokens: int, root: Any
) -> list:
    """The device nodes eviction would take first, in order, until ``budget_tokens`` are
    covered, without changing anything: leaves by priority, and a parent once every one of its
    device children has gone before it (as :meth:`HiCache.evict` frees them), unless it is
    locked or ``root``. Nodes need ``parent``, ``device_children``, ``lock_ref``,
    ``num_tokens`` and the key fields."""
    heap: VictimHeap[Any] = VictimHeap(policy, leaves)
    left: dict = {}
    order, covered = [], 0
    while heap and covered < budget_tokens:
        node = heap.pop()
        order.append(node)
        covered += node.num_tokens
        parent = node.parent
        if parent is not root and parent.lock_ref == 0:
            n = left.get(parent, parent.device_children) - 1
            left[parent] = n
            if n == 0:
                heap.push(parent)
    return order


def hottest_first(policy: str | EvictionPolicy | None, nodes: Iterable[Any]) -> list:
    """``nodes`` most valuable first: the reverse of eviction order."""
    return sorted(nodes, key=_ENTRIES[EvictionPolicy.parse(policy)], reverse=True)
