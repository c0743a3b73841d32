"""``invalidate`` on L3 beyond the tree: a namespace's entries the tree no longer holds (evicted
to L3 only, or put by another cache) are deleted with ``delete_prefix`` and never served again;
a prefix's last page goes, so its continuations are not found; a store that cannot delete moves
the namespace to a new key generation (counted, the namespace's L3 announcements removed)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache, serve, snapshot
from hicache_jax import BlockStored, Medium
from hicache_jax.events.records import BlockRemoved
from hicache_jax.l3.storage import namespace_prefix

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from memory_storage import MemoryStorage

PS = 4
SPEC = bookkeeping_spec(PS)


class KeysOnly(MemoryStorage):
    """Deletes by key, not by prefix (a store that cannot list)."""

    delete_prefix = None


class NoDelete(MemoryStorage):
    """Deletes nothing."""

    delete = None
    delete_prefix = None


def _cache(url, events=True, **kw):
    return make_cache(
        SPEC,
        8,
        16,
        write_policy="write_through",
        storage=url,
        kv_events={"publisher": "queue", "l3_medium": "auto"} if events else None,
        prefetch_policy="wait_complete",
        **kw,
    )


def _to_l3_only(cache):
    cache.flush()
    cache.evict(1 << 20)
    cache.evict_host(1 << 20)
    assert cache.lookup(np.arange(PS))["device"] == 0 and cache.stats()["host_used_pages"] == 0


def _entries(root, spec, extra_key):
    prefix = namespace_prefix(spec, extra_key)
    return [n for _, _, names in os.walk(root) for n in names if n.startswith(prefix)]


A, B = np.arange(4 * PS), 1000 + np.arange(3 * PS)


def test_a_namespace_evicted_to_l3_only_is_deleted_from_the_store_and_misses(tmp_path):
    url = f"file://{tmp_path}"
    cache = _cache(url)
    for key in ("t1", "t2"):
        serve(cache, A, key)
        serve(cache, B, key)
    _to_l3_only(cache)
    other = _cache(url, events=False)  # another cache on the store: its tree holds nothing
    serve(other, 500 + np.arange(2 * PS), "t1")
    other.flush()
    assert len(_entries(tmp_path, SPEC, "t1")) == 9 and len(_entries(tmp_path, SPEC, "t2")) == 7
    cache.take_events()
    got = cache.invalidate(extra_key="t1")
    assert got == {"device": 0, "host": 0, "l3": 9, "l3_unreached": 0}
    assert _entries(tmp_path, SPEC, "t1") == [] and len(_entries(tmp_path, SPEC, "t2")) == 7
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert {e.medium for e in removed} == {Medium.L3}
    assert len(removed) == 7  # what this cache announced of t1
    for c in (cache, other):
        assert c.lookup(A, "t1", l3=True)["l3"] == 0 == c.lookup(B, "t1", l3=True)["l3"]
        assert c.lookup(A, "t2", l3=True)["l3"] == A.size  # the other namespace stays
    before = cache.stats()["l3_prefetch_hit_pages"]
    assert cache.prefetch(A, "t1") is None  # nothing of it in L3 to fetch
    with cache.begin(A, "t1") as req:  # a request of the namespace misses in L3
        assert req.cached_len == 0
        req.extend(A.size)
        req.finish(A)
    assert cache.stats()["l3_prefetch_hit_pages"] == before
    assert cache.stats()["l3_deleted_pages"] == 9 and cache.stats()["l3_invalidate_unreached"] == 0
    for c in (cache, other):
        c.check_invariants()
        c.close()


def test_a_prefix_evicted_to_l3_only_loses_its_last_page_and_continuations_miss(tmp_path):
    cache = _cache(f"file://{tmp_path}")
    serve(cache, A)
    _to_l3_only(cache)
    assert cache.lookup(A, l3=True)["l3"] == A.size
    cache.take_events()
    got = cache.invalidate(A[: 2 * PS])
    assert got == {"device": 0, "host": 0, "l3": 1, "l3_unreached": 0}
    assert cache.lookup(A, l3=True)["l3"] == PS  # the shorter prefix stays
    cache.prefetch(A).wait()
    with cache.begin(A) as req:  # the continuation is not served from L3
        assert req.cached_len == PS
        req.extend(A.size - PS)
        req.finish(A)
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert len([e for e in removed if e.medium is Medium.L3]) == 3
    cache.check_invariants()
    cache.close()


def test_a_store_without_delete_prefix_moves_the_namespace_to_a_new_generation():
    cache = _cache("python://test_invalidate_l3:KeysOnly")
    for key in ("t1", "t2"):
        serve(cache, A, key)
    _to_l3_only(cache)
    store = cache._l3.tier.backend
    held = len(store._entries)
    cache.take_events()
    got = cache.invalidate(extra_key="t1")
    assert got == {"device": 0, "host": 0, "l3": 0, "l3_unreached": 1}
    assert len(store._entries) == held  # the store keeps them ...
    assert cache.lookup(A, "t1", l3=True)["l3"] == 0  # ... but this cache never reads them
    assert cache.lookup(A, "t2", l3=True)["l3"] == A.size
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert len([e for e in removed if e.medium is Medium.L3]) == 4
    assert cache.stats()["l3_invalidate_unreached"] == 1
    serve(cache, A, "t1")  # computed again: stored under the new generation, found again
    _to_l3_only(cache)
    stored = [
        e for e in cache.take_events() if isinstance(e, BlockStored) and e.medium is Medium.L3
    ]
    assert len(stored) == 4 and len(store._entries) == held + 4
    assert cache.lookup(A, "t1", l3=True)["l3"] == A.size
    cache.check_invariants()
    cache.close()


def test_a_prefix_on_a_store_without_delete_drops_the_namespace_from_this_cache():
    cache = _cache("python://test_invalidate_l3:NoDelete", events=False)
    serve(cache, A)
    serve(cache, B)
    _to_l3_only(cache)
    got = cache.invalidate(A[: 2 * PS])
    assert got["l3"] == 0 and got["l3_unreached"] == 1
    assert cache.stats()["l3_delete_unsupported_pages"] == 1
    assert cache.lookup(A, l3=True)["l3"] == 0 == cache.lookup(B, l3=True)["l3"]
    cache.check_invariants()
    cache.close()


def test_bad_input_is_typed_and_leaves_the_store_and_cache_unchanged(tmp_path):
    cache = _cache(f"file://{tmp_path}")
    serve(cache, A, "t1")
    _to_l3_only(cache)
    files = sorted(_entries(tmp_path, SPEC, "t1"))
    before = snapshot(cache)
    for kw, exc in (
        ({"extra_key": ["t1"]}, TypeError),
        ({"tokens": [1, 2], "extra_key": "t1"}, ValueError),
        ({"tokens": A.astype(float), "extra_key": "t1"}, TypeError),
    ):
        with pytest.raises(exc):
            cache.invalidate(**kw)
        assert snapshot(cache) == before and sorted(_entries(tmp_path, SPEC, "t1")) == files
    assert cache.stats()["l3_deleted_pages"] == 0
    for prefix, exc in ((b"hcj2", TypeError), ("", ValueError), ("a/b", ValueError)):
        with pytest.raises(exc):
            cache._l3.tier.backend.delete_prefix(prefix)
    assert sorted(_entries(tmp_path, SPEC, "t1")) == files
    cache.close()
