"""HiCache's request flow and its primitives' own semantics: a request served from device then
from host, insert's returned prefix and freed duplicates, chunked inserts counting no hit, tokens
held as int32, reset, sharded pools, and check_invariants naming what broke."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bits, check_cache, gated_cache, node_of, serve_kv, snapshot
from hicache_jax import HiCacheError


def test_request_flow_device_then_host_hit():
    cache, kv = gated_cache("write_through", device=8, host=32)
    t = np.arange(8)
    serve_kv(cache, kv, t)  # threshold 1: backed up at the insert that creates it
    cache.flush()
    assert cache.stats()["backups"] == 1
    serve_kv(cache, kv, t)  # a device hit: nothing more to back up
    cache.flush()
    assert cache.stats()["backups"] == 1 and cache.stats()["host_cached_tokens"] == 8
    assert cache.evict(8) == 8  # backed up: device freed, node kept on host
    m = cache.match_prefix(t)
    assert (m.device_len, m.host_len) == (0, 8)
    m2 = cache.load_back(m)
    assert (m2.device_len, m2.host_len) == (8, 0) and m2.node == m.node
    np.testing.assert_array_equal(bits(cache.read_kv(m2.device_pages)), kv.pages(None, t, 0, 8))
    assert cache.stats()["load_backs"] == 1
    check_cache(cache, kv)


def test_insert_returns_prefix_and_frees_duplicates():
    cache, kv = gated_cache()
    t = np.arange(6)
    a = cache.alloc_pages(6)
    b = cache.alloc_pages(6)
    cache.write_kv(a, kv.pages(None, t, 0, 6))
    cache.write_kv(b, kv.pages(None, t, 0, 6))
    assert cache.insert(t, a) == 0
    free = cache.stats()["device_free_pages"]
    assert cache.insert(t, b) == 6  # b duplicates a: freed
    assert cache.stats()["device_free_pages"] == free + 6
    assert cache.stats()["device_caller_pages"] == 0
    assert cache.insert(t, a) == 6  # the tree's own pages: no-op
    check_cache(cache, kv)


def test_chunked_insert_counts_no_hit():
    cache, kv = gated_cache("write_through_selective")
    t = np.arange(4)
    serve_kv(cache, kv, t)  # created: its first access
    m = cache.match_prefix(t)
    cache.insert(t, m.device_pages, chunked=True)
    cache.flush()
    assert cache.stats()["backups"] == 0 and m.node._node.hit_count == 1
    u = np.arange(50, 54)  # a chunk that creates a node: no access yet
    new = cache.alloc_pages(4)
    cache.write_kv(new, kv.pages(None, u, 0, 4))
    cache.insert(u, new, chunked=True)
    assert cache.match_prefix(u).node._node.hit_count == 0
    cache.insert(u, new)  # the request's final insert: its first access
    assert cache.match_prefix(u).node._node.hit_count == 1
    cache.flush()
    assert cache.stats()["backups"] == 0
    check_cache(cache, kv)


def test_token_ids_held_as_int32_and_ids_beyond_refused():
    """The facade validates tokens once: ids up to 2**31 - 1 are cached (as int32 in the tree),
    whatever the input's integer type; an id beyond int32 is a ValueError that names the bound,
    on every call taking tokens, and leaves the cache unchanged (no silent wrap-around)."""
    cache, kv = gated_cache(ps=2, kv_events={"publisher": "queue"})
    top = 2**31 - 1
    toks = np.array([top, 0, top - 1, 9], np.int64)
    serve_kv(cache, kv, toks)
    for arg in (
        toks.tolist(),
        toks.astype(np.uint64),
        toks.astype(np.uint32),
        toks.astype(np.int32),
    ):
        assert cache.match_prefix(arg).device_len == 4
    stored = [
        e
        for e in cache.take_events()  # the device copies (host ones land as backups do)
        if type(e).__name__ == "BlockStored" and e.medium.value == "device"
    ]
    assert [list(e.token_ids) for e in stored] == [[top, 0], [top - 1, 9]]
    assert all(n.key.dtype == np.int32 for n in cache.tree.nodes())
    mine = cache.alloc_pages(2)
    for bad in ([2**31, 0, 1, 2], np.array([0, 1, 2**40, 3]), np.array([2**63] * 4, np.uint64)):
        before = snapshot(cache)
        for call in (
            lambda bad=bad: cache.match_prefix(bad),
            lambda bad=bad: cache.insert(bad, mine),
        ):
            with pytest.raises(ValueError, match="beyond int32"):
                call()
        assert snapshot(cache) == before
    cache.free_pages(mine)
    check_cache(cache, kv)


def test_reset_forgets_everything():
    cache, kv = gated_cache("write_back")
    serve_kv(cache, kv, np.arange(6))
    cache.evict(3)
    cache.reset()
    s = cache.stats()
    assert s["device_free_pages"] == 16 and s["host_free_pages"] == 32
    assert cache.match_prefix(np.arange(6)).device_len == 0
    check_cache(cache, kv)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_sharded_pools_round_trip(policy):
    # Pools sharded over kv heads on 2 of the 4 CPU devices: backup, evict and load_back keep
    # every byte (each device moves only its heads).
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("heads",))
    cache, kv = gated_cache(policy, device=8, host=16, mesh=mesh)
    t = np.arange(6)
    serve_kv(cache, kv, t)
    serve_kv(cache, kv, t)
    cache.evict(100)
    m = cache.load_back(cache.match_prefix(t))
    assert m.device_len == 6
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 6))
    cache.flush()
    check_cache(cache, kv)


def test_check_invariants_names_the_broken_invariant():
    cache, kv = gated_cache("write_through", device=8, host=8)
    serve_kv(cache, kv, np.arange(4))
    cache.flush()
    cache.check_invariants()
    cache.tree.lock(node_of(cache, np.arange(4))._node)  # a lock that no one holds
    with pytest.raises(HiCacheError, match="lock_ref"):
        cache.check_invariants()
    cache, kv = gated_cache("write_through", device=8, host=8)
    serve_kv(cache, kv, np.arange(4))
    cache.host_pool.allocator.alloc(1)  # a host page no one holds
    with pytest.raises(HiCacheError, match="host page is neither free"):
        cache.check_invariants()
    cache, kv = gated_cache("write_through", device=8, host=8)
    cache.device_pool.allocator.alloc(1)  # a device page no one owns
    with pytest.raises(HiCacheError, match="device allocator disagrees"):
        cache.check_invariants()
