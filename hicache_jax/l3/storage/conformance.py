"""A conformance kit a backend author runs against their class: ``check(factory)``.

``factory(spec, host_buffer, layout)`` opens a fresh backend over ``host_buffer`` (a numpy
``page_first`` buffer). Each check states a behaviour the cache relies on; the first one broken
raises ``ConformanceError`` naming it (``check`` returns the names of the checks passed):

- ``missing keys``: ``exists`` of keys never put is all False, a get of them lands nothing.
- ``round trip``: a page put then got comes back bit for bit (no stale or foreign data).
- ``partial batch``: a get of some stored and some missing keys lands exactly the stored ones.
- ``write once``: a put under a key already stored leaves the stored page.
- ``no blocking``: every handle finishes within ``timeout_s`` (a backend that blocks fails).
- ``errors``: nothing but ``StorageError`` escapes a call or a ``wait`` (an I/O failure is a miss).
- ``close during work``: ``close`` with a put in flight returns, and the handle finishes.
"""

from __future__ import annotations

import uuid
from typing import Any, Callable

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.spec import KVSpec
from hicache_jax.l3.storage.base import StorageError
from hicache_jax.l3.storage.format import page_keys

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
NUM_PAGES = 16


class ConformanceError(HiCacheError, AssertionError):
    """A backend broke a behaviour the cache relies on (the message names it)."""


def check(factory: Callable[[KVSpec, np.ndarray, str], Any], timeout_s: float = 5.0) -> list[str]:
    """Run every check against fresh backends from ``factory``; the names of those passed."""
    passed = []
    for name, fn in _CHECKS:
        buf = _buffer()
        try:
            store = factory(SPEC, buf, "page_first")
        except Exception as exc:
            raise ConformanceError(f"{name}: factory raised {type(exc).__name__}: {exc}") from exc
        try:
            fn(_Probe(name, store, buf, timeout_s))
        finally:
            try:
                store.close()
            except Exception:
                pass
        passed.append(name)
    return passed


def _buffer() -> np.ndarray:
    info = np.iinfo(SPEC.bits_dtype)
    return np.random.default_rng(0).integers(0, info.max, SPEC.page_major_shape(NUM_PAGES),
                                             dtype=SPEC.bits_dtype, endpoint=True)


class _Probe:
    def __init__(self, name: str, store: Any, buf: np.ndarray, timeout_s: float) -> None:
        self.name, self.store, self.buf, self.timeout_s = name, store, buf, timeout_s
        self.extra = uuid.uuid4().hex  # keys no earlier run stored

    def keys(self, n: int, first: int = 0) -> list[str]:
        return page_keys(SPEC, np.arange(first, first + n * SPEC.page_size), self.extra)

    def fail(self, what: str) -> None:
        raise ConformanceError(f"{self.name}: {what}")

    def call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self.store, op)(*args)
        except StorageError:
            raise
        except Exception as exc:
            raise ConformanceError(f"errors: {op} raised {type(exc).__name__}: {exc} (only "
                                   "StorageError may escape; an I/O failure is a miss)") from exc

    def wait(self, op: str, handle: Any) -> np.ndarray:
        try:
            return np.asarray(handle.wait(self.timeout_s), dtype=bool)
        except TimeoutError:
            raise ConformanceError(f"no blocking: {op} did not finish within {self.timeout_s} s "
                                   "(the backend blocks)") from None
        except StorageError as exc:
            cause = exc.__cause__
            if cause is not None and not isinstance(cause, StorageError):
                raise ConformanceError(f"errors: {op} raised {type(cause).__name__}: {cause} "
                                       "inside the backend") from exc
            raise

    def put(self, keys: list[str], ids: list[int]) -> np.ndarray:
        return self.wait("put", self.call("put_from", keys, np.asarray(ids)))

    def get(self, keys: list[str], ids: list[int]) -> np.ndarray:
        return self.wait("get", self.call("get_into", keys, np.asarray(ids)))


def _missing(p: _Probe) -> None:
    keys = p.keys(3)
    if np.asarray(p.call("exists", keys)).any():
        p.fail("exists reports keys never put")
    before = p.buf[[8, 9, 10]].copy()
    if p.get(keys, [8, 9, 10]).any():
        p.fail("a get of keys never put reports pages landed")
    if not np.array_equal(p.buf[[8, 9, 10]], before):
        p.fail("a get of keys never put wrote host pages")


def _round_trip(p: _Probe) -> None:
    keys = p.keys(2)
    if not p.put(keys, [0, 1]).all():
        p.fail("a put of 2 pages did not store them")
    if not np.asarray(p.call("exists", keys)).all():
        p.fail("exists misses pages just put")
    p.buf[[8, 9]] = 0
    if not p.get(keys, [8, 9]).all():
        p.fail("a get of pages just put missed")
    if not np.array_equal(p.buf[[8, 9]], p.buf[[0, 1]]):
        p.fail("stale data: a get reported pages landed whose bytes differ from those put")


def _partial(p: _Probe) -> None:
    keys = p.keys(4)
    p.put([keys[0], keys[2]], [2, 3])
    ok = p.get(keys, [8, 9, 10, 11])
    if ok.tolist() != [True, False, True, False]:
        p.fail(f"a get of stored/missing/stored/missing keys landed {ok.tolist()}")
    if not np.array_equal(p.buf[[8, 10]], p.buf[[2, 3]]):
        p.fail("stale data: pages of a partial batch differ from those put")


def _write_once(p: _Probe) -> None:
    keys = p.keys(1)
    p.put(keys, [4])
    p.put(keys, [5])
    p.get(keys, [8])
    if not np.array_equal(p.buf[8], p.buf[4]):
        p.fail("a second put under a stored key replaced its page")


def _close_during_work(p: _Probe) -> None:
    handle = p.call("put_from", p.keys(8), np.arange(8))
    p.call("close")
    try:
        handle.wait(p.timeout_s)
    except TimeoutError:
        p.fail(f"a put in flight at close did not finish within {p.timeout_s} s")
    except StorageError:
        pass


_CHECKS = [("missing keys", _missing), ("round trip", _round_trip), ("partial batch", _partial),
           ("write once", _write_once), ("close during work", _close_during_work)]
