"""File backend: one file per page entry in a local directory (the NVMe case).

Layout: ``<root>/<last 2 hex of the key>/<key>`` (keys not ending in hex: a digest picks the
folder), temporary files in ``<root>/.tmp``. A put writes the header and the page with one
``writev`` straight from the page buffer into a temp file, then ``os.replace``s it into place, so a
reader sees a whole entry or none; a get ``readv``s header and page straight into the host page and
checks them (bad header, short file or checksum mismatch: a miss, and the broken file is removed so
a later put can repair it). No fsync by default (``fsync=True`` syncs the file before the rename and
the directory after).

Capacity (optional): LRU by file mtime, which every instance sharing the directory updates on a
hit, so the order is shared. Each instance counts its own writes; when its estimate exceeds the
bound, or it has written 5% of the bound since its last scan, it scans the directory and removes
the oldest entries down to 90% of the bound. With k instances the directory can overshoot by
about k x 5% between scans. Concurrent instances are safe: renames are atomic, a removed file
that another instance has open stays readable, and a vanished file is a miss.

A directory others write to: the store reads, counts and removes only what it writes itself.
An entry is a regular file named like a key (``check_keys``) in the folder ``path`` gives that
name; a temp file is ``.tmp/<key>.<32 hex>``. Anything else at an entry path (a directory, FIFO,
device, a symlink: never followed, never waited on) is a miss, a put onto it is dropped, and both
count ``not_regular``; other names are never counted or removed. The store refuses a ``.tmp`` or
two-hex folder that is a symlink (``StorageUnavailableError``), and removes files through a
descriptor of their folder opened without following symlinks, only while the name still holds
the file it looked at. Temp files older than ``_STALE_TMP_S`` (a crashed writer's) are swept at
open, at each capacity scan, and at least every ``_SWEEP_INTERVAL_S`` of a long-lived instance;
younger ones (another process's write in flight) count against the capacity.

Threads: the lanes of ``BackendBase``; this module holds no JAX arrays.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from hicache_jax.l3.storage.base import BackendBase, StorageError, StorageUnavailableError
from hicache_jax.l3.storage.format import HEADER_BYTES, Verdict, check_key_prefix, check_keys
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import check_bool, is_int

_TMP = ".tmp"
_STALE_TMP_S = 600.0  # temp files older than this are leftovers of a crashed writer
_SWEEP_INTERVAL_S = 60.0  # a long-lived instance sweeps stale temp files this often (at a put)
_LOW_WATER = 0.9  # capacity enforcement removes down to this fraction
_RESCAN_FRACTION = 0.05  # rescan after writing this fraction of the capacity
_MAX_IOV = 512  # stay well under IOV_MAX (1024) per readv/writev call
_HEX2 = re.compile(r"^[0-9a-f]{2}$")
_FOLDERS = tuple(f"{i:02x}" for i in range(256))
_TMP_NAME = re.compile(r"(.+)\.[0-9a-f]{32}")  # <key>.<uuid4 hex>, as _put_one names them
# O_NONBLOCK: opening a FIFO never waits for a writer (fstat then refuses it); it has no effect
# on reads of a regular file. O_NOFOLLOW: a symlink at an entry path fails to open (ELOOP).
_ENTRY_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


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

    def __init__(
        self,
        spec: KVSpec,
        host_buffer: np.ndarray,
        layout: HostLayout | str,
        root: str | os.PathLike,
        *,
        capacity_bytes: int | None = None,
        fsync: bool = False,
        batch_pages: int = 32,
        checksum: str = "auto",
    ) -> None:
        root = os.fspath(root)
        entry = HEADER_BYTES + spec.page_bytes
        if capacity_bytes is not None and (not is_int(capacity_bytes) or capacity_bytes < entry):
            raise ValueError(
                f"capacity_bytes={capacity_bytes!r} must be None or an int >= one "
                f"entry ({entry} bytes)"
            )
        check_bool("fsync", fsync)
        super().__init__(spec, host_buffer, layout, batch_pages=batch_pages, checksum=checksum)
        self.url = f"file://{os.path.abspath(root)}"
        self.root = root
        try:
            os.makedirs(root, exist_ok=True)
            for name in (_TMP,) + _FOLDERS:
                self._own_folder(os.path.join(root, name))
        except OSError as e:
            self.close()
            raise StorageUnavailableError(
                f"file storage directory {root!r} is not usable: {e}"
            ) from e
        except StorageUnavailableError:
            self.close()
            raise
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self._headers = {kind: np.zeros(HEADER_BYTES, np.uint8) for kind in ("get", "put")}
        self._usage = 0
        self._since_scan = 0
        self._last_sweep = time.monotonic()
        if capacity_bytes is not None:
            self._enforce_capacity(capacity_bytes)  # sweeps the temp folder too
        else:
            self._sweep_tmp()

    @staticmethod
    def _own_folder(path: str) -> None:
        """Create ``path`` or check that it is a real directory (not a symlink to one)."""
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            raise StorageUnavailableError(
                f"file storage folder {path!r} is a symlink or not a directory: the store keeps "
                f"its own folders there (remove it, or point file:// at another directory)"
            )

    def path(self, key: str) -> str:
        """Where the entry of ``key`` lives: folder = the key's last two characters when they
        are lowercase hex (the cache's keys end in a page hash), else a digest of the key."""
        return os.path.join(self.root, _folder(key), key)

    def delete(self, keys: Sequence[str]) -> np.ndarray:
        """Remove the entries of ``keys`` (the protocol's optional method, for
        ``HiCache.invalidate``); bool mask: which this call removed (False: absent)."""
        keys = self._check_open_keys(keys)
        return np.fromiter((self._unlink(self.path(k)) for k in keys), dtype=bool, count=len(keys))

    def delete_prefix(self, prefix: str) -> int:
        """Remove every entry whose key starts with ``prefix`` (the protocol's optional method,
        for a namespace's ``HiCache.invalidate``): a scan of the directory, so entries of other
        processes and earlier runs go too; returns how many this call removed."""
        prefix = check_key_prefix(prefix)
        if self._closed:
            raise StorageError(f"storage backend {self.url} is closed")
        removed = 0
        for folder in _FOLDERS:
            names = [
                (name, st.st_ino)
                for name, st in self._listing(folder)
                if name.startswith(prefix) and _folder(name) == folder and _is_key(name)
            ]
            removed += self._remove(folder, names)
        return removed

    # ---- lanes -----------------------------------------------------------------------------
    def _exists(self, keys: tuple[str, ...]) -> np.ndarray:
        return np.fromiter((_is_regular(self.path(k)) for k in keys), dtype=bool, count=len(keys))

    def _get(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(keys), dtype=bool)
        header = self._headers["get"]
        for i, (key, page) in enumerate(zip(keys, ids)):
            ok[i] = self._get_one(key, int(page), header)
        hits = int(ok.sum())
        self._count(
            get_pages=hits, get_misses=len(keys) - hits, bytes_read=hits * self.spec.page_bytes
        )
        return ok

    def _get_one(self, key: str, page: int, header: np.ndarray) -> bool:
        path = self.path(key)
        try:
            fd = os.open(path, _ENTRY_FLAGS)
        except FileNotFoundError:
            return False
        except OSError as e:
            refused = e.errno in (errno.ELOOP, errno.EMLINK) or _is_other(path)  # symlink, socket
            self._count(**{"not_regular" if refused else "get_errors": 1})
            return False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a directory, FIFO, device: not an entry
                self._count(not_regular=1)
                return False
            parts = self.host.parts(page)
            if self.host.entries:  # the row's own header slot: header + page in one run
                header = self.host.header(page)
            size = st.st_size
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
        self._remove(_folder(key), [(key, st.st_ino)])
        return False

    def _put(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        ok = np.zeros(len(keys), dtype=bool)
        header = self._headers["put"]
        written = 0
        for i, (key, page) in enumerate(zip(keys, ids)):
            path = self.path(key)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                pass
            except OSError:
                self._count(puts_dropped=1)
                continue
            else:
                if not stat.S_ISREG(st.st_mode):  # not ours to replace: left as it is
                    self._count(puts_dropped=1, not_regular=1)
                    continue
                # write-once: present already, just refresh its LRU age
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
            if (
                self._usage > self.capacity_bytes
                or self._since_scan > _RESCAN_FRACTION * self.capacity_bytes
            ):
                self._enforce_capacity(self.capacity_bytes)
        if time.monotonic() - self._last_sweep >= _SWEEP_INTERVAL_S:
            self._sweep_tmp()
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

    # ---- capacity and sweeps ---------------------------------------------------------------
    def _scan(self) -> list[tuple[int, int, str, str, int]]:
        """The store's entries now: ``(mtime_ns, size, folder, name, inode)``."""
        return [
            (st.st_mtime_ns, st.st_size, folder, name, st.st_ino)
            for folder in _FOLDERS
            for name, st in self._listing(folder)
            if _folder(name) == folder and _is_key(name)
        ]

    def _enforce_capacity(self, capacity_bytes: int) -> None:
        """Remove the oldest entries down to the low-water mark once over ``capacity_bytes``."""
        entries = self._scan()
        total = self._sweep_tmp() + sum(size for _, size, _, _, _ in entries)
        if total > capacity_bytes:
            entries.sort()
            target = _LOW_WATER * capacity_bytes
            victims: dict[str, list[tuple[str, int]]] = {}
            for _, size, folder, name, ino in entries:
                if total <= target:
                    break
                victims.setdefault(folder, []).append((name, ino))
                total -= size  # gone either way: by us or by another instance
            removed = sum(self._remove(folder, names) for folder, names in victims.items())
            self._count(evictions=removed)
        self._usage = total
        self._since_scan = 0

    def usage_bytes(self) -> int:
        """Bytes of the store's files in the directory now: entries and temp files (a full scan)."""
        temps = sum(st.st_size for name, st in self._listing(_TMP) if _is_temp(name))
        return temps + sum(size for _, size, _, _, _ in self._scan())

    def _sweep_tmp(self) -> int:
        """Remove the store's temp files older than ``_STALE_TMP_S``; returns the bytes of the
        younger ones (writes in flight, of this or another process)."""
        self._last_sweep = time.monotonic()
        cutoff = time.time() - _STALE_TMP_S
        stale, live = [], 0
        for name, st in self._listing(_TMP):
            if not _is_temp(name):
                continue
            if st.st_mtime < cutoff:
                stale.append((name, st.st_ino))
            else:
                live += st.st_size
        self._count(temp_swept=self._remove(_TMP, stale))
        return live

    def _listing(self, folder: str) -> Iterator[tuple[str, os.stat_result]]:
        """``(name, lstat)`` of the regular files in one of the store's folders (nothing when
        the folder is gone or has become a symlink)."""
        try:
            fd = os.open(os.path.join(self.root, folder), _DIR_FLAGS)
        except OSError:
            return
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        if e.is_file(follow_symlinks=False):
                            yield e.name, e.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
        finally:
            os.close(fd)

    def _remove(self, folder: str, victims: list[tuple[str, int]]) -> int:
        """Unlink files ``(name, inode)`` of one of the store's folders, relative to a descriptor
        of it opened without following a symlink, each only while the name still holds that
        regular file (another writer may have replaced it). Returns how many were removed."""
        if not victims:
            return 0
        try:
            fd = os.open(os.path.join(self.root, folder), _DIR_FLAGS)
        except OSError:
            return 0
        removed = 0
        try:
            for name, ino in victims:
                try:
                    st = os.lstat(name, dir_fd=fd)
                    if stat.S_ISREG(st.st_mode) and st.st_ino == ino:
                        os.unlink(name, dir_fd=fd)
                        removed += 1
                except OSError:  # already gone (another instance) or not ours to remove
                    continue
        finally:
            os.close(fd)
        return removed

    # ---- small helpers ---------------------------------------------------------------------
    def _touch(self, target: int | str) -> None:
        """Refresh an entry's LRU age (mtime), best effort: an entry another user owns, or a
        read-only directory, is still a valid entry (counted ``lru_touch_failed``)."""
        try:
            if isinstance(target, int):
                os.utime(target)
            else:
                os.utime(target, follow_symlinks=False)
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
        return sum(os.readv(fd, bufs[i : i + _MAX_IOV]) for i in range(0, len(bufs), _MAX_IOV))

    @staticmethod
    def _writev(fd: int, bufs: list[Any]) -> int:
        return sum(os.writev(fd, bufs[i : i + _MAX_IOV]) for i in range(0, len(bufs), _MAX_IOV))

    @staticmethod
    def _fsync_dir(path: str) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _close(self) -> None:
        return None


def _folder(name: str) -> str:
    """The folder of an entry name: its last two characters when they are lowercase hex (the
    cache's keys end in a page digest), else one byte of a digest of the name."""
    tail = name[-2:]
    if len(tail) != 2 or not _HEX2.match(tail):
        tail = hashlib.blake2b(name.encode(), digest_size=1).hexdigest()
    return tail


def _is_key(name: str) -> bool:
    try:
        check_keys((name,))
    except ValueError:
        return False
    return True


def _is_temp(name: str) -> bool:
    m = _TMP_NAME.fullmatch(name)
    return m is not None and _is_key(m.group(1))


def _is_regular(path: str) -> bool:
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _is_other(path: str) -> bool:
    """Whether something that is not a regular file is at ``path``."""
    try:
        return not stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False
