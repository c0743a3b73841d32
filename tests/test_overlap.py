"""The two-ended split (ARCHITECTURE.md, "Load or recompute"): the cost model's decision on
synthetic timings, the cache's execution (the back copied into the request's own pages, the
host chain untouched until the insert), the serial engine's outputs with it on and off."""

import numpy as np
import pytest

from hicache_jax import HiCacheConfig
from hicache_jax.cache.loading.cost_model import CostModel
from tests.helpers import make_cache
from tests.test_request import SPEC, cached_on_host_only, clean, prompt, write

PS = SPEC.page_size
PAGE_BYTES = 1 << 20


def _model(link_page_s: float, page_prefill_s: float = 1.6e-3) -> CostModel:
    """A model whose L2 -> L1 link moves a page in ``link_page_s`` (fitted from 6 samples) and
    whose prefill costs ``page_prefill_s`` a page of tokens."""
    m = CostModel(PAGE_BYTES, 16, prefill_cost=lambda n, c: n * page_prefill_s / 16)
    for k in (1, 2, 4, 8, 16, 32):
        m.observe_transfer("l2_l1", k * PAGE_BYTES, k * link_page_s)
    return m


@pytest.mark.parametrize("ratio,lo,hi", [(1.0, 0.45, 0.55), (3.0, 0.7, 0.8), (1 / 3, 0.2, 0.3)])
def test_the_split_sits_where_front_and_back_finish_together(ratio, lo, hi):
    m = _model(1.6e-3 * ratio)  # a page loads in ``ratio`` times its recompute
    chain = [1024] * 4
    plain = m.plan(chain, 0, 10**6, None)
    assert m.last_split is None  # without overlap: today's decision
    back = m.plan(chain, 0, 10**6, None, overlap=True)
    front = m.last_split
    assert front is not None and front + back == 4096 and front % 16 == 0
    assert lo <= front / 4096 <= hi  # front / rate = back x ratio / rate
    assert m.stats()["cost_splits"] == 1
    assert plain in (0, 4096)


def test_no_split_where_the_cap_leaves_no_back_or_the_chain_is_one_page():
    m = _model(1.6e-3)
    assert m.plan([16], 0, 10**6, None, overlap=True) is not None and m.last_split is None
    m.plan([1024], 0, 10**6, 0, overlap=True)
    assert m.last_split is None
    back = m.plan([1024], 0, 10**6, 256, overlap=True)  # the back within the cap
    assert m.last_split is not None and back <= 256


def test_free_recompute_never_splits():
    m = _model(1.6e-3, page_prefill_s=0.0)
    assert m.plan([1024] * 2, 0, 10**6, None, overlap=True) == 0 and m.last_split is None


def test_the_config_rejects_a_bad_load_overlap():
    with pytest.raises(TypeError, match="load_overlap"):
        HiCacheConfig(device_pages=8, load_policy="cost", load_overlap=1)
    with pytest.raises(ValueError, match="load_overlap"):
        HiCacheConfig(device_pages=8, load_overlap=True)


def _split_cache(**kw):
    # a page weighs 1 MiB to the model; the link moves one in 0.2 ms, its recompute's time
    cache = make_cache(
        SPEC,
        write_policy="write_through",
        load_policy="cost",
        prefill_cost=lambda n, c: n * 5e-5,
        cost_page_bytes=PAGE_BYTES,
        load_overlap=True,
        **kw,
    )
    for k in (1, 2, 4, 8, 16, 32):  # a measured link: no probe
        cache._cost.links["l2_l1"].observe(k * PAGE_BYTES, k * 2e-4)
    return cache


def _host_only(cache):
    """``cache`` and a prompt of 8 pages it holds on host only."""
    toks = prompt(8 * PS)
    cached_on_host_only(cache, toks)
    return cache, toks


def test_the_cache_copies_the_back_into_the_requests_pages_and_inserts_them():
    cache = _split_cache()
    toks = prompt(8 * PS)
    kv = cached_on_host_only(cache, toks)
    with cache.begin(toks) as req:
        assert req.overlap is not None and req.loaded_len == 0 and req.cached_len == 0
        start, end = req.overlap
        assert 0 < start < end == len(toks) == req.num_tokens
        assert cache.tree.match(toks).device_len == 0  # the chain is still host-only
        req.wait_overlap()
        pages = req.device_pages
        got = np.asarray(cache.read_kv(pages[start // PS :])).view(kv.dtype)
        np.testing.assert_array_equal(got, kv[:, :, start // PS :])  # the host copy's bits
        write(cache, pages[: start // PS])  # the front, "recomputed"
        req.finish(toks)
    st = cache.stats()
    assert st["overlap_loads"] == 1 and st["overlap_load_tokens"] == end - start
    assert st["cost_splits"] == 1
    assert not cache._cost._awaiting_load  # the copy's acknowledgement settled its bytes
    assert cache.tree.match(toks).device_len == len(toks)  # the insert gave them device pages
    clean(cache)
    cache.close()


def test_an_abort_with_the_copy_in_flight_frees_everything():
    cache, toks = _host_only(_split_cache())
    with cache.begin(toks) as req:
        assert req.overlap is not None
    assert req.state == "aborted"
    assert cache.tree.match(toks).host_len == len(toks)  # the host chain kept
    clean(cache)
    # the chain is split again, or loaded, by the next request: nothing was lost
    _serve(cache, toks)
    clean(cache)
    cache.close()


def _serve(cache, toks):
    """One request through the handle (a split's copy waited for); the ended handle."""
    with cache.begin(toks) as req:
        req.wait_overlap()
        req.extend(len(toks) - req.num_tokens)
        req.finish(toks)
    return req


def test_without_load_overlap_the_cache_decides_as_before():
    cache, toks = _host_only(
        make_cache(
            SPEC,
            write_policy="write_through",
            load_policy="cost",
            prefill_cost=lambda n, c: n * 5e-5,
            cost_page_bytes=PAGE_BYTES,
        )
    )
    req = _serve(cache, toks)
    assert req.overlap is None and req.loaded_len > 0  # a probe of the unmeasured link
    assert cache.stats()["cost_splits"] == 0
    clean(cache)
    cache.close()


def test_load_back_called_directly_never_splits():
    cache, toks = _host_only(_split_cache())
    lm = cache.load_back(cache.match_prefix(toks))
    st = cache.stats()
    assert lm.host_len + lm.device_len == len(toks)  # loaded or declined, as today
    assert st["cost_splits"] == 0 and st["overlap_loads"] == 0
    clean(cache)
    cache.close()


def test_the_engine_with_the_split_gives_the_outputs_of_never_loading():
    from hicache_jax.cache.hicache import HiCache
    from hicache_jax.engine.engine import Engine
    from hicache_jax.engine.model import DecoderModel
    from tests.test_engine import BUCKETS, CFG, DEVICE_PAGES, MAX_NEW, _prompts

    model = DecoderModel(CFG, seed=3)
    first, second = _prompts()
    outs = {}
    for overlap in (False, True):
        cfg = HiCacheConfig(
            device_pages=DEVICE_PAGES,
            host_pages=4 * DEVICE_PAGES,
            write_policy="write_through",
            load_back_threshold=16,
            load_policy="cost",
            load_overlap=overlap,
            cost_page_bytes=PAGE_BYTES,
            prefill_cost=lambda n, c: n * 5e-5,
            **({} if overlap else dict(max_load_tokens=0)),
        )  # off: never load
        cache = HiCache(model.kv_spec(16), cfg)
        for k in (1, 2, 4, 8, 16, 32):  # the link measured at a page's recompute time
            cache._cost.links["l2_l1"].observe(k * PAGE_BYTES, k * 8e-4)
        engine = Engine(model, cache, mode="hicache", **BUCKETS)
        engine.generate([first], MAX_NEW)
        cache.flush()
        cache.evict(10**6)  # the shared prefix host-only
        outs[overlap] = engine.generate([second], MAX_NEW)[0]
        st = cache.stats()
        assert st["overlap_loads"] == int(overlap) and st["load_backs"] == 0
        rec = outs[overlap].record
        assert rec.recomputed_tokens == len(second) - (16 if overlap else 0)
        assert rec.host_hit_tokens == (16 if overlap else 0)
        cache.check_invariants()
        cache.flush()
        assert cache.stats()["device_caller_pages"] == 0
        cache.close()
    np.testing.assert_array_equal(outs[True].tokens, outs[False].tokens)
    np.testing.assert_array_equal(outs[True].first_logits, outs[False].first_logits)


def test_finish_without_the_wait_waits_for_the_copy_first():
    cache, toks = _host_only(_split_cache())
    with cache.begin(toks) as req:
        assert req.overlap is not None and req._overlap_copy is not None
        req.finish(toks)  # no wait_overlap(): finish waits before the insert
    assert cache.tree.match(toks).device_len == len(toks)
    clean(cache)
    cache.close()
