"""A decoder with a layer pattern (sliding-window / chunked local layers beside full ones): its
paged forward (fused and per layer) against the dense reference with the same window mask,
a continuation of a cached prefix whose old window pages the cache dropped, and the serial and
batched engines giving the same tokens with no cache, a device radix cache and HiCache (hits
from L1 and from L2)."""

import itertools

import jax
import numpy as np
import pytest

from hicache_jax import HiCacheConfig
from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.layers import layer_plan, reference_logits
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.weights import ModelConfig
from hicache_jax.engine.workloads import multiturn_chat
from hicache_jax.spec import GroupKind

SIZES = dict(vocab_size=97, num_layers=3, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
WINDOW = ModelConfig(**SIZES, ffn_dim=48, layer_pattern="2:1", window=12)
CHUNK = ModelConfig(**SIZES, ffn_dim=48, layer_pattern="2:1", chunk=16)
TOL = dict(rtol=1e-5, atol=1e-5)
PS = 4
# Bucket floors that keep each engine to a few shapes (prompts here are under 128 tokens).
SERIAL = dict(chunk_size=32, prefill_bucket=32, table_bucket=32)
BATCHED = dict(token_budget=32, max_running=2, table_bucket=32, batch_bucket=4)


@pytest.fixture(scope="module", params=[WINDOW, CHUNK], ids=["window", "chunk"])
def model(request):
    return DecoderModel(request.param, seed=2)


class _Waiter:
    def __init__(self):
        self.calls = []

    def wait_layer(self, layer):
        self.calls.append(layer)


def _cache(model, device=64, host=0, **kw):
    cfg = HiCacheConfig(device_pages=device, host_pages=host, load_back_threshold=1, **kw)
    return HiCache(model.kv_spec(PS), cfg)


def test_config_pattern_and_errors():
    spec = WINDOW.kv_spec(PS)
    assert spec.num_layers == 1 and [g.kind for g in spec.window_groups] == [GroupKind.WINDOW]
    assert layer_plan(WINDOW) == ((0, 0, ("window", 12)), (0, 1, ("window", 12)), (-1, 0, None))
    assert layer_plan(ModelConfig(**SIZES)) == ()
    assert ModelConfig(**SIZES).kv_spec(PS).groups == ()  # no pattern: the plain spec
    for kw, field in (
        (dict(layer_pattern="5:1"), "layer_pattern"),  # no full layer among 3
        (dict(layer_pattern="2:1"), "window"),  # local layers need window= or chunk=
        (dict(window=8), "window"),  # a window without local layers
        (dict(layer_pattern="x"), "layer_pattern"),
    ):
        with pytest.raises(ValueError, match=field):
            ModelConfig(**SIZES, **kw)
    with pytest.raises(TypeError, match="layer_pattern"):
        ModelConfig(**SIZES, layer_pattern=5)  # type: ignore[arg-type]


def test_paged_forward_matches_reference(model):
    """Prompt of 45 tokens (> window, > chunk) in chunks, fused and per layer, then decode
    (buckets of 16 tokens and 16 pages: one shape for every call)."""
    prompt = np.random.default_rng(7).integers(0, 97, 45).astype(np.int32)
    ref = np.asarray(reference_logits(model.cfg, model.params, prompt))
    buckets = dict(min_bucket=16, min_pages=16)
    for layerwise in (False, True):
        cache = _cache(model)
        pages = cache.alloc_pages(-(-len(prompt) // PS))
        windows = dict(windows=cache.window_pools, window_pages=cache.window_pages(pages))
        for a, b in itertools.pairwise([0, 5, 21, 37, 40]):
            waiter = _Waiter() if layerwise else None
            logits = model.forward(
                cache.device_pool, prompt[a:b], a, pages, waiter=waiter, **windows, **buckets
            )
            np.testing.assert_allclose(np.asarray(logits), ref[b - 1], **TOL)
            if waiter is not None:  # full-pool layers; any layer waits the window groups
                assert waiter.calls == [0, 0, 0]
        for pos in range(40, 45):
            logits = model.forward(
                cache.device_pool, prompt[pos : pos + 1], pos, pages, **windows, **buckets
            )
            np.testing.assert_allclose(np.asarray(logits), ref[pos], **TOL)


def test_forward_batch_matches_reference(model):
    """Two requests packed (prefill chunks, then a chunk beside a decode token, per layer)."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 97, n).astype(np.int32) for n in (45, 21)]
    refs = [np.asarray(reference_logits(model.cfg, model.params, p)) for p in prompts]
    cache = _cache(model)
    pages = [cache.alloc_pages(-(-len(p) // PS)) for p in prompts]
    wps = [cache.window_pages(p) for p in pages]
    knobs = dict(windows=cache.window_pools, window_pages=wps, key_block=8, min_pages=4)
    logits, _ = model.forward_batch(
        cache.device_pool, [prompts[0][:30], prompts[1][:20]], [0, 0], pages, **knobs
    )
    np.testing.assert_allclose(np.asarray(logits)[:2], [refs[0][29], refs[1][19]], **TOL)
    waiter = _Waiter()
    logits, _ = model.forward_batch(
        cache.device_pool,
        [prompts[0][30:], prompts[1][20:]],
        [30, 20],
        pages,
        waiter=waiter,
        **knobs,
    )
    np.testing.assert_allclose(np.asarray(logits)[:2], [refs[0][44], refs[1][20]], **TOL)
    assert waiter.calls == [0, 0, 0]


def test_forward_needs_window_pools(model):
    cache = _cache(model)
    pages = cache.alloc_pages(2)
    with pytest.raises(ValueError, match="window_pages"):
        model.forward(cache.device_pool, np.arange(5, dtype=np.int32), 0, pages)


def test_continuation_of_a_prefix_with_dropped_window_pages(model):
    """A long prompt served and cached; a second one continuing it is served from the cache,
    whose window pages before the window are gone (freed at insert: ``window_spare=False``),
    and equals recompute."""
    rng = np.random.default_rng(3)
    p1 = rng.integers(0, 97, 61).astype(np.int32)
    engine = Engine(model, _cache(model, window_spare=False), mode="device", **SERIAL)
    first = engine.generate([p1], 4)[0]
    p2 = np.concatenate([p1, first.tokens, rng.integers(0, 97, 9)]).astype(np.int32)
    cache = engine.cache
    with cache.begin(p2[:-1]) as req:
        cached = req.cached_len
        held = cache.window_pages(req.device_pages[: cached // PS])
    assert cached >= 60 and (held[:, 0] == -1).all()  # dropped: no continuation reads them
    gen = engine.generate([p2], 4)[0]
    assert gen.record.device_hit_tokens == cached
    np.testing.assert_allclose(
        gen.first_logits, np.asarray(reference_logits(model.cfg, model.params, p2))[-1], **TOL
    )
    fresh = Engine(model, _cache(model), mode="none", **SERIAL).generate([p2], 4)[0]
    np.testing.assert_array_equal(gen.tokens, fresh.tokens)


def _chat():
    return multiturn_chat(
        num_clients=4,
        num_turns=2,
        system_tokens=40,
        question_tokens=8,
        max_new_tokens=4,
        vocab_size=97,
        seed=1,
    )


def _play(engine, prefetch: bool = False):
    gens = []

    def serve(prompts):
        if prefetch:  # (the batched engine does not prefetch from L3 itself)
            for p in prompts:
                engine.cache.prefetch(p)
        out = engine.generate(prompts, 4)
        gens.extend(out)
        return [g.tokens for g in out]

    _chat().run(serve)
    return gens


@pytest.mark.parametrize(
    "cfg, kind",
    [(WINDOW, "serial"), (WINDOW, "batched"), (CHUNK, "serial")],
    ids=["window-serial", "window-batched", "chunk-serial"],
)
def test_engines_identical_across_caches(cfg, kind):
    """no cache / device radix / HiCache, and (the serial engine only, to keep the suite's
    time; the batched engine's sharded steps: tests/test_engine_recurrent.py) HiCache with the
    model tensor-parallel over 2 devices (the window pools sharded over
    kv heads as the full group's): same tokens, first-token logits
    within 1e-5, and HiCache serves hits from L1 and from L2 (a device pool too small for every
    session). (The batched engine's chunked-attention mask is the serial one's:
    ``_local_start``.)"""
    model = DecoderModel(cfg, seed=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    runs = {}
    modes = ("none", "device", "hicache")
    if kind == "serial" and cfg is WINDOW:
        modes += ("tensor-parallel",)
    for mode in modes:
        if mode == "tensor-parallel":
            model = DecoderModel(cfg, seed=2, mesh=mesh)
            cache = _cache(model, device=24, host=256, mesh=mesh)
            shard = cache.window_pools[0].array.sharding
            assert not shard.is_fully_replicated and len(shard.device_set) == 2
            mode = "hicache"
        else:
            cache = _cache(model, device=24, host=256 if mode == "hicache" else 0)
        if kind == "serial":
            engine = Engine(model, cache, mode=mode, **SERIAL)
        else:
            engine = BatchedEngine(model, cache, mode=mode, **BATCHED)
        gens = _play(engine)
        cache.flush()  # a transfer still in flight would differ by timing, not by the mesh
        runs[mode if cache.cfg.mesh is None else "tensor-parallel"] = gens, cache.stats()
    base, _ = runs["none"]
    for mode, (gens, _) in runs.items():
        for g0, g in zip(base, gens):
            np.testing.assert_array_equal(g.tokens, g0.tokens, err_msg=mode)
            np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL)
    stats = runs["hicache"][1]
    assert stats["device_hit_tokens"] > 0 and stats["host_hit_tokens"] > 0, stats
    gens = runs["hicache"][0]
    assert sum(g.record.host_hit_tokens for g in gens) > 0
    if "tensor-parallel" in runs:
        counts = [
            {k: v for k, v in runs[m][1].items() if isinstance(v, int)}
            for m in ("hicache", "tensor-parallel")
        ]
        assert counts[0] == counts[1]  # the same hits and pages on every tier


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_engines_identical_with_hits_from_l3(kind, tmp_path):
    """A windowed model's KV written through to a file store by one cache, then served to a
    fresh cache from L3 (its own L1 and L2 empty): the same tokens and first-token logits
    (within 1e-5) as no cache, with tokens served from L3."""
    model = DecoderModel(WINDOW, seed=2)
    url = f"file://{tmp_path}"

    def engine(mode: str, **cfg):
        cache = _cache(model, **cfg)
        if kind == "serial":
            return Engine(model, cache, mode=mode, prefetch=mode == "hicache", **SERIAL)
        return BatchedEngine(model, cache, mode=mode, **BATCHED)

    base = _play(engine("none"))
    writer = engine("hicache", device=24, host=256, storage=url)
    _play(writer)
    writer.cache.close()
    reader = engine("hicache", device=24, host=256, storage=url, prefetch_policy="wait_complete")
    gens = _play(reader, prefetch=kind == "batched")
    for g0, g in zip(base, gens):
        np.testing.assert_array_equal(g.tokens, g0.tokens)
        np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL)
    st = reader.cache.stats()
    assert st["served_l3_tokens"] > 0, st
