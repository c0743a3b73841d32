"""A decoder with all three layer kinds (``layer_pattern="R2:S1:F1"``: two gated linear-attention
layers, one sliding-window layer, one full-attention layer, as Samba / Hymba / Qwen3.5-like
hybrids mix them): its plans, its paged forward (one request, and several rows) against the
dense reference, and the serial and batched engines giving the same tokens with no cache and
with HiCache serving hits from L1, L2 and L3 (the recurrent state from checkpoints, the window
layer's K/V from its window pages), also with the model tensor-parallel over 2 devices. (Over
two processes: tests/test_bench_processes.py.)"""

import jax
import numpy as np
import pytest

from hicache_jax import HiCacheConfig
from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.layers import (
    layer_plan,
    local_groups,
    local_plan,
    recurrent_plan,
    reference_logits,
)
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import TokenSlots
from hicache_jax.engine.weights import ModelConfig
from hicache_jax.engine.workloads import multiturn_chat
from hicache_jax.spec import GroupKind

SIZES = dict(vocab_size=97, num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
WINDOW = 6  # tokens: shorter than the prompts, so the window layer masks what it must
CFG = ModelConfig(**SIZES, ffn_dim=48, layer_pattern="R2:S1:F1", window=WINDOW)
TOL = dict(rtol=1e-5, atol=1e-5)
PS = 4
SERIAL = dict(chunk_size=32, prefill_bucket=32, table_bucket=32)
BATCHED = dict(token_budget=32, max_running=2, table_bucket=32, query_block=32, batch_bucket=2)
SLOTS = dict(state_device_slots=32, state_host_slots=128)


@pytest.fixture(scope="module")
def model():
    return DecoderModel(CFG, seed=3)


def _cache(model, device=64, host=0, **kw):
    cfg = HiCacheConfig(
        device_pages=device, host_pages=host, load_back_threshold=1, **{**SLOTS, **kw}
    )
    return HiCache(model.kv_spec(PS), cfg)


def _ref(model, tokens):
    return np.asarray(reference_logits(model.cfg, model.params, np.asarray(tokens, np.int32)))


def test_plans_and_spec():
    spec = CFG.kv_spec(PS)
    kinds = {GroupKind(g.kind): g.layers for g in spec.groups}
    assert kinds == {GroupKind.STATE: (0, 1), GroupKind.WINDOW: (2,), GroupKind.FULL: (3,)}
    assert recurrent_plan(CFG) == (0, 1, None, -1) and layer_plan(CFG) == ()
    assert local_plan(CFG) == (None, None, (0, 0, ("window", WINDOW)), None)
    assert CFG.recurrent and ModelConfig(**SIZES, layer_pattern="S1:R2:F1", window=4).recurrent
    with pytest.raises(ValueError, match="give window="):
        ModelConfig(**SIZES, layer_pattern="R2:S1:F1")


def test_forward_matches_reference(model):
    """A prompt of 37 tokens in two chunks, then decode, through the window pools: logits
    within 1e-5 of the dense reference; the rows form gives the same last logits."""
    prompt = np.random.default_rng(5).integers(0, 97, 37).astype(np.int32)
    ref = _ref(model, prompt)
    cache = _cache(model)
    pages = cache.alloc_pages(10)
    windows = cache.window_pools
    with pytest.raises(ValueError, match="needs 2 pools"):
        model.forward_recurrent(cache.device_pool, prompt[:16], 0, pages, model.zero_state())
    state = model.zero_state()
    logits, state, _, _ = model.forward_recurrent(
        cache.device_pool, prompt[:16], 0, pages, state,
        windows=windows, window_pages=cache.window_pages(pages[:4]),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(logits), ref[15], **TOL)
    logits, state, _, _ = model.forward_recurrent(
        cache.device_pool, prompt[16:36], 16, pages, state,
        windows=windows, window_pages=cache.window_pages(pages[:9]),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(logits), ref[35], **TOL)
    logits, _, _, _ = model.forward_recurrent(
        cache.device_pool, prompt[36:], 36, pages, state,
        windows=windows, window_pages=cache.window_pages(pages[:10]),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(logits), ref[36], **TOL)
    other = np.random.default_rng(6).integers(0, 97, 11).astype(np.int32)
    other_pages = cache.alloc_pages(3)
    slots = TokenSlots(2)
    logits, _, _, _, _ = model.forward_recurrent_rows(
        cache.device_pool,
        [prompt[32:36], other],
        [32, 0],
        [pages, other_pages],
        [state_before_32(model, cache, prompt), model.zero_state()],
        slots,
        [0, 1],
        windows=windows,
        window_pages=[cache.window_pages(pages[:9]), cache.window_pages(other_pages)],
        min_pages=32,
    )
    np.testing.assert_allclose(np.asarray(logits)[:2], [ref[35], _ref(model, other)[-1]], **TOL)


def state_before_32(model, cache, prompt):
    """The recurrent state after the prompt's first 32 tokens (a fresh request's prefill)."""
    pages = cache.alloc_pages(8)
    _, state, _, _ = model.forward_recurrent(
        cache.device_pool, prompt[:32], 0, pages, model.zero_state(),
        windows=cache.window_pools, window_pages=cache.window_pages(pages),
    )  # fmt: skip
    return state


def _engine(model, kind, mode, cache, **kw):
    if kind == "serial":
        return Engine(model, cache, mode=mode, **SERIAL, **kw)
    return BatchedEngine(model, cache, mode=mode, **BATCHED, **kw)


def _play(engine, prefetch: bool = False):
    gens = []

    def serve(prompts):
        if prefetch:  # (the batched engine does not prefetch from L3 itself)
            for p in prompts:
                engine.cache.prefetch(p)
        out = engine.generate(prompts, 4)
        gens.extend(out)
        return [g.tokens for g in out]

    multiturn_chat(
        num_clients=4, num_turns=2, system_tokens=40, question_tokens=8, max_new_tokens=4,
        vocab_size=97, seed=1,
    ).run(serve)  # fmt: skip
    return gens


def _assert_same(base, gens, what):
    for g0, g in zip(base, gens, strict=True):
        np.testing.assert_array_equal(g.tokens, g0.tokens, err_msg=what)
        np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL, err_msg=what)


def _counts(cache):
    return {k: v for k, v in cache.stats().items() if isinstance(v, int)}


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_engines_identical_with_and_without_the_cache(model, kind):
    """no cache / HiCache (a device pool too small for every session, so hits come from L1
    and L2), and HiCache with the model tensor-parallel over 2 devices (attention and
    recurrent heads split; the full and window pools sharded over kv heads, the state slots
    over the recurrent heads): the same tokens, first-token logits within 1e-5, and the
    same hits, pages and slots with and without the split."""
    runs = {}
    for mode in ("none", "hicache"):
        cache = _cache(model, device=24, host=256 if mode == "hicache" else 0)
        runs[mode] = _play(_engine(model, kind, mode, cache)), cache
        cache.check_invariants()
    base, _ = runs["none"]
    gens, cache = runs["hicache"]
    _assert_same(base, gens, "hicache")
    st = cache.stats()
    assert st["device_hit_tokens"] > 0 and st["host_hit_tokens"] > 0, st
    assert st["state_host_used_slots"] > 0 and st["window_host_used_pages"] > 0, st
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    tp = DecoderModel(CFG, seed=3, mesh=mesh)
    assert tp.params["recurrent"]["wq"].sharding.spec[2] == "tp"
    tp_cache = _cache(tp, device=24, host=256, mesh=mesh)
    _assert_same(base, _play(_engine(tp, kind, "hicache", tp_cache)), "tensor-parallel")
    assert _counts(tp_cache) == _counts(cache)
    spec = CFG.kv_spec(PS)
    (g_state,), (g_window,) = spec.state_groups, local_groups(spec)
    state = tp_cache.window_pools[g_state].array
    window = tp_cache.window_pools[g_window].array
    for arr in (state, window):
        assert not arr.sharding.is_fully_replicated and len(arr.devices()) == 2
    assert state.sharding.spec[4] == "tp"  # slots split over the recurrent heads
    assert window.sharding.spec == tp_cache.device_pool.array.sharding.spec  # over kv heads
    tp_cache.check_invariants()


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_engines_identical_with_hits_from_l3(model, kind, tmp_path):
    """Checkpoints and window pages written through to a file store with their pages by one
    cache, then served to a fresh cache from L3 (its L1 and L2 empty): the same tokens and
    first-token logits (within 1e-5) as no cache, with tokens served from L3."""
    url = f"file://{tmp_path}"

    def engine(mode: str, **cfg):
        kw = dict(prefetch=mode == "hicache") if kind == "serial" else {}
        return _engine(model, kind, mode, _cache(model, **cfg), **kw)

    base = _play(engine("none", device=24))
    writer = engine("hicache", device=24, host=256, storage=url)
    _play(writer)
    writer.cache.close()
    reader = engine("hicache", device=24, host=256, storage=url, prefetch_policy="wait_complete")
    _assert_same(base, _play(reader, prefetch=kind == "batched"), "hits from L3")
    st = reader.cache.stats()
    assert st["served_l3_tokens"] > 0 and st["l3_window_prefetch_hit_pages"] > 0, st
    reader.cache.check_invariants()
