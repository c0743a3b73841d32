"""KV events per layer group (hicache_jax/events/groups.py): with window groups every event
names its group, each window group's pages the tree holds are announced per tier (at insert,
backup, load, eviction, and where an insert trims them or fills a hole), ``kv_events``
``groups="full"`` announces the full-attention pages only, and replaying the events gives what
the cache holds per (hash, medium, group). The random workloads with window groups are the
state machine's (tests/test_hicache_state_machine.py, ``test_hicache_state_machine_windows``)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from helpers import make_cache, serve, tree_pages
from hicache_jax import HiCacheConfig, KVSpec, LayerGroup, Medium
from hicache_jax.events import BlockRemoved, BlockStored, replay
from hicache_jax.events.recorder import QueueRecorder
from hicache_jax.events.records import GroupTag, group_tags

PS = 4
W = 8  # a continuation at n tokens reads the window pages of [n - 8, n): two pages


def _spec(window: int | None = W, chunk: int | None = None) -> KVSpec:
    # "3:1": layers 0-2 local, 3 full: the window group is groups[0], the full one groups[1]
    return KVSpec.from_pattern(
        "3:1",
        num_layers=4,
        num_kv_heads=2,
        head_dim=4,
        page_size=PS,
        window=window,
        chunk=chunk,
    )


def _cache(spec: KVSpec | None = None, groups: str | None = None, **cfg):
    kv: dict = {"publisher": "queue"}
    if groups is not None:
        kv["groups"] = groups
    cfg.setdefault("write_policy", "write_back")
    return make_cache(spec or _spec(), 32, 64, kv_events=kv, **cfg)


def _hashes(cache, tokens) -> list[int]:
    """Page hashes of the cached prefix ``tokens``, root first."""
    m = cache.tree.match(np.asarray(tokens))
    out: list[int] = []
    node = m.node
    while node.parent is not None:
        out = node.page_hashes.tolist() + out
        node = node.parent
    return out


def _by_group(events, kind=BlockStored, medium=Medium.DEVICE) -> dict:
    out: dict = {}
    for e in events:
        if isinstance(e, kind) and e.medium is medium:
            out.setdefault(e.group_idx, []).append(e)
    return out


def test_group_tags_name_each_group_as_vllm_does():
    assert group_tags(_spec()) == [
        GroupTag(0, "sliding_window", W),
        GroupTag(1, "full_attention", None),
    ]
    assert group_tags(_spec(window=None, chunk=8)) == [
        GroupTag(0, "chunked_local_attention", None),  # vLLM sends no chunk size
        GroupTag(1, "full_attention", None),
    ]
    mla = KVSpec.from_groups(
        [
            LayerGroup("full", (0,), num_kv_heads=1, head_dim=8, mla=True),
            LayerGroup("window", (1,), num_kv_heads=2, head_dim=4, window=16),
        ],
        page_size=PS,
    )
    assert group_tags(mla) == [
        GroupTag(0, "mla_attention", None),
        GroupTag(1, "sliding_window", 16),
    ]


def test_an_insert_announces_every_full_page_and_the_window_pages_kept():
    cache = _cache(window_spare=False)  # pages no node end reads freed at insert
    tokens = np.arange(24)  # six pages: a continuation at 24 reads the window pages 4 and 5
    serve(cache, tokens)
    events = cache.take_events()
    h = _hashes(cache, tokens)
    stored = _by_group(events)
    assert set(stored) == {0, 1}
    full = stored[1]
    assert [e.block_hash for e in full] == h
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in full} == {
        ("full_attention", None)
    }
    win = stored[0]
    assert [e.block_hash for e in win] == h[4:]  # the same hashes as the full pages there
    assert win[0].parent_block_hash == h[3]  # the prefix's page before, which it does not hold
    assert win[0].token_ids == tuple(range(16, 20))
    assert {(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in win} == {
        ("sliding_window", W)
    }
    assert replay(events) == tree_pages(cache)
    assert {k for k in tree_pages(cache) if k[2] == 0} == {(x, Medium.DEVICE, 0) for x in h[4:]}
    cache.close()


def test_backup_load_and_eviction_announce_the_window_pages_on_each_tier():
    cache = _cache(window_spare=False)
    tokens = np.arange(24)
    serve(cache, tokens)
    router = replay(cache.take_events())
    h = _hashes(cache, tokens)
    cache.evict(24)  # write_back: backed up to host (window pages too), then off device
    events = cache.take_events()
    host = _by_group(events, BlockStored, Medium.HOST)
    assert [e.block_hash for e in host[0]] == h[4:] and [e.block_hash for e in host[1]] == h
    gone = _by_group(events, BlockRemoved, Medium.DEVICE)
    assert sorted(e.block_hash for e in gone[0]) == sorted(h[4:])
    assert sorted(e.block_hash for e in gone[1]) == sorted(h)
    router = replay(events, router)
    assert router == tree_pages(cache)
    assert {k for k in router if k[1] is Medium.DEVICE} == set()
    serve(cache, tokens)  # a host hit: loaded back with its window pages
    events = cache.take_events()
    back = _by_group(events, BlockStored, Medium.DEVICE)
    assert [e.block_hash for e in back[0]] == h[4:]
    router = replay(events, router)
    assert router == tree_pages(cache)
    cache.evict_host(24)
    cache.evict(24)
    cache.evict_host(24)
    router = replay(cache.take_events(), router)
    assert router == tree_pages(cache) == set()
    cache.close()


def test_an_insert_that_splits_a_node_fills_its_holes_and_announces_them():
    cache = _cache(window_spare=False)
    a = np.arange(24)
    serve(cache, a)
    router = replay(cache.take_events())
    h = _hashes(cache, a)
    # the same first three pages, then others: the tree's node splits after page 2, whose end
    # reads the window pages 1 and 2 (trimmed at the first insert): this request's fill them
    b = np.concatenate([a[:12], 100 + np.arange(12)])
    serve(cache, b)
    events = cache.take_events()
    win = _by_group(events)[0]
    assert {e.block_hash for e in win} >= set(h[1:3])
    router = replay(events, router)
    assert router == tree_pages(cache)
    assert {(x, Medium.DEVICE, 0) for x in h[1:3]} <= router
    cache.close()


def test_spare_window_pages_are_announced_until_reclaimed():
    """``window_spare`` (the default): pages no node end reads stay attached while the pool has
    room (a later split there finds them): announced; freed to make room: removed."""
    cache = _cache(window_device_pages=8)
    a = np.arange(24)
    serve(cache, a)
    events = cache.take_events()
    h = _hashes(cache, a)
    assert [e.block_hash for e in _by_group(events)[0]] == h  # all six, two kept, four spare
    router = replay(events)
    assert router == tree_pages(cache)
    serve(cache, 100 + np.arange(16))  # four more window pages: two spare ones reclaimed
    events = cache.take_events()
    assert cache.stats()["window_spare_reclaimed"] > 0
    gone = {e.block_hash for e in _by_group(events, BlockRemoved)[0]}
    assert gone and gone <= set(h[:4])  # spare ones only, the oldest first
    router = replay(events, router)
    assert router == tree_pages(cache)
    cache.close()


def test_groups_full_announces_only_the_full_attention_pages_with_their_group():
    cache = _cache(groups="full")
    tokens = np.arange(24)
    serve(cache, tokens)
    cache.evict(24)
    serve(cache, tokens)
    events = cache.take_events()
    assert events and {e.group_idx for e in events} == {1}
    assert {e.kv_cache_spec_kind for e in events if isinstance(e, BlockStored)} == {
        "full_attention"
    }
    assert replay(events) == tree_pages(cache, windows=False)
    cache.close()


def test_chunked_groups_are_announced_without_a_window():
    cache = _cache(_spec(window=None, chunk=8), window_spare=False)
    serve(cache, np.arange(20))  # a continuation at 20 reads the chunk [16, 20): page 4
    events = cache.take_events()
    win = _by_group(events)[0]
    assert [(e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in win] == [
        ("chunked_local_attention", None)
    ]
    assert replay(events) == tree_pages(cache)
    cache.close()


def test_without_window_groups_events_name_no_group():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=PS)
    cache = make_cache(spec, 16, 32, kv_events={"publisher": "queue", "groups": "full"})
    serve(cache, np.arange(12))
    cache.evict(12)
    events = cache.take_events()
    assert events and all(e.group_idx is None for e in events)
    assert all(e.kv_cache_spec_kind is None for e in events if isinstance(e, BlockStored))
    assert replay(events) == tree_pages(cache)
    cache.close()


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "eager"])
@pytest.mark.parametrize("block_hash", ["tree", "vllm:sha256"])
def test_random_workload_replays_to_what_the_cache_holds_per_group(block_hash, spare):
    rng = np.random.default_rng(3)
    kv = {"publisher": "queue", "block_hash": block_hash, "hash_seed": "0"}
    cache = make_cache(
        _spec(),
        12,
        16,
        kv_events=kv,
        write_policy="write_back",
        window_spare=spare,
        window_device_pages=8,  # smaller window pools: spare pages reclaimed for room
        window_host_pages=10,
    )
    router: set = set()
    for _ in range(150):
        op = rng.integers(8)
        if op < 5:
            prefix = rng.integers(3, size=rng.integers(1, 5)).repeat(PS)
            serve(cache, np.concatenate([prefix, rng.integers(50, size=PS * rng.integers(4))]))
        elif op == 5:
            cache.evict(int(rng.integers(1, 6)) * PS)
        elif op == 6:
            cache.evict_host(int(rng.integers(1, 6)) * PS)
        else:
            cache.flush()
        events = cache.take_events()
        router = replay(events, router)
        if block_hash == "tree":
            assert router == tree_pages(cache)
        else:  # vLLM ids: as many of each group and tier as the cache holds
            want = tree_pages(cache)
            assert sorted((m, g) for _, m, g in router) == sorted((m, g) for _, m, g in want)
    assert any(k[2] == 0 for k in router)
    assert cache.stats()["window_spare_reclaimed"] > 0 or not spare
    cache.flush()
    for _ in range(3):  # everything out: every announcement removed, no vLLM id left counted
        cache.evict(1 << 20)
        cache.evict_host(1 << 20)
    router = replay(cache.take_events(), router)
    assert router == tree_pages(cache) == set()
    ids = cache._events._ids
    assert ids is None or not ids._known
    cache.close()


def test_a_bad_groups_value_names_the_field():
    with pytest.raises(ValueError, match="kv_events groups='none' is not one of: 'all', 'full'"):
        HiCacheConfig(device_pages=4, kv_events={"publisher": "queue", "groups": "none"})


def test_pages_fetched_from_l3_are_announced_with_their_window_pages(tmp_path):
    """A fresh cache on a store another wrote: an L3 fetch fills host nodes (announced), then
    attaches the window pages their ends read (announced on the host tier too). L3 itself is
    announced for the full-attention pages, tagged with their group."""
    url = f"file://{tmp_path}/l3"
    tokens = np.arange(24)
    writer = _cache(
        window_spare=False,
        write_policy="write_through",
        storage=url,
        storage_write_policy="write_through",
    )
    serve(writer, tokens)
    writer.flush()
    writer.close()
    kv = {"publisher": "queue", "l3_medium": "auto"}
    cache = make_cache(_spec(), 32, 64, kv_events=kv, storage=url, window_spare=False)
    cache.prefetch(tokens)
    cache.flush()
    events = cache.take_events()
    h = _hashes(cache, tokens)
    host = _by_group(events, BlockStored, Medium.HOST)
    assert [e.block_hash for e in host[1]] == h and [e.block_hash for e in host[0]] == h[4:]
    assert replay([e for e in events if e.medium is not Medium.L3]) == tree_pages(cache)
    cache.close()


def test_l3_pages_are_the_full_attention_pages_named_as_such():
    """L3 is announced for the full-attention pages, tagged with the full group (the
    recorder alone)."""
    rec = QueueRecorder(10, l3=True)
    nowhere = SimpleNamespace(attach=np.full((1, 4), -1, np.int32))
    rec.watch_groups(_spec(), nowhere, nowhere)
    node = SimpleNamespace(
        num_pages=2,
        num_tokens=2 * PS,
        page_hashes=np.array([5, 6], np.uint64),
        key=np.arange(2 * PS),
        extra_key=None,
        hash_parent=None,
        value=None,
        host_value=None,
    )
    rec.l3_stored(rec.l3_candidate(node), np.ones(2, bool))
    rec.l3_detached()
    events = rec.take()
    assert [(type(e).__name__, e.block_hash, e.medium, e.group_idx) for e in events] == [
        ("BlockStored", 5, Medium.L3, 1),
        ("BlockStored", 6, Medium.L3, 1),
        ("BlockRemoved", 6, Medium.L3, 1),  # leaves first
        ("BlockRemoved", 5, Medium.L3, 1),
    ]
    assert {e.kv_cache_spec_kind for e in events if isinstance(e, BlockStored)} == {
        "full_attention"
    }
