"""The control API: lookup with L3, invalidate of a namespace or a prefix on every tier (events,
store entries, pins, locks), with typed errors that leave the cache unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import l3_helpers as L
from helpers import bookkeeping_spec, make_cache, serve, snapshot
from hicache_jax.errors import InvalidateLockedError
from hicache_jax.events.records import BlockRemoved

PS = 4


def _events_cache(**kw):
    return make_cache(
        bookkeeping_spec(PS),
        8,
        16,
        write_policy="write_through",
        kv_events={"publisher": "queue"},
        **kw,
    )


def test_invalidate_namespace_drops_every_tier_and_publishes_removals():
    cache = _events_cache()
    a, b = np.arange(3 * PS), np.arange(50, 50 + 2 * PS)
    for key in (1, 2):
        serve(cache, a, key)
        serve(cache, a, key)  # backed up
        serve(cache, b, key)
    cache.evict(2 * PS)  # some host-only
    cache.take_events()
    before2 = (cache.lookup(a, 2), cache.lookup(b, 2))
    got = cache.invalidate(extra_key=1)
    assert got["device"] + got["host"] > 0 and got["l3"] == 0
    assert cache.lookup(a, 1) == {"device": 0, "host": 0} == cache.lookup(b, 1)
    assert (cache.lookup(a, 2), cache.lookup(b, 2)) == before2  # the other namespace stays
    removed = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    assert len(removed) == (got["device"] + got["host"]) // PS
    st = cache.stats()
    assert st["invalidated_device_tokens"] == got["device"]
    assert st["invalidated_host_tokens"] == got["host"]
    cache.check_invariants()
    cache.close()


def test_invalidate_prefix_drops_its_last_page_and_below_keeps_shorter_prefixes():
    cache = _events_cache()
    base = np.arange(2 * PS)
    t1 = np.concatenate([base, np.arange(100, 100 + 2 * PS)])
    t2 = np.concatenate([base, np.arange(200, 200 + PS)])
    serve(cache, t1)
    serve(cache, t2)
    target = t1[: 3 * PS]  # ends inside t1's own node: split there
    got = cache.invalidate(target)
    assert got["device"] == 2 * PS  # t1's last two pages
    assert cache.lookup(t1)["device"] == 2 * PS  # the shared base stays ...
    assert cache.lookup(t2)["device"] == 3 * PS  # ... and so does the sibling
    cache.check_invariants()
    assert cache.invalidate(target) == {"device": 0, "host": 0, "l3": 0, "l3_unreached": 0}
    cache.close()


def test_invalidate_drops_pins_but_refuses_locked_nodes_without_change():
    cache = _events_cache()
    a = np.arange(2 * PS)
    serve(cache, a)
    cache.pin(a)
    with cache.begin(np.concatenate([a, np.arange(9, 9 + PS)])) as req:
        cache.flush()  # invalidate waits for transfers first (the backup may be in flight)
        before = snapshot(cache)
        with pytest.raises(InvalidateLockedError) as e:
            cache.invalidate(a)
        assert e.value.locked and e.value.locked[0][1] == 1
        assert snapshot(cache) == before
        req.extend(PS)
        req.finish(np.concatenate([a, np.arange(9, 9 + PS)]))
    got = cache.invalidate(a)
    assert got["device"] == 2 * PS and cache.stats()["pins"] == 0  # a's last page and below
    assert cache.lookup(a)["device"] == PS
    cache.check_invariants()
    cache.close()


def test_invalidate_bad_input_is_typed_and_changes_nothing():
    cache = _events_cache()
    serve(cache, np.arange(2 * PS))
    before = snapshot(cache)
    for kw, exc in (
        ({"tokens": [-1, 0, 0, 0]}, ValueError),
        ({"tokens": [1, 2]}, ValueError),
        ({"extra_key": [1]}, TypeError),
        ({"tokens": np.zeros((2, PS), np.int32)}, ValueError),
    ):
        with pytest.raises(exc):
            cache.invalidate(**kw)
        assert snapshot(cache) == before
    with pytest.raises(TypeError):
        cache.lookup(np.arange(PS), l3="yes")
    cache.check_invariants()
    cache.close()


def test_lookup_l3_and_invalidate_delete_store_entries(tmp_path):
    url = f"file://{tmp_path}"
    toks, kv = L.tokens_kv(0, 4)
    writer = L.make(url)
    L.compute(writer, toks, kv)
    writer.flush()
    cache = L.make(url)
    before = cache.stats()
    assert cache.lookup(toks) == {"device": 0, "host": 0}
    assert cache.lookup(toks, l3=True) == {"device": 0, "host": 0, "l3": 4 * PS}
    assert cache.stats() == before  # no counter moved, nothing fetched
    got = cache.invalidate(toks[: 2 * PS])  # not in this cache's tree: its store entry goes
    assert got["l3"] == 1
    assert cache.lookup(toks, l3=True)["l3"] == PS  # the first page is left
    got = writer.invalidate(toks[:PS])  # the writer's tree holds all four pages
    assert got["device"] == 4 * PS and got["l3"] == 3  # pages 0, 2, 3 (1 was gone)
    assert cache.lookup(toks, l3=True)["l3"] == 0
    assert cache.stats()["l3_deleted_pages"] == 1 and writer.stats()["l3_deleted_pages"] == 3
    for c in (writer, cache):
        c.check_invariants()
        c.close()
