"""L3 announced as its own medium (``kv_events={"l3_medium": ...}``): off by default, a page
announced once the store has it and only after its parent, the wire name per store kind, and
vLLM ids on L3 equal to those on the other tiers."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache, serve
from hicache_jax import BlockStored, Medium
from hicache_jax.events.factory import l3_wire_medium
from hicache_jax.spec import KVEventsConfig

PS = 4


def make(tmp_path, l3_medium="auto", l3_policy="write_through", **kv):
    return make_cache(
        bookkeeping_spec(PS),
        8,
        16,
        write_policy="write_through",
        storage=f"file://{tmp_path}/l3",
        storage_write_policy=l3_policy,
        kv_events={"publisher": "queue", "l3_medium": l3_medium, **kv},
    )


def l3_stored(events):
    return [e for e in events if isinstance(e, BlockStored) and e.medium is Medium.L3]


def test_l3_is_not_announced_by_default(tmp_path):
    cache = make(tmp_path, l3_medium=None)
    serve(cache, np.arange(16))
    cache.flush()
    assert cache.stats()["l3_put_pages_stored"] > 0
    assert l3_stored(cache.take_events()) == []
    assert "kv_event_l3_unannounced" not in cache.stats()


def test_a_page_is_announced_once_stored_and_once_only(tmp_path):
    cache = make(tmp_path)
    serve(cache, np.arange(16))
    cache.flush()
    ev = cache.take_events()
    dev = [e for e in ev if e.medium is Medium.DEVICE]
    l3 = l3_stored(ev)
    assert [e.block_hash for e in l3] == [e.block_hash for e in dev]
    assert [e.token_ids for e in l3] == [e.token_ids for e in dev]
    assert [e.parent_block_hash for e in l3] == [None] + [e.block_hash for e in l3[:-1]]
    cache.evict(16)
    cache.evict_host(16)
    serve(cache, np.arange(16))  # computed again, put again: already there
    cache.flush()
    assert l3_stored(cache.take_events()) == []
    cache.reset()  # a consumer forgets L3 too: announced anew
    cache.take_events()
    serve(cache, np.arange(16))
    cache.flush()
    assert len(l3_stored(cache.take_events())) == 4


def test_write_back_children_wait_for_their_parent(tmp_path):
    cache = make(tmp_path, l3_policy="write_back")
    serve(cache, np.arange(8))
    serve(cache, np.concatenate([np.arange(8), 100 + np.arange(8)]))
    cache.evict(16)
    cache.evict_host(16)  # leaves first: the child is put first
    cache.flush()
    l3 = l3_stored(cache.take_events())
    assert len(l3) == 4
    seen = set()
    for e in l3:  # every parent was announced before
        assert e.parent_block_hash is None or e.parent_block_hash in seen
        seen.add(e.block_hash)


def test_vllm_ids_on_l3_equal_the_other_tiers(tmp_path):
    cache = make(tmp_path, block_hash="vllm:sha256", hash_seed="7")
    serve(cache, np.arange(12))
    cache.flush()
    ev = cache.take_events()
    dev = [e.block_hash for e in ev if e.medium is Medium.DEVICE]
    assert [e.block_hash for e in l3_stored(ev)] == dev
    assert [e.parent_block_hash for e in l3_stored(ev)] == [None] + dev[:-1]


@pytest.mark.parametrize(
    "medium, url, want",
    [
        ("auto", "file:///tmp/x", "DISK"),
        ("auto", "mooncake://h:1", "EXTERNAL"),
        ("auto", "python://m:C", "EXTERNAL"),
        ("STORAGE", "file:///tmp/x", "STORAGE"),
        (None, "file:///tmp/x", None),
        ("auto", None, None),
    ],
)
def test_the_wire_name_per_store(medium, url, want):
    assert l3_wire_medium(KVEventsConfig(l3_medium=medium), url) == want


def test_a_page_the_store_dropped_is_announced_removed_when_a_lookup_misses_it(monkeypatch):
    from hicache_jax.events.records import BlockRemoved, replay

    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "examples"))
    cache = make_cache(
        bookkeeping_spec(PS),
        8,
        16,
        write_policy="write_through",
        storage="python://memory_storage:MemoryStorage?capacity_pages=4",
        kv_events={"publisher": "queue", "l3_medium": "auto"},
    )
    prompts = [np.arange(8) + 100 * i for i in range(3)]
    for p in prompts:
        serve(cache, p)
        cache.flush()  # each put lands before the next
    cache.evict(32)
    cache.evict_host(64)
    events = cache.take_events()
    assert {e.medium for e in l3_stored(events)} == {Medium.L3}
    first = [e.block_hash for e in l3_stored(events)][:2]  # prompt 0: the store's oldest
    cache.prefetch(prompts[0])  # the store lost it: the lookup misses
    gone = [e for e in cache.take_events() if isinstance(e, BlockRemoved)]
    # the first page and the one announced below it (unreachable now), the leaf first
    assert [(e.block_hash, e.medium) for e in gone] == [
        (first[1], Medium.L3),
        (first[0], Medium.L3),
    ]
    replay(events + gone)  # consistent: removed once, after stored
