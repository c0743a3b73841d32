"""attach_storage / detach_storage on a live cache with requests in flight: L1 and L2 untouched,
L3 work in flight finished and counted, no page lost, bad input typed and without change."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import l3_helpers as L
from helpers import snapshot
from hicache_jax.errors import HiCacheError
from hicache_jax.l3.storage import StorageUnavailableError
from hicache_jax.l3.tier import L3Tier, NullL3Tier

PS = L.PS


def test_attach_then_detach_with_a_request_in_flight(tmp_path):
    url = f"file://{tmp_path}"
    cache = L.make(None)
    a, kv_a = L.tokens_kv(1, 3)
    L.compute(cache, a, kv_a)
    b, kv_b = L.tokens_kv(2, 2)
    req = cache.begin(b)  # a request in flight across both calls
    new = req.extend(b.size)
    cache.write_kv(new, kv_b)
    tree_before, owners_before = cache.tree.snapshot(), cache.page_owners().tobytes()
    cache.attach_storage(url)
    assert isinstance(cache.l3, L3Tier) and cache.cfg.storage == url
    assert (cache.tree.snapshot(), cache.page_owners().tobytes()) == (tree_before, owners_before)
    cache.check_invariants()
    req.finish(b)  # backed up and put through the new store (write_through)
    with cache.begin(b) as again:
        again.finish(b)
    assert cache.stats()["l3_put_pages"] > 0
    finished = cache.detach_storage()
    st = cache.stats()
    assert st["storage_attaches"] == 1 and st["storage_detaches"] == 1
    assert st["storage_detach_finished_ops"] == finished
    assert isinstance(cache.l3, NullL3Tier) and cache.cfg.storage is None
    cache.check_invariants()
    _host, dev, got = L.read_prefix(cache, b)  # L1 / L2 still serve it, bytes intact
    assert dev == b.size
    np.testing.assert_array_equal(got, L.bits32(kv_b))
    # what the store received serves another cache
    other = L.make(url)
    assert other.lookup(b, l3=True)["l3"] == b.size
    other.close()
    cache.close()


def test_detach_finishes_a_prefetch_in_flight_and_keeps_its_pages(tmp_path):
    url = f"file://{tmp_path}"
    writer = L.make(url)
    toks, kv = L.tokens_kv(3, 4)
    L.compute(writer, toks, kv)
    writer.close()
    cache = L.make(None)
    cache.attach_storage(url)
    backend, inner, gate = cache.l3.backend, cache.l3.backend._get, threading.Event()

    def held_get(keys, ids):  # the read stays in flight until the gate opens
        gate.wait(10)
        return inner(keys, ids)

    backend._get = held_get
    handle = cache.prefetch(toks)
    assert handle is not None and not handle.done()
    threading.Timer(0.3, gate.set).start()  # opens while detach waits for it
    assert cache.detach_storage() == 1
    assert cache.lookup(toks)["host"] == toks.size  # landed and attached before the close
    cache.check_invariants()
    _host, _dev, got = L.read_prefix(cache, toks)
    np.testing.assert_array_equal(got, L.bits32(kv))
    cache.close()


def test_bad_attach_and_detach_are_typed_and_change_nothing(tmp_path):
    cache = L.make(None)
    toks, kv = L.tokens_kv(4, 2)
    L.compute(cache, toks, kv)
    before = snapshot(cache)
    for url, exc in (
        (3, TypeError),
        ("ftp://x", ValueError),
        ("mooncake://127.0.0.1:1?connect_timeout_s=0.2", (StorageUnavailableError, ValueError)),
    ):
        with pytest.raises(exc):
            cache.attach_storage(url)
        assert snapshot(cache) == before and cache.cfg.storage is None
    with pytest.raises(HiCacheError, match="no storage"):
        cache.detach_storage()
    cache.attach_storage(f"file://{tmp_path}")
    with pytest.raises(HiCacheError, match="detach_storage"):
        cache.attach_storage(f"file://{tmp_path}")
    cache.check_invariants()
    cache.close()


def test_write_back_puts_host_copies_cached_before_the_attach(tmp_path):
    url = f"file://{tmp_path}"
    cache = L.make(None, storage_write_policy="write_back", write_policy="write_through")
    toks, kv = L.tokens_kv(5, 3)
    L.compute(cache, toks, kv)  # backed up to host before any store exists
    assert cache.stats()["host_cached_tokens"] == toks.size
    cache.attach_storage(url)
    cache.evict(10**6)
    assert cache.evict_host(10**6) == toks.size  # L2 evicts: write_back puts them first
    cache.flush()
    assert cache.stats()["l3_unkeyable_pages"] == 0
    other = L.make(url)
    assert other.lookup(toks, l3=True)["l3"] == toks.size
    other.close()
    cache.check_invariants()
    cache.close()


def test_events_attach_announces_puts_only_detach_removes_what_was_announced(tmp_path):
    """With ``l3_medium`` set (the cache built without storage): nothing is announced at the
    attach; puts landing after it are, parents first; detach announces every one removed."""
    from hicache_jax import BlockRemoved, BlockStored, Medium
    from hicache_jax.events.records import replay

    url = f"file://{tmp_path}"
    pre = L.make(url)  # the store already holds a prompt: unknown to the new cache, unannounced
    old, kv_old = L.tokens_kv(6, 2)
    L.compute(pre, old, kv_old)
    pre.close()
    cache = L.make(None, kv_events={"publisher": "queue", "l3_medium": "auto"})
    cache.attach_storage(url)
    assert [e for e in cache.take_events() if getattr(e, "medium", None) is Medium.L3] == []
    toks, kv = L.tokens_kv(7, 3)
    L.compute(cache, toks, kv)
    cache.flush()
    events = cache.take_events()
    stored = [e.block_hash for e in events if isinstance(e, BlockStored) and e.medium is Medium.L3]
    assert len(stored) == 3 and cache.lookup(old, l3=True)["l3"] == old.size
    cache.detach_storage()
    gone = cache.take_events()
    assert all(isinstance(e, BlockRemoved) and e.medium is Medium.L3 for e in gone)
    assert [e.block_hash for e in gone] == stored[::-1]  # leaves first
    assert not any(m is Medium.L3 for _, m in replay(events + gone))
    cache.attach_storage(url)  # again: nothing at the attach, announced anew as puts land
    assert cache.take_events() == []
    cache.close()


def test_zmq_l3_medium_follows_the_store_attached(tmp_path, monkeypatch):
    """``l3_medium="auto"``: a file:// store is announced as DISK, a store attached after it
    (here the example memory backend, not a file) as EXTERNAL; no batch is misnamed."""
    import pathlib

    pytest.importorskip("msgpack")
    pytest.importorskip("zmq")
    from helpers import replay_all

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "examples"))
    ep, rep = (f"inproc://attach-media-{id(tmp_path)}-{i}" for i in range(2))
    cache = L.make(
        None,
        kv_events={
            "publisher": "zmq",
            "endpoint": ep,
            "replay_endpoint": rep,
            "l3_medium": "auto",
            "encoding": "map",
        },
    )
    try:
        for url in (f"file://{tmp_path}", "python://memory_storage:MemoryStorage"):
            cache.attach_storage(url)
            toks, kv = L.tokens_kv(len(url), 2)
            L.compute(cache, toks, kv)
            cache.flush()
            cache.detach_storage()
        assert cache._events.wait_published(10)
        media = [
            (e["type"], e["medium"])
            for _, (ts, events, rank) in replay_all(rep)
            for e in events
            if e.get("medium") not in (None, "GPU", "CPU")
        ]
        assert media == [("BlockStored", "DISK")] * 2 + [("BlockRemoved", "DISK")] + [
            ("BlockStored", "EXTERNAL")
        ] * 2 + [("BlockRemoved", "EXTERNAL")]
    finally:
        cache.close()
