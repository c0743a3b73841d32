"""HiCache's clean_ahead write policy: the reserve at L1's eviction end backed up ahead of
eviction (so eviction copies nothing), the pass at unlock, which host copies it gives up for
room, its events, its reserve after a failed allocation, and its config."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bits, check_cache, gate, gated_cache, node_tiers, serve_kv, tree_pages
from hicache_jax import HiCache, HiCacheConfig, KVSpec, OutOfPagesError
from hicache_jax.events.records import replay


def test_clean_ahead_backs_up_the_eviction_end_so_eviction_copies_nothing():
    """The reserve at the eviction end of L1 is backed up after inserts, once eviction is near;
    eviction then frees pages that already have a host copy (no copy on the allocation path)."""
    cache, kv = gated_cache("clean_ahead", device=16, host=64, clean_ahead_pages=4)
    for i in range(3):  # 12 of 16 pages: eviction not near, nothing copied
        serve_kv(cache, kv, np.arange(4) + 100 * i)
    cache.flush()
    assert cache.stats()["backups"] == 0
    serve_kv(cache, kv, np.arange(4) + 300)  # 0 free pages < reserve: the coldest 4 backed up
    cache.flush()
    st = cache.stats()
    assert st["clean_ahead_pages"] == 4 and st["backups"] == 1
    assert node_tiers(cache)[0] == (True, True)  # the least recently used request
    for i in range(4, 8):  # each evicts the coldest request, already clean
        serve_kv(cache, kv, np.arange(4) + 100 * i)
        cache.flush()
    st = cache.stats()
    assert st["evicted_tokens"] == 16 and st["eviction_backup_pages"] == 0
    assert st["deleted_tokens"] == 0  # every evicted page kept its host copy
    assert all(node_tiers(cache)[i] == (False, True) for i in range(4))
    m = cache.load_back(cache.match_prefix(np.arange(4)))
    assert m.device_len == 4
    check_cache(cache, kv)


def test_clean_ahead_pass_locks_nothing_eviction_takes_its_nodes_while_the_copy_runs():
    """A backup counts from its dispatch: the pass's nodes are clean at once (no lock), so the
    next eviction frees them while the copy is still in flight, copying and waiting for
    nothing; their host bytes are the copied ones once it lands."""
    cache, kv = gated_cache("clean_ahead", device=16, host=64, clean_ahead_pages=4)
    eng = gate(cache)
    for i in range(4):  # the 4th fills L1: the coldest 4 pages backed up
        serve_kv(cache, kv, np.arange(4) + 100 * i)
    held = [h for h in eng.handles if not h.released]
    assert len(held) == 1 and cache.stats()["clean_ahead_pages"] == 4
    assert all(n.lock_ref == 0 for n in cache.tree.nodes() if n.parent is not None)
    serve_kv(cache, kv, np.arange(4) + 400)  # evicts the coldest, still copying
    st = cache.stats()
    assert st["evicted_tokens"] == 4 and st["eviction_backup_pages"] == 0
    assert node_tiers(cache)[0] == (False, True) and not held[0].released
    eng.release()
    cache.flush()
    check_cache(cache, kv)
    m = cache.load_back(cache.match_prefix(np.arange(4)))
    np.testing.assert_array_equal(
        bits(cache.read_kv(m.device_pages)), kv.pages(None, np.arange(4), 0, 4)
    )


def test_clean_ahead_gives_up_hot_redundant_host_copies_before_evicted_pages():
    """L2 full: the host copy of a page still on device (loaded back: hot again) is given up
    before any host-only page when the eviction end needs room."""
    cache, kv = gated_cache("clean_ahead", device=8, host=8, clean_ahead_pages=2)
    for i in range(12):
        serve_kv(cache, kv, np.arange(2) + 100 * i)
        cache.flush()
    t = node_tiers(cache)
    assert cache.stats()["host_free_pages"] == 0
    assert [t[i] for i in (5, 6, 7)] == [(False, True)] * 3 and t[8] == (True, True)
    assert [t[i] for i in (9, 10, 11)] == [(True, False)] * 3
    # Request 7 again: loaded back (evicting 8, clean), keeping its host copy. At its unlock
    # the pass backs up 9, the new eviction end: room comes from 7's copy (hot, on device),
    # not from the evicted pages 5, 6 and 8.
    host_evictions = cache.stats()["host_evictions"]
    serve_kv(cache, kv, np.arange(2) + 700)
    cache.flush()
    t, st = node_tiers(cache), cache.stats()
    assert st["load_backs"] == 1 and st["host_copies_dropped_tokens"] == 2
    assert st["host_evictions"] == host_evictions and st["eviction_backup_pages"] == 0
    assert t[7] == (True, False) and t[9] == (True, True)
    assert [t[i] for i in (5, 6, 8)] == [(False, True)] * 3
    check_cache(cache, kv)


@pytest.mark.parametrize("eviction", ["mru", "lfu"])
def test_clean_ahead_cleans_a_request_that_goes_first_at_its_unlock(eviction):
    """Under strategies that evict new nodes first, the request just served is the next
    victim: the pass runs at its unlock (when its nodes are evictable), so the next request's
    eviction copies nothing."""
    cache, kv = gated_cache(
        "clean_ahead", device=16, host=64, clean_ahead_pages=4, eviction=eviction
    )
    for i in range(10):
        serve_kv(cache, kv, np.arange(4) + 100 * i)
        cache.flush()
    st = cache.stats()
    assert st["evicted_tokens"] >= 16 and st["eviction_backup_pages"] == 0
    assert st["deleted_tokens"] == 0
    check_cache(cache, kv)


def test_a_failed_alloc_leaves_clean_aheads_reserve_as_it_was():
    """The reserve at unlock: twice the largest allocation that no admission announced (a
    request's own pages are cleaned by its admission pass), at most half of L1."""
    cache, kv = gated_cache("clean_ahead", device=64, host=64)
    serve_kv(cache, kv, np.arange(16))  # through begin: announced, no reserve at unlock

    def reserve():
        return cache.stats()["clean_ahead_reserve_pages"]

    assert reserve() == 0
    new = cache.alloc_pages(4)  # not announced: the reserve follows it
    cache.free_pages(new)
    reserve_before = reserve()
    with pytest.raises(OutOfPagesError):
        cache.alloc_pages(1000)
    assert reserve() == reserve_before == 2 * 4  # twice the largest allocation
    new = cache.alloc_pages(12)  # one that succeeds: the reserve follows it
    assert reserve() == 24
    cache.free_pages(new)
    new = cache.alloc_pages(40)
    assert reserve() == 64 // 2  # at most half of L1
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


def test_events_of_clean_aheads_pass_at_unlock_are_sealed_by_the_unlock():
    """The pass at unlock gives up host copies (BlockRemoved): unlock seals them into its own
    batch, rather than leaving them for whatever public call comes next."""
    cache, kv = gated_cache(
        "clean_ahead", device=8, host=8, clean_ahead_pages=2, kv_events={"publisher": "queue"}
    )
    for i in list(range(12)) + [7]:
        serve_kv(cache, kv, np.arange(2) + 100 * i)
        assert not cache._events._pending
        cache.flush()  # every backup landed: which host copies the next pass may drop is fixed
    assert cache.stats()["host_copies_dropped_tokens"] == 2
    router = replay(cache.take_events())
    assert router == tree_pages(cache)


def _serve_primitives(cache, kv, tokens):
    """One request through the primitives, without the admission pass of ``begin``."""
    tokens = np.asarray(tokens, np.int64)
    m = cache.load_back(cache.match_prefix(tokens))
    cache.lock(m.node)
    new = cache.alloc_pages(tokens.size - m.device_len)
    cache.write_kv(new, kv.pages(None, tokens, m.device_len, tokens.size))
    cache.insert(tokens, np.concatenate([m.device_pages, new]).astype(np.int32))
    cache.unlock(m.node)


@pytest.mark.parametrize("flow", ["begin", "primitives"])
def test_the_admission_pass_backs_up_what_a_requests_pages_will_evict(flow):
    """L1 full, a 12-page request: ``begin`` (its admission pass) backs up the 12 pages its
    allocation will take, so eviction copies nothing, and the 4 pages after them ride ahead in
    the same transfer (L2 has free pages); the primitives without ``prepare`` leave eviction to
    copy them on the allocation path."""
    cache, kv = gated_cache("clean_ahead", device=16, host=64)
    for i in range(4):
        serve_kv(cache, kv, np.arange(4) + 100 * i)
        cache.flush()
    assert cache.stats()["clean_ahead_pages"] == 0  # every allocation announced: no reserve
    tokens = np.arange(12) + 900
    serve_kv(cache, kv, tokens) if flow == "begin" else _serve_primitives(cache, kv, tokens)
    cache.flush()
    st, t = cache.stats(), node_tiers(cache)
    assert st["evicted_tokens"] == 12 and st["deleted_tokens"] == 0
    if flow == "begin":
        assert st["admission_clean_pages"] == 16 and st["eviction_backup_pages"] == 0
        assert t[3] == (True, True)  # backed up ahead, still on device
    else:
        assert st["admission_clean_pages"] == 0 and st["eviction_backup_pages"] == 12
    assert [t[i] for i in (0, 1, 2)] == [(False, True)] * 3 and t[3][0] and t[9][0]
    check_cache(cache, kv)


@pytest.mark.parametrize("policy, left_on_device", [("clean_ahead", 12), ("write_back", 0)])
def test_clean_ahead_evicts_only_the_pages_asked_for(policy, left_on_device):
    """An allocation of 4 pages from a full L1 holding one 16-page prompt: clean_ahead evicts
    its last 4 pages (the node is split; its head stays on device), write_back the whole node."""
    cache, kv = gated_cache(policy, device=16, host=64)
    tokens = np.arange(16)
    serve_kv(cache, kv, tokens)
    cache.flush()
    new = cache.alloc_pages(4)
    cache.flush()
    # not announced (no admission): copied on the allocation path, only what goes
    assert cache.stats()["eviction_backup_pages"] == (4 if policy == "clean_ahead" else 16)
    m = cache.match_prefix(tokens)
    assert (m.device_len, m.host_len) == (left_on_device, 16 - left_on_device)
    cache.free_pages(new)
    check_cache(cache, kv)


def test_clean_ahead_gives_up_only_the_host_pages_it_needs():
    """L2 full, the oldest prompt host-only in one 8-page node: making room for 2 pages
    deletes its last 2 pages only (the rest stays a host hit), not the whole node."""
    cache, kv = gated_cache("clean_ahead", device=8, host=8)
    a = np.arange(8)

    def host_pages_of_a():  # read without a match (a match would refresh a's access stamps)
        return sorted(
            n.num_tokens
            for n in cache.tree.nodes()
            if n.parent is not None and n.key[0] < 100 and n.host_value is not None
        )

    serve_kv(cache, kv, a)
    serve_kv(cache, kv, np.arange(8) + 100)  # admission backs up a: L2 full, a host-only
    cache.flush()
    assert host_pages_of_a() == [8] and cache.stats()["host_free_pages"] == 0
    serve_kv(cache, kv, np.arange(2) + 200)  # 2 of b's pages cleaned and evicted: 2 of a's go
    cache.flush()
    st = cache.stats()
    assert host_pages_of_a() == [6] and st["host_evicted_tokens"] == 2
    assert st["eviction_backup_pages"] == 0
    m = cache.match_prefix(a)
    assert (m.device_len, m.host_len) == (0, 6)
    check_cache(cache, kv)


def test_prepare_checks_its_arguments_and_does_nothing_under_other_policies():
    cache, kv = gated_cache("clean_ahead", device=8, host=8)
    serve_kv(cache, kv, np.arange(8))
    m = cache.match_prefix(np.arange(8))
    cache.flush()
    keys = ("backups", "admission_clean_pages", "evicted_tokens", "host_evicted_tokens")
    before, snap = {k: cache.stats()[k] for k in keys}, cache.tree.snapshot()
    with pytest.raises(TypeError, match="list or tuple of Match"):
        cache.prepare("not matches", 4)
    with pytest.raises(ValueError, match="num_pages=-1"):
        cache.prepare([m], -1)
    with pytest.raises(TypeError, match="num_pages"):
        cache.prepare([], 1.5)
    assert {k: cache.stats()[k] for k in keys} == before and cache.tree.snapshot() == snap
    cache.prepare([cache.match_prefix(np.arange(4) + 50)], 4)  # 4 pages will be evicted
    assert cache.stats()["admission_clean_pages"] == 4  # the last 4 (the node is split)
    assert sorted(
        (n.num_tokens, n.backed_up) for n in cache.tree.nodes() if n.parent is not None
    ) == [(4, False), (4, True)]
    wb, kv = gated_cache("write_back", device=8, host=8)
    serve_kv(wb, kv, np.arange(8))
    wb.prepare([wb.match_prefix(np.arange(4) + 50)], 4)
    assert wb.stats()["backups"] == 0 and wb.stats()["admission_clean_pages"] == 0


def test_trim_tail_refuses_what_it_cannot_split_and_changes_nothing():
    from hicache_jax import HiCacheError

    cache, kv = gated_cache("clean_ahead", device=8, host=8)
    serve_kv(cache, kv, np.arange(4))
    tree = cache.tree
    (node,) = [n for n in tree.nodes() if n.parent is not None]
    snap = tree.snapshot()
    for pages in (0, 4, 5):
        with pytest.raises(HiCacheError, match="trim_tail"):
            tree.trim_tail(node, pages)
    m = cache.match_prefix(np.arange(4))
    cache.lock(m.node)
    with pytest.raises(HiCacheError, match="unlocked"):
        tree.trim_tail(node, 1)
    cache.unlock(m.node)
    assert tree.snapshot() == snap
    assert tree.trim_tail(node, 1) is node and node.num_pages == 1
    assert node.parent.num_pages == 3 and node.parent.value is not None
    check_cache(cache, kv)


def test_an_admission_pass_makes_host_room_once_for_all_its_backups(monkeypatch):
    """L2 full of host-only prompts, L1 of four 2-page prompts: a 4-page request's admission
    backs up two nodes and makes host room for both in ONE round (not one a node); what it
    gives up and keeps is what two rounds gave up and kept."""
    from hicache_jax.cache.write_policy import CleanAhead

    rounds = []
    evict_host = CleanAhead.evict_host
    monkeypatch.setattr(
        CleanAhead, "evict_host", lambda self, n: rounds.append(n) or evict_host(self, n)
    )
    cache, kv = gated_cache("clean_ahead", device=8, host=8)
    a = [np.arange(2) + 100 * i for i in range(4)]
    b = [np.arange(2) + 1000 + 100 * i for i in range(4)]
    for tokens in a + b:  # the b's evict the a's to L2 (full: 8 pages), L1 holds the b's
        serve_kv(cache, kv, tokens)
        cache.flush()
    assert cache.stats()["host_free_pages"] == 0 and rounds == []
    serve_kv(cache, kv, np.arange(4) + 5000)
    cache.flush()
    st = cache.stats()
    assert rounds == [4]  # one round for b[0] and b[1]'s 4 pages
    assert st["admission_clean_pages"] == 12 and st["eviction_backup_pages"] == 0
    assert st["host_evicted_tokens"] == 4  # a[0], a[1] gave up their host pages
    assert [cache.match_prefix(t).host_len for t in a] == [0, 0, 2, 2]
    assert [cache.match_prefix(t).host_len for t in b] == [2, 2, 0, 0]
    check_cache(cache, kv)


def test_an_admission_pass_backs_up_ahead_where_host_room_is_spare(monkeypatch):
    """L1 of four 2-page prompts, L2 empty: a 2-page request's admission backs up the prompt
    it evicts and, in the same transfer, the next two in eviction order (up to LOOK_AHEAD x
    its pages, at most L1/2); the next request then evicts one of them with no copy of its
    own (its transfer carries only the next node ahead)."""
    cache, kv = gated_cache("clean_ahead", device=8, host=16)
    a = [np.arange(2) + 100 * i for i in range(4)]
    for tokens in a:
        serve_kv(cache, kv, tokens)
        cache.flush()
    eng, calls = cache.transfer_engine, []
    backup = eng.backup
    monkeypatch.setattr(eng, "backup", lambda *x, **k: calls.append(1) or backup(*x, **k))
    serve_kv(cache, kv, np.arange(2) + 5000)
    cache.flush()
    st = cache.stats()
    assert calls == [1] and st["backups"] == 3 and st["admission_clean_pages"] == 6
    t = node_tiers(cache)  # (on device, on host) by prompt
    assert [t[i] for i in range(4)] == [(False, True), (True, True), (True, True), (True, False)]
    serve_kv(cache, kv, np.arange(2) + 6000)  # evicts a[1], clean already; a[3] ahead
    cache.flush()
    st = cache.stats()
    assert calls == [1, 1] and st["backups"] == 4 and st["eviction_backup_pages"] == 0
    assert st["admission_clean_pages"] == 8
    t = node_tiers(cache)
    assert [t[i] for i in range(4)] == [(False, True), (False, True), (True, True), (True, True)]
    check_cache(cache, kv)
