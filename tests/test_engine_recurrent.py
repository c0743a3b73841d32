"""A hybrid decoder with recurrent layers (``layer_pattern="R3:F1"``: three gated linear-attention
layers, then one full-attention layer): its paged forward against the dense reference, its
spec's STATE group, and the serial and batched engines giving the same tokens with no cache, a
device radix cache and HiCache (hits from L1, L2 and L3), every hit starting from a copy of a
checkpoint that stays as it was written, including a hit at a node's split point."""

import itertools

import jax
import numpy as np
import pytest

from hicache_jax import HiCacheConfig
from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.layers import layer_plan, recurrent_plan, reference_logits
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import TokenSlots
from hicache_jax.engine.weights import ModelConfig, flat_params, unflatten_params
from hicache_jax.engine.workloads import multiturn_chat
from hicache_jax.spec import GroupKind, StateArray

SIZES = dict(vocab_size=97, num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8)
CFG = ModelConfig(**SIZES, ffn_dim=48, layer_pattern="R3:F1")
TOL = dict(rtol=1e-5, atol=1e-5)
PS = 4
SERIAL = dict(chunk_size=32, prefill_bucket=32, table_bucket=32)
BATCHED = dict(token_budget=32, max_running=2, table_bucket=32, query_block=32, batch_bucket=2)
SLOTS = dict(state_device_slots=32, state_host_slots=128)


@pytest.fixture(scope="module")
def model():
    return DecoderModel(CFG, seed=2)


def _cache(model, device=64, host=0, **kw):
    cfg = HiCacheConfig(
        device_pages=device, host_pages=host, load_back_threshold=1, **{**SLOTS, **kw}
    )
    return HiCache(model.kv_spec(PS), cfg)


def _engine(model, kind, mode, cache, **kw):
    if kind == "serial":
        return Engine(model, cache, mode=mode, **SERIAL, **kw)
    return BatchedEngine(model, cache, mode=mode, **BATCHED, **kw)


def _ref(model, tokens):
    return np.asarray(reference_logits(model.cfg, model.params, np.asarray(tokens, np.int32)))


def test_config_spec_and_errors(model):
    spec = CFG.kv_spec(PS)
    state = spec.window_groups[spec.state_groups[0]]
    assert state.kind is GroupKind.STATE and state.layers == (0, 1, 2)
    assert spec.full_group.layers == (3,) and spec.num_layers == 1
    # Defaults from the model's dims: heads = num_heads, dk = dv = head_dim, conv width 4.
    assert state.state == (
        StateArray("conv", (3, 32), "float32"),
        StateArray("ssm", (4, 8, 8), "float32", head_axis=0),
    )
    assert recurrent_plan(CFG) == (0, 1, 2, -1) and layer_plan(CFG) == ()
    other = ModelConfig(**SIZES, layer_pattern="R1:F1", recurrent_heads=2, conv_width=2)
    assert [a.shape for a in other.state_arrays()] == [(1, 32), (2, 8, 8)]
    assert recurrent_plan(other) == (0, -1, 1, -2)
    flat = flat_params(model.params)
    assert flat["recurrent.wq"].shape == (3, 32, 32)
    unflatten_params(CFG, flat)  # the weight file's names round-trip
    for kw, field in (
        (dict(conv_width=1), "conv_width"),
        (dict(recurrent_heads=0), "recurrent_heads"),
        (dict(window=8), "window"),  # a recurrent layer keeps a state, not a window
    ):
        with pytest.raises(ValueError, match=field):
            ModelConfig(**SIZES, layer_pattern="R3:F1", **kw)
    cache = _cache(model)
    pages = cache.alloc_pages(2)
    with pytest.raises(ValueError, match="forward_recurrent"):
        model.forward(cache.device_pool, np.arange(5, dtype=np.int32), 0, pages)
    with pytest.raises(ValueError, match="multiple of its chunk"):
        model.forward_recurrent(
            cache.device_pool, np.arange(3, dtype=np.int32), 1, pages, model.zero_state()
        )
    with pytest.raises(ValueError, match="chunk_size=2"):  # the recurrent chunk: a page here
        Engine(model, cache, mode="device", chunk_size=2)
    with pytest.raises(ValueError, match="token_budget=2"):
        BatchedEngine(model, cache, mode="device", token_budget=2)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:3]), ("tp",))
    with pytest.raises(ValueError, match="recurrent_heads=2 is not divisible by the 3"):
        DecoderModel(
            ModelConfig(
                **{**SIZES, "num_heads": 6, "num_kv_heads": 3},
                ffn_dim=48,
                layer_pattern="R3:F1",
                recurrent_heads=2,
            ),
            mesh=mesh,
        )


def test_forward_matches_reference(model):
    """A prompt of 45 tokens in chunks from page boundaries, then decode token by token, the
    state carried by the caller: logits within 1e-5 of the dense reference (recurrent layers
    token by token there); the chunk-boundary states equal a fresh prefill's."""
    prompt = np.random.default_rng(7).integers(0, 97, 45).astype(np.int32)
    ref = _ref(model, prompt)
    cache = _cache(model)
    pages = cache.alloc_pages(-(-len(prompt) // PS))
    state = model.zero_state()
    knobs = dict(min_bucket=32, min_pages=32)  # (the engine tests' shapes: compiled once)
    for a, b in itertools.pairwise([0, 8, 32, 40]):
        logits, state, bounds, chunk = model.forward_recurrent(
            cache.device_pool, prompt[a:b], a, pages, state, **knobs
        )
        np.testing.assert_allclose(np.asarray(logits), ref[b - 1], **TOL)
        assert chunk == PS and bounds[1].shape[1] == 32 // PS
        # The last boundary inside the chunk is the state after it.
        last = (b - a) // chunk - 1
        np.testing.assert_array_equal(np.asarray(bounds[1][:, last]), np.asarray(state[1]))
    state40 = state
    for pos in range(40, 45):
        logits, state, _, _ = model.forward_recurrent(
            cache.device_pool, prompt[pos : pos + 1], pos, pages, state, min_pages=32
        )
        np.testing.assert_allclose(np.asarray(logits), ref[pos], **TOL)
    # Rows of two requests in one step (the batched engine's): prefill chunks, then decode
    # tokens read from their slots.
    other = prompt[::-1][:30].copy()
    other_pages = cache.alloc_pages(8)
    slots = TokenSlots(2)
    logits, toks, states, bounds, _ = model.forward_recurrent_rows(
        cache.device_pool,
        [other[:29], prompt[40:44]],
        [0, 40],
        [other_pages, pages],
        [model.zero_state(), state40],
        slots,
        [1, 0],
        **knobs,
    )
    np.testing.assert_allclose(np.asarray(logits)[:2], [_ref(model, other)[-2], ref[43]], **TOL)
    np.testing.assert_array_equal(np.asarray(slots.array)[:2], np.asarray(toks)[[1, 0]])
    assert bounds[0][1].shape[1] == 32 // PS
    other_state = states[0]
    before = [np.asarray(a) for a in other_state]
    slots.array = slots.array.at[1].set(int(other[29])).at[0].set(int(prompt[44]))
    logits, toks, states, _, _ = model.forward_recurrent_rows(
        cache.device_pool,
        None,
        [29, 44],
        [other_pages, pages],
        [other_state, states[1]],
        slots,
        [1, 0],
        min_pages=32,
    )
    np.testing.assert_allclose(np.asarray(logits)[:2], [_ref(model, other)[-1], ref[44]], **TOL)
    assert int(np.asarray(toks)[1]) == int(np.asarray(slots.array)[0]) == ref[44].argmax()
    for a, b in zip(before, other_state):  # the caller's state is not modified
        np.testing.assert_array_equal(a, np.asarray(b))


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


def _play(engine, prefetch: bool = False, seen: list | None = None):
    gens = []

    def serve(prompts):
        if seen is not None:
            seen.extend(prompts)
        if prefetch:  # (the batched engine does not prefetch from L3 itself)
            for p in prompts:
                engine.cache.prefetch(p)
        out = engine.generate(prompts, 4)
        gens.extend(out)
        return [g.tokens for g in out]

    _chat().run(serve)
    return gens


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_engines_identical_across_caches(model, kind):
    """no cache / device radix / HiCache, and HiCache with the model tensor-parallel: the same
    tokens, first-token logits within 1e-5 of the recompute's (the last one's also of the dense
    reference's), and HiCache serves hits from L1 and from L2 (a device pool too small for
    every session)."""
    runs, prompts = {}, []
    for mode in ("none", "device", "hicache"):
        cache = _cache(model, device=24, host=256 if mode == "hicache" else 0)
        seen = prompts if mode == "none" else None
        runs[mode] = _play(_engine(model, kind, mode, cache), seen=seen), cache
        cache.check_invariants()
    base, _ = runs["none"]
    for mode, (gens, _) in runs.items():
        for g0, g in zip(base, gens):
            np.testing.assert_array_equal(g.tokens, g0.tokens, err_msg=mode)
            np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL)
    np.testing.assert_allclose(base[-1].first_logits, _ref(model, prompts[-1])[-1], **TOL)
    for mode in ("device", "hicache"):
        st = runs[mode][1].stats()
        assert st["device_hit_tokens"] > 0, (mode, st)
    st = runs["hicache"][1].stats()
    assert st["host_hit_tokens"] > 0 and st["state_host_used_slots"] > 0, st
    # Tensor-parallel over 2 devices (attention and recurrent heads split, the pools sharded
    # as the model's, the state slots over the recurrent heads): the same tokens and logits.
    # (The batched engine here; the serial one over two processes: test_bench_processes.py.)
    if kind == "serial":
        return
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    tp = DecoderModel(CFG, seed=2, mesh=mesh)
    assert tp.params["recurrent"]["wq"].sharding.spec[2] == "tp"
    cache = _cache(tp, device=24, host=256, mesh=mesh)
    for g0, g in zip(base, _play(_engine(tp, kind, "hicache", cache))):
        np.testing.assert_array_equal(g.tokens, g0.tokens, err_msg="tensor-parallel")
        np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL)
    counts = {k: v for k, v in cache.stats().items() if isinstance(v, int)}
    assert counts == {k: v for k, v in st.items() if isinstance(v, int)}  # hits, pages, slots
    state = cache.window_pools[CFG.kv_spec(PS).state_groups[0]].array
    assert not state.sharding.is_fully_replicated and len(state.devices()) == 2
    assert state.sharding.spec[4] == "tp"  # slots split over the recurrent heads
    cache.check_invariants()


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_engines_identical_with_hits_from_l3(model, kind, tmp_path):
    """Checkpoints written through to a file store with their pages by one cache, then served
    to a fresh cache from L3 (its L1 and L2 empty): the same tokens and first-token logits
    (within 1e-5) as no cache, with tokens served from L3."""
    url = f"file://{tmp_path}"

    def engine(mode: str, **cfg):
        kw = dict(prefetch=mode == "hicache") if kind == "serial" else {}
        return _engine(model, kind, mode, _cache(model, **cfg), **kw)

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
    reader.cache.check_invariants()


def _state_at(cache, tokens):
    """The checkpoint (bytes) at the end of the cached prefix of ``tokens``, and its length."""
    m = cache.match_prefix(tokens)
    g = cache.spec.state_groups[0]
    return m.device_len, [np.asarray(a).copy() for a in cache.read_state(g, m.device_pages[-1:])]


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_two_continuations_of_one_checkpoint(model, kind):
    """A's prompt cached; B and C extend it with different suffixes (batched: admitted
    together, decoding side by side): each starts from A's checkpoint (a copy), each equals its
    own recompute, and the checkpoint's bytes are unchanged after."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 97, 37).astype(np.int32)
    engine = _engine(model, kind, "device", _cache(model))
    engine.generate([a], 3)
    held, before = _state_at(engine.cache, a)
    assert held == 36
    b = np.concatenate([a[:held], rng.integers(0, 97, 13)]).astype(np.int32)
    c = np.concatenate([a[:held], rng.integers(0, 97, 6)]).astype(np.int32)
    gens = engine.generate([b, c], 5)
    fresh = _engine(model, kind, "none", _cache(model)).generate([b, c], 5)
    for g, f in zip(gens, fresh):
        assert g.record.device_hit_tokens == held
        np.testing.assert_array_equal(g.tokens, f.tokens)
        np.testing.assert_allclose(g.first_logits, f.first_logits, **TOL)
    g = engine.cache.spec.state_groups[0]
    m = engine.cache.match_prefix(a[:held])
    after = engine.cache.read_state(g, m.device_pages[-1:])
    for x, y in zip(before, after):
        np.testing.assert_array_equal(x, np.asarray(y))
    engine.cache.check_invariants()


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_hit_after_a_node_split(model, kind):
    """B diverges inside A's cached prefix (at 24 tokens, where A wrote no checkpoint): B is
    served from the start, and writes the checkpoint at the split point; then C, diverging from
    both at that point, and D, continuing B's branch, are served from checkpoints at 24 and at
    B's prompt's end, each equal to its recompute."""
    rng = np.random.default_rng(12)
    a = rng.integers(0, 97, 49).astype(np.int32)
    b = np.concatenate([a[:24], rng.integers(0, 97, 21)]).astype(np.int32)  # 45 tokens
    c = np.concatenate([a[:24], rng.integers(0, 97, 10)]).astype(np.int32)
    d = np.concatenate([b[:44], rng.integers(0, 97, 7)]).astype(np.int32)
    engine = _engine(model, kind, "device", _cache(model))
    cache = engine.cache
    engine.generate([a], 3)
    assert cache.match_prefix(b[:-1]).device_len == 0  # no checkpoint at 24 yet
    assert cache.checkpoint_positions(b, 0)[0] == 24  # the tree's branch point
    gb = engine.generate([b], 3)[0]
    assert gb.record.device_hit_tokens == 0
    assert cache.match_prefix(c[:-1]).device_len == 24
    gc, gd = engine.generate([c, d], 4)
    assert gc.record.device_hit_tokens == 24 and gd.record.device_hit_tokens == 44
    fresh = _engine(model, kind, "none", _cache(model)).generate([b, c, d], 4)
    for g, f in zip((gc, gd), fresh[1:]):
        np.testing.assert_array_equal(g.tokens, f.tokens)
        np.testing.assert_allclose(g.first_logits, f.first_logits, **TOL)
    np.testing.assert_array_equal(gb.tokens, fresh[0].tokens[:3])
    cache.check_invariants()


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_branch_point_placed_before_the_request_takes_its_pages(model, kind):
    """B shares A's first 24 tokens (no checkpoint there) and needs nearly the whole device
    pool, so taking its pages evicts A's: the checkpoint at the branch point is placed before
    (while the tree still shows where B leaves A's pages) and C, sharing only those 24 tokens,
    is served from it."""
    rng = np.random.default_rng(13)
    a = rng.integers(0, 97, 41).astype(np.int32)
    b = np.concatenate([a[:24], rng.integers(0, 97, 60)]).astype(np.int32)  # 22 of 24 pages
    c = np.concatenate([a[:24], rng.integers(0, 97, 9)]).astype(np.int32)
    engine = _engine(model, kind, "device", _cache(model, device=24))
    engine.generate([a], 2)
    engine.generate([b], 2)
    assert engine.cache.match_prefix(a[:-1]).device_len == 24  # A's own pages were evicted
    gc = engine.generate([c], 3)[0]
    assert gc.record.device_hit_tokens == 24
    fresh = _engine(model, kind, "none", _cache(model)).generate([c], 3)[0]
    np.testing.assert_array_equal(gc.tokens, fresh.tokens)
    np.testing.assert_allclose(gc.first_logits, fresh.first_logits, **TOL)


def test_batched_retraction_restarts_from_a_checkpoint(model):
    """Decode pages run out (no decode reserve): running requests are retracted (their pages
    inserted), re-admitted from a checkpoint and finish with the tokens of a recompute."""
    rng = np.random.default_rng(0)
    head = rng.integers(0, 97, 20)
    prompts = [
        np.concatenate([head, rng.integers(0, 97, int(rng.integers(5, 30)))]).astype(np.int32)
        for _ in range(6)
    ]
    base = _engine(model, "serial", "none", _cache(model)).generate(prompts, 24)
    engine = BatchedEngine(
        model,
        _cache(model, device=24),
        mode="device",
        **{**BATCHED, "max_running": 4, "batch_bucket": 4},
        decode_reserve=0.0,
    )
    for _ in range(2):  # the second round mostly hits
        gens = engine.generate(prompts, 24)
        for g0, g in zip(base, gens):
            np.testing.assert_array_equal(g.tokens, g0.tokens)
            np.testing.assert_allclose(g.first_logits, g0.first_logits, **TOL)
    assert engine.counters["retractions"] > 0
    assert engine.cache.stats()["device_hit_tokens"] > 0
    engine.cache.check_invariants()


@pytest.mark.parametrize("kind", ["serial", "batched"])
def test_checkpoints_without_a_slot_are_skipped(model, kind):
    """One state slot and a checkpoint every two pages: the cache asks for none of the
    interior ones (no room for them: ``Windows._admit``), the prefill's end checkpoint (28)
    takes the slot, decode's one (at 32) finds none and is skipped (its page goes into the
    tree without it); the request and its continuation, served from 28, equal their
    recompute. (LRU: under the ``value`` eviction every checkpoint of the tree is spare, and
    decode's takes the slot of the prefill's.)"""
    rng = np.random.default_rng(14)
    a = rng.integers(0, 97, 30).astype(np.int32)
    cache = _cache(model, state_device_slots=1, checkpoint_every_pages=2, eviction="lru")
    engine = _engine(model, kind, "device", cache)
    assert cache.checkpoint_positions(a, 0) == [28]
    first = engine.generate([a], 3)[0]
    b = np.concatenate([a, first.tokens[:2], rng.integers(0, 97, 5)]).astype(np.int32)
    second = engine.generate([b], 3)[0]
    assert second.record.device_hit_tokens == 28
    fresh = _engine(model, kind, "none", _cache(model)).generate([a, b], 3)
    for g, f in zip((first, second), fresh):
        np.testing.assert_array_equal(g.tokens, f.tokens)
        np.testing.assert_allclose(g.first_logits, f.first_logits, **TOL)
    assert cache.stats()["state_device_used_slots"] == 1
    cache.check_invariants()
