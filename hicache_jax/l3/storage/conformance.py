"""A conformance kit a backend author runs against their class: ``check(factory)``.

``factory(spec, host_buffer, layout)`` opens a fresh backend over ``host_buffer`` (a numpy
``page_first`` buffer). Each check states a behaviour the cache relies on; the first one broken
raises ``ConformanceError`` naming it (``check`` returns the names of the checks passed, in
order; a check of an optional capability the backend lacks is skipped, so not named):

- ``missing keys``: ``exists`` of keys never put is all False, a get of them lands nothing.
- ``round trip``: a page put then got comes back bit for bit (no stale or foreign data).
- ``partial batch``: a get of some stored and some missing keys lands exactly the stored ones.
- ``write once``: a put under a key already stored leaves the stored page.
- ``delete`` (only where the backend has the optional ``delete``, which ``HiCache.invalidate``
  uses): a mask of what it removed (False for keys never put, no error); a removed key is gone
  from ``exists`` and gets, the others stay, and a later put stores it again.
- ``delete by prefix`` (only where the backend has the optional ``delete_prefix``, which a
  namespace's ``HiCache.invalidate`` uses): every entry whose key starts with the prefix goes
  (both key generations of a namespace), the count it returns says how many, entries of another
  namespace stay whole, and a later put stores a removed key again.
- ``put racing a get``: a get of keys whose put is in flight lands, per page, nothing or the
  whole page put (never a torn page); once the put is done, the get lands them all.
- ``torn or foreign entry`` (only where entries are files, i.e. the backend has ``path(key)``):
  a truncated entry, another key's entry and a bit-flipped one at a key's path are misses, not
  data (the cache would serve the bytes of a page it reports landed).
- ``two processes`` (only with ``shared=True``, for a store that several instances share):
  pages a writer in another process puts while this one reads arrive whole, and all of them.
  ``factory`` must then be picklable (a module-level function, a class, a ``functools.partial``)
  and open the same store in any process.
- ``close during work``: ``close`` with a put and a get in flight returns, both handles finish,
  and a call after close raises ``StorageError``.

Throughout: every handle finishes within ``timeout_s`` (``no blocking``: a backend that blocks
fails), and nothing but ``StorageError`` escapes a call or a ``wait`` (``errors``: an I/O
failure is a miss, not an exception; an error raised inside the backend is a bug).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import time
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np

from hicache_jax.errors import HiCacheError
from hicache_jax.l3.storage.base import StorageError
from hicache_jax.l3.storage.format import key_strings, namespace_prefix, page_keys
from hicache_jax.spec import KVSpec
from hicache_jax.tree.hashing import chain_digests, namespace_seed

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
NUM_PAGES = 16
_RACE_ROUNDS = 20
_SPAWN_S = 60.0  # a spawned interpreter imports numpy and jax first: seconds on a busy machine


class ConformanceError(HiCacheError, AssertionError):
    """A backend broke a behaviour the cache relies on (the message names it)."""


def check(
    factory: Callable[[KVSpec, np.ndarray, str], Any],
    timeout_s: float = 5.0,
    *,
    shared: bool = False,
) -> list[str]:
    """Run every check against fresh backends from ``factory``; the names of those passed.

    Args:
        factory: opens a backend (see the module docstring).
        timeout_s: the longest any handle may take.
        shared: also run ``two processes`` (a store shared between instances).
    """
    passed = []
    for name, fn in _CHECKS:
        if name == "two processes" and not shared:
            continue
        buf = _buffer()
        try:
            store = factory(SPEC, buf, "page_first")
        except Exception as exc:
            raise ConformanceError(f"{name}: factory raised {type(exc).__name__}: {exc}") from exc
        probe = _Probe(name, store, buf, timeout_s, factory)
        try:
            ran = fn(probe)
        finally:
            with contextlib.suppress(Exception):
                store.close()
        if ran is not False:
            passed.append(name)
    return passed


def _buffer() -> np.ndarray:
    info = np.iinfo(SPEC.bits_dtype)
    return np.random.default_rng(0).integers(
        0, info.max, SPEC.page_major_shape(NUM_PAGES), dtype=SPEC.bits_dtype, endpoint=True
    )


class _Probe:
    def __init__(
        self, name: str, store: Any, buf: np.ndarray, timeout_s: float, factory: Any
    ) -> None:
        self.name, self.store, self.buf, self.timeout_s = name, store, buf, timeout_s
        self.factory = factory
        self.extra = uuid.uuid4().hex  # keys no earlier run stored

    def keys(self, n: int, first: int = 0, extra: str | None = None) -> list[str]:
        return page_keys(SPEC, np.arange(first, first + n * SPEC.page_size), extra or self.extra)

    def fail(self, what: str) -> None:
        raise ConformanceError(f"{self.name}: {what}")

    def call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self.store, op)(*args)
        except StorageError:
            raise
        except Exception as exc:
            raise ConformanceError(
                f"errors: {op} raised {type(exc).__name__}: {exc} (only "
                "StorageError may escape; an I/O failure is a miss)"
            ) from exc

    def wait(self, op: str, handle: Any) -> np.ndarray:
        try:
            return np.asarray(handle.wait(self.timeout_s), dtype=bool)
        except TimeoutError:
            raise ConformanceError(
                f"no blocking: {op} did not finish within {self.timeout_s} s (the backend blocks)"
            ) from None
        except StorageError as exc:
            cause = exc.__cause__
            if cause is not None and not isinstance(cause, StorageError):
                raise ConformanceError(
                    f"errors: {op} raised {type(cause).__name__}: {cause} inside the backend"
                ) from exc
            raise

    def put(self, keys: list[str], ids: list[int]) -> np.ndarray:
        return self.wait("put", self.call("put_from", keys, np.asarray(ids)))

    def get(self, keys: list[str], ids: list[int]) -> np.ndarray:
        return self.wait("get", self.call("get_into", keys, np.asarray(ids)))

    def landed_whole(self, ok: np.ndarray, dst: list[int], src: list[int], what: str) -> None:
        """Every page ``ok`` says landed in ``dst[i]`` equals ``src[i]``."""
        for i in np.flatnonzero(ok).tolist():
            if not np.array_equal(self.buf[dst[i]], self.buf[src[i]]):
                self.fail(
                    f"{what}: a get reported page {i} landed whose bytes differ from "
                    "those put (a torn or stale page)"
                )


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


def _delete(p: _Probe) -> bool:
    if not callable(getattr(p.store, "delete", None)):
        return False  # optional: invalidate then leaves the entries (counted by the cache)
    keys = p.keys(4)
    if np.asarray(p.call("delete", keys[3:]), dtype=bool).tolist() != [False]:
        p.fail("delete of a key never put reports it removed")
    p.put(keys[:3], [0, 1, 2])
    gone = np.asarray(p.call("delete", [keys[0], keys[2], keys[3]]), dtype=bool)
    if gone.tolist() != [True, True, False]:
        p.fail(f"delete of stored/stored/missing keys returned {gone.tolist()}")
    if np.asarray(p.call("exists", keys[:3]), dtype=bool).tolist() != [False, True, False]:
        p.fail("exists after delete: a deleted key is still there, or a kept one is gone")
    ok = p.get(keys[:3], [8, 9, 10])
    if ok.tolist() != [False, True, False]:
        p.fail(f"a get after delete of keys 0 and 2 landed {ok.tolist()} (a deleted key serves)")
    if not p.put(keys[:1], [5]).all() or not p.get(keys[:1], [11]).all():
        p.fail(
            "a put after delete did not store the key again (invalidated pages could "
            "never come back)"
        )
    if not np.array_equal(p.buf[11], p.buf[5]):
        p.fail("a put after delete serves the deleted page, not the new one")
    return True


def _delete_prefix(p: _Probe) -> bool:
    if not callable(getattr(p.store, "delete_prefix", None)):
        return False  # optional: a namespace's invalidate then reaches only the keys it knows
    other = p.extra + "-other"
    gone_ns = p.keys(3)
    seed = namespace_seed(SPEC.fingerprint(), p.extra)  # the same namespace, generation 1
    digests = chain_digests(seed, np.arange(100, 100 + SPEC.page_size).reshape(1, -1))
    gone_ns += key_strings(SPEC, p.extra, digests, generation=1)
    kept = p.keys(2, extra=other)
    p.put(gone_ns, [0, 1, 2, 3])
    p.put(kept, [4, 5])
    n = p.call("delete_prefix", namespace_prefix(SPEC, p.extra))
    if np.asarray(p.call("exists", gone_ns), dtype=bool).any():
        p.fail(
            f"an entry of the prefix is still there after delete_prefix (exists "
            f"{np.asarray(p.call('exists', gone_ns), dtype=bool).tolist()}, generation 0 x3 "
            "then 1)"
        )
    if p.get(gone_ns, [8, 9, 10, 11]).any():
        p.fail("a get after delete_prefix landed a removed entry")
    if not isinstance(n, (int, np.integer)) or int(n) != len(gone_ns):
        p.fail(f"delete_prefix returned {n!r}, {len(gone_ns)} entries were removed")
    if not p.get(kept, [12, 13]).all() or not np.array_equal(p.buf[12:14], p.buf[4:6]):
        p.fail("delete_prefix removed or changed an entry of another namespace")
    if int(p.call("delete_prefix", namespace_prefix(SPEC, p.extra))) != 0:
        p.fail("a second delete_prefix of the same prefix reported entries removed")
    if (
        not p.put(gone_ns[:1], [6]).all()
        or not p.get(gone_ns[:1], [14]).all()
        or not np.array_equal(p.buf[14], p.buf[6])
    ):
        p.fail("a put after delete_prefix did not store the key again")
    return True


def _race(p: _Probe) -> None:
    src, dst = list(range(8)), list(range(8, 16))
    for r in range(_RACE_ROUNDS):
        keys = p.keys(8, first=8 * r)
        put = p.call("put_from", keys, np.asarray(src))
        p.buf[dst] = 0
        ok = p.wait("get", p.call("get_into", keys, np.asarray(dst)))  # while the put runs
        p.landed_whole(ok, dst, src, "a get racing a put")
        if not p.wait("put", put).all():
            p.fail("a put of 8 pages did not store them")
        p.buf[dst] = 0
        ok = p.get(keys, dst)
        if not ok.all():
            p.fail(f"a get after the put finished landed {int(ok.sum())} of 8 pages")
        p.landed_whole(ok, dst, src, "a get after a put")


def _tampered(p: _Probe) -> bool:
    path = getattr(p.store, "path", None)
    if not callable(path):
        return False  # entries are not files this kit can reach
    keys = p.keys(4)
    if not p.put(keys, [0, 1, 2, 3]).all():
        p.fail("a put of 4 pages did not store them")
    files = [path(k) for k in keys]
    with open(files[0], "r+b") as f:  # torn: a writer died half way
        f.truncate(os.path.getsize(files[0]) // 2)
    with open(files[3], "rb") as src, open(files[1], "wb") as f:  # foreign: another key's
        f.write(src.read())  # entry under this key
    with open(files[2], "r+b") as f:  # a bit flipped in the page
        f.seek(-1, os.SEEK_END)
        last = f.read(1)[0]
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last ^ 1]))
    p.buf[[8, 9, 10, 11]] = 0
    ok = p.get(keys, [8, 9, 10, 11])
    for i, what in enumerate(
        ("a truncated entry", "another key's entry", "an entry with a flipped bit")
    ):
        if ok[i]:
            p.fail(f"a get of {what} reported the page landed (it must be a miss)")
    if not ok[3] or not np.array_equal(p.buf[11], p.buf[3]):
        p.fail("an intact entry beside tampered ones did not round-trip")
    return True


def _writer(factory: Any, keys: list[str], timeout_s: float) -> None:
    """The other process: opens the store, puts page i under ``keys[i]`` two at a time."""
    buf = _buffer()
    store = factory(SPEC, buf, "page_first")
    try:
        for lo in range(0, len(keys), 2):
            store.put_from(keys[lo : lo + 2], np.arange(lo, lo + 2)).wait(timeout_s)
    finally:
        store.close()


def _two_processes(p: _Probe) -> None:
    keys = p.keys(8)
    ctx = multiprocessing.get_context("spawn")
    writer = ctx.Process(target=_writer, args=(p.factory, keys, p.timeout_s), daemon=True)
    writer.start()
    src, dst = list(range(8)), list(range(8, 16))
    deadline = time.monotonic() + _SPAWN_S + p.timeout_s
    try:
        while True:  # read while the writer writes: whole pages or none
            finished = not writer.is_alive()  # before the get: then every put is in
            p.buf[dst] = 0
            ok = p.get(keys, dst)
            p.landed_whole(ok, dst, src, "a reader beside a writer process")
            if ok.all():
                break
            if finished and writer.exitcode != 0:
                p.fail(f"the writer process failed (exit code {writer.exitcode})")
            if finished:
                p.fail(
                    f"pages put in another process never all reached this one ({int(ok.sum())}"
                    " of 8): the store is not shared between processes"
                )
            if time.monotonic() > deadline:
                p.fail(f"the writer process did not finish within {_SPAWN_S + p.timeout_s} s")
            time.sleep(0.01)
    finally:
        writer.join(p.timeout_s + _SPAWN_S)
        if writer.is_alive():
            writer.kill()
            writer.join()


def _close_during_work(p: _Probe) -> None:
    keys = p.keys(8)
    p.put(keys[4:], [4, 5, 6, 7])
    put = p.call("put_from", keys[:4], np.arange(4))
    get = p.call("get_into", keys[4:], np.arange(8, 12))
    p.call("close")
    for op, handle in (("put", put), ("get", get)):
        try:
            handle.wait(p.timeout_s)
        except TimeoutError:
            p.fail(f"a {op} in flight at close did not finish within {p.timeout_s} s")
        except StorageError:
            pass
    try:
        p.call("exists", keys)
    except StorageError:
        return
    p.fail("exists after close did not raise StorageError")


_CHECKS = [
    ("missing keys", _missing),
    ("round trip", _round_trip),
    ("partial batch", _partial),
    ("write once", _write_once),
    ("delete", _delete),
    ("delete by prefix", _delete_prefix),
    ("put racing a get", _race),
    ("torn or foreign entry", _tampered),
    ("two processes", _two_processes),
    ("close during work", _close_during_work),
]
