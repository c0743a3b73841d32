"""KV events: one BlockStored / BlockRemoved per page and tier, hashes chained from the parent,
AllBlocksCleared on reset, and a replay that matches the cache's contents."""

from __future__ import annotations

import numpy as np
import pytest

from hicache_jax import (AllBlocksCleared, BlockRemoved, BlockStored, HiCache, HiCacheConfig,
                         KVSpec, Medium)
from hicache_jax.events import EventLog, replay
from hicache_jax.radix import chain_hashes, namespace_hash


def make(policy="write_back", ps=4, device=16, host=32):
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16", page_size=ps)
    return HiCache(spec, HiCacheConfig(device_pages=device, host_pages=host,
                                       write_policy=policy, load_back_threshold=ps))


def put(cache, tokens, extra_key=None):
    tokens = np.asarray(tokens)
    m = cache.match_prefix(tokens, extra_key)
    new = cache.alloc_pages(tokens.size // cache.spec.page_size - m.device_pages.size)
    cache.insert(tokens, np.concatenate([m.device_pages, new]), extra_key)


def test_block_stored_per_page_with_chained_hashes():
    cache = make(ps=4)
    t = np.arange(12)
    put(cache, t)
    ev = cache.take_events()
    assert [type(e) for e in ev] == [BlockStored] * 3
    want = chain_hashes(namespace_hash(None), t.reshape(3, 4)).tolist()
    assert [e.block_hash for e in ev] == want
    assert [e.parent_block_hash for e in ev] == [None] + want[:2]
    assert [e.token_ids for e in ev] == [tuple(range(0, 4)), tuple(range(4, 8)),
                                         tuple(range(8, 12))]
    assert all(e.medium is Medium.DEVICE and e.medium == "device" for e in ev)
    assert cache.take_events() == []           # taken


def test_child_chains_from_parent_and_split_changes_no_hash():
    cache = make(ps=4)
    put(cache, np.arange(8))
    first = cache.take_events()
    cache.match_prefix(np.arange(4))           # splits the node: no event
    assert cache.take_events() == []
    put(cache, np.concatenate([np.arange(8), [50, 51, 52, 53]]))
    (child,) = cache.take_events()
    assert child.parent_block_hash == first[-1].block_hash


def test_extra_key_namespaces_hashes():
    cache = make(ps=4)
    put(cache, np.arange(4))
    put(cache, np.arange(4), extra_key="lora-1")
    a, b = cache.take_events()
    assert a.block_hash != b.block_hash and b.extra_key == "lora-1"


def test_events_follow_evict_backup_load_back_and_evict_host():
    cache = make("write_back", ps=4)
    t = np.arange(8)
    put(cache, t)
    router = replay(cache.take_events())
    cache.evict(8)                             # write_back: backup (host stored), device removed
    ev = cache.take_events()
    kinds = [(type(e).__name__, e.medium.value) for e in ev]
    assert kinds.count(("BlockStored", "host")) == 2
    assert kinds.count(("BlockRemoved", "device")) == 2
    router = replay(ev, router)
    assert {m for _, m in router} == {Medium.HOST}
    cache.load_back(cache.match_prefix(t))
    router = replay(cache.take_events(), router)
    assert len(router) == 4                    # each page on both tiers
    cache.flush()
    cache.evict(8)
    cache.evict_host(8)
    router = replay(cache.take_events(), router)
    assert router == set()


def test_reset_emits_all_blocks_cleared():
    cache = make()
    put(cache, np.arange(8))
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]


def test_replay_rejects_inconsistent_streams():
    stored = BlockStored(1, None, (1, 2), Medium.DEVICE)
    with pytest.raises(ValueError, match="stored twice"):
        replay([stored, stored])
    with pytest.raises(ValueError, match="while not stored"):
        replay([BlockRemoved(1, Medium.HOST)])
    assert replay([stored, AllBlocksCleared()]) == set()


def test_event_log_slices_pages():
    class Node:  # duck-typed TreeNode: what EventLog reads
        page_hashes = np.array([11, 12, 13], np.uint64)
        key = np.arange(6)
        num_pages, num_tokens, extra_key, parent = 3, 6, None, None

    log = EventLog()
    log.stored(Node, Medium.HOST, slice(1, 3))
    ev = log.take()
    assert [(e.block_hash, e.parent_block_hash, e.token_ids) for e in ev] == [
        (12, 11, (2, 3)), (13, 12, (4, 5))]
