"""cache.lookup: tokens held per tier, equal to match_prefix's figures, with no side effect."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache, serve

PS = 4


def _state(cache):
    nodes, stack = [], [cache._tree.root]
    while stack:
        node = stack.pop()
        nodes.append((id(node), node.key.shape[0], node.last_access))
        stack.extend(node.children.values())
    return sorted(nodes), cache.stats()


def test_lookup_agrees_with_match_prefix_and_changes_nothing():
    rng = np.random.default_rng(3)
    cache = make_cache(bookkeeping_spec(PS), 6, 24, write_policy="write_through")
    prompts = [rng.integers(0, 5, size=int(rng.integers(1, 6)) * PS) for _ in range(40)]
    seen_host = False
    for i, p in enumerate(prompts):
        serve(cache, p, extra_key=i % 2)
        for q in prompts[: i + 1]:
            for key in (0, 1):
                before = _state(cache)
                got = cache.lookup(q, key)
                assert _state(cache) == before  # no split, stamp, count, load or prefetch
                m = cache.match_prefix(q, key)
                assert got == {"device": m.device_len, "host": m.host_len}, (q, key)
                seen_host |= got["host"] > 0
    assert seen_host  # the workload evicted to host, so both tiers were exercised
    cache.close()


def test_lookup_rejects_bad_input_and_leaves_cache_unchanged():
    cache = make_cache(bookkeeping_spec(PS), 6, 24)
    serve(cache, np.arange(8))
    before = _state(cache)
    with pytest.raises((TypeError, ValueError)):
        cache.lookup([-1, 2, 3, 4])
    with pytest.raises((TypeError, ValueError)):
        cache.lookup(np.zeros((2, 4), dtype=np.int32))
    assert _state(cache) == before
    cache.close()
