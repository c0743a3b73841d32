"""Tests of hicache_jax/tree/radix.py: unit tests, bad input, and a state machine against a
model."""

import ast
import hashlib
import pathlib

import numpy as np
import pytest
import xxhash
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hicache_jax import validation
from hicache_jax.errors import HiCacheError
from hicache_jax.tree import node as tree_node
from hicache_jax.tree import radix
from hicache_jax.tree import tiers as tree_index
from hicache_jax.tree.eviction import EvictionPolicy, VictimHeap
from hicache_jax.tree.hashing import chain_hashes, namespace_hash
from hicache_jax.tree.radix import RadixTree

PAGE_SIZES = [1, 16, 64]


def seq(ps, pages, tail=0, seed=0):
    """Tokens: ``pages`` whole pages (page i all equal to pages[i]) + ``tail`` extra tokens."""
    toks = np.repeat(np.asarray(pages, np.int64), ps)
    return np.concatenate([toks, np.full(tail, 999, np.int64)])


@pytest.fixture(params=PAGE_SIZES)
def ps(request):
    return request.param


@pytest.mark.parametrize("module", [radix, tree_index, tree_node, validation])
def test_radix_imports_no_jax(module):
    tree = ast.parse(pathlib.Path(module.__file__).read_text())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(m and m.split(".")[0] == "jax" for m in mods), mods


def test_insert_then_match_ignores_partial_page(ps, clock):
    t = RadixTree(ps, clock=clock)
    r = t.insert(seq(ps, [1, 2, 3], tail=ps - 1), [10, 11, 12])
    assert r.prefix_len == 0 and r.duplicate_pages.size == 0 and r.existing_nodes == []
    assert r.last_node.num_tokens == 3 * ps and r.last_node.num_pages == 3
    m = t.match(seq(ps, [1, 2, 3, 4], tail=ps - 1))
    assert m.device_pages.dtype == np.int32 and m.device_pages.tolist() == [10, 11, 12]
    assert (m.device_len, m.host_len, m.host_nodes) == (3 * ps, 0, ())
    assert m.node is r.last_node is m.last_device_node
    assert t.match(seq(ps, [5])).node is t.root
    assert t.match(np.zeros(ps - 1, np.int64)).device_len == 0  # shorter than a page
    assert t.device_tokens == 3 * ps == t.evictable_device_tokens
    t.check_invariants()


def test_match_splits_node_and_carries_state(ps, clock):
    t = RadixTree(ps, clock=clock)
    leaf = t.insert(seq(ps, [1, 2, 3, 4]), [0, 1, 2, 3]).last_node
    t.set_host_value(leaf, [7, 6, 5, 4])
    t.insert(seq(ps, [1, 2, 3, 4]), [0, 1, 2, 3])  # hit_count 2 (the creating insert: 1)
    t.lock(leaf)
    clock.tick()
    m = t.match(seq(ps, [1, 2, 9]))
    upper = m.node
    assert m.device_pages.tolist() == [0, 1] and upper is not leaf and leaf.parent is upper
    assert upper.value.tolist() == [0, 1] and leaf.value.tolist() == [2, 3]
    assert upper.host_value.tolist() == [7, 6] and leaf.host_value.tolist() == [5, 4]
    assert (upper.lock_ref, upper.hit_count, upper.created) == (1, 2, leaf.created)
    assert upper.last_access == clock() and leaf.last_access < clock()
    assert np.array_equal(
        np.concatenate([upper.page_hashes, leaf.page_hashes]),
        chain_hashes(namespace_hash(None), seq(ps, [1, 2, 3, 4]).reshape(4, ps)),
    )
    t.unlock(leaf)  # the lock walk covers the new parent
    assert upper.lock_ref == 0 and leaf in t.evictable_device
    t.check_invariants()


def test_mismatch_inside_page_rounds_down(clock):
    t = RadixTree(4, clock=clock)
    t.insert(np.arange(12), [0, 1, 2])
    q = np.arange(12)
    q[6] = 100  # differs inside the second page
    m = t.match(q)
    assert m.device_len == 4 and m.device_pages.tolist() == [0]
    r = t.insert(q, [0, 5, 6])
    assert r.prefix_len == 4 and len(t.root.children) == 1 and len(m.node.children) == 2
    t.check_invariants()


def test_insert_duplicates_and_existing_nodes(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    r = t.insert(seq(ps, [1, 2, 3]), [0, 9, 8], priority=5)
    assert r.prefix_len == 2 * ps and r.duplicate_pages.tolist() == [9]
    assert r.existing_nodes == [a] and a.hit_count == 2 and a.priority == 5
    assert t.match(seq(ps, [1, 2, 3])).device_pages.tolist() == [0, 1, 8]
    r2 = t.insert(seq(ps, [1, 2, 3]), [0, 1, 8], chunked=True)
    assert r2.duplicate_pages.size == 0 and a.hit_count == 2  # chunked: no hit
    assert [n.hit_count for n in r2.existing_nodes] == [2, 1]
    c = t.insert(seq(ps, [1, 2, 3, 7]), [0, 1, 8, 7], chunked=True).last_node
    assert c.hit_count == 0  # a chunk's new node: its request's final insert counts the access
    t.check_invariants()


def test_insert_revives_host_only_nodes(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    b = t.insert(seq(ps, [1, 2, 3, 4]), [0, 1, 2, 3]).last_node
    for node, host in ((b, [10, 11]), (a, [12, 13])):
        t.set_host_value(node, host)
    assert t.evict_device(b).tolist() == [2, 3] and t.evict_device(a).tolist() == [0, 1]
    m = t.match(seq(ps, [1, 2, 3]))  # ends inside b: splits it
    assert (m.device_len, m.host_len, m.last_device_node) == (0, 3 * ps, t.root)
    assert m.host_nodes[0] is a and m.host_nodes[1].host_value.tolist() == [10]
    r = t.insert(seq(ps, [1, 2, 3, 4]), [20, 21, 22, 23])
    assert r.prefix_len == 4 * ps and r.duplicate_pages.size == 0
    assert r.revived_nodes == r.existing_nodes and len(r.revived_nodes) == 3
    assert b.value.tolist() == [23] and b.host_value.tolist() == [11]
    assert t.match(seq(ps, [1, 2, 3, 4])).device_pages.tolist() == [20, 21, 22, 23]
    assert t.evictable_host == set() and t.evictable_device == {b}
    t.check_invariants()


def test_extra_key_namespaces(ps, clock):
    t = RadixTree(ps, clock=clock)
    x = t.insert(seq(ps, [1, 2]), [0, 1], extra_key="lora-a").last_node
    y = t.insert(seq(ps, [1, 2]), [2, 3], extra_key="lora-b").last_node
    assert x is not y and len(t.root.children) == 2
    assert t.match(seq(ps, [1, 2]), extra_key="lora-b").device_pages.tolist() == [2, 3]
    assert t.match(seq(ps, [1, 2])).device_len == 0
    assert x.page_hashes[0] != y.page_hashes[0]
    t.check_invariants()


def test_page_hashes_are_xxh3_chain():
    t = RadixTree(2)
    leaf = t.insert([5, 6, 7, 8], [0, 1], extra_key=("t", 1)).last_node
    h = int.from_bytes(
        hashlib.blake2b(b"hicache-ns:" + repr(("t", 1)).encode(), digest_size=8).digest(), "little"
    )
    want = []
    for page in ([5, 6], [7, 8]):
        h = xxhash.xxh3_64_intdigest(np.asarray(page, "<i8").tobytes(), seed=h)
        want.append(h)
    assert leaf.page_hashes.dtype == np.uint64 and leaf.page_hashes.tolist() == want


def test_lock_protects_and_accounts(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1]), [0]).last_node
    b = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    t.lock(b)
    t.lock(b)
    assert t.evictable_device == set() and t.protected_device_tokens == 2 * ps
    assert (a.lock_ref, b.lock_ref, t.evictable_device_tokens) == (2, 2, 0)
    t.unlock(b)
    t.unlock(b)
    assert t.evictable_device == {b} and t.protected_device_tokens == 0
    t.lock(t.root)  # no-op
    t.unlock(t.root)
    before = t.snapshot()
    with pytest.raises(HiCacheError, match="below zero"):
        t.unlock(b)
    assert t.snapshot() == before
    t.check_invariants()


def test_lock_host_only_node_blocks_host_eviction(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    t.set_host_value(a, [3, 4])
    t.evict_device(a)
    assert t.evictable_host == {a} and t.host_tokens == 2 * ps and t.device_tokens == 0
    t.lock(a)
    assert t.evictable_host == set()
    with pytest.raises(HiCacheError, match="deletable"):
        t.delete_leaf(a)
    t.unlock(a)
    value, host = t.delete_leaf(a)
    assert value is None and host.tolist() == [3, 4] and t.host_tokens == 0
    assert list(t.nodes()) == [] and a.parent is None
    with pytest.raises(HiCacheError, match="not in this tree"):
        t.lock(a)
    t.check_invariants()


def test_evict_device_then_parent_becomes_evictable(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1]), [0]).last_node
    b = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    assert t.evictable_device == {b}
    with pytest.raises(HiCacheError, match="no host copy"):
        t.evict_device(b)
    with pytest.raises(HiCacheError, match="not device-evictable"):
        t.evict_device(a)
    t.set_host_value(b, [5])
    t.evict_device(b)
    assert t.evictable_device == {a} and t.evictable_host == {b}
    with pytest.raises(HiCacheError, match="deletable"):
        t.delete_leaf(a)  # has a (host-only) child
    with pytest.raises(HiCacheError, match="no host copy"):
        t.evict_device(a)  # ... and no host copy of its own: back it up first
    assert t.delete_leaf(b)[1].tolist() == [5]
    assert t.evictable_device == {a}
    value, host = t.delete_leaf(a)
    assert value.tolist() == [0] and host is None and t.device_tokens == 0
    t.check_invariants()


def test_set_value_load_back_root_first(ps, clock):
    t = RadixTree(ps, clock=clock)
    a = t.insert(seq(ps, [1]), [0]).last_node
    b = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    t.set_host_value(b, [9])
    t.set_host_value(a, [8])
    t.evict_device(b)
    t.evict_device(a)
    before = t.snapshot()
    with pytest.raises(HiCacheError, match="root-first"):
        t.set_value(b, [4])
    with pytest.raises(ValueError, match="device_ids has 2 ids"):
        t.set_value(a, [4, 5])
    assert t.snapshot() == before
    t.set_value(a, [4])
    t.set_value(b, [5])
    with pytest.raises(HiCacheError, match="already holds"):
        t.set_value(b, [6])
    assert t.match(seq(ps, [1, 2])).device_pages.tolist() == [4, 5]
    t.check_invariants()


def test_reset_and_nodes(ps, clock):
    t = RadixTree(ps, clock=clock)
    t.insert(seq(ps, [1, 2]), [0, 1])
    t.insert(seq(ps, [3]), [2])
    t.match(seq(ps, [1]))
    assert sorted(n.num_tokens for n in t.nodes()) == [ps, ps, ps]
    t.reset()
    assert list(t.nodes()) == [] and t.device_tokens == 0 and not t.evictable_device
    t.insert(seq(ps, [1]), [0])  # pages are free to be taken again
    t.check_invariants()


# ----------------------------------------------------------------------------- bad input


def _tree_with_content(ps=4):
    t = RadixTree(ps)
    a = t.insert(seq(ps, [1, 2]), [0, 1]).last_node
    t.lock(a)
    return t, a


@pytest.mark.parametrize(
    "tokens, exc, msg",
    [
        ([1.0, 2.0, 3.0, 4.0], TypeError, "integers"),
        (np.array([True] * 4), TypeError, "integers"),
        (np.zeros((2, 4), np.int64), ValueError, "1-D"),
        ([1, -2, 3, 4], ValueError, ">= 0"),
        (np.array([2**63 + 1] * 4, np.uint64), ValueError, "int64"),
    ],
)
def test_bad_tokens(tokens, exc, msg):
    t, _ = _tree_with_content()
    before = t.snapshot()
    with pytest.raises(exc, match=msg):
        t.insert(tokens, [5])
    with pytest.raises(exc, match=msg):
        t.match(tokens)
    assert t.snapshot() == before


@pytest.mark.parametrize(
    "page_ids, exc, msg",
    [
        ([5], ValueError, "has 1 ids, expected 3"),
        ([5, 6, 7, 8], ValueError, "expected 3"),
        (np.array([5.0, 6.0, 7.0]), TypeError, "integers"),
        (np.zeros((3, 1), np.int32), ValueError, "1-D"),
        ([5, -6, 7], ValueError, "negative ids"),
        ([5, 5, 7], ValueError, "duplicate"),
        ([0, 1, 1], ValueError, "duplicate"),
        ([0, 1, 0], ValueError, "duplicate"),
        ([1, 5, 7], HiCacheError, "already holds"),  # tree page 1 passed at position 0
        ([0, 7, 1], HiCacheError, "already holds"),  # locked path page 1 moved to a new position
    ],
)
def test_bad_page_ids(page_ids, exc, msg):
    t, _ = _tree_with_content()
    before = t.snapshot()
    with pytest.raises(exc, match=msg):
        t.insert(seq(4, [1, 2, 3]), page_ids)
    assert t.snapshot() == before
    t.check_invariants()


def test_bad_other_arguments():
    t, a = _tree_with_content()
    before = t.snapshot()
    with pytest.raises(TypeError, match="extra_key must be hashable"):
        t.insert(seq(4, [1]), [9], extra_key=["unhashable"])
    with pytest.raises(TypeError, match="priority must be an int"):
        t.insert(seq(4, [1]), [9], priority=1.5)
    with pytest.raises(TypeError, match="TreeNode"):
        t.lock("node")
    with pytest.raises(HiCacheError, match="not in this tree"):
        t.lock(RadixTree(4).insert(seq(4, [1]), [0]).last_node)
    with pytest.raises(HiCacheError, match="not device-evictable"):
        t.evict_device(a)  # locked
    with pytest.raises(HiCacheError, match="deletable"):
        t.delete_leaf(a)
    with pytest.raises(ValueError, match="host_ids has 1 ids, expected 2"):
        t.set_host_value(a, [3])
    with pytest.raises(HiCacheError, match="non-root"):
        t.set_host_value(t.root, [])
    t.set_host_value(a, [3, 4])
    with pytest.raises(HiCacheError, match="no host copy yet"):
        t.set_host_value(a, [5, 6])
    b = t.insert(seq(4, [7]), [9]).last_node
    with pytest.raises(HiCacheError, match="host_ids has pages the tree already holds"):
        t.set_host_value(b, [4])
    with pytest.raises(ValueError, match="page_size"):
        RadixTree(0)
    t.unlock(a)
    t.delete_leaf(b)
    t.lock(a)
    assert t.snapshot() != before  # host copy was recorded by the one successful call
    t.check_invariants()


# ----------------------------------------------------------------------------- state machine


def page_tokens(ps, p):
    """Page pattern p in 0..3; patterns 2k and 2k+1 differ only in their last token."""
    return [p % 2] if ps == 1 else [p // 2] * (ps - 1) + [p % 2]


class TreeMachine(RuleBasedStateMachine):
    """Random operations against a model: (extra_key, page-aligned prefix) -> per-page state."""

    def __init__(self):
        super().__init__()
        self.now = 0.0

    def clock(self):
        return self.now

    @initialize(ps=st.sampled_from([1, 2, 4]))
    def setup(self, ps):
        self.ps = ps
        self.tree = RadixTree(ps, clock=self.clock)
        self.model = {}  # (ek, prefix tuple) -> {"dev", "host", "hits"}
        self.locks = []  # locked node handles, with their (ek, prefix tuple)
        self.next_dev = self.next_host = 0

    # -- helpers -------------------------------------------------------------------------------
    def tokens(self, pages, tail):
        toks = [t for p in pages for t in page_tokens(self.ps, p)]
        return np.asarray(toks + [3] * tail, np.int64)

    def keys(self, ek, toks):
        return [
            (ek, tuple(toks[: (k + 1) * self.ps].tolist())) for k in range(len(toks) // self.ps)
        ]

    def node_keys(self, node):
        path = self.tree.path_tokens(node)
        return self.keys(node.extra_key, path)[-node.num_pages :]

    def fresh_dev(self, n):
        self.next_dev += n
        return list(range(self.next_dev - n, self.next_dev))

    def expect_match(self, ek, toks):
        dev, host = [], 0
        for key in self.keys(ek, toks):
            e = self.model.get(key)
            if e is None:
                break
            if e["dev"] is not None and host == 0:
                dev.append(e["dev"])
            else:  # device residency is prefix-closed: the rest is host-only
                host += 1
        return dev, host

    # -- rules ---------------------------------------------------------------------------------
    pages_st = st.lists(st.integers(0, 3), max_size=6)

    @rule(
        pages=pages_st,
        tail=st.integers(0, 3),
        ek=st.sampled_from([None, "x"]),
        reuse=st.booleans(),
        chunked=st.booleans(),
        prio=st.integers(0, 2),
    )
    def insert(self, pages, tail, ek, reuse, chunked, prio):
        self.now += 1
        toks = self.tokens(pages, tail % self.ps)
        keys = self.keys(ek, toks)
        ids = self.fresh_dev(len(keys))
        prefix = 0
        while prefix < len(keys) and keys[prefix] in self.model:
            prefix += 1
        dup = []
        for i, key in enumerate(keys[:prefix]):
            e = self.model[key]
            if reuse and e["dev"] is not None:
                ids[i] = e["dev"]
            if e["dev"] is not None and e["dev"] != ids[i]:
                dup.append(ids[i])
        r = self.tree.insert(toks, ids, ek, priority=prio, chunked=chunked)
        assert r.prefix_len == prefix * self.ps and r.duplicate_pages.tolist() == dup
        assert r.last_node.parent is not None or not keys
        for i, key in enumerate(keys):
            if i >= prefix:  # a new node: its creation is its first access (not a chunk's)
                self.model[key] = {"dev": ids[i], "host": None, "hits": 0 if chunked else 1}
                continue
            e = self.model[key]
            if e["dev"] is None:  # host-only position revived with the caller's page
                e["dev"] = ids[i]
            e["hits"] += 0 if chunked else 1

    @rule(pages=pages_st, tail=st.integers(0, 3), ek=st.sampled_from([None, "x"]))
    def match(self, pages, tail, ek):
        self.now += 1
        toks = self.tokens(pages, tail % self.ps)
        dev, host = self.expect_match(ek, toks)
        m = self.tree.match(toks, ek)
        assert m.device_pages.tolist() == dev and m.device_len == len(dev) * self.ps
        assert m.host_len == host * self.ps
        assert sum(n.num_tokens for n in m.host_nodes) == m.host_len
        assert all(n.evicted and n.backed_up for n in m.host_nodes)
        assert m.node.is_root == (not dev and not host)
        assert m.node.is_root or m.node.last_access == self.now

    @rule(data=st.data())
    def lock(self, data):
        nodes = sorted(self.tree.nodes(), key=lambda n: n.id)
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            self.tree.lock(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        self.tree.unlock(self.locks.pop(i))

    @rule()
    def unlock_unlocked_fails(self):
        free = [n for n in self.tree.nodes() if n.lock_ref == 0]
        if free:
            before = self.tree.snapshot()
            with pytest.raises(HiCacheError):
                self.tree.unlock(min(free, key=lambda n: n.id))
            assert self.tree.snapshot() == before

    @rule(policy=st.sampled_from(list(EvictionPolicy)))
    def evict_device(self, policy):
        heap = VictimHeap(policy, self.tree.evictable_device)
        if not heap:
            return
        node = heap.pop()
        keys = self.node_keys(node)
        if not node.backed_up and node.children:
            # Host-only children but no host copy of its own: neither tier transition applies
            # (a cache backs it up first); deleting it would orphan the children.
            before = self.tree.snapshot()
            with pytest.raises(HiCacheError, match="deletable"):
                self.tree.delete_leaf(node)
            with pytest.raises(HiCacheError, match="no host copy"):
                self.tree.evict_device(node)
            assert self.tree.snapshot() == before
        elif node.backed_up:
            ids = self.tree.evict_device(node)
            for key, page in zip(keys, ids.tolist()):
                assert self.model[key]["dev"] == page
                self.model[key]["dev"] = None
        else:
            value, host = self.tree.delete_leaf(node)
            assert host is None and value.tolist() == [self.model.pop(k)["dev"] for k in keys]

    @rule(data=st.data())
    def backup(self, data):
        nodes = sorted(
            (n for n in self.tree.nodes() if n.value is not None and n.host_value is None),
            key=lambda n: n.id,
        )
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            ids = list(range(self.next_host, self.next_host + node.num_pages))
            self.next_host += node.num_pages
            self.tree.set_host_value(node, ids)
            for key, h in zip(self.node_keys(node), ids):
                self.model[key]["host"] = h

    @rule(policy=st.sampled_from(list(EvictionPolicy)))
    def evict_host(self, policy):
        heap = VictimHeap(policy, self.tree.evictable_host)
        if heap:
            node = heap.pop()
            keys = self.node_keys(node)
            value, host = self.tree.delete_leaf(node)
            assert value is None and host.tolist() == [self.model.pop(k)["host"] for k in keys]

    @rule(data=st.data())
    def load_back(self, data):
        nodes = sorted(
            (n for n in self.tree.nodes() if n.value is None and n.parent.value is not None),
            key=lambda n: n.id,
        )
        if nodes:
            node = data.draw(st.sampled_from(nodes))
            ids = self.fresh_dev(node.num_pages)
            self.tree.set_value(node, ids)
            for key, d in zip(self.node_keys(node), ids):
                self.model[key]["dev"] = d

    @rule(pages=st.lists(st.integers(0, 3), min_size=1, max_size=4))
    def insert_held_page_fails(self, pages):
        held = [n for n in self.tree.nodes() if n.value is not None]
        if not held:
            return
        page = int(min(held, key=lambda n: n.id).value[0])
        toks = self.tokens(pages, 0)
        ids = self.fresh_dev(len(pages))
        ids[-1] = page  # namespace "z" is never inserted: every position is new
        before = self.tree.snapshot()
        with pytest.raises(HiCacheError, match="already holds"):
            self.tree.insert(toks, ids, "z")
        assert self.tree.snapshot() == before

    # -- invariants ----------------------------------------------------------------------------
    @invariant()
    def tree_matches_model(self):
        if not hasattr(self, "tree"):
            return
        t = self.tree
        t.check_invariants()
        locked = [set(self.keys(h.extra_key, t.path_tokens(h))) for h in self.locks]
        seen = {}
        for node in t.nodes():
            for i, key in enumerate(self.node_keys(node)):
                seen[key] = {
                    "dev": None if node.value is None else int(node.value[i]),
                    "host": None if node.host_value is None else int(node.host_value[i]),
                    "hits": node.hit_count,
                }
                assert node.lock_ref == sum(key in ks for ks in locked)
        assert seen == self.model
        # The evictable sets, recomputed from their definition.
        nodes = list(t.nodes())
        assert t.evictable_device == {
            n
            for n in nodes
            if n.lock_ref == 0
            and n.value is not None
            and all(c.value is None for c in n.children.values())
        }
        assert t.evictable_host == {
            n
            for n in nodes
            if n.lock_ref == 0 and n.value is None and n.host_value is not None and not n.children
        }
        dev = sum(e["dev"] is not None for e in self.model.values()) * self.ps
        assert t.device_tokens == dev and t.host_tokens == self.ps * sum(
            e["host"] is not None for e in self.model.values()
        )
        assert t.evictable_device_tokens + t.protected_device_tokens == dev


TreeMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50)
TestTreeMachine = TreeMachine.TestCase


@pytest.mark.parametrize("where", [0, 17, 2047, 2048, 3000, 4095])
def test_long_node_mismatch_positions(where):
    """Both compare paths (memcmp for short runs, elementwise for long ones) round to pages."""
    t = RadixTree(16)
    toks = np.arange(4096, dtype=np.int64)
    t.insert(toks, np.arange(256))
    q = toks.copy()
    q[where] = 10**6
    assert t.match(q).device_len == where // 16 * 16
    assert t.match(toks[:2500]).device_len == 2496
    t.check_invariants()


# ----------------------------------------------------------------------------- host leaves (L3)


def test_add_host_leaf_hangs_host_only_pages_and_validates(clock):
    tree = RadixTree(4, clock=clock)
    tree.insert(np.arange(8), [0, 1])
    parent = tree.match(np.arange(8)).node
    leaf = tree.add_host_leaf(parent, np.arange(8, 16), [5, 6])
    tree.check_invariants()
    m = tree.match(np.arange(16))
    assert (m.device_len, m.host_len, m.node) == (8, 8, leaf)
    assert leaf in tree.evictable_host and tree.host_tokens == 8
    # Same hashes as if the pages had been inserted on device under the same parent.
    other = RadixTree(4, clock=clock)
    other.insert(np.arange(16), [0, 1, 2, 3])
    np.testing.assert_array_equal(
        other.match(np.arange(16)).node.page_hashes[-2:], leaf.page_hashes
    )
    before = tree.snapshot()
    with pytest.raises(HiCacheError, match="already has a child"):
        tree.add_host_leaf(parent, np.arange(8, 12), [7])
    with pytest.raises(HiCacheError, match="already holds"):
        tree.add_host_leaf(leaf, np.arange(16, 20), [5])
    with pytest.raises(ValueError, match="multiple of 4"):
        tree.add_host_leaf(leaf, np.arange(16, 19), [7])
    with pytest.raises(ValueError, match="namespace"):
        tree.add_host_leaf(leaf, np.arange(16, 20), [7], extra_key="other")
    assert tree.snapshot() == before
    tree.check_invariants()


@pytest.mark.parametrize("ps", [1, 16])
def test_redundant_set_and_drop_host_value(ps, clock):
    """Nodes on both tiers and unlocked are ``redundant``; drop_host_value gives up such a
    host copy (the node stays on device); the set follows locks, splits and evictions."""
    t = RadixTree(ps, clock=clock)
    leaf = t.insert(seq(ps, [1, 2, 3, 4]), [0, 1, 2, 3]).last_node
    assert t.redundant == set() and t.redundant_tokens == 0
    t.set_host_value(leaf, [7, 6, 5, 4])
    assert t.redundant == {leaf} and t.redundant_tokens == 4 * ps
    upper = t.match(seq(ps, [1, 2, 9])).node  # split: both parts redundant
    assert t.redundant == {upper, leaf} and t.redundant_tokens == 4 * ps
    t.lock(leaf)  # the chain is in use
    assert t.redundant == set() and t.redundant_tokens == 0
    with pytest.raises(HiCacheError, match="not redundant"):
        t.drop_host_value(leaf)
    t.unlock(leaf)
    assert t.drop_host_value(leaf).tolist() == [5, 4]
    assert leaf.host_value is None and leaf.value.tolist() == [2, 3]
    assert t.redundant == {upper} and t.host_tokens == 2 * ps
    t.check_invariants()
    with pytest.raises(HiCacheError, match="not redundant"):
        t.drop_host_value(leaf)  # no host copy left
    t.delete_leaf(leaf)
    t.evict_device(upper)  # host-only now: not redundant
    assert t.redundant == set() and t.redundant_tokens == 0
    t.check_invariants()


@pytest.mark.parametrize("dtype", [np.int64, np.uint64, np.int32, np.uint32, np.int16, list])
def test_keys_are_int32_whatever_the_input_and_hash_as_int64(dtype):
    """Keys are stored as int32 (half of int64's bytes), from any integer input; the page hashes
    are those of the same tokens as int64 (unchanged by the narrower storage)."""
    ps, top = 4, 2**31 - 1 if dtype not in (np.int16,) else 2**15 - 1
    toks = np.array([top, 0, 7, top - 1, 5, 5, 5, 5], np.int64)
    arg = toks.tolist() if dtype is list else toks.astype(dtype)
    t = RadixTree(ps)
    leaf = t.insert(arg, [3, 4]).last_node
    assert leaf.key.dtype == np.int32 and leaf.key.tolist() == toks.tolist()
    assert t.match(arg).device_pages.tolist() == [3, 4]
    assert t.match(toks).device_len == 8 and t.match(toks.astype(np.int32)).device_len == 8
    want = chain_hashes(namespace_hash(None), toks.reshape(-1, ps))
    np.testing.assert_array_equal(leaf.page_hashes, want)
    t.check_invariants()


@pytest.mark.parametrize(
    "tokens",
    [
        [2**31, 1, 2, 3],
        np.array([0, 1, 2, 2**40], np.int64),
        np.array([2**31] * 4, np.uint32),
        np.array([2**32] * 4, np.uint64),
    ],
)
def test_tokens_beyond_int32_refused_tree_unchanged(tokens):
    t, _node = _tree_with_content()
    before = t.snapshot()
    for call in (
        lambda: t.insert(tokens, [5]),
        lambda: t.match(tokens),
        lambda: t.add_host_leaf(t.root, tokens, [9]),
    ):
        with pytest.raises(ValueError, match=r"beyond int32 .*< 2\*\*31"):
            call()
    assert t.snapshot() == before
