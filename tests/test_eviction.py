"""Tests of hicache_jax/tree/eviction.py: priority keys, VictimHeap, and eviction order over a
RadixTree."""

from types import SimpleNamespace

import numpy as np
import pytest

from hicache_jax.tree.eviction import (
    SLRU_PROTECTED_HITS,
    EvictionPolicy,
    VictimHeap,
    eviction_order,
    hottest_first,
    priority_key,
)
from hicache_jax.tree.radix import RadixTree

PAGE_SIZES = [1, 16, 64]


def select_victims(policy, nodes, k: int) -> list:
    """The k least valuable of ``nodes``, least valuable first, popped from a VictimHeap (the
    library's select_victims had no user but these tests)."""
    heap = VictimHeap(policy, nodes)
    return [heap.pop() for _ in range(min(k, len(heap)))]


# Four leaves A, B, C, D built by _four_leaves; their eviction keys are
# (an insert that creates a node is its first access: hit_count 1)
#   A: created 1, last_access 7, hit_count 1, priority 3
#   B: created 2, last_access 6, hit_count 3, priority 1
#   C: created 3, last_access 8, hit_count 2, priority 2
#   D: created 4, last_access 4, hit_count 1, priority 0
EXPECTED_ORDER = {
    "lru": "DBAC",  # oldest last_access first
    "lfu": "DACB",  # fewest hits, ties by last_access
    "fifo": "ABCD",  # oldest created first
    "mru": "CABD",  # newest last_access first
    "filo": "DCBA",  # newest created first
    "priority": "DBCA",  # lowest priority first
    "slru": "DABC",  # probationary (hits < 2: A, D) by last_access, then protected B, C
    "value": "DBAC",  # a tree without worth_power: every worth 0, then by last_access
}


def _pages(ps, first):
    return np.full(2 * ps, first, np.int64)


def _four_leaves(ps, clock):
    tree = RadixTree(ps, clock=clock)
    nodes = {}
    for i, (name, prio) in enumerate(zip("ABCD", (3, 1, 2, 0))):
        clock.tick()
        nodes[name] = tree.insert(_pages(ps, i), [2 * i, 2 * i + 1], priority=prio).last_node
    clock.tick()  # t=5
    tree.insert(_pages(ps, 1), [2, 3])  # B: hit 2
    clock.tick()  # t=6
    tree.insert(_pages(ps, 1), [2, 3])  # B: hit 3
    clock.tick()  # t=7
    tree.match(_pages(ps, 0))  # A: touched, no hit
    clock.tick()  # t=8
    tree.insert(_pages(ps, 2), [4, 5])  # C: hit 2
    return tree, nodes


def _name(nodes, node):
    return next(k for k, v in nodes.items() if v is node)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_device_eviction_order(ps, policy, clock):
    tree, nodes = _four_leaves(ps, clock)
    assert [(n.created, n.last_access, n.hit_count, n.priority) for n in nodes.values()] == [
        (1, 7, 1, 3),
        (2, 6, 3, 1),
        (3, 8, 2, 2),
        (4, 4, 1, 0),
    ]
    heap = VictimHeap(policy, tree.evictable_device)
    order = []
    while heap:
        node = heap.pop()
        value, host = tree.delete_leaf(node)
        assert host is None and value.size == 2
        order.append(_name(nodes, node))
    assert "".join(order) == EXPECTED_ORDER[policy.value]
    assert tree.device_tokens == 0 and list(tree.nodes()) == []
    tree.check_invariants()


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("policy", list(EvictionPolicy))
def test_host_eviction_order_and_lock(ps, policy, clock):
    """Backed-up leaves evicted from device, then dropped from host in policy order; a lock holds
    one."""
    tree, nodes = _four_leaves(ps, clock)
    for i, node in enumerate(nodes.values()):
        tree.set_host_value(node, [10 + 2 * i, 11 + 2 * i])
        tree.evict_device(node)
    assert tree.device_tokens == 0 and tree.host_tokens == 8 * ps
    want = EXPECTED_ORDER[policy.value]
    tree.lock(nodes[want[0]])
    order = [_name(nodes, n) for n in select_victims(policy, tree.evictable_host, 4)]
    assert "".join(order) == want[1:]
    for node in (nodes[k] for k in order):
        assert tree.delete_leaf(node)[0] is None
    tree.unlock(nodes[want[0]])
    assert tree.evictable_host == {nodes[want[0]]}
    tree.check_invariants()


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_parent_becomes_victim_during_eviction(ps, clock):
    """Evicting a chain leaf-first: the parent joins the heap once its child is gone."""
    tree = RadixTree(ps, clock=clock)
    toks = np.arange(3 * ps, dtype=np.int64) % 7 + 1
    clock.tick()
    tree.insert(toks[:ps], [0])
    clock.tick()
    tree.insert(toks[: 2 * ps], [0, 1])
    clock.tick()
    leaf = tree.insert(toks, [0, 1, 2]).last_node
    clock.tick()
    other = tree.insert(np.zeros(ps, np.int64), [3]).last_node  # newest: evicted last under lru
    tree.lock(leaf)
    assert tree.evictable_device == {other}
    tree.unlock(leaf)
    heap = VictimHeap("lru", tree.evictable_device)
    freed = []
    while heap:
        node = heap.pop()
        parent = node.parent
        freed.extend(tree.delete_leaf(node)[0].tolist())
        if parent in tree.evictable_device:
            heap.push(parent)
    # The chain's last_access is 3 for every node (insert touches the whole path).
    assert freed == [2, 1, 0, 3]
    tree.check_invariants()


def test_keys_and_ties():
    def mk(i, la, cr, hc, pr):
        return SimpleNamespace(id=i, last_access=la, created=cr, hit_count=hc, priority=pr)

    a, b = mk(0, 5.0, 1.0, SLRU_PROTECTED_HITS, 0), mk(1, 5.0, 1.0, 0, 0)
    assert priority_key("slru")(a) > priority_key("slru")(b)
    assert priority_key(EvictionPolicy.LFU)(b) < priority_key("lfu")(a)
    # SLRU is not LFU: inside the probationary segment (hits < SLRU_PROTECTED_HITS) recency
    # decides, so a 1-hit leaf older than a 0-hit one goes first (LFU: the 0-hit one).
    once_old, never_new = mk(3, 1.0, 1.0, 1, 0), mk(4, 5.0, 1.0, 0, 0)
    assert select_victims("slru", [never_new, once_old], 1) == [once_old]
    assert select_victims("lfu", [never_new, once_old], 1) == [never_new]
    # Equal keys: the older id goes first, deterministically.
    c = mk(2, 5.0, 1.0, 0, 0)
    assert select_victims("lru", [c, b], 1) == [b]
    heap = VictimHeap("fifo", [c, b])
    assert [heap.pop().id, heap.pop().id] == [1, 2]
    with pytest.raises(IndexError):
        heap.pop()
    assert select_victims("mru", [a, b, c], 10) == [a, b, c]


def test_unknown_policy():
    with pytest.raises(ValueError, match="eviction='lru2' is not one of: lru, lfu"):
        EvictionPolicy.parse("lru2")
    with pytest.raises(ValueError, match="not one of"):
        VictimHeap("random", [])


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_eviction_order_simulates_leaves_first_eviction(ps, clock):
    """eviction_order lists what evict() would free first, changing nothing: leaves by key,
    a parent once all its device children have gone, never a locked parent or the root."""
    tree = RadixTree(ps, clock=clock)
    toks = np.arange(3 * ps, dtype=np.int64) % 7 + 1
    clock.tick()
    tree.insert(toks[: 2 * ps], [0, 1])
    clock.tick()
    leaf = tree.insert(toks, [0, 1, 2]).last_node  # chain: upper [0, 1], leaf [2]
    clock.tick()
    other = tree.insert(np.zeros(ps, np.int64), [3]).last_node
    upper = leaf.parent
    before = tree.snapshot()
    assert eviction_order("lru", tree.evictable_device, 100 * ps, tree.root) == [leaf, upper, other]
    assert eviction_order("lru", tree.evictable_device, ps, tree.root) == [leaf]  # the budget
    assert eviction_order("mru", tree.evictable_device, 100 * ps, tree.root) == [other, leaf, upper]
    tree.lock(leaf)  # locks the chain: only the other leaf can go
    assert eviction_order("lru", tree.evictable_device, 100 * ps, tree.root) == [other]
    tree.unlock(leaf)
    assert tree.snapshot() == before
    assert hottest_first("lru", [upper, other, leaf]) == [other, leaf, upper]  # ties: newer id


def test_the_value_clock_rises_with_a_cut_of_a_node_the_host_tier_holds(clock):
    """An eviction that cuts the tail of a node L2 holds (page-granular) raises the clock to
    its worth; a node that leaves L1 whole (its host copy kept) or a cut of a node L2 does not
    hold leaves it: the order ages with the cuts, not with every page L1 evicts
    (``RadixTree.trim_tail``; measured in benchmarks/RESULTS.md, "Layer groups")."""
    ps = 4
    tree = RadixTree(ps, clock=clock)
    tree.worth_power = 2.0
    clock.tick()
    a = tree.insert(np.full(8 * ps, 1, np.int64), np.arange(8)).last_node  # worth 64
    b = tree.insert(np.full(3 * ps, 2, np.int64), [8, 9, 10]).last_node  # worth 9
    tree.trim_tail(b, 1)  # no host copy: the clock stays
    assert tree.worth_clock == 0.0
    tree.set_host_value(a, np.arange(8))
    tree.evict_device(a)  # leaves L1 whole, kept on L2: the clock stays
    assert tree.worth_clock == 0.0
    c = tree.insert(np.full(6 * ps, 3, np.int64), np.arange(11, 17)).last_node  # worth 36
    tree.set_host_value(c, np.arange(8, 14))
    tree.trim_tail(c, 2)  # L1's cut of a node L2 holds: the clock takes its worth
    assert tree.worth_clock == 36.0
    tree.delete_leaf(a)  # a host-only leaf leaving L2: as before
    assert tree.worth_clock == 64.0


def test_value_eviction_keeps_a_long_prompt_over_a_short_one_used_later(clock):
    """GreedyDual: a node is worth its last prompt's pages squared above the clock; a long
    prompt's leaf outlives a short one touched after it, and the clock rises only when a node
    leaves the host tier (a device-only deletion leaves it)."""
    ps = 4
    tree = RadixTree(ps, clock=clock)
    tree.worth_power = 2.0
    clock.tick()
    long = tree.insert(np.full(8 * ps, 1, np.int64), np.arange(8)).last_node  # 8 pages: 64
    clock.tick()
    short = tree.insert(np.full(2 * ps, 2, np.int64), [8, 9]).last_node  # 2 pages: 4
    assert (long.worth, short.worth) == (64.0, 4.0)
    assert [n is short for n in select_victims("value", tree.evictable_device, 2)] == [True, False]
    assert [n is long for n in select_victims("lru", tree.evictable_device, 2)] == [True, False]
    tree.delete_leaf(short)  # device only: no host copy, the clock stays
    assert tree.worth_clock == 0.0
    clock.tick()
    tree.match(np.full(8 * ps, 1, np.int64))  # touched again by the same prompt: no change
    assert long.worth == 64.0
    tree.set_host_value(long, np.arange(8))  # a host copy: its deletion raises the clock
    tree.evict_device(long)
    tree.delete_leaf(long)
    assert tree.worth_clock == 64.0
    clock.tick()
    again = tree.insert(np.full(2 * ps, 2, np.int64), [8, 9]).last_node
    assert again.worth == 64.0 + 4.0  # the clock ages every node after it
    upper = tree.match(np.full(ps, 2, np.int64)).node  # a split copies the worth
    assert upper is not again and upper.worth == again.worth == 68.0
