"""Mooncake backend: ``MooncakeDistributedStore`` (PyPI ``mooncake-transfer-engine-non-cuda``).

This process is a client only (``global_segment_size=0``): the memory is mounted by a separate
holder (``mooncake_client --global_segment_size=...``) or by other clients; the metadata lives in
``mooncake_master``; no etcd (``P2PHANDSHAKE``), TCP transport by default.

Transfers: with an ``ENTRY_ROWS`` buffer (what HiCache's L3 staging pool is) each row already
is an entry, so ``batch_put_from`` / ``batch_get_into`` move one contiguous entry per key
straight from / into the registered buffer and the checksum runs in place: no copy on our side.
With a pool layout each page is staged with its 64-byte header in a registered buffer of this
backend (one memcpy, then one contiguous entry per key), or, with ``zero_copy=True``
(page_first buffers), passed as two buffers per key, the header and the page
(``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers``): no memcpy, but with
Mooncake 0.3.13 over TCP that call measured slower than staging, so it is off by default.
A handle of several sub-batches runs as a two-stage pipeline (store call of one sub-batch on a
mover thread while the lane checks or stages the next).

Known behaviour of the store, and what this module does about it:
- ``setup()`` holds the GIL and retries for minutes while the master is unreachable (20 tries,
  30 s RPC timeout each when the port accepts but does not answer). We first open a TCP
  connection to the master (bounded by ``setup_timeout_s``) and, unless the user exported them,
  set ``MC_STORE_CLIENT_SETUP_RETRIES=1`` and ``MC_RPC_TIMEOUT_MS`` / ``MC_RPC_CONNECT_TIMEOUT_MS``
  from ``setup_timeout_s`` (process-wide environment, read by each ``setup()``).
  Failure raises ``StorageUnavailableError`` naming the address.
- Keys are write-once (a put on an existing key is a no-op returning success): fine for
  content-addressed keys. An entry that fails its check (or has the wrong size, which the store
  reports as a failed transfer) is removed with ``force=True`` so a later put can repair it.
- Reads and ``exists`` take a lease (master ``--default_kv_lease_ttl``, 10 s by default): a
  leased object is neither removed without ``force`` nor evicted, so a store full of recently
  read entries refuses puts (``NO_AVAILABLE_HANDLE``: counted in ``puts_no_space``, dropped).
  A read slower than the lease may be torn by an eviction; the checksum turns that into a miss.
- A dead master makes calls take seconds (RPC_FAIL, -900); a dead holder fails its transfers
  (TRANSFER_FAIL, -800) until the master drops its segment (``--client_ttl``), then its keys
  are gone. When the master fails, or every transfer of a call fails, the backend stops calling
  the store for a backoff (1 s doubling to 30 s, then a TCP probe of the master first): gets are
  misses (``get_skipped``), puts are dropped (``puts_dropped``), ``exists`` is all False. Calls
  run on the lanes, so the cache's thread never waits on the store unless it waits on a handle.

Threads: the lanes of ``BackendBase`` plus one mover thread per lane and one for ``exists``;
each lane has two registered staging (or header) slots, one per pipeline stage (none for
``ENTRY_ROWS`` buffers).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache_jax.l3.storage.base import (
    BackendBase,
    StorageError,
    StorageHandle,
    StorageUnavailableError,
)
from hicache_jax.l3.storage.format import HEADER_BYTES, Verdict, check_key_prefix
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import check_bool, is_real

INSTALL_HINT = (
    "pip install mooncake-transfer-engine-non-cuda (the import also needs the system "
    "library libibverbs.so.1: apt-get install -y libibverbs1)"
)

# ErrorCode values of mooncake-store (types.h)
NO_AVAILABLE_HANDLE = -200  # no space in any mounted segment
INVALID_PARAMS = -600  # e.g. the object does not fit the buffers given
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_TRANSPORT_DOWN = (TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT)

#: Default bytes of one store call's staging rows (per lane, per slot: 4x this is registered).
STAGING_BYTES = 16 << 20


# Mooncake reads these at setup(); values the user exported before we were imported win.
_USER_ENV = {
    name: os.environ.get(name)
    for name in ("MC_STORE_CLIENT_SETUP_RETRIES", "MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS")
}


def _set_env(values: dict[str, str]) -> None:
    for name, value in values.items():
        if _USER_ENV.get(name) is None:
            os.environ[name] = value


def import_store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, or ``StorageUnavailableError`` saying why."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise StorageUnavailableError(f"cannot import mooncake.store ({e}); {INSTALL_HINT}") from e
    return MooncakeDistributedStore


def parse_address(addr: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port); ValueError otherwise."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"mooncake master address {addr!r} must be host:port")
    return host.strip("[]"), int(port)


def probe_tcp(addr: str, timeout_s: float) -> str | None:
    """None if a TCP connection to ``addr`` opens within ``timeout_s``, else the reason."""
    host, port = parse_address(addr)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except OSError as e:
        return f"{type(e).__name__}: {e}"


class _Breaker:
    """Stops calls to a store that just failed at the transport level, for a growing backoff."""

    def __init__(self, addr: str, min_s: float = 1.0, max_s: float = 30.0) -> None:
        self.addr, self.min_s, self.max_s = addr, min_s, max_s
        self._lock = threading.Lock()
        self._until = 0.0
        self._backoff = min_s
        self.trips = 0

    def allow(self) -> bool:
        with self._lock:
            if time.monotonic() < self._until:
                return False
            if self.trips == 0 or self._until == 0.0:
                return True
        if probe_tcp(self.addr, 0.5) is not None:
            self.trip()
            return False
        with self._lock:
            self._until = 0.0
        return True

    def trip(self) -> None:
        with self._lock:
            self.trips += 1
            self._until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self.max_s)

    def reset(self) -> None:
        with self._lock:
            self._backoff = self.min_s


class MooncakeStorage(BackendBase):
    """L3 pages in a Mooncake store.

    Counters: Mooncake's put of a key already present succeeds without writing (write-once) and
    its client does not say which happened, so here ``put_pages`` / ``bytes_written`` count pages
    the store *accepted*: stored now or present already (the file backend counts the latter
    apart, as ``put_existing``). Checking first would cost an extra round trip per put.

    Args:
        spec: KV spec of the entries.
        host_buffer: numpy page buffer, registered with the store (see ``zero_copy``).
        layout: its host layout, or ``ENTRY_ROWS`` (moved in place, no staging).
        master: ``"host:port"`` of ``mooncake_master``.
        local_hostname: this client's address as other nodes reach it.
        protocol: Mooncake transport ("tcp"; "rdma" where the hardware has it).
        device_names: RDMA device list ("" for TCP).
        setup_timeout_s: bound on reaching the master at setup.
        zero_copy: multi-buffer transfers straight from/into ``host_buffer`` (page_first only).
            Off by default: with Mooncake 0.3.13 over TCP the two-buffer calls measured slower
            than one registered staging buffer plus a memcpy (benchmarks/bench_storage.py).
        batch_pages: pages per store call (sub-batch of a handle); None: as many as fit in
            ``STAGING_BYTES`` (128 pages of 128 KiB). A handle of more pages runs as a two-stage
            pipeline of such calls.
        checksum: "auto" (xxh3 when the xxhash package is installed, else crc32), "crc32"
            or "xxh3", written into new entries (readers accept either).
        exists_timeout_s: bound on ``exists()`` (then all False, and the backend backs off).
    """

    def __init__(
        self,
        spec: KVSpec,
        host_buffer: np.ndarray,
        layout: HostLayout | str,
        master: str,
        *,
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_names: str = "",
        setup_timeout_s: float = 10.0,
        zero_copy: bool = False,
        batch_pages: int | None = None,
        checksum: str = "auto",
        exists_timeout_s: float = 2.0,
    ) -> None:
        parse_address(master)
        for name, value in (
            ("setup_timeout_s", setup_timeout_s),
            ("exists_timeout_s", exists_timeout_s),
        ):
            if not is_real(value) or value <= 0:
                raise ValueError(f"{name}={value!r} must be > 0")
        self.exists_timeout_s = float(exists_timeout_s)
        if batch_pages is None:  # (+64 B of header per row: 128 pages of 128 KiB = 16 MiB + 8 KiB)
            batch_pages = max(1, STAGING_BYTES // spec.page_bytes)
        super().__init__(spec, host_buffer, layout, batch_pages=batch_pages, checksum=checksum)
        check_bool("zero_copy", zero_copy)
        if zero_copy and (not self.host.contiguous or self.host.entries):
            raise ValueError(
                "zero_copy=True needs a page_first host_buffer (an entry_rows "
                "buffer is always moved in place)"
            )
        self.zero_copy = zero_copy
        self.in_place = self.host.entries  # each row is an entry: one buffer per key, no copy
        self.master = master
        self.url = f"mooncake://{master}"
        self._store: Any = None
        self._registered: list[int] = []
        try:
            self._store = self._setup(
                master, local_hostname, protocol, device_names, float(setup_timeout_s)
            )
            self._register(self.host.base, self.host.nbytes)
            # per lane, two slots (one in transfer, one being checked/filled): headers
            # [batch, 64], or staging rows [batch, entry] without zero-copy; none in place
            width = HEADER_BYTES if self.zero_copy else self.codec.entry_bytes
            self._bufs = (
                {}
                if self.in_place
                else {
                    (kind, slot): np.zeros((batch_pages, width), np.uint8)
                    for kind in ("get", "put")
                    for slot in (0, 1)
                }
            )
            for buf in self._bufs.values():
                self._register(buf.ctypes.data, buf.nbytes)
            self._movers = {
                kind: concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"hicache-l3-{kind}-mover"
                )
                for kind in ("get", "put", "exists")
            }
        except BaseException:
            self.close()
            raise
        self._breaker = _Breaker(master)

    # ---- setup -----------------------------------------------------------------------------
    def _setup(
        self, master: str, hostname: str, protocol: str, devices: str, timeout_s: float
    ) -> Any:
        store_cls = import_store_class()
        reason = probe_tcp(master, timeout_s)
        if reason is not None:
            raise StorageUnavailableError(
                f"Mooncake master {master} is unreachable ({reason}); start mooncake_master "
                f"there or fix the storage URL"
            )
        _set_env(
            {
                "MC_STORE_CLIENT_SETUP_RETRIES": "1",
                "MC_RPC_TIMEOUT_MS": str(int(timeout_s * 1000)),
                "MC_RPC_CONNECT_TIMEOUT_MS": str(int(min(timeout_s, 2.0) * 1000)),
            }
        )
        store = store_cls()
        rc = store.setup(hostname, "P2PHANDSHAKE", 0, 0, protocol, devices, master)
        if rc != 0:
            raise StorageUnavailableError(
                f"Mooncake client setup against master {master} failed (rc={rc}): the master "
                f"accepted a connection but did not answer in time"
            )
        return store

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageUnavailableError(
                f"Mooncake register_buffer({nbytes} bytes) failed: rc={rc}"
            )
        self._registered.append(ptr)

    # ---- lanes -----------------------------------------------------------------------------
    def _exists(self, keys: tuple[str, ...]) -> np.ndarray:
        if not self._breaker.allow():
            self._count(exists_skipped=len(keys))
            return np.zeros(len(keys), dtype=bool)
        # on its own thread, bounded: a master that just died makes this call take
        # seconds, and exists() is synchronous for the cache's thread
        pending = self._movers["exists"].submit(self._store.batch_is_exist, list(keys))
        try:
            codes = pending.result(timeout=self.exists_timeout_s)
        except concurrent.futures.TimeoutError:
            self._breaker.trip()
            self._count(exists_timeouts=1)
            return np.zeros(len(keys), dtype=bool)
        if any(c in _TRANSPORT_DOWN for c in codes):
            self._breaker.trip()
        return np.asarray([c == 1 for c in codes], dtype=bool)

    # A handle of more than batch_pages pages runs as a two-stage pipeline: the mover thread
    # runs the store call of sub-batch k+1 (it releases the GIL) while the lane checks /
    # prepares sub-batch k. Handles are not split further to make a pipeline: measured on 2
    # cores (bench_storage.py, RESULTS.md), four store calls of 4-32 pages overlapped this way
    # took longer than one call of 16-128 pages (Mooncake's per-call cost is ~1 ms over TCP).
    def _run(self, handle: StorageHandle) -> None:
        error = None
        try:
            n = len(handle.keys)
            size = self.batch_pages
            chunks = [slice(i, min(i + size, n)) for i in range(0, n, size)]
            if len(chunks) == 1:  # nothing to overlap: save the hop to the mover
                sl = chunks[0]
                if handle.kind == "get":
                    codes = self._get_transfer(handle, sl, 0)
                    if codes is not None:
                        handle._ok[sl] = self._get_check(handle.keys, handle.host_ids, 0, codes)
                else:
                    self._put_prepare(handle, sl, 0)
                    handle._ok[sl] = self._put_transfer(handle, sl, 0)
            elif handle.kind == "get":
                self._run_get(handle, chunks)
            else:
                self._run_put(handle, chunks)
        except BaseException as e:  # a bug, not an I/O failure: surfaced by wait()
            error = e
        finally:
            handle._finish(error)

    def _run_get(self, handle: StorageHandle, chunks: list[slice]) -> None:
        mover = self._movers["get"]
        pending: concurrent.futures.Future[list[int] | None] | None = mover.submit(
            self._get_transfer, handle, chunks[0], 0
        )
        try:
            for k, sl in enumerate(chunks):
                assert pending is not None  # the loop breaks once nothing is pending
                codes, pending = pending.result(), None
                if k + 1 < len(chunks) and not handle._cancelled:
                    pending = mover.submit(self._get_transfer, handle, chunks[k + 1], (k + 1) % 2)
                if codes is not None:
                    handle._ok[sl] = self._get_check(
                        handle.keys[sl], handle.host_ids[sl], k % 2, codes
                    )
                if pending is None:
                    break
        finally:  # never finish a handle while a transfer may still write its host pages
            if pending is not None:
                concurrent.futures.wait([pending])

    def _run_put(self, handle: StorageHandle, chunks: list[slice]) -> None:
        mover = self._movers["put"]
        self._put_prepare(handle, chunks[0], 0)
        pending: concurrent.futures.Future[np.ndarray] | None = mover.submit(
            self._put_transfer, handle, chunks[0], 0
        )
        try:
            for k, sl in enumerate(chunks):
                more = k + 1 < len(chunks) and not handle._cancelled
                if more:
                    self._put_prepare(handle, chunks[k + 1], (k + 1) % 2)  # overlaps transfer k
                assert pending is not None  # the loop breaks once nothing is pending
                handle._ok[sl], pending = pending.result(), None
                if not more:
                    break
                pending = mover.submit(self._put_transfer, handle, chunks[k + 1], (k + 1) % 2)
        finally:
            if pending is not None:
                concurrent.futures.wait([pending])

    def _get_transfer(self, handle: StorageHandle, sl: slice, slot: int) -> list[int] | None:
        keys, ids = list(handle.keys[sl]), handle.host_ids[sl]
        n = len(keys)
        if not self._breaker.allow():
            self._count(get_skipped=n, get_misses=n)
            return None
        if self.in_place:
            ptrs = [self.host.entry_address(p) for p in ids]
            return self._store.batch_get_into(keys, ptrs, [self.codec.entry_bytes] * n)
        buf = self._bufs["get", slot]
        if self.zero_copy:
            pairs = [
                [buf.ctypes.data + i * HEADER_BYTES, self.host.address(p)]
                for i, p in enumerate(ids)
            ]
            return self._store.batch_get_into_multi_buffers(
                keys, pairs, [[HEADER_BYTES, self.spec.page_bytes]] * n
            )
        ptrs = [buf.ctypes.data + i * self.codec.entry_bytes for i in range(n)]
        return self._store.batch_get_into(keys, ptrs, [self.codec.entry_bytes] * n)

    def _get_check(
        self, keys: tuple[str, ...], ids: np.ndarray, slot: int, codes: list[int]
    ) -> np.ndarray:
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        buf = self._bufs.get(("get", slot))
        bad, down, errors = [], 0, 0
        for i, (key, page, code) in enumerate(zip(keys, ids, codes)):
            if code >= 0:
                if self.in_place:
                    header, parts = self.host.header(page), self.host.parts(int(page))
                else:
                    assert buf is not None, "not in place: the slot's staging rows"
                    if self.zero_copy:
                        header, parts = buf[i, :HEADER_BYTES], self.host.parts(int(page))
                    else:
                        header, parts = buf[i, :HEADER_BYTES], [buf[i, HEADER_BYTES:]]
                verdict = self.codec.verify(header, key, parts, code)
                ok[i] = verdict is Verdict.VALID
                if ok[i] and buf is not None and not self.zero_copy:
                    # copy the row while the checksum pass has it in cache (a separate pass
                    # over all rows afterwards read them cold again: 2x slower, measured)
                    self.host.write_page(page, buf[i, HEADER_BYTES:])
                if verdict is Verdict.INVALID:
                    bad.append(key)
                elif verdict is Verdict.UNCHECKABLE:
                    self._count(uncheckable=1)
            elif code == OBJECT_NOT_FOUND:
                continue
            elif code in (TRANSFER_FAIL, INVALID_PARAMS) and self._wrong_size(key):
                bad.append(key)  # the store refuses to move an object of another size
            elif code in _TRANSPORT_DOWN:
                down += 1
            else:
                errors += 1
        self._health(codes, down, bool(ok.any()))
        for key in bad:  # force: our own read just took a lease on it
            self._store.remove(key, True)
        hits = int(ok.sum())
        self._count(
            get_pages=hits,
            get_misses=n - hits,
            corrupt=len(bad),
            get_errors=errors + down,
            bytes_read=hits * self.spec.page_bytes,
        )
        return ok

    def _wrong_size(self, key: str) -> bool:
        size = self._store.get_size(key)
        return size >= 0 and size != self.codec.entry_bytes

    def _put_prepare(self, handle: StorageHandle, sl: slice, slot: int) -> None:
        """Headers (and staged pages) of a sub-batch into its slot (in place: into the rows)."""
        keys, ids = handle.keys[sl], handle.host_ids[sl]
        if self.in_place:
            for key, page in zip(keys, ids):
                self.codec.pack_into(self.host.header(page), key, self.host.parts(int(page)))
            return
        buf = self._bufs["put", slot]
        if self.zero_copy:
            for i, (key, page) in enumerate(zip(keys, ids)):
                self.codec.pack_into(buf[i, :HEADER_BYTES], key, self.host.parts(int(page)))
        else:  # row by row: the checksum reads the row while the copy left it in cache
            for i, (key, page) in enumerate(zip(keys, ids)):
                self.host.read_page(page, buf[i, HEADER_BYTES:])
                self.codec.pack_into(buf[i, :HEADER_BYTES], key, [buf[i, HEADER_BYTES:]])

    def _put_transfer(self, handle: StorageHandle, sl: slice, slot: int) -> np.ndarray:
        keys, ids = list(handle.keys[sl]), handle.host_ids[sl]
        n = len(keys)
        if not self._breaker.allow():
            self._count(puts_dropped=n)
            return np.zeros(n, dtype=bool)
        if self.in_place:
            ptrs = [self.host.entry_address(p) for p in ids]
            codes = self._store.batch_put_from(keys, ptrs, [self.codec.entry_bytes] * n)
        elif self.zero_copy:
            buf = self._bufs["put", slot]
            pairs = [
                [buf.ctypes.data + i * HEADER_BYTES, self.host.address(p)]
                for i, p in enumerate(ids)
            ]
            codes = self._store.batch_put_from_multi_buffers(
                keys, pairs, [[HEADER_BYTES, self.spec.page_bytes]] * n
            )
        else:
            buf = self._bufs["put", slot]
            ptrs = [buf.ctypes.data + i * self.codec.entry_bytes for i in range(n)]
            codes = self._store.batch_put_from(keys, ptrs, [self.codec.entry_bytes] * n)
        ok = np.asarray([c == 0 for c in codes], dtype=bool)
        self._health(codes, sum(1 for c in codes if c in _TRANSPORT_DOWN), bool(ok.any()))
        stored = int(ok.sum())
        self._count(
            put_pages=stored,
            puts_dropped=n - stored,
            puts_no_space=sum(1 for c in codes if c == NO_AVAILABLE_HANDLE),
            bytes_written=stored * self.spec.page_bytes,
        )
        return ok

    def _health(self, codes: list[int], down: int, any_ok: bool) -> None:
        """Trip the breaker when the master is unreachable, or when transfers fail and none
        of the batch succeeded (a holder gone); a per-object failure does not trip it."""
        if any(c in (RPC_FAIL, RPC_TIMEOUT) for c in codes) or (down and not any_ok):
            self._breaker.trip()
            self._count(backend_errors=1)
        else:
            self._breaker.reset()

    def delete(self, keys: Sequence[str]) -> np.ndarray:
        """Remove the objects of ``keys`` (the protocol's optional method, for
        ``HiCache.invalidate``; ``force``: a lease does not keep an invalidated entry); bool
        mask: which the store removed (code 0)."""
        keys = self._check_open_keys(keys)
        return np.asarray([self._store.remove(k, True) == 0 for k in keys], dtype=bool)

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object whose key starts with ``prefix`` (the protocol's optional method,
        for a namespace's ``HiCache.invalidate``): one ``remove_by_regex`` on the master, with
        ``force``, so other clients' entries go too; returns how many it removed.

        Raises:
            StorageError: the store answered with an error code (nothing known removed)."""
        prefix = check_key_prefix(prefix)
        self._check_open_keys(())
        code = int(self._store.remove_by_regex("^" + re.escape(prefix), True))
        if code < 0:
            self._count(backend_errors=1)
            raise StorageError(f"mooncake remove_by_regex of {prefix!r} failed: code {code}")
        return code

    def _close(self) -> None:
        for mover in getattr(self, "_movers", {}).values():
            mover.shutdown(wait=True)
        if self._store is None:
            return
        for ptr in self._registered:
            self._store.unregister_buffer(ptr)
        self._registered.clear()
        self._store.close()
        self._store = None
