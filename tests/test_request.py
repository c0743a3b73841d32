"""The request handle (hicache_jax/cache/request.py): the walk through the cache, its error paths
(each leaves no page or lock behind and the invariants intact), and batched admission."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec, make_cache, random_bits
from hicache_jax import HiCacheError, OutOfPagesError
from hicache_jax.cache.ownership import PageOwner

SPEC = bookkeeping_spec(page_size=4)
PS = SPEC.page_size


def clean(cache) -> None:
    """Invariants hold, and no page is the caller's and nothing is locked (once the copies in
    flight, whose nodes stay locked until they land, have landed)."""
    cache.check_invariants()
    cache.flush()
    st = cache.stats()
    assert st["device_caller_pages"] == 0
    assert st["device_protected_pages"] == 0
    assert not (cache.page_owners() == PageOwner.CALLER).any()


def prompt(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def cached_on_host_only(cache, toks):
    """Serve ``toks`` (whole pages) through a handle, then evict it from device: a host-only
    prefix (write_through backed it up). Returns the KV bits written for it."""
    with cache.begin(toks) as req:
        kv = write(cache, req.extend(len(toks)))
        req.finish(toks)
    cache.flush()
    cache.evict(10**6)
    return kv


def write(cache, pages) -> np.ndarray:
    kv = random_bits(SPEC, len(pages), seed=int(pages.sum()) if len(pages) else 0)
    cache.write_kv(pages, kv)
    return kv


def test_a_request_caches_its_whole_pages_and_frees_the_partial_one():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(10)
    with cache.begin(toks) as req:
        assert req.cached_len == 0 and req.num_tokens == 0
        new = req.extend(len(toks))
        assert new.size == 3 and req.num_tokens == 10  # 10 tokens: 2 whole pages + 1 partial
        write(cache, new)
        req.extend(1)  # room in the partial page: no new page
        assert req.device_pages.size == 3
        assert req.finish(np.append(toks, 99)) == 0
        assert req.state == "finished"
    m = cache.match_prefix(np.append(toks, 99))
    assert m.device_len == 8
    clean(cache)


def test_the_second_request_hits_and_reads_the_first_requests_bytes():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(12)
    with cache.begin(toks) as req:
        kv = write(cache, req.extend(12))
        req.finish(toks)
    with cache.begin(np.append(toks, [7, 7, 7, 7])) as req:
        assert req.cached_len == 12 and req.host_len_declined == 0
        np.testing.assert_array_equal(
            np.asarray(cache.read_kv(req.device_pages)).view(kv.dtype), kv
        )
        req.extend(4)
        req.finish(np.append(toks, [7, 7, 7, 7]))
    clean(cache)


def test_a_host_hit_is_loaded_back_at_begin():
    cache = make_cache(SPEC, device_pages=8, host_pages=32, write_policy="write_through")
    toks = prompt(16)
    kv = cached_on_host_only(cache, toks)
    assert cache.match_prefix(toks).host_len == 16
    with cache.begin(toks) as req:
        assert req.cached_len == 16 and req.loaded_len == 16
        got = np.asarray(cache.read_kv(req.device_pages)).view(kv.dtype)
        np.testing.assert_array_equal(got, kv)
        req.finish(toks)
    clean(cache)


def test_commit_makes_the_prompt_shareable_while_the_request_decodes():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(8)
    a = cache.begin(toks)
    write(cache, a.extend(8))
    assert a.commit(toks) == 8
    assert cache.match_prefix(toks).device_len == 8  # another request hits it now
    with cache.begin(toks) as b:
        assert b.cached_len == 8
        np.testing.assert_array_equal(b.device_pages, a.device_pages)
        b.finish(toks)
    a.extend(3)
    a.finish(np.append(toks, [1, 2, 3]))
    clean(cache)


def test_commit_of_a_page_another_request_inserted_first_takes_the_trees_page():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(8)
    a, b = cache.begin(toks), cache.begin(toks)
    pa, pb = a.extend(8), b.extend(8)
    write(cache, pa), write(cache, pb)
    a.finish(toks)
    b.commit(toks)  # b's duplicates are freed; b now holds the tree's (a's) pages
    np.testing.assert_array_equal(b.device_pages, pa)
    assert cache.stats()["duplicate_pages_freed"] == 2
    b.finish(toks)
    clean(cache)


def test_an_exception_inside_the_block_aborts_and_inserts_nothing():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(8)
    with pytest.raises(RuntimeError, match="model failed"), cache.begin(toks) as req:
        req.extend(8)
        raise RuntimeError("model failed")
    assert req.state == "aborted"
    assert cache.match_prefix(toks).device_len == 0
    assert cache.stats()["device_free_pages"] == 16
    clean(cache)


def test_leaving_the_block_without_finish_aborts_but_keeps_what_was_committed():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(8)
    with cache.begin(toks) as req:
        req.extend(10)
        req.commit(toks)
    assert req.state == "aborted"
    assert cache.match_prefix(toks).device_len == 8
    clean(cache)


def test_out_of_pages_in_extend_leaves_the_request_as_it_was():
    cache = make_cache(SPEC, device_pages=4, host_pages=8)
    other = cache.begin(prompt(8, 100))
    other.extend(8)  # 2 pages owned by another request
    with cache.begin(prompt(16)) as req:
        req.extend(4)
        before = (req.device_pages.copy(), req.num_tokens, cache.stats()["device_free_pages"])
        with pytest.raises(OutOfPagesError):
            req.extend(8)  # needs 2 more: 1 free, nothing evictable
        assert (req.device_pages.tolist(), req.num_tokens, cache.stats()["device_free_pages"]) == (
            before[0].tolist(),
            *before[1:],
        )
        cache.check_invariants()
        req.finish(prompt(4))
    other.abort()
    clean(cache)


def test_finish_after_abort_and_double_finish_raise_and_abort_after_finish_is_a_no_op():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    req = cache.begin(prompt(8))
    req.extend(8)
    req.abort()
    with pytest.raises(HiCacheError, match="aborted"):
        req.finish(prompt(8))
    with pytest.raises(HiCacheError, match="aborted"):
        req.extend(1)
    req.abort()  # again: a no-op
    req2 = cache.begin(prompt(8))
    req2.extend(8)
    req2.finish(prompt(8))
    with pytest.raises(HiCacheError, match="finished"):
        req2.finish(prompt(8))
    with pytest.raises(HiCacheError, match="finished"):
        req2.commit(prompt(8))
    req2.abort()
    assert req2.state == "finished"
    clean(cache)


def test_bad_tokens_at_finish_raise_before_any_change():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    req = cache.begin(prompt(8))
    req.extend(8)
    with pytest.raises(ValueError, match="room for 8"):
        req.finish(prompt(12))
    with pytest.raises((TypeError, ValueError)):
        req.finish(np.full(8, -1))
    with pytest.raises(ValueError, match="n_tokens"):
        req.extend(-1)
    assert req.state == "open" and req.device_pages.size == 2
    req.finish(prompt(8))
    clean(cache)


def test_a_handle_of_a_closed_cache_raises_and_abort_is_a_no_op():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    req = cache.begin(prompt(8))
    req.extend(4)
    cache.close()
    assert cache.closed
    with pytest.raises(HiCacheError):
        req.extend(4)
    with pytest.raises(HiCacheError):
        req.finish(prompt(4))
    req.abort()
    assert req.state == "aborted"


def test_begin_many_admits_oldest_first_within_the_budget_and_loads_nothing_for_the_rest():
    cache = make_cache(SPEC, device_pages=16, host_pages=32, write_policy="write_through")
    shared = prompt(8, 500)
    cached_on_host_only(cache, shared)  # shared prefix: host only now
    prompts = [np.append(shared, prompt(4)), np.append(shared, prompt(8, 50)), prompt(40, 900)]
    reqs = cache.begin_many(prompts, budget=8)  # 3 pages, then 4, then 10: stops at 3rd
    assert [r is not None for r in reqs] == [True, True, False]
    assert reqs[0].loaded_len == 8 and reqs[1].cached_len == 8
    assert cache.stats()["load_backs"] == 1  # the overlap is loaded once
    for r, p in zip(reqs[:2], prompts):
        r.extend(len(p) - r.cached_len)
        r.finish(p)
    clean(cache)


def test_begin_many_checks_every_prompt_before_matching_any():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    with pytest.raises((TypeError, ValueError)):
        cache.begin_many([prompt(8), np.full(4, -5)])
    assert cache.stats()["match_tokens"] == 0
    with pytest.raises(ValueError, match="extra_keys"):
        cache.begin_many([prompt(8)], extra_keys=[None, None])
    clean(cache)


def test_extend_many_takes_one_allocation_and_raises_leaving_every_request_as_it_was():
    from hicache_jax.cache.request import extend_many

    cache = make_cache(SPEC, device_pages=6, host_pages=8)
    a, b = cache.begin(prompt(4, 10)), cache.begin(prompt(4, 20))
    a.extend(4), b.extend(3)
    extend_many(cache, [a, b], [1, 1])  # a needs a new page, b's last page has room
    assert (a.device_pages.size, b.device_pages.size) == (2, 1)
    assert (a.num_tokens, b.num_tokens) == (5, 4)
    before = [(r.device_pages.tolist(), r.num_tokens) for r in (a, b)]
    with pytest.raises(OutOfPagesError):
        extend_many(cache, [a, b], [8, 8])  # 4 more pages: 3 free, nothing evictable
    assert [(r.device_pages.tolist(), r.num_tokens) for r in (a, b)] == before
    with pytest.raises(ValueError, match="token counts"):
        extend_many(cache, [a, b], [1])
    a.finish(prompt(4, 10)), b.finish(prompt(4, 20))
    with pytest.raises(HiCacheError, match="finished"):
        extend_many(cache, [a], [1])
    clean(cache)


def test_tree_len_follows_commit_and_a_chunked_finish_counts_no_hit():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(12)
    with cache.begin(toks) as r:
        r.extend(12)
        r.finish(toks)
    req = cache.begin(np.append(toks, prompt(8, 40)))
    assert req.tree_len == 12 == req.cached_len
    req.extend(8)
    seq = np.append(toks, prompt(8, 40))
    req.commit(seq)
    assert req.tree_len == 20
    hits = {n.id: n.hit_count for n in cache.tree.nodes()}
    req.finish(seq, chunked=True)  # e.g. a retracted request: no hit counted
    assert {n.id: n.hit_count for n in cache.tree.nodes()} == hits
    clean(cache)


def test_admit_matched_wraps_a_schedulers_own_matches_with_one_load_back():
    from hicache_jax.cache.request import admit_matched

    cache = make_cache(SPEC, device_pages=16, host_pages=32, write_policy="write_through")
    shared = prompt(8, 700)
    cached_on_host_only(cache, shared)
    prompts = [np.append(shared, prompt(4)), np.append(shared, prompt(4, 60))]
    matches = [cache.match_prefix(p) for p in prompts]  # the scheduler's own plan admits both
    reqs = admit_matched(cache, matches)
    assert [r.loaded_len for r in reqs] == [8, 8] and [r.cached_len for r in reqs] == [8, 8]
    assert cache.stats()["load_backs"] == 1
    with pytest.raises(ValueError, match="extra_keys"):
        admit_matched(cache, matches, extra_keys=[None])
    reqs[0].abort()
    for r, p in zip(reqs[1:], prompts[1:]):
        r.extend(len(p) - r.cached_len)
        r.finish(p)
    clean(cache)


# -- where a request was served from (Request.served) ------------------------------------------

SERVED_KEYS = {
    "admitted_requests": None,
    "admitted_prompt_tokens": "prompt_tokens",
    "served_device_tokens": "device_tokens",
    "served_host_tokens": "host_tokens",
    "served_l3_tokens": "l3_tokens",
    "recomputed_tokens": "recomputed_tokens",
    "served_load_bytes": "load_bytes",
}


def figures(req) -> tuple:
    s = req.served
    return (s.device_tokens, s.host_tokens, s.l3_tokens, s.recomputed_tokens, s.load_bytes)


def check_sums(cache, served, base=None) -> None:
    """stats()' served counters grew by the sums of the admitted requests' figures (since the
    stats ``base``; None: since the cache was built)."""
    st, base = cache.stats(), base or dict.fromkeys(SERVED_KEYS, 0)
    for key, field in SERVED_KEYS.items():
        want = len(served) if field is None else sum(getattr(s, field) for s in served)
        assert st[key] - base[key] == want, key
    waited = st["served_load_wait_seconds"] - base.get("served_load_wait_seconds", 0.0)
    assert waited == pytest.approx(sum(s.load_wait_s for s in served))


def test_served_from_device_counts_the_l1_hit_and_the_rest_as_recomputed():
    cache = make_cache(SPEC, device_pages=16, host_pages=32)
    toks = prompt(14)  # 3 whole pages and 2 tokens
    with cache.begin(toks) as req:
        assert figures(req) == (0, 0, 0, 14, 0) and req.served.load_wait_s == 0.0
        req.extend(len(toks))
        req.finish(toks)
        first = req.served
    with cache.begin(np.append(toks, [7, 7, 7])) as req:  # 17 tokens: 12 on device
        assert figures(req) == (12, 0, 0, 5, 0)
        assert req.served.prompt_tokens == 17 and req.served.load_wait_s == 0.0
        check_sums(cache, [first, req.served])


def test_served_from_host_counts_the_load_back_its_bytes_and_wait():
    cache = make_cache(SPEC, device_pages=16, host_pages=32, write_policy="write_through")
    toks = prompt(12, 300)
    cached_on_host_only(cache, toks)
    base = cache.stats()["admitted_requests"]
    with cache.begin(np.append(toks, [1, 2])) as req:
        assert figures(req) == (0, 12, 0, 2, 3 * SPEC.page_bytes)
        assert req.served.load_wait_s > 0.0
        assert cache.stats()["admitted_requests"] == base + 1


def test_declined_host_tokens_count_as_recomputed():
    cache = make_cache(
        SPEC, device_pages=16, host_pages=32, write_policy="write_through", load_back_threshold=64
    )
    toks = prompt(12, 500)
    cached_on_host_only(cache, toks)
    with cache.begin(toks) as req:
        assert req.host_len_declined == 12
        assert figures(req) == (0, 0, 0, 12, 0) and req.served.load_wait_s > 0.0


def test_served_from_l3_counts_the_prefetched_pages_once(tmp_path):
    from l3_helpers import compute, make, tokens_kv

    url = f"file://{tmp_path}/store"
    a, b = make(url), make(url, prefetch_policy="wait_complete")
    toks, kv = tokens_kv(3, 6)
    compute(a, toks, kv)
    a.flush()
    assert b.prefetch(toks).pages_found == 6
    served = []
    with b.begin(np.append(toks, 5)) as req:  # 6 pages from L3, 1 token computed
        assert req.served.l3_tokens == 6 * PS
        assert figures(req) == (0, 0, 6 * PS, 1, 6 * b.spec.page_bytes)
        req.finish(toks)
        served.append(req.served)
    b.flush()
    b.evict(10**6)  # back on host only: the host copies are L3's, but a request was served
    with b.begin(toks) as req:
        assert figures(req) == (0, 6 * PS, 0, 0, 6 * b.spec.page_bytes)
        served.append(req.served)
    check_sums(b, served)
    a.close(), b.close()


def test_begin_many_reports_each_request_and_stats_sum_them():
    cache = make_cache(SPEC, device_pages=32, host_pages=64, write_policy="write_through")
    on_host = prompt(8, 900)
    cached_on_host_only(cache, on_host)
    base = cache.stats()
    on_device = prompt(8, 100)
    with cache.begin(on_device) as req:
        req.extend(8)
        req.finish(on_device)
        served = [req.served]
    prompts = [np.append(on_device, [1, 2, 3]), np.append(on_host, prompt(4)), prompt(6, 40)]
    reqs = cache.begin_many(prompts)
    assert [figures(r) for r in reqs] == [
        (8, 0, 0, 3, 0),
        (0, 8, 0, 4, 2 * SPEC.page_bytes),
        (0, 0, 0, 6, 0),
    ]
    assert reqs[1].served.load_wait_s > 0.0  # the step's one load-back
    assert reqs[0].served.load_wait_s == reqs[2].served.load_wait_s == 0.0  # nothing on host
    served += [r.served for r in reqs]
    check_sums(cache, served, base)
    for r in reqs:
        r.abort()
    clean(cache)


def test_admit_matched_takes_prompt_lengths_and_checks_them_first():
    from hicache_jax.cache.request import admit_matched

    cache = make_cache(SPEC, device_pages=16, host_pages=32, write_policy="write_through")
    toks = prompt(8, 700)
    cached_on_host_only(cache, toks)
    m = cache.match_prefix(toks)
    before = cache.stats()
    with pytest.raises(ValueError, match=r"prompt_lens\[0\]=4 is shorter"):
        admit_matched(cache, [m], prompt_lens=[4])
    with pytest.raises(ValueError, match="prompt_lens has 2"):
        admit_matched(cache, [m], prompt_lens=[8, 8])
    assert cache.stats() == before  # nothing loaded, locked or counted
    (req,) = admit_matched(cache, [m], prompt_lens=[11])
    assert figures(req) == (0, 8, 0, 3, 2 * SPEC.page_bytes)
    req.abort()
    clean(cache)
