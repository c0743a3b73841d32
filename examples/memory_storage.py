"""An in-memory L3 backend of a deployment's own, loaded with ``storage="python://..."``.

```python
cache = HiCache(spec, ..., storage="python://memory_storage:MemoryStorage?capacity_pages=4096")
```

(with this directory on ``sys.path``). It subclasses ``BackendBase``, which supplies the
protocol's handles, lanes, sub-batching and counters; the backend only says how to test, read,
write and delete entries (by key, and by key prefix for a namespace). Entries are whole
``EntryCodec`` entries (header + page), so a get verifies the spec fingerprint, the key and the
checksum exactly as the file backend does, and a torn or foreign entry is a miss. Keys are
write-once; when full, the oldest entry is dropped.
It passes ``hicache_jax.l3.storage.conformance.check``.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from hicache_jax.l3.storage.base import BackendBase
from hicache_jax.l3.storage.format import HEADER_BYTES, Verdict, check_key_prefix


class MemoryStorage(BackendBase):
    """L3 pages in a dict in this process (a sketch of the protocol, not a shared store).

    Args:
        spec, host_buffer, layout: as for every backend (``open_storage`` passes them).
        capacity_pages: most entries held (a query string value arrives as a string).
        batch_pages: pages per sub-batch.
    """

    def __init__(self, spec, host_buffer, layout, *, capacity_pages=1024, batch_pages=32):
        capacity_pages = int(capacity_pages)
        if capacity_pages < 1:
            raise ValueError(f"capacity_pages={capacity_pages} must be >= 1")
        super().__init__(spec, host_buffer, layout, batch_pages=int(batch_pages))
        self.url = f"python://memory_storage:MemoryStorage?capacity_pages={capacity_pages}"
        self.capacity_pages = capacity_pages
        self._entries: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._store_lock = threading.Lock()
        self._row = np.empty(self.codec.entry_bytes, np.uint8)

    def delete(self, keys):
        """The protocol's optional ``delete`` (``HiCache.invalidate``): which keys it removed."""
        keys = self._check_open_keys(keys)
        with self._store_lock:
            return np.array([self._entries.pop(k, None) is not None for k in keys], dtype=bool)

    def delete_prefix(self, prefix):
        """The optional ``delete_prefix`` (a namespace's ``HiCache.invalidate``): every entry
        whose key starts with ``prefix`` goes; how many."""
        prefix = check_key_prefix(prefix)
        self._check_open_keys(())
        with self._store_lock:
            gone = [k for k in self._entries if k.startswith(prefix)]
            for k in gone:
                del self._entries[k]
        return len(gone)

    def _exists(self, keys):
        with self._store_lock:
            return np.array([k in self._entries for k in keys], dtype=bool)

    def _get(self, keys, ids):
        ok = np.zeros(len(keys), dtype=bool)
        for i, (key, page) in enumerate(zip(keys, ids)):
            with self._store_lock:
                entry = self._entries.get(key)
            if entry is None:
                self._count(pages_missed=1)
                continue
            row = np.frombuffer(entry, np.uint8)
            payload = row[HEADER_BYTES:]
            if self.codec.verify(row[:HEADER_BYTES], key, [payload], row.size) is not Verdict.VALID:
                self._count(pages_corrupt=1)
                continue
            self.host.write_page(int(page), payload)
            ok[i] = True
            self._count(pages_got=1, bytes_read=len(entry))
        return ok

    def _put(self, keys, ids):
        ok = np.ones(len(keys), dtype=bool)
        for key, page in zip(keys, ids):
            with self._store_lock:
                if key in self._entries:
                    continue
            self.host.read_page(int(page), self._row[HEADER_BYTES:])
            self.codec.pack_into(self._row[:HEADER_BYTES], key, [self._row[HEADER_BYTES:]])
            with self._store_lock:
                self._entries[key] = self._row.tobytes()
                while len(self._entries) > self.capacity_pages:
                    self._entries.popitem(last=False)
            self._count(puts_stored=1, bytes_written=self._row.size)
        return ok

    def _close(self):
        with self._store_lock:
            self._entries.clear()
