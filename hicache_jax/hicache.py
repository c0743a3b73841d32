"""HiCache: the public facade over the radix tree, the two page pools and the transfer engine.

Semantics follow SGLang's HiCache (``hiradix_cache.py``):

* **write_backup(node)** copies a node's device pages to fresh host pages. The node is "backing
  up" until the copy is acknowledged: it is locked (so eviction cannot take it) and its
  ``host_value`` is recorded only at the acknowledgement. A node split meanwhile keeps its tail
  under the same object; the acknowledgement walks up from it and gives every part its slice of
  the host pages, so both halves end up backed up. Write-through modes back up only when the
  parent is backed up or backing up (a continuous prefix from the root); acknowledgements are
  applied in dispatch order, so a parent is always backed up before its child. The backups
  one call starts (the hit path of an ``insert``, an eviction round) go in ONE transfer: one
  dispatch and one fixed cost, each node still acknowledged as its own op, root-first.
* **evict(num_tokens)** pops the least valuable device leaves: backed up -> free the device
  pages, keep the node host-only; not backed up -> delete it (write-through modes) or back it up
  first and free it once the copy is acknowledged at the end of the call (write-back). Unlike
  SGLang, a write-back leaf whose backup finds no host room even after ``evict_host`` is
  deleted (its KV is lost, counted in ``deleted_tokens``) rather than kept, and so is a
  not-backed-up leaf with host-only children (their host copies go with it, to L3 first under
  ``storage_write_policy="write_back"``): every unlocked device page can be freed, so
  ``alloc_pages``' pre-check (unlocked device pages) is exact and it raises before evicting
  anything or not at all.
* **evict_host(num_tokens)** deletes host-only unlocked leaves; nodes with a transfer in flight
  are locked or device-resident, so it never reaches them.
* **load_back(match)** moves the chain of host-only nodes above the match's node back to device
  pages (threshold / quota first), protected by an internal lock until the copy lands.

When: ``write_through`` backs a node up once its ``hit_count`` reaches the threshold, the
insert that creates it counting as its first access (as current SGLang counts it: threshold 1
backs up at insert, ``write_through_selective``'s 2 at the second access); L2 is then
inclusive of L1. ``write_back`` backs up only what eviction takes, on the allocation path.
``clean_ahead`` (the default) does what an OS page cache does with dirty pages, so that L1 + L2
behave like one cache of their summed size without copies on the allocation path:

* after an ``insert``, once eviction is near (fewer free device pages than
  ``cfg.clean_ahead_pages``, by default twice the largest allocation seen) and has taken a
  quarter of that reserve (or copied on its path, or, under strategies that evict new nodes
  first, a new leaf was inserted) since the last pass, the not-backed-up nodes among the first
  reserve pages that
  eviction would take (:func:`~hicache_jax.eviction.eviction_order`) are backed up in one
  asynchronous transfer: eviction then finds them clean (what it still has to copy is counted in
  ``stats()["eviction_backup_pages"]``);
* when L2 is full, host copies of nodes still on device (loaded back, or cleaned then hit
  again) are what it gives up first, hottest first, never the window the last pass cleaned;
  host-only leaves go after them, least valuable first.

No continuous host prefix is kept under ``write_back`` or ``clean_ahead``.

Page ownership (checked after every step of tests/test_hicache_state_machine.py): every device page is
free, owned by a caller (``alloc_pages`` .. ``insert``/``free_pages``) or held by one tree node;
every host page is free, held by one node, the target of a backup in flight, or reserved by
an L3 prefetch.

With ``cfg.storage`` set, an :class:`~hicache_jax.l3.L3Tier` adds L3 (``prefetch``; puts after
backups land; policies at ``match_prefix``): this module only calls its hooks. Pages fetched
from L3 attach below the deepest backed-up node, as SGLang's prefetch does: in write-through
modes a fetch starts there, device nodes on the way take the fetched pages as their host copy
(a backup of such a node still in flight then frees its own host pages at its
acknowledgement), and the rest hangs as a host-only leaf, so the host copies stay a continuous
prefix from the root, L3 included. In write-back mode, which needs no continuous prefix,
fetched pages hang under the matched prefix.

Matches go stale (DESIGN.md): a :class:`Match` names device pages; later calls may evict them.
``Match.node`` is a :class:`NodeRef` that remembers the deepest device node of the match and the
epoch of its pages (the tree stamps a node each time it gets device pages), so :meth:`lock`
refuses a stale match and :meth:`load_back` always returns what holds the prefix now.
:meth:`insert` gets only pages: it refuses free pages and tree pages at other positions, but a
stale page that was re-allocated to a caller cannot be told from a fresh one there, which is why
the request flow locks the match before anything that may evict.

Threading: one thread owns the cache and makes every call but :meth:`stats`; a call from any
other thread raises :class:`HiCacheError` (one ``threading.get_ident()`` per call). The first
call after construction takes ownership, so a cache built on one thread may be served from
another; :meth:`release_thread` hands it over explicitly, and the cache of an owner that has
exited goes to the next caller. :meth:`stats` may be called from any
thread (reads only). Transfer completion is detected by polling the engine at the start of the
public methods, never by callbacks. After :meth:`close`, every call but ``stats()`` raises.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from hicache_jax.allocator import PageAllocator
from hicache_jax.device_pool import DevicePagePool
from hicache_jax.errors import HiCacheError, OutOfPagesError
from hicache_jax.events import EventBatch, KVEvent, Medium, NullRecorder, Recorder, make_recorder
from hicache_jax.eviction import FRESH_FIRST, VictimHeap, eviction_order, hottest_first
from hicache_jax.host_pool import HostPagePool
from hicache_jax.l3 import L3Tier, PrefetchHandle
from hicache_jax.radix import RadixTree
from hicache_jax.tree_node import TreeNode
from hicache_jax.spec import HiCacheConfig, KVSpec, WritePolicy
from hicache_jax.transfer import TransferEngine
from hicache_jax.validation import as_tokens, check_bool, check_extra_key, check_int

# Owner of a device page (one int8 per page): the allocator says free/used, this says by whom.
_FREE, _CALLER, _TREE = 0, 1, 2
# Which owners a call accepts, as owner -> allowed masks (indexing one costs ~10x less than
# np.isin): caller pages only, or caller pages and the tree's.
_CALLERS = np.array([False, True, False])
_ALLOCATED = np.array([False, True, True])


@dataclass(frozen=True, eq=False)
class NodeRef:
    """Opaque handle to the deepest node of a :class:`Match` (``Match.node``): what
    :meth:`HiCache.lock`, :meth:`HiCache.unlock` and :meth:`HiCache.load_back` take.

    It remembers which device pages the match saw (the deepest device node and the epoch of its
    pages), so :meth:`HiCache.lock` can tell a match that went stale -- its device pages were
    evicted, or evicted and loaded back into other pages, by calls made since -- and refuse it.
    """

    _node: TreeNode
    _anchor: TreeNode  # deepest device-resident node of the match (the root if none)
    _epoch: int        # _anchor.device_epoch when the match was made

    @property
    def _prefix(self) -> np.ndarray:
        """int64 tokens of _node's prefix, which load_back re-matches when _node has left the
        tree: rebuilt from the node on demand (the node keeps its key and the node its prefix
        continues from once deleted), not copied at every match."""
        return self._node.prefix_tokens()

    def __eq__(self, other: object) -> bool:  # the same node, whichever match named it
        return isinstance(other, NodeRef) and other._node is self._node

    def __hash__(self) -> int:
        return id(self._node)

    def __repr__(self) -> str:
        return f"NodeRef({self._node!r})"


@dataclass(frozen=True)
class Match:
    """Result of :meth:`HiCache.match_prefix` / :meth:`HiCache.load_back`.

    A Match describes the cache when it was made. Calls that may evict (``alloc_pages``,
    ``load_back``, ``insert``, ``evict``, other requests' work) can free or move its device
    pages: lock ``node`` before any of them (the request flow of DESIGN.md), or pass the match
    through :meth:`HiCache.load_back`, which always returns what holds the prefix now.
    :meth:`HiCache.lock` of a stale match raises :class:`HiCacheError` (match again).

    Attributes:
        device_pages: int32 ``[device_len // page_size]`` device page ids of the L1 part, root
            first (a copy).
        device_len: tokens covered on device (a multiple of page_size).
        host_len: further tokens available on host only (a multiple of page_size).
        node: opaque handle (:class:`NodeRef`) of the deepest matched node, for lock / unlock /
            load_back.
        load_handle: set only by ``load_back(m, layerwise=True)``: the transfer handle whose
            ``wait_layer(l)`` returns once layer ``l`` of the loaded pages is on device (the
            caller's forward waits per layer). ``None`` otherwise.
    """

    device_pages: np.ndarray
    device_len: int
    host_len: int
    node: NodeRef
    load_handle: Any = None


@dataclass(frozen=True)
class _WriteStrategy:
    """A write policy resolved once: when to back up, and whether the prefix must be continuous."""

    backup_on_hit: bool
    backup_on_evict: bool
    continuous_prefix: bool
    clean_ahead: bool = False  # back up the eviction end of L1 after inserts; L2 ~ exclusive


_WRITE_STRATEGIES = {
    WritePolicy.WRITE_THROUGH: _WriteStrategy(True, False, True),
    WritePolicy.WRITE_THROUGH_SELECTIVE: _WriteStrategy(True, False, True),
    WritePolicy.WRITE_BACK: _WriteStrategy(False, True, False),
    WritePolicy.CLEAN_AHEAD: _WriteStrategy(False, True, False, clean_ahead=True),
}


@dataclass(frozen=True)
class _Tier:
    """What the single evict-and-retry path (:meth:`HiCache._take_pages`) needs of one tier."""

    allocator: PageAllocator
    evict: Callable[[int], int]          # tokens -> tokens freed
    evictable_pages: Callable[[], int]   # upper bound of pages eviction could free
    wait_helps: bool                     # finishing copies in flight can free more (their locks)


@dataclass
class _Op:
    """A transfer in flight: a backup of ``node`` or a load-back ending at ``node`` (locked)."""

    seq: int
    kind: str
    handle: Any
    node: TreeNode
    device_ids: np.ndarray
    host_ids: np.ndarray


def _prepare_tokens(tokens: Any, extra_key: Any, page_size: int) -> np.ndarray:
    """Validate tokens (1-D ints in [0, 2**31)) and extra_key (hashable); return the whole-page
    int32 part (what the tree stores; see validation.as_tokens)."""
    arr = as_tokens(tokens)
    check_extra_key(extra_key)
    return arr[: arr.shape[0] // page_size * page_size]


def _publishes(method: Callable) -> Callable:
    """A public call that may record KV events: its events form one batch, sealed (published)
    when it returns. With events off that is one no-op call of the NullRecorder. It runs the
    owning-thread check (:meth:`HiCache._guard`) for the method."""
    @functools.wraps(method)
    def call(self: "HiCache", *args: Any, **kwargs: Any) -> Any:
        self._guard()  # first: another thread must not seal the owner's batch
        try:
            return method(self, *args, **kwargs)
        finally:
            self._events.end_call()
    return call


class HiCache:
    """Hierarchical KV page cache: device pool (L1), host pool (L2), radix tree of prefixes.

    Args:
        spec: what one page holds.
        cfg: sizes and policies.
        clock: time source of the tree's access stamps (tests inject a manual clock).
    """

    def __init__(self, spec: KVSpec, cfg: HiCacheConfig, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(spec, KVSpec):
            raise TypeError(f"spec must be a KVSpec, got {type(spec).__name__}")
        if not isinstance(cfg, HiCacheConfig):
            raise TypeError(f"cfg must be a HiCacheConfig, got {type(cfg).__name__}")
        self.spec, self.cfg = spec, cfg
        self._ps = spec.page_size
        self._write = _WRITE_STRATEGIES[cfg.write_policy]
        self._tree = RadixTree(spec.page_size, clock)
        self._device = DevicePagePool(spec, cfg.device_pages, mesh=cfg.mesh, axis=cfg.shard_axis,
                                      copy_backend=cfg.copy_backend, huge_pages=cfg.huge_pages)
        self._host = HostPagePool(spec, cfg.host_pages, layout=cfg.host_layout, mesh=cfg.mesh,
                                  axis=cfg.shard_axis, huge_pages=cfg.huge_pages)
        self._engine = TransferEngine(self._device, self._host)
        self._dev_tier = _Tier(self._device.allocator, self._evict_device,
                               lambda: self._tree.evictable_device_tokens // self._ps, True)
        # Host eviction frees exactly the unlocked host-only nodes, so a host page request that
        # cannot be met fails before deleting anything. Waiting for copies in flight never adds
        # to them: a load's nodes are already device-resident, a backup's are on device.
        self._host_tier = _Tier(self._host.allocator, self._evict_host,
                                lambda: self._tree.host_evictable_tokens // self._ps, False)
        if self._write.clean_ahead:  # host room also comes from redundant copies (see module doc)
            self._host_tier = _Tier(self._host.allocator, self._evict_host_clean_ahead,
                                    self._host_evictable_clean_ahead, False)
        self._events: NullRecorder | Recorder = NullRecorder()  # the configured one: last
        self._thread: int | None = None  # owning thread's ident; taken by the first call
        self._owner_thread = threading.current_thread()
        self._thread_name = ""
        self._thread_lock = threading.Lock()
        self._closed = False
        self._init_state()
        self._l3 = L3Tier(self) if cfg.storage is not None else None  # L3: see l3.py
        # Last, so that nothing stays bound when anything above raises. Off: NullRecorder.
        try:
            self._events = make_recorder(cfg.kv_events)
        except BaseException:  # e.g. a port in use: release the L3 backend opened above
            if self._l3 is not None:
                self._l3.close()
            raise

    def _init_state(self) -> None:
        self._owner = np.zeros(self.cfg.device_pages, np.int8)
        self._backing = np.zeros(self.cfg.device_pages, np.bool_)   # pages of backups in flight
        self._loading = np.zeros(self.cfg.device_pages, np.bool_)   # pages of loads in flight
        self._slot = np.full(self.cfg.device_pages, -1, np.int64)  # scratch of _finish_backup
        self._ops: collections.deque[_Op] = collections.deque()
        self._caller_locks: dict[TreeNode, int] = {}
        self._n: collections.Counter[str] = collections.Counter()
        self._seq = -1  # seq of the last transfer dispatched
        self._cold: list[TreeNode] = []  # clean_ahead: the eviction end its last pass covered
        self._clean_mark = (0, 0, 0)  # (evicted, eviction-backup pages, fresh) at that pass
        self._fresh_tokens = 0  # tokens of new leaves (counted under FRESH_FIRST strategies)
        self._largest_alloc = 0  # pages: the auto reserve follows the largest allocation

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # -- validation --------------------------------------------------------------------------

    def _guard(self) -> None:
        """Every public call but ``stats()`` starts here: the owning thread passes at the cost
        of one ``get_ident()``; anything else goes to :meth:`_take_thread`."""
        if threading.get_ident() != self._thread:
            self._take_thread()

    def _take_thread(self) -> None:
        with self._thread_lock:
            if self._closed:
                raise HiCacheError("this HiCache is closed: build a new one (only stats() "
                                   "answers after close())")
            if self._thread is not None and not self._owner_thread.is_alive():
                # The owner exited, but its ident may now be a live thread's (CPython reuses
                # them at once), which passes the fast path: that thread owns the cache.
                heir = next((t for t in threading.enumerate() if t.ident == self._thread), None)
                if heir is not None:
                    self._owner_thread, self._thread_name = heir, heir.name
            # First call, handed over with release_thread(), or the owner has exited.
            if self._thread is None or not self._owner_thread.is_alive():
                self._thread = threading.get_ident()
                self._owner_thread = threading.current_thread()
                self._thread_name = self._owner_thread.name
                return
        raise HiCacheError(
            f"this HiCache is owned by thread {self._thread_name!r}, called from "
            f"{threading.current_thread().name!r}: a cache is not thread-safe. Call it from its "
            "owning thread, or hand it over: release_thread() on the owner, then the next call "
            "from any thread takes it")

    def _check_node(self, node: Any) -> TreeNode:
        if not isinstance(node, NodeRef):
            raise TypeError(f"node must be a Match.node, got {type(node).__name__}")
        if not self._tree.owns(node._node):
            raise HiCacheError(f"{node!r} is not in this cache (evicted and deleted since the "
                               "match, or from another cache): match again")
        return node._node

    @staticmethod
    def _is_stale(ref: NodeRef) -> bool:
        """Whether the device pages ``ref``'s match named were freed or moved since. Device
        residency is prefix-closed and leaves go first, so the anchor (the match's deepest
        device node) loses its pages before any ancestor does; a node that gets device pages
        again gets a new epoch. Splits keep the anchor object on its tail: no change."""
        anchor = ref._anchor
        return anchor.value is None or anchor.device_epoch != ref._epoch

    @staticmethod
    def _ref(node: TreeNode, anchor: TreeNode) -> NodeRef:
        return NodeRef(node, anchor, anchor.device_epoch)

    def _current(self, match: Match, node: TreeNode) -> Match:
        """``match`` if it still describes the cache, else a Match of what holds the prefix of
        ``node`` now (its device part and the host-only chain after it)."""
        anchor, host_len = node, 0
        while anchor.parent is not None and anchor.value is None:
            host_len += anchor.num_tokens
            anchor = anchor.parent
        if (not self._is_stale(match.node) and match.node._anchor is anchor
                and match.host_len == host_len):
            return match
        pages = self._path_pages(anchor)
        return Match(pages, pages.size * self._ps, host_len,
                     self._ref(node, anchor))

    def _check_pages(self, pages: Any, allowed: np.ndarray, what: str) -> np.ndarray:
        ids = self._device.validate_ids(pages, "pages")
        ok = allowed[self._owner[ids]]  # allowed: _CALLERS or _ALLOCATED
        if ids.size and not ok.all():
            bad = ids[~ok][:8].tolist()
            free = " (free: a stale Match's pages, evicted since? match again)" if (
                self._owner[bad] == _FREE).any() else ""
            raise HiCacheError(f"pages {bad} are not {what}{free}")
        return ids

    # -- public API --------------------------------------------------------------------------

    @_publishes
    def match_prefix(self, tokens: Any, extra_key: Hashable = None) -> Match:
        """Longest cached whole-page prefix of ``tokens`` on device, then on host.

        Args:
            tokens: 1-D non-negative int sequence; a trailing partial page is ignored.
            extra_key: hashable namespace (LoRA id, tenant salt).

        Returns:
            A :class:`Match`; its ``device_pages`` stay valid while ``node`` is locked.
        """
        arr = _prepare_tokens(tokens, extra_key, self._ps)  # validate before polling
        self._complete(attach=True)
        if self._l3 is not None:
            self._l3.before_match(arr, extra_key)
        tm = self._tree.match(arr, extra_key, validated=True)
        self._n["match_tokens"] += len(tokens) // self._ps * self._ps
        self._n["device_hit_tokens"] += tm.device_len
        self._n["host_hit_tokens"] += tm.host_len
        return Match(tm.device_pages, tm.device_len, tm.host_len,
                     self._ref(tm.node, tm.last_device_node))

    @_publishes
    def prefetch(self, tokens: Any, extra_key: Hashable = None) -> PrefetchHandle | None:
        """Start fetching from L3, into host pages, the pages of ``tokens`` beyond L1 + L2.

        Returns:
            A :class:`~hicache_jax.l3.PrefetchHandle` (``done()``, ``wait()``, ``pages_found``)
            or None: no storage, nothing beyond L1 + L2, or L3 holds none of the next pages.
            Fetched pages appear to :meth:`match_prefix` as host-only nodes per
            ``cfg.prefetch_policy``.
        """
        arr = _prepare_tokens(tokens, extra_key, self._ps)
        self._complete(attach=True)
        return None if self._l3 is None else self._l3.prefetch(arr, extra_key)

    @_publishes
    def load_back(self, match: Match, *, layerwise: bool = False) -> Match:
        """Copy the host-only part of ``match`` back to device pages.

        Args:
            match: from :meth:`match_prefix` or :meth:`load_back`; it may be stale (pages
                evicted or moved since, its node deleted: the prefix is matched again).
            layerwise: return before the copy completes, with ``Match.load_handle`` set so the
                forward can ``wait_layer(l)`` per layer.

        Returns:
            What holds the prefix of ``match.node`` now, on every path: a new :class:`Match`
            with ``device_len`` grown and ``host_len == 0`` when loaded; when nothing is on host
            or the load is declined (fewer host tokens than ``cfg.load_back_threshold``, more
            than ``cfg.load_back_quota``, or no device pages even after eviction), ``match``
            itself if it still describes the cache, else a new Match of the current device part
            and host continuation. Leaves no lock for the caller (lock the result's node).
        """
        if not isinstance(match, Match) or not isinstance(match.node, NodeRef):
            raise TypeError(f"match must be a Match from match_prefix, got {type(match).__name__}")
        check_bool("layerwise", layerwise)
        self._complete(attach=True)
        node = top = match.node._node
        while top.parent is not None:
            top = top.parent
        if top.is_root and top is not self._tree.root:
            raise HiCacheError(f"{match.node!r} is not in this cache (another cache's, or from "
                               "before reset()): match again")
        if top is not self._tree.root:  # deleted since the match: what holds its prefix now
            prefix = match.node._prefix
            tm = self._tree.match(prefix, node.extra_key)
            match = Match(tm.device_pages, tm.device_len, tm.host_len,
                          self._ref(tm.node, tm.last_device_node))
            node = tm.node
        chain, top = [], node
        while top.parent is not None and top.value is None:
            chain.append(top)
            top = top.parent
        chain.reverse()
        ntok = sum(n.num_tokens for n in chain)
        quota = self.cfg.load_back_quota
        if not chain or ntok < self.cfg.load_back_threshold or (quota is not None and ntok > quota):
            self._n["load_backs_declined"] += bool(chain)
            return self._current(match, node)
        # The lock walks to the root: the chain cannot be host-evicted and its device ancestors
        # cannot be device-evicted while we allocate (write-back eviction may evict_host).
        self._tree.lock(node)
        try:
            ids = self._take_pages(self._dev_tier, ntok // self._ps)
        except OutOfPagesError:
            self._tree.unlock(node)
            self._n["load_backs_declined"] += 1
            return self._current(match, node)
        host_ids = np.concatenate([n.host_value for n in chain])
        try:
            handle = self._engine.load(host_ids, ids, layerwise=bool(layerwise))
        except BaseException:  # a dispatch failure (internal ids: a bug, or the runtime): undo
            self._device.allocator.free(ids)
            self._tree.unlock(node)
            raise
        off = 0
        for n in chain:  # root-first, as set_value requires
            self._tree.set_value(n, ids[off:off + n.num_pages])
            self._events.stored(n, Medium.DEVICE)
            off += n.num_pages
        self._owner[ids] = _TREE
        self._loading[ids] = True
        self._ops.append(_Op(self._next_seq(), "load", handle, node, ids, host_ids))  # keeps the lock
        self._n["load_backs"] += 1
        self._n["load_back_tokens"] += ntok
        pages = self._path_pages(node)
        return Match(pages, pages.size * self._ps, 0, self._ref(node, node),
                     handle if layerwise else None)

    # -- load_back_many: the load-backs of several requests in one transfer ------------------

    @_publishes
    def load_back_many(self, matches: Any, *, layerwise: bool = False) -> list[Match]:
        """:meth:`load_back` of several matches (a scheduler step's admitted requests) with ONE
        copy dispatch for all the host pages it accepts.

        Each match is decided as ``load_back`` would decide it called on the matches in order:
        its chain is the host-only nodes above its node not already accepted for an earlier
        match in the list (duplicates and overlapping prefixes load once, by the first), and
        the threshold and quota apply to that chain. Device pages come from one allocation for
        every accepted chain; when that cannot be had even after eviction, each match is
        allocated in order and those that find no pages are declined.

        Args:
            matches: a list or tuple of Matches (as :meth:`load_back` takes; stale is fine).
            layerwise: as in :meth:`load_back`; every returned match whose device part holds
                pages of the load carries the one shared ``load_handle``.

        Returns:
            One Match per input, in order, each what :meth:`load_back` would return for it:
            what holds its prefix now (``host_len == 0`` when its chain was loaded, by it or by
            an earlier duplicate). No lock is left for the caller.

        Raises:
            TypeError: ``matches`` is not a list/tuple of Matches, ``layerwise`` not a bool.
            HiCacheError: a match from another cache (or from before ``reset()``).
            All before any change to the cache.
        """
        if not isinstance(matches, (list, tuple)):
            raise TypeError(f"matches must be a list or tuple of Match, got "
                            f"{type(matches).__name__}")
        for i, m in enumerate(matches):
            if not isinstance(m, Match) or not isinstance(m.node, NodeRef):
                raise TypeError(f"matches[{i}] must be a Match from match_prefix, got "
                                f"{type(m).__name__}")
        check_bool("layerwise", layerwise)
        for i, m in enumerate(matches):
            if self._root_of(m.node._node) is not None:
                raise HiCacheError(f"matches[{i}]: {m.node!r} is not in this cache (another "
                                   "cache's, or from before reset()): match again")
        self._complete(attach=True)
        resolved = [self._resolve_for_load(m) for m in matches]
        accepted = self._take_load_pages(resolved)
        handle = self._dispatch_loads(accepted, layerwise)
        loaded = np.concatenate([ids for _, _, ids in accepted]) if accepted else None
        out = []
        for m, node in resolved:
            cur = self._current(m, node)
            if layerwise and loaded is not None and np.isin(cur.device_pages, loaded).any():
                cur = Match(cur.device_pages, cur.device_len, cur.host_len, cur.node, handle)
            out.append(cur)
        return out

    def _root_of(self, node: TreeNode) -> TreeNode | None:
        """None when ``node``'s top ancestor is this cache's root (deleted nodes keep theirs)."""
        top = node
        while top.parent is not None:
            top = top.parent
        return None if top is self._tree.root or not top.is_root else top

    def _resolve_for_load(self, match: Match) -> tuple[Match, TreeNode]:
        """(match, node) of what holds ``match``'s prefix: re-matched when its node was deleted."""
        node = match.node._node
        if self._tree.owns(node):
            return match, node
        tm = self._tree.match(match.node._prefix, node.extra_key)
        return (Match(tm.device_pages, tm.device_len, tm.host_len,
                      self._ref(tm.node, tm.last_device_node)), tm.node)

    def _load_chain(self, node: TreeNode, claimed: set) -> list[TreeNode]:
        """Host-only nodes above ``node`` (root-first), stopping at a claimed one."""
        chain = []
        while node.parent is not None and node.value is None and node not in claimed:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    def _chains(self, resolved: list, take: Callable[[int], np.ndarray] | None) -> tuple:
        """Decide the matches in order: ([(node, chain, ids)], declined). A chain is cut at
        the nodes accepted before it; threshold and quota apply to it; ``take(pages)`` (None:
        decide only, ids None) allocates and may raise OutOfPagesError, which declines it."""
        quota, claimed, out, declined = self.cfg.load_back_quota, set(), [], 0
        for _, node in resolved:
            chain = self._load_chain(node, claimed)
            ntok = sum(n.num_tokens for n in chain)
            if not chain or ntok < self.cfg.load_back_threshold or (quota is not None
                                                                    and ntok > quota):
                declined += bool(chain)
                continue
            try:
                ids = None if take is None else take(ntok // self._ps)
            except OutOfPagesError:
                declined += 1
                continue
            claimed.update(chain)
            out.append((node, chain, ids))
        return out, declined

    def _take_load_pages(self, resolved: list) -> list:
        """(node, chain, device ids) of every accepted chain, its node locked (the lock its op
        keeps until the copy lands). Every match's node is locked while pages are taken, so
        eviction cannot reach a chain or its device ancestors. One allocation for all; if even
        eviction cannot cover it, one per chain in order, declining those that find none."""
        nodes = [node for _, node in resolved]
        for node in nodes:
            self._tree.lock(node)
        try:
            out, declined = self._chains(resolved, None)
            try:
                need = sum(n.num_pages for _, chain, _ in out for n in chain)
                ids = self._take_pages(self._dev_tier, need) if need else np.zeros(0, np.int32)
                off = 0
                for i, (node, chain, _) in enumerate(out):
                    k = sum(n.num_pages for n in chain)
                    out[i] = (node, chain, ids[off:off + k])
                    off += k
            except OutOfPagesError:
                out, declined = self._chains(resolved,
                                             lambda k: self._take_pages(self._dev_tier, k))
        finally:
            for node in nodes:
                self._tree.unlock(node)
        for node, _, _ in out:
            self._tree.lock(node)
        self._n["load_backs_declined"] += declined
        return out

    def _dispatch_loads(self, accepted: list, layerwise: bool) -> Any:
        """One host -> device copy for every accepted chain; one op per chain sharing it."""
        if not accepted:
            return None
        ids = np.concatenate([i for _, _, i in accepted])
        host_ids = np.concatenate([n.host_value for _, chain, _ in accepted for n in chain])
        try:
            handle = self._engine.load(host_ids, ids, layerwise=bool(layerwise))
        except BaseException:  # a dispatch failure (internal ids: a bug, or the runtime): undo
            self._device.allocator.free(ids)
            for node, _, _ in accepted:
                self._tree.unlock(node)
            raise
        off = 0
        for node, chain, dev in accepted:  # in order: a chain's parent was set by an earlier one
            for n in chain:
                self._tree.set_value(n, ids[off:off + n.num_pages])
                self._events.stored(n, Medium.DEVICE)
                off += n.num_pages
            self._ops.append(_Op(self._next_seq(), "load", handle, node, dev,
                                 np.concatenate([n.host_value for n in chain])))
            self._n["load_backs"] += 1
            self._n["load_back_tokens"] += dev.size * self._ps
        self._owner[ids] = _TREE
        self._loading[ids] = True
        return handle

    def lock(self, node: NodeRef) -> None:
        """Protect a match's prefix (``Match.node``: the node and its ancestors) from eviction
        on both tiers (counted).

        Raises:
            HiCacheError: the match is stale: its device pages were evicted, or evicted and
                loaded back into other pages, since it was made (lock before calls that may
                evict, or pass it through :meth:`load_back`); or its node left the cache.
        """
        self._guard()
        tnode = self._check_node(node)
        if self._is_stale(node):
            raise HiCacheError(
                f"stale Match: the device pages of {node!r} were evicted or moved since the "
                "match (by alloc_pages, load_back, insert or evict of other requests): call "
                "match_prefix (or load_back) again and lock the new Match's node")
        self._tree.lock(tnode)
        self._caller_locks[tnode] = self._caller_locks.get(tnode, 0) + 1

    @_publishes  # clean_ahead's pass at unlock may give up host copies (BlockRemoved)
    def unlock(self, node: NodeRef) -> None:
        """Undo one :meth:`lock` of ``node``. ``HiCacheError`` if the caller holds none."""
        node = self._check_node(node)
        held = self._caller_locks.get(node, 0)
        if held == 0:
            raise HiCacheError(f"unlock of {node!r} without a matching lock")
        self._tree.unlock(node)
        if held == 1:
            del self._caller_locks[node]
        else:
            self._caller_locks[node] = held - 1
        self._maybe_clean_ahead()  # a request's end: its nodes are evictable again

    @_publishes
    def alloc_pages(self, n: int) -> np.ndarray:
        """Take ``n`` device pages for the caller, evicting as needed.

        Returns:
            int32 ``[n]`` page ids, owned by the caller until :meth:`insert` or
            :meth:`free_pages`.

        Raises:
            OutOfPagesError: not enough free + evictable pages; ``needed``, ``free``,
                ``evictable``, ``locked`` say why. Raised before evicting anything; copies in
                flight (whose locks may be what holds the pages) are waited for first.
        """
        n = check_int("n", n)
        self._complete(attach=True)
        ids = self._take_pages(self._dev_tier, n)
        self._owner[ids] = _CALLER
        return ids

    def free_pages(self, pages: Any) -> None:
        """Give back caller-owned pages that were never inserted."""
        self._guard()
        ids = self._check_pages(pages, _CALLERS, "caller-owned (from alloc_pages, not inserted)")
        self._device.allocator.free(ids)
        self._owner[ids] = _FREE

    def write_kv(self, pages: Any, kv: Any) -> None:
        """Write KV into caller-owned pages.

        Args:
            pages: n caller-owned device page ids.
            kv: ``spec.kv_shape(n)`` = [num_layers, kv, n, page_size, heads, head_dim] in
                ``spec.dtype`` or its raw-bits dtype; jax or numpy. Not consumed.
        """
        self._guard()
        ids = self._check_pages(pages, _CALLERS, "caller-owned (cached pages are read-only)")
        self._device.write(ids, kv)

    @_publishes
    def read_kv(self, pages: Any) -> Any:
        """KV of allocated device pages: ``spec.kv_shape(n)`` in ``spec.dtype`` (a new array)."""
        ids = self._check_pages(pages, _ALLOCATED, "allocated")
        if self._loading[ids].any():  # a layer-wise load may still be writing these pages
            last = [op for op in self._ops if op.kind == "load"
                    and np.isin(op.device_ids, ids).any()][-1]
            self._complete(upto=last.seq)
        return self._device.read(ids)

    @_publishes
    def insert(self, tokens: Any, pages: Any, extra_key: Hashable = None, *,
               chunked: bool = False, priority: int = 0) -> int:
        """Cache the whole pages of ``tokens`` with ``pages`` (see DESIGN.md).

        Args:
            tokens: 1-D non-negative int sequence; a trailing partial page is ignored.
            pages: int ``[len(tokens) // page_size]``: the tree's own page for a position it
                holds on device, or a caller-owned page. Caller pages at positions the tree
                already holds are freed; the others become the tree's.
            extra_key: namespace.
            chunked: one chunk of a chunked prefill: no hit is counted on existing nodes.
            priority: request priority (``eviction="priority"``).

        Returns:
            Tokens already cached (either tier) before the call.
        """
        check_bool("chunked", chunked)
        check_int("priority", priority, -(2**62), 2**62)
        arr = _prepare_tokens(tokens, extra_key, self._ps)
        ntok = arr.shape[0]
        ids = self._check_pages(pages, _ALLOCATED, "caller-owned or cached")
        if ids.size != ntok // self._ps:
            raise ValueError(f"pages has {ids.size} ids, expected {ntok // self._ps} "
                             "(one per whole page of tokens)")
        # No polling here: the tree's own checks below must see the state the caller saw.
        res = self._tree.insert(arr, ids, extra_key, priority=int(priority), validated=True,
                                chunked=bool(chunked))
        dup = res.duplicate_pages
        if dup.size:
            self._device.allocator.free(dup)
            self._owner[dup] = _FREE
            self._n["duplicate_pages_freed"] += dup.size
        kept = ids[self._owner[ids] == _CALLER]
        self._owner[kept] = _TREE
        for node in res.revived_nodes:
            self._events.stored(node, Medium.DEVICE)
        if res.last_node.parent is not None and res.last_node not in res.existing_nodes:
            self._events.stored(res.last_node, Medium.DEVICE)
        if not chunked and (self._write.backup_on_hit or self._write.clean_ahead):
            self._backup_inserted(res)
        if self._write.clean_ahead and self.cfg.eviction in FRESH_FIRST and \
                res.last_node not in res.existing_nodes:
            self._fresh_tokens += res.last_node.num_tokens
        # Inside the request flow the pass runs at unlock, once this request's nodes are
        # evictable; an insert made outside it (no caller lock held) runs it here.
        if not chunked and not self._caller_locks:
            self._maybe_clean_ahead()
        return res.prefix_len

    @_publishes
    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` device tokens if possible; returns tokens freed."""
        num_tokens = check_int("num_tokens", num_tokens)
        self._complete(attach=True)
        return self._evict_device(num_tokens)

    @_publishes
    def evict_host(self, num_tokens: int) -> int:
        """Delete host-only leaves worth ``num_tokens``; returns tokens freed on host."""
        num_tokens = check_int("num_tokens", num_tokens)
        self._complete(attach=True)
        return self._evict_host(num_tokens)

    @property
    def device_pool(self) -> DevicePagePool:
        """The device pool (L1). A serving stack's jitted forward writes K/V of pages it
        allocated straight into it with ``device_pool.run(step, ...)`` (pool donated); the pool
        object holds the only reference to the array, so do not keep ``device_pool.array``."""
        self._guard()
        return self._device

    @_publishes
    def flush(self) -> None:
        """Wait for every transfer in flight (L3 puts and prefetches too) and apply it."""
        self._complete(upto=self._seq)
        self._engine.wait_all()
        if self._l3 is not None:
            self._l3.flush()

    def close(self) -> None:
        """Flush, then release the L3 backend (its threads, connections). Idempotent. Every
        later call but ``stats()`` raises :class:`HiCacheError`."""
        if self._closed:
            return
        self.flush()
        try:
            if self._l3 is not None:
                self._l3.close()
        finally:
            self._events.close()  # the ZMQ publisher sends what is queued and unbinds
            with self._thread_lock:
                self._closed, self._thread = True, None

    def release_thread(self) -> None:
        """Hand the cache over: the owning thread gives it up and the next call from any thread
        takes it (e.g. built and warmed up on one thread, served from a scheduler thread).
        A no-op when no thread owns it yet."""
        if self._thread is None and not self._closed:
            return
        self._guard()
        with self._thread_lock:
            self._thread, self._thread_name = None, ""

    def take_events(self) -> list[KVEvent]:
        """KV events (BlockStored / BlockRemoved / AllBlocksCleared, one per page) since the
        last take, oldest first: the batches of :meth:`take_event_batches`, flattened.

        Raises:
            HiCacheError: events are off (``HiCacheConfig(kv_events=None)``, the default) or go
                to ZMQ: build the cache with ``kv_events={"publisher": "queue"}``.
        """
        self._guard()
        return self._events.take()

    def take_event_batches(self) -> list[EventBatch]:
        """The event batches (one per public call that recorded any) since the last take, each
        with its ``seq``: a gap means the buffer (``buffer_steps``) was full and the oldest
        batches were dropped (``stats()["kv_event_batches_dropped"]``). Raises as
        :meth:`take_events`."""
        self._guard()
        return self._events.take_batches()

    @_publishes
    def reset(self) -> None:
        """Wait for transfers, then forget everything: tree, caller pages and locks, counters
        (the L3 store keeps its entries, and its client's ``l3_store_*`` counters)."""
        self.flush()
        self._tree.reset()
        self._device.allocator.reset()
        self._host.allocator.reset()
        self._init_state()
        if self._l3 is not None:
            self._l3.reset_counters()
        self._events.cleared()

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy of both tiers (pure: does not poll transfers).

        The one call that any thread may make, also after :meth:`close`: it only reads, and
        reads made while the owner is inside a call may be mutually inconsistent."""
        dev, host, tree, ps = self._device.allocator, self._host.allocator, self._tree, self._ps
        n = self._n
        seconds = n["seconds_to_host"] + n["seconds_to_device"]
        moved = n["bytes_to_host"] + n["bytes_to_device"]
        return {
            "device_pages": dev.num_pages, "device_free_pages": dev.num_free,
            "device_used_pages": dev.num_used,
            "device_caller_pages": int((self._owner == _CALLER).sum()),
            "device_cached_tokens": tree.device_tokens,
            "device_evictable_pages": tree.evictable_device_tokens // ps,
            "device_protected_pages": tree.protected_device_tokens // ps,
            "host_pages": host.num_pages, "host_free_pages": host.num_free,
            "host_used_pages": host.num_used, "host_cached_tokens": tree.host_tokens,
            "host_evictable_leaves": len(tree.evictable_host),
            "match_tokens": n["match_tokens"], "device_hit_tokens": n["device_hit_tokens"],
            "host_hit_tokens": n["host_hit_tokens"],
            "backups": n["backups"], "backup_tokens": n["backup_tokens"],
            "backups_skipped": n["backups_skipped"],
            "load_backs": n["load_backs"], "load_back_tokens": n["load_back_tokens"],
            "load_backs_declined": n["load_backs_declined"],
            "evictions": n["evictions"], "evicted_tokens": n["evicted_tokens"],
            "eviction_backup_pages": n["eviction_backup_pages"],
            "clean_ahead_pages": n["clean_ahead_pages"],
            "host_copies_dropped_tokens": n["host_copies_dropped_tokens"],
            "deleted_tokens": n["deleted_tokens"],
            "host_evictions": n["host_evictions"], "host_evicted_tokens": n["host_evicted_tokens"],
            "duplicate_pages_freed": n["duplicate_pages_freed"],
            "bytes_to_host": n["bytes_to_host"], "bytes_to_device": n["bytes_to_device"],
            "transfer_seconds": seconds,
            "mean_transfer_gbps": moved / seconds / 1e9 if seconds > 0 else 0.0,
            "transfers_in_flight": len(self._ops),
        } | self._events.stats() | ({} if self._l3 is None else self._l3.stats())

    # -- internals: allocation and eviction --------------------------------------------------

    def _take_pages(self, tier: _Tier, n: int) -> np.ndarray:
        """The one evict-and-retry path: free pages, else evict the shortfall once, else raise.

        Raises before evicting anything when even full eviction could not cover ``n``.
        """
        alloc = tier.allocator
        if n <= alloc.num_free:  # the common case: no eviction bound to compute
            return self._granted(tier, alloc.alloc(n))
        if tier.wait_helps and self._ops and n > alloc.num_free + tier.evictable_pages():
            self._complete(upto=self._seq)  # copies in flight hold locks; their acks release them
        short = n - alloc.num_free
        if short > 0 and short <= tier.evictable_pages():
            tier.evict(short * self._ps)
        if n > alloc.num_free:
            evictable = tier.evictable_pages()
            raise OutOfPagesError(
                f"{alloc.name} pool: {n} pages needed, {alloc.num_free} free, {evictable} "
                "evictable: unlock finished requests or free caller pages",
                needed=n, free=alloc.num_free, evictable=evictable,
                locked=alloc.num_used - evictable)
        return self._granted(tier, alloc.alloc(n))

    def _granted(self, tier: _Tier, ids: np.ndarray) -> np.ndarray:
        """The auto clean_ahead reserve follows the largest device allocation that succeeded
        (one that raised leaves the cache as it was)."""
        if tier is self._dev_tier and ids.size > self._largest_alloc:
            self._largest_alloc = ids.size
        return ids

    def _evict_device(self, num_tokens: int) -> int:
        """Evict rounds until ``num_tokens`` are freed or a round frees nothing."""
        freed = 0
        while freed < num_tokens:
            got = self._evict_round(num_tokens - freed)
            if got == 0:
                break
            freed += got
        return freed

    def _evict_round(self, num_tokens: int) -> int:
        """One pass over the evictable leaves (see module doc). Write-back nodes are backed up
        in the pass (one transfer for all of them) and freed at its end, once acknowledged;
        their parents wait for the next round, as in SGLang (one wait for all
        acknowledgements, not one per node)."""
        tree = self._tree
        heap = VictimHeap(self.cfg.eviction, tree.evictable_device)
        freed, promised, claims = 0, 0, []
        while freed + promised < num_tokens and heap:
            node = heap.pop()
            if node not in tree.evictable_device:
                continue  # stale heap entry: locked, evicted or deleted meanwhile
            parent = node.parent
            if node.backed_up:
                freed += self._drop_device(node)
            elif self._write.backup_on_evict and (claim := self._claim_backup(node)) is not None:
                claims.append(claim)  # copied below in one transfer, freed once acknowledged
                promised += node.num_tokens
                continue
            else:  # no host copy and none to be had: the node goes, with any host-only
                freed += self._delete_subtree(node)  # children (none can be locked)
            if parent in tree.evictable_device:
                heap.push(parent)
        if claims:  # a copy on the allocation path: counted, a policy should make it rare
            self._n["eviction_backup_pages"] += sum(node.num_pages for node, _ in claims)
            self._complete(upto=self._dispatch_backups(claims))
            for node, _ in claims:
                if node in tree.evictable_device and node.backed_up:
                    freed += self._drop_device(node)
        return freed

    def _evict_host(self, num_tokens: int) -> int:
        tree = self._tree
        heap = VictimHeap(self.cfg.eviction, tree.evictable_host)
        freed = 0
        while freed < num_tokens and heap:
            node = heap.pop()
            if node not in tree.evictable_host:
                continue
            if self._engine.busy_host_pages(node.host_value).any():
                continue  # a copy still reads these pages (defence in depth: such nodes are locked)
            parent = node.parent
            freed += self._delete(node)
            if parent in tree.evictable_host:
                heap.push(parent)
        return freed

    def _backup_inserted(self, res: Any) -> None:
        """Backups an insert starts, in one transfer: write-through hits at the threshold
        (root-first), and the new leaf -- its creation is its first access -- or, with L3
        (``storage_write_policy="write_through"``, write-through and clean_ahead modes), so
        that computed pages go down to L3 now."""
        threshold, claims = self.cfg.write_through_threshold, []
        if self._write.backup_on_hit:
            claims = [self._claim_backup(node) for node in res.existing_nodes
                      if node.hit_count >= threshold]
        last = res.last_node
        if last.parent is not None and last not in res.existing_nodes and (
                (self._write.backup_on_hit and last.hit_count >= threshold)
                or (self._l3 is not None and self._l3.back_up_new)):
            claims.append(self._claim_backup(last))
        self._dispatch_backups([c for c in claims if c is not None])

    # -- internals: clean_ahead -------------------------------------------------------------

    def _reserve_pages(self) -> int:
        """Pages the clean_ahead pass keeps backed up at the eviction end (see the config)."""
        if self.cfg.clean_ahead_pages is not None:
            return self.cfg.clean_ahead_pages
        dev = self.cfg.device_pages
        return max(1, min(max(dev // 16, 2 * self._largest_alloc), dev // 2))

    def _maybe_clean_ahead(self) -> None:
        if self._write.clean_ahead and self._clean_due():
            self._clean_ahead()

    def _clean_due(self) -> bool:
        """A pass is due once eviction is near (fewer free device pages than the reserve) and,
        since the last, eviction has copied on its path or taken a quarter of the reserve, or
        (strategies that evict new nodes first) a new leaf was inserted."""
        reserve = self._reserve_pages()
        if self._device.allocator.num_free >= reserve:
            return False
        evicted, synced, fresh = self._clean_mark
        quarter = reserve * self._ps // 4
        return (not self._cold or self._n["eviction_backup_pages"] > synced
                or self._n["evicted_tokens"] - evicted >= quarter
                or self._fresh_tokens > fresh)  # new pages went straight to the eviction end

    def _clean_ahead(self) -> None:
        """Back up the not-backed-up nodes among the first ``clean_ahead_pages`` pages that
        eviction would take (one transfer), so that eviction finds them clean."""
        self._cold = eviction_order(self.cfg.eviction, self._tree.evictable_device,
                                    self._reserve_pages() * self._ps, self._tree.root)
        self._clean_mark = (self._n["evicted_tokens"], self._n["eviction_backup_pages"],
                            self._fresh_tokens)
        claims = [self._claim_backup(node) for node in self._cold if not node.backed_up]
        claims = [c for c in claims if c is not None]
        self._n["clean_ahead_pages"] += sum(node.num_pages for node, _ in claims)
        self._dispatch_backups(claims)

    def _cold_redundant_tokens(self) -> int:
        """Tokens of host copies in the last pass's window: kept, so eviction finds them clean."""
        redundant = self._tree.redundant
        return sum(n.num_tokens for n in self._cold if n in redundant)

    def _host_evictable_clean_ahead(self) -> int:
        tree = self._tree
        return (tree.host_evictable_tokens + tree.redundant_tokens
                - self._cold_redundant_tokens()) // self._ps

    def _evict_host_clean_ahead(self, num_tokens: int) -> int:
        """Host room under clean_ahead: first give up host copies of nodes still on device,
        hottest first (outside the window the last pass cleaned; a quarter of the reserve more
        than asked, so the next passes find room), then delete host-only leaves."""
        cold, tree = set(self._cold), self._tree
        want = num_tokens + self._reserve_pages() * self._ps // 4
        freed = 0
        for node in hottest_first(self.cfg.eviction, [n for n in tree.redundant if n not in cold]):
            if freed >= want:
                break
            if self._engine.busy_host_pages(node.host_value).any():
                continue  # defence in depth: a copy still reads them (such nodes are locked)
            ids = tree.drop_host_value(node)
            self._host.allocator.free(ids)
            self._events.removed(node, Medium.HOST)
            self._n["host_copies_dropped_tokens"] += node.num_tokens
            freed += node.num_tokens
        if freed < num_tokens:
            freed += self._evict_host(num_tokens - freed)
        return freed

    def _drop_device(self, node: TreeNode) -> int:
        """Free a backed-up node's device pages; it stays as a host-only node."""
        ids = self._tree.evict_device(node)
        self._device.allocator.free(ids)
        self._owner[ids] = _FREE
        self._events.removed(node, Medium.DEVICE)
        self._n["evictions"] += 1
        self._n["evicted_tokens"] += node.num_tokens
        return node.num_tokens

    def _delete_subtree(self, node: TreeNode) -> int:
        """Delete ``node`` (an unlocked device leaf) after its descendants, all host-only and
        unlocked (a lock below it would lock it): children first, so each is a leaf when
        deleted. Returns the device tokens freed (``node``'s)."""
        stack, order = list(node.children.values()), []
        while stack:
            child = stack.pop()
            order.append(child)
            stack.extend(child.children.values())
        for child in reversed(order):  # every node after all of its descendants
            self._delete(child)
        return self._delete(node)

    def _delete(self, node: TreeNode) -> int:
        """Delete a leaf from the tree, freeing its pages on both tiers; returns its tokens."""
        value, host_value = self._tree.delete_leaf(node)
        if value is not None:
            self._device.allocator.free(value)
            self._owner[value] = _FREE
            self._events.removed(node, Medium.DEVICE)
            self._n["evictions"] += 1
            self._n["evicted_tokens"] += node.num_tokens
            self._n["deleted_tokens"] += node.num_tokens
        if host_value is not None:
            if value is None and self._l3 is not None:
                self._l3.on_host_evict(node, host_value)  # write_back: to L3 before the free
            self._host.allocator.free(host_value)
            self._events.removed(node, Medium.HOST)
            if value is None:
                self._n["host_evictions"] += 1
                self._n["host_evicted_tokens"] += node.num_tokens
        return node.num_tokens

    # -- internals: transfers ----------------------------------------------------------------

    def _claim_backup(self, node: TreeNode) -> tuple[TreeNode, np.ndarray] | None:
        """Reserve host pages for a backup of ``node`` (locked, pages marked in flight); the copy
        itself is dispatched by :meth:`_dispatch_backups`. None when skipped (see module doc)."""
        if node.value is None or node.backed_up or self._backing[node.value].any():
            return None
        if self._write.continuous_prefix:
            parent = node.parent
            if not (parent.parent is None or parent.backed_up
                    or (parent.value is not None and self._backing[parent.value].any())):
                return None
        try:
            host_ids = self._take_pages(self._host_tier, node.num_pages)
        except OutOfPagesError:
            self._n["backups_skipped"] += 1
            return None
        self._tree.lock(node)
        self._backing[node.value] = True
        return node, host_ids

    def _dispatch_backups(self, claims: list[tuple[TreeNode, np.ndarray]]) -> int:
        """Copy every claimed node to host in ONE transfer (one dispatch, however many nodes);
        one op per node, in claim order (root-first), sharing the handle. Returns the last op's
        seq (-1: nothing to do)."""
        if not claims:
            return -1
        device_ids = [node.value.copy() for node, _ in claims]
        try:
            handle = self._engine.backup(np.concatenate(device_ids),
                                         np.concatenate([h for _, h in claims]))
        except BaseException:  # internal ids: a bug; undo the claims so the tree stays whole
            for (node, host_ids), ids in zip(claims, device_ids):
                self._backing[ids] = False
                self._tree.unlock(node)
                self._host.allocator.free(host_ids)
            raise
        for (node, host_ids), ids in zip(claims, device_ids):
            self._ops.append(_Op(self._next_seq(), "backup", handle, node, ids, host_ids))
        return self._seq

    def _complete(self, upto: int = -1, *, attach: bool = False) -> None:
        """Apply finished transfers in dispatch order, first waiting for those with seq <= upto.

        Dispatch order keeps a parent's backup acknowledged before its child's. ``attach``:
        also hang landed L3 prefetches in the tree -- only at the start of a public call, never
        inside an operation that holds nodes (an attach may split them).
        """
        self._engine.poll()
        if self._l3 is not None:
            self._l3.poll(attach)
        while self._ops:
            op = self._ops[0]
            if not op.handle.done():
                if op.seq > upto:
                    return
                op.handle.wait()
            self._ops.popleft()
            self._apply(op)

    def _apply(self, op: _Op) -> None:
        # Backups started together share one handle: each op counts its share of it.
        share = op.device_ids.size / op.handle.device_ids.size
        seconds = float(op.handle.seconds or 0.0) * share
        nbytes = op.device_ids.size * self.spec.page_bytes
        if op.kind == "load":
            self._loading[op.device_ids] = False
            self._n["bytes_to_device"] += nbytes
            self._n["seconds_to_device"] += seconds
        else:
            self._finish_backup(op)
            self._n["bytes_to_host"] += nbytes
            self._n["seconds_to_host"] += seconds
        self._tree.unlock(op.node)

    def _finish_backup(self, op: _Op) -> None:
        """Record host pages on ``op.node`` and on the parents split off it meanwhile."""
        pos = self._slot  # device page -> its index in op.device_ids (-1: not in the op)
        pos[op.device_ids] = np.arange(op.device_ids.size)
        parts, node = [], op.node
        while (node.parent is not None and node.value is not None and node.host_value is None
               and (pos[node.value] >= 0).all()):
            parts.append((node, pos[node.value]))
            node = node.parent
        pos[op.device_ids] = -1
        used = np.zeros(op.host_ids.size, np.bool_)
        for part, idx in reversed(parts):  # root-first: a parent is backed up before its child
            self._tree.set_host_value(part, op.host_ids[idx])
            self._events.stored(part, Medium.HOST)
            used[idx] = True
        if self._l3 is not None:
            self._l3.on_backup([part for part, _ in parts])
        if not used.all():  # an L3 fetch gave a part its host copy first: free ours
            self._host.allocator.free(op.host_ids[~used])
        self._backing[op.device_ids] = False
        self._n["backups"] += 1
        self._n["backup_tokens"] += int(used.sum()) * self._ps

    def _path_pages(self, node: TreeNode) -> np.ndarray:
        parts = []
        while node.parent is not None:
            parts.append(node.value)
            node = node.parent
        return np.concatenate(parts[::-1]).astype(np.int32) if parts else np.zeros(0, np.int32)
