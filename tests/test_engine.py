"""Engine over HiCache: identical logits and tokens whether the prefix is recomputed, hit in L1 or
loaded back from L2 (both write policies, page sizes 1 and 16, plain and layer-wise load-back,
a cached prefix ending mid-page); records; page accounting; bad input; out of pages."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from hicache_jax import HiCacheConfig, OutOfPagesError
from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.engine import CacheMode, Engine
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.weights import ModelConfig

CFG = ModelConfig(
    vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48
)
DEVICE_PAGES = 64  # one pool shape per page size across the file: compiles are shared
MAX_NEW = 4
TOL = dict(rtol=1e-5, atol=1e-6)
# Same bucket floors in every engine of this file (and the bench CLI's for page 16 and chunk 64,
# see test_cli.py), so every engine reuses the same executables.
BUCKETS = dict(chunk_size=64, prefill_bucket=64, table_bucket=32)


@pytest.fixture(scope="module")
def model():
    return DecoderModel(CFG, seed=3)


def _engine(
    model,
    page_size,
    mode="hicache",
    policy="write_through",
    layerwise=False,
    load_back_threshold=1,
    **kw,
):
    host = 4 * DEVICE_PAGES if mode == "hicache" else 0
    cfg = HiCacheConfig(
        device_pages=DEVICE_PAGES,
        host_pages=host,
        write_policy=policy,
        write_through_threshold=1,
        load_back_threshold=load_back_threshold,
    )
    cache = HiCache(model.kv_spec(page_size), cfg)
    return Engine(model, cache, mode=mode, layerwise=layerwise, **{**BUCKETS, **kw})


def _prompts(seed=0):
    """A first prompt, and a second sharing its first 37 tokens (mid-page for page_size 16)."""
    rng = np.random.default_rng(seed)
    first = rng.integers(1, CFG.vocab_size, 40).astype(np.int32)
    second = np.concatenate([first[:37], rng.integers(1, CFG.vocab_size, 9).astype(np.int32)])
    return first, second


@pytest.fixture(scope="module")
def baseline(model):
    """Outputs of the second prompt computed from scratch (no prefix cache)."""
    _, second = _prompts()
    return _engine(model, 16, mode="none").generate([second], MAX_NEW)[0]


def _same(gen, ref):
    np.testing.assert_array_equal(gen.tokens, ref.tokens)
    np.testing.assert_allclose(gen.first_logits, ref.first_logits, **TOL)


def _no_leaks(engine):
    engine.cache.flush()  # backups in flight hold their nodes locked until acknowledged
    s = engine.cache.stats()
    assert s["device_caller_pages"] == 0
    assert s["device_protected_pages"] == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_l1_hit_matches_recompute(model, baseline, page_size):
    first, second = _prompts()
    eng = _engine(model, page_size)
    eng.generate([first], MAX_NEW)
    gen = eng.generate([second], MAX_NEW)[0]
    _same(gen, baseline)
    hit = 37 // page_size * page_size  # the shared part, whole pages only
    assert gen.record.device_hit_tokens == hit
    assert gen.record.host_hit_tokens == 0
    assert gen.record.recomputed_tokens == len(second) - hit
    _no_leaks(eng)


@pytest.mark.parametrize("layerwise", [False, True], ids=["plain", "layerwise"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_l2_load_back_matches_recompute(model, baseline, page_size, policy, layerwise):
    first, second = _prompts()
    eng = _engine(model, page_size, policy=policy, layerwise=layerwise)
    eng.generate([first], MAX_NEW)
    if policy == "write_through":
        eng.generate([first], MAX_NEW)  # the second access backs the prefix up (threshold 1)
    eng.cache.flush()
    eng.cache.evict(DEVICE_PAGES * page_size)  # write_back backs up on eviction
    eng.cache.flush()
    assert eng.cache.stats()["device_cached_tokens"] == 0
    gen = eng.generate([second], MAX_NEW)[0]
    _same(gen, baseline)
    hit = 37 // page_size * page_size
    assert (gen.record.device_hit_tokens, gen.record.host_hit_tokens) == (0, hit)
    assert gen.record.recomputed_tokens == len(second) - hit
    assert eng.cache.stats()["load_backs"] == 1
    # The loaded-back pages now serve a third request from L1, still identically.
    again = eng.generate([second], MAX_NEW)[0]
    _same(again, baseline)
    assert again.record.device_hit_tokens >= hit
    _no_leaks(eng)


def test_declined_load_back_recomputes_identically(model, baseline):
    first, second = _prompts()
    eng = _engine(model, 16, policy="write_back", load_back_threshold=10_000)
    eng.generate([first], MAX_NEW)
    eng.cache.evict(DEVICE_PAGES * 16)
    eng.cache.flush()
    gen = eng.generate([second], MAX_NEW)[0]
    _same(gen, baseline)
    assert (gen.record.host_hit_tokens, gen.record.host_declined_tokens) == (0, 32)
    assert gen.record.recomputed_tokens == len(second)
    _no_leaks(eng)


def test_chunked_prefill_and_device_mode_match(model, baseline):
    _, second = _prompts()
    eng = _engine(model, 16, mode="device", chunk_size=16, prefill_bucket=16)
    assert eng.cache.cfg.host_pages == 0
    _same(eng.generate([second], MAX_NEW)[0], baseline)
    gen = eng.generate([second], MAX_NEW)[0]  # whole prompt cached but its last token
    _same(gen, baseline)
    assert gen.record.device_hit_tokens == 32 and gen.record.recomputed_tokens == len(second) - 32
    _no_leaks(eng)


def test_none_mode_caches_nothing(model, baseline):
    _, second = _prompts()
    eng = _engine(model, 16, mode="none")
    gens = eng.generate([second, second], MAX_NEW)
    for g in gens:
        _same(g, baseline)
        assert g.record.device_hit_tokens == 0 and g.record.recomputed_tokens == len(second)
    s = eng.cache.stats()
    assert s["device_free_pages"] == DEVICE_PAGES and s["device_cached_tokens"] == 0
    assert len(eng.records) == 2 and eng.records[0].ttft_s > 0


def test_generated_pages_are_cached(model):
    # Prompt + output (minus the last token) is inserted: a follow-up hits through the answer.
    first, _ = _prompts()
    eng = _engine(model, 1)
    out = eng.generate([first], MAX_NEW)[0].tokens
    follow = np.concatenate([first, out, np.array([5, 6], np.int32)])
    rec = eng.generate([follow], MAX_NEW)[0].record
    assert rec.device_hit_tokens == len(first) + MAX_NEW - 1


@pytest.mark.parametrize(
    "prompt,exc,match",
    [
        (np.array([1, 2, 97]), ValueError, "outside \\[0, 97\\)"),
        (np.array([], np.int32), ValueError, "non-empty 1-D"),
        (np.ones((2, 3), np.int32), ValueError, "non-empty 1-D"),
        (np.array([1.0, 2.0]), TypeError, "integer token ids"),
    ],
)
def test_bad_prompt_changes_nothing(model, prompt, exc, match):
    first, _ = _prompts()
    eng = _engine(model, 16)
    eng.generate([first], MAX_NEW)
    before, records = eng.cache.stats(), list(eng.records)
    with pytest.raises(exc, match=match):
        eng.generate([first, prompt], MAX_NEW)  # checked before the first prompt is served
    assert eng.cache.stats() == before and eng.records == records


def test_bad_sizes_and_mismatched_model(model):
    eng = _engine(model, 16)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([np.array([1, 2])], 0)
    with pytest.raises(ValueError, match="chunk_size"):
        Engine(model, eng.cache, chunk_size=24)
    with pytest.raises(ValueError, match="mode="):
        Engine(model, eng.cache, mode="l3")
    other = DecoderModel(ModelConfig(**{**CFG.__dict__, "num_kv_heads": 4}))
    with pytest.raises(ValueError, match="does not hold this model"):
        Engine(other, eng.cache)


def test_out_of_pages_releases_everything(model):
    first, _ = _prompts()
    eng = _engine(model, 16, mode="device")
    eng.generate([first[:20]], MAX_NEW)
    long = np.concatenate([first[:20], np.arange(1, 1030, dtype=np.int32) % CFG.vocab_size])
    with pytest.raises(OutOfPagesError):
        eng.generate([long], MAX_NEW)  # 1052 positions need 66 pages of 16: the pool has 64
    _no_leaks(eng)
    eng.generate([first[:20]], MAX_NEW)  # still serves afterwards


def test_create_builds_each_mode(model):
    for mode, host in (("none", 0), ("device", 0), ("hicache", 32)):
        eng = Engine.create(model, mode, page_size=16, device_pages=8, **BUCKETS)
        assert eng.mode is CacheMode(mode) and eng.cache.cfg.host_pages == host


def test_pool_sharded_over_kv_heads_matches(model, baseline):
    # The model's step keeps the pool's NamedSharding (DevicePagePool.run checks it).
    first, second = _prompts()
    mesh = Mesh(np.array(jax.devices()[:2]), ("kv",))
    cache = HiCache(
        model.kv_spec(16),
        HiCacheConfig(
            device_pages=DEVICE_PAGES,
            host_pages=4 * DEVICE_PAGES,
            write_policy="write_back",
            load_back_threshold=1,
            mesh=mesh,
        ),
    )
    eng = Engine(model, cache, **BUCKETS)
    eng.generate([first], MAX_NEW)
    cache.evict(DEVICE_PAGES * 16)
    gen = eng.generate([second], MAX_NEW)[0]
    _same(gen, baseline)
    assert gen.record.host_hit_tokens == 32
    assert eng.pool.array.sharding.spec[4] == "kv"


def test_engine_reports_prefill_samples_without_compiles(model):
    eng = _engine(model, 16, mode="none")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, CFG.vocab_size, 40).astype(np.int32) for _ in range(4)]
    eng.generate(prompts, 1)
    s = eng.cache.stats()
    assert s["cost_prefill_samples"] == 3  # the first prefill of the shape compiled: skipped
