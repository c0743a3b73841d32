"""Mooncake backend: ``MooncakeDistributedStore`` (PyPI ``mooncake-transfer-engine-non-cuda``).

This process is a client only (``global_segment_size=0``): the memory is mounted by a separate
holder (``mooncake_client --global_segment_size=...``) or by other clients; the metadata lives in
``mooncake_master``; no etcd (``P2PHANDSHAKE``), TCP transport by default.

Transfers (zero-copy where the layout allows it):
- page_first host pool: ``batch_put_from_multi_buffers`` / ``batch_get_into_multi_buffers`` with
  two buffers per key, the 64-byte header (a registered buffer of this backend) and the page
  itself in the registered host pool;
- layer_first host pool (or ``zero_copy=False``): pages are gathered into a registered staging
  buffer next to their headers and moved with ``batch_put_from`` / ``batch_get_into``.

Known behaviour of the store, and what this module does about it:
- ``setup()`` holds the GIL and retries for minutes while the master is unreachable (20 tries,
  30 s RPC timeout each when the port accepts but does not answer). We first open a TCP
  connection to the master (bounded by ``setup_timeout_s``) and, unless the user exported them,
  set ``MC_STORE_CLIENT_SETUP_RETRIES=1`` and ``MC_RPC_TIMEOUT_MS`` / ``MC_RPC_CONNECT_TIMEOUT_MS``
  from ``setup_timeout_s`` (process-wide environment, read by each ``setup()``).
  Failure raises ``StorageUnavailableError`` naming the address.
- Keys are write-once (a put on an existing key is a no-op returning success): fine for
  content-addressed keys. An entry that fails its check is removed with ``force=True`` (reads
  take a lease that would otherwise block the removal) so a later put can repair it.
- A dead master makes every call take seconds (RPC_FAIL, -900), a dead holder fails transfers
  (TRANSFER_FAIL, -800). After either, the backend stops calling the store for a backoff
  (1 s doubling to 30 s; then a TCP probe of the master first): gets are misses
  (``get_skipped``), puts are dropped (``puts_dropped``). Calls run on the lanes, so the
  cache's thread never waits on them unless it waits on a handle.

Threads: the lanes of ``BackendBase``; each lane has its own registered header/staging buffers.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Any

import numpy as np

from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.storage._base import BackendBase, StorageUnavailableError
from hicache_jax.storage.format import HEADER_BYTES

INSTALL_HINT = ("pip install mooncake-transfer-engine-non-cuda (the import also needs the system "
                "library libibverbs.so.1: apt-get install -y libibverbs1)")

# ErrorCode values of mooncake-store (types.h)
NO_AVAILABLE_HANDLE = -200   # no space in any mounted segment
INVALID_PARAMS = -600        # e.g. the object does not fit the buffers given
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800
RPC_FAIL = -900
RPC_TIMEOUT = -901
_TRANSPORT_DOWN = (TRANSFER_FAIL, RPC_FAIL, RPC_TIMEOUT)


# Mooncake reads these at setup(); values the user exported before we were imported win.
_USER_ENV = {name: os.environ.get(name) for name in (
    "MC_STORE_CLIENT_SETUP_RETRIES", "MC_RPC_TIMEOUT_MS", "MC_RPC_CONNECT_TIMEOUT_MS")}


def _set_env(values: dict[str, str]) -> None:
    for name, value in values.items():
        if _USER_ENV.get(name) is None:
            os.environ[name] = value


def import_store_class() -> type:
    """``mooncake.store.MooncakeDistributedStore``, or ``StorageUnavailableError`` saying why not."""
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

    Args:
        spec: KV spec of the entries.
        host_buffer: the host pool array (registered with the store for zero-copy transfers).
        layout: its host layout.
        master: ``"host:port"`` of ``mooncake_master``.
        local_hostname: this client's address as other nodes reach it.
        protocol: Mooncake transport ("tcp"; "rdma" where the hardware has it).
        device_names: RDMA device list ("" for TCP).
        setup_timeout_s: bound on reaching the master at setup.
        zero_copy: multi-buffer transfers straight from/into the host pool (page_first only);
            None: whenever the layout allows it.
        batch_pages: pages per store call (sub-batch of a handle).
    """

    def __init__(self, spec: KVSpec, host_buffer: np.ndarray, layout: HostLayout | str,
                 master: str, *, local_hostname: str = "127.0.0.1", protocol: str = "tcp",
                 device_names: str = "", setup_timeout_s: float = 10.0,
                 zero_copy: bool | None = None, batch_pages: int = 32) -> None:
        parse_address(master)
        if not isinstance(setup_timeout_s, (int, float)) or setup_timeout_s <= 0:
            raise ValueError(f"setup_timeout_s={setup_timeout_s!r} must be > 0")
        super().__init__(spec, host_buffer, layout, batch_pages=batch_pages)
        if zero_copy and not self.host.contiguous:
            raise ValueError("zero_copy=True needs a page_first host pool")
        self.zero_copy = self.host.contiguous if zero_copy is None else bool(zero_copy)
        self.master = master
        self.url = f"mooncake://{master}"
        self._store: Any = None
        self._registered: list[int] = []
        try:
            self._store = self._setup(master, local_hostname, protocol, device_names,
                                      float(setup_timeout_s))
            self._register(self.host.base, self.host.nbytes)
            # per lane: headers [batch, 64] (+ staging rows [batch, entry] without zero-copy)
            width = HEADER_BYTES if self.zero_copy else self.codec.entry_bytes
            self._bufs = {kind: np.zeros((batch_pages, width), np.uint8) for kind in ("get", "put")}
            for buf in self._bufs.values():
                self._register(buf.ctypes.data, buf.nbytes)
        except BaseException:
            self.close()
            raise
        self._breaker = _Breaker(master)

    # ---- setup -----------------------------------------------------------------------------
    def _setup(self, master: str, hostname: str, protocol: str, devices: str,
               timeout_s: float) -> Any:
        store_cls = import_store_class()
        reason = probe_tcp(master, timeout_s)
        if reason is not None:
            raise StorageUnavailableError(
                f"Mooncake master {master} is unreachable ({reason}); start mooncake_master "
                f"there or fix the storage URL")
        _set_env({"MC_STORE_CLIENT_SETUP_RETRIES": "1",
                  "MC_RPC_TIMEOUT_MS": str(int(timeout_s * 1000)),
                  "MC_RPC_CONNECT_TIMEOUT_MS": str(int(min(timeout_s, 2.0) * 1000))})
        store = store_cls()
        rc = store.setup(hostname, "P2PHANDSHAKE", 0, 0, protocol, devices, master)
        if rc != 0:
            raise StorageUnavailableError(
                f"Mooncake client setup against master {master} failed (rc={rc}): the master "
                f"accepted a connection but did not answer in time")
        return store

    def _register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageUnavailableError(f"Mooncake register_buffer({nbytes} bytes) failed: rc={rc}")
        self._registered.append(ptr)

    # ---- lanes -----------------------------------------------------------------------------
    def _exists(self, keys: tuple[str, ...]) -> np.ndarray:
        if not self._breaker.allow():
            self._count(exists_skipped=len(keys))
            return np.zeros(len(keys), dtype=bool)
        codes = self._store.batch_is_exist(list(keys))
        if any(c in _TRANSPORT_DOWN for c in codes):
            self._breaker.trip()
        return np.asarray([c == 1 for c in codes], dtype=bool)

    def _get(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        n = len(keys)
        ok = np.zeros(n, dtype=bool)
        if not self._breaker.allow():
            self._count(get_skipped=n)
            return ok
        buf = self._bufs["get"]
        if self.zero_copy:
            ptrs = [[buf.ctypes.data + i * HEADER_BYTES, self.host.address(p)]
                    for i, p in enumerate(ids)]
            codes = self._store.batch_get_into_multi_buffers(
                list(keys), ptrs, [[HEADER_BYTES, self.spec.page_bytes]] * n)
        else:
            ptrs = [buf.ctypes.data + i * self.codec.entry_bytes for i in range(n)]
            codes = self._store.batch_get_into(list(keys), ptrs, [self.codec.entry_bytes] * n)
        bad, down, errors = [], 0, 0
        for i, (key, page, code) in enumerate(zip(keys, ids, codes)):
            if code >= 0:
                if self.zero_copy:
                    header, parts = buf[i, :HEADER_BYTES], self.host.parts(int(page))
                else:
                    header, parts = buf[i, :HEADER_BYTES], [buf[i, HEADER_BYTES:]]
                ok[i] = self.codec.verify(header, key, parts, code)
                if not ok[i]:
                    bad.append(key)
            elif code == OBJECT_NOT_FOUND:
                continue
            elif code in (TRANSFER_FAIL, INVALID_PARAMS) and self._wrong_size(key):
                bad.append(key)  # the store refuses to move an object of another size
            elif code in _TRANSPORT_DOWN:
                down += 1
            else:
                errors += 1
        if not self.zero_copy and ok.any():
            self.host.scatter(ids[ok], buf[:n][ok][:, HEADER_BYTES:])
        self._health(codes, down, ok.any())
        for key in bad:  # force: our own read just took a lease on it
            self._store.remove(key, True)
        hits = int(ok.sum())
        self._count(get_pages=hits, get_misses=n - hits, corrupt=len(bad),
                    get_errors=errors + down, bytes_read=hits * self.spec.page_bytes)
        return ok

    def _wrong_size(self, key: str) -> bool:
        size = self._store.get_size(key)
        return size >= 0 and size != self.codec.entry_bytes

    def _put(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        n = len(keys)
        if not self._breaker.allow():
            self._count(puts_dropped=n)
            return np.zeros(n, dtype=bool)
        buf = self._bufs["put"]
        if self.zero_copy:
            for i, (key, page) in enumerate(zip(keys, ids)):
                self.codec.pack_into(buf[i, :HEADER_BYTES], key, self.host.parts(int(page)))
            ptrs = [[buf.ctypes.data + i * HEADER_BYTES, self.host.address(p)]
                    for i, p in enumerate(ids)]
            codes = self._store.batch_put_from_multi_buffers(
                list(keys), ptrs, [[HEADER_BYTES, self.spec.page_bytes]] * n)
        else:
            self.host.gather(ids, buf[:, HEADER_BYTES:])
            for i, key in enumerate(keys):
                self.codec.pack_into(buf[i, :HEADER_BYTES], key, [buf[i, HEADER_BYTES:]])
            ptrs = [buf.ctypes.data + i * self.codec.entry_bytes for i in range(n)]
            codes = self._store.batch_put_from(list(keys), ptrs, [self.codec.entry_bytes] * n)
        ok = np.asarray([c == 0 for c in codes], dtype=bool)
        self._health(codes, sum(1 for c in codes if c in _TRANSPORT_DOWN), ok.any())
        stored = int(ok.sum())
        self._count(put_pages=stored, puts_dropped=n - stored,
                    puts_no_space=sum(1 for c in codes if c == NO_AVAILABLE_HANDLE),
                    bytes_written=stored * self.spec.page_bytes)
        return ok

    def _health(self, codes: list[int], down: int, any_ok: bool) -> None:
        """Trip the breaker when the master is unreachable, or when transfers fail and none
        of the batch succeeded (a holder gone); a per-object failure does not trip it."""
        if any(c == RPC_FAIL or c == RPC_TIMEOUT for c in codes) or (down and not any_ok):
            self._breaker.trip()
            self._count(backend_errors=1)
        else:
            self._breaker.reset()

    def _close(self) -> None:
        if self._store is None:
            return
        for ptr in self._registered:
            self._store.unregister_buffer(ptr)
        self._registered.clear()
        self._store.close()
        self._store = None
