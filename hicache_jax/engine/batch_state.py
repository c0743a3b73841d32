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
from typing import Any, Callable, Hashable

import numpy as np

from hicache_jax.errors import OutOfPagesError
from hicache_jax.hicache import HiCache, Match
from hicache_jax.engine.engine import CacheMode, Generation, RequestRecord


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


class BatchRequest:
    """Scheduler state of one request (owned and mutated by its engine)."""

    def __init__(self, key: Hashable, prompt: np.ndarray, max_new: int, arrival: float) -> None:
        self.key, self.prompt, self.max_new, self.arrival = key, prompt, max_new, arrival
        self.seq = prompt              # prompt + generated tokens (re-admission prefills it)
        self.out: list[int] = []
        self.token_times: list[float] = []
        self.first_logits: np.ndarray | None = None
        self.admitted_at: float | None = None
        self.lock: Any = None          # NodeRef the request holds locked
        self.locked_len = 0            # tokens of the prefix that lock covers
        self.pages = np.zeros(0, np.int32)
        self.kv_done = 0               # positions whose K/V is in self.pages
        self.target = 0                # positions the current prefill computes
        self.handle: Any = None        # layer-wise load handle of the first chunk
        self.hits = None               # (l1, l2, declined) of the first admission
        self.recomputed = 0
        self.retractions = 0


class PageLedger:
    """The device pages and locks of a batched engine's requests (see the module doc).

    Args:
        cache: the engine's cache (the page allocator too in mode ``none``).
        mode: the engine's cache mode (``none``: no tree, pages are only allocated and freed).
        clock: the engine's time source (admission times).
    """

    def __init__(self, cache: HiCache, mode: CacheMode, clock: Callable[[], float]) -> None:
        self.cache, self.mode, self.clock = cache, mode, clock
        self.ps = cache.spec.page_size

    def take(self, req: BatchRequest, m: Match | None, active: list[BatchRequest],
             reserve: float) -> bool:
        """Allocate the prompt's uncached pages beyond ``m`` (locked by the caller), keeping
        ``reserve`` x the remaining decode pages of ``req`` and the ``active`` requests free or
        evictable; False (nothing taken) when they cannot be had now."""
        cache, ps = self.cache, self.ps
        prefix = np.zeros(0, np.int32) if m is None else m.device_pages
        target = req.seq.shape[0]
        need = -(-target // ps) - prefix.shape[0]
        future = self.future_pages(req, prefix.shape[0] + need)
        future += sum(self.future_pages(r) for r in active)
        if not self.fits(need + int(np.ceil(reserve * future))):
            return False
        try:
            new = cache.alloc_pages(need)
        except OutOfPagesError:
            return False
        if req.admitted_at is None:
            req.admitted_at = self.clock()
        req.lock = None if m is None else m.node
        req.locked_len = prefix.shape[0] * ps
        req.pages = np.concatenate([prefix, new]).astype(np.int32)
        req.kv_done = prefix.shape[0] * ps
        req.target = target
        req.handle = None if m is None else m.load_handle
        req.recomputed += target - req.kv_done
        return True

    def fits(self, pages: int) -> bool:
        """Whether ``pages`` device pages are free or evictable; copies in flight (whose locks
        hold pages until they land) are waited for before saying no."""
        st = self.cache.stats()
        if st["device_free_pages"] + st["device_evictable_pages"] >= pages:
            return True
        if not st["transfers_in_flight"]:
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
            needed=-(-req.seq.shape[0] // self.ps), free=st["device_free_pages"],
            evictable=st["device_evictable_pages"],
            locked=st["device_protected_pages"] + st["device_caller_pages"])

    def share_prompt(self, r: BatchRequest) -> None:
        """Insert the whole pages of a finished prefill and lock them (in place of the matched
        prefix), so requests admitted next hit them; a page another request inserted first
        replaces ours (the cache frees the duplicate)."""
        if self.mode is CacheMode.NONE:
            return
        full = r.target // self.ps
        if full * self.ps <= r.locked_len:
            return
        tokens = r.seq[:full * self.ps]
        self.cache.insert(tokens, r.pages[:full], chunked=True)
        m = self.cache.match_prefix(tokens)
        if m.device_len != full * self.ps:
            raise RuntimeError(f"inserted {full} pages but match_prefix finds {m.device_len} "
                               "tokens on device: the cache lost pages the request holds")
        self.cache.lock(m.node)
        self.cache.unlock(r.lock)
        r.lock, r.locked_len = m.node, full * self.ps
        r.pages = np.concatenate([m.device_pages, r.pages[full:]]).astype(np.int32)

    def finish(self, r: BatchRequest) -> Generation:
        """Release a request with all its tokens (its whole pages of prompt + output, minus the
        last token whose K/V is never computed, go to the tree) and return its Generation."""
        kv_len = r.prompt.shape[0] + r.max_new - 1
        full = kv_len // self.ps
        self.release(r, r.seq[:full * self.ps], full, chunked=False)
        l1, l2, declined = r.hits
        n = r.prompt.shape[0]
        t = r.token_times
        rec = BatchedRecord(
            prompt_tokens=n, device_hit_tokens=l1, host_hit_tokens=l2,
            host_declined_tokens=declined, recomputed_tokens=r.recomputed,
            output_tokens=len(r.out), ttft_s=t[0] - r.arrival, latency_s=t[-1] - r.arrival,
            key=r.key, arrival_s=r.arrival, queue_s=r.admitted_at - r.arrival,
            itl_s=tuple(float(b - a) for a, b in zip(t, t[1:])), retractions=r.retractions)
        return Generation(np.asarray(r.out, np.int32), r.first_logits, rec)

    def release(self, r: BatchRequest, tokens: np.ndarray, full: int, *, chunked: bool) -> None:
        """Insert ``tokens`` (whole pages) with the request's first ``full`` pages, free the
        rest, unlock: the request holds nothing after."""
        cache = self.cache
        if self.mode is CacheMode.NONE:
            own = r.pages
        else:
            if full:
                cache.insert(tokens, r.pages[:full], chunked=chunked)
            own = r.pages[full:]
        if own.size:
            cache.free_pages(own)
        if r.lock is not None:
            cache.unlock(r.lock)
        r.lock, r.pages, r.kv_done, r.locked_len = None, np.zeros(0, np.int32), 0, 0
