"""Recurrent-state (``STATE``) groups beside a full-attention group: checkpoints in state slots.

Bad input (write_state / read_state refusing a bad group, array, name, shape, dtype or page with
a typed error naming it, the cache unchanged), bad specs, the KV events of a STATE group (vLLM's
``"mamba"`` kind, one BlockStored per page holding a checkpoint), checkpoints fetched back from
L3 bit-exact (file store and a ``python://`` backend), and node splits keeping the checkpoint
at the lower node's end (SGLang's failure mode: splitting an interior node must not lose the
hit). The random workloads are the state machine's
(``test_hicache_state_machine_state_slots``)."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from helpers import snapshot, tree_pages
from hicache_jax import (
    HiCache,
    HiCacheConfig,
    HiCacheError,
    KVSpec,
    LayerGroup,
    Medium,
    OutOfPagesError,
    StateArray,
)
from hicache_jax.events import BlockRemoved, BlockStored, replay
from hicache_jax.events.records import GroupTag, group_tags

PS = 4
ARRAYS = [StateArray("conv", (2, 3), "bfloat16"), StateArray("ssm", (2, 2, 2))]
#: The same arrays with ``ssm`` split over its 2 heads: slots of two head parts (a mesh would
#: shard them as K/V), ``conv`` (no head axis) spread over both.
HEADED = [StateArray("conv", (2, 3), "bfloat16"), StateArray("ssm", (2, 2, 2), head_axis=0)]


def _spec(dtype: str = "float32", **kw) -> KVSpec:
    # "R3:F1": layers 0-2 recurrent (groups[0], the STATE group), layer 3 full (groups[1])
    return KVSpec.from_pattern(
        "R3:F1", num_layers=4, num_kv_heads=kw.pop("num_kv_heads", 1), head_dim=4,
        dtype=dtype, page_size=PS, state=kw.pop("state", ARRAYS), **kw,
    )  # fmt: skip


#: The checkpoints the cache took before tail checkpoints and the ``value`` eviction: ends,
#: branch points and interior ones, spare ones reclaimed by rank and age, nodes by LRU (what
#: the tests of those rules pin)
LRU_ENDS = {"eviction": "lru", "checkpoint_tail_pages": 0}


def _cache(spec: KVSpec | None = None, **cfg) -> HiCache:
    cfg = {
        "device_pages": 32,
        "host_pages": 64,
        "load_back_threshold": PS,
        "state_device_slots": 8,
        "state_host_slots": 16,
        **cfg,
    }
    return HiCache(spec or _spec(), HiCacheConfig(**cfg))


def _state(tokens, ends) -> list[np.ndarray]:
    """The checkpoints after ``tokens[:e]`` for each ``e``: ``[n, 3, *shape]`` per array, a
    pure function of the prefix (so one at the wrong position reads as another)."""
    out = []
    for e in ends:
        rng = np.random.default_rng(np.asarray(tokens[:e], np.int64).tolist())
        out.append([rng.standard_normal((1, 3, *a.shape)).astype(_np(a.dtype)) for a in ARRAYS])
    return [np.concatenate(parts) for parts in zip(*out, strict=True)]


def _np(dtype: str) -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def _same(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


def _insert(cache: HiCache, tokens, ends) -> np.ndarray:
    """A request computing ``tokens`` from scratch, checkpointing at each of ``ends``; its
    pages (now the tree's)."""
    tokens = np.asarray(tokens)
    pages = cache.alloc_pages(tokens.size // PS)
    if ends:
        cache.write_state(0, pages[[e // PS - 1 for e in ends]], _state(tokens, ends))
    cache.insert(tokens, pages)
    cache.check_invariants()
    return pages


def _served(cache: HiCache, tokens) -> int:
    """Tokens of ``tokens`` served from the device (after loading back any host part), the
    checkpoint at that end read bit-exact."""
    m = cache.match_prefix(np.asarray(tokens))
    if m.host_len:
        m = cache.load_back(m)
    if m.device_len:
        got = cache.read_state(0, m.device_pages[-1:])
        _same(got, _state(tokens, [m.device_len]))
    cache.check_invariants()
    return m.device_len


TOKS = np.arange(24) + 100  # 6 pages


# ----------------------------------------------------------------------------- bad input


def test_bad_writes_name_the_field_and_change_nothing():
    cache = _cache()
    tree = _insert(cache, TOKS, [24])
    mine = cache.alloc_pages(2)
    good = _state(np.arange(8), [4, 8])
    cache.write_state(0, mine, good)
    conv, ssm = good
    bad = [
        # (error, message, group, pages, state)
        (ValueError, "ssm.*expected", 0, mine, [conv, ssm[:, :, :1]]),  # shape
        (ValueError, "conv.*expected", 0, mine, [conv[:1], ssm]),  # slots != pages
        (TypeError, "conv.*dtype", 0, mine, [conv.astype(np.float32), ssm]),
        (TypeError, "ssm.*dtype", 0, mine, [conv, ssm.astype(np.float16)]),
        (ValueError, "the group's are", 0, mine, {"conv": conv}),  # missing name
        (ValueError, "the group's are", 0, mine, {"conv": conv, "ssm": ssm, "h": ssm}),
        (ValueError, "the group's are", 0, mine, [conv]),
        (TypeError, "sequence or mapping", 0, mine, conv.tobytes()),
        (ValueError, "group=1", 1, mine, good),  # the full group
        (ValueError, "group=2", 2, mine, good),
        (ValueError, "group=True", True, mine, good),
        (ValueError, "group='0'", "0", mine, good),
        (HiCacheError, "caller-owned", 0, tree[-2:], good),  # checkpoints are read-only
        (HiCacheError, "caller-owned", 0, np.array([tree[-1], mine[0]]), good),
        (HiCacheError, "caller-owned", 0, np.array([31, 30]), good),  # free pages
    ]
    for err, msg, group, pages, state in bad:
        before = snapshot(cache)
        with pytest.raises(err, match=msg):
            cache.write_state(group, pages, state)
        assert snapshot(cache) == before, msg
        _same(cache.read_state(0, mine), good)  # the caller's own checkpoints as written
        assert _served(cache, TOKS) == 24  # and the tree's
    # a page holding no checkpoint, a non-state group, an unallocated page
    for err, msg, group, pages in [
        (HiCacheError, "no checkpoint of state group 0", 0, tree[:1]),
        (ValueError, "group=1", 1, tree[-1:]),
        (HiCacheError, "allocated", 0, np.array([31])),
    ]:
        before = snapshot(cache)
        with pytest.raises(err, match=msg):
            cache.read_state(group, pages)
        assert snapshot(cache) == before
    cache.free_pages(mine)
    cache.check_invariants()
    assert cache.stats()["state_device_used_slots"] == 1


def test_zero_pages_write_and_read_nothing():
    """No page: a no-op write, empty arrays read (both raised ZeroDivisionError: a reshape of
    0 slots with -1)."""
    cache = _cache()
    none = np.zeros(0, np.int32)
    before = snapshot(cache)
    cache.write_state(0, none, [a[:0] for a in _state(TOKS, [4])])
    assert snapshot(cache) == before
    got = cache.read_state(0, none)
    assert [a.shape for a in got] == [(0, 3, *a.shape) for a in ARRAYS]
    assert [np.dtype(a.dtype) for a in got] == [_np(a.dtype) for a in ARRAYS]


def test_a_slot_not_had_takes_nothing():
    cache = _cache(state_device_slots=2)
    mine = cache.alloc_pages(3)
    before = snapshot(cache)
    with pytest.raises(OutOfPagesError):
        cache.write_state(0, mine, _state(TOKS, [4, 8, 12]))
    assert snapshot(cache) == before
    assert cache.stats()["state_device_used_slots"] == 0
    cache.check_invariants()


def test_a_spec_without_state_groups_refuses_state_calls():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=PS)
    cache = HiCache(spec, HiCacheConfig(device_pages=8, host_pages=8))
    pages = cache.alloc_pages(1)
    with pytest.raises(HiCacheError, match="no state"):
        cache.write_state(0, pages, _state(TOKS, [4]))
    with pytest.raises(HiCacheError, match="no state"):
        cache.read_state(0, pages)
    assert cache.checkpoint_positions(TOKS, 0) == []


@pytest.mark.parametrize(
    "make,msg",
    [
        (lambda: StateArray("a", (0, 3)), r"shape\[0\]=0 must be a positive int"),
        (lambda: StateArray("a", (2, -1)), r"shape\[1\]=-1"),
        (lambda: StateArray("a", (2,), "float64"), "dtype='float64' is not one of"),
        (lambda: StateArray("", (2,)), "name=''"),
        (lambda: StateArray("a", (2, 3), head_axis=2), r"head_axis=2 must be an axis of shape"),
        (lambda: StateArray("a", (2,), head_axis=-1), r"head_axis=-1 must be an axis"),
        (lambda: StateArray("a", (2,), head_axis="0"), r"head_axis='0' must be an int or None"),
        (lambda: StateArray("a", (2,), head_axis=True), r"head_axis=True must be an int"),
        (
            lambda: _spec(state=[{"name": "a", "shape": (2,), "heads": 0}]),
            r"state\[0\]\.unknown field\(s\) \['heads'\]",
        ),
        (lambda: _spec(state=[StateArray("a", (2,)), StateArray("a", (3,))]), "duplicate name"),
        (lambda: _spec(state=[{"name": "a", "shape": (0,)}]), r"state\[0\]\.shape\[0\]=0"),
        (lambda: _spec(state=[{"name": "a", "shape": (2,), "dtype": "x"}]), r"state\[0\]\.dtype"),
        (lambda: _spec(state=None), "give state="),
        (lambda: _spec(state=[]), "give state="),
        (
            lambda: LayerGroup("state", (0,), num_kv_heads=2, state=ARRAYS),
            "num_kv_heads=2: a 'state' group has no K/V",
        ),
        (
            lambda: LayerGroup("state", (0,), head_dim=2, state=ARRAYS),
            "head_dim=2: a 'state' group",
        ),
        (lambda: LayerGroup("state", (0,), window=8, state=ARRAYS), "window=8"),
        (lambda: LayerGroup("state", (0,)), "state=.*at least one array"),
        (
            lambda: LayerGroup("full", (0,), num_kv_heads=1, head_dim=4, state=ARRAYS),
            "for 'state' groups only",
        ),
    ],
)
def test_bad_specs_name_the_field(make, msg):
    with pytest.raises((ValueError, TypeError), match=msg):
        make()


def test_slots_split_over_heads_keep_each_heads_part_in_its_head():
    """With a head axis, a slot's row is ``state_heads`` parts: head ``h``'s slice of every
    array that names one lands in head ``h`` only (so a mesh's device holds its own heads'
    state), an array without one is spread over the parts, and the round trip is bit-exact
    for odd sizes and every dtype width; without one the layout is the single-row one."""
    import jax.numpy as jnp

    from hicache_jax.memory.state import pack_state, unpack_state

    arrays = [
        StateArray("conv", (3, 5), "bfloat16"),  # 30 bytes: 8 words over 4 parts
        StateArray("ssm", (4, 3, 3), "float16", head_axis=0),
        StateArray("gate", (3, 8), "int8", head_axis=1),  # 8 = 2 x 4 heads
    ]
    group = LayerGroup("state", (0, 1), state=arrays)
    assert group.state_heads == 4
    assert group.spec(PS).kv_shape(1) == (2, 2, 1, 1, 4, group.head_words // 2)
    rng = np.random.default_rng(3)
    n = 3

    def draw():
        return [
            jnp.asarray(rng.integers(-100, 100, (n, 2, *a.shape)).astype(_np(a.dtype)))
            for a in arrays
        ]

    xs = draw()
    bits = np.asarray(pack_state(group, xs))
    for got, want in zip(unpack_state(group, jnp.asarray(bits)), xs, strict=True):
        _same([got], [want])
    ssm = np.array(xs[1])
    ssm[1, 0, 2] += 1  # slot 1, layer 0, head 2 of ssm
    changed = np.asarray(pack_state(group, [xs[0], jnp.asarray(ssm), xs[2]])) != bits
    assert changed.any()
    layer, _, slot, _, head, _ = np.nonzero(changed)
    assert set(layer) == {0} and set(slot) == {1} and set(head) == {2}
    gate = np.array(xs[2])
    gate[0, 1, 2, 7] += 1  # channel 7 of 8: head 3
    changed = np.asarray(pack_state(group, [xs[0], xs[1], jnp.asarray(gate)])) != bits
    assert set(np.nonzero(changed)[4]) == {3}
    plain = LayerGroup("state", (0, 1), state=ARRAYS)
    assert plain.state_heads == 1 and plain.spec(PS).mla  # one latent row: the same as ever
    assert plain.slot_words == sum(-(-a.nbytes // 4) for a in ARRAYS)


# ----------------------------------------------------------------------------- KV events


def test_the_default_recurrent_state_is_split_over_qwen3_next_heads():
    """``--layer-pattern R3:F1`` without ``--state`` (``QWEN3_NEXT_STATE``) names every
    array's heads, so a tensor-parallel mesh of up to 16 devices shards its slots: 16 parts,
    the same words as one conv array of 8192 channels beside the recurrent state."""
    from hicache_jax.spec import QWEN3_NEXT_STATE, pattern_state

    assert pattern_state("R3:F1", None) == QWEN3_NEXT_STATE
    assert all(a.head_axis is not None for a in QWEN3_NEXT_STATE)
    group = KVSpec.from_pattern(
        "R3:F1", num_layers=4, num_kv_heads=2, head_dim=8, page_size=16, state=QWEN3_NEXT_STATE
    ).window_groups[0]
    assert group.state_heads == 16
    assert group.slot_words == 3 * 8192 + 32 * 128 * 128
    assert group.slot_words == group.state_heads * group.head_words


def test_state_group_events_are_vllms_mamba_kind():
    """vLLM names a MambaSpec group (Mamba, linear attention, GDN) ``"mamba"`` and announces
    the blocks holding a state: here one BlockStored per page holding a checkpoint, under the
    full-attention page's hash at that position, on each tier holding it; BlockRemoved when
    it goes (with its page, or reclaimed spare). Replaying the events gives the slots held."""
    spec = _spec()
    assert group_tags(spec) == [GroupTag(0, "mamba", None), GroupTag(1, "full_attention", None)]
    cache = _cache(spec, kv_events={"publisher": "queue"}, write_policy="write_through")
    _insert(cache, TOKS, [12, 24])  # an interior (spare) checkpoint and the end's
    cache.flush()
    events = cache.take_events()
    full = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 1]
    state = [e for e in events if isinstance(e, BlockStored) and e.group_idx == 0]
    by_hash = {e.block_hash: e for e in full if e.medium is Medium.DEVICE}
    assert len(by_hash) == 6
    for medium in (Medium.DEVICE, Medium.HOST):
        mine = [e for e in state if e.medium is medium]
        assert [e.token_ids[-1] for e in mine] == [TOKS[11], TOKS[23]], medium
        for e in mine:
            assert e.kv_cache_spec_kind == "mamba" and e.kv_cache_spec_sliding_window is None
            f = by_hash[e.block_hash]  # the full page's hash, parent and tokens at that position
            assert (e.parent_block_hash, e.token_ids) == (f.parent_block_hash, f.token_ids)
    router = replay(events)
    assert router == tree_pages(cache)
    cache.evict(24)  # the device copies go: their slots' events with them
    events = cache.take_events()
    gone = [e for e in events if isinstance(e, BlockRemoved) and e.group_idx == 0]
    assert gone and all(e.medium is Medium.DEVICE for e in gone)
    assert replay(events, router) == tree_pages(cache)
    assert {(m, g) for _, m, g in tree_pages(cache)} == {(Medium.HOST, 0), (Medium.HOST, 1)}


# ----------------------------------------------------------------------------- L3


def _l3_cache(url: str, **cfg) -> HiCache:
    return _cache(storage=url, write_through_threshold=1, prefetch_policy="wait_complete", **cfg)


@pytest.mark.parametrize("backend", ["file", "python"])
def test_checkpoint_evicted_from_l1_and_l2_is_fetched_back_from_l3_bit_exact(
    tmp_path, monkeypatch, backend
):
    """Put with its page (every checkpoint, the spare one inside the node too), evicted from
    both local tiers, prefetched and loaded back: the checkpoint reads back bit-exact."""
    if backend == "file":
        url = f"file://{tmp_path / 'store'}"
    else:  # the example backend (examples/memory_storage.py), loaded by module path
        monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent.parent / "examples"))
        url = "python://memory_storage:MemoryStorage"
    cache = _l3_cache(url)
    _insert(cache, TOKS, [12, 24])
    cache.flush()
    s = cache.stats()
    assert s["l3_window_put_pages"] == s["l3_window_put_pages_stored"] == 2  # 12 and 24
    cache.evict(24)
    cache.evict_host(24)
    assert cache.stats()["state_device_used_slots"] == cache.stats()["state_host_used_slots"] == 0
    m = cache.match_prefix(TOKS)
    assert m.device_len == m.host_len == 0  # only L3 holds it
    h = cache.prefetch(TOKS)
    assert h is not None and h.wait() == 6
    assert _served(cache, TOKS) == 24  # the end's checkpoint, bit-exact
    assert cache.stats()["l3_window_prefetch_hit_pages"] == 1
    # the interior one was spare: never put, so a prefix ending there is not served from L3
    assert _served(cache, TOKS[:12]) == 0
    cache.close()
    if backend == "file":  # a fresh cache on the same store
        fresh = _l3_cache(url)
        h = fresh.prefetch(TOKS)
        assert h is not None and h.wait() == 6
        assert _served(fresh, TOKS) == 24
        fresh.close()


def test_a_fresh_cache_is_served_from_the_deepest_checkpoint_l3_holds(tmp_path):
    """Another cache on the same store (a restart, a second server) serving a prompt that
    leaves the stored one inside its node: the lookup fetches the pages up to the deepest
    checkpoint L3 holds (an interior one: every checkpoint is put), not beyond it, and the
    prefix there is served bit-exact; a prompt with no checkpoint in L3 fetches nothing."""
    url = f"file://{tmp_path / 'store'}"
    a = _l3_cache(url)
    _insert(a, TOKS, [8, 16, 24])  # the node's end and two interior checkpoints
    a.flush()
    assert a.stats()["l3_window_put_pages_stored"] == 3
    a.close()
    b = _l3_cache(url)
    leave = np.concatenate([TOKS[:20], np.arange(8) + 900])  # 5 pages shared: 16 the deepest
    h = b.prefetch(leave)
    assert h is not None and h.wait() == 4  # page 5 (no checkpoint at its end) not fetched
    assert b.stats()["l3_window_unservable_pages"] == 1
    assert _served(b, leave) == 16
    none = np.concatenate([TOKS[:4], np.arange(20) + 900])  # 1 page shared: no checkpoint
    assert b.prefetch(none) is None
    assert _served(b, none) == 0
    b.close()


def test_slots_split_over_heads_on_a_mesh_read_back_exact_on_every_tier(tmp_path):
    """Over a 2-device mesh, a group whose ``ssm`` names its head axis keeps its slot pools
    sharded over those heads (each device half of every slot): a checkpoint written, backed
    up, evicted from L1 and L2, fetched from L3 and loaded back reads back bit-exact, and a
    fresh unsharded cache on the same store reads the same bits (the layout does not depend
    on the mesh)."""
    import jax

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("tp",))
    url = f"file://{tmp_path / 'store'}"
    spec = _spec(state=HEADED, num_kv_heads=2)
    assert spec.window_groups[0].state_heads == 2
    cache = _cache(spec, mesh=mesh, storage=url, write_through_threshold=1,
                   prefetch_policy="wait_complete")  # fmt: skip
    sharding = cache.window_pools[0].array.sharding
    assert not sharding.is_fully_replicated and sharding.spec[4] == "tp"
    _insert(cache, TOKS, [12, 24])
    assert _served(cache, TOKS) == 24
    cache.flush()
    cache.evict(24)
    assert _served(cache, TOKS) == 24  # from L2, loaded back
    cache.evict(24)
    cache.evict_host(24)
    h = cache.prefetch(TOKS)
    assert h is not None and h.wait() == 6
    assert _served(cache, TOKS) == 24  # from L3
    assert cache.stats()["l3_window_prefetch_hit_pages"] == 1
    cache.close()
    fresh = _cache(spec, storage=url, write_through_threshold=1, prefetch_policy="wait_complete")
    h = fresh.prefetch(TOKS)
    assert h is not None and h.wait() == 6
    assert _served(fresh, TOKS) == 24
    fresh.close()
    # a mesh that does not divide the state's heads is refused, naming the group's field
    four = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("tp",))
    with pytest.raises(ValueError, match=r"groups\[0\]\.state_heads=2 .* size 4 of mesh axis"):
        _cache(_spec(state=HEADED, num_kv_heads=4), mesh=four)


# ----------------------------------------------------------------------------- splits


@pytest.mark.parametrize("tier", ["device", "host"])
def test_a_split_keeps_the_checkpoint_at_the_lower_nodes_end(tier):
    """Insert A (one node, a checkpoint at its end only); B diverges inside A's node at 12
    tokens (inside a page): the split's upper end has no checkpoint, so B is served nothing,
    while A's whole prompt is still served from its end's checkpoint (the lower node's end
    is A's last page). B writes a checkpoint at the split point, as checkpoint_positions
    asks; then a prefix ending there is served, from B's checkpoint, and A still whole."""
    cache = _cache(write_policy="write_through", **LRU_ENDS)
    _insert(cache, TOKS, [24])
    if tier == "host":
        cache.flush()
        cache.evict(24)
    b = np.concatenate([TOKS[:14], 900 + np.arange(10)])
    assert cache.match_prefix(b).device_len == 0  # splits A at 12 tokens (page-granular)
    assert len(list(cache.tree.nodes())) == 2
    assert _served(cache, TOKS) == 24  # (host: loaded back) no hit lost
    m = cache.match_prefix(b)
    assert (m.device_len, m.host_len) == (0, 0)
    ends = cache.checkpoint_positions(b, 0)
    assert ends == [12, 24]  # the split point (where the tree goes on) and the prompt's end
    _insert(cache, b, ends)
    assert _served(cache, b) == 24
    c = np.concatenate([TOKS[:12], 700 + np.arange(12)])  # a third branch at the split
    assert _served(cache, c) == 12  # B's checkpoint, now the tree's page's
    assert _served(cache, TOKS) == 24


def test_a_branch_checkpoint_written_after_the_backup_reaches_the_host_copy():
    """A backs up whole (no checkpoint at 12); B splits it there and writes the branch
    point's checkpoint, which the tree's page takes: the node's host copy gets it too, so
    once the device copies are evicted the prefix is still served from host, bit-exact."""
    cache = _cache(write_policy="write_through", write_through_threshold=1)
    _insert(cache, TOKS, [24])  # one node, backed up at once, its checkpoint at its end
    assert cache.stats()["backups"] == 1
    cache.flush()
    b = np.concatenate([TOKS[:12], np.arange(12) + 900])
    _insert(cache, b, [12, 24])  # splits A at 12; its checkpoint there becomes the tree's
    cache.flush()
    assert cache.stats()["window_host_pages_patched"] == 1
    cache.evict(10_000)
    assert cache.stats()["device_used_pages"] == 0
    c = np.concatenate([TOKS[:12], np.arange(12) + 500])
    assert _served(cache, c) == 12  # loaded back from host with the checkpoint at 12


def test_a_split_at_a_spare_checkpoint_serves_at_once():
    """A checkpointed at 12 (interior: spare) and 24: a request diverging at 12 is served 12
    tokens from the spare checkpoint, which becomes the new node's end (no longer spare), and
    A is still served whole."""
    cache = _cache(**LRU_ENDS)
    _insert(cache, TOKS, [12, 24])
    assert cache.stats()["state_device_spare_slots"] == 1
    c = np.concatenate([TOKS[:12], 700 + np.arange(12)])
    assert _served(cache, c) == 12
    assert cache.stats()["state_device_spare_slots"] == 0
    assert _served(cache, TOKS) == 24
    assert cache.checkpoint_positions(c, 12) == [24]


def test_interior_checkpoints_are_asked_for_only_where_slots_have_room():
    """A request's interior checkpoints (every page here) are asked for highest rank first
    (the every-8-pages one, then every 4, ...) as far as the device slots have room: free,
    or holding a spare checkpoint of no higher rank; its end is counted first. With room
    for all, all are asked for."""
    b = 500 + np.arange(9 * PS)  # 9 pages: interior ends at pages 1..8, the end at 9
    roomy = _cache(checkpoint_every_pages=1, state_device_slots=16, **LRU_ENDS)
    assert roomy.checkpoint_positions(b, 0) == [PS * p for p in range(1, 10)]
    cache = _cache(checkpoint_every_pages=1, state_device_slots=4, **LRU_ENDS)
    # 4 slots, the end takes one: pages 8 (rank 3), 4 (rank 2), then the first of rank 1
    assert cache.checkpoint_positions(b, 0) == [PS * p for p in (2, 4, 8, 9)]
    _insert(cache, TOKS, [PS, 2 * PS, 24])  # spare checkpoints at pages 1 and 2 (ranks 0, 1)
    assert cache.stats()["state_device_spare_slots"] == 2
    # one slot free (the end's): the two spare ones can go to ranks 3 and 2, none to rank 1
    assert cache.checkpoint_positions(b, 0) == [PS * p for p in (4, 8, 9)]
    assert _served(cache, TOKS) == 24  # asking reclaims nothing


def test_a_match_with_a_host_part_holds_its_device_end_for_a_device_only_serve():
    """A match whose device part ends at a branch point (a spare checkpoint) and goes on in
    host pages: a caller may serve the device part alone (no load-back). Other requests
    taking slots before it locks must not reclaim that checkpoint (found by the long
    state-machine profile: a batch's matches made first, a later one's ``read_state`` then
    found no checkpoint at its device end)."""
    cache = _cache(write_policy="write_through", write_through_threshold=1, state_device_slots=3)
    b = np.concatenate([TOKS[:12], 700 + np.arange(12)])
    _insert(cache, TOKS, [12, 24])
    _insert(cache, b, [24])  # TOKS[:12] is now a branch point: its checkpoint spare
    assert _served(cache, b) == 24  # B's leaf the more recent: A's is evicted first
    cache.flush()
    cache.evict(12)
    m = cache.match_prefix(TOKS)
    assert (m.device_len, m.host_len) == (12, 12)
    assert cache.stats()["state_device_spare_slots"] == 0  # held by the match
    other = cache.alloc_pages(2)  # another request's two checkpoints: one slot is free
    cache.write_state(0, other, _state(900 + np.arange(8), [4, 8]))
    cache.lock(m.node)  # not stale: the device part and its checkpoint are still there
    _same(cache.read_state(0, m.device_pages[-1:]), _state(TOKS, [12]))
    cache.unlock(m.node)
    cache.free_pages(other)
    cache.check_invariants()


def _split_a_then_evict_its_tail(**cfg) -> HiCache:
    """A (one node, its checkpoint at 24 only) backed up, split at 12 by a match, its lower
    node (a leaf) evicted from device: device pages 0-12 whose end holds no checkpoint, then
    host pages 12-24 ending at A's."""
    cache = _cache(write_policy="write_through", write_through_threshold=1, **cfg)
    _insert(cache, TOKS, [24])
    cache.flush()
    cache.match_prefix(np.concatenate([TOKS[:12], 700 + np.arange(12)]))  # splits A at 12
    assert cache.evict(12) == 12
    return cache


def test_device_pages_past_the_last_checkpoint_are_served_with_the_host_part():
    """The device part serves nothing alone (no checkpoint at 12): the Match's device part is
    empty and its host part counts the 12 device tokens (resident, never copied) and the 12
    on host; the load-back copies the 3 host pages (and the slot) only, and serves all 24
    bit-exact (before, the host part was dropped with the device part: nothing served)."""
    cache = _split_a_then_evict_its_tail()
    m = cache.match_prefix(TOKS)
    assert (m.device_len, m.host_len, m.resident_len) == (0, 24, 12)
    assert m.device_pages.size == 0 and m.resident_pages.size == 3
    moved = cache.stats()["bytes_to_device"]
    lm = cache.load_back(m)
    assert (lm.device_len, lm.host_len) == (24, 0)
    np.testing.assert_array_equal(lm.device_pages[:3], m.resident_pages)
    cache.flush()  # (counted when the copy completes; full-attention pages)
    assert cache.stats()["bytes_to_device"] - moved == 3 * cache.spec.page_bytes
    _same(cache.read_state(0, lm.device_pages[-1:]), _state(TOKS, [24]))
    cache.check_invariants()


@pytest.mark.parametrize("threshold", [PS, 16, 28])
def test_a_request_served_through_resident_pages_counts_each_tier(threshold):
    """begin() of that prompt: loaded (threshold 4, or 16: the load serves the 12 resident
    tokens with the 12 it copies, so it is weighed as 24, ``host_len``), 12 tokens were an L1
    hit and 12 an L2 hit; declined (threshold 28), nothing is served (the device part alone
    ends at no checkpoint) and all 24 matched tokens count as declined."""
    cache = _split_a_then_evict_its_tail(load_back_threshold=threshold)
    with cache.begin(np.concatenate([TOKS, [1, 2]])) as req:
        sv = req.served
        if threshold <= 24:
            assert (req.cached_len, req.loaded_len, req.host_len_declined) == (24, 12, 0)
            assert (sv.device_tokens, sv.host_tokens, sv.recomputed_tokens) == (12, 12, 2)
            _same(cache.read_state(0, req.device_pages[5:6]), _state(TOKS, [24]))
        else:
            assert (req.cached_len, req.loaded_len, req.host_len_declined) == (0, 0, 24)
            assert (sv.device_tokens, sv.host_tokens, sv.recomputed_tokens) == (0, 0, 26)
        req.abort()
    cache.check_invariants()


def test_the_cost_rule_loads_a_chain_after_resident_pages_whole():
    """The cost model prices a chain whose device prefix serves; after resident pages a part
    would serve nothing and a decline recomputes them too: the chain is loaded whole (the
    threshold rule's decision over ``host_len``), served bit-exact."""
    cache = _split_a_then_evict_its_tail(load_policy="cost")
    with cache.begin(TOKS) as req:
        assert (req.cached_len, req.loaded_len) == (24, 12)
        _same(cache.read_state(0, req.device_pages[-1:]), _state(TOKS, [24]))
        req.abort()
    cache.check_invariants()


def test_the_cost_rule_loads_a_part_only_as_far_as_a_checkpoint():
    """A's 24 tokens on host, checkpoints at 8 and 24, split at 12; the cost rule may load 12
    tokens at most (``max_load_tokens``). Once its link is measured (a first request's probe,
    which serves nothing here), the model picks the node end at 12, which holds no
    checkpoint: it loads 8 instead (2 pages, the node split there) and serves them bit-exact
    (before: 3 pages copied for the same 8 tokens served)."""
    cache = _cache(
        write_policy="write_through", write_through_threshold=1, load_policy="cost",
        max_load_tokens=12, prefill_cost=lambda n, c: float(n),  # a slow prefill: load
    )  # fmt: skip
    _insert(cache, TOKS, [8, 24])
    cache.flush()
    prompt = np.concatenate([TOKS, [1, 2]])
    for probe in (True, False):
        cache.evict(24)
        if not probe:
            cache.match_prefix(np.concatenate([TOKS[:12], 700 + np.arange(12)]))  # split at 12
        moved = cache.stats()["bytes_to_device"]
        with cache.begin(prompt) as req:
            if not probe:
                assert (req.cached_len, req.loaded_len) == (8, 8)
                _same(cache.read_state(0, req.device_pages[1:2]), _state(TOKS, [8]))
            req.abort()
        cache.flush()
        assert cache.stats()["cost_probes"] == 1
    assert cache.stats()["bytes_to_device"] - moved == 2 * cache.spec.page_bytes
    cache.check_invariants()


# ----------------------------------------------------------------------------- random workloads


def _prompts(rng, n: int = 6) -> list[np.ndarray]:
    """Prompts sharing prefixes (3 heads, branches diverging inside pages), whole pages."""
    heads = [rng.integers(0, 1000, rng.integers(1, 4) * PS) for _ in range(3)]
    out = []
    for i in range(n):
        h = heads[i % 3]
        tail = rng.integers(0, 1000, rng.integers(1, 3) * PS + int(rng.integers(0, 3)))
        cut = int(rng.integers(h.size // 2, h.size + 1))  # a branch inside the head
        out.append(np.concatenate([h[:cut], tail]))
    return [p[: p.size // PS * PS] for p in out]


@pytest.mark.parametrize(
    "policy,every,arrays,placement",
    [
        ("write_through", 0, ARRAYS, LRU_ENDS),
        ("write_back", 2, ARRAYS, LRU_ENDS),
        ("write_back", 2, HEADED, LRU_ENDS),
        ("write_through", None, ARRAYS, {}),
        ("write_back", None, HEADED, {}),
    ],
    ids=["write_through", "write_back", "write_back-heads", "default", "write_back-default"],
)
def test_random_requests_through_l3_read_back_every_checkpoint_exact(
    tmp_path, policy, every, arrays, placement
):
    """Two instances take turns over prompts sharing prefixes on one file store, pools (and
    slot pools) far too small, so pages and their checkpoints move L1 -> L2 -> L3 and back:
    every hit's checkpoint reads back as taken, every slot held on either tier is the one
    taken at its page's end (ServedKV), none leaked; by age (``LRU_ENDS``) and by worth (the
    default: the ``value`` eviction, tail checkpoints)."""
    from helpers import ServedKV

    url = f"file://{tmp_path / 'store'}"
    rng = np.random.default_rng(11)
    prompts = _prompts(rng)
    spec = _spec("bfloat16", state=arrays)  # (ServedKV's KV model: 16-bit KV)
    caches = [
        _cache(
            spec,
            storage=url,
            device_pages=10,
            host_pages=10,
            state_device_slots=4,
            state_host_slots=4,
            write_policy=policy,
            write_through_threshold=1,
            prefetch_policy="wait_complete",
            checkpoint_every_pages=every,
            **placement,
        )
        for _ in range(2)
    ]
    served = [ServedKV(c) for c in caches]
    for sm in served[1].states:  # one model: both instances take the same checkpoints
        sm.taken = served[0].states[0].taken
    hits = 0
    for step in range(30):
        i = int(step % 3 == 2)
        toks = prompts[rng.integers(len(prompts))]
        caches[1 - i].flush()
        if rng.random() < 0.7:
            h = caches[i].prefetch(toks)
            if h is not None:
                h.wait()
        hits += served[i](toks) > 0
    from_l3 = 0
    for cache, s in zip(caches, served, strict=True):
        cache.flush()
        s.check()
        from_l3 += cache.stats()["l3_window_prefetch_hit_pages"]
        cache.close()
    assert hits and from_l3 > 0  # checkpoints were served, some fetched from L3
    assert served[0].checkpoints + served[1].checkpoints > 0


def test_random_workload_events_replay_to_the_slots_held():
    """KV events with vLLM block hashes over a random workload with small slot pools (spare
    slots reclaimed, nodes evicted for slots): replaying them gives as many pages of each
    (medium, group) as the cache holds, the mamba group's being its slots."""
    from helpers import ServedKV

    rng = np.random.default_rng(5)
    kv = {"publisher": "queue", "block_hash": "tree"}
    cache = _cache(
        _spec("bfloat16"),
        kv_events=kv,
        device_pages=12,
        host_pages=16,
        state_device_slots=4,
        state_host_slots=6,
        write_policy="write_back",
        checkpoint_every_pages=1,
    )
    served = ServedKV(cache)
    prompts = _prompts(rng, 8)
    router: set = set()
    for _ in range(60):
        op = rng.integers(8)
        if op < 5:
            served(prompts[rng.integers(len(prompts))])
        elif op == 5:
            cache.evict(int(rng.integers(1, 6)) * PS)
        elif op == 6:
            cache.evict_host(int(rng.integers(1, 6)) * PS)
        else:
            cache.flush()
        router = replay(cache.take_events(), router)
        assert router == tree_pages(cache)
    assert any(g == 0 for _, _, g in router)
    assert cache.stats()["window_spare_reclaimed"] > 0
    cache.flush()
    for _ in range(3):
        cache.evict(1 << 20)
        cache.evict_host(1 << 20)
    assert replay(cache.take_events(), router) == tree_pages(cache) == set()
    cache.close()


def test_lookup_reports_what_match_prefix_serves():
    """lookup (read-only) reported the tree's pages, 12 device tokens where no checkpoint
    ends and match_prefix serves nothing; it reports the servable prefix now, per tier."""
    cache = _cache(write_policy="write_through")
    _insert(cache, TOKS, [24])
    branch = np.concatenate([TOKS[:12], 700 + np.arange(12)])
    for toks in (TOKS, TOKS[:12], branch, TOKS[:12]):
        want = cache.lookup(toks)
        m = cache.match_prefix(toks)
        assert want == {"device": m.device_len, "host": m.host_len}, toks.size
    assert cache.lookup(TOKS[:12]) == {"device": 0, "host": 0}
    cache.flush()
    cache.evict(24)
    assert cache.lookup(TOKS) == {"device": 0, "host": 24}
    assert cache.lookup(TOKS[:12]) == {"device": 0, "host": 0}


def test_write_window_kv_refuses_a_state_group():
    """Checkpoints are written only through write_state (its checks): the raw page call of
    window groups refuses a state group's index."""
    spec = KVSpec.from_pattern(
        "R1:F1",
        num_layers=2,
        num_kv_heads=1,
        head_dim=4,
        dtype="float32",
        page_size=4,
        state=[StateArray("s", (2,))],
    )
    cache = HiCache(spec, HiCacheConfig(device_pages=8, host_pages=16, state_device_slots=4))
    pages = cache.alloc_pages(1)
    kv = np.zeros(spec.window_groups[0].spec(4).kv_shape(1), np.float32)
    with pytest.raises(ValueError, match="state group: checkpoints go through write_state"):
        cache.write_window_kv(0, pages, kv)


# ------------------------------------------- the default: tail checkpoints, kept by worth


def test_a_tail_checkpoint_serves_a_request_that_leaves_the_prompt_before_its_end():
    """By default a prefill checkpoints ``checkpoint_tail_pages`` (4) pages before its
    prompt's end too: a later request that shares the prompt up to a page past that point is
    served up to it (the end alone would serve it nothing), bit-exact, from host as well."""
    cache = _cache(write_policy="write_through", write_through_threshold=1)
    a = np.arange(10 * PS) + 100  # 10 pages: the tail checkpoint 4 pages before the end
    ends = cache.checkpoint_positions(a, 0)
    assert ends == [6 * PS, 10 * PS]
    _insert(cache, a, ends)
    b = np.concatenate([a[: 7 * PS + 2], 900 + np.arange(3 * PS)])  # leaves a in page 8
    assert _served(cache, b) == 6 * PS
    cache.flush()
    cache.evict(10_000)
    assert cache.stats()["device_used_pages"] == 0
    assert _served(cache, b) == 6 * PS  # loaded back with its checkpoint
    none = _cache(checkpoint_tail_pages=0)
    assert none.checkpoint_positions(a, 0) == [10 * PS]
    assert none.checkpoint_positions(a, 7 * PS) == [10 * PS]  # (past the tail: none)
    assert cache.checkpoint_positions(a, 7 * PS) == [10 * PS]


def test_the_tail_checkpoint_never_takes_the_ends_slot():
    """With one device slot the end is asked for alone: a tail checkpoint only where the
    slots have room beside the firm ones."""
    one = _cache(state_device_slots=1)
    a = np.arange(10 * PS) + 100
    assert one.checkpoint_positions(a, 0) == [10 * PS]
    two = _cache(state_device_slots=2)
    assert two.checkpoint_positions(a, 0) == [6 * PS, 10 * PS]


def test_value_eviction_keeps_a_long_prompts_checkpoint_over_a_short_ones():
    """The default eviction with state groups is ``value``: every checkpoint of the tree is
    spare (reclaimable), and slots run short take the least worth first (its prefix's pages
    squared over a slot's size, above a clock), so a long prompt's checkpoint outlives short
    prompts' written after it, where the age order (``lru``) would take it first. The
    checkpoints kept read back bit-exact."""
    long = np.arange(12 * PS) + 100
    shorts = [np.arange(2 * PS) + 1000 * (i + 1) for i in range(3)]
    served = {}
    for eviction in ("value", "lru"):
        cache = _cache(
            eviction=None if eviction == "value" else eviction,
            device_pages=32,
            host_pages=0,
            state_device_slots=3,
            checkpoint_tail_pages=0,
        )
        assert cache.cfg.eviction == eviction
        _insert(cache, long, [12 * PS])
        for s in shorts:
            _insert(cache, s, [2 * PS])
        if eviction == "value":  # the tree's checkpoints are all spare, the long one kept
            assert cache.stats()["state_device_spare_slots"] == 3
        served[eviction] = _served(cache, long)
    assert served == {"value": 12 * PS, "lru": 0}


def test_tail_checkpoints_are_worth_what_their_hits_show():
    """Under ``value``, a checkpoint inside a node is worth its position's squared pages
    times how often matches ended inside a node so far against at a node's end (at most 1):
    after matches that all ended at prompt ends (a conversation's turns), a new prompt's tail
    checkpoint is reclaimed before an older, shorter prompt's end."""
    cache = _cache(device_pages=64, host_pages=0, state_device_slots=3)
    c = np.arange(5 * PS) + 3000
    _insert(cache, c, cache.checkpoint_positions(c, 0))  # 5 pages: the end alone
    for _ in range(3):  # a request served c whole, then inserted it (its finish)
        assert _served(cache, c) == 5 * PS
        _insert(cache, c, [])  # (re-marks c's end spare: the match held it)
    w = cache._windows
    assert (w.inner_hits, w.end_hits) == (0, 3)
    a = np.arange(10 * PS) + 100
    assert cache.checkpoint_positions(a, 0) == [6 * PS, 10 * PS]
    _insert(cache, a, [6 * PS, 10 * PS])  # (a's tail: 36 / 4 over a slot's pages; c's end 25)
    d = np.arange(3 * PS) + 5000
    _insert(cache, d, [3 * PS])  # takes the least worth's slot: a's tail
    leave = np.concatenate([a[: 7 * PS], 900 + np.arange(PS)])
    assert _served(cache, leave) == 0
    assert _served(cache, c) == 5 * PS and _served(cache, a) == 10 * PS


def test_a_match_served_alone_up_to_an_inner_checkpoint_splits_the_node_there():
    """Under ``value`` a node's end checkpoint can go while one inside it stays: a match whose
    host part is servable past its device part then serves the device part alone up to that
    inner checkpoint, and the tree is split there, so the checkpoint the match holds is a
    node's end (nothing unspare inside a node: check_invariants), and both parts serve."""
    cache = _cache(write_policy="write_through", write_through_threshold=1)
    a = np.arange(10 * PS) + 100
    pages = _insert(cache, a, [6 * PS, 10 * PS])
    b = np.concatenate([a, np.arange(4 * PS) + 700])
    _insert(cache, b, [14 * PS])
    cache.flush()
    cache.evict(4 * PS)  # b's own node goes to host (backed up: write_through)
    cache.flush()
    w = cache._windows
    w.device.detach_group(0, pages[9:10])  # a's end checkpoint reclaimed on device alone
    nodes = len(list(cache.tree.nodes()))
    m = cache.match_prefix(b)
    assert (m.device_len, m.host_len) == (6 * PS, 8 * PS)  # alone up to the inner one
    cache.check_invariants()
    assert len(list(cache.tree.nodes())) == nodes + 1  # split at 6 pages
    m = cache.load_back(m)
    assert m.device_len == 14 * PS
    got = cache.read_state(0, m.device_pages[-1:])
    _same(got, _state(b, [14 * PS]))
    cache.check_invariants()
