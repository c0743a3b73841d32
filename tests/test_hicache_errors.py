"""HiCache's bad input: every public method raises a typed error (ValueError / TypeError naming
the argument, HiCacheError for misuse of state) and leaves the cache, and its events, unchanged;
the constructor checks its arguments."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import POLICIES, check_cache, gated_cache, node_of, serve_kv, snapshot, tree_pages
from hicache_jax import HiCache, HiCacheConfig, HiCacheError, KVSpec, Match
from hicache_jax.events.records import replay


def _bad_calls(cache, kv, tree_page, mine, node):
    other, _ = gated_cache()
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
        (HiCacheError, lambda: cache.unlock(node)),  # not locked by the caller
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
        (
            HiCacheError,
            lambda: cache.insert(np.arange(ps) + 500, [cache.stats()["device_pages"] - 1]),
        ),
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
    cache, kv = gated_cache(policy, device=16, host=8, kv_events={"publisher": "queue"})
    t = np.arange(6)
    serve_kv(cache, kv, t)
    serve_kv(cache, kv, t)
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
    check_cache(cache, kv)


def test_constructor_rejects_bad_arguments():
    spec = KVSpec(2, 2, 4, page_size=1)
    with pytest.raises(TypeError, match="KVSpec"):
        HiCache("spec", HiCacheConfig(device_pages=4))
    with pytest.raises(TypeError, match="HiCacheConfig"):
        HiCache(spec, {"device_pages": 4})
