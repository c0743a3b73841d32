"""The L3 tier on its own, against a fake cache that implements the port (:class:`CachePort`):
a radix tree, a numpy host pool, a manual clock, and a record of what the tier reserved, locked
and attached. No HiCache, no pools, no sleeping for deadlines."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from hicache_jax import HiCacheConfig, KVSpec
from hicache_jax.events.recorder import NullRecorder
from hicache_jax.l3.port import CachePort
from hicache_jax.l3.storage import entry_pages, entry_rows
from hicache_jax.l3.tier import L3Tier, NullL3Tier, open_l3
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.group import LocalGroup
from hicache_jax.tree.radix import RadixTree

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32", page_size=4)
PS = SPEC.page_size


class _Read:
    def __init__(self, pages: np.ndarray) -> None:
        self.pages = pages

    def done(self) -> bool:
        return True

    def copy_into(self, rows: np.ndarray, row_ids: np.ndarray) -> None:
        rows[row_ids] = self.pages


class FakeCache:
    """What the port promises, and checks that the tier keeps to it: it writes and attaches
    only pages it reserved, releases each once, and unlocks only what it locked."""

    def __init__(self, host_pages: int = 16) -> None:
        self.spec, self.now = SPEC, 100.0
        self.tree = RadixTree(PS)
        self.alloc = PageAllocator(host_pages, "host")
        page = entry_pages(SPEC, entry_rows(SPEC, 1))
        self.pages = np.zeros((host_pages,) + page.shape[1:], page.dtype)
        self.reserved: set[int] = set()
        self.locks: collections.Counter = collections.Counter()
        self.events = NullRecorder()
        self.fetches: list = []  # (nbytes, seconds) of completed reads
        self.group = LocalGroup()

    def clock(self) -> float:
        return self.now

    def match(self, tokens, extra_key):
        return self.tree.match(tokens, extra_key)

    def path_tokens(self, node):
        return self.tree.path_tokens(node)

    def lock(self, node) -> None:
        self.tree.lock(node)
        self.locks[node] += 1

    def unlock(self, node) -> None:
        assert self.locks[node] > 0, "unlock without a lock"
        self.tree.unlock(node)
        self.locks[node] -= 1
        self.locks += collections.Counter()  # drop zeros

    def reserve_host_pages(self, n: int) -> np.ndarray:
        ids = self.alloc.alloc(min(n, self.alloc.num_free))
        self.reserved |= set(ids.tolist())
        return ids

    def _unreserve(self, ids) -> None:
        assert set(ids.tolist()) <= self.reserved, "not reserved by the tier"
        self.reserved -= set(ids.tolist())

    def release_host_pages(self, ids) -> None:
        self._unreserve(ids)
        self.alloc.free(ids)

    def write_host_pages(self, ids, rows, row_ids) -> None:
        assert set(ids.tolist()) <= self.reserved
        self.pages[ids] = rows[row_ids]

    def attach_host_copy(self, node, ids) -> None:
        self._unreserve(ids)
        self.tree.set_host_value(node, ids)

    def attach_host_leaf(self, parent, tokens, ids, extra_key):
        self._unreserve(ids)
        return self.tree.add_host_leaf(parent, tokens, ids, extra_key)

    def fetch_pages(self, new_pages: int, covered: int) -> int:
        return new_pages  # the threshold rule's: fetch all

    def fetch_decision(self):
        return None

    def observe_fetch(self, nbytes: int, seconds: float, decision=None) -> None:
        self.fetches.append((nbytes, seconds))

    def read_host_async(self, ids) -> _Read:
        return _Read(self.pages[ids].copy())

    # -- helpers of the tests --

    def backed_up(self, tokens: np.ndarray, seed: int):
        """A device node of ``tokens`` whose backup just landed, with random page bits."""
        res = self.tree.insert(tokens, np.arange(tokens.size // PS))
        ids = self.alloc.alloc(tokens.size // PS)
        self.pages[ids] = (
            np.random.default_rng(seed)
            .integers(0, 2**31, self.pages[ids].shape)
            .astype(self.pages.dtype)
        )
        self.tree.set_host_value(res.last_node, ids)
        return res.last_node


def cfg(url: str | None, **kw) -> HiCacheConfig:
    return HiCacheConfig(device_pages=8, host_pages=16, storage=url, **kw)


def test_the_fake_cache_is_a_port():
    assert isinstance(open_l3(FakeCache(), SPEC, cfg(None)), NullL3Tier)
    for name in vars(CachePort):
        if not name.startswith("_"):
            assert hasattr(FakeCache(), name), name


def test_a_put_then_a_prefetch_in_another_cache_returns_the_bytes(tmp_path):
    url, toks = f"file://{tmp_path}", np.arange(3 * PS)
    a = FakeCache()
    tier = open_l3(a, SPEC, cfg(url))
    node = a.backed_up(toks, seed=1)
    tier.on_backup([node])  # write_through (the default): put once the backup landed
    tier.flush()
    assert tier.stats()["l3_put_pages_stored"] == 3
    b = FakeCache()
    other = open_l3(b, SPEC, cfg(url))
    h = other.prefetch(toks, None)
    assert h is not None and h.pages_found == 3 and b.locks  # the fetch base is held
    other.flush()
    tm = b.tree.match(toks)
    assert tm.host_len == 3 * PS and h.landed() == 3
    np.testing.assert_array_equal(b.pages[tm.node.host_value], a.pages[node.host_value])
    assert not b.reserved and not b.locks  # every reservation attached, every lock given back
    assert other.stats()["l3_prefetch_hit_pages"] == 3
    assert other.prefetch(toks, None) is None  # L2 holds it all now
    tier.close()
    other.close()


def test_a_prefetch_that_misses_gives_back_its_reservations(tmp_path):
    url, toks = f"file://{tmp_path}", np.arange(4 * PS)
    a = FakeCache()
    tier = open_l3(a, SPEC, cfg(url))
    tier.on_backup([a.backed_up(toks[: 2 * PS], seed=2)])
    tier.flush()
    b = FakeCache()
    other = open_l3(b, SPEC, cfg(url))
    assert other.prefetch(toks, None).pages_found == 2  # the leading run L3 holds
    other.flush()
    assert b.tree.match(toks).host_len == 2 * PS
    assert not b.reserved and b.alloc.num_free == 16 - 2 and not b.locks
    tier.close()
    other.close()


class _HeldGet:
    """A storage read that never lands: records the timeouts it is waited with."""

    def __init__(self, n: int) -> None:
        self.n, self.timeouts, self.cancelled = n, [], False

    def done(self) -> bool:
        return self.cancelled

    def landed(self) -> np.ndarray:
        return np.zeros(self.n, bool)

    def wait(self, timeout=None) -> np.ndarray:
        if self.cancelled:
            return np.zeros(self.n, bool)
        self.timeouts.append(timeout)
        raise TimeoutError

    def cancel(self) -> None:
        self.cancelled = True


class _HeldStore:
    def __init__(self) -> None:
        self.gets: list[_HeldGet] = []

    def exists(self, keys):
        return np.ones(len(keys), bool)

    def get_into(self, keys, ids):
        self.gets.append(_HeldGet(len(keys)))
        return self.gets[-1]

    def put_from(self, keys, ids):
        raise AssertionError("no puts here")

    def stats(self):
        return {}

    def close(self) -> None:
        pass


@pytest.mark.parametrize("late", [0.25, 5.0])
def test_the_timeout_deadline_runs_on_the_cache_clock(late):
    port, store = FakeCache(), _HeldStore()
    c = cfg("file:///unused", prefetch_policy="timeout", prefetch_timeout_s=0.5)
    tier = L3Tier(port, SPEC, c, "file:///unused", store, entry_rows(SPEC, 8))
    toks = np.arange(2 * PS)
    assert tier.prefetch(toks, None) is not None
    deadline = 100.0 + 0.5 * (1 + 2 * PS / 1024)  # issued at clock 100, 2 pages
    port.now += late  # the cache's clock moves, not the wall's
    tier.before_match(toks, None)
    (waited,) = store.gets[0].timeouts
    assert waited == pytest.approx(max(0.0, deadline - port.now))
    s = tier.stats()
    assert s["l3_prefetch_timeouts"] == 1 and s["l3_prefetch_missed_pages"] == 2
    assert store.gets[0].cancelled and not port.reserved and not port.locks
    tier.before_match(toks, None)  # closed: not waited for again
    assert store.gets[0].timeouts == [waited]


def test_best_effort_never_waits():
    port, store = FakeCache(), _HeldStore()
    tier = L3Tier(port, SPEC, cfg("file:///unused"), "file:///unused", store, entry_rows(SPEC, 8))
    tier.prefetch(np.arange(2 * PS), None)
    tier.before_match(np.arange(2 * PS), None)
    assert store.gets[0].timeouts == [] and len(port.reserved) == 2  # still in flight


def test_no_storage_and_a_store_down_give_null_tiers():
    null = open_l3(FakeCache(), SPEC, cfg(None))
    assert null.prefetch(np.arange(PS), None) is None and null.stats() == {}
    assert not null.back_up_new
    down = open_l3(FakeCache(), SPEC, cfg("mooncake://127.0.0.1:1?setup_timeout_s=1&optional=1"))
    assert isinstance(down, NullL3Tier) and down.back_up_new  # the cache still backs up new
    s = down.stats()
    assert s["l3_available"] == 0 and s["l3_prefetches"] == 0 and s["l3_in_flight"] == 0
    with pytest.raises(ValueError, match="host pool"):
        open_l3(FakeCache(), SPEC, HiCacheConfig(device_pages=8, host_pages=0, storage="file:///x"))
