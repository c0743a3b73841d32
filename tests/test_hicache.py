"""HiCache unit and regression tests: the request flow, policies, thresholds, and one test per
failure class SGLang's HiCache has had, plus bad input on every public method (typed error,
cache unchanged). The random-workload property test is in test_hicache_state_machine.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from hicache_jax import HiCache, HiCacheConfig, HiCacheError, KVSpec, Match, OutOfPagesError
from hicache_jax.events.records import replay
from test_hicache_state_machine import (GatedEngine, KVModel, bits, check_bytes,
                                        check_invariants, gate, snapshot, tree_pages)

POLICIES = ["write_through", "write_through_selective", "write_back", "clean_ahead"]


def make(policy="write_through", *, device=16, host=32, ps=1, threshold=None, **kw):
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=ps)
    cfg = HiCacheConfig(device_pages=device, host_pages=host, write_policy=policy,
                        write_through_threshold=threshold, load_back_threshold=kw.pop("lbt", ps),
                        **kw)
    return HiCache(spec, cfg, transfer_engine=GatedEngine), KVModel(spec)


def request(cache, kv, tokens, *, load=True, extra_key=None):
    """The request flow of ARCHITECTURE.md; returns the match used (after load_back)."""
    tokens = np.asarray(tokens, np.int64)
    ps = cache.spec.page_size
    m = cache.match_prefix(tokens, extra_key)
    if load:
        m = cache.load_back(m)
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)),
                                  kv.pages(extra_key, tokens, 0, m.device_pages.size))
    cache.lock(m.node)
    n_new = tokens.size // ps - m.device_pages.size
    new = cache.alloc_pages(n_new)
    cache.write_kv(new, kv.pages(extra_key, tokens, m.device_pages.size, tokens.size // ps))
    cache.insert(tokens, np.concatenate([m.device_pages, new]), extra_key)
    cache.unlock(m.node)
    return m


def check(cache, kv):
    check_invariants(cache)
    check_bytes(cache, kv)


def node_of(cache, tokens):
    """The Match.node handle of ``tokens`` (for lock / unlock)."""
    m = cache.match_prefix(np.asarray(tokens))
    return m.node


def tree_node_of(cache, tokens):
    """The tree's node behind that handle (to look at its fields)."""
    return node_of(cache, tokens)._node


# ----------------------------------------------------------------------------- the contract

def test_request_flow_device_then_host_hit():
    cache, kv = make("write_through", device=8, host=32)
    t = np.arange(8)
    request(cache, kv, t)          # threshold 1: backed up at the insert that creates it
    cache.flush()
    assert cache.stats()["backups"] == 1
    request(cache, kv, t)          # a device hit: nothing more to back up
    cache.flush()
    assert cache.stats()["backups"] == 1 and cache.stats()["host_cached_tokens"] == 8
    assert cache.evict(8) == 8     # backed up: device freed, node kept on host
    m = cache.match_prefix(t)
    assert (m.device_len, m.host_len) == (0, 8)
    m2 = cache.load_back(m)
    assert (m2.device_len, m2.host_len) == (8, 0) and m2.node == m.node
    np.testing.assert_array_equal(bits(cache.read_kv(m2.device_pages)), kv.pages(None, t, 0, 8))
    assert cache.stats()["load_backs"] == 1
    check(cache, kv)


def test_insert_returns_prefix_and_frees_duplicates():
    cache, kv = make()
    t = np.arange(6)
    a = cache.alloc_pages(6)
    b = cache.alloc_pages(6)
    cache.write_kv(a, kv.pages(None, t, 0, 6))
    cache.write_kv(b, kv.pages(None, t, 0, 6))
    assert cache.insert(t, a) == 0
    free = cache.stats()["device_free_pages"]
    assert cache.insert(t, b) == 6                          # b duplicates a: freed
    assert cache.stats()["device_free_pages"] == free + 6
    assert cache.stats()["device_caller_pages"] == 0
    assert cache.insert(t, a) == 6                          # the tree's own pages: no-op
    check(cache, kv)


@pytest.mark.parametrize("policy,backs_up_at", [("write_through", 1), ("write_through_selective", 2),
                                                ("write_back", None)])
def test_write_through_threshold(policy, backs_up_at):
    """The insert that creates a node is its first access (as current SGLang counts it):
    threshold 1 backs up at insert, write_through_selective (2) at the second access."""
    cache, kv = make(policy)
    t = np.arange(4)
    for access in range(1, 5):
        request(cache, kv, t)
        cache.flush()
        backed = cache.stats()["backups"] > 0
        assert backed == (backs_up_at is not None and access >= backs_up_at), access


def test_chunked_insert_counts_no_hit():
    cache, kv = make("write_through_selective")
    t = np.arange(4)
    request(cache, kv, t)                 # created: its first access
    m = cache.match_prefix(t)
    cache.insert(t, m.device_pages, chunked=True)
    cache.flush()
    assert cache.stats()["backups"] == 0 and m.node._node.hit_count == 1
    u = np.arange(50, 54)                 # a chunk that creates a node: no access yet
    new = cache.alloc_pages(4)
    cache.write_kv(new, kv.pages(None, u, 0, 4))
    cache.insert(u, new, chunked=True)
    assert cache.match_prefix(u).node._node.hit_count == 0
    cache.insert(u, new)                  # the request's final insert: its first access
    assert cache.match_prefix(u).node._node.hit_count == 1
    cache.flush()
    assert cache.stats()["backups"] == 0
    check(cache, kv)


def test_continuous_prefix_guard_skips_child_of_unbacked_parent():
    # Host pool of 2 pages: the 3-page parent can never be backed up, so its 1-page child,
    # which would fit, must not be (a gap in the host prefix).
    cache, kv = make("write_through", host=2)
    request(cache, kv, np.arange(3))
    request(cache, kv, np.arange(4))
    request(cache, kv, np.arange(4))
    cache.flush()
    assert cache.stats()["backups"] == 0 and cache.stats()["host_used_pages"] == 0
    check(cache, kv)


def test_write_back_backs_up_on_evict_then_loads_back():
    cache, kv = make("write_back", device=8)
    t = np.arange(8)
    request(cache, kv, t)
    assert cache.stats()["backups"] == 0
    assert cache.evict(8) == 8
    assert cache.stats()["backups"] == 1 and cache.stats()["host_cached_tokens"] == 8
    assert cache.stats()["eviction_backup_pages"] == 8  # copied on the eviction path
    m = cache.load_back(cache.match_prefix(t))
    assert m.device_len == 8
    check(cache, kv)


def _count_backup_calls(cache):
    """Wrap the transfer engine's backup: returns the list of page counts per call."""
    engine = cache.transfer_engine
    calls, real = [], engine.backup
    engine.backup = lambda d, h, **kw: calls.append(len(d)) or real(d, h, **kw)
    return calls


def test_write_back_eviction_round_backs_up_all_victims_in_one_transfer():
    cache, kv = make("write_back", device=16, host=32)
    prompts = [np.arange(4) + 100 * i for i in range(4)]  # four disjoint 4-page leaves
    for t in prompts:
        request(cache, kv, t)
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
    check(cache, kv)


def test_write_through_hits_on_a_path_back_up_in_one_transfer():
    cache, kv = make("write_through", device=32, host=64, threshold=3)
    request(cache, kv, np.arange(8))         # one node, hit_count 1 (its creation)
    request(cache, kv, np.arange(8))         # hit_count 2: under the threshold
    cache.match_prefix(np.arange(4))         # splits it: both halves keep hit_count 2
    calls = _count_backup_calls(cache)
    request(cache, kv, np.arange(12))        # hits both halves -> both reach the threshold
    assert calls == [8]                      # root-first, one dispatch
    cache.flush()
    assert cache.stats()["backups"] == 2 and cache.stats()["host_cached_tokens"] == 8
    check(cache, kv)


def test_write_through_evicts_unbacked_nodes_by_deleting_them():
    cache, kv = make("write_through", threshold=2)
    request(cache, kv, np.arange(5))
    assert cache.evict(100) == 5
    m = cache.match_prefix(np.arange(5))
    assert (m.device_len, m.host_len) == (0, 0) and cache.stats()["deleted_tokens"] == 5


def test_load_back_threshold_and_quota_decline():
    for kw in (dict(lbt=8), dict(load_back_quota=3)):
        cache, kv = make("write_back", **kw)
        t = np.arange(4)
        request(cache, kv, t)
        cache.evict(4)
        m = cache.match_prefix(t)
        assert m.host_len == 4
        assert cache.load_back(m) is m
        assert cache.stats()["load_backs_declined"] == 1
        # Declined: the caller recomputes; insert revives the host-only node with its pages.
        request(cache, kv, t, load=False)
        assert cache.match_prefix(t).device_len == 4 and cache.stats()["host_cached_tokens"] == 4
        check(cache, kv)


def test_load_back_never_evicts_the_chains_ancestors():
    cache, kv = make("write_back", device=6, host=16)
    p, c = np.arange(4), np.arange(6)
    request(cache, kv, p)
    request(cache, kv, c)                      # child node [4, 5] under [0..3]
    assert cache.evict(2) == 2                 # the child: backed up, host-only
    held = cache.alloc_pages(2)                # no free device page left
    m = cache.match_prefix(c)
    assert (m.device_len, m.host_len) == (4, 2)
    # The only evictable device node is the chain's parent: decline instead of evicting it.
    assert cache.load_back(m) is m
    assert cache.match_prefix(p).device_len == 4 and cache.stats()["load_backs_declined"] == 1
    cache.free_pages(held)
    assert cache.load_back(cache.match_prefix(c)).device_len == 6
    check(cache, kv)


def test_layerwise_load_back_handle():
    cache, kv = make("write_back", ps=16, device=8)
    t = np.arange(64)
    request(cache, kv, t)
    cache.evict(64)
    m = cache.load_back(cache.match_prefix(t), layerwise=True)
    assert m.device_len == 64 and m.load_handle is not None
    for layer in range(cache.spec.num_layers):
        m.load_handle.wait_layer(layer)
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 4))
    assert cache.load_back(cache.match_prefix(t)).load_handle is None
    check(cache, kv)


def test_alloc_pages_out_of_pages_counts_and_unchanged():
    cache, kv = make("write_through", device=8)
    request(cache, kv, np.arange(3))
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
    assert cache.alloc_pages(8).size == 8   # everything evictable again


def test_backup_that_cannot_fit_deletes_nothing_from_host():
    """A backup larger than what host eviction can free is skipped before any host-only node is
    deleted (host pages of backed-up device nodes are not evictable)."""
    cache, kv = make("write_through", device=16, host=4, ps=2)
    a, b, c = np.arange(4), np.arange(100, 104), np.arange(200, 206)
    for t in (a, a):
        request(cache, kv, t)
    cache.flush()
    cache.evict(4)  # a -> host only (2 host pages)
    for t in (b, b):
        request(cache, kv, t)  # b backed up and on device: host 4/4
    cache.flush()
    assert cache.match_prefix(a).host_len == 4
    request(cache, kv, c)  # c (3 pages) cannot fit while b's 2 are pinned
    cache.flush()
    st = cache.stats()
    assert cache.match_prefix(a).host_len == 4  # a's host copy survived
    assert st["backups_skipped"] == 1 and st["host_evictions"] == 0
    check(cache, kv)


def test_backup_larger_than_the_host_pool_does_not_wait_for_copies_in_flight():
    cache, kv = make("write_through", device=32, host=4, ps=2)
    engine = gate(cache)
    a, b = np.arange(4), np.arange(100, 110)  # b: 5 pages > 4 host pages
    request(cache, kv, b)  # b's backup can never fit: skipped
    assert cache.stats()["backups_skipped"] == 1
    request(cache, kv, a)  # a's backup in flight (gated)
    pending = [h for h in engine.handles if not h.released]
    assert pending
    request(cache, kv, b)  # b's backup skipped again, without waiting for a's
    assert not any(h.released for h in pending)
    assert cache.stats()["backups_skipped"] == 2
    engine.release()
    cache.flush()
    check(cache, kv)


def test_write_back_evicts_a_node_whose_backup_cannot_fit_with_its_host_only_children():
    """A not-backed-up device leaf with a host-only child and no host room for its backup used
    to stay: alloc_pages then evicted others and still raised (after changing the cache). It
    now goes with its host-only children, so the pre-check (unlocked device pages) is exact."""
    cache, kv = make("write_back", device=6, host=2)
    request(cache, kv, [0, 1, 2])
    request(cache, kv, [0, 1, 2, 3])
    cache.evict(1)  # [3] backed up and dropped: a host-only child of [0, 1, 2]
    cache.flush()
    request(cache, kv, [100])
    assert cache.stats()["device_evictable_pages"] == 4
    pages = cache.alloc_pages(6)  # needs [0, 1, 2] gone: 3 pages, host has room for 1
    assert pages.size == 6 and cache.stats()["device_free_pages"] == 0
    assert cache.match_prefix([0, 1, 2, 3]).host_len == 0  # the child went with it
    cache.free_pages(pages)
    check(cache, kv)
    request(cache, kv, [7, 8, 9])
    node = node_of(cache, [7, 8, 9])
    cache.lock(node)
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError):
        cache.alloc_pages(6)
    assert snapshot(cache) == before
    cache.unlock(node)


def _backed_up_then_evicted(cache, kv, tokens):
    """Two requests (the hit backs ``tokens`` up), then its device pages are evicted."""
    request(cache, kv, tokens)
    request(cache, kv, tokens)
    cache.flush()
    cache.evict(len(tokens))
    cache.flush()


def test_load_back_of_a_stale_match_reports_what_is_on_device_now():
    cache, kv = make("write_through", device=16, host=16, ps=2)
    t = np.arange(8)
    _backed_up_then_evicted(cache, kv, t)
    m1, m2 = cache.match_prefix(t), cache.match_prefix(t)
    assert m1.host_len == m2.host_len == 8
    r1 = cache.load_back(m1)
    r2 = cache.load_back(m2)  # r1 loaded it meanwhile
    assert (r2.device_len, r2.host_len) == (8, 0)
    np.testing.assert_array_equal(r2.device_pages, r1.device_pages)
    cache.flush()
    check(cache, kv)


def test_load_back_of_a_match_whose_device_pages_moved_returns_the_new_pages():
    """The prefix of a match was evicted and loaded back into other pages by another request:
    load_back returned the old match, whose pages were free (or another caller's: its insert
    then freed them)."""
    cache, kv = make("write_through", device=8, host=8, lbt=0)
    toks = np.arange(1, 5)
    request(cache, kv, toks)
    request(cache, kv, toks)
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
    request(cache, kv, toks)
    check(cache, kv)


def _prefix_split_between_tiers(cache, kv):
    """[0, 8) cached and backed up, then split at 4 with the upper part on device and the lower
    part host-only; returns the match of the whole prefix (device 4, host 4)."""
    t = np.arange(8)
    request(cache, kv, t)            # backed up at insert
    cache.flush()
    cache.match_prefix(t[:4])        # split at 4
    assert cache.evict(4) == 4       # the lower half leaves the device
    m = cache.match_prefix(t)
    assert (m.device_len, m.host_len) == (4, 4)
    return t, m


def test_load_back_declined_for_lack_of_pages_returns_what_holds_the_prefix_now():
    """A scheduler matches its batch first: another request's alloc_pages then evicts the
    match's device part and takes its pages. load_back, declined for lack of device pages,
    returned the old Match, whose device_pages were now that other request's."""
    cache, kv = make("write_through", device=8, host=32)
    t, m = _prefix_split_between_tiers(cache, kv)
    other = cache.alloc_pages(8)     # evicts the upper half too: every page is the other's
    assert set(m.device_pages.tolist()) <= set(other.tolist())
    r = cache.load_back(m)           # needs 8 pages: none free, none evictable -> declined
    assert cache.stats()["load_backs_declined"] == 1
    assert (r.device_len, r.host_len, r.device_pages.size) == (0, 8, 0)
    assert r.node == m.node
    with pytest.raises(HiCacheError, match="stale Match.*match_prefix"):
        cache.lock(m.node)
    cache.lock(r.node)               # what load_back returned is current
    cache.free_pages(other)
    cache.unlock(r.node)
    request(cache, kv, t)
    check(cache, kv)


@pytest.mark.parametrize("moved", [False, True])
def test_lock_of_a_stale_match_is_refused_and_changes_nothing(moved):
    """Evicted since the match (moved=False), or evicted and loaded back into other pages
    (moved=True: the prefix is on device again, but not in the pages the match names)."""
    cache, kv = make("write_through", device=8, host=32)
    t = np.arange(4)
    request(cache, kv, t)
    request(cache, kv, t)
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
    m = cache.load_back(stale)       # load_back revalidates: lock what it returns
    cache.lock(m.node)
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 4))
    cache.unlock(m.node)
    check(cache, kv)


def test_a_match_stays_lockable_through_unrelated_eviction_and_splits():
    """Staleness is about the match's own pages: other prefixes evicted, its node split by
    another insert, copies landing -- none of that makes it stale."""
    cache, kv = make("write_through", device=16, host=32)
    a, b = np.arange(8), np.arange(100, 104)
    request(cache, kv, a)
    request(cache, kv, b)
    m = cache.match_prefix(a)
    request(cache, kv, np.concatenate([a[:3], [7, 7]]))  # splits a's node at 3
    request(cache, kv, a)                                # backs a up (both parts)
    cache.flush()
    assert cache.match_prefix(b).device_len == 4
    cache.lock(m.node)
    assert cache.evict(100) > 0                          # everything but a goes
    assert cache.match_prefix(b).device_len == 0
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, a, 0, 8))
    cache.unlock(m.node)
    check(cache, kv)


def test_load_back_of_a_match_whose_node_was_deleted_matches_its_prefix_again():
    cache, kv = make("write_through", device=8, host=32, threshold=2)
    t = np.arange(4)
    request(cache, kv, t)            # one access: not backed up
    m = cache.match_prefix(t)
    cache.evict(4)                   # deleted (no host copy)
    with pytest.raises(HiCacheError, match="not in this cache"):
        cache.lock(m.node)
    r = cache.load_back(m)
    assert (r.device_len, r.host_len) == (0, 0)
    request(cache, kv, t)            # computed again by another request
    r = cache.load_back(m)
    assert r.device_len == 4
    cache.lock(r.node)
    np.testing.assert_array_equal(bits(cache.read_kv(r.device_pages)), kv.pages(None, t, 0, 4))
    cache.unlock(r.node)
    check(cache, kv)


def test_load_back_whose_dispatch_fails_leaves_the_cache_unchanged():
    cache, kv = make("write_through", device=8, host=8, ps=2)
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
    check(cache, kv)
    assert cache.load_back(m).device_len == 4


def test_reset_forgets_everything():
    cache, kv = make("write_back")
    request(cache, kv, np.arange(6))
    cache.evict(3)
    cache.reset()
    s = cache.stats()
    assert s["device_free_pages"] == 16 and s["host_free_pages"] == 32
    assert cache.match_prefix(np.arange(6)).device_len == 0
    check(cache, kv)


# ----------------------------------------------------------------------------- regressions

def test_node_split_while_write_through_copy_in_flight():
    """A node holds its host pages from the backup's dispatch: a split mid-copy gives each half
    its slice, and both read back the copied bytes once it lands."""
    cache, kv = make("write_through")
    eng = gate(cache)
    t = np.arange(8)
    request(cache, kv, t)
    request(cache, kv, t)                      # backup dispatched, held in flight
    assert cache.stats()["transfers_in_flight"] == 1
    assert tree_node_of(cache, t).lock_ref == 0  # a backup locks nothing
    m = cache.match_prefix(t[:3])              # splits the node mid-copy
    upper = m.node._node
    lower = tree_node_of(cache, t)
    assert upper.num_tokens == 3 and upper.host_value.size == 3 and lower.parent is upper
    check_invariants(cache)
    cache.evict(8)                             # device pages freed while the copy reads them
    assert cache.stats()["device_cached_tokens"] == 0 and eng.handles
    eng.release()
    cache.flush()
    assert cache.stats()["host_cached_tokens"] == 8
    check(cache, kv)                           # host bytes of both halves are right
    m = cache.load_back(cache.match_prefix(t))
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 8))


def _host_only(cache, kv, tokens):
    request(cache, kv, tokens)
    n = node_of(cache, tokens)
    cache.lock(n)
    cache.evict(1000)            # everything else goes first
    cache.unlock(n)
    cache.evict(1000)
    m = cache.match_prefix(tokens)
    assert m.device_len == 0 and m.host_len == len(tokens)
    return m


def test_evict_host_reaching_node_whose_load_back_is_in_flight():
    # write_back: allocating device pages evicts, which backs up, which needs host pages,
    # which evicts host nodes. The node being loaded is the least recently used one: it must
    # be neither device-evicted (its pages are the copy's destination) nor host-evicted.
    cache, kv = make("write_back", device=8, host=6)
    a, b = np.arange(4), np.arange(300, 302)
    request(cache, kv, a)
    request(cache, kv, b)
    cache.evict(1000)                          # both backed up and host-only: host is full
    cache.flush()                              # (eviction does not wait for the copies)
    eng = gate(cache)
    m = cache.load_back(cache.match_prefix(a))
    loaded, hv = m.device_pages.copy(), m.node._node.host_value.copy()
    assert cache.stats()["transfers_in_flight"] == 1
    request(cache, kv, np.arange(100, 102))    # fits
    request(cache, kv, np.arange(200, 204))    # evict -> backup -> evict_host
    assert cache.stats()["host_evictions"] >= 1 and cache.match_prefix(b).host_len == 0
    assert m.node._node.parent is not None and np.array_equal(m.node._node.value, loaded)
    assert np.array_equal(m.node._node.host_value, hv) and cache.host_pool.allocator.is_allocated(hv).all()
    check(cache, kv)
    eng.release()
    cache.flush()
    np.testing.assert_array_equal(bits(cache.read_kv(loaded)), kv.pages(None, a, 0, 4))
    check(cache, kv)


def test_host_pages_released_before_async_load_finished():
    cache, kv = make("write_back", device=8, host=8)
    eng = gate(cache)
    a = np.arange(4)
    m = cache.load_back(_host_only(cache, kv, a))
    hv = m.node._node.host_value.copy()
    cache.evict(1000)                          # locked by the load: stays on device
    cache.evict_host(1000)                     # and its host pages stay allocated
    assert cache.host_pool.allocator.is_allocated(hv).all()
    assert m.node._node.value is not None and np.array_equal(m.node._node.host_value, hv)
    eng.release()
    cache.flush()
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, a, 0, 4))
    check(cache, kv)


def test_evict_host_without_progress_returns():
    cache, kv = make("write_back", device=4, host=4)
    m = _host_only(cache, kv, np.arange(4))
    cache.lock(m.node)                         # the only host node is protected
    assert cache.evict_host(1000) == 0
    # A backup that needs host pages: evict_host makes no progress, the backup is skipped
    # and the request still succeeds (its node is deleted instead of backed up).
    request(cache, kv, np.arange(50, 52))
    request(cache, kv, np.arange(60, 64))
    assert cache.stats()["backups_skipped"] >= 1
    cache.unlock(m.node)
    check(cache, kv)


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_when_everything_is_locked(policy):
    cache, kv = make(policy, device=8)
    request(cache, kv, np.arange(8))
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
    check(cache, kv)


@pytest.mark.parametrize("host", [0, 3])
@pytest.mark.parametrize("policy", POLICIES)
def test_host_pool_smaller_than_device_pool(policy, host):
    cache, kv = make(policy, device=12, host=host, threshold=1)
    rng = np.random.default_rng(1)
    for _ in range(40):
        conv = int(rng.integers(0, 4))
        t = np.arange(int(rng.integers(1, 8))) + 100 * conv
        request(cache, kv, t)
        check(cache, kv)
    cache.flush()
    s = cache.stats()
    assert s["evictions"] > 0 and s["host_used_pages"] <= host
    if host == 0:
        assert s["backups"] == 0
    check(cache, kv)


def test_host_page_given_up_while_copy_into_it_in_flight_is_parked_until_it_lands():
    """Host pages a node gives up while its backup still writes them are the copy's until it
    lands (never handed to a new owner meanwhile); a host allocation that needs them waits."""
    cache, kv = make("write_back", device=8, host=4)
    eng = gate(cache)
    t = np.arange(4)
    request(cache, kv, t)
    assert cache.evict(4) == 4                 # backed up into all 4 host pages, in flight
    inflight = [h.host_ids for h in eng.handles]
    assert len(inflight) == 1 and inflight[0].size == 4
    assert cache.stats()["host_cached_tokens"] == 4 and cache.stats()["device_free_pages"] == 8
    assert cache.evict_host(4) == 4            # the node goes; its pages are parked
    assert cache.host_pool.allocator.is_allocated(inflight[0]).all()
    assert cache.stats()["host_free_pages"] == 0
    check_invariants(cache)
    u = np.arange(100, 104)
    request(cache, kv, u)
    first = eng.handles[0]
    assert not first.released and cache.stats()["transfers_in_flight"] == 1
    assert cache.evict(4) == 4                 # its backup needs the parked pages: waits
    assert first.released
    cache.flush()
    assert np.array_equal(np.sort(tree_node_of(cache, u).host_value), np.sort(inflight[0]))
    assert cache.stats()["host_free_pages"] == 0
    check(cache, kv)
    m = cache.load_back(cache.match_prefix(u))
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, u, 0, 4))


# ----------------------------------------------------------------------------- bad input

def _bad_calls(cache, kv, tree_page, mine, node):
    other, _ = make()
    foreign = other.match_prefix([1]).node
    L, ps = cache.spec.num_layers, cache.spec.page_size
    good = cache.match_prefix([1])
    return [
        (ValueError, lambda: cache.match_prefix(np.zeros((2, 2), np.int64))),
        (TypeError, lambda: cache.match_prefix(np.array([1.5, 2.0]))),
        (ValueError, lambda: cache.match_prefix([-1, 2])),
        (TypeError, lambda: cache.match_prefix([1, 2], extra_key=[1])),
        (ValueError, lambda: cache.match_prefix([1, 2], extra_key=float("nan"))),
        (ValueError, lambda: cache.match_prefix([1, 2], extra_key=("lora", np.float32("nan")))),
        (ValueError, lambda: cache.insert(np.arange(ps), mine[:1], extra_key=float("nan"))),
        (TypeError, lambda: cache.load_back("match")),
        (HiCacheError, lambda: cache.load_back(Match(np.zeros(0, np.int32), 0, 0, foreign))),
        (TypeError, lambda: cache.load_back(good, layerwise="yes")),
        (TypeError, lambda: cache.lock("node")),
        (HiCacheError, lambda: cache.lock(foreign)),
        (HiCacheError, lambda: cache.unlock(node)),          # not locked by the caller
        (ValueError, lambda: cache.alloc_pages(-1)),
        (TypeError, lambda: cache.alloc_pages(2.0)),
        (TypeError, lambda: cache.alloc_pages(True)),
        (HiCacheError, lambda: cache.free_pages([tree_page])),
        (ValueError, lambda: cache.free_pages([mine[0], mine[0]])),
        (ValueError, lambda: cache.free_pages([10_000])),
        (ValueError, lambda: cache.free_pages(np.zeros((1, 1), np.int32))),
        (HiCacheError, lambda: cache.write_kv([tree_page], kv.pages(None, np.arange(ps), 0, 1))),
        (ValueError, lambda: cache.write_kv(mine[:1], np.zeros((L, 2, 2, ps, 2, 4), np.uint16))),
        (TypeError, lambda: cache.write_kv(mine[:1], np.zeros((L, 2, 1, ps, 2, 4), np.int32))),
        (HiCacheError, lambda: cache.read_kv([cache.stats()["device_pages"] - 1])),
        (ValueError, lambda: cache.read_kv([10_000])),
        (ValueError, lambda: cache.insert(np.arange(3 * ps), mine[:1])),
        (HiCacheError, lambda: cache.insert(np.arange(ps) + 500, [tree_page])),
        (HiCacheError, lambda: cache.insert(np.arange(ps) + 500,
                                            [cache.stats()["device_pages"] - 1])),
        (TypeError, lambda: cache.insert(np.arange(ps), mine[:1], chunked=1)),
        (TypeError, lambda: cache.insert(np.arange(ps), mine[:1], priority=1.5)),
        (ValueError, lambda: cache.insert(np.arange(ps), mine[:1], priority=2**62 + 1)),
        (ValueError, lambda: cache.insert(np.arange(ps), mine[:1], priority=-(2**62) - 1)),
        (ValueError, lambda: cache.insert(np.arange(ps) - 5, mine[:1])),
        (ValueError, lambda: cache.evict(-1)),
        (TypeError, lambda: cache.evict(1.0)),
        (ValueError, lambda: cache.evict_host(-3)),
        (TypeError, lambda: cache.evict_host("x")),
    ]


@pytest.mark.parametrize("policy", POLICIES)
def test_bad_input_typed_error_and_cache_unchanged(policy):
    cache, kv = make(policy, device=16, host=8, kv_events={"publisher": "queue"})
    t = np.arange(6)
    request(cache, kv, t)
    request(cache, kv, t)
    cache.flush()
    node = node_of(cache, t)
    tree_page = int(node._node.value[0])
    mine = cache.alloc_pages(3)
    calls = _bad_calls(cache, kv, tree_page, mine, node)
    for err, call in calls:
        before = snapshot(cache)
        events_before = tree_pages(cache)
        with pytest.raises(err):
            call()
        assert snapshot(cache) == before, call
        assert tree_pages(cache) == events_before
    router = replay(cache.take_events())
    assert router == tree_pages(cache)
    cache.free_pages(mine)
    check(cache, kv)


def test_unlock_of_a_node_only_a_copy_holds_is_refused():
    """The caller's unlock is counted apart from the cache's own locks: a node locked only by a
    load-back in flight cannot be unlocked by a caller (eviction would then free its pages while
    the copy writes them)."""
    cache, kv = make("write_back", device=8, host=16)
    engine = gate(cache)
    t = np.arange(4)
    request(cache, kv, t)
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
    check(cache, kv)


def test_constructor_rejects_bad_arguments():
    spec = KVSpec(2, 2, 4, page_size=1)
    with pytest.raises(TypeError, match="KVSpec"):
        HiCache("spec", HiCacheConfig(device_pages=4))
    with pytest.raises(TypeError, match="HiCacheConfig"):
        HiCache(spec, {"device_pages": 4})


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_sharded_pools_round_trip(policy):
    # Pools sharded over kv heads on 2 of the 4 CPU devices: backup, evict and load_back keep
    # every byte (each device moves only its heads).
    import jax
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()[:2]), ("heads",))
    cache, kv = make(policy, device=8, host=16, mesh=mesh)
    t = np.arange(6)
    request(cache, kv, t)
    request(cache, kv, t)
    cache.evict(100)
    m = cache.load_back(cache.match_prefix(t))
    assert m.device_len == 6
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)), kv.pages(None, t, 0, 6))
    cache.flush()
    check(cache, kv)


# ----------------------------------------------------------------------------- threads, close

def _in_thread(fn):
    """Run ``fn`` on a new thread; returns what it returned or raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            out["error"] = e
    th = threading.Thread(target=run, name="intruder")
    th.start()
    th.join()
    return out


def test_calls_from_a_second_thread_are_refused_and_change_nothing():
    cache, kv = make()
    t = np.arange(4)
    request(cache, kv, t)            # this thread owns the cache now
    m = cache.match_prefix(t)
    mine = cache.alloc_pages(1)
    calls = [lambda: cache.match_prefix(t), lambda: cache.load_back(m),
             lambda: cache.lock(m.node), lambda: cache.alloc_pages(1),
             lambda: cache.free_pages(mine), lambda: cache.read_kv(mine),
             lambda: cache.insert(t[:1] + 50, mine), lambda: cache.evict(4),
             lambda: cache.evict_host(4), lambda: cache.flush(), lambda: cache.take_events(),
             lambda: cache.reset(), lambda: cache.close(), lambda: cache.release_thread(),
             lambda: cache.device_pool]
    before = snapshot(cache), tree_pages(cache)
    for call in calls:
        out = _in_thread(call)
        assert isinstance(out.get("error"), HiCacheError), (call, out)
        assert "owned by thread 'MainThread'" in str(out["error"]) and "intruder" in str(out["error"])
        assert (snapshot(cache), tree_pages(cache)) == before
    assert _in_thread(cache.stats)["value"]["device_pages"] == 16  # stats: from anywhere
    cache.free_pages(mine)
    check(cache, kv)


class _Worker:
    """One long-lived thread that runs what it is given (thread idents are reused once a
    thread exits, so a test of ownership keeps its threads alive)."""

    def __init__(self, name: str) -> None:
        import queue
        self._jobs: "queue.Queue" = queue.Queue()
        self._results: "queue.Queue" = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (fn := self._jobs.get()) is not None:
            try:
                self._results.put(("value", fn()))
            except BaseException as e:  # handed back to the test thread
                self._results.put(("error", e))

    def run(self, fn):
        self._jobs.put(fn)
        kind, out = self._results.get(timeout=60)
        if kind == "error":
            raise out
        return out

    def stop(self) -> None:
        self._jobs.put(None)
        self.thread.join()


def test_ownership_is_taken_by_the_first_call_and_handed_over_explicitly():
    """Built on one thread, served from another (a serving stack's scheduler thread); then
    handed back with release_thread(); a cache whose owner exited goes to the next caller."""
    cache, kv = make()
    t = np.arange(4)
    sched, other = _Worker("scheduler"), _Worker("other")
    sched.run(lambda: request(cache, kv, t))              # the first call: it owns the cache
    with pytest.raises(HiCacheError, match="owned by thread 'scheduler'"):
        cache.match_prefix(t)
    with pytest.raises(HiCacheError, match="owned by thread 'scheduler'"):
        other.run(cache.release_thread)                   # only the owner hands it over
    sched.run(cache.release_thread)
    assert cache.match_prefix(t).device_len == 4          # this thread took it
    with pytest.raises(HiCacheError, match="owned by thread 'MainThread'"):
        sched.run(lambda: cache.match_prefix(t))
    cache.release_thread()
    assert other.run(lambda: cache.match_prefix(t).device_len) == 4
    other.stop()                                          # the owner exits without handing over
    assert sched.run(lambda: cache.match_prefix(t).device_len) == 4
    sched.stop()
    check(cache, kv)


def test_every_call_after_close_raises_but_stats():
    cache, kv = make()
    t = np.arange(4)
    request(cache, kv, t)
    m = cache.match_prefix(t)
    cache.close()
    cache.close()                    # idempotent
    for call in [lambda: cache.match_prefix(t), lambda: cache.load_back(m),
                 lambda: cache.lock(m.node), lambda: cache.alloc_pages(1),
                 lambda: cache.insert(t, m.device_pages), lambda: cache.read_kv(m.device_pages),
                 lambda: cache.evict(1), lambda: cache.flush(), lambda: cache.take_events(),
                 lambda: cache.reset(), lambda: cache.prefetch(t), lambda: cache.device_pool,
                 lambda: cache.release_thread()]:
        with pytest.raises(HiCacheError, match="closed"):
            call()
    assert cache.stats()["device_cached_tokens"] == 4
    assert "value" in _in_thread(cache.stats)


# ----------------------------------------------------------------------------- clean_ahead

def _tiers(cache):
    """{first token // 100: (on device, on host)} of every node, read without touching the
    tree (a match would refresh the access stamps that decide what eviction takes)."""
    return {int(n.key[0]) // 100: (n.value is not None, n.host_value is not None)
            for n in cache.tree.nodes()}


def test_clean_ahead_backs_up_the_eviction_end_so_eviction_copies_nothing():
    """The reserve at the eviction end of L1 is backed up after inserts, once eviction is near;
    eviction then frees pages that already have a host copy (no copy on the allocation path)."""
    cache, kv = make("clean_ahead", device=16, host=64, clean_ahead_pages=4)
    for i in range(3):                       # 12 of 16 pages: eviction not near, nothing copied
        request(cache, kv, np.arange(4) + 100 * i)
    cache.flush()
    assert cache.stats()["backups"] == 0
    request(cache, kv, np.arange(4) + 300)   # 0 free pages < reserve: the coldest 4 backed up
    cache.flush()
    st = cache.stats()
    assert st["clean_ahead_pages"] == 4 and st["backups"] == 1
    assert _tiers(cache)[0] == (True, True)  # the least recently used request
    for i in range(4, 8):                    # each evicts the coldest request, already clean
        request(cache, kv, np.arange(4) + 100 * i)
        cache.flush()
    st = cache.stats()
    assert st["evicted_tokens"] == 16 and st["eviction_backup_pages"] == 0
    assert st["deleted_tokens"] == 0         # every evicted page kept its host copy
    assert all(_tiers(cache)[i] == (False, True) for i in range(4))
    m = cache.load_back(cache.match_prefix(np.arange(4)))
    assert m.device_len == 4
    check(cache, kv)


def test_clean_ahead_pass_locks_nothing_eviction_takes_its_nodes_while_the_copy_runs():
    """A backup counts from its dispatch: the pass's nodes are clean at once (no lock), so the
    next eviction frees them while the copy is still in flight, copying and waiting for
    nothing; their host bytes are the copied ones once it lands."""
    cache, kv = make("clean_ahead", device=16, host=64, clean_ahead_pages=4)
    eng = gate(cache)
    for i in range(4):                       # the 4th fills L1: the coldest 4 pages backed up
        request(cache, kv, np.arange(4) + 100 * i)
    held = [h for h in eng.handles if not h.released]
    assert len(held) == 1 and cache.stats()["clean_ahead_pages"] == 4
    assert all(n.lock_ref == 0 for n in cache.tree.nodes() if n.parent is not None)
    request(cache, kv, np.arange(4) + 400)   # evicts the coldest, still copying
    st = cache.stats()
    assert st["evicted_tokens"] == 4 and st["eviction_backup_pages"] == 0
    assert _tiers(cache)[0] == (False, True) and not held[0].released
    eng.release()
    cache.flush()
    check(cache, kv)
    m = cache.load_back(cache.match_prefix(np.arange(4)))
    np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)),
                                  kv.pages(None, np.arange(4), 0, 4))


def test_write_back_eviction_frees_device_pages_without_waiting_for_the_copy():
    """The eviction path dispatches a dirty node's copy and frees its device pages at once; a
    new request writing into them meanwhile does not change what the host copy holds."""
    cache, kv = make("write_back", device=8, host=16)
    eng = gate(cache)
    t, u = np.arange(8), np.arange(100, 108)
    request(cache, kv, t)
    request(cache, kv, u)                    # all 8 device pages reused: t copied on the way
    held = [h for h in eng.handles if not h.released]
    assert len(held) == 1 and held[0].host_ids.size == 8
    st = cache.stats()
    assert st["eviction_backup_pages"] == 8 and st["host_cached_tokens"] == 8
    assert _tiers(cache) == {0: (False, True), 1: (True, False)}
    eng.release()
    cache.flush()
    check(cache, kv)
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
    cache, kv = make(policy, device=16, host=0, clean_ahead_pages=4)
    for i in range(8):                       # fills L1 twice over: eviction on every request
        request(cache, kv, np.arange(4) + 100 * i)
    st = cache.stats()
    assert st["backups"] == 0 and st["evicted_tokens"] == 16
    check(cache, kv)


def test_clean_ahead_gives_up_hot_redundant_host_copies_before_evicted_pages():
    """L2 full: the host copy of a page still on device (loaded back: hot again) is given up
    before any host-only page when the eviction end needs room."""
    cache, kv = make("clean_ahead", device=8, host=8, clean_ahead_pages=2)
    for i in range(12):
        request(cache, kv, np.arange(2) + 100 * i)
        cache.flush()
    t = _tiers(cache)
    assert cache.stats()["host_free_pages"] == 0
    assert [t[i] for i in (5, 6, 7)] == [(False, True)] * 3 and t[8] == (True, True)
    assert [t[i] for i in (9, 10, 11)] == [(True, False)] * 3
    # Request 7 again: loaded back (evicting 8, clean), keeping its host copy. At its unlock
    # the pass backs up 9, the new eviction end: room comes from 7's copy (hot, on device),
    # not from the evicted pages 5, 6 and 8.
    host_evictions = cache.stats()["host_evictions"]
    request(cache, kv, np.arange(2) + 700)
    cache.flush()
    t, st = _tiers(cache), cache.stats()
    assert st["load_backs"] == 1 and st["host_copies_dropped_tokens"] == 2
    assert st["host_evictions"] == host_evictions and st["eviction_backup_pages"] == 0
    assert t[7] == (True, False) and t[9] == (True, True)
    assert [t[i] for i in (5, 6, 8)] == [(False, True)] * 3
    check(cache, kv)


@pytest.mark.parametrize("eviction", ["mru", "lfu"])
def test_clean_ahead_cleans_a_request_that_goes_first_at_its_unlock(eviction):
    """Under strategies that evict new nodes first, the request just served is the next
    victim: the pass runs at its unlock (when its nodes are evictable), so the next request's
    eviction copies nothing."""
    cache, kv = make("clean_ahead", device=16, host=64, clean_ahead_pages=4, eviction=eviction)
    for i in range(10):
        request(cache, kv, np.arange(4) + 100 * i)
        cache.flush()
    st = cache.stats()
    assert st["evicted_tokens"] >= 16 and st["eviction_backup_pages"] == 0
    assert st["deleted_tokens"] == 0
    check(cache, kv)


def test_a_failed_alloc_leaves_clean_aheads_reserve_as_it_was():
    cache, kv = make("clean_ahead", device=64, host=64)
    request(cache, kv, np.arange(4))
    def reserve():
        return cache.stats()["clean_ahead_reserve_pages"]
    reserve_before = reserve()
    with pytest.raises(OutOfPagesError):
        cache.alloc_pages(1000)
    assert reserve() == reserve_before == 2 * 4      # twice the largest allocation
    new = cache.alloc_pages(12)            # one that succeeds: the reserve follows it
    assert reserve() == 24
    cache.free_pages(new)
    new = cache.alloc_pages(40)
    assert reserve() == 64 // 2               # at most half of L1
    cache.free_pages(new)


def test_clean_ahead_config():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=1)
    assert HiCacheConfig(device_pages=64, write_policy="clean_ahead").clean_ahead_pages is None
    assert HiCacheConfig(device_pages=8, clean_ahead_pages=3).clean_ahead_pages == 3
    with pytest.raises(ValueError, match="clean_ahead_pages=0 must be >= 1"):
        HiCacheConfig(device_pages=8, clean_ahead_pages=0)
    with pytest.raises(ValueError, match="not an L3 policy"):
        HiCacheConfig(device_pages=8, storage_write_policy="clean_ahead")
    HiCache(spec, HiCacheConfig(device_pages=8, host_pages=0, write_policy="clean_ahead"))


def test_a_reused_thread_ident_keeps_the_cache_with_the_live_thread():
    """CPython reuses a thread's ident as soon as it exits: a new thread with the dead owner's
    ident passes the owner check and uses the cache, so no third thread may take it then."""
    cache, kv = make()
    t = np.arange(4)
    owner = _Worker("first")
    owner.run(lambda: request(cache, kv, t))
    owner.stop()                      # the owner exits ...
    heir = _Worker("heir")
    cache._threads.ident = heir.thread.ident  # ... and the OS hands its ident to a new thread
    assert heir.run(lambda: cache.match_prefix(t).device_len) == 4
    with pytest.raises(HiCacheError, match="owned by thread 'heir'"):
        cache.match_prefix(t)
    heir.stop()
    assert cache.match_prefix(t).device_len == 4   # the heir exited too: this thread takes it


def test_events_of_clean_aheads_pass_at_unlock_are_sealed_by_the_unlock():
    """The pass at unlock gives up host copies (BlockRemoved): unlock seals them into its own
    batch, rather than leaving them for whatever public call comes next."""
    cache, kv = make("clean_ahead", device=8, host=8, clean_ahead_pages=2,
                     kv_events={"publisher": "queue"})
    for i in list(range(12)) + [7]:
        request(cache, kv, np.arange(2) + 100 * i)
        assert not cache._events._pending
        cache.flush()  # every backup landed: which host copies the next pass may drop is fixed
    assert cache.stats()["host_copies_dropped_tokens"] == 2
    router = replay(cache.take_events())
    assert router == tree_pages(cache)


def test_token_ids_held_as_int32_and_ids_beyond_refused():
    """The facade validates tokens once: ids up to 2**31 - 1 are cached (as int32 in the tree),
    whatever the input's integer type; an id beyond int32 is a ValueError that names the bound,
    on every call taking tokens, and leaves the cache unchanged (no silent wrap-around)."""
    cache, kv = make(ps=2, kv_events={"publisher": "queue"})
    top = 2**31 - 1
    toks = np.array([top, 0, top - 1, 9], np.int64)
    request(cache, kv, toks)
    for arg in (toks.tolist(), toks.astype(np.uint64), toks.astype(np.uint32),
                toks.astype(np.int32)):
        assert cache.match_prefix(arg).device_len == 4
    stored = [e for e in cache.take_events()   # the device copies (host ones land as backups do)
              if type(e).__name__ == "BlockStored" and e.medium.value == "device"]
    assert [list(e.token_ids) for e in stored] == [[top, 0], [top - 1, 9]]
    assert all(n.key.dtype == np.int32 for n in cache.tree.nodes())
    mine = cache.alloc_pages(2)
    for bad in ([2**31, 0, 1, 2], np.array([0, 1, 2**40, 3]), np.array([2**63] * 4, np.uint64)):
        before = snapshot(cache)
        for call in (lambda: cache.match_prefix(bad), lambda: cache.insert(bad, mine)):
            with pytest.raises(ValueError, match="beyond int32"):
                call()
        assert snapshot(cache) == before
    cache.free_pages(mine)
    check(cache, kv)


def test_check_invariants_names_the_broken_invariant():
    cache, kv = make("write_through", device=8, host=8)
    request(cache, kv, np.arange(4))
    cache.flush()
    cache.check_invariants()
    cache.tree.lock(node_of(cache, np.arange(4))._node)  # a lock that no one holds
    with pytest.raises(HiCacheError, match="lock_ref"):
        cache.check_invariants()
    cache, kv = make("write_through", device=8, host=8)
    request(cache, kv, np.arange(4))
    cache.host_pool.allocator.alloc(1)                    # a host page no one holds
    with pytest.raises(HiCacheError, match="host page is neither free"):
        cache.check_invariants()
    cache, kv = make("write_through", device=8, host=8)
    cache.device_pool.allocator.alloc(1)                  # a device page no one owns
    with pytest.raises(HiCacheError, match="device allocator disagrees"):
        cache.check_invariants()
