"""examples/kv_router.py: its per-instance answers agree with each cache's own match_prefix, after
serving, evictions, evict_host and reset(); it routes a request to the instance with its prefix."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("msgspec")
pytest.importorskip("zmq")

from helpers import bookkeeping_spec, make_cache, serve
from hicache_jax import HiCache, HiCacheConfig, KVSpec

PS = 4
SPEC = bookkeeping_spec(PS)
EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "kv_router.py"


@pytest.fixture(scope="module")
def kv_router():
    spec = importlib.util.spec_from_file_location("kv_router", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_router"] = module  # msgspec resolves the structs' annotations through it
    spec.loader.exec_module(module)
    yield module
    del sys.modules["kv_router"]


@pytest.fixture
def two(tmp_path, kv_router):
    instances, caches = {}, {}
    for name, policy in (("a", "write_back"), ("b", "clean_ahead")):
        ep, rep = f"ipc://{tmp_path}/{name}", f"ipc://{tmp_path}/{name}-replay"
        instances[name] = (ep, rep)
        caches[name] = make_cache(
            SPEC,
            12,
            16,
            write_policy=policy,
            kv_events={"publisher": "zmq", "endpoint": ep, "replay_endpoint": rep},
        )
    router = kv_router.KVRouter(instances, page_size=PS)
    yield caches, router
    router.close()
    for cache in caches.values():
        cache.close()


def agree(caches, router, queries):
    """The router's per-instance answer of each query equals that cache's match_prefix."""
    for name, cache in caches.items():
        cache.flush()
        router.sync(name, cache.stats()["kv_event_batches"])
    for name, cache in caches.items():
        for q, key in queries:
            ans = router.lookup(name, q, key)
            m = cache.match_prefix(q, key)  # after the lookup: a match publishes nothing
            assert (ans.device_tokens, ans.host_tokens) == (m.device_len, m.host_len), (name, q)


def test_router_agrees_with_each_cache_through_evictions_and_reset(two):
    caches, router = two
    rng = np.random.default_rng(3)
    sys_a, sys_b = np.arange(16), np.arange(500, 516)
    queries = []
    for i in range(6):
        qa = np.concatenate([sys_a[: 4 * (1 + i % 4)], rng.integers(100, size=PS * (i % 3))])
        qb = np.concatenate([sys_b, rng.integers(100, size=PS * 2)])
        serve(caches["a"], qa)
        serve(caches["b"], qb, extra_key=7 if i % 2 else None)
        queries += [(qa, None), (qb, None), (qb, 7)]
    agree(caches, router, queries)
    assert router.route(np.concatenate([sys_a, [1, 2, 3, 4]])).instance == "a"
    assert router.route(sys_b).instance == "b"
    for cache in caches.values():
        cache.evict(6 * PS)
    agree(caches, router, queries)
    assert any(router.lookup(n, q, k).host_tokens for n in caches for q, k in queries)
    for cache in caches.values():
        cache.evict_host(5 * PS)
    agree(caches, router, queries)
    for q, key in queries[:6]:  # load back / recompute what is left
        serve(caches["a"], q, key)
    agree(caches, router, queries)
    caches["b"].reset()
    agree(caches, router, queries)
    assert router.route(sys_b).device_tokens == 0 or router.route(sys_b).instance == "a"
    assert router.index["b"].mediums == {}


def test_router_that_starts_late_recovers_through_replay(tmp_path, kv_router):
    ep, rep = f"ipc://{tmp_path}/x", f"ipc://{tmp_path}/x-replay"
    cache = HiCache(
        SPEC,
        HiCacheConfig(
            device_pages=12,
            host_pages=16,
            kv_events={"publisher": "zmq", "endpoint": ep, "replay_endpoint": rep},
        ),
    )
    try:
        for i in range(4):
            serve(cache, np.arange(8) + 100 * i)  # nobody subscribed yet
        router = kv_router.KVRouter({"x": (ep, rep)}, page_size=PS)
        try:
            agree({"x": cache}, router, [(np.arange(8) + 100 * i, None) for i in range(4)])
            assert router.route(np.arange(300, 312)).device_tokens == 8
        finally:
            router.close()
    finally:
        cache.close()


def test_index_keeps_namespaces_the_wire_cannot_tell_apart(kv_router):
    """extra_keys other than None / int / str arrive as lora_id = lora_name = None: two such
    namespaces share a first-page key. Removing one namespace's page kept the other's
    unreachable (the key held one hash, popped by either removal)."""
    r = kv_router
    idx = r.InstanceIndex()
    stored = lambda h: r.BlockStored([h], None, [1, 2], 2, None, "GPU", None)  # noqa: E731
    idx.apply(r.KVEventBatch(0.0, [stored(11), stored(22)]))
    assert idx.longest_prefix([1, 2], 2) == (2, 0)
    idx.apply(r.KVEventBatch(0.0, [r.BlockRemoved([11], "GPU")]))
    assert idx.longest_prefix([1, 2], 2) == (2, 0)  # 22 still holds it
    idx.apply(r.KVEventBatch(0.0, [r.BlockRemoved([22], "GPU"), r.BlockRemoved([33], "GPU")]))
    assert idx.longest_prefix([1, 2], 2) == (0, 0)  # and an unknown removal is ignored
    assert idx.longest_prefix([1, 2], 2, extra_key=np.int64(5)) == (0, 0)
    with pytest.raises(TypeError, match="only None, int and str"):
        idx.longest_prefix([1, 2], 2, extra_key=b"tenant")


def test_dynamo_block_key_matches_dynamos_known_answers(kv_router):
    # Dynamo's published answers: block size 4, seed 1337.
    assert kv_router.dynamo_block_key([1, 2, 3, 4]) == 14643705804678351452
    assert kv_router.dynamo_block_key([5, 6, 7, 8]) == 16777012769546811212


def test_dynamo_keyed_index_agrees_with_token_keyed_and_drops_other_block_sizes(kv_router):
    stored = kv_router.BlockStored([11, 12], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", None)
    other = kv_router.BlockStored([21], None, [9, 9, 9, 9, 9, 9, 9, 9], 8, None, "GPU", None)
    batch = kv_router.KVEventBatch(0.0, [stored, other])
    by_tokens, by_dynamo = kv_router.InstanceIndex(), kv_router.InstanceIndex("dynamo", 4)
    by_tokens.apply(batch)
    by_dynamo.apply(batch)
    for q in ([1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0], [5, 6, 7, 8]):
        assert by_dynamo.longest_prefix(q, 4) == by_tokens.longest_prefix(q, 4)
    assert by_dynamo.longest_prefix([1, 2, 3, 4, 5, 6, 7, 8], 4) == (8, 0)
    assert by_dynamo.dropped == 1 and 21 not in by_dynamo.mediums
    with pytest.raises(ValueError, match="block_size"):
        kv_router.InstanceIndex("dynamo")
    with pytest.raises(ValueError, match="keying"):
        kv_router.InstanceIndex("xx", 4)


def test_router_keeps_the_full_attention_pages_of_a_model_with_window_groups(tmp_path, kv_router):
    """With window groups each group's pages are announced apart: the index keeps the
    full-attention pages, the same whether the window groups' are announced or not."""
    spec = KVSpec.from_pattern(
        "3:1", num_layers=4, num_kv_heads=2, head_dim=4, page_size=PS, window=2 * PS
    )
    instances, caches = {}, {}
    for groups in ("all", "full"):
        ep = f"ipc://{tmp_path}/{groups}"
        instances[groups] = (ep, f"{ep}-replay")
        caches[groups] = make_cache(
            spec,
            12,
            16,
            write_policy="write_back",
            kv_events={
                "publisher": "zmq",
                "endpoint": ep,
                "replay_endpoint": f"{ep}-replay",
                "groups": groups,
            },
        )
    router = kv_router.KVRouter(instances, page_size=PS)
    try:
        rng = np.random.default_rng(1)
        for i in range(20):
            q = np.concatenate([np.arange(4 * (1 + i % 4)), rng.integers(100, size=PS * (i % 3))])
            for cache in caches.values():
                serve(cache, q)
                if i % 5 == 4:
                    cache.evict(3 * PS)
        for name, cache in caches.items():
            cache.flush()
            router.sync(name, cache.stats()["kv_event_batches"])
        held = {}
        for name, cache in caches.items():
            want = {h for node in cache.tree.nodes() for h in node.page_hashes.tolist()}
            assert set(router.index[name].mediums) == want
            held[name] = router.index[name].mediums
        assert held["all"] == held["full"] and held["all"]
    finally:
        router.close()
        for cache in caches.values():
            cache.close()
    # a window group's page leaving (trimmed, dropped) leaves the full-attention page held
    r, idx = kv_router, kv_router.InstanceIndex()
    stored = lambda g, kind: r.BlockStored(  # noqa: E731
        [11], None, [1, 2], 2, None, "GPU", None, None, g, kind
    )
    idx.apply(r.KVEventBatch(0.0, [stored(1, "full_attention"), stored(0, "sliding_window")]))
    idx.apply(r.KVEventBatch(0.0, [r.BlockRemoved([11], "GPU", 0)]))
    assert idx.longest_prefix([1, 2], 2) == (2, 0)
    idx.apply(r.KVEventBatch(0.0, [r.BlockRemoved([11], "GPU", 1)]))
    assert idx.longest_prefix([1, 2], 2) == (0, 0)
