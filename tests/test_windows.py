"""Window groups in the cache: what the tree keeps, which prefixes are servable, the window
pages' bytes on each tier, and bad calls (hicache_jax/cache/windows.py, memory/window.py,
tree/windows.py). The random workloads are the state machine's
(tests/test_hicache_state_machine.py, ``test_hicache_state_machine_windows``)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import ServedKV, snapshot
from hicache_jax import (
    HiCache,
    HiCacheConfig,
    HiCacheError,
    KVSpec,
    LayerGroup,
    OutOfPagesError,
    StateArray,
)
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.window import WindowPages, spare_rank
from hicache_jax.tree.windows import servable_pages

PS = 4


def _spec(window: int = 8, pattern: str = "3:1", layers: int = 4) -> KVSpec:
    return KVSpec.from_pattern(
        pattern,
        num_layers=layers,
        num_kv_heads=2,
        head_dim=4,
        dtype="bfloat16",
        page_size=PS,
        window=window,
    )


def _cache(spec: KVSpec, device: int = 64, host: int = 128, **cfg) -> HiCache:
    cfg.setdefault("load_back_threshold", PS)
    return HiCache(spec, HiCacheConfig(device_pages=device, host_pages=host, **cfg))


# ------------------------------------------------------------------------- servable_pages


def _brute(held: np.ndarray, groups, limit: int) -> int:
    for k in range(limit, 0, -1):
        if all(
            held[g, k - 1]
            if grp.kind == "state"
            else held[g, grp.need_start(k * PS) // PS : k].all()
            for g, grp in enumerate(groups)
        ):
            return k
    return 0


@settings(max_examples=300, deadline=None)
@given(
    data=st.data(),
    n=st.integers(0, 24),
    specs=st.lists(
        st.tuples(st.sampled_from(["window", "chunk", "state"]), st.integers(1, 20)),
        min_size=1,
        max_size=3,
    ),
)
def test_servable_pages_equals_brute_force(data, n, specs):
    groups = [
        LayerGroup(kind, (i,), state=[StateArray("s", (v,))])
        if kind == "state"
        else LayerGroup(
            kind,
            (i,),
            1,
            2,
            window=v if kind == "window" else None,
            chunk=v if kind == "chunk" else None,
        )
        for i, (kind, v) in enumerate(specs)
    ]
    held = np.array(
        data.draw(
            st.lists(
                st.lists(st.booleans(), min_size=n, max_size=n),
                min_size=len(groups),
                max_size=len(groups),
            )
        ),
        dtype=bool,
    ).reshape(len(groups), n)
    limit = data.draw(st.integers(0, n))
    assert servable_pages(held, groups, PS, limit) == _brute(held, groups, limit)


# ------------------------------------------------------------------------------ WindowPages


def test_window_pages_follow_their_full_page():
    spec = _spec()
    anchor = PageAllocator(8, "device")
    pools = [_FakePool(4)]
    w = WindowPages(spec.window_groups, pools, anchor, "device")
    ids = anchor.alloc(3)
    w.attach_new(ids)
    assert w.used_pages() == [3] and (w.held(ids)).all()
    w.check()
    with pytest.raises(OutOfPagesError, match="window group 0 pool: 2 pages needed, 1 free"):
        w.attach_new(anchor.alloc(2))  # all or nothing: no page of the group taken
    assert w.used_pages() == [3]
    anchor.free(ids[:2])  # the full-attention pages leave: their window pages with them
    assert w.used_pages() == [1] and not w.held(ids[:2]).any()
    assert w.detach_group(0, ids[2:]) == 1 and w.used_pages() == [0]


def test_a_copy_short_of_window_pages_frees_no_spare_page_of_a_higher_rank():
    """``WindowPages.take_for_copy``: onto a full pool, the pages a node end reads may free
    any spare page (lowest rank first), a spare page only one of no higher rank."""
    spec = _spec()
    anchor = PageAllocator(16, "host")
    w = WindowPages(spec.window_groups, [_FakePool(6)], anchor, "host")
    held = anchor.alloc(6)
    w.attach_new(held)
    w.mark_spare(0, held, np.array([1, 1, 2, 2, 3, 5]))  # all six spare, ranks 1 1 2 2 3 5
    # one page a node end reads, then spare ones of ranks 4, 2, 2, 1: the node end's page
    # frees a rank-1 page, then rank 4 frees the other rank 1, rank 2 and 2 free the two
    # rank 2 (no higher), rank 1 finds only ranks 3 and 5 left: not copied
    got = w.take_for_copy(0, 1, np.array([4, 2, 2, 1]))
    assert got.size == 4
    assert sorted(spare_rank(w.spare[0, held[w.held(held)[0]]]).tolist()) == [3, 5]
    assert w.spare_reclaimed == 4
    # room enough: every page, nothing freed
    w2 = WindowPages(spec.window_groups, [_FakePool(6)], PageAllocator(16, "h"), "host")
    assert w2.take_for_copy(0, 2, np.array([1, 0])).size == 4 and w2.spare_reclaimed == 0


class _FakePool:
    def __init__(self, n: int) -> None:
        self.allocator = PageAllocator(n, "window")


# ------------------------------------------------------------------------ the tree's rules


@pytest.mark.parametrize("spare", [True, False])
def test_a_node_keeps_only_what_a_continuation_at_its_end_reads(spare):
    spec = _spec(window=8)  # 2 pages of 4
    cache = _cache(spec, window_spare=spare)
    serve = ServedKV(cache)
    tokens = np.arange(64)
    serve(tokens)
    st_ = cache.stats()
    kept = st_["window_device_used_pages"] - st_["window_device_spare_pages"]
    assert kept == 2  # the last 8 tokens of the one node
    assert st_["window_device_spare_pages"] == (14 if spare else 0)  # the rest: spare or freed
    assert st_["window_pages_trimmed"] == 14
    assert serve(tokens) == 64  # the whole prompt is a hit: its window is there


def test_bytes_a_cached_prefix_holds():
    """For prompts much longer than the window, a cached prefix holds 1/4 + 3/4 * W/n of what
    the all-full model would (a 3:1 pattern, every layer of one shape)."""
    window, n = 8, 256
    spec = _spec(window=window)
    cache = _cache(spec, device=128, host=256, window_spare=False)
    ServedKV(cache)(np.arange(n))
    full_bytes = spec.page_bytes * (n // PS)
    win_bytes = (
        spec.window_groups[0].spec(PS).page_bytes * cache.stats()["window_device_used_pages"]
    )
    all_full = spec.model_page_bytes * (n // PS)
    assert (full_bytes + win_bytes) / all_full == pytest.approx(1 / 4 + 3 / 4 * window / n)


def test_spare_window_pages_serve_a_split_end_until_room_is_needed():
    spec = _spec(window=8)
    a = np.arange(64)
    b = a.copy()
    b[40:] += 1000
    cache = _cache(spec)
    serve = ServedKV(cache)
    serve(a)  # 16 pages: 2 kept, 14 spare
    assert serve(b) == 40  # the split end at 40 reads spare pages 8, 9: still there
    assert cache.stats()["window_unservable_tokens"] == 0
    # A window pool of 18 pages: a's 14 spare pages make room for another request's 16.
    cache = _cache(spec, window_device_pages=18)
    serve = ServedKV(cache)
    serve(a)
    serve(np.arange(2000, 2064))
    assert cache.stats()["window_spare_reclaimed"] == 14
    assert cache.stats()["evictions"] == 0  # spare pages go before any node
    assert serve(b) == 0  # a's pages 8, 9 were freed: the split end at 40 is not servable


def test_spare_window_pages_go_so_that_the_ends_left_servable_thin_out_evenly():
    # W 8 = 2 pages: page j is read by the ends j + 1 and j + 2 (pages from the root). Its
    # reclaim rank is the larger trailing-zero count of the two, so the first pages taken
    # leave every end at a multiple of 4 pages servable, then of 8, and so on.
    spec = _spec(window=8)
    a = np.arange(64)  # 16 pages: 14, 15 kept (its end reads them), 0 .. 13 spare
    cache = _cache(spec, window_device_pages=18)
    serve = ServedKV(cache)
    serve(a)
    serve(np.arange(2000, 2040))  # 10 pages: 2 free, 8 spare pages taken
    assert cache.stats()["window_spare_reclaimed"] == 8
    assert cache.stats()["evictions"] == 0
    for cut, served in ((48, 48), (56, 48), (40, 32), (36, 32), (20, 16), (12, 0)):
        b = a.copy()
        b[cut:] += 1000
        m = cache.match_prefix(b)
        assert m.device_len == served, cut
    assert cache.stats()["window_unservable_tokens"] > 0


def test_a_split_end_backs_off_then_is_filled_by_the_request_that_recomputes_it():
    spec = _spec(window=8)
    cache = _cache(spec, window_spare=False)
    serve = ServedKV(cache)
    a = np.arange(64)
    serve(a)
    b = a.copy()
    b[40:] += 1000  # shares 40 tokens (10 pages) with a
    # a's node is split at 40, whose window pages (24..40) were freed: nothing is servable
    # before a's own end, so b recomputes from 0 ...
    assert serve(b) == 0
    assert cache.stats()["window_unservable_tokens"] > 0
    # ... and its pages give the split node the window pages its end reads (48 is not
    # servable: b's own node keeps only the pages before its end, 56..64)
    assert serve(np.concatenate([b[:40], [7] * 8])) == 40
    assert serve(b[:48]) == 40
    assert serve(a) == 64


def test_device_pages_whose_end_lacks_its_window_are_served_with_the_host_part():
    """a backed up, split at 40 (whose window pages were freed), its lower node evicted to
    host: the device pages 0-40 serve nothing alone, the host part's end (64) reads window
    pages held on host. The match keeps it all (device part 0, the 40 device tokens resident
    in the host part) and the request is served 64 tokens, bit-exact (before: 0)."""
    spec = _spec(window=8)
    cache = _cache(
        spec, window_spare=False, write_policy="write_through", write_through_threshold=1
    )
    serve = ServedKV(cache)
    a = np.arange(64)
    serve(a)
    cache.flush()
    b = a.copy()
    b[40:] += 1000
    cache.match_prefix(b)  # splits a at 40
    assert cache.evict(24) == 24
    m = cache.match_prefix(a)
    assert (m.device_len, m.host_len, m.resident_len) == (0, 64, 40)
    assert serve(a) == 64
    assert cache.stats()["served_device_tokens"] == 40


@pytest.mark.parametrize("eviction", ["lru", "value"])
def test_a_window_longer_than_any_prompt_is_full_attention(eviction):
    """Same hits, same occupancy as the plain spec of the full layers' shape, under the same
    eviction (the defaults differ: ``value`` with window groups, ``lru`` without)."""
    rng = np.random.default_rng(0)
    prompts = [
        np.concatenate([np.arange(32), rng.integers(100, 200, int(rng.integers(4, 40)))])
        for _ in range(20)
    ]
    windowed = _cache(_spec(window=10_000), device=24, host=48, eviction=eviction)
    plain_spec = KVSpec(num_layers=1, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=PS)
    plain = _cache(plain_spec, device=24, host=48, eviction=eviction)
    for cache in (windowed, plain):
        serve = ServedKV(cache) if cache is windowed else None
        for p in prompts:
            if serve:
                serve(p)
            else:
                p = p[: p.size // PS * PS]
                with cache.begin(p) as req:
                    req.extend(p.size - req.cached_len)
                    req.finish(p)
    keys = ("device_hit_tokens", "host_hit_tokens", "evictions", "backups", "load_backs")
    assert {k: windowed.stats()[k] for k in keys} == {k: plain.stats()[k] for k in keys}
    assert windowed.stats()["window_pages_trimmed"] == 0


def test_hits_from_host_read_back_every_group(tmp_path):
    """Evicted to host and loaded back: the window pages a continuation reads come back with
    the full-attention pages, bit-exact (and only those: the rest were never copied)."""
    spec = _spec(window=8)
    cache = _cache(spec, device=24, host=96, write_policy="write_through")
    serve = ServedKV(cache)
    a, b = np.arange(64), np.arange(1000, 1064)
    serve(a)
    serve(b)  # evicts a from device
    cache.flush()
    assert serve(a) == 64
    assert cache.stats()["load_backs"] > 0
    st_ = cache.stats()
    assert st_["window_host_used_pages"] - st_["window_host_spare_pages"] <= 4  # two tails


def test_small_window_pools_evict_for_a_callers_window_pages():
    spec = _spec(window=8)
    cache = _cache(spec, device=32, host=64, window_device_pages=18)
    serve = ServedKV(cache)
    for i in range(6):
        serve(np.arange(64) + 1000 * i)  # 16 pages each: the window pool holds one request
    assert cache.stats()["evictions"] > 0
    assert cache.stats()["window_device_used_pages"] <= 18


@pytest.mark.parametrize("write_policy", ["clean_ahead", "write_back", "write_through"])
def test_a_backup_makes_host_room_for_the_window_pages_its_node_end_reads(write_policy):
    """A host window pool of 4 pages holds two node ends (W 8 = 2 pages each) and a full pool
    that holds five prompts: each backup past the second evicts the least valuable host node
    for its end's window pages, rather than copying its full pages without them (a host copy
    that could not serve its own end, never reclaimed while it held pages nobody reads)."""
    spec = _spec(window=8)
    cache = _cache(
        spec,
        device=20,
        host=80,
        window_host_pages=4,
        write_policy=write_policy,
        write_through_threshold=1,
    )
    serve = ServedKV(cache)
    prompts = [np.arange(64) + 1000 * i for i in range(5)]
    for p in prompts:
        serve(p)  # 16 pages: the next one evicts it from device (backed up first)
    cache.flush()
    st_ = cache.stats()
    assert st_["window_pages_dropped"] == 0
    assert st_["host_evicted_tokens"] + st_["host_copies_dropped_tokens"] > 0  # room in L2
    assert st_["window_host_used_pages"] <= 4
    # the last one evicted from device (clean_ahead: all but its head) is whole on host:
    # served bit-exact, from L2
    assert serve(prompts[3]) == 64
    assert cache.stats()["host_hit_tokens"] >= 48
    cache.check_invariants()


# --------------------------------------------------------------------------------- bad calls


def test_bad_window_calls_raise_typed_errors_and_change_nothing():
    spec = _spec()
    cache = _cache(spec, window_spare=False)
    ServedKV(cache)(np.arange(32))
    before = snapshot(cache)
    tree_page = cache.match_prefix(np.arange(32)).device_pages
    with pytest.raises(ValueError, match="group=1 must be an int in"):
        cache.read_window_kv(1, tree_page[-1:])
    with pytest.raises(HiCacheError, match="hold no page of window group 0"):
        cache.read_window_kv(0, tree_page[:1])  # trimmed: no continuation reads it
    with pytest.raises(HiCacheError, match="caller-owned"):
        cache.write_window_kv(0, tree_page[-1:], np.zeros((3, 2, 1, PS, 2, 4), np.uint16))
    page = cache.alloc_pages(1)
    after_alloc = snapshot(cache)
    with pytest.raises(ValueError, match=r"kv\.shape"):
        cache.write_window_kv(0, page, np.zeros((1, 2, 1, PS, 2, 4), np.uint16))
    assert snapshot(cache) == after_alloc
    cache.free_pages(page)
    assert snapshot(cache)[1:] == before[1:]
    plain = _cache(KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, page_size=PS))
    with pytest.raises(HiCacheError, match="no window groups"):
        plain.window_pages(plain.alloc_pages(1))


def test_settings_not_supported_with_window_groups_are_refused(tmp_path):
    spec = _spec()
    # storage is supported (tests/test_windows_l3.py): the store opens once more per group
    HiCache(spec, HiCacheConfig(device_pages=8, storage=f"file://{tmp_path}")).close()
    with pytest.raises(ValueError, match="load_overlap=True with window groups"):
        HiCache(spec, HiCacheConfig(device_pages=8, load_policy="cost", load_overlap=True))
    with pytest.raises(ValueError, match="window_device_pages=0 must be >= 1"):
        HiCacheConfig(device_pages=8, window_device_pages=0)
    for flag in ("window_spare", "storage_window_spare"):
        with pytest.raises(TypeError, match=f"{flag}='yes' must be a bool"):
            HiCacheConfig(device_pages=8, **{flag: "yes"})
    for bad in (0, 3, -4):  # an int: the spacing of the ends put, in pages
        with pytest.raises(ValueError, match=f"storage_window_spare={bad} must be a power of two"):
            HiCacheConfig(device_pages=8, storage_window_spare=bad)
