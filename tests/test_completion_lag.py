"""HiCacheConfig.completion_lag (TransferEngine.complete_after): copies count as done at the
K-th request start after their dispatch, so the cache's decisions depend on its calls, not on
when copies land (ARCHITECTURE.md, "Several processes")."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import bookkeeping_spec
from hicache_jax import HiCache, HiCacheConfig
from hicache_jax.memory.transfer import TransferEngine


class _Slow:
    """A completion token that never says ready until waited on (a link still moving)."""

    def __init__(self, token) -> None:
        self._token, self._waited = token, False

    def is_ready(self) -> bool:
        return self._waited

    def block_until_ready(self):
        self._waited = True
        return self._token.block_until_ready()


class SlowEngine(TransferEngine):
    """Every copy looks in flight to a poll until something waits for it."""

    def _track(self, handle):
        handle._tokens = [_Slow(t) for t in handle._tokens]
        return super()._track(handle)


def _run(lag, engine=TransferEngine) -> tuple[list, dict]:
    """A workload whose copies (write-backs of what it evicts, load-backs) stay in flight from
    one request into the next; its decisions and counters."""
    spec = bookkeeping_spec()
    cache = HiCache(
        spec,
        HiCacheConfig(
            device_pages=10,
            host_pages=14,
            load_back_threshold=4,
            write_policy="write_back",
            completion_lag=lag,
        ),
        transfer_engine=engine,
    )
    rng = np.random.default_rng(3)
    bases = [rng.integers(0, 1000, 24) for _ in range(4)]
    log = []
    for _ in range(60):
        tokens = np.concatenate(
            [
                bases[rng.integers(4)][: 4 * int(rng.integers(1, 7))],
                rng.integers(0, 1000, 4 * int(rng.integers(0, 3))),
            ]
        )
        with cache.begin(tokens) as req:
            log.append(req.cached_len)
            req.extend(tokens.size - req.cached_len)
            req.finish(tokens)
        cache.check_invariants()
    cache.flush()
    stats = {k: v for k, v in cache.stats().items() if isinstance(v, int) and "lag_waits" not in k}
    waits = cache.stats()["completion_lag_waits"]
    cache.close()
    return log, stats | {"_waits": waits}


@pytest.mark.parametrize("lag", [1, 3])
def test_decisions_do_not_depend_on_when_copies_land(lag):
    log, stats = _run(lag)
    slow_log, slow = _run(lag, SlowEngine)
    assert stats["evictions"] and stats["backups"] and stats["load_backs"], stats
    assert slow_log == log
    assert {k: v for k, v in slow.items() if k != "_waits"} == {
        k: v for k, v in stats.items() if k != "_waits"
    }
    assert slow["_waits"] > 0  # the slow link's copies were waited for at their start


def test_without_a_lag_a_slow_link_changes_decisions():
    """What the lag removes: applied when seen landed, a slower link decides otherwise."""
    log, stats = _run(None)
    slow_log, slow = _run(None, SlowEngine)
    assert (slow_log, slow) != (log, stats)


def test_a_copy_counts_as_done_at_its_lagth_request_start_only():
    spec = bookkeeping_spec()
    cache = HiCache(spec, HiCacheConfig(device_pages=8, host_pages=8, completion_lag=2))
    engine = cache.transfer_engine
    cache.match_prefix(np.arange(4))  # start 1
    with cache.begin(np.arange(8)) as req:  # start 2
        req.extend(8)
        req.finish(np.arange(8))
    h = engine.backup(*_allocated(cache))  # dispatched after start 2
    h._tokens[0].block_until_ready()
    assert not h.done() and engine.poll(agree=False) == []  # landed, not a start: in flight
    engine.poll()  # start 3: one start after its dispatch
    assert not h.done()
    engine.poll()  # start 4: the second
    assert h.done()
    assert engine.stats()["completion_lag_waits"] == 0  # it had landed: nothing waited
    cache.flush()
    cache.close()


def _allocated(cache):
    dev = cache.device_pool.allocator.alloc(1)
    host = cache.host_pool.allocator.alloc(1)
    return dev, host


def test_bad_completion_lag():
    with pytest.raises(ValueError, match="completion_lag"):
        HiCacheConfig(device_pages=8, completion_lag=0)
    with pytest.raises(TypeError, match="completion_lag"):
        HiCacheConfig(device_pages=8, completion_lag=1.5)
    assert HiCacheConfig(device_pages=8).completion_lag is None
