"""L3Tier: the storage tier of a HiCache (prefetch from L3 into host pages, write to L3).

Owned by one :class:`~hicache_jax.cache.hicache.HiCache` and driven from its thread only. It reaches
the cache only through a narrow port (:class:`CachePort`: match, lock / unlock, reserve and
release host pages, attach fetched pages, read host pages asynchronously, the clock), never its
internals; the cache keeps the host-page rule (every host page is free, held by one node, in
flight, or reserved by an L3 prefetch) on its side of the port. Without storage (or with
``optional=1`` and the store down) the cache holds a :class:`NullL3Tier`, which does nothing.

* **write** (L2 -> L3): ``storage_write_policy="write_through"`` backs up newly inserted leaves
  too (L1 -> L2 write-through alone waits for a reuse) and puts a node's pages once its
  device -> host backup is dispatched (the put's read is ordered after the copy);
  ``write_through_selective`` puts backed-up pages without
  the extra backups; ``write_back`` puts host-only pages when L2 evicts them. Pages are first
  copied from the host pool (a donated ``jax.Array``) into a numpy *staging* pool:
  ``HostPagePool.read_async`` dispatches the copy (the cache's thread does not wait for it; XLA
  orders it before any reuse of those host pages) and ``poll`` stages the pages and hands them to
  the backend once it is done; the backend's workers read only the staging pool. Its rows are
  whole L3 entries (``entry_rows``: a header slot before each page), so the backend sends and
  receives each page in place and checks it there, with no copy of its own. A put that finds no
  free staging page is skipped (counted).
* **prefetch** (L3 -> L2) and the **policies** at ``match_prefix``: :mod:`hicache_jax.l3.prefetch`.
* **keys**: :mod:`hicache_jax.l3.keys`.
* **window groups** (a spec with ``KVSpec.window_groups``): each group's page attached to a
  host page put is put with it, as an entry of its own in a store lane of the group
  (:mod:`hicache_jax.l3.windows`: keys, lanes, and a prefetch's reads of them); a page with
  none attached (trimmed: no continuation reads it) puts nothing for that group.

URL options handled here (stripped before the backend sees the URL): ``optional=1`` runs without
L3 when the store is unreachable at start (logged; ``stats()["l3_available"] == 0``) instead of
raising ``StorageUnavailableError``; ``staging_pages=N`` sizes the staging pool (default
``max(128, host_pages // 2)``; it bounds the L3 pages in flight).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time
import urllib.parse
from typing import Any

import numpy as np

from hicache_jax.l3.keys import DigestRecords, KeyNames
from hicache_jax.l3.port import CachePort
from hicache_jax.l3.prefetch import Prefetcher, PrefetchHandle, leading
from hicache_jax.l3.storage import (
    ENTRY_ROWS,
    StorageError,
    StorageUnavailableError,
    entry_pages,
    entry_rows,
    namespace_prefix,
    open_storage,
    parse_bool,
)
from hicache_jax.l3.windows import WindowLane, open_lanes
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.spec import HiCacheConfig, KVSpec, PrefetchPolicy, WritePolicy
from hicache_jax.tree.hashing import chain_digests
from hicache_jax.tree.node import TreeNode

__all__ = ["L3Tier", "NullL3Tier", "open_l3", "split_url"]

log = logging.getLogger(__name__)

_PUT_WAIT_S = 1.0  # longest a put waits (wall time) for staging pages held by earlier puts
_STAT_NAMES = (
    "l3_lookup_pages",
    "l3_prefetches",
    "l3_prefetch_pages",
    "l3_prefetch_hit_pages",
    "l3_prefetch_missed_pages",
    "l3_prefetch_duplicate_pages",
    "l3_prefetch_backfill_pages",
    "l3_prefetch_dropped_pages",
    "l3_prefetch_skipped_pages",
    "l3_prefetch_declined_pages",
    "l3_lookups_declined",
    "l3_prefetch_timeouts",
    "l3_prefetches_complete",
    "l3_prefetches_partial",
    "l3_prefetches_revoked",
    "l3_put_pages",
    "l3_put_pages_stored",
    "l3_puts_dropped",
    "l3_puts_skipped",
    "l3_unkeyable_pages",
    "l3_deleted_pages",
    "l3_delete_unsupported_pages",
    "l3_invalidate_unreached",
)
# reported by a tier with window groups only (a plain spec's figures stay what they were)
_WINDOW_STAT_NAMES = (
    "l3_window_put_pages",
    "l3_window_put_pages_stored",
    "l3_window_puts_dropped",
    "l3_window_puts_skipped",
    "l3_window_prefetch_pages",
    "l3_window_prefetch_hit_pages",
    "l3_window_prefetch_missed_pages",
    "l3_window_prefetch_skipped_pages",
    "l3_window_unservable_pages",
)


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Remove this module's options (``optional``, ``staging_pages``) from a storage URL.

    Returns:
        The URL for ``open_storage`` and ``{"optional": bool, "staging_pages": int | None}``.
    """
    parts = urllib.parse.urlsplit(url)
    keep: list[tuple[str, str]] = []
    opts: dict[str, Any] = {"optional": False, "staging_pages": None}
    for name, value in urllib.parse.parse_qsl(parts.query, keep_blank_values=True):
        try:
            if name == "optional":
                opts["optional"] = parse_bool(value)
            elif name == "staging_pages":
                opts["staging_pages"] = int(value)
                if opts["staging_pages"] < 1:
                    raise ValueError(value)
            else:
                keep.append((name, value))
        except ValueError:
            raise ValueError(f"storage url={url!r}: bad value {value!r} for {name}") from None
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(keep))), opts


class NullL3Tier:
    """The L3 tier of a cache without storage (or whose optional store is down): every hook
    does nothing, ``prefetch`` finds nothing.

    Args:
        back_up_new: ``storage_write_policy="write_through"`` (kept with the store down:
            the cache backs up new leaves as it would with L3).
        stats: what :meth:`stats` reports (nothing without storage; zeros and
            ``l3_available=0`` with the store down).
    """

    available = False

    def __init__(self, back_up_new: bool = False, stats: dict[str, Any] | None = None) -> None:
        self.back_up_new, self._stats, self.backend = back_up_new, stats or {}, None

    def on_backup(self, nodes: list[TreeNode]) -> None:
        pass

    def on_host_evict(self, node: TreeNode, host_ids: np.ndarray) -> None:
        pass

    def prefetch(self, tokens: np.ndarray, extra_key: Any) -> None:
        return None

    def before_match(self, tokens: np.ndarray, extra_key: Any) -> None:
        pass

    def poll(self, attach: bool = True) -> None:
        pass

    def held_beyond(self, tokens: np.ndarray, extra_key: Any, covered: int) -> int:
        return 0

    def delete(
        self, nodes: list[TreeNode], tokens: np.ndarray | None, extra_key: Any
    ) -> tuple[int, int]:
        return 0, 0

    def flush(self) -> None:
        pass

    def reset_counters(self) -> None:
        pass

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return dict(self._stats)


def open_l3(port: CachePort, spec: KVSpec, cfg: HiCacheConfig) -> L3Tier | NullL3Tier:
    """The L3 tier of a cache: :class:`NullL3Tier` without ``cfg.storage``, else the store's.

    Raises:
        ValueError: ``host_pages == 0`` or a malformed URL / option (before anything opens).
        StorageUnavailableError: the store is unreachable (message names the address), unless
            the URL says ``optional=1`` (then a :class:`NullL3Tier`, logged).
    """
    if cfg.storage is None:
        return NullL3Tier()
    host_pages = cfg.host_pages
    assert host_pages is not None  # resolved by HiCacheConfig.__post_init__
    if host_pages == 0:
        raise ValueError("storage needs a host pool (host_pages > 0): L3 pages move via L2")
    url, opts = split_url(cfg.storage)
    n_staging = opts["staging_pages"] or max(128, host_pages // 2)
    rows = entry_rows(spec, n_staging)  # entry rows (header slot + page), moved in place
    back_up_new = cfg.storage_write_policy is WritePolicy.WRITE_THROUGH
    windows = getattr(port, "window_host", None)
    try:
        backend = open_storage(url, spec, rows, ENTRY_ROWS)
        try:  # window groups: the store once more per group, on the group's pages
            lanes = (
                [] if windows is None else open_lanes(url, windows.groups, windows.specs, n_staging)
            )
        except BaseException:
            backend.close()
            raise
    except StorageUnavailableError as e:
        if not opts["optional"]:
            raise
        log.warning("running without L3 storage: %s", e)
        down = dict.fromkeys(_STAT_NAMES, 0) | {
            "l3_available": 0,
            "l3_staging_free_pages": n_staging,
            "l3_in_flight": 0,
        }
        return NullL3Tier(back_up_new, down)
    return L3Tier(port, spec, cfg, url, backend, rows, lanes)


class L3Tier:
    """The L3 side of a HiCache (see the module docstring). Built by :func:`open_l3`.

    Args:
        port: the cache, through its port (always called on the cache's thread).
        spec: what the entries hold: the cache's spec, or of a cache over several processes
            this process's heads (``KVSpec.shard``: the keys carry the shard).
        cfg: the cache's.
        url: the storage URL without this module's options; ``backend``: the store opened on
            ``rows``, the staging pool's entry rows.
        lanes: the window groups' lanes (``l3/windows.py``; none for a plain spec).
    """

    available = True

    def __init__(
        self,
        port: CachePort,
        spec: KVSpec,
        cfg: HiCacheConfig,
        url: str,
        backend: Any,
        rows: np.ndarray,
        lanes: list[WindowLane] | None = None,
    ) -> None:
        self._port, self.url, self.backend = port, url, backend
        self._lanes = list(lanes or ())
        self._window_host = getattr(port, "window_host", None) if self._lanes else None
        self._spec = spec  # this process's heads: its fingerprint keys the entries
        self._names = KeyNames(spec)  # key strings, each namespace in its generation
        self._group = port.group  # several processes: every store result is agreed (MIN)
        self.write_back = cfg.storage_write_policy is WritePolicy.WRITE_BACK
        # write_through to L3 also backs up newly computed leaves at insert (not only on reuse,
        # as L1 -> L2 write-through does): a leaf evicted from L1 before its reuse would
        # otherwise be deleted unseen by L3, which is exactly what L3 is there to keep.
        self.back_up_new = cfg.storage_write_policy is WritePolicy.WRITE_THROUGH
        assert cfg.host_pages is not None  # resolved by HiCacheConfig.__post_init__
        self._records = DigestRecords(
            cfg.host_pages, spec.page_size, spec.fingerprint(), port.path_tokens
        )
        self._staging = entry_pages(spec, rows)  # [P, L, kvf, ps, H, D] bits
        self._staging_alloc = PageAllocator(rows.shape[0], "l3 staging")
        self._n: collections.Counter[str] = collections.Counter()
        # puts in two stages, each in order: pages being copied out of the host pool
        # (keys, staging ids, HostRead), then handed to the backend (StorageHandle, staging ids)
        self._reads: collections.deque = collections.deque()
        self._puts: collections.deque = collections.deque()
        # write_through modes keep host copies a continuous prefix: fetches start at the
        # deepest backed-up node and give device nodes on the way their host copy
        continuous = cfg.write_policy in (
            WritePolicy.WRITE_THROUGH,
            WritePolicy.WRITE_THROUGH_SELECTIVE,
        )
        self._prefetch = Prefetcher(
            port,
            spec.page_size,
            continuous,
            PrefetchPolicy(cfg.prefetch_policy),
            cfg.prefetch_timeout_s,
            backend,
            self._staging,
            self._staging_alloc,
            self._records,
            self._n,
            port.group,
            self._names,
            self._lanes,
        )
        self._closed = False

    # -- writes -------------------------------------------------------------------------------

    def on_backup(self, nodes: list[TreeNode]) -> None:
        """Backups of ``nodes`` dispatched (host_value set; XLA orders the puts' reads of those
        host pages after the copy): record their digests; put them (write-through policies)."""
        for node in reversed(nodes):  # the cache passes a chain leaf first: parents first
            digests = self._records.node_digests(node)
            if digests is None:
                if not self.write_back:
                    self._n["l3_unkeyable_pages"] += node.num_pages
                continue
            host_ids = node.host_value
            assert host_ids is not None, "a node backed up has its host copy"
            self._records.record(host_ids, digests, node.page_hashes)
            if not self.write_back:
                self._put(digests, node.extra_key, host_ids, self._port.events.l3_candidate(node))

    def on_host_evict(self, node: TreeNode, host_ids: np.ndarray) -> None:
        """``node`` (already unlinked from the tree) is deleted and its host pages are about to
        be freed: put them first (write_back policy), keyed by their recorded digests."""
        ok, digests = self._records.take(host_ids, node.page_hashes)
        if not self.write_back:
            return
        if not ok.all():  # no record (unkeyable extra_key): never guess a key
            self._n["l3_unkeyable_pages"] += int((~ok).sum())
        if ok.any():
            self._put(
                digests,
                node.extra_key,
                host_ids[ok],
                self._port.events.l3_candidate(node, np.flatnonzero(ok)),
            )

    def _put(
        self, digests: np.ndarray, extra_key: Any, host_ids: np.ndarray, announce: Any
    ) -> None:
        """Put pages; ``announce``: what the events say once they are stored (None: nothing)."""
        keys = self._names.keys(extra_key, digests)
        # A node longer than the staging pool goes in parts (keys are per page: independent).
        step = self._staging_alloc.num_pages
        for lo in range(0, len(keys), step):
            part = None if announce is None else announce.part(lo, lo + step)
            self._put_part(keys[lo : lo + step], host_ids[lo : lo + step], part)

    def _put_part(self, keys: list[str], host_ids: np.ndarray, announce: Any) -> None:
        n = len(keys)
        if n > self._staging_alloc.num_free:
            self._drain_puts(n)
        if n > self._staging_alloc.num_free:
            self._n["l3_puts_skipped"] += n  # staging still full: L3 is too slow; drop
            return
        sids = self._staging_alloc.alloc(n)
        # dispatched, not waited for: the cache's thread does not stall on the copy (nor on the
        # transfers before it); poll() stages the pages once they are out. The host pages may be
        # freed at once (write_back evicts them next): XLA orders their reuse after this read.
        self._reads.append((keys, sids, self._port.read_host_async(host_ids), announce, None))
        self._n["l3_put_pages"] += n
        for lane in self._lanes:
            self._put_window(lane, keys, host_ids)

    def _put_window(self, lane: WindowLane, keys: list[str], host_ids: np.ndarray) -> None:
        """Put window group ``lane.g``'s pages attached to ``host_ids`` (those with one), under
        the group's keys of ``keys``; staging rows short even after waiting: skipped."""
        assert self._window_host is not None
        w = self._window_host.pages(lane.g, host_ids)
        sel = np.flatnonzero(w >= 0)
        n = int(sel.size)
        if not n:
            return
        if n > lane.alloc.num_free:
            self._drain_puts(n, lane)
        if n > lane.alloc.num_free:
            self._n["l3_window_puts_skipped"] += n
            return
        sids = lane.alloc.alloc(n)
        read = self._window_host.read_async(lane.g, w[sel])
        self._reads.append((lane.keys([keys[i] for i in sel]), sids, read, None, lane))
        self._n["l3_window_put_pages"] += n

    def _leading_done(self, tag: str, queue: collections.deque, at: int, block: bool) -> int:
        """How many of ``queue``'s oldest entries (their handle at index ``at``) are done on
        every process (all of them: ``block``)."""
        if block or not queue:
            return len(queue)
        n = 0
        while n < len(queue) and queue[n][at].done():
            n += 1
        return int(self._group.agree_min(tag, [n])[0])

    def _submit_reads(self, block: bool) -> None:
        """Hand the host reads that are done (all of them with ``block``) to the backend, in
        order: staging pages filled, then one put each."""
        for _ in range(self._leading_done("l3 reads", self._reads, 2, block)):
            keys, sids, read, announce, lane = self._reads.popleft()
            read.copy_into(self._staging if lane is None else lane.staging, sids)
            backend = self.backend if lane is None else lane.backend
            self._puts.append((backend.put_from(keys, sids), sids, announce, lane))

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, tokens: np.ndarray, extra_key: Any) -> PrefetchHandle | None:
        """Start fetching the pages of ``tokens`` (whole pages, validated) beyond L1 + L2
        (:meth:`Prefetcher.prefetch`); None when nothing is fetched."""
        return self._prefetch.prefetch(tokens, extra_key)

    def before_match(self, tokens: np.ndarray, extra_key: Any) -> None:
        """Apply the prefetch policy to prefetches on the path of ``tokens``."""
        self._prefetch.before_match(tokens, extra_key)
        self.poll()

    def poll(self, attach: bool = True) -> None:
        """Finish completed puts and prefetches (cache thread; cheap when nothing is done).

        Args:
            attach: also hang landed prefetch pages in the tree. False inside an operation of
                the cache (eviction, load_back, allocation): attaching matches, and so may split,
                nodes that operation holds; the pages wait for the next public call.
        """
        self._submit_reads(block=False)
        for _ in range(self._leading_done("l3 puts", self._puts, 0, block=False)):
            self._finish_put(*self._puts.popleft())
        if self._prefetch.gets and attach:
            self._prefetch.poll()

    def flush(self) -> None:
        """Wait for every put and prefetch in flight and apply them."""
        self._submit_reads(block=True)
        while self._puts:
            handle, sids, announce, lane = self._puts.popleft()
            with contextlib.suppress(StorageError):
                handle.wait()
            self._finish_put(handle, sids, announce, lane)
        self._prefetch.flush()

    def _drain_puts(self, n: int, lane: WindowLane | None = None) -> None:
        """Backpressure: wait (oldest first, ``_PUT_WAIT_S`` in all) for puts in flight until
        ``n`` staging pages are free (of ``lane``'s staging rows: a window group's). Touches no
        tree state (safe inside an eviction loop)."""
        deadline = time.monotonic() + _PUT_WAIT_S
        alloc = self._staging_alloc if lane is None else lane.alloc
        self._submit_reads(block=True)  # their staging pages are freed only after their puts
        while self._puts and n > alloc.num_free:
            handle, sids, announce, of = self._puts[0]
            try:
                handle.wait(max(0.0, deadline - time.monotonic()))
                finished = True
            except TimeoutError:
                finished = False
            except StorageError:
                finished = True
            if not self._group.agree_min("l3 drain", [finished])[0]:
                return  # on some process the store is too slow: every one stops here
            self._puts.popleft()
            self._finish_put(handle, sids, announce, of)

    def _finish_put(
        self, handle: Any, sids: np.ndarray, announce: Any, lane: WindowLane | None = None
    ) -> None:
        try:
            ok = handle.wait(0)
        except StorageError:
            ok = np.zeros(len(handle.keys), bool)
        if self._group.num_processes > 1:  # stored: by every process
            ok = self._group.agree_min("l3 stored", np.asarray(ok, np.int64)).astype(bool)
        stored = int(ok.sum())
        if lane is not None:  # a window group's entries: counted apart, announced never
            self._n["l3_window_put_pages_stored"] += stored
            self._n["l3_window_puts_dropped"] += ok.size - stored
            lane.alloc.free(sids)
            return
        self._n["l3_put_pages_stored"] += stored
        self._n["l3_puts_dropped"] += ok.size - stored
        self._staging_alloc.free(sids)
        if stored:
            self._port.events.l3_stored(announce, ok)

    # -- control API (ARCHITECTURE.md, "Control API") ------------------------------------------

    def adopt(self, nodes: list[TreeNode]) -> None:
        """Record the digests of host copies cached before this tier was attached (``nodes``
        parents first), so write-back puts them at host eviction; nothing is put now."""
        for node in nodes:
            digests = self._records.node_digests(node)
            if digests is not None:
                assert node.host_value is not None, "nodes with host copies are adopted"
                self._records.record(node.host_value, digests, node.page_hashes)

    def held_beyond(self, tokens: np.ndarray, extra_key: Any, covered: int) -> int:
        """Tokens of validated whole-page ``tokens`` after its first ``covered`` that the store
        holds, continuing them: one batched ``exists``, nothing counted, fetched or stamped."""
        ps, seed = self._port.spec.page_size, self._records.seed(extra_key)
        if seed is None or covered >= tokens.size:
            return 0
        digests = chain_digests(seed, tokens.reshape(-1, ps))[covered // ps :]
        found = leading(self.backend.exists(self._names.keys(extra_key, digests)))
        return int(self._group.agree_min("l3 exists", [found])[0]) * ps

    def delete(
        self, nodes: list[TreeNode], tokens: np.ndarray | None, extra_key: Any
    ) -> tuple[int, int]:
        """Delete from the store what ``HiCache.invalidate`` names: the namespace ``extra_key``
        (``tokens=None``: every entry of it, with ``delete_prefix``), or the entries of
        ``nodes``' pages (still in the tree) and of ``tokens``' last page (with ``delete``).
        Puts in flight finish first (a put landing after the delete would bring an entry back).

        Where the backend cannot remove all of it (a namespace without ``delete_prefix``: the
        entries only the store holds; anything without ``delete``), the namespace moves to its
        next key generation (:class:`~hicache_jax.l3.keys.KeyNames`): this tier never reads
        the rest again, counted in ``l3_invalidate_unreached``. What was announced on L3 there
        (the whole namespace when unreached) is announced removed.

        With window groups their entries go with the pages' (``delete_prefix`` removes them
        with the namespace, ``delete`` is asked for them on each group's lane), counted among
        the entries deleted.

        Returns:
            ``(entries deleted, 1 if unreached else 0)``.
        """
        self._submit_reads(block=True)
        self._drain_puts(self._staging_alloc.num_pages)
        for lane in self._lanes:
            self._drain_puts(lane.alloc.num_pages, lane)
        if self._records.seed(extra_key) is None:
            return 0, 0  # an unkeyable namespace: never put to the store
        by_prefix = getattr(self.backend, "delete_prefix", None)
        remove = getattr(self.backend, "delete", None)
        if tokens is None and callable(by_prefix):
            gone, reached = int(by_prefix(namespace_prefix(self._spec, extra_key))), True
        elif callable(remove):
            keys = self._keys_of(nodes, tokens, extra_key)
            gone = int(np.asarray(remove(keys), dtype=bool).sum()) if keys else 0
            reached = tokens is not None  # a namespace's store-only entries have no known key
            for lane in self._lanes:  # the window groups' entries of those pages
                lane_remove = getattr(lane.backend, "delete", None)
                if keys and callable(lane_remove):
                    gone += int(np.asarray(lane_remove(lane.keys(keys)), dtype=bool).sum())
        else:
            self._n["l3_delete_unsupported_pages"] += len(self._keys_of(nodes, tokens, extra_key))
            gone, reached = 0, False
        self._n["l3_deleted_pages"] += gone
        if not reached:
            self._names.advance(extra_key)
            self._n["l3_invalidate_unreached"] += 1
        # announced removed: the prefix, or the whole namespace (unreached: never read again)
        ps = self._port.spec.page_size
        pages = None if tokens is None or not reached else tokens.reshape(-1, ps)
        self._port.events.l3_invalidated(pages, extra_key)
        return gone, int(not reached)

    def _keys_of(
        self, nodes: list[TreeNode], tokens: np.ndarray | None, extra_key: Any
    ) -> list[str]:
        """The keys (this generation) of ``nodes``' pages and of ``tokens``' last page."""
        keys: dict[str, None] = {}
        for node in nodes:
            digests = self._records.node_digests(node)
            if digests is not None:
                keys.update(dict.fromkeys(self._names.keys(node.extra_key, digests)))
        seed = self._records.seed(extra_key)
        if tokens is not None and seed is not None:
            last = chain_digests(seed, tokens.reshape(-1, self._port.spec.page_size))[-1:]
            keys.update(dict.fromkeys(self._names.keys(extra_key, last)))
        return list(keys)

    # -- misc ---------------------------------------------------------------------------------

    def reset_counters(self) -> None:
        """Zero this tier's counters and forget its digest records (``HiCache.reset``: the tree
        is empty); the store's own counters (``l3_store_*``) stay."""
        self._n.clear()
        self._records.clear()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {name: self._n[name] for name in _STAT_NAMES}
        out["l3_available"] = int(not self._closed)
        out["l3_staging_free_pages"] = self._staging_alloc.num_free
        out["l3_in_flight"] = len(self._reads) + len(self._puts) + len(self._prefetch.gets)
        if self._lanes:
            out.update({name: self._n[name] for name in _WINDOW_STAT_NAMES})
        if not self._closed:
            out.update({f"l3_store_{k}": v for k, v in self.backend.stats().items()})
        return out

    def close(self) -> None:
        """Flush, then close the backend (idempotent)."""
        if not self._closed:
            self.flush()
            self.backend.close()
            for lane in self._lanes:
                lane.close()
            self._closed = True
