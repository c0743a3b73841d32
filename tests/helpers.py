"""Helpers shared by the test files (no tests here): page bits, poison, poisoned pools, small
specs and caches, one request through the handle, a transfer engine whose copies the test holds
in flight (:class:`GatedEngine`), the KV model whose bytes every cached page must hold
(:class:`KVModel`, :func:`check_bytes`), and the snapshot a failed call must leave unchanged.

Import them as ``from helpers import ...``: pytest puts ``tests/`` on ``sys.path`` (there is no
``tests/__init__.py``), as for ``storage_servers``.

Poison: every page a test has not written holds :data:`POISON` of its dtype, a NaN for the float
dtypes (a stray read shows in any arithmetic, and in bit compares), the most negative value for
int8. :func:`random_bits` never produces it, nor zero, so a page read from the wrong place or left
unwritten never passes for the data.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
from jax.sharding import Mesh

from hicache_jax import HiCache, HiCacheConfig, KVSpec, OutOfPagesError
from hicache_jax.events.records import Medium
from hicache_jax.memory.device_pool import DevicePagePool
from hicache_jax.memory.host_pool import HostPagePool
from hicache_jax.memory.transfer import TransferEngine
from hicache_jax.spec import GroupKind
from hicache_jax.tree.hashing import canonical_key  # one namespace, one key (5 == np.int64(5))

#: KV dtype -> the unsigned dtype of its bits (what the pools store).
BITS = {
    "bfloat16": np.uint16,
    "float16": np.uint16,
    "float32": np.uint32,
    "float8_e4m3fn": np.uint8,
    "int8": np.uint8,
}

#: Poison bit pattern per KV dtype: a NaN for the floats, the most negative value for int8.
POISON = {
    "bfloat16": 0x7FC1,
    "float16": 0x7E01,
    "float32": 0x7FC00001,
    "float8_e4m3fn": 0x7F,
    "int8": 0x80,
}


def poison(spec: KVSpec) -> int:
    """The poison bit pattern of ``spec.dtype``."""
    return POISON[spec.dtype]


def random_bits(spec: KVSpec, n: int, seed: int | np.random.Generator) -> np.ndarray:
    """Random bits ``spec.kv_shape(n)`` of ``spec.bits_dtype``, never zero, never the poison.

    Args:
        seed: an int (the same bits every call) or a Generator (advanced by the call).
    """
    rng = np.random.default_rng(seed)
    bits = rng.integers(
        1,
        np.iinfo(spec.bits_dtype).max,
        size=spec.kv_shape(n),
        dtype=spec.bits_dtype,
        endpoint=True,
    )
    bits[bits == poison(spec)] = 1
    return bits


def poisoned_device_pool(spec: KVSpec, num_pages: int, **kw) -> DevicePagePool:
    """A device pool (``DevicePagePool(spec, num_pages, **kw)``) whose every page, the scratch
    page included, holds the poison; no page allocated."""
    pool = DevicePagePool(spec, num_pages, **kw)
    # A device_put, not pool.write: one compile less per test spec (compiles dominate run time).
    # Of a broadcast, not of a contiguous array, which the CPU client may alias when it is
    # aligned: the copy is a buffer of XLA's own, which donations then reuse in place.
    bits = np.broadcast_to(np.array(poison(spec), spec.bits_dtype), pool.shape)
    pool.array = jax.device_put(bits, pool.array.sharding)
    return pool


def poisoned_host_pool(
    spec: KVSpec, num_pages: int, layout: str = "layer_first", **kw
) -> HostPagePool:
    """A host pool (``HostPagePool(spec, num_pages, layout, **kw)``) whose every page holds the
    poison; no page allocated."""
    pool = HostPagePool(spec, num_pages, layout, **kw)
    pool.write(
        np.arange(num_pages), np.full(spec.kv_shape(num_pages), poison(spec), spec.bits_dtype)
    )
    return pool


def heads_mesh() -> Mesh:
    """The 4 CPU devices of conftest on one axis, ``"heads"`` (axis type Auto)."""
    return Mesh(np.array(jax.devices()[:4]), ("heads",))


def bookkeeping_spec(page_size: int = 4) -> KVSpec:
    """The smallest KV (1 layer, 1 head of 2, float16: 8 bytes a token): for tests of what the
    cache records (events, routing), where the bytes do not matter."""
    return KVSpec(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float16", page_size=page_size)


def make_cache(spec: KVSpec, device_pages: int = 16, host_pages: int = 32, **cfg) -> HiCache:
    """``HiCache(spec, HiCacheConfig(device_pages, host_pages, **cfg))``, with
    ``load_back_threshold`` one page unless given (a host hit of one page is loaded back)."""
    cfg.setdefault("load_back_threshold", spec.page_size)
    return HiCache(spec, HiCacheConfig(device_pages=device_pages, host_pages=host_pages, **cfg))


def serve(cache: HiCache, tokens, extra_key=None) -> None:
    """One request without KV bytes, through the handle: begin (match, load back, lock), the
    pages of the rest of the whole pages, finish (insert, unlock)."""
    tokens = np.asarray(tokens)
    tokens = tokens[: tokens.size // cache.spec.page_size * cache.spec.page_size]
    with cache.begin(tokens, extra_key) as req:
        req.extend(tokens.size - req.cached_len)
        req.finish(tokens)


# ------------------------------------------------------------------ held copies, the KV model


class _GatedHandle:
    """A transfer handle that reports not-done until its gate opens (or someone waits on it)."""

    def __init__(self, inner, engine: GatedEngine, released: bool) -> None:
        self._inner, self._engine, self.released = inner, engine, released

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def done(self) -> bool:
        return self.released and self._inner.done()

    def wait(self):
        self._engine.open_upto(self)  # waiting for a transfer waits for those before it
        return self._inner.wait()

    def wait_layer(self, layer: int):
        self._engine.open_upto(self)
        return self._inner.wait_layer(layer)


class GatedEngine(TransferEngine):
    """A TransferEngine whose copies count as finished only once the test releases them
    (injected with ``HiCache(..., transfer_engine=GatedEngine)``). Open -- every copy released
    at dispatch -- until :meth:`hold`. Like the real engine, it reports completions in dispatch
    order: ``poll`` returns the released ones up to the first that is not."""

    def __init__(self, device_pool, host_pool) -> None:
        super().__init__(device_pool, host_pool)
        self.holding, self.handles = False, []  # gated handles not yet reported
        self._gated, self._landed = {}, []  # id(inner) -> gated; inner polled, unreported

    def hold(self) -> GatedEngine:
        self.holding = True
        return self

    def _gate(self, handle):
        gated = _GatedHandle(handle, self, released=not self.holding)
        self.handles.append(gated)
        self._gated[id(handle)] = gated
        return gated

    def backup(self, device_ids, host_ids, **kw):
        return self._gate(super().backup(device_ids, host_ids, **kw))

    def load(self, host_ids, device_ids, **kw):
        return self._gate(super().load(host_ids, device_ids, **kw))

    def open_upto(self, gated) -> None:
        for h in self.handles[: self.handles.index(gated) + 1]:
            h.released = True

    def poll(self, agree: bool = True):
        self._landed += super().poll(agree)
        out = []
        while self._landed and self._gated[id(self._landed[0])].released:
            gated = self._gated.pop(id(self._landed.pop(0)))
            self.handles.remove(gated)
            out.append(gated)
        return out

    def wait_all(self):
        for h in self.handles:
            h.released = True
        return super().wait_all()  # which returns self.poll()

    @property
    def in_flight(self) -> int:
        """Dispatched and not yet reported: a gated copy stays in flight after it lands."""
        return len(self.handles)

    def busy_host_pages(self, ids, **kw):
        ids = np.asarray(ids)
        busy = np.asarray(super().busy_host_pages(ids, **kw), bool)
        for h in self.handles:
            if not h.done():
                busy = busy | np.isin(ids, np.asarray(h.host_ids))
        return busy

    def release(self, k: int | None = None) -> None:
        """Open the gates of the ``k`` oldest pending handles (all when None)."""
        pending = [h for h in self.handles if not h.released]
        for h in pending[:k]:
            h.released = True
            # Released means finished: otherwise whether the copy has landed by the next poll
            # depends on XLA's thread, and the run (hence its coverage) on machine load.
            h._inner.wait()


def gate(cache: HiCache) -> GatedEngine:
    """Hold the copies of ``cache`` (built with ``transfer_engine=GatedEngine``) in flight."""
    engine = cache.transfer_engine
    assert isinstance(engine, GatedEngine), "build the cache with transfer_engine=GatedEngine"
    return engine.hold()


class KVModel:
    """The KV bytes of every page: a pure function of (extra_key, tokens up to the page's end)."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self._memo: dict[bytes, np.ndarray] = {}

    def page(self, extra_key, prefix: np.ndarray) -> np.ndarray:
        """Bits ``[L, kvf, 1, ps, H, D]`` of the page ending ``prefix``."""
        key = (
            repr(canonical_key(extra_key)).encode() + b"|" + np.asarray(prefix, np.int64).tobytes()
        )
        if key not in self._memo:
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            rng = np.random.default_rng(seed)
            # Below 0x3f80: finite bf16/fp16 patterns (no NaN payload games), still random bits.
            self._memo[key] = rng.integers(0, 0x3F80, self.spec.kv_shape(1), dtype=np.uint16)
        return self._memo[key]

    def pages(self, extra_key, tokens: np.ndarray, first: int, stop: int) -> np.ndarray:
        """Bits ``spec.kv_shape(stop - first)`` of pages ``first .. stop-1`` of ``tokens``."""
        ps = self.spec.page_size
        parts = [self.page(extra_key, tokens[: (j + 1) * ps]) for j in range(first, stop)]
        if not parts:
            return np.zeros(self.spec.kv_shape(0), np.uint16)
        return np.concatenate(parts, axis=2)


class WindowKV:
    """A window group's KV bytes of every page: a pure function of (the group, extra_key,
    tokens up to the page's end), other bytes than the full-attention group's."""

    def __init__(self, group, page_size: int) -> None:
        self.group = group
        self._kv = KVModel(group.spec(page_size))

    def pages(self, extra_key, tokens: np.ndarray, first: int, stop: int) -> np.ndarray:
        """Bits of group pages ``first .. stop-1`` of ``tokens``."""
        return self._kv.pages(("window", self.group.layers, extra_key), tokens, first, stop)


def check_window_bytes(cache: HiCache, g: int, model: WindowKV) -> None:
    """Every window group ``g`` page the cache holds, on either tier, holds the bytes of its
    prefix (bit-exact), and each node holds exactly the pages a continuation at its end reads
    (those it holds, it holds on every tier holding the node's full-attention pages, unless a
    copy dropped it; never one it need not)."""
    ps = cache.spec.page_size
    windows = cache._windows
    for node in cache.tree.nodes():
        prefix = cache.tree.path_tokens(node)
        total = prefix.shape[0] // ps
        start = total - node.num_pages
        for side, ids in ((windows.device, node.value), (windows.host, node.host_value)):
            if ids is None:
                continue
            w = side.attach[g, ids]
            held = np.flatnonzero(w >= 0)
            kept = np.flatnonzero((w >= 0) & (side.spare[g, ids] == 0))  # (spare: device only)
            first = model.group.need_start(total * ps) // ps - start
            assert kept.size == 0 or kept[0] >= first, f"{node!r} keeps window pages it need not"
            if held.size:
                got = bits(side.pools[g].read(w[held]))
                want = np.concatenate(
                    [model.pages(node.extra_key, prefix, start + j, start + j + 1) for j in held],
                    axis=2,
                )
                np.testing.assert_array_equal(got, want, f"{side.name} window bytes")


class ServedKV:
    """Requests through the handle over a spec with window groups, writing each group's bytes
    (a pure function of the prefix: another cache's model gives the same bytes) and checking
    what a hit reads back: the full-attention pages and, per window group, the pages a
    continuation at the hit's end reads; per STATE group (:class:`StateModel`), the checkpoint
    at the hit's end, and it writes the checkpoints ``checkpoint_positions`` asks for.
    ``__call__`` returns the tokens served from the cache and checks the cache after
    (:meth:`check`)."""

    def __init__(self, cache: HiCache) -> None:
        self.cache = cache
        self.kv = KVModel(cache.spec)
        groups = cache.spec.window_groups
        self.wkv = {
            g: WindowKV(grp, cache.spec.page_size)
            for g, grp in enumerate(groups)
            if grp.kind is not GroupKind.STATE
        }
        self.states = [StateModel(cache.spec, g) for g in cache.spec.state_groups]
        self.checkpoints = 0
        self.slots_short = 0  # write_state calls that found too few slots

    def __call__(self, tokens) -> int:
        cache, ps = self.cache, self.cache.spec.page_size
        tokens = np.asarray(tokens, np.int64)
        tokens = tokens[: tokens.size // ps * ps]
        with cache.begin(tokens) as req:
            have = req.cached_len // ps
            pages = req.device_pages
            np.testing.assert_array_equal(
                bits(cache.read_kv(pages)), self.kv.pages(None, tokens, 0, have)
            )
            for g, w in self.wkv.items():
                first = w.group.need_start(have * ps) // ps
                np.testing.assert_array_equal(
                    bits(cache.read_window_kv(g, pages[first:])),
                    w.pages(None, tokens, first, have),
                )
            for sm in self.states:
                if have:
                    sm.check(None, tokens[: have * ps], cache.read_state(sm.g, pages[-1:]), "hit")
            new = req.extend(tokens.size - req.cached_len)
            cache.write_kv(new, self.kv.pages(None, tokens, have, tokens.size // ps))
            for g, w in self.wkv.items():
                cache.write_window_kv(g, new, w.pages(None, tokens, have, tokens.size // ps))
            ends = cache.checkpoint_positions(tokens, have * ps) if self.states else []
            for sm in self.states:
                for want in (ends, ends[-1:]):  # more than the slot pool holds: the last one
                    if not want:
                        break
                    try:
                        sm.write(cache, new[[e // ps - 1 - have for e in want]], None, tokens, want)
                    except OutOfPagesError:
                        self.slots_short += 1
                        continue
                    self.checkpoints += len(want)
                    break
            req.finish(tokens)
        self.check()
        return have * ps

    def check(self) -> None:
        """The invariants, and every window page held on either tier bit-exact."""
        self.cache.check_invariants()
        for g, w in self.wkv.items():
            check_window_bytes(self.cache, g, w)
        for sm in self.states:
            check_state_bytes(self.cache, sm)


def bits(x) -> np.ndarray:
    """The 16-bit patterns of ``x`` (a bf16 / fp16 read, or :class:`KVModel` bits)."""
    return np.asarray(x).view(np.uint16)


def tree_pages(cache: HiCache, windows: bool = True) -> set:
    """``(page_hash, medium)`` of every page the cache holds on each tier (what replaying its
    KV events gives, :func:`~hicache_jax.events.replay`).

    With window groups, ``(page_hash, medium, group_idx)``: the full-attention pages (the
    full group's index), and unless ``windows=False`` (``kv_events={"groups": "full"}``)
    each window group's pages the tree's pages hold on that tier.
    """
    out: set = set()
    spec = cache.spec
    if not spec.window_groups:
        for node in cache.tree.nodes():
            for h in node.page_hashes.tolist():
                if node.value is not None:
                    out.add((h, Medium.DEVICE))
                if node.host_value is not None:
                    out.add((h, Medium.HOST))
        return out
    kinds = [g.kind for g in spec.groups]
    full = kinds.index(GroupKind.FULL)
    win = [i for i, k in enumerate(kinds) if k is not GroupKind.FULL]
    w = cache._windows
    assert w is not None
    for node in cache.tree.nodes():
        hashes = node.page_hashes.tolist()
        for medium, ids, attach in (
            (Medium.DEVICE, node.value, w.device.attach),
            (Medium.HOST, node.host_value, w.host.attach),
        ):
            if ids is None:
                continue
            out.update((h, medium, full) for h in hashes)
            if windows:
                for g, row in zip(win, (attach[:, ids] >= 0).tolist()):
                    out.update((h, medium, g) for h, k in zip(hashes, row) if k)
    return out


def check_bytes(cache: HiCache, model: KVModel) -> None:
    """Every cached page, on either tier, holds the bytes of its prefix (bit-exact)."""
    dev_ids, dev_want, host_ids, host_want = [], [], [], []
    for node in cache.tree.nodes():
        prefix = cache.tree.path_tokens(node)
        total = prefix.shape[0] // cache.spec.page_size
        want = model.pages(node.extra_key, prefix, total - node.num_pages, total)
        if node.value is not None:
            dev_ids.append(node.value)
            dev_want.append(want)
        if node.host_value is not None:
            host_ids.append(node.host_value)
            host_want.append(want)
    if dev_ids:
        got = bits(cache.read_kv(np.concatenate(dev_ids)))
        np.testing.assert_array_equal(got, np.concatenate(dev_want, axis=2), "device bytes")
    if host_ids:
        got = bits(cache.host_pool.read(np.concatenate(host_ids)))
        np.testing.assert_array_equal(got, np.concatenate(host_want, axis=2), "host bytes")


def check_invariants(cache: HiCache) -> None:
    """Full scan of the invariants (ARCHITECTURE.md) and exact page accounting on both tiers
    (O(cache))."""
    cache.check_invariants()


def snapshot(cache: HiCache):
    """Everything a failed call must leave unchanged: stats, the tree, the page owners."""
    return cache.stats(), cache.tree.snapshot(), cache.page_owners().tobytes()


# ------------------------------------------------------------------ the HiCache tests' caches

#: Every write policy (the HiCache tests run the policy-dependent ones for each).
POLICIES = ["write_through", "write_through_selective", "write_back", "clean_ahead"]


def gated_cache(
    policy: str = "write_through",
    *,
    device: int = 16,
    host: int = 32,
    ps: int = 1,
    threshold: int | None = None,
    **kw,
) -> tuple[HiCache, KVModel]:
    """A small bf16 cache (2 layers, 2 heads of 4) with ``policy`` and a :class:`GatedEngine`
    (open until :func:`gate`), and the :class:`KVModel` of its spec.

    Args:
        threshold: ``write_through_threshold``; ``lbt`` in ``kw``: ``load_back_threshold`` (one
            page by default); the rest goes to :class:`HiCacheConfig`.
    """
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16", page_size=ps)
    cfg = HiCacheConfig(
        device_pages=device,
        host_pages=host,
        write_policy=policy,
        write_through_threshold=threshold,
        load_back_threshold=kw.pop("lbt", ps),
        **kw,
    )
    return HiCache(spec, cfg, transfer_engine=GatedEngine), KVModel(spec)


def serve_kv(cache: HiCache, kv: KVModel, tokens, *, extra_key=None) -> None:
    """One request through the handle (ARCHITECTURE.md, "A request's data flow"): begin (match,
    load back, lock), check that the cached prefix reads back ``kv``'s bytes, extend by the rest
    of the whole pages and write their KV, finish (insert, unlock)."""
    tokens = np.asarray(tokens, np.int64)
    ps = cache.spec.page_size
    full = tokens.size // ps
    with cache.begin(tokens, extra_key) as req:
        have = req.cached_len // ps
        np.testing.assert_array_equal(
            bits(cache.read_kv(req.device_pages)), kv.pages(extra_key, tokens, 0, have)
        )
        new = req.extend(full * ps - req.cached_len)
        cache.write_kv(new, kv.pages(extra_key, tokens, have, full))
        req.finish(tokens[: full * ps])


def check_cache(cache: HiCache, kv: KVModel) -> None:
    """The invariants, and every cached page on either tier holds ``kv``'s bytes."""
    check_invariants(cache)
    check_bytes(cache, kv)


def node_of(cache: HiCache, tokens):
    """The Match.node handle of ``tokens`` (for lock / unlock)."""
    return cache.match_prefix(np.asarray(tokens)).node


def tree_node_of(cache: HiCache, tokens):
    """The tree's node behind that handle (to look at its fields)."""
    return node_of(cache, tokens)._node


def node_tiers(cache: HiCache) -> dict[int, tuple[bool, bool]]:
    """{first token // 100: (on device, on host)} of every node, read without touching the tree
    (a match would refresh the access stamps that decide what eviction takes)."""
    return {
        int(n.key[0]) // 100: (n.value is not None, n.host_value is not None)
        for n in cache.tree.nodes()
    }


def replay_all(replay_ep: str) -> list:
    """Every batch a cache's ZMQ replay socket holds, from seq 0: ``[(seq, [ts, events,
    rank])]`` (decoded msgpack)."""
    import msgpack
    import zmq

    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_ep)
    out = []
    try:
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return out
            out.append((int.from_bytes(seq, "big"), msgpack.unpackb(payload)))
    finally:
        dealer.close(linger=0)


# ------------------------------------------------------------------ recurrent state (STATE groups)


class StateModel:
    """A STATE group's checkpoints: the state after ``(extra_key, tokens up to a page's end)``
    is a pure function of them (random finite values of each ``StateArray``'s dtype, seeded by
    a hash of the prefix), so a checkpoint at the wrong position reads as another state.

    ``taken`` records, per checkpoint written (:meth:`write`), the digest of its bytes when
    taken; :func:`check_state_bytes` compares every later read with it (no checkpoint is ever
    mutated, on any tier, after any copy)."""

    def __init__(self, spec: KVSpec, g: int) -> None:
        self.g = g
        self.group = spec.window_groups[g]
        self._ps = spec.page_size
        self._memo: dict[bytes, list[np.ndarray]] = {}
        self.taken: dict[bytes, bytes] = {}

    def _key(self, extra_key, prefix) -> bytes:
        return (
            b"state|"
            + repr(canonical_key(extra_key)).encode()
            + b"|"
            + np.asarray(prefix, np.int64).tobytes()
        )

    def state(self, extra_key, prefix) -> list[np.ndarray]:
        """The group's arrays ``[1, len(layers), *shape]`` after ``prefix``."""
        key = self._key(extra_key, prefix)
        if key not in self._memo:
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            rng = np.random.default_rng(seed)
            layers = len(self.group.layers)
            self._memo[key] = [
                rng.standard_normal((1, layers, *a.shape)).astype(jnp_dtype(a.dtype))
                for a in self.group.state
            ]
        return self._memo[key]

    def states(self, extra_key, tokens, ends: list[int]) -> list[np.ndarray]:
        """The arrays of the checkpoints at prefix lengths ``ends`` (tokens), stacked."""
        per = [self.state(extra_key, tokens[:e]) for e in ends]
        return [np.concatenate(parts) for parts in zip(*per, strict=True)]

    def write(self, cache: HiCache, pages, extra_key, tokens, ends: list[int]) -> None:
        """``cache.write_state`` of the checkpoints at ``ends`` into caller ``pages`` (each
        page ending at its end), recording each one's digest as taken."""
        cache.write_state(self.g, pages, self.states(extra_key, tokens, ends))
        for e in ends:
            key = self._key(extra_key, tokens[:e])
            digest = _digest(self.state(extra_key, tokens[:e]))
            assert self.taken.setdefault(key, digest) == digest
        return None

    def check(self, extra_key, prefix, arrays, where: str) -> None:
        """``arrays`` (one slot's, ``[1, L, *shape]`` each) are the checkpoint after ``prefix``,
        as taken (bit-exact)."""
        key = self._key(extra_key, prefix)
        assert key in self.taken, f"{where}: a checkpoint at {len(prefix)} was never taken"
        got = _digest(arrays)
        assert got == self.taken[key], f"{where}: checkpoint at {len(prefix)} changed"
        for a, want in zip(arrays, self.state(extra_key, prefix), strict=True):
            np.testing.assert_array_equal(
                np.asarray(a).view(np.uint8), want.view(np.uint8), f"{where} state"
            )


def jnp_dtype(name: str) -> np.dtype:
    """The numpy dtype of a spec dtype name (ml_dtypes for bfloat16 / float8)."""
    import ml_dtypes

    return np.dtype(getattr(ml_dtypes, name, None) or name)


def unpack_slots(group, bits: np.ndarray) -> list[np.ndarray]:
    """Slot bits (uint32) as the group's arrays ``[n, L, *shape]``, in numpy (the layout of
    hicache_jax/memory/state.py). One head: ``[L, 1, n, 1, 1, words]``, per layer each
    array's bytes back to back, each padded to whole words. ``H = state_heads`` > 1:
    ``[L, 2, n, 1, H, head_words / 2]``, head ``h``'s part (two halves) holding, per array,
    its ``h``-th slice along its head axis, or (no head axis) its ``h``-th share of words."""
    layers, n = bits.shape[0], bits.shape[2]
    h = group.state_heads
    if h > 1:
        rows = bits.view(np.uint32).reshape(layers, 2, n, h, -1).transpose(2, 0, 3, 1, 4)
        rows = np.ascontiguousarray(rows).reshape(n, layers, h, -1)
        out, at = [], 0
        for a in group.state:
            w = a.head_words(h)
            part = np.ascontiguousarray(rows[:, :, :, at : at + w])
            at += w
            dtype = jnp_dtype(a.dtype)
            if a.head_axis is None:
                raw = part.reshape(n, layers, -1).view(np.uint8)[:, :, : a.nbytes]
                out.append(np.ascontiguousarray(raw).view(dtype).reshape(n, layers, *a.shape))
                continue
            raw = part.view(np.uint8)[:, :, :, : a.nbytes // h]
            rest = list(a.shape)
            heads = rest.pop(a.head_axis)
            x = np.ascontiguousarray(raw).view(dtype).reshape(n, layers, heads, *rest)
            out.append(np.moveaxis(x, 2, a.head_axis + 2))
        return out
    rows = np.ascontiguousarray(bits.view(np.uint32).reshape(layers, n, -1).transpose(1, 0, 2))
    raw = rows.view(np.uint8).reshape(n, layers, -1)
    out, at = [], 0
    for a in group.state:
        b = np.ascontiguousarray(raw[:, :, at : at + a.nbytes])
        out.append(b.view(jnp_dtype(a.dtype)).reshape(n, layers, *a.shape))
        at += -(-a.nbytes // 4) * 4
    return out


def _digest(arrays) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).view(np.uint8).tobytes())
    return h.digest()


def check_state_bytes(cache: HiCache, model: StateModel) -> None:
    """Every checkpoint the tree holds, on either tier, is the one taken at the end of its page
    (bit-exact, its digest unchanged since taken); each tier's used-slot count is what the
    attachments say."""
    ps, g = cache.spec.page_size, model.g
    w = cache._windows
    assert w is not None
    stats = cache.stats()
    for side in (w.device, w.host):
        used = int((side.attach[g] >= 0).sum())
        assert used == side.used_pages()[g] == stats[f"state_{side.name}_used_slots"], side.name
    for node in cache.tree.nodes():
        prefix = cache.tree.path_tokens(node)
        start = prefix.shape[0] // ps - node.num_pages
        for side, ids in ((w.device, node.value), (w.host, node.host_value)):
            if ids is None:
                continue
            slots = side.attach[g, ids]
            held = np.flatnonzero(slots >= 0)
            if not held.size:
                continue
            pool = side.pools[g]
            raw = pool.read_bits(slots[held]) if side.name == "device" else pool.read(slots[held])
            arrays = unpack_slots(model.group, np.asarray(raw))
            for i, j in enumerate(held.tolist()):
                model.check(
                    node.extra_key,
                    prefix[: (start + j + 1) * ps],
                    [np.asarray(a)[i : i + 1] for a in arrays],
                    f"{side.name} slot of {node!r}",
                )
