"""BatchedEngine: identical tokens and first-token logits to the serial engine in every mode,
page size and write policy; admission under page pressure (waits, no failure, a stall is
reported); retraction; one load-back for several requests; bounded compiles; bad arguments.
Also HiCache.load_back_many, which the engine's admission uses."""

import numpy as np
import pytest

from helpers import GatedEngine, gate
from hicache_jax import HiCacheConfig, HiCacheError, KVSpec
from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.batch_state import EngineStalledError, PageLedger
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.layers import trace_count
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.weights import ModelConfig
from hicache_jax.engine.workloads import ClosedLoop, multiturn_chat
from hicache_jax.memory.transfer import TransferHandle

CFG = ModelConfig(
    vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48
)
TOL = dict(rtol=1e-5, atol=1e-5)
POLICIES = ["clean_ahead", "write_through", "write_through_selective", "write_back"]
# Pools small enough that the chat below evicts to L2 and waits for pages.
POOLS = {16: (8, 64), 1: (96, 1024)}  # page size -> (device pages, host pages)
# Bucket floors that keep this file to a few shapes per pool: batch 4, prefill 64 tokens,
# page tables of 128 tokens.
BUCKETS = {
    16: dict(batch_bucket=4, query_block=32, table_bucket=8),
    1: dict(batch_bucket=4, query_block=32, table_bucket=128),
}


@pytest.fixture(scope="module")
def model():
    return DecoderModel(CFG, seed=3)


def _cache(model, page_size, mode, policy="write_through", device=None, host=None):
    dev, hst = POOLS[page_size]
    cfg = HiCacheConfig(
        device_pages=device or dev,
        host_pages=(host or hst) if mode == "hicache" else 0,
        write_policy=policy,
        write_through_threshold=1,
        load_back_threshold=1,
    )
    return HiCache(model.kv_spec(page_size), cfg)


def _batched(model, page_size, mode="hicache", policy="write_through", **kw):
    cache = _cache(model, page_size, mode, policy, kw.pop("device", None), kw.pop("host", None))
    kw = {"token_budget": 64, **BUCKETS[page_size], **kw}
    return BatchedEngine(model, cache, mode=mode, **kw)


def _chat():
    return multiturn_chat(
        num_clients=4,
        num_turns=2,
        system_tokens=40,
        question_tokens=10,
        max_new_tokens=4,
        vocab_size=CFG.vocab_size,
        seed=1,
    )


def _serial_reference(model, workload):
    """Serial engine, no cache: the reference outputs keyed (session, turn)."""
    eng = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    )
    gens, order = (
        {},
        iter([(i, t) for t in range(workload.num_rounds) for i in range(len(workload.sessions))]),
    )

    def serve(prompts):
        out = []
        for p in prompts:
            g = eng.generate([p], workload.max_new_tokens)[0]
            gens[next(order)] = g
            out.append(g.tokens)
        return out

    workload.run(serve)
    return gens


@pytest.fixture(scope="module")
def chat_ref(model):
    return _serial_reference(model, _chat())


def _same(gens, ref):
    assert sorted(gens) == sorted(ref)
    for k in ref:
        np.testing.assert_array_equal(gens[k].tokens, ref[k].tokens)
        np.testing.assert_allclose(gens[k].first_logits, ref[k].first_logits, **TOL)


def _drained(engine):
    engine.cache.flush()
    s = engine.cache.stats()
    assert s["device_caller_pages"] == 0 and s["device_protected_pages"] == 0
    assert s["device_free_pages"] + s["device_cached_tokens"] // engine.ps == s["device_pages"]
    assert not engine.busy


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("page_size", [1, 16])
def test_matches_serial_every_policy(model, chat_ref, page_size, policy):
    eng = _batched(model, page_size, policy=policy)
    gens = {g.record.key: g for g in eng.serve(ClosedLoop(_chat()))}
    _same(gens, chat_ref)
    st = eng.cache.stats()
    assert sum(g.record.device_hit_tokens for g in gens.values()) > 0
    if policy == "write_through":  # backed up at insert; the pool is small: L2 serves later turns
        assert st["load_backs"] > 0
        # 4 clients need more pages than the pool has: some wait for others to finish
        assert max(g.record.queue_s for g in gens.values()) > 0
    assert eng.counters["prefill_batches"] < len(gens)  # requests were batched
    assert eng.counters["admission_plan_misses"] == 0  # admission's count was never short
    _drained(eng)


@pytest.mark.parametrize("page_size", [1, 16])
def test_clean_ahead_admission_pass_keeps_copies_off_the_allocation_path(
    model, chat_ref, page_size
):
    """The engine announces its allocations (cache.prepare) before admitting and before decode
    pages: under clean_ahead what they evict is backed up ahead, none on the eviction path;
    the outputs are the serial engine's."""
    eng = _batched(model, page_size, policy="clean_ahead")
    gens = {g.record.key: g for g in eng.serve(ClosedLoop(_chat()))}
    _same(gens, chat_ref)
    st = eng.cache.stats()
    assert st["evicted_tokens"] > 0 and st["admission_clean_pages"] > 0
    assert st["eviction_backup_pages"] == 0
    _drained(eng)


def test_admission_waits_for_transfers_only_when_nothing_runs(model, chat_ref, monkeypatch):
    """A request that does not fit while others run waits a step; it does not wait for the
    copies in flight (behind the forward in flight: the host would stall on it)."""
    cfg = HiCacheConfig(
        device_pages=POOLS[16][0],
        host_pages=POOLS[16][1],
        write_through_threshold=1,
        load_back_threshold=1,
    )
    cache = HiCache(model.kv_spec(16), cfg, transfer_engine=GatedEngine)
    gate(cache)  # copies stay in flight until something waits for them
    eng = BatchedEngine(model, cache, token_budget=64, **BUCKETS[16])
    active_at_flush = []
    real = eng.cache.flush
    monkeypatch.setattr(
        eng.cache,
        "flush",
        lambda: active_at_flush.append(bool(eng.prefilling or eng.running)) or real(),
    )
    gens = {g.record.key: g for g in eng.serve(ClosedLoop(_chat()))}
    _same(gens, chat_ref)
    assert max(g.record.queue_s for g in gens.values()) > 0  # some waited for pages
    assert eng.cache.stats()["load_backs"] > 0 and not any(active_at_flush)
    _drained(eng)


@pytest.mark.parametrize("overlap", [True, False])
def test_layerwise_load_backs_only_without_overlap(model, chat_ref, overlap, monkeypatch):
    """Without overlap a step waits for its load layer by layer; with it, the step is dispatched
    at once (XLA orders it after the load): a host wait would stall on the step in flight."""
    eng = _batched(model, 16, layerwise=True, overlap=overlap)
    asked, waited = [], []
    real_load, real_wait = eng.cache.load_back_many, TransferHandle.wait_layer
    monkeypatch.setattr(
        eng.cache,
        "load_back_many",
        lambda ms, layerwise: asked.append(layerwise) or real_load(ms, layerwise=layerwise),
    )
    monkeypatch.setattr(
        TransferHandle,
        "wait_layer",
        lambda self, layer: waited.append(layer) or real_wait(self, layer),
    )
    gens = {g.record.key: g for g in eng.serve(ClosedLoop(_chat()))}
    _same(gens, chat_ref)
    assert eng.cache.stats()["load_backs"] > 0 and set(asked) == {not overlap}
    assert bool(waited) == (not overlap)
    _drained(eng)


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("mode", ["none", "device"])
def test_matches_serial_other_modes(model, chat_ref, mode, overlap):
    eng = _batched(model, 16, mode=mode, layerwise=False, overlap=overlap)
    gens = {g.record.key: g for g in eng.serve(ClosedLoop(_chat()))}
    _same(gens, chat_ref)
    if mode == "none":
        assert all(g.record.recomputed_tokens == g.record.prompt_tokens for g in gens.values())
    _drained(eng)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_when_decode_runs_out_of_pages(model, overlap):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, CFG.vocab_size, 24).astype(np.int32) for _ in range(4)]
    ref = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    ).generate(prompts, 12)
    # 4 prompts x 2 pages fill the 8 pages when admitted greedily (decode_reserve 0); their
    # 3rd pages (positions 32..34) cannot all be had in decode.
    eng = _batched(model, 16, mode="device", decode_reserve=0.0, overlap=overlap)
    gens = eng.generate(prompts, 12)
    assert eng.counters["retractions"] > 0
    assert sum(g.record.retractions for g in gens) == eng.counters["retractions"]
    for g, r in zip(gens, ref):
        np.testing.assert_array_equal(g.tokens, r.tokens)
        np.testing.assert_allclose(g.first_logits, r.first_logits, **TOL)
    _drained(eng)


def test_overlap_reads_a_step_s_tokens_after_dispatching_the_next():
    """overlap: each step is dispatched before the previous step's tokens are read (decode
    tokens go from step to step on the device), so a request comes back, and gives its pages
    back, one step() call after its last forward; without overlap, in the same call. Tokens
    and first-token logits are the serial engine's either way."""
    model = DecoderModel(CFG, seed=3)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(1, CFG.vocab_size, n).astype(np.int32) for n in (20, 9)]
    ref = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    ).generate(prompts, 3)
    calls = {}
    for overlap in (True, False):
        eng = _batched(model, 16, mode="device", overlap=overlap)
        for i, p in enumerate(prompts):
            eng.submit(p, 3, key=i)
        done, n = {}, 0
        while eng.busy:
            n += 1
            done.update({g.record.key: g for g in eng.step()})
            if overlap and n == 1:  # the prefill is dispatched, its tokens not read yet
                assert not done and all(not r.out and r.pending == 1 for r in eng.running)
        for i, r in enumerate(ref):
            np.testing.assert_array_equal(done[i].tokens, r.tokens)
            np.testing.assert_allclose(done[i].first_logits, r.first_logits, **TOL)
        calls[overlap] = n
        assert eng.counters["forward_calls"] == 3  # the prefill, then two decode steps
        _drained(eng)
    assert calls == {True: 4, False: 3}


@pytest.mark.parametrize("mode", ["none", "device", "hicache"])
def test_overlap_under_page_pressure_with_retractions_matches_serial(model, mode):
    """Overlap with a pool too small for its requests (greedy admission: decode runs out of
    pages, requests are retracted and re-admitted) and requests of 1 to 9 new tokens: every
    request's tokens and first-token logits are the serial engine's, and nothing is held after."""
    rng = np.random.default_rng(21)
    reqs = [
        (rng.integers(1, CFG.vocab_size, int(n)).astype(np.int32), int(k))
        for n, k in zip(rng.integers(5, 40, 9), rng.integers(1, 10, 9))
    ]
    serial = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    )
    eng = _batched(model, 16, mode=mode, decode_reserve=0.0, overlap=True)
    for i, (p, k) in enumerate(reqs):
        eng.submit(p, k, key=i)
    done = {}
    while eng.busy:
        done.update({g.record.key: g for g in eng.step()})
    assert sorted(done) == list(range(len(reqs))) and eng.counters["retractions"] > 0
    for i, (p, k) in enumerate(reqs):
        want = serial.generate([p], k)[0]
        np.testing.assert_array_equal(done[i].tokens, want.tokens)
        np.testing.assert_allclose(done[i].first_logits, want.first_logits, **TOL)
    assert eng.slots.free == eng.slots.n
    _drained(eng)


@pytest.mark.parametrize("mode", ["none", "device", "hicache"])
def test_a_refused_head_is_tried_again_only_once_it_could_fit(model, chat_ref, mode, monkeypatch):
    """Under page pressure the oldest waiting request, refused while others run, is not
    matched and counted again until the engine's pages change (PageLedger.refused_again): the
    schedule is the one of an engine that tries it every step (clock: the step count), and
    the tokens are the serial engine's."""

    def run(skip):
        if not skip:
            monkeypatch.setattr(PageLedger, "refused_again", lambda self, req, reserve: False)
        eng = []
        eng.append(_batched(model, 16, mode=mode, clock=lambda: float(eng[0].counters["steps"])))
        gens = {g.record.key: g for g in eng[0].serve(ClosedLoop(_chat()))}
        monkeypatch.undo()
        _same(gens, chat_ref)
        _drained(eng[0])
        recs = {k: g.record for k, g in gens.items()}
        return eng[0].counters, recs

    skipping, tried = run(True), run(False)
    assert skipping[0].pop("admission_skips") > 0 and "admission_skips" not in tried[0]
    assert skipping == tried


def test_all_locked_is_reported_not_spun(model):
    eng = _batched(model, 16, mode="device")
    held = eng.cache.alloc_pages(6)  # owned outside the engine
    eng.submit(np.arange(1, 41, dtype=np.int32), 4, key="a")
    pages = (
        "device_free_pages",
        "device_caller_pages",
        "device_protected_pages",
        "device_cached_tokens",
    )
    before = {k: eng.cache.stats()[k] for k in pages}
    with pytest.raises(EngineStalledError, match=r"nothing is running.*6 owned by callers"):
        eng.step()
    assert {k: eng.cache.stats()[k] for k in pages} == before and len(eng.waiting) == 1
    eng.cache.free_pages(held)
    while eng.busy:
        eng.step()
    assert [r.key for r in eng.records] == ["a"]
    _drained(eng)


def test_one_load_back_for_the_requests_admitted_together(model):
    rng = np.random.default_rng(7)
    prefixes = [rng.integers(1, CFG.vocab_size, 16).astype(np.int32) for _ in range(3)]
    eng = _batched(model, 16, policy="write_through")
    eng.generate(prefixes, 1)
    eng.cache.flush()
    eng.cache.evict(8 * 16)
    eng.cache.flush()
    assert eng.cache.stats()["device_cached_tokens"] == 0
    loads = eng.cache.stats()["load_backs"]
    prompts = [
        np.concatenate([p, rng.integers(1, CFG.vocab_size, 5).astype(np.int32)]) for p in prefixes
    ]
    for i, p in enumerate(prompts):
        eng.submit(p, 3, key=i)
    eng.step()  # admits all three: one load_back_many, one prefill batch
    assert eng.counters["load_back_calls"] == 1
    assert eng.cache.stats()["load_backs"] - loads == 3
    while eng.busy:
        eng.step()
    recs = sorted(eng.records[-3:], key=lambda r: r.key)
    assert [r.host_hit_tokens for r in recs] == [16, 16, 16]
    _drained(eng)


def test_a_waiting_request_is_not_loaded_back_while_it_waits(model):
    rng = np.random.default_rng(11)
    prefix = rng.integers(1, CFG.vocab_size, 32).astype(np.int32)
    eng = _batched(model, 16, policy="write_through")
    eng.generate([prefix], 1)
    eng.cache.flush()
    eng.cache.evict(8 * 16)
    eng.cache.flush()
    assert eng.cache.stats()["device_cached_tokens"] == 0  # the prefix is on host only
    # 60 + 40 tokens: 4 pages now, 7 at the end, the other 3 kept in reserve (decode_reserve 1)
    eng.submit(rng.integers(1, CFG.vocab_size, 60).astype(np.int32), 40, key="long")
    eng.step()
    assert [r.key for r in eng.running] == ["long"]
    # 3 pages (2 of them loaded back): never fits beside the long one's reserve
    eng.submit(
        np.concatenate([prefix, rng.integers(1, CFG.vocab_size, 5).astype(np.int32)]), 3, key="w"
    )
    moved = ("bytes_to_device", "load_backs", "load_back_tokens")
    before = {k: eng.cache.stats()[k] for k in moved}
    calls = eng.counters["load_back_calls"]
    waited = 0
    while eng.running:
        eng.step()
        w = eng.waiting[0]
        assert [r.key for r in eng.waiting] == ["w"] and w.req is None and w.pages.size == 0
        assert {k: eng.cache.stats()[k] for k in moved} == before
        assert eng.counters["load_back_calls"] == calls
        waited += 1
    assert waited > 30
    while eng.busy:
        eng.step()
    rec = {r.key: r for r in eng.records}
    assert rec["w"].host_hit_tokens == 32 and eng.counters["load_back_calls"] == calls + 1
    _drained(eng)


def test_a_host_prefix_two_admissions_share_is_counted_once(model):
    rng = np.random.default_rng(14)
    prefix = rng.integers(1, CFG.vocab_size, 32).astype(np.int32)
    prompts = [
        np.concatenate([prefix, rng.integers(1, CFG.vocab_size, 5).astype(np.int32)])
        for _ in range(2)
    ]
    ref = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    ).generate(prompts, 3)
    eng = _batched(model, 16, policy="write_through")
    eng.generate([prefix], 1)
    eng.cache.flush()
    eng.cache.evict(8 * 16)
    eng.cache.flush()
    held = eng.cache.alloc_pages(4)  # 4 pages left: 3 + 3, less the 2 loaded back once
    for i, p in enumerate(prompts):
        eng.submit(p, 3, key=i)
    loaded = eng.cache.stats()["load_back_tokens"]
    eng.step()
    assert sorted(r.key for r in eng.prefilling + eng.running) == [0, 1]
    assert eng.cache.stats()["load_back_tokens"] - loaded == 32
    gens = {}
    while eng.busy:
        gens.update((g.record.key, g) for g in eng.step())
    for i, r in enumerate(ref):
        np.testing.assert_array_equal(gens[i].tokens, r.tokens)
    assert eng.counters["admission_plan_misses"] == 0
    eng.cache.free_pages(held)
    _drained(eng)


def test_the_head_is_admitted_when_only_it_fits(model):
    rng = np.random.default_rng(12)
    prefix = rng.integers(1, CFG.vocab_size, 64).astype(np.int32)
    head = np.concatenate([prefix, rng.integers(1, CFG.vocab_size, 10).astype(np.int32)])
    other = rng.integers(1, CFG.vocab_size, 60).astype(np.int32)
    ref = Engine(
        model,
        _cache(model, 16, "none", device=64),
        mode="none",
        chunk_size=64,
        prefill_bucket=64,
        table_bucket=32,
    ).generate([head, other], 2)
    eng = _batched(model, 16, mode="device")
    eng.generate([prefix], 1)  # its 4 pages in the tree ...
    held = eng.cache.match_prefix(prefix)
    eng.cache.lock(held.node)  # ... locked outside the engine: 4 pages left free
    eng.submit(head, 2, key="head")  # 5 pages: 4 matched (locked already) + 1 new
    eng.submit(other, 2, key="other")  # 4 new pages: not beside the head's
    eng.step()
    assert [r.key for r in eng.prefilling + eng.running] == ["head"]
    assert [r.key for r in eng.waiting] == ["other"] and eng.waiting[0].pages.size == 0
    gens = {}
    while eng.busy:
        gens.update((g.record.key, g) for g in eng.step())
    for key, r in zip(["head", "other"], ref):
        np.testing.assert_array_equal(gens[key].tokens, r.tokens)
        np.testing.assert_allclose(gens[key].first_logits, r.first_logits, **TOL)
    assert gens["head"].record.device_hit_tokens == 64
    eng.cache.unlock(held.node)
    _drained(eng)


def test_the_head_may_take_every_free_and_evictable_page(model):
    rng = np.random.default_rng(13)
    eng = _batched(model, 16, mode="hicache", policy="write_back")
    eng.generate([rng.integers(1, CFG.vocab_size, 64).astype(np.int32)], 1)
    st = eng.cache.stats()
    assert (st["device_free_pages"], st["device_evictable_pages"]) == (4, 4)
    big = rng.integers(1, CFG.vocab_size, 120).astype(np.int32)  # + 8 new: all 8 pages
    eng.submit(big, 8, key="big")
    eng.submit(rng.integers(1, CFG.vocab_size, 20).astype(np.int32), 2, key="small")
    eng.step()
    assert [r.key for r in eng.prefilling] == ["big"] and [r.key for r in eng.waiting] == ["small"]
    while eng.busy:
        eng.step()
    assert [r.key for r in eng.records] == [0, "big", "small"]
    _drained(eng)


def test_compiles_bounded_by_buckets(model):
    eng = _batched(
        model, 16, mode="none", token_budget=64, query_block=16, table_bucket=1, batch_bucket=1
    )
    rng = np.random.default_rng(0)
    rounds = [
        [rng.integers(1, CFG.vocab_size, 3 + 9 * i).astype(np.int32) for i in range(n)]
        for n in range(1, 6)
    ]  # growing batches of growing prompts (3 .. 39 tokens)
    before = trace_count("batch_step")
    for prompts in rounds:
        eng.generate(prompts, 2)
    traced = trace_count("batch_step") - before
    calls = eng.counters["forward_calls"]
    # Rows <= 5 requests x 3 blocks of 16 (buckets 1 2 3 4 6 8 12 16), tokens 16 or 1, pages
    # <= 3 (1 2 3): a bounded set of shapes, fewer than the calls made ...
    assert 0 < traced <= 8 * 2 * 3 and traced < calls
    # ... and the same requests again compile nothing.
    again = trace_count("batch_step")
    for prompts in rounds:
        eng.generate(prompts, 2)
    assert trace_count("batch_step") == again


def test_without_compile_mixed_a_new_mixed_shape_runs_as_two_known_steps():
    """compile_mixed=False (steady serving after a warm-up): a prefill + decode step whose
    mixed shape has no executable runs as a prefill-only and a decode-only step, compiling
    nothing new when those ran before; a mixed shape compiled while warming up is used. The
    tokens are the serial engine's either way."""
    cfg = ModelConfig(
        vocab_size=89, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=24
    )  # its own config: no shape of it ran before
    model = DecoderModel(cfg, seed=5)
    serial = Engine.create(model, "none", page_size=16, device_pages=32)
    rng = np.random.default_rng(9)
    traced, calls = [], []
    for compile_mixed in (False, False, True, False):
        eng = BatchedEngine.create(
            model,
            "none",
            page_size=16,
            device_pages=32,
            token_budget=32,
            query_block=32,
            compile_mixed=compile_mixed,
        )
        prompts = {k: rng.integers(1, cfg.vocab_size, 20).astype(np.int32) for k in "ab"}
        eng.submit(prompts["a"], 8, key="a")
        gens = eng.step() + eng.step()  # a's prefill, a's first decode (compiled the 1st time)
        eng.submit(prompts["b"], 8, key="b")
        before, c0 = trace_count("batch_step"), eng.counters["forward_calls"]
        gens += eng.step()  # b's prefill beside a's decode: the mixed shape
        traced.append(trace_count("batch_step") - before)
        calls.append(eng.counters["forward_calls"] - c0)
        while eng.busy:
            gens += eng.step()
        for g in gens:
            want = serial.generate([prompts[g.record.key]], 8)[0]
            np.testing.assert_array_equal(g.tokens, want.tokens)
        assert eng.cache.stats()["device_free_pages"] == 32
    # off: two known steps, nothing compiled (twice); on: the mixed shape is compiled, one
    # step; off again: the compiled mixed shape is used.
    assert calls == [2, 2, 1, 1] and traced == [0, 0, 1, 0]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"token_budget": 48}, ValueError, "token_budget=48 must be a power of two"),
        ({"key_block": 24}, ValueError, "key_block=24 must be a power of two"),
        ({"max_running": 0}, ValueError, "max_running=0 must be an int >= 1"),
        ({"decode_reserve": 1.5}, ValueError, r"decode_reserve=1.5 must be a number in \[0, 1\]"),
        ({"layerwise": "yes"}, TypeError, "layerwise"),
        ({"compile_mixed": 1}, TypeError, "compile_mixed"),
        ({"overlap": "no"}, TypeError, "overlap"),
        ({"mode": "l3"}, ValueError, "mode='l3' is not one of"),
        ({"clock": 3}, TypeError, "clock must be callable"),
    ],
)
def test_bad_engine_arguments(model, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        _batched(model, 16, **kwargs)


def test_bad_requests_change_nothing(model):
    eng = _batched(model, 16)
    for prompt, new, exc, match in [
        (np.zeros((2, 2), np.int32), 2, ValueError, "non-empty 1-D"),
        (np.array([1.5]), 2, TypeError, "integer token ids"),
        (np.array([1, 500]), 2, ValueError, r"outside \[0, 97\)"),
        (np.array([1, 2]), 0, ValueError, "max_new_tokens=0"),
        (np.ones(200, np.int32), 2, ValueError, "needs 13 device pages; the pool has 8"),
    ]:
        with pytest.raises(exc, match=match):
            eng.submit(prompt, new)
    assert not eng.busy
    with pytest.raises(TypeError, match="model must be a DecoderModel"):
        BatchedEngine("model", eng.cache)
    other = HiCache(
        KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=16),
        HiCacheConfig(device_pages=8, host_pages=0),
    )
    with pytest.raises(ValueError, match="does not hold this model's K/V"):
        BatchedEngine(model, other)


# -- HiCache.load_back_many ------------------------------------------------------------------

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)


def _filled(device=16, host=64, threshold=4, prompts=2):
    cache = HiCache(
        SPEC,
        HiCacheConfig(
            device_pages=device,
            host_pages=host,
            write_policy="write_through",
            load_back_threshold=threshold,
        ),
    )
    rng = np.random.default_rng(0)
    toks, kv = [], []
    for i in range(prompts):
        t = np.arange(1, 17) + 100 * i
        data = rng.standard_normal(SPEC.kv_shape(4)).astype(np.float32)
        with cache.begin(t) as req:  # a request that computes the whole prompt
            cache.write_kv(req.extend(len(t)), data)
            req.finish(t)
        toks.append(t)
        kv.append(data)
    cache.flush()
    cache.evict(device * 4)
    cache.flush()
    assert cache.stats()["device_cached_tokens"] == 0
    return cache, toks, kv


def test_load_back_many_one_transfer_duplicates_and_overlaps():
    cache, (a, b), (kva, kvb) = _filled()
    ms = [
        cache.match_prefix(a),
        cache.match_prefix(b),
        cache.match_prefix(a[:8]),
        cache.match_prefix(a),
    ]
    out = cache.load_back_many(ms, layerwise=True)
    assert [(m.device_len, m.host_len) for m in out] == [(16, 0), (16, 0), (8, 0), (16, 0)]
    handles = {id(m.load_handle) for m in out}
    assert len(handles) == 1 and out[0].load_handle is not None  # one copy for all
    st = cache.stats()
    assert st["load_backs"] == 2 and st["load_back_tokens"] == 32  # a's prefix loaded once
    assert st["device_free_pages"] == 16 - 8
    np.testing.assert_array_equal(out[2].device_pages, out[0].device_pages[:2])
    np.testing.assert_array_equal(cache.read_kv(out[0].device_pages), kva)
    np.testing.assert_array_equal(cache.read_kv(out[1].device_pages), kvb)
    for m in out:
        cache.lock(m.node)
        cache.unlock(m.node)


def test_load_back_many_declines_like_load_back():
    cache, (a, b), _ = _filled(device=6, threshold=12)
    ms = [cache.match_prefix(a[:8]), cache.match_prefix(a), cache.match_prefix(b)]
    out = cache.load_back_many(ms)
    # a[:8] is below the threshold (declined, as load_back would); a fits; b finds no pages
    # (6 device pages, a's 4 locked in flight leave 2): declined, revalidated.
    assert [(m.device_len, m.host_len) for m in out] == [(8, 0), (16, 0), (0, 16)]
    assert cache.stats()["load_backs_declined"] == 2
    assert cache.stats()["load_backs"] == 1
    cache.flush()
    cache.lock(out[2].node)  # a declined match is current: lockable
    cache.unlock(out[2].node)


def test_load_back_many_bad_input_changes_nothing():
    cache, (a, _), _ = _filled()
    m = cache.match_prefix(a)
    other, (x, _), _ = _filled()
    foreign = other.match_prefix(x)
    before = cache.stats()
    for arg, exc, match in [
        (m, TypeError, "list or tuple of Match"),
        ([m, "m"], TypeError, r"matches\[1\] must be a Match"),
        ([m, foreign], HiCacheError, r"matches\[1\].*not in this cache"),
    ]:
        with pytest.raises(exc, match=match):
            cache.load_back_many(arg)
    with pytest.raises(TypeError, match="layerwise"):
        cache.load_back_many([m], layerwise=1)
    assert cache.stats() == before
    assert cache.load_back_many([]) == []


def test_batched_engine_reports_prefill_samples_without_compiles(model):
    """One request's prefill-only forwards are prefill samples for the cost model; the first
    forward of a shape (its jit compile) and mixed forwards are not."""
    eng = _batched(model, 16, mode="none", max_running=1)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, CFG.vocab_size, 40).astype(np.int32) for _ in range(5)]
    eng.generate(prompts, 1)
    s = eng.cache.stats()
    assert s["cost_prefill_samples"] == 4  # the first prefill of the shape compiled: skipped
    assert s["cost_prefill_coef"] is not None
    eng2 = _batched(model, 16, mode="none", max_running=4)
    eng2.generate(prompts[:2], 3)  # prefilled together, then decode rows: no sample
    assert eng2.cache.stats()["cost_prefill_samples"] == 0
