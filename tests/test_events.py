"""KV events: one BlockStored / BlockRemoved per page and tier, hashes chained from the parent,
AllBlocksCleared on reset, and a replay that matches the cache's contents; off by default,
bounded when on, and a clear error for a bad kv_events configuration."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache
from helpers import serve as put  # one request through the handle (no KV bytes)
from hicache_jax import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HiCacheConfig,
    HiCacheError,
    Medium,
)
from hicache_jax.events.recorder import NullRecorder, QueueRecorder
from hicache_jax.events.records import RECORD_OVERHEAD, held_bytes, record_bytes, replay
from hicache_jax.spec import KVEventsConfig
from hicache_jax.tree.hashing import chain_hashes, namespace_hash

QUEUE = {"publisher": "queue"}


def make(policy="write_back", ps=4, device=16, host=32, kv_events=QUEUE):
    return make_cache(bookkeeping_spec(ps), device, host, write_policy=policy, kv_events=kv_events)


def test_block_stored_per_page_with_chained_hashes():
    cache = make(ps=4)
    t = np.arange(12)
    put(cache, t)
    ev = cache.take_events()
    assert [type(e) for e in ev] == [BlockStored] * 3
    want = chain_hashes(namespace_hash(None), t.reshape(3, 4)).tolist()
    assert [e.block_hash for e in ev] == want
    assert [e.parent_block_hash for e in ev] == [None] + want[:2]
    assert [e.token_ids for e in ev] == [tuple(range(4)), tuple(range(4, 8)), tuple(range(8, 12))]
    assert all(e.medium is Medium.DEVICE and e.medium == "device" for e in ev)
    assert cache.take_events() == []  # taken


def test_child_chains_from_parent_and_split_changes_no_hash():
    cache = make(ps=4)
    put(cache, np.arange(8))
    first = cache.take_events()
    cache.match_prefix(np.arange(4))  # splits the node: no event
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
    cache.evict(8)  # write_back: backup (host stored), device removed
    ev = cache.take_events()
    kinds = [(type(e).__name__, e.medium.value) for e in ev]
    assert kinds.count(("BlockStored", "host")) == 2
    assert kinds.count(("BlockRemoved", "device")) == 2
    router = replay(ev, router)
    assert {m for _, m in router} == {Medium.HOST}
    cache.load_back(cache.match_prefix(t))
    router = replay(cache.take_events(), router)
    assert len(router) == 4  # each page on both tiers
    cache.flush()
    cache.evict(8)
    cache.evict_host(8)
    router = replay(cache.take_events(), router)
    assert router == set()


def test_reset_emits_all_blocks_cleared():
    cache = make()
    put(cache, np.arange(8))
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    put(cache, np.arange(8))
    cache.reset()  # the put's batch stays; the reset supersedes it
    ev = cache.take_events()
    assert ev[-1] == AllBlocksCleared() and replay(ev) == set()


def test_replay_rejects_inconsistent_streams():
    stored = BlockStored(1, None, (1, 2), Medium.DEVICE)
    with pytest.raises(ValueError, match="stored twice"):
        replay([stored, stored])
    with pytest.raises(ValueError, match="while not stored"):
        replay([BlockRemoved(1, Medium.HOST)])
    assert replay([stored, AllBlocksCleared()]) == set()


def test_recorder_slices_pages_and_holds_them_compactly():
    class Node:  # duck-typed TreeNode: what the recorder reads
        page_hashes = np.array([11, 12, 13], np.uint64)
        key = np.arange(6)
        num_pages, num_tokens, extra_key, parent = 3, 6, None, None

    log = QueueRecorder(buffer_steps=4)
    log.stored(Node, Medium.HOST, slice(1, 3))
    log.end_call()
    ((_, _, (record,)),) = log._buffer  # one record per node, numpy copies
    assert isinstance(record.tokens, np.ndarray) and isinstance(record.hashes, np.ndarray)
    ev = log.take()
    assert [(e.block_hash, e.parent_block_hash, e.token_ids) for e in ev] == [
        (12, 11, (2, 3)),
        (13, 12, (4, 5)),
    ]


def test_events_are_off_by_default_and_take_events_says_how_to_enable_them():
    cache = make(kv_events=None)
    assert HiCacheConfig(device_pages=4).kv_events is None
    assert isinstance(cache._events, NullRecorder)
    put(cache, np.arange(8))
    cache.evict(8)
    with pytest.raises(HiCacheError, match=r"not enabled.*kv_events=\{'publisher': 'queue'\}"):
        cache.take_events()
    with pytest.raises(HiCacheError, match="not enabled"):
        cache.take_event_batches()
    s = cache.stats()
    assert (s["kv_event_batches"], s["kv_event_batches_dropped"]) == (0, 0)


def test_one_batch_per_public_call_with_consecutive_seqs():
    cache = make()
    put(cache, np.arange(8))  # begin, extend, finish: only insert records
    cache.match_prefix(np.arange(8))  # nothing recorded: no batch
    cache.evict(8)  # write_back: backup + device removed
    batches = cache.take_event_batches()
    assert [b.seq for b in batches] == [0, 1]
    assert [len(b.events) for b in batches] == [2, 4]
    assert batches[0].ts <= batches[1].ts
    assert cache.take_event_batches() == []


def test_bounded_buffer_drops_the_oldest_batches_counts_them_and_shows_the_gap():
    cache = make(device=64, kv_events={"publisher": "queue", "buffer_steps": 3})
    for i in range(5):
        put(cache, np.arange(4) + 100 * i)  # one batch each (insert)
    batches = cache.take_event_batches()
    assert [b.seq for b in batches] == [2, 3, 4]  # 0 and 1 dropped: a visible gap
    assert [b.events[0].token_ids[0] for b in batches] == [200, 300, 400]
    s = cache.stats()
    assert (s["kv_event_batches"], s["kv_event_batches_dropped"]) == (5, 2)
    put(cache, np.arange(4) + 500)
    assert [b.seq for b in cache.take_event_batches()] == [5]


def test_buffer_bytes_drops_the_oldest_batches_counts_them_and_shows_the_gap():
    # One page of 4 int64 tokens and one uint64 hash per insert: 40 bytes + the overhead.
    per_batch = 4 * 8 + 8 + RECORD_OVERHEAD
    cache = make(device=64, kv_events={"publisher": "queue", "buffer_bytes": 3 * per_batch})
    for i in range(5):
        put(cache, np.arange(4) + 100 * i)
    batches = cache.take_event_batches()
    assert [b.seq for b in batches] == [2, 3, 4]  # 0 and 1 dropped: a visible gap
    assert [b.events[0].token_ids[0] for b in batches] == [200, 300, 400]
    s = cache.stats()
    assert (s["kv_event_batches"], s["kv_event_batches_dropped"]) == (5, 2)
    put(cache, np.arange(8) + 500)  # 2 pages: fits
    put(cache, np.arange(160) + 600)  # 40 pages: over the bound by itself: dropped
    assert [b.seq for b in cache.take_event_batches()] == [5]
    assert cache.stats()["kv_event_batches_dropped"] == 3
    put(cache, np.arange(4) + 700)  # taking emptied the buffer: nothing dropped
    assert [b.seq for b in cache.take_event_batches()] == [7]


def test_a_record_counts_the_whole_arrays_its_views_keep_alive():
    cache = make(device=64)
    put(cache, np.arange(16))
    cache.match_prefix(np.arange(4))  # split: the child's key is a view of 16 tokens
    cache.evict(12)  # write_back: the child's 3 pages to host
    (_, _, (_stored,)), (_, _, records) = cache._events._buffer
    host = next(r for r in records if r.medium is Medium.HOST)
    assert host.tokens.shape == (12,) and held_bytes(host.tokens) == 16 * host.tokens.itemsize
    assert record_bytes(host) == (
        16 * host.tokens.itemsize + held_bytes(host.hashes) + RECORD_OVERHEAD
    )
    assert held_bytes(np.arange(4)) == 32 and held_bytes(np.arange(8)[2:4]) == 64
    assert held_bytes(np.frombuffer(bytes(80), np.int64)[:2]) == 80


def test_kv_events_config_from_a_dict_or_its_json_string():
    a = HiCacheConfig(device_pages=4, kv_events={"publisher": "zmq", "endpoint": "ipc:///tmp/x"})
    b = HiCacheConfig(device_pages=4, kv_events='{"publisher": "zmq", "endpoint": "ipc:///tmp/x"}')
    assert a.kv_events == b.kv_events == KVEventsConfig("zmq", "ipc:///tmp/x")
    assert a.kv_events.buffer_steps == 10_000 and a.kv_events.topic == "kv-events"
    assert a.kv_events.buffer_bytes == 16 << 20
    assert HiCacheConfig(device_pages=4, kv_events=a.kv_events).kv_events == a.kv_events


@pytest.mark.parametrize(
    "kv_events, err, match",
    [
        ({"publisher": "kafka"}, ValueError, "publisher='kafka' is not one of"),
        (
            {"publisher": "zmq", "endpoint": "tcp://127.0.0.1"},
            ValueError,
            "endpoint=.* is not a ZMQ",
        ),
        ({"publisher": "zmq", "endpoint": "tcp://127.0.0.1:70000"}, ValueError, "endpoint="),
        ({"publisher": "zmq", "endpoint": "http://x:1"}, ValueError, "endpoint="),
        ({"publisher": "zmq", "replay_endpoint": "5558"}, ValueError, "replay_endpoint="),
        ({"publisher": "zmq", "replay_endpoint": "tcp://*:5557"}, ValueError, "must differ"),
        ({"publisher": "queue", "buffer_steps": 0}, ValueError, "buffer_steps=0"),
        ({"publisher": "queue", "buffer_steps": "10"}, ValueError, "buffer_steps='10'"),
        ({"publisher": "queue", "buffer_steps": True}, ValueError, "buffer_steps=True"),
        (
            {"publisher": "queue", "buffer_bytes": 0},
            ValueError,
            "buffer_bytes=0 must be an int >= 1",
        ),
        ({"publisher": "zmq", "buffer_bytes": 1.5e6}, ValueError, "buffer_bytes=1500000.0"),
        ({"publisher": "queue", "buffer_bytes": False}, ValueError, "buffer_bytes=False"),
        ({"publisher": "queue", "topics": "x"}, ValueError, r"unknown field\(s\) \['topics'\]"),
        ({"publisher": "zmq", "topic": 3}, TypeError, "topic=3"),
        ("{not json", ValueError, "not valid JSON"),
        (["queue"], TypeError, "must be None, a dict or its JSON string"),
    ],
)
def test_bad_kv_events_config_names_the_field(kv_events, err, match):
    with pytest.raises(err, match=match):
        HiCacheConfig(device_pages=4, kv_events=kv_events)
