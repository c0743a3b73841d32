"""L3Tier: the storage tier of a HiCache (prefetch from L3 into host pages, write to L3).

Owned by one :class:`~hicache_jax.hicache.HiCache` and driven from its thread only:

* **write** (L2 -> L3): ``storage_write_policy="write_through"`` backs up newly inserted leaves
  too (L1 -> L2 write-through alone waits for a reuse) and puts a node's pages once its
  device -> host backup has landed; ``write_through_selective`` puts backed-up pages without
  the extra backups; ``write_back`` puts host-only pages when L2 evicts them. Pages are first
  copied from the host pool (a donated ``jax.Array``) into a numpy *staging* pool:
  ``HostPagePool.read_async`` dispatches the copy (the cache's thread does not wait for it; XLA
  orders it before any reuse of those host pages) and ``poll`` stages the pages and hands them to
  the backend once it is done; the backend's workers read only the staging pool. Its rows are
  whole L3 entries (``entry_rows``: a header slot before each page), so the backend sends and
  receives each page in place and checks it there, with no copy of its own. A put that finds no
  free staging page is skipped (counted).
* **prefetch** (L3 -> L2): for a prompt that L1 + L2 do not hold whole, the pages from the
  *fetch base* up to the first page L3 does not hold are read into staging pages; host pages are
  reserved at once (host eviction first, never pages being loaded: reserved pages are in no tree
  node). The fetch base is the deepest node of the prompt's path with a host copy (the root if
  none) in the write_through modes, as in SGLang, so that fetched pages attach below a backed-up
  node and the host copies stay a continuous prefix from the root (DESIGN.md); in write_back,
  where that prefix is not required, it is the end of what L1 + L2 hold (nothing held is fetched
  again). The base is locked meanwhile (L2 eviction cannot remove it). Pages that land are copied
  into their host pages and attached root-first: a position the tree holds with a host copy keeps
  it (the fetched page is freed, counted as a duplicate); a position on device without one takes
  the fetched page as its host copy (write_through modes; the node is split at the page boundary
  by the tree's match if needed; counted as ``l3_prefetch_backfill_pages``); positions the tree
  lacks become one host-only leaf (``l3_prefetch_hit_pages``). A page that misses or fails its
  check ends the usable run: the rest is recomputed by the caller.
* **sharing prefetches in flight**: a prompt whose pages from the same fetch base are all covered
  by an in-flight prefetch of the same path gets that handle -- covered means its prompt ends
  within that prefetch's pages, or that prefetch stopped at a page L3 did not hold when it was
  issued and this prompt has that same page next. A prompt that goes further (the other
  prefetch ended with its own prompt, or ran short of staging / host pages) gets a new prefetch
  of the *rest*, chained after the one in flight: it starts at that one's last page (nothing is
  fetched twice) and attaches only once that one is closed (until then its pages wait in
  staging). If no new prefetch can start (L3 has nothing more, no staging pages), the prompt
  gets the one in flight.
* **policies** at ``match_prefix``: ``best_effort`` attaches what has landed so far,
  ``wait_complete`` waits for the prefetches on the request's path, ``timeout`` waits up to
  ``issued + prefetch_timeout_s * (1 + tokens / 1024)`` then keeps what landed and cancels the rest.

Keys: 128-bit chained digests of the pages' tokens (:mod:`hicache_jax.hashing`, namespaced by
``extra_key`` and the spec fingerprint, as :func:`hicache_jax.storage.page_keys`), so instances
sharing a store share entries and a collision between prefixes is a 128-bit one. Each host page
the tree holds has the digest of its prefix recorded here when it gets there (backup landed,
prefetch attached), so a put or a prefetch hashes only its own pages, starting from the digest
of the page before (a record is used only if the tree's 64-bit hash of that page is the one it
was recorded for); without a record the chain is hashed from the root. Write_back puts (at host
eviction, after the tree unlinked the node) take their keys from these records.

URL options handled here (stripped before the backend sees the URL): ``optional=1`` runs without
L3 when the store is unreachable at start (logged; ``stats()["l3_available"] == 0``) instead of
raising ``StorageUnavailableError``; ``staging_pages=N`` sizes the staging pool (default
``max(128, host_pages // 2)``; it bounds the L3 pages in flight).
"""

from __future__ import annotations

import collections
import logging
import time
import urllib.parse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from hicache_jax.allocator import PageAllocator
from hicache_jax.errors import OutOfPagesError
from hicache_jax.events import Medium
from hicache_jax.hashing import DIGEST_BYTES, chain_digests, namespace_seed
from hicache_jax.tree_node import TreeNode
from hicache_jax.spec import PrefetchPolicy, WritePolicy
from hicache_jax.storage import (
    ENTRY_ROWS, StorageError, StorageUnavailableError, entry_pages, entry_rows, key_strings,
    open_storage, parse_bool)

if TYPE_CHECKING:
    from hicache_jax.hicache import HiCache

log = logging.getLogger(__name__)

_TIMEOUT_TOKENS = 1024  # the timeout policy's deadline grows by prefetch_timeout_s per this many
_PUT_WAIT_S = 1.0        # longest a put waits for staging pages held by earlier puts


def split_url(url: str) -> tuple[str, dict[str, Any]]:
    """Remove this module's options (``optional``, ``staging_pages``) from a storage URL.

    Returns:
        The URL for ``open_storage`` and ``{"optional": bool, "staging_pages": int | None}``.
    """
    parts = urllib.parse.urlsplit(url)
    keep, opts = [], {"optional": False, "staging_pages": None}
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


def _leading(mask: np.ndarray) -> int:
    """Length of the leading run of True."""
    return int(mask.size if mask.all() else np.argmin(mask))


@dataclass(eq=False)
class PrefetchHandle:
    """A prefetch in flight (returned by ``HiCache.prefetch``).

    Attributes:
        pages_found: pages L3 held (leading run) when the prefetch started, and being fetched.
        start: the prompt position its pages start at: the fetch base (see the module
            docstring), or the end of the prefetch in flight it is chained after.
        tokens: int64 tokens of the prompt up to the end of the fetched pages.
    """

    pages_found: int
    start: int
    tokens: np.ndarray
    extra_key: Any
    _get: Any
    _node: TreeNode            # the fetch base (locked until closed)
    _host_ids: np.ndarray
    _staging_ids: np.ndarray
    _digests: np.ndarray       # uint8 [pages_found, 16]: chain digests of the fetched pages
    _deadline: float
    _after: "PrefetchHandle | None" = None   # fetches the pages right after this one's
    _next_page: np.ndarray | None = None     # the prompt's page after ``tokens``, which L3 did
    #                                          not hold at issue (None: not known to be missing)
    _applied: int = 0          # pages attached to the tree (or given up) so far
    _closed: bool = False      # finished and its pages accounted for
    _timed_out: bool = False   # the timeout policy gave up waiting (its rest was cancelled)

    def done(self) -> bool:
        """Whether the storage read has finished (pages are attached at the cache's next call;
        a chained prefetch's once the one before it is closed)."""
        return self._get.done()

    def wait(self, timeout: float | None = None) -> int:
        """Block until the read finishes (``TimeoutError`` after ``timeout`` s); returns the
        pages that arrived intact (leading run)."""
        try:
            ok = self._get.wait(timeout)
        except StorageError:
            return 0
        return _leading(ok)


class L3Tier:
    """The L3 side of a HiCache (see the module docstring). Built by ``HiCache.__init__``.

    Args:
        cache: the owning cache; this class uses its tree, host pool, event log and host-page
            allocation path (``_take_pages``), always on the cache's thread.

    Raises:
        ValueError: ``host_pages == 0`` or a malformed URL / option (before anything opens).
        StorageUnavailableError: the store is unreachable (message names the address), unless
            the URL says ``optional=1``.
    """

    def __init__(self, cache: "HiCache") -> None:
        cfg, spec = cache.cfg, cache.spec
        if cfg.host_pages == 0:
            raise ValueError("storage needs a host pool (host_pages > 0): L3 pages move via L2")
        url, opts = split_url(cfg.storage)
        self._cache = cache
        self.url = url
        self.policy = PrefetchPolicy(cfg.prefetch_policy)
        self.write_back = cfg.storage_write_policy is WritePolicy.WRITE_BACK
        # write_through to L3 also backs up newly computed leaves at insert (not only on reuse,
        # as L1 -> L2 write-through does): a leaf evicted from L1 before its reuse would
        # otherwise be deleted unseen by L3, which is exactly what L3 is there to keep.
        self.back_up_new = cfg.storage_write_policy is WritePolicy.WRITE_THROUGH
        # write_through modes keep host copies a continuous prefix: fetches start at the
        # deepest backed-up node and give device nodes on the way their host copy
        self._continuous = cfg.write_policy in (WritePolicy.WRITE_THROUGH,
                                                WritePolicy.WRITE_THROUGH_SELECTIVE)
        self._fingerprint = spec.fingerprint()
        # per host page: the chain digest of the prefix ending with it, the tree's 64-bit hash
        # of that page when it was recorded, and whether the record is live
        self._digest = np.zeros((cfg.host_pages, DIGEST_BYTES), np.uint8)
        self._digest_of = np.zeros(cfg.host_pages, np.uint64)
        self._digest_ok = np.zeros(cfg.host_pages, np.bool_)
        n_staging = opts["staging_pages"] or max(128, cfg.host_pages // 2)
        # entry rows (header slot + page): the backend moves and checks each page in place
        self._staging_rows = entry_rows(spec, n_staging)
        self._staging = entry_pages(spec, self._staging_rows)  # [P, L, kvf, ps, H, D] bits
        self._staging_alloc = PageAllocator(n_staging, "l3 staging")
        self._n: collections.Counter[str] = collections.Counter()
        # puts in two stages, each in order: pages being copied out of the host pool
        # (keys, staging ids, HostRead), then handed to the backend (StorageHandle, staging ids)
        self._reads: collections.deque = collections.deque()
        self._puts: collections.deque = collections.deque()
        self._gets: list[PrefetchHandle] = []
        try:
            self.backend = open_storage(url, spec, self._staging_rows, ENTRY_ROWS)
        except StorageUnavailableError as e:
            if not opts["optional"]:
                raise
            log.warning("running without L3 storage: %s", e)
            self.backend = None

    @property
    def available(self) -> bool:
        return self.backend is not None

    # -- keys ---------------------------------------------------------------------------------

    def _seed(self, extra_key: Any) -> bytes | None:
        try:
            return namespace_seed(self._fingerprint, extra_key)
        except TypeError:  # an extra_key without a process-stable encoding: not shareable
            return None

    def _record(self, host_ids: np.ndarray, digests: np.ndarray, hashes: np.ndarray) -> None:
        self._digest[host_ids] = digests
        self._digest_of[host_ids] = hashes
        self._digest_ok[host_ids] = True

    def _prefix_digest(self, node: TreeNode, extra_key: Any,
                       tokens: np.ndarray | None = None) -> bytes | None:
        """Chain digest of the prefix ending with ``node`` (the namespace seed at the root).

        Args:
            tokens: that prefix's tokens when the caller has them (else read from the tree).

        Returns:
            16 bytes, or None for an unkeyable ``extra_key``.
        """
        tree = self._cache._tree
        if node is tree.root:
            return self._seed(extra_key)
        if node.host_value is not None:
            last = int(node.host_value[-1])
            if self._digest_ok[last] and self._digest_of[last] == node.page_hashes[-1]:
                return self._digest[last].tobytes()
        seed = self._seed(extra_key)
        if seed is None:
            return None
        if tokens is None:
            tokens = tree.path_tokens(node)
        return chain_digests(seed, tokens.reshape(-1, self._cache.spec.page_size))[-1].tobytes()

    def _node_digests(self, node: TreeNode) -> np.ndarray | None:
        """uint8 ``[node.num_pages, 16]`` chain digests of a node in the tree (None: unkeyable)."""
        prev = self._prefix_digest(node.parent, node.extra_key)
        if prev is None:
            return None
        return chain_digests(prev, node.key.reshape(-1, self._cache.spec.page_size))

    # -- writes -------------------------------------------------------------------------------

    def on_backup(self, nodes: list[TreeNode]) -> None:
        """Backups of ``nodes`` landed (host_value set): record their digests; put them
        (write-through policies)."""
        if self.backend is None:
            return
        for node in reversed(nodes):  # the cache passes a chain leaf first: parents first
            digests = self._node_digests(node)
            if digests is None:
                if not self.write_back:
                    self._n["l3_unkeyable_pages"] += node.num_pages
                continue
            self._record(node.host_value, digests, node.page_hashes)
            if not self.write_back:
                self._put(digests, node.extra_key, node.host_value)

    def on_host_evict(self, node: TreeNode, host_ids: np.ndarray) -> None:
        """``node`` (already unlinked from the tree) is deleted and its host pages are about to
        be freed: put them first (write_back policy), keyed by their recorded digests."""
        if self.backend is None:
            return
        ok = self._digest_ok[host_ids] & (self._digest_of[host_ids] == node.page_hashes)
        self._digest_ok[host_ids] = False
        if not self.write_back:
            return
        if not ok.all():  # no record (unkeyable extra_key): never guess a key
            self._n["l3_unkeyable_pages"] += int((~ok).sum())
        if ok.any():
            self._put(self._digest[host_ids[ok]], node.extra_key, host_ids[ok])

    def _put(self, digests: np.ndarray, extra_key: Any, host_ids: np.ndarray) -> None:
        keys = key_strings(self._cache.spec, extra_key, digests)
        # A node longer than the staging pool goes in parts (keys are per page: independent).
        step = self._staging_alloc.num_pages
        for lo in range(0, len(keys), step):
            self._put_part(keys[lo:lo + step], host_ids[lo:lo + step])

    def _put_part(self, keys: list[str], host_ids: np.ndarray) -> None:
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
        self._reads.append((keys, sids, self._cache._host.read_async(host_ids)))
        self._n["l3_put_pages"] += n

    def _submit_reads(self, block: bool) -> None:
        """Hand the host reads that are done (all of them with ``block``) to the backend, in
        order: staging pages filled, then one put each."""
        while self._reads and (block or self._reads[0][2].done()):
            keys, sids, read = self._reads.popleft()
            read.copy_into(self._staging, sids)
            self._puts.append((self.backend.put_from(keys, sids), sids))

    # -- prefetch -----------------------------------------------------------------------------

    def prefetch(self, tokens: np.ndarray, extra_key: Any) -> PrefetchHandle | None:
        """Start fetching the pages of ``tokens`` (whole pages, validated) from the fetch base
        (see the module docstring); None when L1 + L2 hold the prompt or nothing is fetched."""
        if self.backend is None:
            return None
        cache, ps = self._cache, self._cache.spec.page_size
        tm = cache._tree.match(tokens, extra_key)
        covered = tm.device_len + tm.host_len
        if covered == tokens.size:
            return None  # L1 + L2 hold it all
        base, start = self._fetch_base(tm)
        shared, pos, after = self._in_flight(tokens, extra_key, start)
        if shared is not None:
            return shared
        prev = (after._digests[-1].tobytes() if after is not None
                else self._prefix_digest(base, extra_key, tokens[:start]))
        if prev is None:
            self._n["l3_unkeyable_pages"] += (tokens.size - pos) // ps
            return None
        digests = chain_digests(prev, tokens[pos:].reshape(-1, ps))
        keys = key_strings(cache.spec, extra_key, digests)
        found = _leading(self.backend.exists(keys))
        self._n["l3_lookup_pages"] += len(keys)
        if pos + found * ps <= covered:
            return after  # L3 has nothing beyond what L1 + L2 hold
        want = min(found, self._staging_alloc.num_free)
        if want == 0:
            self._n["l3_prefetch_skipped_pages"] += found
            return after
        if after is not None:
            base = after._node  # one base per chain
        got = self._start_get(base, keys, want, found)
        if got is None:
            return after
        get, host_ids, sids = got
        k = host_ids.size
        ntok = pos + k * ps
        missing = tokens[ntok:ntok + ps].copy() if k == found and ntok < tokens.size else None
        deadline = time.monotonic() + self._cache.cfg.prefetch_timeout_s * (
            1 + k * ps / _TIMEOUT_TOKENS)
        handle = PrefetchHandle(k, pos, tokens[:ntok].copy(), extra_key, get, base, host_ids,
                                sids, digests[:k].copy(), deadline, _after=after,
                                _next_page=missing)
        self._gets.append(handle)
        self._n["l3_prefetches"] += 1
        self._n["l3_prefetch_pages"] += k
        return handle

    def _fetch_base(self, tm: Any) -> tuple[TreeNode, int]:
        """Where a prompt's fetch starts: ``(node, tokens up to its end)``."""
        if not self._continuous:
            return tm.node, tm.device_len + tm.host_len
        path, node = [], tm.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        base, start = node, 0  # the root
        for node in reversed(path):  # host copies are a prefix of the path (write-through)
            if node.host_value is None:
                break
            base, start = node, start + node.num_tokens
        return base, start

    def _in_flight(self, tokens: np.ndarray, extra_key: Any,
                   start: int) -> tuple[PrefetchHandle | None, int, PrefetchHandle | None]:
        """The prefetch in flight to hand out for ``tokens``, else where a new one starts.

        Returns:
            ``(shared, pos, after)``: ``shared`` covers what L3 can give this prompt (see the
            module docstring); otherwise a new prefetch starts at ``pos``, chained after
            ``after`` (the last prefetch in flight along this prompt from ``start``, or None).
        """
        ps = self._cache.spec.page_size
        pos, after = start, None
        for h in self._gets:  # issue order: a chain's links come in order
            if h._closed or h.extra_key != extra_key or h.start != pos:
                continue
            end = h.tokens.size
            n = min(end, tokens.size)
            if not np.array_equal(h.tokens[:n], tokens[:n]):
                continue
            if tokens.size <= end or (h._next_page is not None
                                      and np.array_equal(h._next_page, tokens[end:end + ps])):
                return h, pos, after
            pos, after = end, h
        return None, pos, after

    def _start_get(self, base: TreeNode, keys: list[str], want: int,
                   found: int) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """Reserve host and staging pages for up to ``want`` of ``keys`` and start the read
        (``base`` locked); None when no page could be had (nothing left behind)."""
        cache = self._cache
        cache._tree.lock(base)  # the attach point survives host eviction, ours included
        host_ids = sids = None
        try:
            try:
                host_ids = cache._evict.take_host(want)
            except OutOfPagesError:
                host_ids = cache._host.allocator.alloc(min(want, cache._host.allocator.num_free))
            # Host eviction (write_back) may have put evicted pages to L3, taking staging pages:
            # those keep them (they are cached data); the prefetch takes what is left.
            k = min(host_ids.size, self._staging_alloc.num_free)
            if k < host_ids.size:
                cache._host.allocator.free(host_ids[k:])
                host_ids = host_ids[:k]
            if k == 0:
                cache._host.allocator.free(host_ids)
                cache._tree.unlock(base)
                self._n["l3_prefetch_skipped_pages"] += found
                return None
            sids = self._staging_alloc.alloc(k)
            return self.backend.get_into(keys[:k], sids), host_ids, sids
        except BaseException:  # leave no lock, host page or staging page behind
            if host_ids is not None:
                cache._host.allocator.free(host_ids)
            if sids is not None:
                self._staging_alloc.free(sids)
            cache._tree.unlock(base)
            raise

    def before_match(self, tokens: np.ndarray, extra_key: Any) -> None:
        """Apply the prefetch policy to prefetches on the path of ``tokens``."""
        ps = self._cache.spec.page_size
        for h in list(self._gets):
            # on the path: the prompt shares at least the first page this prefetch fetches
            if h._closed or h.extra_key != extra_key or tokens.size < h.start + ps or not \
                    np.array_equal(h.tokens[:h.start + ps], tokens[:h.start + ps]):
                continue
            if self.policy is PrefetchPolicy.WAIT_COMPLETE:
                h.wait()
            elif self.policy is PrefetchPolicy.TIMEOUT and not h.done() and not h._timed_out:
                try:
                    h.wait(max(0.0, h._deadline - time.monotonic()))
                except TimeoutError:
                    h._get.cancel()  # keep what landed; the rest is recomputed
                    h._timed_out = True  # counted once; later matches do not wait again
                    self._n["l3_prefetch_timeouts"] += 1
            self._advance(h)
        self.poll()

    def poll(self, attach: bool = True) -> None:
        """Finish completed puts and prefetches (cache thread; cheap when nothing is done).

        Args:
            attach: also hang landed prefetch pages in the tree. False inside an operation of
                the cache (eviction, load_back, allocation): attaching matches, and so may split,
                nodes that operation holds; the pages wait for the next public call.
        """
        self._submit_reads(block=False)
        while self._puts and self._puts[0][0].done():
            self._finish_put(*self._puts.popleft())
        if self._gets and attach:
            for h in self._gets:
                if h.done():
                    self._advance(h)
            self._gets = [h for h in self._gets if not h._closed]

    def flush(self) -> None:
        """Wait for every put and prefetch in flight and apply them."""
        self._submit_reads(block=True)
        while self._puts:
            handle, sids = self._puts.popleft()
            try:
                handle.wait()
            except StorageError:
                pass
            self._finish_put(handle, sids)
        for h in self._gets:
            h.wait()
            self._advance(h)
        self._gets = []

    def _drain_puts(self, n: int) -> None:
        """Backpressure: wait (oldest first, ``_PUT_WAIT_S`` in all) for puts in flight until
        ``n`` staging pages are free. Touches no tree state (safe inside an eviction loop)."""
        deadline = time.monotonic() + _PUT_WAIT_S
        self._submit_reads(block=True)  # their staging pages are freed only after their puts
        while self._puts and n > self._staging_alloc.num_free:
            handle, sids = self._puts[0]
            try:
                handle.wait(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return
            except StorageError:
                pass
            self._puts.popleft()
            self._finish_put(handle, sids)

    def _finish_put(self, handle: Any, sids: np.ndarray) -> None:
        try:
            ok = handle.wait(0)
        except StorageError:
            ok = np.zeros(len(handle.keys), bool)
        stored = int(ok.sum())
        self._n["l3_put_pages_stored"] += stored
        self._n["l3_puts_dropped"] += ok.size - stored
        self._staging_alloc.free(sids)

    def _advance(self, h: PrefetchHandle) -> None:
        """Attach the pages of ``h`` that landed since the last call; close it once done."""
        if h._closed or (h._after is not None and not h._after._closed):
            return  # chained: its pages attach below the previous link's, once that is closed
        done = h.done()
        try:
            ok = h._get.wait(0) if done else h._get.landed()
        except StorageError:
            ok = np.zeros(h.pages_found, bool)
        ready = _leading(ok)
        if ready > h._applied:
            self._attach(h, ready)
        if done:
            rest = h._host_ids[h._applied:]
            self._cache._host.allocator.free(rest)
            self._n["l3_prefetch_missed_pages"] += rest.size
            self._staging_alloc.free(h._staging_ids)
            self._cache._tree.unlock(h._node)
            h._applied, h._closed = h.pages_found, True

    def _attach(self, h: PrefetchHandle, ready: int) -> None:
        """Pages ``[h._applied, ready)`` landed: copy them into their host pages and hang them in
        the tree root-first (see the module docstring)."""
        cache, ps = self._cache, self._cache.spec.page_size
        tree, lo = cache._tree, h._applied
        begin, end = h.start + lo * ps, h.start + ready * ps
        tree.match(h.tokens[:begin], h.extra_key)  # a node boundary where these pages start
        tm = tree.match(h.tokens[:end], h.extra_key)  # ... and where they end
        covered = tm.device_len + tm.host_len
        path, node = [], tm.node
        while node.parent is not None:
            path.append(node)
            node = node.parent
        path.reverse()
        pos, i = 0, 0
        while i < len(path) and pos < begin:
            pos += path[i].num_tokens
            i += 1
        parent = path[i - 1] if i else tree.root
        if covered < begin or pos != begin or (self._continuous and parent is not tree.root
                                               and parent.host_value is None):
            # What these pages hang under went (evicted since the earlier pages attached, or
            # the previous link came up short), or lost its host copy: nothing to attach to.
            self._give_up(h, lo, ready)
            return
        take, dup, copies = [], [], []  # page offsets in h; device nodes taking host copies
        for node in path[i:]:
            first = (pos - h.start) // ps
            span = np.arange(first, first + node.num_pages)
            pos += node.num_tokens
            if node.host_value is None and self._continuous:
                take.append(span)
                copies.append((node, span))
            else:  # already backed up (or write_back: a device node needs no host copy)
                dup.append(span)
        leaf_span = np.arange((covered - h.start) // ps, ready)
        take.append(leaf_span)
        take = np.concatenate(take)
        if dup:
            dup = np.concatenate(dup)
            cache._host.allocator.free(h._host_ids[dup])
            self._n["l3_prefetch_duplicate_pages"] += dup.size
        if take.size:
            cache._host.write_rows(h._host_ids[take], self._staging, h._staging_ids[take])
        for node, span in copies:  # root-first: each under a backed-up parent
            tree.set_host_value(node, h._host_ids[span])
            self._record(node.host_value, h._digests[span], node.page_hashes)
            cache._events.stored(node, Medium.HOST)
            self._n["l3_prefetch_backfill_pages"] += span.size
        if leaf_span.size:
            ids = h._host_ids[leaf_span]
            leaf = tree.add_host_leaf(tm.node, h.tokens[covered:end], ids, h.extra_key)
            self._record(ids, h._digests[leaf_span], leaf.page_hashes)
            cache._events.stored(leaf, Medium.HOST)
            self._n["l3_prefetch_hit_pages"] += leaf_span.size
        h._applied = ready

    def _give_up(self, h: PrefetchHandle, lo: int, ready: int) -> None:
        self._cache._host.allocator.free(h._host_ids[lo:ready])
        self._n["l3_prefetch_dropped_pages"] += ready - lo
        h._applied = ready
        h._get.cancel()

    # -- misc ---------------------------------------------------------------------------------

    def holdings(self) -> tuple[list[np.ndarray], list[TreeNode]]:
        """What open prefetches hold: their reserved host pages (not yet attached or given
        up) and their locked fetch bases (for ``HiCache.check_invariants``)."""
        open_ = [h for h in self._gets if not h._closed]
        return [h._host_ids[h._applied:] for h in open_], [h._node for h in open_]

    def reset_counters(self) -> None:
        """Zero this tier's counters and forget its digest records (``HiCache.reset``: the tree
        is empty); the store's own counters (``l3_store_*``) stay."""
        self._n.clear()
        self._digest_ok[:] = False

    def stats(self) -> dict[str, Any]:
        names = ("l3_lookup_pages", "l3_prefetches", "l3_prefetch_pages", "l3_prefetch_hit_pages",
                 "l3_prefetch_missed_pages", "l3_prefetch_duplicate_pages",
                 "l3_prefetch_backfill_pages",
                 "l3_prefetch_dropped_pages", "l3_prefetch_skipped_pages", "l3_prefetch_timeouts",
                 "l3_put_pages", "l3_put_pages_stored", "l3_puts_dropped", "l3_puts_skipped",
                 "l3_unkeyable_pages")
        out: dict[str, Any] = {name: self._n[name] for name in names}
        out["l3_available"] = int(self.backend is not None)
        out["l3_staging_free_pages"] = self._staging_alloc.num_free
        out["l3_in_flight"] = len(self._reads) + len(self._puts) + len(self._gets)
        if self.backend is not None:
            out.update({f"l3_store_{k}": v for k, v in self.backend.stats().items()})
        return out

    def close(self) -> None:
        """Flush, then close the backend (idempotent)."""
        if self.backend is not None:
            self.flush()
            self.backend.close()
            self.backend = None
