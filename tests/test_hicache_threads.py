"""HiCache's owning thread and close: calls from another thread are refused and change nothing,
ownership is taken by the first call and handed over explicitly (or goes to the next caller once
the owner exits, even when its ident is reused), and after close every call but stats raises."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from helpers import check_cache, gated_cache, serve_kv, snapshot, tree_pages
from hicache_jax import HiCacheError


def _in_thread(fn):
    """Run ``fn`` on a new thread; returns what it returned or raised."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # handed back to the test thread
            out["error"] = e

    th = threading.Thread(target=run, name="intruder")
    th.start()
    th.join()
    return out


def test_calls_from_a_second_thread_are_refused_and_change_nothing():
    cache, kv = gated_cache()
    t = np.arange(4)
    serve_kv(cache, kv, t)  # this thread owns the cache now
    m = cache.match_prefix(t)
    mine = cache.alloc_pages(1)
    calls = [
        lambda: cache.match_prefix(t),
        lambda: cache.load_back(m),
        lambda: cache.lock(m.node),
        lambda: cache.alloc_pages(1),
        lambda: cache.free_pages(mine),
        lambda: cache.read_kv(mine),
        lambda: cache.insert(t[:1] + 50, mine),
        lambda: cache.evict(4),
        lambda: cache.evict_host(4),
        lambda: cache.flush(),
        lambda: cache.take_events(),
        lambda: cache.reset(),
        lambda: cache.close(),
        lambda: cache.release_thread(),
        lambda: cache.device_pool,
    ]
    before = snapshot(cache), tree_pages(cache)
    for call in calls:
        out = _in_thread(call)
        assert isinstance(out.get("error"), HiCacheError), (call, out)
        assert "owned by thread 'MainThread'" in str(out["error"])
        assert "intruder" in str(out["error"])
        assert (snapshot(cache), tree_pages(cache)) == before
    assert _in_thread(cache.stats)["value"]["device_pages"] == 16  # stats: from anywhere
    cache.free_pages(mine)
    check_cache(cache, kv)


class _Worker:
    """One long-lived thread that runs what it is given (thread idents are reused once a
    thread exits, so a test of ownership keeps its threads alive)."""

    def __init__(self, name: str) -> None:
        import queue

        self._jobs: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (fn := self._jobs.get()) is not None:
            try:
                self._results.put(("value", fn()))
            except BaseException as e:  # handed back to the test thread
                self._results.put(("error", e))

    def run(self, fn):
        self._jobs.put(fn)
        kind, out = self._results.get(timeout=60)
        if kind == "error":
            raise out
        return out

    def stop(self) -> None:
        self._jobs.put(None)
        self.thread.join()


def test_ownership_is_taken_by_the_first_call_and_handed_over_explicitly():
    """Built on one thread, served from another (a serving stack's scheduler thread); then
    handed back with release_thread(); a cache whose owner exited goes to the next caller."""
    cache, kv = gated_cache()
    t = np.arange(4)
    sched, other = _Worker("scheduler"), _Worker("other")
    sched.run(lambda: serve_kv(cache, kv, t))  # the first call: it owns the cache
    with pytest.raises(HiCacheError, match="owned by thread 'scheduler'"):
        cache.match_prefix(t)
    with pytest.raises(HiCacheError, match="owned by thread 'scheduler'"):
        other.run(cache.release_thread)  # only the owner hands it over
    sched.run(cache.release_thread)
    assert cache.match_prefix(t).device_len == 4  # this thread took it
    with pytest.raises(HiCacheError, match="owned by thread 'MainThread'"):
        sched.run(lambda: cache.match_prefix(t))
    cache.release_thread()
    assert other.run(lambda: cache.match_prefix(t).device_len) == 4
    other.stop()  # the owner exits without handing over
    assert sched.run(lambda: cache.match_prefix(t).device_len) == 4
    sched.stop()
    check_cache(cache, kv)


def test_a_reused_thread_ident_keeps_the_cache_with_the_live_thread():
    """CPython reuses a thread's ident as soon as it exits: a new thread with the dead owner's
    ident passes the owner check and uses the cache, so no third thread may take it then."""
    cache, kv = gated_cache()
    t = np.arange(4)
    owner = _Worker("first")
    owner.run(lambda: serve_kv(cache, kv, t))
    owner.stop()  # the owner exits ...
    heir = _Worker("heir")
    cache._threads.ident = heir.thread.ident  # ... and the OS hands its ident to a new thread
    assert heir.run(lambda: cache.match_prefix(t).device_len) == 4
    with pytest.raises(HiCacheError, match="owned by thread 'heir'"):
        cache.match_prefix(t)
    heir.stop()
    assert cache.match_prefix(t).device_len == 4  # the heir exited too: this thread takes it


def test_every_call_after_close_raises_but_stats():
    cache, kv = gated_cache()
    t = np.arange(4)
    serve_kv(cache, kv, t)
    m = cache.match_prefix(t)
    cache.close()
    cache.close()  # idempotent
    for call in [
        lambda: cache.match_prefix(t),
        lambda: cache.load_back(m),
        lambda: cache.lock(m.node),
        lambda: cache.alloc_pages(1),
        lambda: cache.insert(t, m.device_pages),
        lambda: cache.read_kv(m.device_pages),
        lambda: cache.evict(1),
        lambda: cache.flush(),
        lambda: cache.take_events(),
        lambda: cache.reset(),
        lambda: cache.prefetch(t),
        lambda: cache.device_pool,
        lambda: cache.release_thread(),
    ]:
        with pytest.raises(HiCacheError, match="closed"):
            call()
    assert cache.stats()["device_cached_tokens"] == 4
    assert "value" in _in_thread(cache.stats)
