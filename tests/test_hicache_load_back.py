"""HiCache.load_back and stale matches: the threshold and the quota, never evicting the chain's
own ancestors, layer-wise loading, a failed dispatch, and a Match that went stale (evicted,
moved to other pages, its node deleted or split): load_back returns what holds the prefix now,
lock refuses a stale Match and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bits, check_cache, gated_cache, serve_kv, snapshot
from hicache_jax import HiCacheError


def test_load_back_threshold_and_quota_decline():
    for kw in (dict(lbt=8), dict(load_back_quota=3)):
        cache, kv = gated_cache("write_back", **kw)
        t = np.arange(4)
        serve_kv(cache, kv, t)
        cache.evict(4)
        m = cache.match_prefix(t)
        assert m.host_len == 4
        assert cache.load_back(m) is m
        assert cache.stats()["load_backs_declined"] == 1
        # Declined: the caller recomputes; insert revives the host-only node with its pages.
        serve_kv(cache, kv, t)
        assert cache.match_prefix(t).device_len == 4 and cache.stats()["host_cached_tokens"] == 4
        check_cache(cache, kv)


def test_load_back_never_evicts_the_chains_ancestors():
    cache, kv = gated_cache("write_back", device=6, host=16)
    p, c = np.arange(4), np.arange(6)
    serve_kv(cache, kv, p)
    serve_kv(cache, kv, c)  # child node [4, 5] under [0..3]
    assert cache.evict(2) == 2  # the child: backed up, host-only
    held = cache.alloc_pages(2)  # no free device page left
    m = cache.match_prefix(c)
    assert (m.device_len, m.host_len) == (4, 2)
    # The only evictable device node is the chain's parent: decline instead of evicting it.
    assert cache.load_back(m) is m
    assert cache.match_prefix(p).device_len == 4 and cache.stats()["load_backs_declined"] == 1
    cache.free_pages(held)
    assert cache.load_back(cache.match_prefix(c)).device_len == 6
    check_cache(cache, kv)


def test_layerwise_load_back_handle():
    cache, kv = gated_cache("write_back", ps=16, device=8)
    t = np.arange(64)
    serve_kv(cache, kv, t)
    cache.evict(64)
    m = cache.load_back(cache.match_prefix(t), layerwise=True)
    assert m.device_len == 64 and m.load_handle is not None
    for layer in range(cache.spec.num_layers):
        m.load_handle.wait_layer(layer)
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 4))
    assert cache.load_back(cache.match_prefix(t)).load_handle is None
    check_cache(cache, kv)


def _backed_up_then_evicted(cache, kv, tokens):
    """Two requests (the hit backs ``tokens`` up), then its device pages are evicted."""
    serve_kv(cache, kv, tokens)
    serve_kv(cache, kv, tokens)
    cache.flush()
    cache.evict(len(tokens))
    cache.flush()


def test_load_back_of_a_stale_match_reports_what_is_on_device_now():
    cache, kv = gated_cache("write_through", device=16, host=16, ps=2)
    t = np.arange(8)
    _backed_up_then_evicted(cache, kv, t)
    m1, m2 = cache.match_prefix(t), cache.match_prefix(t)
    assert m1.host_len == m2.host_len == 8
    r1 = cache.load_back(m1)
    r2 = cache.load_back(m2)  # r1 loaded it meanwhile
    assert (r2.device_len, r2.host_len) == (8, 0)
    np.testing.assert_array_equal(r2.device_pages, r1.device_pages)
    cache.flush()
    check_cache(cache, kv)


def test_load_back_of_a_match_whose_device_pages_moved_returns_the_new_pages():
    """The prefix of a match was evicted and loaded back into other pages by another request:
    load_back returned the old match, whose pages were free (or another caller's: its insert
    then freed them)."""
    cache, kv = gated_cache("write_through", device=8, host=8, lbt=0)
    toks = np.arange(1, 5)
    serve_kv(cache, kv, toks)
    serve_kv(cache, kv, toks)
    cache.flush()
    old = cache.match_prefix(toks)
    assert (old.device_len, old.host_len) == (4, 0)
    cache.evict(4)
    cache.flush()
    filler = cache.alloc_pages(4)  # the freed pages, so the reload gets other ids
    moved = cache.load_back(cache.match_prefix(toks))
    cache.flush()
    cache.free_pages(filler)
    m = cache.load_back(old)  # the stale request goes on
    np.testing.assert_array_equal(m.device_pages, moved.device_pages)
    assert not np.array_equal(m.device_pages, old.device_pages) and m.device_len == 4
    serve_kv(cache, kv, toks)
    check_cache(cache, kv)


def _prefix_split_between_tiers(cache, kv):
    """[0, 8) cached and backed up, then split at 4 with the upper part on device and the lower
    part host-only; returns the match of the whole prefix (device 4, host 4)."""
    t = np.arange(8)
    serve_kv(cache, kv, t)  # backed up at insert
    cache.flush()
    cache.match_prefix(t[:4])  # split at 4
    assert cache.evict(4) == 4  # the lower half leaves the device
    m = cache.match_prefix(t)
    assert (m.device_len, m.host_len) == (4, 4)
    return t, m


def test_load_back_declined_for_lack_of_pages_returns_what_holds_the_prefix_now():
    """A scheduler matches its batch first: another request's alloc_pages then evicts the
    match's device part and takes its pages. load_back, declined for lack of device pages,
    returned the old Match, whose device_pages were now that other request's."""
    cache, kv = gated_cache("write_through", device=8, host=32)
    t, m = _prefix_split_between_tiers(cache, kv)
    other = cache.alloc_pages(8)  # evicts the upper half too: every page is the other's
    assert set(m.device_pages.tolist()) <= set(other.tolist())
    r = cache.load_back(m)  # needs 8 pages: none free, none evictable -> declined
    assert cache.stats()["load_backs_declined"] == 1
    assert (r.device_len, r.host_len, r.device_pages.size) == (0, 8, 0)
    assert r.node == m.node
    with pytest.raises(HiCacheError, match=r"stale Match.*match_prefix"):
        cache.lock(m.node)
    cache.lock(r.node)  # what load_back returned is current
    cache.free_pages(other)
    cache.unlock(r.node)
    serve_kv(cache, kv, t)
    check_cache(cache, kv)


@pytest.mark.parametrize("moved", [False, True])
def test_lock_of_a_stale_match_is_refused_and_changes_nothing(moved):
    """Evicted since the match (moved=False), or evicted and loaded back into other pages
    (moved=True: the prefix is on device again, but not in the pages the match names)."""
    cache, kv = gated_cache("write_through", device=8, host=32)
    t = np.arange(4)
    serve_kv(cache, kv, t)
    serve_kv(cache, kv, t)
    cache.flush()
    stale = cache.match_prefix(t)
    assert stale.device_len == 4
    cache.evict(4)
    if moved:
        filler = cache.alloc_pages(4)  # the freed pages: the reload gets other ids
        fresh = cache.load_back(cache.match_prefix(t))
        cache.flush()
        cache.free_pages(filler)
        assert fresh.device_len == 4 and not set(fresh.device_pages) & set(stale.device_pages)
    before = snapshot(cache)
    with pytest.raises(HiCacheError, match="stale Match"):
        cache.lock(stale.node)
    assert snapshot(cache) == before
    m = cache.load_back(stale)  # load_back revalidates: lock what it returns
    cache.lock(m.node)
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 4))
    cache.unlock(m.node)
    check_cache(cache, kv)


def test_a_match_stays_lockable_through_unrelated_eviction_and_splits():
    """Staleness is about the match's own pages: other prefixes evicted, its node split by
    another insert, copies landing -- none of that makes it stale."""
    cache, kv = gated_cache("write_through", device=16, host=32)
    a, b = np.arange(8), np.arange(100, 104)
    serve_kv(cache, kv, a)
    serve_kv(cache, kv, b)
    m = cache.match_prefix(a)
    serve_kv(cache, kv, np.concatenate([a[:3], [7, 7]]))  # splits a's node at 3
    serve_kv(cache, kv, a)  # backs a up (both parts)
    cache.flush()
    assert cache.match_prefix(b).device_len == 4
    cache.lock(m.node)
    assert cache.evict(100) > 0  # everything but a goes
    assert cache.match_prefix(b).device_len == 0
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, a, 0, 8))
    cache.unlock(m.node)
    check_cache(cache, kv)


def test_load_back_of_a_match_whose_node_was_deleted_matches_its_prefix_again():
    cache, kv = gated_cache("write_through", device=8, host=32, threshold=2)
    t = np.arange(4)
    serve_kv(cache, kv, t)  # one access: not backed up
    m = cache.match_prefix(t)
    cache.evict(4)  # deleted (no host copy)
    with pytest.raises(HiCacheError, match="not in this cache"):
        cache.lock(m.node)
    r = cache.load_back(m)
    assert (r.device_len, r.host_len) == (0, 0)
    serve_kv(cache, kv, t)  # computed again by another request
    r = cache.load_back(m)
    assert r.device_len == 4
    cache.lock(r.node)
    np.testing.assert_array_equal(bits(cache.read_kv(r.device_pages)), kv.pages(None, t, 0, 4))
    cache.unlock(r.node)
    check_cache(cache, kv)


def test_load_back_whose_dispatch_fails_leaves_the_cache_unchanged():
    cache, kv = gated_cache("write_through", device=8, host=8, ps=2)
    t = np.arange(4)
    _backed_up_then_evicted(cache, kv, t)
    m = cache.match_prefix(t)
    before = snapshot(cache)
    engine = cache.transfer_engine
    real = engine.load

    def failing(*args, **kw):
        raise RuntimeError("RESOURCE_EXHAUSTED: simulated runtime failure")

    engine.load = failing
    with pytest.raises(RuntimeError, match="RESOURCE_EXHAUSTED"):
        cache.load_back(m)
    engine.load = real
    assert snapshot(cache) == before and m.node._node.lock_ref == 0
    check_cache(cache, kv)
    assert cache.load_back(m).device_len == 4
