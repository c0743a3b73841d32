"""HiCache's write policies (write_through, write_through_selective, write_back): when a node is
backed up, the continuous host prefix, one transfer per eviction round or per hit path, backups
that cannot fit the host pool, and caches whose host pool is small or absent. clean_ahead has
its own file (test_hicache_clean_ahead.py)."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import (
    POLICIES,
    bits,
    check_cache,
    gate,
    gated_cache,
    node_of,
    node_tiers,
    serve_kv,
    snapshot,
)
from hicache_jax import OutOfPagesError


@pytest.mark.parametrize(
    "policy,backs_up_at",
    [("write_through", 1), ("write_through_selective", 2), ("write_back", None)],
)
def test_write_through_threshold(policy, backs_up_at):
    """The insert that creates a node is its first access (as current SGLang counts it):
    threshold 1 backs up at insert, write_through_selective (2) at the second access."""
    cache, kv = gated_cache(policy)
    t = np.arange(4)
    for access in range(1, 5):
        serve_kv(cache, kv, t)
        cache.flush()
        backed = cache.stats()["backups"] > 0
        assert backed == (backs_up_at is not None and access >= backs_up_at), access


def test_continuous_prefix_guard_skips_child_of_unbacked_parent():
    # Host pool of 2 pages: the 3-page parent can never be backed up, so its 1-page child,
    # which would fit, must not be (a gap in the host prefix).
    cache, kv = gated_cache("write_through", host=2)
    serve_kv(cache, kv, np.arange(3))
    serve_kv(cache, kv, np.arange(4))
    serve_kv(cache, kv, np.arange(4))
    cache.flush()
    assert cache.stats()["backups"] == 0 and cache.stats()["host_used_pages"] == 0
    check_cache(cache, kv)


def test_write_back_backs_up_on_evict_then_loads_back():
    cache, kv = gated_cache("write_back", device=8)
    t = np.arange(8)
    serve_kv(cache, kv, t)
    assert cache.stats()["backups"] == 0
    assert cache.evict(8) == 8
    assert cache.stats()["backups"] == 1 and cache.stats()["host_cached_tokens"] == 8
    assert cache.stats()["eviction_backup_pages"] == 8  # copied on the eviction path
    m = cache.load_back(cache.match_prefix(t))
    assert m.device_len == 8
    check_cache(cache, kv)


def _count_backup_calls(cache):
    """Wrap the transfer engine's backup: returns the list of page counts per call."""
    engine = cache.transfer_engine
    calls, real = [], engine.backup
    engine.backup = lambda d, h, **kw: calls.append(len(d)) or real(d, h, **kw)
    return calls


def test_write_back_eviction_round_backs_up_all_victims_in_one_transfer():
    cache, kv = gated_cache("write_back", device=16, host=32)
    prompts = [np.arange(4) + 100 * i for i in range(4)]  # four disjoint 4-page leaves
    for t in prompts:
        serve_kv(cache, kv, t)
    calls = _count_backup_calls(cache)
    assert cache.evict(16) == 16
    assert calls == [16]  # one dispatch for the four nodes
    cache.flush()  # the bytes are counted once the copy lands
    stats = cache.stats()
    assert stats["backups"] == 4 and stats["host_cached_tokens"] == 16
    assert stats["bytes_to_host"] == 16 * cache.spec.page_bytes
    for t in prompts:  # every node got its own slice of the host pages
        m = cache.load_back(cache.match_prefix(t))
        assert m.device_len == 4
        np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 4))
    check_cache(cache, kv)


def test_write_through_hits_on_a_path_back_up_in_one_transfer():
    cache, kv = gated_cache("write_through", device=32, host=64, threshold=3)
    serve_kv(cache, kv, np.arange(8))  # one node, hit_count 1 (its creation)
    serve_kv(cache, kv, np.arange(8))  # hit_count 2: under the threshold
    cache.match_prefix(np.arange(4))  # splits it: both halves keep hit_count 2
    calls = _count_backup_calls(cache)
    serve_kv(cache, kv, np.arange(12))  # hits both halves -> both reach the threshold
    assert calls == [8]  # root-first, one dispatch
    cache.flush()
    assert cache.stats()["backups"] == 2 and cache.stats()["host_cached_tokens"] == 8
    check_cache(cache, kv)


def test_write_through_evicts_unbacked_nodes_by_deleting_them():
    cache, kv = gated_cache("write_through", threshold=2)
    serve_kv(cache, kv, np.arange(5))
    assert cache.evict(100) == 5
    m = cache.match_prefix(np.arange(5))
    assert (m.device_len, m.host_len) == (0, 0) and cache.stats()["deleted_tokens"] == 5


def test_backup_that_cannot_fit_deletes_nothing_from_host():
    """A backup larger than what host eviction can free is skipped before any host-only node is
    deleted (host pages of backed-up device nodes are not evictable)."""
    cache, kv = gated_cache("write_through", device=16, host=4, ps=2)
    a, b, c = np.arange(4), np.arange(100, 104), np.arange(200, 206)
    for t in (a, a):
        serve_kv(cache, kv, t)
    cache.flush()
    cache.evict(4)  # a -> host only (2 host pages)
    for t in (b, b):
        serve_kv(cache, kv, t)  # b backed up and on device: host 4/4
    cache.flush()
    assert cache.match_prefix(a).host_len == 4
    serve_kv(cache, kv, c)  # c (3 pages) cannot fit while b's 2 are pinned
    cache.flush()
    st = cache.stats()
    assert cache.match_prefix(a).host_len == 4  # a's host copy survived
    assert st["backups_skipped"] == 1 and st["host_evictions"] == 0
    check_cache(cache, kv)


def test_backup_larger_than_the_host_pool_does_not_wait_for_copies_in_flight():
    cache, kv = gated_cache("write_through", device=32, host=4, ps=2)
    engine = gate(cache)
    a, b = np.arange(4), np.arange(100, 110)  # b: 5 pages > 4 host pages
    serve_kv(cache, kv, b)  # b's backup can never fit: skipped
    assert cache.stats()["backups_skipped"] == 1
    serve_kv(cache, kv, a)  # a's backup in flight (gated)
    pending = [h for h in engine.handles if not h.released]
    assert pending
    serve_kv(cache, kv, b)  # b's backup skipped again, without waiting for a's
    assert not any(h.released for h in pending)
    assert cache.stats()["backups_skipped"] == 2
    engine.release()
    cache.flush()
    check_cache(cache, kv)


def test_write_back_evicts_a_node_whose_backup_cannot_fit_with_its_host_only_children():
    """A not-backed-up device leaf with a host-only child and no host room for its backup used
    to stay: alloc_pages then evicted others and still raised (after changing the cache). It
    now goes with its host-only children, so the pre-check (unlocked device pages) is exact."""
    cache, kv = gated_cache("write_back", device=6, host=2)
    serve_kv(cache, kv, [0, 1, 2])
    serve_kv(cache, kv, [0, 1, 2, 3])
    cache.evict(1)  # [3] backed up and dropped: a host-only child of [0, 1, 2]
    cache.flush()
    serve_kv(cache, kv, [100])
    assert cache.stats()["device_evictable_pages"] == 4
    pages = cache.alloc_pages(6)  # needs [0, 1, 2] gone: 3 pages, host has room for 1
    assert pages.size == 6 and cache.stats()["device_free_pages"] == 0
    assert cache.match_prefix([0, 1, 2, 3]).host_len == 0  # the child went with it
    cache.free_pages(pages)
    check_cache(cache, kv)
    serve_kv(cache, kv, [7, 8, 9])
    node = node_of(cache, [7, 8, 9])
    cache.lock(node)
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError):
        cache.alloc_pages(6)
    assert snapshot(cache) == before
    cache.unlock(node)


def test_write_back_eviction_frees_device_pages_without_waiting_for_the_copy():
    """The eviction path dispatches a dirty node's copy and frees its device pages at once; a
    new request writing into them meanwhile does not change what the host copy holds."""
    cache, kv = gated_cache("write_back", device=8, host=16)
    eng = gate(cache)
    t, u = np.arange(8), np.arange(100, 108)
    serve_kv(cache, kv, t)
    serve_kv(cache, kv, u)  # all 8 device pages reused: t copied on the way
    held = [h for h in eng.handles if not h.released]
    assert len(held) == 1 and held[0].host_ids.size == 8
    st = cache.stats()
    assert st["eviction_backup_pages"] == 8 and st["host_cached_tokens"] == 8
    assert node_tiers(cache) == {0: (False, True), 1: (True, False)}
    eng.release()
    cache.flush()
    check_cache(cache, kv)
    cache.evict(8)
    m = cache.load_back(cache.match_prefix(t))
    assert m.device_len == 8
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 8))


@pytest.mark.parametrize("policy", ["clean_ahead", "write_through", "write_back"])
def test_a_device_only_cache_runs_no_backup_pass(policy, monkeypatch):
    """host_pages=0 (a device-only radix cache): no policy has anywhere to back up to, so none
    sorts the eviction end at an unlock (clean_ahead did, at every unlock near a full L1)."""
    import hicache_jax.cache.write_policy as wp

    def refuse(*a, **k):
        raise AssertionError("a backup pass ran in a cache without a host pool")

    monkeypatch.setattr(wp, "eviction_order", refuse)
    cache, kv = gated_cache(policy, device=16, host=0, clean_ahead_pages=4)
    for i in range(8):  # fills L1 twice over: eviction on every request
        serve_kv(cache, kv, np.arange(4) + 100 * i)
    st = cache.stats()
    assert st["backups"] == 0 and st["evicted_tokens"] == 16
    check_cache(cache, kv)


@pytest.mark.parametrize("host", [0, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_host_pool_smaller_than_device_pool(policy, host):
    cache, kv = gated_cache(policy, device=12, host=host, threshold=1)
    rng = np.random.default_rng(1)
    for _ in range(40):
        conv = int(rng.integers(0, 4))
        t = np.arange(int(rng.integers(1, 8))) + 100 * conv
        serve_kv(cache, kv, t)
        check_cache(cache, kv)
    cache.flush()
    s = cache.stats()
    assert s["evictions"] > 0 and s["host_used_pages"] <= host
    if host == 0:
        assert s["backups"] == 0
    check_cache(cache, kv)
