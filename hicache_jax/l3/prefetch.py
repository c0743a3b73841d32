"""Prefetch from L3 into host pages: the prefetch side of :class:`~hicache_jax.l3.tier.L3Tier`.

* **prefetch** (L3 -> L2): for a prompt that L1 + L2 do not hold whole, the pages from the
  *fetch base* up to the first page L3 does not hold are read into staging pages; host pages are
  reserved at once (host eviction first, never pages being loaded: reserved pages are in no tree
  node). The fetch base is the deepest node of the prompt's path with a host copy (the root if
  none) in the write_through modes, as in SGLang, so that fetched pages attach below a backed-up
  node and the host copies stay a continuous prefix from the root (ARCHITECTURE.md); in write_back,
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

* **window groups** (:mod:`hicache_jax.l3.windows`): a prefetch also reads, per window group,
  the entries of its pages that a continuation at its end reads (``need_start(end)`` on), and
  attaches once every read is done; each node it gives host pages (the leaf, device nodes'
  host copies) gets a group's pages only where every page a continuation at the node's own end
  reads of its pages landed (all or none, and none when the group's host pool is short): what
  the tree keeps, never a page it would trim. A node without them is not servable from host
  at its end, and the match cuts it back (ARCHITECTURE.md, "Layer groups").

Everything here talks to the cache through its port (:class:`~hicache_jax.l3.port.CachePort`):
host pages are reserved and released there, and fetched pages attach there, so the cache alone
keeps the rule "every host page is free, held by one node, in flight, or reserved by an L3
prefetch". Deadlines use the port's clock (the cache's injected one).

Several processes (ARCHITECTURE.md, "Several processes"): every result of the store that a
decision reads is agreed through the port's group first, as the MIN over processes -- the pages
``exists`` found, a read's completion and its pages landed, a timeout -- so a page one process
could not read is a miss on every process, and all of them hang the same pages in the tree.

Threading: the cache's thread only (the backend's workers read and write staging rows only).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache_jax.l3.keys import DigestRecords, KeyNames
from hicache_jax.l3.port import CachePort
from hicache_jax.l3.storage import StorageError
from hicache_jax.l3.windows import WindowedGet, WindowLane, WindowPart
from hicache_jax.memory.allocator import PageAllocator
from hicache_jax.memory.group import Group, LocalGroup
from hicache_jax.spec import GroupKind, PrefetchPolicy
from hicache_jax.tree.hashing import chain_digests
from hicache_jax.tree.node import TreeNode
from hicache_jax.tree.windows import kept_first_page, servable_pages

_TIMEOUT_TOKENS = 1024  # the timeout policy's deadline grows by prefetch_timeout_s per this many


def leading(mask: np.ndarray) -> int:
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
    _node: TreeNode  # the fetch base (locked until closed)
    _host_ids: np.ndarray
    _staging_ids: np.ndarray
    _digests: np.ndarray  # uint8 [pages_found, 16]: chain digests of the fetched pages
    _deadline: float
    _after: PrefetchHandle | None = None  # fetches the pages right after this one's
    _next_page: np.ndarray | None = None  # the prompt's page after ``tokens``, which L3 did
    #     not hold at issue, or held beyond the deepest servable end (None: not known missing)
    _applied: int = 0  # pages attached to the tree (or given up) so far
    _closed: bool = False  # finished and its pages accounted for
    _timed_out: bool = False  # the timeout policy gave up waiting (its rest was cancelled)
    _revoked: bool = False  # landed pages had nothing left to hang under (its rest cancelled)
    _issued: float = 0.0  # the port's clock when its read started
    _measured: bool = False  # its read's time went to the cost model
    _decision: Any = None  # the load rule's record of the decision to fetch (or None)

    def done(self) -> bool:
        """Whether the storage read has finished (pages are attached at the cache's next call;
        a chained prefetch's once the one before it is closed)."""
        return self._get.done()

    def landed(self) -> int:
        """Pages landed intact so far (leading run; non-blocking)."""
        try:
            return leading(self._get.wait(0) if self._get.done() else self._get.landed())
        except StorageError:
            return 0

    def wait(self, timeout: float | None = None) -> int:
        """Block until the read finishes (``TimeoutError`` after ``timeout`` s); returns the
        pages that arrived intact (leading run)."""
        try:
            ok = self._get.wait(timeout)
        except StorageError:
            return 0
        return leading(ok)


# -- policies at match_prefix: one strategy object each, resolved once ---------------------------


class _MatchPolicy(Protocol):
    def before_match(
        self,
        h: PrefetchHandle,
        clock: Callable[[], float],
        counters: collections.Counter,
        group: Group,
    ) -> None: ...


class BestEffort:
    """Attach what has landed so far; never wait."""

    def before_match(
        self,
        h: PrefetchHandle,
        clock: Callable[[], float],
        counters: collections.Counter,
        group: Group,
    ) -> None:
        pass


class WaitComplete:
    """Wait for the prefetches on the request's path."""

    def before_match(
        self,
        h: PrefetchHandle,
        clock: Callable[[], float],
        counters: collections.Counter,
        group: Group,
    ) -> None:
        h.wait()


class Timeout:
    """Wait up to the prefetch's deadline, then keep what landed and cancel the rest (with
    several processes: if any process timed out, every one cancels)."""

    def before_match(
        self,
        h: PrefetchHandle,
        clock: Callable[[], float],
        counters: collections.Counter,
        group: Group,
    ) -> None:
        if h._timed_out:
            return
        # several processes: read on every one (a reading taken only where the read is not
        # done would tick that process's agreed clock alone); one: only when it waits, as ever
        now = clock() if group.num_processes > 1 else None
        finished = h.done()
        if not finished:
            try:
                h.wait(max(0.0, h._deadline - (clock() if now is None else now)))
                finished = True
            except TimeoutError:
                pass
        if group.agree_min("l3 prefetch in time", [finished])[0]:
            return
        h._get.cancel()  # keep what landed; the rest is recomputed
        h._timed_out = True  # counted once; later matches do not wait again
        counters["l3_prefetch_timeouts"] += 1


POLICIES: dict[PrefetchPolicy, type[_MatchPolicy]] = {
    PrefetchPolicy.BEST_EFFORT: BestEffort,
    PrefetchPolicy.WAIT_COMPLETE: WaitComplete,
    PrefetchPolicy.TIMEOUT: Timeout,
}


def _outcome(h: PrefetchHandle, missed: int) -> str | None:
    """The counter of a closed prefetch's outcome, so that each prefetch counts once: None when
    it timed out (``l3_prefetch_timeouts`` counted it when the policy gave up), else revoked
    (landed pages had nothing left to hang under: evicted since, or the previous link came up
    short), else partial (pages missed or failed their check), else complete."""
    if h._timed_out:
        return None
    if h._revoked:
        return "l3_prefetches_revoked"
    return "l3_prefetches_partial" if missed else "l3_prefetches_complete"


class Prefetcher:
    """The prefetches of one L3 tier (see the module docstring).

    Args:
        port: the cache, through its port.
        page_size, continuous: the cache's page size; whether its write policy keeps host
            copies a continuous prefix from the root (fetches then start at the deepest
            backed-up node).
        policy: :class:`~hicache_jax.spec.PrefetchPolicy`; ``timeout_s``: its base deadline.
        backend, staging, staging_alloc, records, counters: the tier's store, staging rows and
            their allocator, digest records and counters.
        group: the cache's processes (every store result is agreed through it).
        names: the tier's key names (its spec's fingerprint, each namespace's generation;
            default: the port's spec, every namespace in generation 0).
        lanes: the window groups' lanes (``l3/windows.py``; none for a plain spec): their
            pages are fetched and attached through the port's ``window_host``.
    """

    def __init__(
        self,
        port: CachePort,
        page_size: int,
        continuous: bool,
        policy: PrefetchPolicy,
        timeout_s: float,
        backend: Any,
        staging: np.ndarray,
        staging_alloc: PageAllocator,
        records: DigestRecords,
        counters: collections.Counter,
        group: Group | None = None,
        names: KeyNames | None = None,
        lanes: list[WindowLane] | None = None,
    ) -> None:
        self._port, self._ps, self._continuous = port, page_size, continuous
        self._policy, self._timeout_s = POLICIES[policy](), timeout_s
        self._backend, self._staging, self._staging_alloc = backend, staging, staging_alloc
        self._records, self._n = records, counters
        self._group = group if group is not None else LocalGroup()
        self._names = names if names is not None else KeyNames(port.spec)
        self._lanes = list(lanes or ())
        self._window_host = getattr(port, "window_host", None) if self._lanes else None
        self.gets: list[PrefetchHandle] = []

    def prefetch(self, tokens: np.ndarray, extra_key: Any) -> PrefetchHandle | None:
        """Start fetching the pages of ``tokens`` (whole pages, validated) from the fetch base
        (see the module docstring); None when L1 + L2 hold the prompt or nothing is fetched."""
        ps = self._ps
        tm = self._port.match(tokens, extra_key)
        covered = tm.device_len + tm.host_len
        if covered == tokens.size:
            return None  # L1 + L2 hold it all
        base, start = self._fetch_base(tm)
        shared, pos, after = self._in_flight(tokens, extra_key, start)
        if shared is not None:
            return shared
        prev = (
            after._digests[-1].tobytes()
            if after is not None
            else self._records.prefix_digest(base, extra_key, tokens[:start])
        )
        if prev is None:
            self._n["l3_unkeyable_pages"] += (tokens.size - pos) // ps
            return None
        # the load rule first, on the most L3 could give: where even that is not worth its
        # read, no lookup (the decision for fewer pages is the same: see _fetch_take)
        most = (
            pos + min((tokens.size - pos) // ps, self._staging_alloc.num_free) * ps - covered
        ) // ps
        take = int(self._port.fetch_pages(most, covered)) if most > 0 else 0
        if most > 0 and take <= 0:
            self._n["l3_lookups_declined"] += 1
            self._n["l3_prefetch_declined_pages"] += most
            return after
        digests = chain_digests(prev, tokens[pos:].reshape(-1, ps))
        keys = self._names.keys(extra_key, digests)
        stored = leading(self._backend.exists(keys))
        servable = self._servable(keys, pos, stored) if self._lanes and stored else stored
        stored, found = (int(x) for x in self._group.agree_min("l3 exists", [stored, servable]))
        self._n["l3_lookup_pages"] += len(keys)
        if stored < len(keys):  # the store lacks this page: if announced, it left L3
            self._port.events.l3_gone(tokens[: pos + (stored + 1) * ps].reshape(-1, ps), extra_key)
        if found < stored:
            self._n["l3_window_unservable_pages"] += stored - found
        if pos + found * ps <= covered:
            return after  # L3 has nothing beyond what L1 + L2 hold
        want = min(found, self._staging_alloc.num_free)
        new = (pos + want * ps - covered) // ps  # pages beyond what L1 + L2 hold
        decision = None
        if new > 0:  # the load rule: how many of those are worth their read
            take, decision = self._fetch_take(new, most, take, covered)
            if take < new:
                self._n["l3_prefetch_declined_pages"] += new - take
                want = 0 if take <= 0 else want - (new - take)
                if want == 0:
                    return after
        if want == 0:
            self._n["l3_prefetch_skipped_pages"] += found
            return after
        if after is not None:
            base = after._node  # one base per chain
        issued = self._port.clock()
        got = self._start_get(base, keys, want, found)
        if got is None:
            return after
        get, host_ids, sids = got
        k = host_ids.size
        if self._lanes:
            get = self._window_get(get, keys, pos, k)
        ntok = pos + k * ps
        missing = tokens[ntok : ntok + ps].copy() if k == found and ntok < tokens.size else None
        deadline = issued + self._timeout_s * (1 + k * ps / _TIMEOUT_TOKENS)
        handle = PrefetchHandle(
            k,
            pos,
            tokens[:ntok].copy(),
            extra_key,
            get,
            base,
            host_ids,
            sids,
            digests[:k].copy(),
            deadline,
            _after=after,
            _next_page=missing,
            _issued=issued,
            _decision=decision,
        )
        self.gets.append(handle)
        self._n["l3_prefetches"] += 1
        self._n["l3_prefetch_pages"] += k
        return handle

    def _servable(self, keys: list[str], pos: int, stored: int) -> int:
        """Of the ``stored`` pages from token ``pos`` that L3 holds (``keys``), how many end
        at a prefix that L3 can serve with every window group: the deepest end whose pages a
        continuation reads are all stored in each group's lane (a ``STATE`` group: the
        checkpoint at that end; ``tree/windows.py``'s ``servable_pages``). Pages before
        ``pos`` count as held (L1 + L2 hold them; a match cuts later where they do not). A
        fetch then ends where a checkpoint is, not beyond the last one (whose pages alone
        would serve nothing)."""
        first = pos // self._ps
        held = np.ones((len(self._lanes), first + stored), np.bool_)
        for i, lane in enumerate(self._lanes):
            if lane.group.kind is GroupKind.STATE:  # the checkpoints: any page may hold one
                lo = first
            else:  # a window group: what the deepest end reads (an earlier end reads less)
                lo = max(first, kept_first_page(lane.group, (first + stored) * self._ps, self._ps))
            have = np.asarray(lane.backend.exists(lane.keys(keys[lo - first : stored])), np.bool_)
            held[i, lo:] = have
            if lo > first and not have.all():  # an earlier end: its window, below lo too
                more = np.asarray(lane.backend.exists(lane.keys(keys[: lo - first])), np.bool_)
                held[i, first:lo] = more
        groups = [lane.group for lane in self._lanes]
        return max(0, servable_pages(held, groups, self._ps, first + stored) - first)

    def _window_get(self, full: Any, keys: list[str], pos: int, k: int) -> WindowedGet:
        """``full`` (the read of ``keys[:k]``, pages from token ``pos``) with each window
        group's read of the pages a continuation at its end reads; a group whose staging
        rows are short reads nothing (that end is then not servable from host)."""
        ps, end = self._ps, pos + k * self._ps
        parts: list[WindowPart] = []
        for lane in self._lanes:
            first = max(0, kept_first_page(lane.group, end, ps) - pos // ps)
            n = k - first
            if n <= 0:
                continue
            if n > lane.alloc.num_free:
                self._n["l3_window_prefetch_skipped_pages"] += n
                continue
            sids = lane.alloc.alloc(n)
            try:
                get = lane.backend.get_into(lane.keys(keys[first:k]), sids)
            except BaseException:
                lane.alloc.free(sids)
                for p in parts:  # (their reads finish on their own: release once done)
                    p.get.cancel()
                    p.get.wait()
                    p.lane.alloc.free(p.sids)
                full.cancel()
                raise
            parts.append(WindowPart(lane, np.arange(first, k), sids, get))
            self._n["l3_window_prefetch_pages"] += n
        return WindowedGet(full, parts)

    def _fetch_take(self, new: int, most: int, take: int, covered: int) -> tuple[int, Any]:
        """How many of the ``new`` pages L3 holds to fetch, given the rule's ``take`` of the
        ``most`` it could have held: that decision where it fits in ``new`` (the cost rule's
        gain of loading ``j`` pages does not depend on the pages after them, so its choice
        among fewer candidates that include it is the same), else the rule asked again on
        ``new``; and the decision's record."""
        if take > new:
            take = int(self._port.fetch_pages(new, covered))
        return take, self._port.fetch_decision()

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

    def _in_flight(
        self, tokens: np.ndarray, extra_key: Any, start: int
    ) -> tuple[PrefetchHandle | None, int, PrefetchHandle | None]:
        """The prefetch in flight to hand out for ``tokens``, else where a new one starts.

        Returns:
            ``(shared, pos, after)``: ``shared`` covers what L3 can give this prompt (see the
            module docstring); otherwise a new prefetch starts at ``pos``, chained after
            ``after`` (the last prefetch in flight along this prompt from ``start``, or None).
        """
        ps = self._ps
        pos, after = start, None
        for h in self.gets:  # issue order: a chain's links come in order
            if h._closed or h.extra_key != extra_key or h.start != pos:
                continue
            end = h.tokens.size
            n = min(end, tokens.size)
            if not np.array_equal(h.tokens[:n], tokens[:n]):
                continue
            if tokens.size <= end or (
                h._next_page is not None and np.array_equal(h._next_page, tokens[end : end + ps])
            ):
                return h, pos, after
            pos, after = end, h
        return None, pos, after

    def _start_get(
        self, base: TreeNode, keys: list[str], want: int, found: int
    ) -> tuple[Any, np.ndarray, np.ndarray] | None:
        """Reserve host and staging pages for up to ``want`` of ``keys`` and start the read
        (``base`` locked); None when no page could be had (nothing left behind)."""
        port = self._port
        port.lock(base)  # the attach point survives host eviction, ours included
        host_ids = sids = None
        try:
            host_ids = port.reserve_host_pages(want)
            # Host eviction (write_back) may have put evicted pages to L3, taking staging pages:
            # those keep them (they are cached data); the prefetch takes what is left.
            k = min(host_ids.size, self._staging_alloc.num_free)
            if k < host_ids.size:
                port.release_host_pages(host_ids[k:])
                host_ids = host_ids[:k]
            if k == 0:
                port.release_host_pages(host_ids)
                port.unlock(base)
                self._n["l3_prefetch_skipped_pages"] += found
                return None
            sids = self._staging_alloc.alloc(k)
            return self._backend.get_into(keys[:k], sids), host_ids, sids
        except BaseException:  # leave no lock, host page or staging page behind
            if host_ids is not None:
                port.release_host_pages(host_ids)
            if sids is not None:
                self._staging_alloc.free(sids)
            port.unlock(base)
            raise

    def before_match(self, tokens: np.ndarray, extra_key: Any) -> None:
        """Apply the prefetch policy to prefetches on the path of ``tokens``."""
        ps = self._ps
        for h in list(self.gets):
            # on the path: the prompt shares at least the first page this prefetch fetches
            if (
                h._closed
                or h.extra_key != extra_key
                or tokens.size < h.start + ps
                or not np.array_equal(h.tokens[: h.start + ps], tokens[: h.start + ps])
            ):
                continue
            self._policy.before_match(h, self._port.clock, self._n, self._group)
            self._advance(h)

    def _measure(self, h: PrefetchHandle) -> None:
        """A read seen done for the first time, every page intact: its time is a sample of the
        ``l3_l2`` link. "Now" is its end where a policy waited on it (``wait_complete``,
        ``timeout``); ``best_effort`` sees it at a later call: an upper bound."""
        if h._measured or h._timed_out or self._group.num_processes > 1 or not h.done():
            return  # several processes: a reading taken where this one alone sees the read
            # done would tick its agreed clock alone; the figure is for the cost policy, which
            # several processes refuse
        h._measured = True
        try:
            ok = h._get.wait(0)
        except StorageError:
            return
        if ok.all():
            self._port.observe_fetch(
                ok.size * self._port.spec.page_bytes, self._port.clock() - h._issued, h._decision
            )

    def _landed(self, h: PrefetchHandle) -> tuple[bool, int]:
        """This process's view of ``h``: read finished?, pages landed intact (leading run)."""
        done = h.done()
        try:
            ok = h._get.wait(0) if done else h._get.landed()
        except StorageError:
            ok = np.zeros(h.pages_found, bool)
        return done, leading(ok)

    def _advance(self, h: PrefetchHandle, seen: tuple[bool, int] | None = None) -> None:
        """Attach the pages of ``h`` that landed since the last call; close it once done.
        ``seen``: its (done, landed) agreed already (else agreed here)."""
        self._measure(h)
        if h._closed or (h._after is not None and not h._after._closed):
            return  # chained: its pages attach below the previous link's, once that is closed
        if seen is None:
            seen = tuple(self._group.agree_min("l3 landed", self._landed(h)))
        done, ready = bool(seen[0]), int(seen[1])
        if ready > h._applied:
            self._attach(h, ready)
        if done:
            rest = h._host_ids[h._applied :]
            self._port.release_host_pages(rest)
            self._n["l3_prefetch_missed_pages"] += rest.size
            self._staging_alloc.free(h._staging_ids)
            if isinstance(h._get, WindowedGet):
                h._get.release()
            self._port.unlock(h._node)
            h._applied, h._closed = h.pages_found, True
            outcome = _outcome(h, rest.size)
            if outcome is not None:
                self._n[outcome] += 1

    def _attach(self, h: PrefetchHandle, ready: int) -> None:
        """Pages ``[h._applied, ready)`` landed: copy them into their host pages and hang them in
        the tree root-first (see the module docstring)."""
        port, ps, lo = self._port, self._ps, h._applied
        begin, end = h.start + lo * ps, h.start + ready * ps
        port.match(h.tokens[:begin], h.extra_key)  # a node boundary where these pages start
        tm = port.match(h.tokens[:end], h.extra_key)  # ... and where they end
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
        parent = path[i - 1] if i else node  # node: the root
        if (
            covered < begin
            or pos != begin
            or (self._continuous and parent.parent is not None and parent.host_value is None)
        ):
            # What these pages hang under went (evicted since the earlier pages attached, or
            # the previous link came up short), or lost its host copy: nothing to attach to.
            self._give_up(h, lo, ready)
            return
        # page offsets in h; device nodes taking host copies
        take_spans: list[np.ndarray] = []
        dup_spans: list[np.ndarray] = []
        copies: list[tuple[TreeNode, np.ndarray]] = []
        for node in path[i:]:
            first = (pos - h.start) // ps
            span = np.arange(first, first + node.num_pages)
            pos += node.num_tokens
            if node.host_value is None and self._continuous:
                take_spans.append(span)
                copies.append((node, span))
            else:  # already backed up (or write_back: a device node needs no host copy)
                dup_spans.append(span)
        leaf_span = np.arange((covered - h.start) // ps, ready)
        take_spans.append(leaf_span)
        take = np.concatenate(take_spans)
        if dup_spans:
            dup = np.concatenate(dup_spans)
            port.release_host_pages(h._host_ids[dup])
            self._n["l3_prefetch_duplicate_pages"] += dup.size
        if take.size:
            port.write_host_pages(h._host_ids[take], self._staging, h._staging_ids[take])
        for node, span in copies:  # root-first: each under a backed-up parent
            port.attach_host_copy(node, h._host_ids[span])
            assert node.host_value is not None, "attach_host_copy gave it one"
            self._records.record(node.host_value, h._digests[span], node.page_hashes)
            self._n["l3_prefetch_backfill_pages"] += span.size
        if leaf_span.size:
            ids = h._host_ids[leaf_span]
            leaf = port.attach_host_leaf(tm.node, h.tokens[covered:end], ids, h.extra_key)
            self._records.record(ids, h._digests[leaf_span], leaf.page_hashes)
            self._n["l3_prefetch_hit_pages"] += leaf_span.size
        if isinstance(h._get, WindowedGet):
            spans = [span for _, span in copies]
            self._attach_windows(h, spans + ([leaf_span] if leaf_span.size else []))
        h._applied = ready

    def _attach_windows(self, h: PrefetchHandle, spans: list[np.ndarray]) -> None:
        """Each window group's landed pages to the host pages of the nodes whose pages are
        ``spans`` (offsets in ``h``, each a whole node, now in the tree): per node and group,
        the pages a continuation at the node's end reads, all or none (module docstring)."""
        assert isinstance(h._get, WindowedGet) and self._window_host is not None
        ps, base = self._ps, h.start // self._ps
        for part in h._get.parts:
            landed = part.landed()
            if self._group.num_processes > 1:  # landed on every process (MIN), like the rest
                agreed = self._group.agree_min("l3 window landed", landed.astype(int).tolist())
                landed = np.asarray(agreed).astype(bool)
            lo, hi = int(part.pages[0]), int(part.pages[-1]) + 1
            for span in spans:
                end = base + int(span[-1]) + 1  # the node's end, in pages from the root
                want = span[span >= kept_first_page(part.lane.group, end * ps, ps) - base]
                if not want.size:
                    continue
                if want[0] < lo or want[-1] >= hi or not landed[want - lo].all():
                    self._n["l3_window_prefetch_missed_pages"] += want.size
                    continue
                got = self._window_host.attach(
                    part.lane.g, h._host_ids[want], part.lane.staging, part.sids[want - lo]
                )
                self._n["l3_window_prefetch_hit_pages"] += got
                self._n["l3_window_prefetch_missed_pages"] += want.size - got

    def _give_up(self, h: PrefetchHandle, lo: int, ready: int) -> None:
        self._port.release_host_pages(h._host_ids[lo:ready])
        self._n["l3_prefetch_dropped_pages"] += ready - lo
        h._applied, h._revoked = ready, True
        h._get.cancel()

    def poll(self) -> None:
        """Attach landed pages of the prefetches whose reads are done (on every process: one
        agreement for all of them); drop closed ones."""
        if self._group.num_processes == 1:
            for h in self.gets:
                if h.done():
                    self._advance(h)
        elif self.gets:
            seen = self._group.agree_min(
                "l3 poll", [x for h in self.gets for x in self._landed(h)]
            ).reshape(-1, 2)
            for h, (done, ready) in zip(list(self.gets), seen.tolist()):
                if done:
                    self._advance(h, (done, ready))
        self.gets = [h for h in self.gets if not h._closed]

    def flush(self) -> None:
        """Wait for every prefetch in flight and apply it."""
        for h in self.gets:
            h.wait()
            self._advance(h)
        self.gets = []
