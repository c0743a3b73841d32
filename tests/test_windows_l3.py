"""Window groups with an L3 store (hicache_jax/l3/windows.py, l3/tier.py, l3/prefetch.py):
each group's kept pages are put as entries of their own next to the full-attention pages,
a fresh cache on the same store serves the prefix from L3 bit-exact on every group, a prefix
whose group entries are missing (or wrong) in the store is cut back, trimmed window pages
never reach the store, and plain-spec keys are what they were."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from helpers import ServedKV
from hicache_jax import HiCache, HiCacheConfig, KVSpec, LayerGroup, StateArray
from hicache_jax.l3.storage import page_keys
from hicache_jax.l3.windows import window_keys

PS = 4


def _spec(window: int = 8) -> KVSpec:
    return KVSpec.from_pattern(
        "3:1", num_layers=4, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=PS,
        window=window,
    )  # fmt: skip


def _two_groups() -> KVSpec:
    """Two window groups whose pages have the same shape (equal ``LayerGroup.spec``
    fingerprints), with other windows: only the group in the key tells their entries apart."""
    shape = {"num_kv_heads": 2, "head_dim": 4, "dtype": "bfloat16"}
    return KVSpec.from_groups(
        [
            LayerGroup("full", (2,), **shape),
            LayerGroup("window", (0, 3), **shape, window=8),
            LayerGroup("window", (1, 4), **shape, window=4),
        ],
        page_size=PS,
    )


def _cache(spec: KVSpec, url: str, **cfg) -> HiCache:
    cfg = {
        "device_pages": 64,
        "host_pages": 128,
        "load_back_threshold": PS,
        "write_through_threshold": 1,
        **cfg,
    }
    return HiCache(spec, HiCacheConfig(storage=url, **cfg))


def _entries(root: str) -> dict[str, list[str]]:
    """The store's entry names, by group ("full", "w0", "w1", ...)."""
    out: dict[str, list[str]] = {}
    for folder in os.listdir(root):
        if folder == ".tmp":
            continue
        for name in os.listdir(os.path.join(root, folder)):
            parts = name.split("_")
            out.setdefault(parts[3] if len(parts) == 5 else "full", []).append(name)
    return out


def _tokens(seed: int, pages: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, pages * PS)


@pytest.fixture
def store(tmp_path):
    root = str(tmp_path / "store")
    return root, f"file://{root}"


def _write(spec: KVSpec, url: str, *prompts: np.ndarray) -> None:
    a = _cache(spec, url)
    served = ServedKV(a)
    for toks in prompts:
        served(toks)
    a.flush()
    s = a.stats()
    assert s["l3_window_put_pages"] == s["l3_window_put_pages_stored"] > 0
    assert s["l3_window_puts_skipped"] == s["l3_window_puts_dropped"] == 0
    a.close()


@pytest.mark.parametrize("make_spec", [_spec, _two_groups], ids=["one_group", "two_groups"])
def test_fresh_cache_serves_a_long_prompt_from_l3_bit_exact(store, make_spec):
    _root, url = store
    spec = make_spec()
    toks = _tokens(0, 12)
    _write(spec, url, toks)
    b = _cache(spec, url, prefetch_policy="wait_complete")
    served = ServedKV(b)
    assert b.match_prefix(toks).host_len == 0  # nothing local: only L3 has it
    h = b.prefetch(toks)
    assert h is not None and h.wait() == 12
    assert served(toks) == 12 * PS  # every page, read back bit-exact on every group
    s = b.stats()
    assert s["served_l3_tokens"] == 12 * PS
    assert s["l3_prefetch_hit_pages"] == 12
    kept = sum(-(-g.window // PS) for g in spec.window_groups)  # the window pages at the end
    assert s["l3_window_prefetch_pages"] == s["l3_window_prefetch_hit_pages"] == kept
    assert s["l3_window_prefetch_missed_pages"] == 0
    served.check()
    b.close()


def test_store_holds_only_the_window_pages_the_tree_keeps(store):
    root, url = store
    spec = _two_groups()  # windows of 8 and 4 tokens: 2 and 1 pages kept at a node's end
    toks = _tokens(1, 10)
    _write(spec, url, toks[: 6 * PS], toks)  # two nodes: ends at 6 and 10 pages
    names = _entries(root)
    assert len(names["full"]) == 10
    assert len(names["w0"]) == 2 + 2 and len(names["w1"]) == 1 + 1
    keys = page_keys(spec, toks, None)  # the full-attention pages' keys, root first
    assert sorted(names["w0"]) == sorted(window_keys([keys[i] for i in (4, 5, 8, 9)], 0))
    assert sorted(names["w1"]) == sorted(window_keys([keys[i] for i in (5, 9)], 1))
    # each prefix end the first cache held is served from L3 by a fresh one
    for n in (6, 10):
        b = _cache(spec, url, prefetch_policy="wait_complete")
        b.prefetch(toks[: n * PS])
        assert ServedKV(b)(toks[: n * PS]) == n * PS
        b.close()


def _corrupt(root: str, spec: KVSpec, toks: np.ndarray, page: int, how: str) -> None:
    """Remove window group 0's entry of ``page``, or overwrite it with page ``page - 1``'s
    (a whole, valid entry of another key: must read as a miss, never as data)."""
    keys = window_keys(page_keys(spec, toks, None), 0)
    path = next(os.path.join(r, keys[page]) for r, _, f in os.walk(root) if keys[page] in f)
    if how == "missing":
        os.remove(path)
    else:
        src = [os.path.join(r, keys[page - 1]) for r, _, f in os.walk(root) if keys[page - 1] in f]
        shutil.copyfile(src[0], path)


def test_prefix_whose_window_entries_are_missing_is_fetched_to_the_deepest_servable_end(store):
    """A lookup cuts what it fetches back to the deepest end whose window entries L3 holds:
    the pages beyond it (which no continuation could read) are not fetched, and the shorter
    prefix is served from L3 at once."""
    root, url = store
    spec = _spec()
    toks = _tokens(2, 10)
    _write(spec, url, toks[: 6 * PS], toks)  # window entries of pages 4, 5 and 8, 9
    _corrupt(root, spec, toks, 9, "missing")
    b = _cache(spec, url, prefetch_policy="wait_complete")
    served = ServedKV(b)
    h = b.prefetch(toks)
    assert h is not None and h.wait() == 6  # page 9's window entry is gone: end at 6
    m = b.match_prefix(toks)
    assert m.device_len == 0 and m.host_len == 6 * PS
    s = b.stats()
    assert s["l3_prefetch_hit_pages"] == 6 and s["l3_window_unservable_pages"] == 4
    assert s["l3_window_prefetch_hit_pages"] == 2 and s["l3_window_prefetch_missed_pages"] == 0
    served.check()
    assert served(toks) == 6 * PS  # served from L3 and exact
    b.close()


def test_prefix_whose_window_entries_are_corrupt_is_cut_back(store):
    """An entry that exists but reads wrong is found only by the fetch: the fetched prefix is
    cut back at the match (nothing wrong kept), and the shorter one is served from L3."""
    root, url = store
    spec = _spec()
    toks = _tokens(2, 10)
    _write(spec, url, toks[: 6 * PS], toks)  # window entries of pages 4, 5 and 8, 9
    _corrupt(root, spec, toks, 9, "wrong")
    b = _cache(spec, url, prefetch_policy="wait_complete")
    served = ServedKV(b)
    h = b.prefetch(toks)
    assert h is not None and h.wait() == 10  # the full-attention pages are all there
    m = b.match_prefix(toks)
    assert m.device_len + m.host_len == 0  # the leaf's end reads page 9's window: cut back
    s = b.stats()
    assert s["l3_prefetch_hit_pages"] == 10 and s["window_unservable_tokens"] > 0
    assert s["l3_window_prefetch_hit_pages"] == 0 and s["l3_window_prefetch_missed_pages"] == 2
    served.check()  # the leaf holds no window page: nothing wrong kept
    assert served(toks) == 0  # recomputed; what it served (nothing) and keeps is exact
    # the shorter prefix, whose window entries are whole, is served from L3
    c = _cache(spec, url, prefetch_policy="wait_complete")
    c.prefetch(toks[: 6 * PS])
    assert ServedKV(c)(toks[: 6 * PS]) == 6 * PS
    b.close(), c.close()


@pytest.mark.parametrize("put_spare", [False, True])
def test_spare_window_pages_in_l3_serve_a_prompt_leaving_a_stored_one_mid_node(store, put_spare):
    """``storage_window_spare``: a second cache on the same store serves a prompt that leaves a
    stored one inside its node from L3 (exact) only when the spare window pages were put; by
    default L3 holds the node end's window alone, and nothing is fetched for that prompt."""
    root, url = store
    spec = _spec()
    toks = _tokens(4, 10)
    a = _cache(spec, url, storage_window_spare=put_spare)
    ServedKV(a)(toks)
    a.flush()
    a.close()
    assert len(_entries(root)["w0"]) == (10 if put_spare else 2)
    b = _cache(spec, url, prefetch_policy="wait_complete")
    served = ServedKV(b)
    leave = np.concatenate([toks[: 6 * PS], _tokens(5, 3)])
    h = b.prefetch(leave)
    if put_spare:
        assert h is not None and h.wait() == 6
    else:
        assert h is None and b.stats()["l3_window_unservable_pages"] == 6
    assert served(leave) == (6 * PS if put_spare else 0)  # and what it served is exact
    served.check()
    b.close()


@pytest.mark.parametrize("leave_at, served", [(8, 8), (7, 4), (6, 4), (5, 4), (3, 0)])
def test_spare_window_pages_every_k_pages_in_l3_serve_up_to_the_last_such_end(
    store, leave_at, served
):
    """``storage_window_spare=4``: of the spare window pages, only those the ends at multiples
    of 4 pages read are put (W 8 = 2 pages: pages 2, 3 and 6, 7 of a 10-page prompt, besides
    the node end's 8, 9), so a second cache serves a prompt leaving the stored one inside its
    node from L3 up to the last such end before the point where it leaves (exact)."""
    root, url = store
    spec = _spec()
    toks = _tokens(4, 10)
    a = _cache(spec, url, storage_window_spare=4)
    ServedKV(a)(toks)
    a.flush()
    a.close()
    assert len(_entries(root)["w0"]) == 6
    b = _cache(spec, url, prefetch_policy="wait_complete")
    check = ServedKV(b)
    leave = np.concatenate([toks[: leave_at * PS], _tokens(5, 3)])
    h = b.prefetch(leave)
    assert (h.wait() if h is not None else 0) == served
    assert check(leave) == served * PS  # and what it served is exact
    check.check()
    b.close()


def _three_kinds() -> KVSpec:
    """A window group (W 8 = 2 pages) and a recurrent group beside the full one."""
    shape = {"num_kv_heads": 2, "head_dim": 4, "dtype": "bfloat16"}
    return KVSpec.from_groups(
        [
            LayerGroup("full", (2,), **shape),
            LayerGroup("window", (0,), **shape, window=8),
            LayerGroup(
                "state", (1,), state=[StateArray("conv", (2, 3)), StateArray("ssm", (2, 2, 2))]
            ),
        ],
        page_size=PS,
    )


@pytest.mark.parametrize("put_spare", [None, False])
@pytest.mark.parametrize("leave_at, served", [(9, 8), (6, 4), (3, 0)])
def test_checkpoints_in_l3_come_with_the_window_pages_their_ends_read(
    store, put_spare, leave_at, served
):
    """With window and STATE groups, every checkpoint goes to L3, and by default
    (``storage_window_spare=None``) so do the window pages the interior checkpoints' ends read
    (every ``checkpoint_every_pages`` = 4 pages: pages 2, 3 and 6, 7 of a 10-page prompt,
    besides the node end's 8, 9): a second cache serves a prompt leaving the stored one
    inside its node from L3 up to the last checkpoint before the point where it leaves
    (exact). ``False`` puts the node end's window pages alone: nothing inside is servable.
    (No tail checkpoint: the interval's alone.)"""
    root, url = store
    spec = _three_kinds()
    toks = _tokens(4, 10)
    a = _cache(
        spec, url, storage_window_spare=put_spare, checkpoint_every_pages=4, checkpoint_tail_pages=0
    )
    first = ServedKV(a)
    first(toks)
    a.flush()
    a.close()
    assert len(_entries(root)["w0"]) == (6 if put_spare is None else 2)
    assert len(_entries(root)["w1"]) == 3  # the checkpoints at 4, 8 and 10 pages
    b = _cache(
        spec,
        url,
        prefetch_policy="wait_complete",
        checkpoint_every_pages=4,
        checkpoint_tail_pages=0,
    )
    check = ServedKV(b)
    check.states[0].taken = first.states[0].taken  # one model: the checkpoints a took
    leave = np.concatenate([toks[: leave_at * PS], _tokens(5, 3)])
    h = b.prefetch(leave)
    want = served if put_spare is None else 0
    assert (h.wait() if h is not None else 0) == want
    assert check(leave) == want * PS  # and what it served is exact
    check.check()
    b.close()


def test_window_host_pool_short_leaves_the_fetched_prefix_unservable_from_host(store):
    _root, url = store
    spec = _spec()
    toks = _tokens(3, 8)
    _write(spec, url, toks)
    b = _cache(spec, url, prefetch_policy="wait_complete", window_host_pages=1)
    served = ServedKV(b)
    b.prefetch(toks).wait()
    assert b.match_prefix(toks).host_len == 0  # 2 window pages needed, 1 in the pool
    assert b.stats()["l3_window_prefetch_missed_pages"] == 2
    served.check()
    assert served(toks) == 0
    b.close()


def test_write_back_puts_the_kept_window_pages_at_host_eviction(store):
    root, url = store
    spec = _spec()
    prompts = [_tokens(10 + i, 6) for i in range(6)]
    a = _cache(
        spec,
        url,
        device_pages=16,
        host_pages=24,
        storage_write_policy="write_back",
        write_policy="write_through",
    )
    served = ServedKV(a)
    for toks in prompts:
        served(toks)
    a.flush()
    names = _entries(root)
    stored = [t for t in prompts if page_keys(spec, t, None)[0] in names.get("full", [])]
    assert stored, "the host pool evicted some prompt"
    want = [k for t in stored for k in window_keys(page_keys(spec, t, None)[4:], 0)]
    assert sorted(names["w0"]) == sorted(want)  # each node's kept pages, nothing trimmed
    a.close()
    b = _cache(spec, url, prefetch_policy="wait_complete")
    b.prefetch(stored[0])
    assert ServedKV(b)(stored[0]) == 6 * PS
    b.close()


def test_plain_spec_keys_are_unchanged(store):
    root, url = store
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=PS)
    # pinned: existing stores stay readable
    assert page_keys(spec, np.arange(2 * PS), None) == [
        "hcj2_b23df3cf8a803038_43672a59dd716050_088fef20bda84dda9c01a70d74b94c8e",
        "hcj2_b23df3cf8a803038_43672a59dd716050_116ac0f17eb7f0761eabcff9d5e245bf",
    ]
    cache = HiCache(
        spec,
        HiCacheConfig(device_pages=16, host_pages=32, storage=url, write_through_threshold=1),
    )
    assert cache._port.window_host is None
    toks = np.arange(3 * PS)
    with cache.begin(toks) as req:
        cache.write_kv(req.extend(toks.size), np.zeros(spec.kv_shape(3), np.float32))
        req.finish(toks)
    cache.flush()
    assert not any(k.startswith("l3_window") for k in cache.stats())
    assert sorted(_entries(root)) == ["full"]
    assert sorted(_entries(root)["full"]) == sorted(page_keys(spec, toks, None))
    cache.close()


def test_window_keys_carry_the_group():
    keys = ["hcj2_aa_bb_0123", "hcj2_aa_bb-g2_4567"]
    assert window_keys(keys, 0) == ["hcj2_aa_bb_w0_0123", "hcj2_aa_bb-g2_w0_4567"]
    assert window_keys(keys, 1) != window_keys(keys, 0)
    spec = _two_groups()
    g0, g1 = (g.spec(PS) for g in spec.window_groups)
    assert g0.fingerprint() == g1.fingerprint()  # why the key names the group itself


def test_fetched_pages_backing_up_a_device_node_get_its_kept_window_pages(store):
    """Write-through modes fetch from the deepest backed-up node: a device node without a
    host copy takes the fetched pages as one, with the window pages a continuation at its own
    end reads (a chunked group: all of its pages, from the chunk's start)."""
    _root, url = store
    spec = KVSpec.from_pattern(
        "3:1", num_layers=4, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=PS,
        chunk=8 * PS,
    )  # fmt: skip
    toks = _tokens(4, 7)
    _write(spec, url, toks)
    b = _cache(
        spec,
        url,
        prefetch_policy="wait_complete",
        write_policy="write_through",
        storage_write_policy="write_through_selective",
        write_through_threshold=5,
    )
    served = ServedKV(b)
    assert served(toks[: 6 * PS]) == 0  # on device only: no host copy
    assert b.match_prefix(toks[: 6 * PS]).device_len == 6 * PS
    b.prefetch(toks).wait()
    m = b.match_prefix(toks)  # (landed pages attach at a call's poll)
    assert (m.device_len, m.host_len) == (6 * PS, PS)
    s = b.stats()
    assert s["l3_prefetch_backfill_pages"] == 6 and s["l3_prefetch_hit_pages"] == 1
    assert s["l3_window_prefetch_hit_pages"] == 6 + 1  # the device node's 6, the leaf's 1
    served.check()  # the host copies' window bytes are exact
    b.evict(10**6)  # device nodes go host-only: the prefix is served from the fetched pages
    assert b.match_prefix(toks).host_len == 7 * PS
    assert served(toks) == 7 * PS
    b.close()


def test_invalidate_removes_the_window_entries_too(store):
    root, url = store
    spec = _spec()
    one, two = _tokens(5, 6), _tokens(6, 6)
    a = _cache(spec, url)
    served = ServedKV(a)
    served(one), served(two)
    a.flush()
    assert len(_entries(root)["w0"]) == 4
    out = a.invalidate(one)  # a prefix: its last page and below, with delete
    assert out["l3"] == 1 + 1  # page 5's entry and its window group's
    names = _entries(root)
    left = page_keys(spec, one, None)[4:5] + page_keys(spec, two, None)[4:]
    assert sorted(names["w0"]) == sorted(window_keys(left, 0))
    a.invalidate()  # the namespace: delete_prefix reaches the group entries (same prefix)
    assert _entries(root) == {}
    a.close()


@pytest.mark.parametrize(
    "policy,storage_policy,prefetch_policy,window_host_pages,eviction",
    [
        ("write_through", "write_through", "wait_complete", None, None),
        ("write_back", "write_back", "best_effort", None, "lru"),  # (value: no L3 hit here)
        ("write_through_selective", "write_through_selective", "wait_complete", 6, None),
        ("clean_ahead", "write_through", "best_effort", None, None),
        ("write_through", "write_through", "timeout", None, None),  # (a deadline ~0: cancels)
    ],
)
def test_random_requests_read_back_every_group_exact(
    store, policy, storage_policy, prefetch_policy, window_host_pages, eviction
):
    """Two instances take turns over prompts sharing prefixes, pools far too small, so pages
    and their window pages move L1 -> L2 -> L3 and back: every served page reads back each
    group's bytes exactly, and each tier keeps only what its nodes' ends read (_Served)."""
    _root, url = store
    spec = _spec(window=6)  # a window across a page boundary: 2 pages read
    rng = np.random.default_rng(7)
    heads = [rng.integers(0, 1000, rng.integers(1, 4) * PS) for _ in range(3)]
    # prompts come back whole too: a fetch then ends where a writer's node ended, whose
    # window pages the store holds (a split end's were trimmed before any put)
    prompts = [np.concatenate([h, rng.integers(0, 1000, rng.integers(1, 3) * PS)]) for h in heads]
    prompts += [np.concatenate([h, rng.integers(0, 1000, 2 * PS)]) for h in heads]
    caches = [
        _cache(
            spec,
            url,
            device_pages=10,
            host_pages=10,
            write_policy=policy,
            storage_write_policy=storage_policy,
            prefetch_policy=prefetch_policy,
            prefetch_timeout_s=1e-9,
            window_host_pages=window_host_pages,
            eviction=eviction,
        )
        for _ in range(2)
    ]
    served = [ServedKV(c) for c in caches]
    from_l3 = 0
    for step in range(50):
        i = int(step % 3 == 2)  # instance 1 serves every third request
        toks = prompts[rng.integers(len(prompts))]
        caches[1 - i].flush()  # the other instance's puts are in the store
        h = caches[i].prefetch(toks) if rng.random() < 0.7 else None
        if h is not None and rng.random() < 0.5:
            h.wait()  # the scheduler's other work: best_effort attaches what is done by then
        served[i](toks)
        if rng.random() < 0.1:
            caches[i].flush()
            served[i].check()
    for cache, s in zip(caches, served, strict=True):
        cache.flush()
        s.check()
        from_l3 += cache.stats()["l3_window_prefetch_hit_pages"]
        cache.close()
    assert from_l3 > 0  # the run did serve window pages from L3


def test_window_entries_one_process_misses_are_a_miss_on_every_process(tmp_path):
    """Two processes, each over its own store: process 1's store lacks a window group entry
    of one prompt; that prompt is fetched on neither (the lookup's cut back to the deepest
    end every store serves is agreed), the other served from L3 on both."""
    from multiproc import launch

    out = launch("l3_windows", 2, str(tmp_path), timeout=90)
    assert all(o.result is not None and "error" not in o.result for o in out), out
    for o in out:
        r = o.result
        assert r["cut"] == {"found": None, "cached": 0}, r
        assert r["whole"] == {"found": 8, "cached": 32}, r
        assert (r["window_hits"], r["window_missed"]) == (2, 0), r


def test_storage_attached_at_run_time_puts_and_fetches_the_window_pages(store):
    root, url = store
    spec = _spec()
    a = HiCache(spec, HiCacheConfig(device_pages=64, host_pages=128, write_through_threshold=1))
    a.attach_storage(url)
    toks = _tokens(8, 6)
    served = ServedKV(a)
    served(toks)
    assert a.detach_storage() >= 0  # puts finished first
    assert len(_entries(root)["full"]) == 6 and len(_entries(root)["w0"]) == 2
    served.check()
    a.close()
    b = HiCache(spec, HiCacheConfig(device_pages=64, host_pages=128, load_back_threshold=PS))
    b.attach_storage(url)
    h = b.prefetch(toks)
    assert h is not None and h.wait() == 6
    assert ServedKV(b)(toks) == 6 * PS
    b.close()


def test_a_fetch_cut_short_ends_where_the_store_holds_no_window_pages(store):
    """A prefetch bounded by its staging rows ends inside the writer's node: the store holds
    no window entries for that end (the writer's node kept its own end's), so the fetched
    prefix is cut back, never served with window pages of another end."""
    _root, url = store
    spec = _spec()
    toks = _tokens(9, 6)
    _write(spec, url, toks)
    b = _cache(spec, url + "?staging_pages=4", prefetch_policy="wait_complete")
    h = b.prefetch(toks)
    assert h is not None and h.wait() == 4
    served = ServedKV(b)
    assert served(toks) == 0
    assert b.stats()["l3_window_prefetch_missed_pages"] == 2
    b.close()
