"""File backend: one file per page entry in a local directory (the NVMe case).

Layout: ``<root>/<last 2 hex of the key>/<key>`` (keys not ending in hex: a digest picks the folder), temporary files in ``<root>/.tmp``. A put writes
the header and the page with one ``writev`` straight from the page buffer into a temp file, then
``os.replace``s it into place, so a reader sees a whole entry or none; a get ``readv``s header and
page straight into the host page and checks them (bad header, short file or checksum mismatch:
a miss, and the broken file is removed so a later put can repair it). No fsync by default
(``fsync=True`` syncs the file before the rename and the directory after).

Capacity (optional): LRU by file mtime, which every instance sharing the directory updates on a
hit, so the order is shared. Each instance counts its own writes; when its estimate exceeds the
bound, or it has written 5% of the bound since its last scan, it scans the directory and removes
the oldest entries down to 90% of the bound. With k instances the directory can overshoot by
about k x 5% between scans. Concurrent instances are safe: renames are atomic, a removed file
that another instance has open stays readable, and a vanished file is a miss.

Threads: the lanes of ``BackendBase``; this module holds no JAX arrays.
"""

from __future__ import annotations

import hashlib
import os
import re
import time
import uuid
from typing import Any

import numpy as np

from hicache_jax.spec import HostLayout, KVSpec, check_bool
from hicache_jax.storage._base import BackendBase, StorageUnavailableError
from hicache_jax.storage.format import HEADER_BYTES, Verdict

_TMP = ".tmp"
_STALE_TMP_S = 600.0       # temp files older than this are leftovers of a crashed writer
_LOW_WATER = 0.9           # capacity enforcement removes down to this fraction
_RESCAN_FRACTION = 0.05    # rescan after writing this fraction of the capacity
_MAX_IOV = 512             # stay well under IOV_MAX (1024) per readv/writev call
_HEX2 = re.compile(r"^[0-9a-f]{2}$")


class FileStorage(BackendBase):
    """L3 pages as files under ``root``.

    Args:
        spec: KV spec of the entries.
        host_buffer: numpy page buffer (see ``HostPages``); pages are read from / written to it.
        layout: its host layout, or ``ENTRY_ROWS`` (header read and written in the row's slot).
        root: directory (created if missing).
        capacity_bytes: optional bound on the bytes of all entries in ``root`` (LRU removal).
        fsync: make each put durable before it counts as stored.
        batch_pages: pages per sub-batch of a handle.
        checksum: "auto" (xxh3 when the xxhash package is installed, else crc32), "crc32"
            or "xxh3", written into new entries (readers accept either).
    """

    def __init__(self, spec: KVSpec, host_buffer: np.ndarray, layout: HostLayout | str,
                 root: str | os.PathLike, *, capacity_bytes: int | None = None,
                 fsync: bool = False, batch_pages: int = 32, checksum: str = "auto") -> None:
        root = os.fspath(root)
        entry = HEADER_BYTES + spec.page_bytes
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool)
                                           or not isinstance(capacity_bytes, int)
                                           or capacity_bytes < entry):
            raise ValueError(f"capacity_bytes={capacity_bytes!r} must be None or an int >= one "
                             f"entry ({entry} bytes)")
        check_bool("fsync", fsync)
        super().__init__(spec, host_buffer, layout, batch_pages=batch_pages, checksum=checksum)
        self.url = f"file://{os.path.abspath(root)}"
        self.root = root
        try:
            os.makedirs(os.path.join(root, _TMP), exist_ok=True)
            for i in range(256):
                os.makedirs(os.path.join(root, f"{i:02x}"), exist_ok=True)
        except OSError as e:
            self.close()
            raise StorageUnavailableError(f"file storage directory {root!r} is not usable: {e}") from e
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._headers = {kind: np.zeros(HEADER_BYTES, np.uint8) for kind in ("get", "put")}
        self._usage = 0
        self._since_scan = 0
        self._remove_stale_tmp()
        if capacity_bytes is not None:
            self._enforce_capacity()

    def path(self, key: str) -> str:
        """Where the entry of ``key`` lives: folder = the key's last two characters when they
        are lowercase hex (the cache's keys end in a page hash), else a digest of the key."""
        tail = key[-2:]
        if len(tail) != 2 or not _HEX2.match(tail):
            tail = hashlib.blake2b(key.encode(), digest_size=1).hexdigest()
        return os.path.join(self.root, tail, key)

    # ---- lanes -----------------------------------------------------------------------------
    def _exists(self, keys: tuple[str, ...]) -> np.ndarray:
        return np.fromiter((os.path.exists(self.path(k)) for k in keys), dtype=bool, count=len(keys))

    def _get(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(keys), dtype=bool)
        header = self._headers["get"]
        for i, (key, page) in enumerate(zip(keys, ids)):
            ok[i] = self._get_one(key, int(page), header)
        hits = int(ok.sum())
        self._count(get_pages=hits, get_misses=len(keys) - hits,
                    bytes_read=hits * self.spec.page_bytes)
        return ok

    def _get_one(self, key: str, page: int, header: np.ndarray) -> bool:
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        except OSError:
            self._count(get_errors=1)
            return False
        try:
            parts = self.host.parts(page)
            if self.host.entries:  # the row's own header slot: header + page in one run
                header = self.host.header(page)
            size = os.fstat(fd).st_size
            nread = self._readv(fd, [header] + parts) if size == self.codec.entry_bytes else size
            verdict = self.codec.verify(header, key, parts, nread)
            if verdict is Verdict.VALID:
                self._touch(fd)  # LRU: a hit makes the entry young for every instance
                return True
        except OSError:
            self._count(get_errors=1)
            return False
        finally:
            os.close(fd)
        if verdict is Verdict.UNCHECKABLE:
            self._count(uncheckable=1)
            return False
        self._count(corrupt=1)
        self._unlink(path)
        return False

    def _put(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(keys), dtype=bool)
        header = self._headers["put"]
        written = 0
        for i, (key, page) in enumerate(zip(keys, ids)):
            path = self.path(key)
            try:
                os.stat(path)
            except FileNotFoundError:
                pass
            except OSError:
                self._count(puts_dropped=1)
                continue
            else:  # write-once: present already, just refresh its LRU age
                self._touch(path)
                ok[i] = True
                self._count(put_existing=1)
                continue
            ok[i] = self._put_one(path, key, int(page), header)
            written += int(ok[i])
        self._count(put_pages=written, bytes_written=written * self.spec.page_bytes)
        if self.capacity_bytes is not None and written:
            entry = self.codec.entry_bytes
            self._usage += written * entry
            self._since_scan += written * entry
            if (self._usage > self.capacity_bytes
                    or self._since_scan > _RESCAN_FRACTION * self.capacity_bytes):
                self._enforce_capacity()
        return ok

    def _put_one(self, path: str, key: str, page: int, header: np.ndarray) -> bool:
        parts = self.host.parts(page)
        if self.host.entries:
            header = self.host.header(page)
        self.codec.pack_into(header, key, parts)
        tmp = os.path.join(self.root, _TMP, f"{key}.{uuid.uuid4().hex}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                n = self._writev(fd, [header] + parts)
                if n != self.codec.entry_bytes:
                    raise OSError(f"short write: {n} of {self.codec.entry_bytes} bytes")
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if self.fsync:
                self._fsync_dir(os.path.dirname(path))
            return True
        except OSError:
            self._count(puts_dropped=1)
            self._unlink(tmp)
            return False

    # ---- capacity --------------------------------------------------------------------------
    def _scan(self) -> list[tuple[int, int, str]]:
        entries = []
        for i in range(256):
            try:
                with os.scandir(os.path.join(self.root, f"{i:02x}")) as it:
                    for e in it:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        entries.append((st.st_mtime_ns, st.st_size, e.path))
            except FileNotFoundError:
                continue
        return entries

    def _enforce_capacity(self) -> None:
        entries = self._scan()
        total = sum(size for _, size, _ in entries)
        if total > self.capacity_bytes:
            entries.sort()
            target = _LOW_WATER * self.capacity_bytes
            removed = 0
            for _, size, path in entries:
                if total <= target:
                    break
                if self._unlink(path):
                    removed += 1
                total -= size  # gone either way: by us or by another instance
            self._count(evictions=removed)
        self._usage = total
        self._since_scan = 0

    def usage_bytes(self) -> int:
        """Bytes of all entries in the directory now (a full scan)."""
        return sum(size for _, size, _ in self._scan())

    # ---- small helpers ---------------------------------------------------------------------
    def _remove_stale_tmp(self) -> None:
        now = time.time()
        with os.scandir(os.path.join(self.root, _TMP)) as it:
            for e in it:
                try:
                    if now - e.stat().st_mtime > _STALE_TMP_S:
                        self._unlink(e.path)
                except FileNotFoundError:
                    continue

    def _touch(self, target: int | str) -> None:
        """Refresh an entry's LRU age (mtime), best effort: an entry another user owns, or a
        read-only directory, is still a valid entry (counted ``lru_touch_failed``)."""
        try:
            os.utime(target)
        except OSError:
            self._count(lru_touch_failed=1)

    @staticmethod
    def _unlink(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:  # already gone (another instance) or not ours to remove
            return False

    @staticmethod
    def _readv(fd: int, bufs: list[Any]) -> int:
        return sum(os.readv(fd, bufs[i:i + _MAX_IOV]) for i in range(0, len(bufs), _MAX_IOV))

    @staticmethod
    def _writev(fd: int, bufs: list[Any]) -> int:
        return sum(os.writev(fd, bufs[i:i + _MAX_IOV]) for i in range(0, len(bufs), _MAX_IOV))

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _close(self) -> None:
        return None
