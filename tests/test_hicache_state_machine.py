"""Stateful property test of HiCache over its public contract.

A hypothesis ``RuleBasedStateMachine`` drives random requests (match, optional load_back, lock,
alloc, write KV, insert — sometimes chunked —, unlock; several requests open at once), explicit
evict / evict_host / flush / reset, and bad calls, on tiny pools so that eviction, evict_host and
load_back happen all the time. Transfers are held in flight by a gate (:class:`GatedEngine`) and
released at random, so splits, evictions and loads meet copies in flight.

After every step: DESIGN.md's invariants and exact page accounting on both tiers
(``HiCache._check_invariants``), the KV events replayed by a router model equal the pages the
cache holds on each tier, and every cached page — device or host — holds bit-exactly the bytes
written for its prefix. The KV of a page is a pure function of (extra_key, tokens up to the end
of that page), so a page moved to the wrong place or overwritten shows up at once.

Run for every write policy x {lru, lfu, slru} x page_size {1, 16}; longer with
``HICACHE_HYPOTHESIS_PROFILE=long``.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from hicache_jax import HiCacheConfig, HiCacheError, KVSpec, OutOfPagesError
from hicache_jax.events import Medium, replay
from hicache_jax.hicache import HiCache
from hicache_jax.radix import RadixTree

LONG = os.environ.get("HICACHE_HYPOTHESIS_PROFILE") == "long"


# ----------------------------------------------------------------------------- helpers

class _GatedHandle:
    """A transfer handle that reports not-done until its gate opens (or someone waits on it)."""

    def __init__(self, inner, engine: "GatedEngine") -> None:
        self._inner, self._engine, self.released = inner, engine, False

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def done(self) -> bool:
        return self.released and self._inner.done()

    def wait(self):
        self.released = True
        return self._inner.wait()

    def wait_layer(self, layer: int):
        self.released = True
        return self._inner.wait_layer(layer)


class GatedEngine:
    """Wraps a TransferEngine so tests decide when each copy counts as finished."""

    def __init__(self, inner) -> None:
        self._inner, self.handles = inner, []

    def _gate(self, handle):
        gated = _GatedHandle(handle, self)
        self.handles.append(gated)
        return gated

    def backup(self, device_ids, host_ids, **kw):
        return self._gate(self._inner.backup(device_ids, host_ids, **kw))

    def load(self, host_ids, device_ids, **kw):
        return self._gate(self._inner.load(host_ids, device_ids, **kw))

    def poll(self):
        return self._inner.poll()

    def wait_all(self):
        for h in self.handles:
            h.released = True
        return self._inner.wait_all()

    @property
    def in_flight(self) -> int:
        return self._inner.in_flight

    def busy_host_pages(self, ids):
        ids = np.asarray(ids)
        busy = np.asarray(self._inner.busy_host_pages(ids), bool)
        for h in self.handles:
            if not h.done():
                busy = busy | np.isin(ids, np.asarray(h.host_ids))
        return busy

    def release(self, k: int | None = None) -> None:
        """Open the gates of the ``k`` oldest pending handles (all when None)."""
        pending = [h for h in self.handles if not h.released]
        for h in pending[:k]:
            h.released = True
        self.handles = [h for h in self.handles if not h._inner.done() or not h.released]


def gate(cache: HiCache) -> GatedEngine:
    """Put a gate in front of ``cache``'s transfer engine (test-only: a private attribute)."""
    cache._engine = GatedEngine(cache._engine)
    return cache._engine


class KVModel:
    """The KV bytes of every page: a pure function of (extra_key, tokens up to the page's end)."""

    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec
        self._memo: dict[bytes, np.ndarray] = {}

    def page(self, extra_key, prefix: np.ndarray) -> np.ndarray:
        """Bits ``[L, kvf, 1, ps, H, D]`` of the page ending ``prefix``."""
        key = repr(extra_key).encode() + b"|" + np.asarray(prefix, np.int64).tobytes()
        if key not in self._memo:
            seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
            rng = np.random.default_rng(seed)
            # Below 0x3f80: finite bf16/fp16 patterns (no NaN payload games), still random bits.
            self._memo[key] = rng.integers(0, 0x3F80, self.spec.kv_shape(1), dtype=np.uint16)
        return self._memo[key]

    def pages(self, extra_key, tokens: np.ndarray, first: int, stop: int) -> np.ndarray:
        """Bits ``spec.kv_shape(stop - first)`` of pages ``first .. stop-1`` of ``tokens``."""
        ps = self.spec.page_size
        parts = [self.page(extra_key, tokens[:(j + 1) * ps]) for j in range(first, stop)]
        if not parts:
            return np.zeros(self.spec.kv_shape(0), np.uint16)
        return np.concatenate(parts, axis=2)


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def tree_pages(cache: HiCache) -> set:
    """``(page_hash, medium)`` of every page the cache holds on each tier."""
    out = set()
    for node in cache._tree.nodes():
        for h in node.page_hashes.tolist():
            if node.value is not None:
                out.add((h, Medium.DEVICE))
            if node.host_value is not None:
                out.add((h, Medium.HOST))
    return out


def check_bytes(cache: HiCache, model: KVModel) -> None:
    """Every cached page, on either tier, holds the bytes of its prefix (bit-exact)."""
    dev_ids, dev_want, host_ids, host_want = [], [], [], []
    for node in cache._tree.nodes():
        prefix = cache._tree.path_tokens(node)
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
        got = bits(cache._host.read(np.concatenate(host_ids)))
        np.testing.assert_array_equal(got, np.concatenate(host_want, axis=2), "host bytes")


def snapshot(cache: HiCache):
    """Everything a failed call must leave unchanged."""
    return cache.stats(), cache._tree.snapshot(), cache._owner.tobytes(), len(cache._ops)


# ----------------------------------------------------------------------------- the machine

def _token_strategy(page_size: int):
    """Requests over few page patterns, so prefixes are shared and diverge inside pages."""
    patterns = st.integers(0, 5)
    return st.tuples(st.lists(patterns, min_size=1, max_size=7 if page_size == 1 else 5),
                     st.integers(0, page_size - 1), st.sampled_from([None, None, "b"]))


def _tokens(page_size: int, draw) -> tuple[np.ndarray, object]:
    pats, tail, extra_key = draw
    pages = []
    for k in pats:
        page = np.full(page_size, 10 + k // 2, np.int64)
        if k % 2:  # a variant that differs from its sibling only in its last token
            page[-1] = 100 + k
        pages.append(page)
    toks = np.concatenate(pages + [np.arange(tail, dtype=np.int64) + 7])
    return toks, extra_key


class HiCacheMachine(RuleBasedStateMachine):
    write_policy = "write_through"
    eviction = "lru"
    page_size = 1

    def __init__(self) -> None:
        super().__init__()
        self.cache = None

    @initialize(host_kind=st.sampled_from(["none", "small", "equal", "large"]),
                layerwise=st.booleans())
    def setup(self, host_kind, layerwise):
        ps = self.page_size
        self.spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype="bfloat16",
                           page_size=ps)
        device = 12 if ps == 1 else 9
        host = {"none": 0, "small": device // 2, "equal": device, "large": 3 * device}[host_kind]
        self.clock = 0.0
        cfg = HiCacheConfig(device_pages=device, host_pages=host,
                            write_policy=self.write_policy, eviction=self.eviction,
                            load_back_threshold=ps)
        self.cache = HiCache(self.spec, cfg, clock=self._now)
        self.engine = gate(self.cache)
        self.kv = KVModel(self.spec)
        self.router: set = set()
        self.open: list[dict] = []
        self.layerwise = layerwise

    def _now(self) -> float:
        self.clock += 1.0
        return self.clock

    # -- requests --------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < 3)
    @rule(req=st.data(), load=st.booleans())
    def start_request(self, req, load):
        cache, ps = self.cache, self.page_size
        tokens, extra_key = _tokens(ps, req.draw(_token_strategy(ps)))
        m = cache.match_prefix(tokens, extra_key)
        assert m.device_len == m.device_pages.size * ps
        if load:
            m2 = cache.load_back(m, layerwise=self.layerwise)
            if m2 is not m:
                assert m2.device_len == m.device_len + m.host_len and m2.host_len == 0
                if self.layerwise:
                    for layer in range(self.spec.num_layers):
                        m2.load_handle.wait_layer(layer)
            m = m2
        # Whatever tier served it, the matched prefix reads back the bytes written for it.
        npre = m.device_pages.size
        np.testing.assert_array_equal(bits(cache.read_kv(m.device_pages)),
                                      self.kv.pages(extra_key, tokens, 0, npre))
        cache.lock(m.node)
        n_new = tokens.shape[0] // ps - npre
        try:
            new = cache.alloc_pages(n_new)
        except OutOfPagesError as e:
            assert e.needed == n_new and e.free < n_new
            cache.unlock(m.node)
            return
        cache.write_kv(new, self.kv.pages(extra_key, tokens, npre, npre + n_new))
        self.open.append(dict(tokens=tokens, extra_key=extra_key, node=m.node,
                              pages=np.concatenate([m.device_pages, new]), new=new))

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 2), chunk=st.booleans(), priority=st.integers(0, 2))
    def finish_request(self, i, chunk, priority):
        r = self.open.pop(i % len(self.open))
        cache, ps = self.cache, self.page_size
        npages = r["pages"].size
        if chunk and npages >= 2:  # a chunked prefill inserts its first half first
            half = npages // 2
            cache.insert(r["tokens"][:half * ps], r["pages"][:half], r["extra_key"],
                         chunked=True, priority=priority)
        before = cache.stats()["device_caller_pages"]
        still_mine = int((cache._owner[r["new"]] == 1).sum())
        cache.insert(r["tokens"], r["pages"], r["extra_key"], priority=priority)
        # Every caller page became the tree's or was freed as a duplicate.
        assert cache.stats()["device_caller_pages"] == before - still_mine
        assert not (cache._owner[r["new"]] == 1).any()
        cache.unlock(r["node"])

    @precondition(lambda self: self.open)
    @rule(i=st.integers(0, 2))
    def abort_request(self, i):
        r = self.open.pop(i % len(self.open))
        self.cache.free_pages(r["new"])
        self.cache.unlock(r["node"])

    # -- cache maintenance -----------------------------------------------------------------

    @rule(tokens=st.integers(0, 40))
    def evict(self, tokens):
        cache = self.cache
        before = cache.stats()["device_cached_tokens"]
        freed = cache.evict(tokens)
        assert cache.stats()["device_cached_tokens"] == before - freed
        if freed < tokens:  # stopped early: nothing left it could take
            for node in cache._tree.evictable_device:
                assert self.write_policy == "write_back" and not node.backed_up \
                    and node.children, f"evict stopped with {node!r} still evictable"

    @rule(tokens=st.integers(0, 40))
    def evict_host(self, tokens):
        freed = self.cache.evict_host(tokens)
        if freed < tokens:  # stopped early: no host-only leaf left
            assert not self.cache._tree.evictable_host

    @rule(k=st.integers(1, 4))
    def release_transfers(self, k):
        self.engine.release(k)

    @rule()
    def flush(self):
        self.cache.flush()
        assert self.cache.stats()["transfers_in_flight"] == 0

    @precondition(lambda self: not self.open)
    @rule(p=st.integers(0, 20))
    def reset(self, p):
        if p == 0:  # rare: a reset wipes the state the other rules build up
            self.cache.reset()
            self.router.clear()

    @rule(which=st.integers(0, 5))
    def bad_call(self, which):
        cache = self.cache
        before = snapshot(cache)
        calls = [
            (ValueError, lambda: cache.match_prefix(np.zeros((2, 2), np.int64))),
            (ValueError, lambda: cache.evict(-1)),
            (HiCacheError, lambda: cache.free_pages(self._tree_page_or_oob())),
            (HiCacheError, lambda: cache.unlock(RadixTree(self.page_size).root)),
            (TypeError, lambda: cache.load_back("not a match")),
            (TypeError, lambda: cache.alloc_pages(1.5)),
        ]
        err, call = calls[which]
        with pytest.raises((err, ValueError)):
            call()
        assert snapshot(cache) == before

    def _tree_page_or_oob(self):
        for node in self.cache._tree.nodes():
            if node.value is not None:
                return node.value[:1]
        # No tree page: a free page is not the caller's either.
        free = np.nonzero(self.cache._owner == 0)[0]
        return free[:1] if free.size else np.array([0])

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        if self.cache is None:
            return
        self.cache._check_invariants()
        self.router = replay(self.cache.take_events(), self.router)
        assert self.router == tree_pages(self.cache), "KV events disagree with the cache"
        check_bytes(self.cache, self.kv)


# ----------------------------------------------------------------------------- the runs

POLICIES = ["write_through", "write_through_selective", "write_back"]
EVICTIONS = ["lru", "lfu", "slru"]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("eviction", EVICTIONS)
@pytest.mark.parametrize("write_policy", POLICIES)
def test_hicache_state_machine(write_policy, eviction, page_size):
    machine = type(f"HiCache_{write_policy}_{eviction}_{page_size}", (HiCacheMachine,),
                   dict(write_policy=write_policy, eviction=eviction, page_size=page_size))
    if LONG:
        cfg = settings(max_examples=200, stateful_step_count=60)
    else:
        cfg = settings(max_examples=8, stateful_step_count=30)
    if os.environ.get("HICACHE_NO_SHRINK"):
        cfg = settings(cfg, phases=[Phase.explicit, Phase.reuse, Phase.generate],
                       report_multiple_bugs=False)
    run_state_machine_as_test(machine, settings=cfg)
