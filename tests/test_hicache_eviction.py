"""HiCache's eviction on both tiers, and its meeting with copies in flight (regressions of
failure classes SGLang's HiCache has had): a split mid-backup, evict_host reaching a node whose
load-back is in flight, host pages parked under a copy, everything locked, evict_host without
progress, and out-of-pages errors that leave the cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import (
    POLICIES,
    bits,
    check_cache,
    check_invariants,
    gate,
    gated_cache,
    node_of,
    serve_kv,
    snapshot,
    tree_node_of,
)
from hicache_jax import HiCacheError, OutOfPagesError


def test_alloc_pages_out_of_pages_counts_and_unchanged():
    cache, kv = gated_cache("write_through", device=8)
    serve_kv(cache, kv, np.arange(3))
    node = node_of(cache, np.arange(3))
    cache.lock(node)
    mine = cache.alloc_pages(2)
    cache.flush()  # the backup of the insert may still be in flight: alloc_pages would land it
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError) as e:
        cache.alloc_pages(4)
    assert (e.value.needed, e.value.free, e.value.evictable, e.value.locked) == (4, 3, 0, 5)
    assert snapshot(cache) == before
    cache.free_pages(mine)
    cache.unlock(node)
    assert cache.alloc_pages(8).size == 8  # everything evictable again


def test_node_split_while_write_through_copy_in_flight():
    """A node holds its host pages from the backup's dispatch: a split mid-copy gives each half
    its slice, and both read back the copied bytes once it lands."""
    cache, kv = gated_cache("write_through")
    eng = gate(cache)
    t = np.arange(8)
    serve_kv(cache, kv, t)
    serve_kv(cache, kv, t)  # backup dispatched, held in flight
    assert cache.stats()["transfers_in_flight"] == 1
    assert tree_node_of(cache, t).lock_ref == 0  # a backup locks nothing
    m = cache.match_prefix(t[:3])  # splits the node mid-copy
    upper = m.node._node
    lower = tree_node_of(cache, t)
    assert upper.num_tokens == 3 and upper.host_value.size == 3 and lower.parent is upper
    check_invariants(cache)
    cache.evict(8)  # device pages freed while the copy reads them
    assert cache.stats()["device_cached_tokens"] == 0 and eng.handles
    eng.release()
    cache.flush()
    assert cache.stats()["host_cached_tokens"] == 8
    check_cache(cache, kv)  # host bytes of both halves are right
    m = cache.load_back(cache.match_prefix(t))
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 8))


def _host_only(cache, kv, tokens):
    serve_kv(cache, kv, tokens)
    n = node_of(cache, tokens)
    cache.lock(n)
    cache.evict(1000)  # everything else goes first
    cache.unlock(n)
    cache.evict(1000)
    m = cache.match_prefix(tokens)
    assert m.device_len == 0 and m.host_len == len(tokens)
    return m


def test_evict_host_reaching_node_whose_load_back_is_in_flight():
    # write_back: allocating device pages evicts, which backs up, which needs host pages,
    # which evicts host nodes. The node being loaded is the least recently used one: it must
    # be neither device-evicted (its pages are the copy's destination) nor host-evicted.
    cache, kv = gated_cache("write_back", device=8, host=6)
    a, b = np.arange(4), np.arange(300, 302)
    serve_kv(cache, kv, a)
    serve_kv(cache, kv, b)
    cache.evict(1000)  # both backed up and host-only: host is full
    cache.flush()  # (eviction does not wait for the copies)
    eng = gate(cache)
    m = cache.load_back(cache.match_prefix(a))
    loaded, hv = m.device_pages.copy(), m.node._node.host_value.copy()
    assert cache.stats()["transfers_in_flight"] == 1
    serve_kv(cache, kv, np.arange(100, 102))  # fits
    serve_kv(cache, kv, np.arange(200, 204))  # evict -> backup -> evict_host
    assert cache.stats()["host_evictions"] >= 1 and cache.match_prefix(b).host_len == 0
    assert m.node._node.parent is not None and np.array_equal(m.node._node.value, loaded)
    assert np.array_equal(m.node._node.host_value, hv)
    assert cache.host_pool.allocator.is_allocated(hv).all()
    check_cache(cache, kv)
    eng.release()
    cache.flush()
    np.testing.assert_array_equal(bits(cache.read_kv(loaded)), kv.pages(None, a, 0, 4))
    check_cache(cache, kv)


def test_host_pages_released_before_async_load_finished():
    cache, kv = gated_cache("write_back", device=8, host=8)
    eng = gate(cache)
    a = np.arange(4)
    m = cache.load_back(_host_only(cache, kv, a))
    hv = m.node._node.host_value.copy()
    cache.evict(1000)  # locked by the load: stays on device
    cache.evict_host(1000)  # and its host pages stay allocated
    assert cache.host_pool.allocator.is_allocated(hv).all()
    assert m.node._node.value is not None and np.array_equal(m.node._node.host_value, hv)
    eng.release()
    cache.flush()
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, a, 0, 4))
    check_cache(cache, kv)


def test_evict_host_without_progress_returns():
    cache, kv = gated_cache("write_back", device=4, host=4)
    m = _host_only(cache, kv, np.arange(4))
    cache.lock(m.node)  # the only host node is protected
    assert cache.evict_host(1000) == 0
    # A backup that needs host pages: evict_host makes no progress, the backup is skipped
    # and the request still succeeds (its node is deleted instead of backed up).
    serve_kv(cache, kv, np.arange(50, 52))
    serve_kv(cache, kv, np.arange(60, 64))
    assert cache.stats()["backups_skipped"] >= 1
    cache.unlock(m.node)
    check_cache(cache, kv)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_when_everything_is_locked(policy):
    cache, kv = gated_cache(policy, device=8)
    serve_kv(cache, kv, np.arange(8))
    node = node_of(cache, np.arange(8))
    cache.lock(node)
    cache.flush()  # a backup in flight would be waited for (and applied) by the failing alloc
    assert cache.evict(100) == 0
    assert cache.evict_host(100) == 0
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError, match="pages needed"):
        cache.alloc_pages(1)
    assert snapshot(cache) == before
    cache.unlock(node)
    check_cache(cache, kv)


def test_host_page_given_up_while_copy_into_it_in_flight_is_parked_until_it_lands():
    """Host pages a node gives up while its backup still writes them are the copy's until it
    lands (never handed to a new owner meanwhile); a host allocation that needs them waits."""
    cache, kv = gated_cache("write_back", device=8, host=4)
    eng = gate(cache)
    t = np.arange(4)
    serve_kv(cache, kv, t)
    assert cache.evict(4) == 4  # backed up into all 4 host pages, in flight
    inflight = [h.host_ids for h in eng.handles]
    assert len(inflight) == 1 and inflight[0].size == 4
    assert cache.stats()["host_cached_tokens"] == 4 and cache.stats()["device_free_pages"] == 8
    assert cache.evict_host(4) == 4  # the node goes; its pages are parked
    assert cache.host_pool.allocator.is_allocated(inflight[0]).all()
    assert cache.stats()["host_free_pages"] == 0
    check_invariants(cache)
    u = np.arange(100, 104)
    serve_kv(cache, kv, u)
    first = eng.handles[0]
    assert not first.released and cache.stats()["transfers_in_flight"] == 1
    assert cache.evict(4) == 4  # its backup needs the parked pages: waits
    assert first.released
    cache.flush()
    assert np.array_equal(np.sort(tree_node_of(cache, u).host_value), np.sort(inflight[0]))
    assert cache.stats()["host_free_pages"] == 0
    check_cache(cache, kv)
    m = cache.load_back(cache.match_prefix(u))
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, u, 0, 4))


def test_unlock_of_a_node_only_a_copy_holds_is_refused():
    """The caller's unlock is counted apart from the cache's own locks: a node locked only by a
    load-back in flight cannot be unlocked by a caller (eviction would then free its pages while
    the copy writes them)."""
    cache, kv = gated_cache("write_back", device=8, host=16)
    engine = gate(cache)
    t = np.arange(4)
    serve_kv(cache, kv, t)
    cache.evict(4)
    engine.release()
    cache.flush()
    m = cache.load_back(cache.match_prefix(t))  # the load is held at the gate
    node = m.node
    assert m.device_len == 4 and node._node.lock_ref == 1 and engine.handles
    before = snapshot(cache)
    with pytest.raises(HiCacheError, match="without a matching lock"):
        cache.unlock(node)
    assert node._node.lock_ref == 1 and snapshot(cache) == before
    engine.release()
    cache.flush()
    assert node._node.lock_ref == 0
    check_cache(cache, kv)
