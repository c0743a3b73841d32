"""The paged decoder against its dense reference: chunking, page sizes, mid-page starts, decode,
the per-layer path, donation, poisoned pages, bounded compiles, weight files, bad input."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import poisoned_device_pool
from hicache_jax.engine import layers, packing
from hicache_jax.engine import model as model_mod
from hicache_jax.engine.layers import compiled_step_count, reference_logits, trace_count
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import TokenSlots, bucket, fine_bucket
from hicache_jax.engine.weights import ModelConfig, init_params, load_params, save_params
from hicache_jax.memory.device_pool import DevicePagePool

CFG = ModelConfig(
    vocab_size=97, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn_dim=48
)
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return DecoderModel(CFG, seed=1)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(7).integers(0, CFG.vocab_size, 45).astype(np.int32)


@pytest.fixture(scope="module")
def ref(model, prompt):
    return np.asarray(reference_logits(CFG, model.params, prompt))


def _poisoned_pool(page_size, num_pages=64):
    """A pool whose every page (scratch included) holds NaN bits, so stray reads show."""
    return poisoned_device_pool(CFG.kv_spec(page_size), num_pages)


def _pages(n, num_pages=64, seed=0):
    return np.random.default_rng(seed).permutation(num_pages)[:n].astype(np.int32)


class _Waiter:
    def __init__(self):
        self.calls = []

    def wait_layer(self, layer):
        self.calls.append(layer)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("splits", [(), (5, 21, 37)])
def test_chunked_prefill_matches_dense_reference(model, prompt, ref, page_size, splits):
    # Chunk boundaries at arbitrary positions (mid-page for page_size 4 and 16).
    pool = _poisoned_pool(page_size)
    pages = _pages(-(-len(prompt) // page_size))
    bounds = [0, *splits, len(prompt)]
    for a, b in itertools.pairwise(bounds):
        logits = model.forward(pool, prompt[a:b], a, pages, min_bucket=16)
        np.testing.assert_allclose(np.asarray(logits), ref[b - 1], **TOL)


def test_decode_steps_match_reference_rows(model, prompt, ref):
    pool = _poisoned_pool(16)
    pages = _pages(3)
    model.forward(pool, prompt[:30], 0, pages, min_bucket=16)
    for pos in range(30, len(prompt)):
        tok = jnp.asarray(prompt[pos : pos + 1])  # a device token, as the engine feeds it
        np.testing.assert_allclose(
            np.asarray(model.forward(pool, tok, pos, pages)), ref[pos], **TOL
        )


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("key_block", [128, 8])
def test_packed_step_mixes_prefill_chunks_and_decode_tokens(layerwise, page_size, key_block):
    """One forward_batch over prefill chunks of several query blocks (mid-page starts, a chunk
    of one block, one of three) and decode tokens of other requests, on a poisoned pool: each
    chunk's last-token logits match the dense reference, and the next step reads what it wrote.
    key_block 128: every row's keys in one work item; 8: rows of up to six items (a page of 16
    or 8 pages of 1 each), the items of one row merged."""
    model = DecoderModel(CFG, seed=1)
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (40, 23, 9, 31, 17)]
    refs = [np.asarray(reference_logits(CFG, model.params, s)) for s in seqs]
    pool = _poisoned_pool(page_size, num_pages=200)
    perm = np.random.default_rng(0).permutation(200).astype(np.int32)
    pages, used = [], 0
    for s in seqs:
        n = -(-len(s) // page_size)
        pages.append(perm[used : used + n])
        used += n
    # Requests 2..4 already hold K/V up to their last token (prefilled in one earlier step).
    done = [0, 0, 8, 30, 16]
    model.forward_batch(
        pool,
        [seqs[i][: done[i]] for i in (2, 3, 4)],
        [0, 0, 0],
        [pages[i] for i in (2, 3, 4)],
        query_block=8,
    )
    # One step: request 0's 40-token prefill from position 3 (three blocks of 16, mid-page),
    # request 1's whole prompt (two blocks), and one decode token each for requests 2..4 ...
    model.forward(pool, seqs[0][:3], 0, pages[0])
    chunks = [seqs[0][3:], seqs[1]] + [seqs[i][done[i] :] for i in (2, 3, 4)]
    starts = [3, 0] + [done[i] for i in (2, 3, 4)]
    waiter = _Waiter() if layerwise else None
    logits, toks = model.forward_batch(
        pool, chunks, starts, pages, waiter=waiter, query_block=16, key_block=key_block
    )
    if layerwise:
        assert waiter.calls == list(range(CFG.num_layers))
    logits = np.asarray(logits)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(logits[i], refs[i][len(s) - 1], **TOL)
    np.testing.assert_array_equal(np.asarray(toks)[:5], logits[:5].argmax(axis=-1))
    # ... and a later decode step of request 0 reads the K/V the packed step wrote.
    nxt = np.asarray(toks)[:1]
    full = np.concatenate([seqs[0], nxt])
    want = np.asarray(reference_logits(CFG, model.params, full))[-1]
    pages0 = perm[used : used + -(-len(full) // page_size)]
    pages0 = np.concatenate([pages[0], pages0])[: -(-len(full) // page_size)]
    got, _ = model.forward_batch(pool, [nxt], [len(seqs[0])], [pages0], key_block=key_block)
    np.testing.assert_allclose(np.asarray(got)[0], want, **TOL)


def test_layerwise_if_compiled_never_compiles_a_shape_the_fused_step_has():
    """With layerwise_if_compiled, a pending load runs layer by layer only for shapes whose
    per-layer executables exist (or whose fused one does not either): otherwise every layer is
    waited for, then the fused step runs, compiling nothing. Results are the same either way."""
    model = DecoderModel(CFG, seed=4)
    rng = np.random.default_rng(11)
    seqs = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (19, 26)]
    refs = [np.asarray(reference_logits(CFG, model.params, s))[-1] for s in seqs]
    pages = [_pages(2, seed=1), _pages(2, seed=2)]
    pages[1] = np.setdiff1d(_pages(6, seed=2), pages[0])[:2].astype(np.int32)

    def run(waiter, **kw):
        pool = _poisoned_pool(16)
        logits, _ = model.forward_batch(
            pool, seqs, [0, 0], pages, waiter=waiter, query_block=8, **kw
        )
        for got, want in zip(np.asarray(logits), refs):
            np.testing.assert_allclose(got, want, **TOL)

    run(None)  # the fused step of this shape is compiled
    layers_before = trace_count("batch_layer")
    waiter = _Waiter()
    run(waiter, layerwise_if_compiled=True)  # waits for every layer, then the fused step
    assert waiter.calls == list(range(CFG.num_layers))
    assert trace_count("batch_layer") == layers_before
    waiter = _Waiter()
    run(waiter)  # asked for explicitly: the per-layer path compiles
    assert trace_count("batch_layer") > layers_before
    layers_after = trace_count("batch_layer")
    waiter = _Waiter()
    run(waiter, layerwise_if_compiled=True)  # its executables exist now: layer by layer again
    assert waiter.calls == list(range(CFG.num_layers))
    assert trace_count("batch_layer") == layers_after


@pytest.mark.parametrize("layerwise", [False, True])
def test_decode_tokens_read_from_token_slots_match_host_tokens(layerwise):
    """With slots=, each chunk's sampled token is written to its slot on the device, and a
    decode chunk marked from_slot reads its token there (its host value is ignored): two steps
    dispatched back to back, the second never seeing the first's tokens on the host, give the
    logits of feeding those tokens from the host."""
    model = DecoderModel(CFG, seed=2)
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (21, 12, 30)]
    pages = [_pages(8, num_pages=200, seed=3)[i * 2 : i * 2 + 2] for i in range(3)]
    waiter = _Waiter() if layerwise else None

    def two_steps(slots):
        pool = _poisoned_pool(16, num_pages=200)
        kw = dict(slots=slots, slot_of=[5, 0, 2]) if slots else {}
        _, first = model.forward_batch(
            pool, seqs, [0, 0, 0], pages, query_block=8, waiter=waiter, **kw
        )
        if slots:  # placeholders: the real tokens are the first step's, read on the device
            chunks, kw["from_slot"] = [np.zeros(1, np.int32)] * 3, [True] * 3
        else:
            chunks = [np.asarray(first)[i : i + 1] for i in range(3)]
        logits, toks = model.forward_batch(
            pool, chunks, [len(x) for x in seqs], pages, query_block=8, **kw
        )
        return np.asarray(first)[:3], np.asarray(logits)[:3], np.asarray(toks)[:3]

    slots = TokenSlots(6)
    got, want = two_steps(slots), two_steps(None)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_array_equal(np.asarray(slots.array)[[5, 0, 2]], got[2])
    for i, s in enumerate(seqs):
        full = np.concatenate([s, got[0][i : i + 1]])
        np.testing.assert_allclose(
            got[1][i], np.asarray(reference_logits(CFG, model.params, full))[-1], **TOL
        )


def test_token_slots_and_their_bad_arguments(model):
    slots = TokenSlots(2)
    assert (slots.take(), slots.take(), slots.free) == (0, 1, 0)
    with pytest.raises(RuntimeError, match="all 2 token slots are held"):
        slots.take()
    slots.give(1)
    with pytest.raises(ValueError, match="slot 1 is not held"):
        slots.give(1)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="must be an int >= 1"):
            TokenSlots(bad)
    pool = _poisoned_pool(16)
    before = np.asarray(pool.array).copy()
    one = [np.zeros(1, np.int32)]
    for kw, exc, match in [
        (dict(slot_of=[0]), ValueError, "need slots=TokenSlots"),
        (dict(slots=np.zeros(3, np.int32), slot_of=[0]), TypeError, "must be a TokenSlots"),
        (dict(slots=TokenSlots(2)), ValueError, "one slot per chunk"),
        (dict(slots=TokenSlots(2), slot_of=[2]), ValueError, "distinct slots in"),
        (
            dict(slots=TokenSlots(2), slot_of=[0], from_slot=[True, False]),
            ValueError,
            "2 entries for 1 chunks",
        ),
    ]:
        with pytest.raises(exc, match=match):
            model.forward_batch(pool, one, [0], [_pages(1)], **kw)
    with pytest.raises(ValueError, match="read from its slot must be one token"):
        model.forward_batch(
            pool,
            [np.zeros(3, np.int32)],
            [0],
            [_pages(1)],
            slots=TokenSlots(2),
            slot_of=[1],
            from_slot=[True],
        )
    np.testing.assert_array_equal(np.asarray(pool.array), before)  # nothing ran


def test_reuse_compiled_runs_a_new_shape_padded_into_a_compiled_one():
    """reuse_compiled: a step whose shapes have no executable runs padded into the cheapest
    compiled shape that holds it (same logits, nothing compiled); a shape no compiled one holds
    within REUSE_COST_LIMIT x its work compiles as before."""
    cfg = ModelConfig(
        vocab_size=61, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1, head_dim=8, ffn_dim=24
    )  # its own config: no shape of it ran before
    model = DecoderModel(cfg, seed=3)
    rng = np.random.default_rng(8)
    seqs = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in (40, 23, 9)]
    pages = [np.arange(i * 4, i * 4 + 4, dtype=np.int32) for i in range(3)]

    def run(k, **kw):
        pool = poisoned_device_pool(cfg.kv_spec(16), 64)
        shape = model.batch_shape(pool, seqs[:k], [0] * k, pages[:k], query_block=8)
        logits, _ = model.forward_batch(pool, seqs[:k], [0] * k, pages[:k], query_block=8, **kw)
        for i in range(k):
            np.testing.assert_allclose(
                np.asarray(logits)[i],
                np.asarray(reference_logits(cfg, model.params, seqs[i]))[-1],
                **TOL,
            )
        return shape

    big = run(2)  # compiles the two-request shape
    traced = trace_count("batch_step")
    small = run(1, reuse_compiled=True)  # held by it: no compile
    assert trace_count("batch_step") == traced and small != big
    assert model.batch_compiled(small, reuse=True) and not model.batch_compiled(small)
    assert packing.cover(small, model_mod._RAN) == big
    run(1)  # without reuse: its own executable
    assert trace_count("batch_step") == traced + 1
    tiny = [seqs[2][:2]]  # 2 tokens: every compiled shape is > 2x it
    pool = poisoned_device_pool(cfg.kv_spec(16), 64)
    shape = model.batch_shape(pool, tiny, [0], pages[:1], query_block=8)
    assert not model.batch_compiled(shape, reuse=True)
    model.forward_batch(pool, tiny, [0], pages[:1], query_block=8, reuse_compiled=True)
    assert trace_count("batch_step") == traced + 2


def test_forward_batch_rejects_a_bad_query_block(model):
    pool = _poisoned_pool(16)
    with pytest.raises(ValueError, match="query_block=12 must be a power of two"):
        model.forward_batch(pool, [np.zeros(3, np.int32)], [0], [_pages(1)], query_block=12)
    with pytest.raises(ValueError, match="key_block=0 must be an int >= 1"):
        model.forward_batch(pool, [np.zeros(3, np.int32)], [0], [_pages(1)], key_block=0)


def test_work_items_stop_at_each_rows_last_query():
    """The packed step's key work: a row's key blocks run up to the page of its last query, not
    to the longest row's (split-K); padding items point at the scratch page and see nothing."""
    from hicache_jax.engine.packing import pack, plan

    lens, starts, ps = [40, 1, 1], [0, 100, 7], 4
    pages = [np.arange(10) + 10, np.arange(26) + 30, np.arange(2) + 60]
    key, rows = plan(CFG, lens, starts, pages, ps, 16, 8, 1, 1)
    # prefill rows see 16, 32, 40 keys: 2 + 4 + 5 blocks of 8 (11 -> bucket 12); decode rows
    # see 101 and 8 keys: 13 + 1 blocks (14 -> 16 beside a prefill); nothing shared
    assert key[1:] == (48, 2, 3, 16, 12, 0, 16, 0, 2)
    used = [10, 26, 2]
    chunks = [np.zeros(n, np.int32) for n in lens]
    _, _, _, groups, _, _ = pack(chunks, starts, pages, lens, used, ps, 99, key, rows)
    (_, row, items, k0, sh, _), (_, drow, ditems, _dk0, dsh, _) = groups
    assert sh.shape == dsh.shape == (0, 2)
    np.testing.assert_array_equal(row[:11], [0] * 2 + [1] * 4 + [2] * 5)
    np.testing.assert_array_equal(k0[:11], [0, 8, 0, 8, 16, 24, 0, 8, 16, 24, 32])
    np.testing.assert_array_equal(items[6:11].reshape(-1), np.arange(10) + 10)
    assert (items[11:] == 99).all() and (k0[11:] >= 1 << 30).all()
    np.testing.assert_array_equal(drow[:14], [0] * 13 + [1])
    np.testing.assert_array_equal(ditems[12], [54, 55])  # request 1's last block: pages 24, 25
    np.testing.assert_array_equal(ditems[13], [60, 61])


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_blocks_run_once_and_match_the_reference(page_size):
    """Requests on one prefix's pages (a system prompt in the tree): the key blocks every row
    reads and sees whole are computed once for the group (cascade), in the prefill group (two
    requests' chunks past the prefix) and the decode group (three requests' tokens). Logits
    match the dense reference on a poisoned pool; a group whose rows start inside the prefix,
    or of one request, shares nothing."""
    from hicache_jax.engine.packing import plan

    model = DecoderModel(CFG, seed=2)
    rng = np.random.default_rng(5)
    prefix = rng.integers(0, CFG.vocab_size, 48).astype(np.int32)
    tails = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (20, 37, 5, 9, 14)]
    seqs = [np.concatenate([prefix, t]) for t in tails]
    pool = _poisoned_pool(page_size, num_pages=300)
    perm = np.random.default_rng(1).permutation(300).astype(np.int32)
    shared = perm[: 48 // page_size]
    pages, nxt = [], 48 // page_size
    for s in seqs:
        n = -(-len(s) // page_size) - len(shared)
        pages.append(np.concatenate([shared, perm[nxt : nxt + n]]))
        nxt += n
    kw = dict(query_block=16, key_block=16)
    model.forward_batch(pool, [prefix], [0], [pages[0]], **kw)  # the prefix's K/V, once
    for i in (2, 3, 4):  # requests 2..4 prefilled up to their last token
        model.forward_batch(pool, [seqs[i][48:-1]], [48], [pages[i]], **kw)
    chunks = [seqs[0][48:], seqs[1][48:]] + [seqs[i][-1:] for i in (2, 3, 4)]
    starts = [48, 48] + [len(seqs[i]) - 1 for i in (2, 3, 4)]
    key, _ = plan(CFG, [len(c) for c in chunks], starts, pages, page_size, 16, 16, 1, 1)
    assert key[6] == 3 and key[8] == 3  # 48 prefix keys: 3 blocks of 16, in both groups
    logits, _ = model.forward_batch(pool, chunks, starts, pages, **kw)
    for i, s in enumerate(seqs):
        want = np.asarray(reference_logits(CFG, model.params, s))[-1]
        np.testing.assert_allclose(np.asarray(logits)[i], want, **TOL)
    # A chunk starting inside the prefix shares only the blocks its first query sees whole.
    for start, blocks in ((8, 0), (20, 1), (47, 2)):
        key, _ = plan(CFG, [30, 30], [start, 48], pages[:2], page_size, 16, 16, 1, 1)
        assert key[6] == blocks
    # One request's rows alone share nothing (its blocks are its own items).
    key, _ = plan(CFG, [37], [48], pages[1:2], page_size, 16, 16, 1, 1)
    assert key[6] == 0


def test_untouched_pages_stay_poisoned(model, prompt):
    pool = _poisoned_pool(16)
    pages = _pages(3)
    model.forward(pool, prompt, 0, pages, min_bucket=16)
    bits = np.asarray(pool.array)
    others = np.setdiff1d(np.arange(pool.num_pages), pages)
    assert np.isnan(bits[:, :, others].view(np.float32)).all()
    written = bits[:, :, pages].view(np.float32).reshape(2, 2, 48, 2, 8)  # position order
    assert not np.isnan(written[:, :, : len(prompt)]).any()
    assert np.isnan(written[:, :, len(prompt) :]).all()


def test_layerwise_path_waits_per_layer_and_matches_fused(model, prompt, ref):
    pool = _poisoned_pool(16)
    pages = _pages(3)
    waiter = _Waiter()
    model.forward(pool, prompt[:20], 0, pages, waiter=waiter, min_bucket=16)
    logits = model.forward(pool, prompt[20:], 20, pages, waiter=waiter, min_bucket=16)
    assert waiter.calls == [0, 1, 0, 1]
    np.testing.assert_allclose(np.asarray(logits), ref[-1], **TOL)


def test_layerwise_waits_before_each_layer_dispatch(model, prompt):
    # The waiter sees the pool array before layer l runs: layers < l have written, l has not.
    pool = DevicePagePool(CFG.kv_spec(16), 64)
    pages = np.array([2, 5, 6], np.int32)
    seen = []

    class Probe:
        def wait_layer(self, layer):
            written = np.asarray(pool.array)[:, 0, pages].any(axis=(1, 2, 3, 4))
            seen.append((layer, written.tolist()))

    model.forward(pool, prompt, 0, pages, waiter=Probe(), min_bucket=16)
    assert seen == [(0, [False, False]), (1, [True, False])]


def test_pool_is_donated_in_place(model, prompt):
    pool = DevicePagePool(CFG.kv_spec(16), 64)
    old = pool.array
    ptr = old.unsafe_buffer_pointer()
    model.forward(pool, prompt[:10], 0, np.array([3], np.int32), min_bucket=16)
    assert old.is_deleted()
    assert pool.array.unsafe_buffer_pointer() == ptr


def test_steps_of_few_tokens_unroll_their_layers_and_match_the_scan():
    """A step of up to unroll_tokens tokens runs its layers unrolled over per-layer weights, a
    longer one as a scan over the stacked weights; forcing the scan (unroll_tokens 0) gives the
    same logits and K/V, through a compile of its own (the weights' structure differs)."""
    cfg = ModelConfig(**{**CFG.__dict__, "ffn_dim": 40})  # compiled by no other test
    unrolled = DecoderModel(cfg, seed=4)
    assert unrolled.unroll_tokens == layers.UNROLL_TOKENS >= 4
    rng = np.random.default_rng(5)
    seqs = [rng.integers(0, CFG.vocab_size, n).astype(np.int32) for n in (21, 12, 30)]
    pages = [np.array([0, 1]), np.array([2]), np.array([3, 4])]
    runs = []
    for model in (unrolled, DecoderModel(cfg, unrolled.params, unroll_tokens=0)):
        pool = poisoned_device_pool(cfg.kv_spec(16), 64)
        for s, p in zip(seqs, pages):  # prefills in buckets of 16 and 32 tokens
            model.forward(pool, s[:-1], 0, p, min_bucket=16)
        before = trace_count("batch_step"), trace_count("step")
        # Three decode rows in one packed step, and one serial decode step.
        logits, _ = model.forward_batch(
            pool, [s[-1:] for s in seqs], [len(s) - 1 for s in seqs], pages
        )
        serial = model.forward(pool, np.array([seqs[0][-1]], np.int32), len(seqs[0]), pages[0])
        # Both models compile their decode steps: the second does not find the first's.
        assert trace_count("batch_step") > before[0] and trace_count("step") > before[1]
        runs.append(
            (np.asarray(logits)[:3], np.asarray(serial), np.asarray(pool.array).view(np.float32))
        )  # K/V bits as float32
    for got, want in zip(*runs):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for i, s in enumerate(seqs):
        np.testing.assert_allclose(
            runs[0][0][i], np.asarray(reference_logits(cfg, model.params, s))[-1], **TOL
        )
    with pytest.raises(ValueError, match="unroll_tokens"):
        DecoderModel(cfg, unrolled.params, unroll_tokens=-1)


def test_compiles_bounded_by_buckets():
    cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 1})
    model = DecoderModel(cfg, seed=2)
    pool = DevicePagePool(cfg.kv_spec(16), 64)
    pages = _pages(4)
    tokens = np.arange(1, 64, dtype=np.int32)
    lengths = range(1, 64, 4)  # 16 lengths
    buckets = {(bucket(n, 16), bucket(-(-n // 16))) for n in lengths}
    before = compiled_step_count()
    for n in lengths:
        model.forward(pool, tokens[:n], 0, pages, min_bucket=16)
    # One compile per (token bucket, page-table bucket), not per length.
    assert compiled_step_count() - before == len(buckets) == 3


def test_bfloat16_model_runs_on_uint16_pool(prompt):
    cfg = ModelConfig(**{**CFG.__dict__, "dtype": "bfloat16"})
    model = DecoderModel(cfg, seed=1)
    pool = DevicePagePool(cfg.kv_spec(16), 8)
    assert pool.array.dtype == np.uint16
    logits = np.asarray(model.forward(pool, prompt, 0, _pages(3, 8), min_bucket=16))
    ref = np.asarray(reference_logits(cfg, model.params, prompt))[-1]
    np.testing.assert_allclose(logits, ref, rtol=0.05, atol=0.05)


def test_seeded_weights_are_deterministic():
    a, b, c = init_params(CFG, 3), init_params(CFG, 3), init_params(CFG, 4)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a["embed"], c["embed"])


def test_weights_roundtrip_npz(tmp_path, model, prompt, ref):
    path = str(tmp_path / "w.npz")
    save_params(model.params, path)
    loaded = DecoderModel(CFG, load_params(CFG, path))
    np.testing.assert_array_equal(np.asarray(reference_logits(CFG, loaded.params, prompt)), ref)


def test_weight_file_errors(tmp_path, model):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_params(CFG, str(tmp_path / "missing.npz"))
    bad = str(tmp_path / "w.bin")
    open(bad, "wb").close()
    with pytest.raises(ValueError, match="extension"):
        load_params(CFG, bad)
    path = str(tmp_path / "w.npz")
    save_params(model.params, path)
    bigger = ModelConfig(**{**CFG.__dict__, "d_model": 64})
    with pytest.raises(ValueError, match="'embed' has shape"):
        load_params(bigger, path)
    flat = dict(np.load(path))
    del flat["lm_head"]
    np.savez(path, **flat)
    with pytest.raises(ValueError, match="missing \\['lm_head'\\]"):
        load_params(CFG, path)


def test_safetensors_without_package_is_a_clear_error(tmp_path):
    try:
        import safetensors  # noqa: F401

        pytest.skip("safetensors is installed")
    except ImportError:
        pass
    path = tmp_path / "w.safetensors"
    path.write_bytes(b"")
    with pytest.raises(ImportError, match="pip install safetensors"):
        load_params(CFG, str(path))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("num_heads", 3, "multiple of num_kv_heads"),
        ("head_dim", 7, "even"),
        ("dtype", "int8", "float32, bfloat16 or float16"),
        ("num_layers", 0, ">= 1"),
    ],
)
def test_config_validation(field, value, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**CFG.__dict__, field: value})


def test_bad_forward_input_leaves_pool_untouched(model, prompt):
    pool = DevicePagePool(CFG.kv_spec(16), 8)
    before = pool.array
    with pytest.raises(ValueError, match="need 3 pages"):
        model.forward(pool, prompt, 0, np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="need >= 1 token"):
        model.forward(pool, prompt[:0], 0, np.array([1], np.int32))
    assert pool.array is before and not before.is_deleted()


def test_bucket():
    assert [bucket(n) for n in (0, 1, 2, 3, 16, 17)] == [1, 1, 2, 4, 16, 32]
    assert bucket(3, 16) == 16


def test_fine_bucket_and_trace_count():
    assert [fine_bucket(n) for n in range(1, 14)] == [1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    assert fine_bucket(5, 16) == 16 and fine_bucket(17, 1) == 24
    assert trace_count() == compiled_step_count()
    with pytest.raises(ValueError, match="name='x'"):
        trace_count("x")
