"""The batched engine's per-request state and its page bookkeeping against the cache.

:class:`BatchRequest` is one request's scheduler state; :class:`PageLedger` gives a request its
device pages and lock on admission (keeping the decode reserve), shares a finished prefill's
pages through the tree, and takes everything back when the request finishes or is retracted (its
whole computed pages go to the tree, the rest are freed, its lock released), so a request holds
nothing after :meth:`PageLedger.release`. The scheduler (:mod:`hicache_jax.engine.batched`)
decides who is admitted, decoded or retracted; this module only moves pages and locks.

Threading: the ledger and its requests belong to the engine's thread (the cache's owner).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.match import Match
from hicache_jax.cache.request import Request
from hicache_jax.engine.engine import CacheMode, Generation, RequestRecord, check_prompt
from hicache_jax.engine.packing import TokenSlots
from hicache_jax.errors import OutOfPagesError
from hicache_jax.validation import is_int


class EngineStalledError(OutOfPagesError):
    """Nothing is running and the oldest waiting request cannot get its device pages: every
    page is locked or owned outside the engine. Raised instead of waiting forever."""


@dataclasses.dataclass(frozen=True)
class BatchedRecord(RequestRecord):
    """A :class:`RequestRecord` of the batched engine; times from the request's arrival.

    Attributes (beyond RequestRecord's):
        key: the caller's key of the request.
        arrival_s: arrival, seconds since the engine's clock origin.
        queue_s: arrival -> first admission.
        itl_s: gaps between consecutive generated tokens (``output_tokens - 1`` of them).
        retractions: times the request was retracted and re-admitted.
    """

    key: Any = None
    arrival_s: float = 0.0
    queue_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    retractions: int = 0


_NO_TOKENS = np.zeros(0, np.int32)


class BatchRequest:
    """Scheduler state of one request (owned and mutated by its engine)."""

    def __init__(self, key: Hashable, prompt: np.ndarray, max_new: int, arrival: float) -> None:
        self.key, self.prompt, self.max_new, self.arrival = key, prompt, max_new, arrival
        self.seq = prompt  # prompt + generated tokens (re-admission prefills it)
        self.out: list[int] = []
        self.token_times: list[float] = []
        self.first_logits: np.ndarray | None = None
        self.admitted_at: float | None = None
        self.req: Request | None = None  # the cache's handle (its pages, its lock) while admitted
        self.locked_len = 0  # tokens of the prefix the tree holds locked for it
        self.pages = np.zeros(0, np.int32)
        self.kv_done = 0  # positions whose K/V is in self.pages
        self.target = 0  # positions the current prefill computes
        self.handle: Any = None  # layer-wise load handle of the first chunk
        self.hits: tuple[int, int, int] | None = None  # (l1, l2, declined), first admission
        self.recomputed = 0
        self.retractions = 0
        self.slot: int | None = None  # its TokenSlots slot while admitted
        self.pending = 0  # tokens sampled by dispatched forwards, not read yet
        #: A recurrent model's state and checkpoints (engine.Checkpoints) while admitted.
        self.recurrent: Any = None

    def add_token(self, tok: np.ndarray, now: float, logits: np.ndarray | None) -> None:
        """One sampled token (int32 ``[1]``) read from a dispatched forward at ``now``;
        ``logits``: the first token's, at the end of the prompt (None otherwise)."""
        self.pending -= 1
        self.out.append(int(tok[0]))
        self.seq = np.concatenate([self.seq, tok])
        self.token_times.append(now)
        if logits is not None:
            self.first_logits = logits


def shares_uncached(req: BatchRequest, cached: int, ps: int, others: list[BatchRequest]) -> bool:
    """Whether ``req``'s prompt beyond ``cached`` shares more than a page with one of
    ``others`` (prompts being prefilled or admitted this step: ``req`` then waits for those
    pages, SGLang's in-batch prefix check): whether the first ``cached + ps + 1`` tokens are
    the same, compared as bytes (the page right after ``cached`` first, where prompts part)."""
    k = cached + ps + 1
    if req.seq.shape[0] < k:
        return False
    tail, head = req.seq[cached:k].tobytes(), None
    for other in others:
        o = other.seq
        if o.shape[0] < k or o[cached:k].tobytes() != tail:
            continue
        head = req.seq[:cached].tobytes() if head is None else head
        if o[:cached].tobytes() == head:
            return True
    return False


class PageLedger:
    """The device pages and locks of a batched engine's requests (see the module doc).

    Args:
        cache: the engine's cache (the page allocator too in mode ``none``).
        mode: the engine's cache mode (``none``: no tree, pages are only allocated and freed).
        clock: the engine's time source (admission times).
        slots: the engine's device token slots: an admitted request holds one until released.
    """

    def __init__(
        self, cache: HiCache, mode: CacheMode, clock: Callable[[], float], slots: TokenSlots
    ) -> None:
        self.cache, self.mode, self.clock, self.slots = cache, mode, clock, slots
        self.ps = cache.spec.page_size
        self.changes = 0  # take / share_prompt / release calls so far (see refused_again)
        self._refused: tuple | None = None

    def request(
        self, prompt: Any, max_new: Any, key: Hashable, arrival: float | None, vocab_size: int
    ) -> BatchRequest:
        """A checked new request arriving at ``arrival`` (None: now). ValueError / TypeError
        for a malformed prompt or size, or one needing more device pages than the pool has
        (it could never be served)."""
        if not is_int(max_new) or max_new < 1:
            raise ValueError(f"max_new_tokens={max_new!r} must be an int >= 1")
        arr = check_prompt(prompt, vocab_size)
        pages = -(-(arr.size + int(max_new) - 1) // self.ps)
        if pages > self.cache.cfg.device_pages:
            raise ValueError(
                f"a request of {arr.size} prompt + {max_new} new tokens needs "
                f"{pages} device pages; the pool has {self.cache.cfg.device_pages}"
            )
        now = self.clock() if arrival is None else float(arrival)
        return BatchRequest(key, arr, int(max_new), now)

    def take(
        self,
        req: BatchRequest,
        h: Request | None,
        active: list[BatchRequest],
        reserve: float,
        checked: bool = False,
    ) -> bool:
        """Extend the admitted request's handle ``h`` (its prefix matched, loaded back and
        locked; None in mode ``none``: a handle of no prefix is begun here) over the prompt's
        uncached pages, keeping ``reserve`` x the remaining decode pages of ``req`` and the
        ``active`` requests free or evictable; False (nothing taken: ``h`` is still the
        caller's) when they cannot be had now. ``checked``: an :class:`AdmissionPlan` already
        counted this request's pages and reserve (no stats() read; only the allocation itself
        can still fail)."""
        cache, ps = self.cache, self.ps
        self.changes += 1
        held = 0 if h is None else h.device_pages.shape[0]
        target = req.seq.shape[0]
        need = -(-target // ps) - held
        if not checked:
            future = self.future_pages(req, held + need)
            future += sum(self.future_pages(r) for r in active)
            if not self.fits(need + math.ceil(reserve * future), wait=not active):
                return False
        own = h is None
        if h is None:  # mode none: a handle of no prefix only holds the request's pages
            h = cache.begin(_NO_TOKENS)
        try:
            h.extend(target - held * ps)
        except OutOfPagesError:
            if own:
                h.abort()
            return False
        if req.admitted_at is None:
            req.admitted_at = self.clock()
        req.req = h
        req.locked_len = h.tree_len
        req.pages = h.device_pages
        req.kv_done = held * ps
        req.target = target
        req.handle = h.load_handle
        req.recomputed += target - req.kv_done
        req.slot = self.slots.take()
        return True

    def refuse(self, req: BatchRequest, reserve: float) -> None:
        """Remember that ``req``, the oldest waiting request, did not get its pages while
        requests were active, at decode reserve ``reserve`` (see :meth:`refused_again`)."""
        self._refused = (req, self.changes, reserve)

    def refused_again(self, req: BatchRequest, reserve: float) -> bool:
        """Whether ``req`` was refused (:meth:`refuse`) at this reserve with no ledger change
        since: then it would be refused again, and admission skips its match and count (most
        steps under page pressure). Nothing else the engine does lets it fit: its other cache
        changes are decode pages, which take as many free or evictable pages as they take off
        the reserve (at most 1 a page); an eviction only shortens its match; a load-back's
        pages stay locked by its request. Pages a caller frees or unlocks outside the engine
        between steps count from the next ledger change."""
        r = self._refused
        return r is not None and r[0] is req and r[1:] == (self.changes, reserve)

    def fits(self, pages: int, wait: bool = True) -> bool:
        """Whether ``pages`` device pages are free or evictable; with ``wait``, loads in flight
        (whose locks hold pages until they land) are waited for before saying no. A caller
        with requests running does not wait: the loads land by a later step, which counts
        again (waiting here would wait for the forward in flight, queued before them)."""
        st = self.cache.stats()
        if st["device_free_pages"] + st["device_evictable_pages"] >= pages:
            return True
        if not (wait and st["transfers_in_flight"]):
            return False
        self.cache.flush()
        st = self.cache.stats()
        return st["device_free_pages"] + st["device_evictable_pages"] >= pages

    def future_pages(self, req: BatchRequest, held: int | None = None) -> int:
        """Pages ``req`` still needs to finish, holding ``held`` (default: its pages now)."""
        held = req.pages.shape[0] if held is None else held
        return max(0, -(-(req.prompt.shape[0] + req.max_new - 1) // self.ps) - held)

    def stalled_error(self, req: BatchRequest) -> EngineStalledError:
        """The error for ``req`` waiting on pages with nothing running (counts from stats())."""
        st = self.cache.stats()
        return EngineStalledError(
            f"request {req.key!r} ({req.seq.shape[0]} tokens) cannot get its device pages and "
            f"nothing is running: {st['device_free_pages']} free, "
            f"{st['device_evictable_pages']} evictable, {st['device_protected_pages']} locked, "
            f"{st['device_caller_pages']} owned by callers (unlock or free them)",
            needed=-(-req.seq.shape[0] // self.ps),
            free=st["device_free_pages"],
            evictable=st["device_evictable_pages"],
            locked=st["device_protected_pages"] + st["device_caller_pages"],
        )

    def share_prompt(self, r: BatchRequest) -> None:
        """Insert the whole pages of a finished prefill and lock them (in place of the matched
        prefix), so requests admitted next hit them; a page another request inserted first
        replaces ours (the cache frees the duplicate)."""
        if self.mode is CacheMode.NONE:
            return
        self.changes += 1
        full = r.target // self.ps
        if full * self.ps <= r.locked_len:
            return
        h = r.req
        assert h is not None  # an admitted request (release() is what drops its handle)
        h.commit(r.seq[: full * self.ps])  # a page inserted first by another replaces ours
        r.locked_len, r.pages = h.tree_len, h.device_pages

    def release_done(self, r: BatchRequest) -> None:
        """Release a request whose tokens are all computed or dispatched, once every token but
        the last is read (its whole pages of prompt + output minus the last token, whose K/V is
        never computed, go to the tree): the last token's forward may still be running, but
        every later reader of these pages is ordered after it on the device."""
        full = (r.prompt.shape[0] + r.max_new - 1) // self.ps
        self.release(r, r.seq[: full * self.ps], full, chunked=False)

    def finish(self, r: BatchRequest) -> Generation[BatchedRecord]:
        """A request with all its tokens read: released (:meth:`release_done`) unless it was
        already, and its Generation."""
        if r.slot is not None:  # not released yet
            self.release_done(r)
        # Set on its first admission, its first token's logits read with that token.
        assert r.hits is not None and r.admitted_at is not None and r.first_logits is not None
        l1, l2, declined = r.hits
        n = r.prompt.shape[0]
        t = r.token_times
        rec = BatchedRecord(
            prompt_tokens=n,
            device_hit_tokens=l1,
            host_hit_tokens=l2,
            host_declined_tokens=declined,
            recomputed_tokens=r.recomputed,
            output_tokens=len(r.out),
            ttft_s=t[0] - r.arrival,
            latency_s=t[-1] - r.arrival,
            key=r.key,
            arrival_s=r.arrival,
            queue_s=r.admitted_at - r.arrival,
            itl_s=tuple(float(b - a) for a, b in itertools.pairwise(t)),
            retractions=r.retractions,
        )
        return Generation(np.asarray(r.out, np.int32), r.first_logits, rec)

    def release(self, r: BatchRequest, tokens: np.ndarray, full: int, *, chunked: bool) -> None:
        """Insert ``tokens`` (whole pages) with the request's first ``full`` pages, free the
        rest, unlock: the request holds nothing after."""
        self.changes += 1
        if r.req is not None:
            if self.mode is CacheMode.NONE:
                r.req.abort()  # no tree: every page goes back
            else:
                r.req.finish(tokens[: full * self.ps], chunked=chunked)
        r.req = None
        if r.slot is not None:
            self.slots.give(r.slot)
        r.pages, r.kv_done, r.locked_len = np.zeros(0, np.int32), 0, 0
        r.slot, r.recurrent = None, None


class AdmissionPlan:
    """One step's count of who among the waiting requests gets device pages, decided BEFORE
    anything is loaded back, locked or allocated: a request that will wait moves no bytes and
    takes no L1 page (the scheduler tries requests oldest first and stops at the first refused).

    An admitted request holds ``ceil(len(seq) / page_size)`` pages: its matched device pages
    (locked: they stop being evictable) and new ones, whether its host part is loaded back or
    recomputed. The plan adds up what the admitted requests take -- new pages, plus matched
    device pages that no active request or earlier admission holds locked, minus host pages an
    earlier admission loads back for it -- and the decode reserve (as :meth:`PageLedger.take`
    reckons it), against free + evictable pages read once (``stats()``).

    The first request tried is counted exactly: its match is locked before that read (a lock
    held elsewhere, e.g. by a load in flight, is then not counted twice), and with no request
    active, loads in flight are waited for before refusing it, as :meth:`PageLedger.fits`
    does (with requests active it waits a step instead); refusing it is what
    :meth:`PageLedger.take` would do after its load-back. The later ones are counted
    conservatively (a page locked outside the engine counts as newly locked): a wrong estimate
    makes one wait a step, never over-commits. :meth:`release` drops the first request's lock
    once the scheduler has locked the load-back's results.

    Args:
        ledger: the engine's ledger (cache, page size, decode pages).
        active: requests prefilling or running (their locks, their remaining decode pages).
        reserve: the engine's current decode reserve fraction.
    """

    def __init__(self, ledger: PageLedger, active: list[BatchRequest], reserve: float) -> None:
        self.ledger, self.active, self.reserve = ledger, active, reserve
        self.future = sum(ledger.future_pages(r) for r in active)
        self.used = 0  # pages the admitted requests take from free + evictable
        self.avail = 0  # free + evictable pages (the first request's lock counted)
        self.admitted = 0
        self.held: Any = None  # NodeRef locked for the first request (see release)
        self._locked: set[int] = set()
        # (seq, device tokens, cached tokens) of admitted requests with a host part to load
        self._loads: list[tuple[np.ndarray, int, int]] = []

    def admit(self, req: BatchRequest, m: Match | None, cached: int) -> bool:
        """Count ``req`` (matched as ``m``; ``cached``: tokens it will not compute, host part
        included when over the load-back threshold) if it fits with those admitted before;
        False (nothing counted, nothing held) when it must wait."""
        ps = self.ledger.ps
        pages = -(-req.seq.shape[0] // ps)
        # (the resident pages too: the match's lock holds them, a load-back serves them)
        dev = [] if m is None else m.device_pages.tolist() + m.resident_pages.tolist()
        future = self.future + self.ledger.future_pages(req, pages)
        reserve = math.ceil(self.reserve * future)
        if self.admitted == 0:
            cost = pages - len(dev)
            if not self._first_fits(m, cost + reserve):
                return False
            self._locked.update(
                p for r in self.active for p in r.pages[: r.locked_len // ps].tolist()
            )
            self._locked.update(dev)
        else:
            fresh = [p for p in dev if p not in self._locked]
            cost = pages - len(dev) - self._loaded_for(req, len(dev) * ps, cached) + len(fresh)
            if self.used + cost + reserve > self.avail:
                return False
            self._locked.update(fresh)
        self.used += cost
        self.future = future
        self.admitted += 1
        if cached > len(dev) * ps:
            self._loads.append((req.seq, len(dev) * ps, cached))
        return True

    def _first_fits(self, m: Match | None, pages: int) -> bool:
        cache = self.ledger.cache
        if m is not None:
            cache.lock(m.node)
        st = cache.stats()
        avail = st["device_free_pages"] + st["device_evictable_pages"]
        if avail < pages and st["transfers_in_flight"] and not self.active:  # as fits()
            cache.flush()
            st = cache.stats()
            avail = st["device_free_pages"] + st["device_evictable_pages"]
        if avail < pages:
            if m is not None:
                cache.unlock(m.node)
            return False
        self.avail, self.held = avail, None if m is None else m.node
        return True

    def _loaded_for(self, req: BatchRequest, dev_len: int, cached: int) -> int:
        """Pages of ``req``'s host part that an earlier admission's load-back brings in (the
        same tree nodes: ``load_back_many`` loads an overlap once)."""
        if cached <= dev_len:
            return 0
        best = 0
        for seq, o_dev, o_cached in self._loads:
            if o_dev != dev_len:  # a shared host node has the same device part above it
                continue
            k = min(cached, o_cached)  # both prompts are longer than what they have cached
            diff = np.flatnonzero(req.seq[:k] != seq[:k])
            common = k if diff.size == 0 else int(diff[0])
            best = max(best, common // self.ledger.ps * self.ledger.ps - dev_len)
        return best // self.ledger.ps

    def release(self) -> None:
        """Drop the lock taken for the first request (after its load-back result is locked)."""
        if self.held is not None:
            self.ledger.cache.unlock(self.held)
            self.held = None
