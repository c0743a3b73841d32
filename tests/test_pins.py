"""cache.pin / unpin: pinned prefixes stay on their tier under eviction pressure, within the
configured share, expire on the cache's clock, survive load-backs and reset clears them."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec, serve, snapshot
from hicache_jax.errors import HiCacheError, PinLimitError

PS = 4


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _cache(device=8, host=16, share=0.5, clock=None, **kw):
    from hicache_jax import HiCache, HiCacheConfig

    cfg = HiCacheConfig(
        device_pages=device,
        host_pages=host,
        load_back_threshold=PS,
        pin_max_share=share,
        write_policy="write_through",
        **kw,
    )
    return HiCache(bookkeeping_spec(PS), cfg, clock=clock or Clock())


def _churn(cache, rng, n=30, pages=2):
    for _ in range(n):
        serve(cache, rng.integers(1000, 9000, pages * PS))
        cache.check_invariants()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_pinned_prefix_survives_churn_unpinned_does_not(tier):
    rng = np.random.default_rng(0)
    cache = _cache()
    system = np.arange(2 * PS)
    other = np.arange(100, 100 + 2 * PS)
    serve(cache, system)
    serve(cache, system)  # a hit: backed up (write_through)
    serve(cache, other)
    serve(cache, other)
    assert cache.pin(system, tier=tier) == 2 * PS
    cache.check_invariants()
    _churn(cache, rng)
    got = cache.lookup(system)
    if tier == "device":
        assert got == {"device": 2 * PS, "host": 0}
    else:
        assert got["device"] + got["host"] == 2 * PS
    assert cache.lookup(other) == {"device": 0, "host": 0}  # the unpinned twin went
    st = cache.stats()
    assert st["pins"] == 1 and st[f"pinned_{tier}_pages"] == 2
    assert cache.unpin(system, tier=tier) == 2 * PS
    cache.check_invariants()
    _churn(cache, rng)
    assert cache.lookup(system) == {"device": 0, "host": 0}
    cache.close()


def test_device_pin_is_never_counted_evictable():
    cache = _cache()
    serve(cache, np.arange(3 * PS))
    before = cache.stats()["device_evictable_pages"]
    cache.pin(np.arange(3 * PS))
    st = cache.stats()
    assert st["device_evictable_pages"] == before - 3 and st["device_protected_pages"] >= 3
    cache.evict(10**6)
    assert cache.lookup(np.arange(3 * PS))["device"] == 3 * PS
    cache.check_invariants()
    cache.close()


def test_host_pin_is_never_host_evictable_and_survives_load_back():
    cache = _cache()
    toks = np.arange(2 * PS)
    serve(cache, toks)
    serve(cache, toks)
    cache.pin(toks, tier="host")
    cache.evict(10**6)  # to host only
    assert cache.lookup(toks) == {"device": 0, "host": 2 * PS}
    assert cache.evict_host(10**6) == 0
    assert cache.stats()["host_evictable_leaves"] == 0
    serve(cache, toks)  # load-back: device again, pin kept
    cache.flush()  # the load has landed: its lock is gone
    assert cache.lookup(toks)["device"] == 2 * PS
    cache.evict(10**6)
    assert cache.evict_host(10**6) == 0 and cache.lookup(toks)["host"] == 2 * PS
    cache.check_invariants()
    cache.unpin(toks, tier="host")
    assert cache.evict_host(10**6) == 2 * PS
    cache.check_invariants()
    cache.close()


def test_pin_beyond_share_raises_with_figures_and_changes_nothing():
    cache = _cache(device=8, share=0.5)  # limit 4 device pages
    a, b = np.arange(3 * PS), np.arange(50, 50 + 2 * PS)
    serve(cache, a)
    serve(cache, b)
    cache.pin(a)
    cache.flush()  # the backups land now: pin applies finished transfers before it checks
    before = snapshot(cache)
    with pytest.raises(PinLimitError) as e:
        cache.pin(b)
    assert (e.value.tier, e.value.pinned, e.value.requested, e.value.limit) == ("device", 3, 2, 4)
    assert "limit of 4" in str(e.value)
    assert snapshot(cache) == before
    cache.pin(a[: 2 * PS])  # inside what is pinned: adds nothing
    cache.check_invariants()
    cache.close()


def test_the_limit_counts_every_pin_of_the_tier():
    cache = _cache(device=8, share=0.5)
    a = np.arange(4 * PS)
    serve(cache, a)
    serve(cache, np.arange(100, 100 + 2 * PS))
    before = snapshot(cache)
    with pytest.raises(PinLimitError):  # 2 pinned + 4 more > 4
        cache.pin(np.arange(100, 100 + 2 * PS))
        cache.pin(a)
    cache.unpin(np.arange(100, 100 + 2 * PS))
    assert snapshot(cache)[1:] == before[1:]
    cache.close()


def test_pins_expire_on_the_cache_clock_and_renew():
    clock = Clock()
    cache = _cache(clock=clock)
    toks = np.arange(2 * PS)
    serve(cache, toks)
    cache.pin(toks, ttl_s=10)
    clock.t = 5
    cache.pin(toks, ttl_s=10)  # renewed: now expires at 15
    clock.t = 12
    cache.evict(10**6)
    assert cache.lookup(toks)["device"] == 2 * PS
    clock.t = 15
    cache.evict(10**6)  # the call's poll expires the pin first
    assert cache.lookup(toks)["device"] == 0
    assert cache.stats()["pins"] == 0
    with pytest.raises(HiCacheError, match="not pinned"):
        cache.unpin(toks)
    cache.check_invariants()
    cache.close()


def test_bad_input_typed_errors_leave_cache_unchanged():
    cache = _cache()
    toks = np.arange(2 * PS)
    serve(cache, toks)
    cache.pin(toks)
    before = snapshot(cache)
    for call, exc in (
        (lambda: cache.pin(toks, tier="disk"), ValueError),
        (lambda: cache.pin(toks, ttl_s=0), ValueError),
        (lambda: cache.pin(toks, ttl_s="1"), ValueError),
        (lambda: cache.pin([-1, 0, 0, 0]), ValueError),
        (lambda: cache.pin(np.arange(900, 900 + PS)), HiCacheError),
        (lambda: cache.pin(np.arange(900, 900 + PS), tier="host"), HiCacheError),
        (lambda: cache.unpin(toks, tier="host"), HiCacheError),
        (lambda: cache.unpin(toks[:PS]), HiCacheError),
        (lambda: cache.unpin(toks, extra_key=1), HiCacheError),
    ):
        with pytest.raises(exc):
            call()
        assert snapshot(cache) == before
    cache.check_invariants()
    cache.close()


def test_reset_clears_pins():
    cache = _cache()
    toks = np.arange(2 * PS)
    serve(cache, toks)
    cache.pin(toks)
    cache.reset()
    assert cache.stats()["pins"] == 0
    serve(cache, toks)
    cache.evict(10**6)
    assert cache.lookup(toks)["device"] == 0
    cache.check_invariants()
    cache.close()


def test_pin_share_config_is_checked():
    from hicache_jax import HiCacheConfig

    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ValueError, match="pin_max_share"):
            HiCacheConfig(device_pages=4, pin_max_share=bad)
