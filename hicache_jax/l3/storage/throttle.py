"""A file store throttled to a given bandwidth and latency, for tests and benchmarks
(ARCHITECTURE.md, "Load or recompute"): ``throttle+file:///dir?gbps=0.5&latency_ms=2``.

:class:`ThrottledFileStorage` is :class:`~hicache_jax.l3.storage.file.FileStorage` (same
entries, so a directory written by one is read by the other) whose gets and puts take at least
``latency_ms`` per handle plus ``bytes / (gbps * 1e9)`` for the pages it moves (paced per
sub-batch: a sub-batch that the disk served faster sleeps the difference; one it served slower
is not sped up). Gets and puts run on separate lanes, each its own link; ``exists`` is not
throttled (a lookup that the cache makes before any decision). It stands in for a remote or
slow store where the one at hand is a fast local disk: what a decision to load or recompute
sees, not a model of any particular store.

Threads: the lanes of ``BackendBase``.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import numpy as np

from hicache_jax.l3.storage.base import StorageHandle
from hicache_jax.l3.storage.file import FileStorage
from hicache_jax.spec import HostLayout, KVSpec
from hicache_jax.validation import is_real

__all__ = ["ThrottledFileStorage"]


class ThrottledFileStorage(FileStorage):
    """:class:`FileStorage` whose reads and writes are throttled (see the module docstring).

    Args:
        spec, host_buffer, layout, root, **options: as :class:`FileStorage`.
        gbps: bandwidth of each lane in GB/s (1e9 bytes per second), > 0.
        latency_ms: added once per handle, >= 0.

    Raises:
        ValueError: a bad ``gbps`` or ``latency_ms`` (nothing opened).
    """

    def __init__(
        self,
        spec: KVSpec,
        host_buffer: np.ndarray,
        layout: HostLayout | str,
        root: str | os.PathLike,
        *,
        gbps: float,
        latency_ms: float = 0.0,
        **options: Any,
    ) -> None:
        for name, v, low_ok in (("gbps", gbps, False), ("latency_ms", latency_ms, True)):
            if not is_real(v) or not math.isfinite(v) or v < 0 or (v == 0 and not low_ok):
                raise ValueError(
                    f"{name}={v!r} must be a finite number {'>= 0' if low_ok else '> 0'}"
                )
        super().__init__(spec, host_buffer, layout, root, **options)
        self.bytes_per_s, self.latency_s = float(gbps) * 1e9, float(latency_ms) / 1e3
        self.url = f"throttle+{self.url}?gbps={float(gbps):g}&latency_ms={float(latency_ms):g}"

    def _run(self, handle: StorageHandle) -> None:
        if self.latency_s and not handle._cancelled:
            time.sleep(self.latency_s)
        super()._run(handle)

    def _paced(self, fn: Any, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        ok = fn(keys, ids)
        wait = len(keys) * self.spec.page_bytes / self.bytes_per_s - (time.perf_counter() - t0)
        if wait > 0:
            time.sleep(wait)
        return ok

    def _get(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        return self._paced(super()._get, keys, ids)

    def _put(self, keys: tuple[str, ...], ids: np.ndarray) -> np.ndarray:
        return self._paced(super()._put, keys, ids)
