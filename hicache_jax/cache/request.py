"""Request: one request's walk through the cache, as a handle (what serving loops call).

A serving stack's scheduler speaks in requests: admit one (match its prompt, load the host part
back, lock the prefix), give it device pages as it prefills and decodes, make its prompt
shareable once computed, and at the end cache what it computed and release the rest. The handle
does exactly the primitive calls (:meth:`HiCache.match_prefix`, :meth:`~HiCache.prepare`,
:meth:`~HiCache.load_back`,
:meth:`~HiCache.lock`, :meth:`~HiCache.alloc_pages`, :meth:`~HiCache.insert`,
:meth:`~HiCache.free_pages`, :meth:`~HiCache.unlock`) in the one order that leaks nothing:

```python
with cache.begin(prompt) as req:  # match + prepare + load_back + lock
    new = req.extend(len(prompt) - req.cached_len)  # device pages for the uncached part
    ...  # the model writes K/V into req.device_pages in place
    req.commit(prompt)  # the prompt's whole pages become shareable now
    new = req.extend(1)  # one more token (a new page at page boundaries)
    req.finish(all_tokens)  # insert the whole pages, unlock, free the rest
```

Leaving the block by an exception -- or without :meth:`Request.finish` -- aborts: nothing more is
inserted (what :meth:`Request.commit` inserted stays cached: it is a valid prefix), every page the
request still owns is freed and its lock released. :meth:`HiCache.begin_many` admits several
requests at once with one load-back transfer.

This module owns a request's life after admission (the handle: extend, commit, finish, abort)
and the scheduler-side helpers over handles (:func:`admit_matched`, :func:`extend_many`).
Admission itself (match, prepare, load back, lock) is the facade's (``HiCache.begin``,
``HiCache.begin_many``). The handle calls its cache through :class:`RequestCache`, the calls
it makes, not the facade's class (the facade imports this module).

Threading: the cache's thread only (a handle calls its cache).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from hicache_jax.cache.loading.overlap import OverlapCopy
from hicache_jax.cache.match import Match, NodeRef
from hicache_jax.errors import HiCacheError
from hicache_jax.spec import KVSpec
from hicache_jax.validation import check_int

__all__ = [
    "AdmittingCache",
    "Request",
    "RequestCache",
    "Served",
    "admit_matched",
    "extend_many",
    "served_of",
]

_EMPTY = np.zeros(0, np.int32)


@dataclass(frozen=True)
class Served:
    """Where a request's prompt was served from at admission (:attr:`Request.served`).

    The four token counts split the prompt: ``device_tokens + host_tokens + l3_tokens +
    recomputed_tokens == prompt_tokens``. ``stats()`` adds every admitted request's figures to
    its ``served_*`` counters (``served_device_tokens`` ...), so over the requests admitted by
    :meth:`HiCache.begin`, :meth:`HiCache.begin_many` and :func:`admit_matched` the
    per-request figures sum to them.

    Attributes:
        prompt_tokens: the prompt's tokens (a trailing partial page included).
        device_tokens: tokens on device when the request was matched (an L1 hit).
        host_tokens: tokens loaded back from host copies L2 made itself (backups), and the
            back of a two-ended split (``Request.overlap``), copied from host into the
            request's own pages.
        l3_tokens: tokens loaded back from host copies an L3 prefetch brought in and that no
            request had been served from since (``Match.l3_len``).
        recomputed_tokens: the prompt's other tokens, which the caller computes: its uncached
            rest, the host tokens the load-back declined (threshold, quota, no pages), the
            trailing partial page.
        load_bytes: bytes the load-back copied for this request (``(host_tokens + l3_tokens)
            / page_size`` pages); pages a load of the same step shares with an earlier
            request count for each.
        load_wait_s: wall seconds admission spent in the load-back (taking device pages,
            which may evict, and dispatching the copy; on XLA:CPU a small copy runs in the
            call). The copy itself may land later: reading the pages waits for it. With
            :meth:`HiCache.begin_many` every request of the step with host tokens reports
            the step's one load-back. 0.0 when nothing was on host.
    """

    prompt_tokens: int
    device_tokens: int
    host_tokens: int
    l3_tokens: int
    recomputed_tokens: int
    load_bytes: int
    load_wait_s: float


def loaded_len(before: Match, after: Match) -> int:
    """Tokens a load-back of ``before`` brought in (``after``: its result): what ``after``
    holds on device past what ``before`` held there (``Match.resident_len`` included)."""
    return max(0, after.device_len - before.device_len - before.resident_len)


def declined_len(before: Match, after: Match) -> int:
    """Tokens of ``before``'s match that its load-back (``after``) left off the device: its
    host part when declined (and ``resident_len`` with it, where the device part was cut back
    to what serves alone), none when loaded."""
    return max(0, before.device_len + before.host_len - after.device_len)


def served_of(
    prompt_tokens: int,
    before: Match,
    after: Match,
    page_bytes: int,
    page_size: int,
    load_wait_s: float = 0.0,
    overlap_tokens: int = 0,
) -> Served:
    """The :class:`Served` of a request whose prompt of ``prompt_tokens`` was matched as
    ``before`` and loaded back as ``after`` (``overlap_tokens``: a two-ended split's back)."""
    device = min(before.device_len + before.resident_len, after.device_len)
    l3 = after.l3_len
    host = after.device_len - device - l3 + overlap_tokens
    loaded = host + l3
    return Served(
        prompt_tokens,
        device,
        host,
        l3,
        prompt_tokens - device - loaded,
        loaded // page_size * page_bytes,
        load_wait_s if loaded or before.host_len else 0.0,
    )


class RequestCache(Protocol):
    """The calls a :class:`Request` handle makes on its cache (``HiCache`` is one)."""

    spec: KVSpec

    @property
    def closed(self) -> bool: ...

    def alloc_pages(self, n: int) -> np.ndarray: ...

    def free_pages(self, pages: Any) -> None: ...

    def insert(
        self,
        tokens: Any,
        pages: Any,
        extra_key: Hashable = None,
        *,
        chunked: bool = False,
        priority: int = 0,
    ) -> int: ...

    def insert_locked(
        self, tokens: Any, pages: Any, node: NodeRef, extra_key: Hashable = None
    ) -> Match: ...

    def unlock(self, node: NodeRef) -> None: ...


class AdmittingCache(RequestCache, Protocol):
    """A :class:`RequestCache` that :func:`admit_matched` also loads back and locks through."""

    def load_back_many(self, matches: Any, *, layerwise: bool = False) -> list[Match]: ...

    def lock(self, node: NodeRef) -> None: ...

    def record_served(self, served: Sequence[Served]) -> None: ...


class _State(enum.Enum):
    OPEN = "open"
    FINISHED = "finished"
    ABORTED = "aborted"


class Request:
    """A request admitted by :meth:`HiCache.begin` / :meth:`HiCache.begin_many`.

    Attributes (read-only):
        device_pages: int32 ``[k]`` the request's device pages so far, root first: the cached
            prefix's (locked, the tree's), then its own (from :meth:`extend`).
        cached_len: tokens of the prompt served from the cache at admission (on device after
            the load-back), a multiple of ``page_size``.
        loaded_len: of those, tokens loaded back from host for this request.
        host_len_declined: host-only tokens of the prompt not loaded (declined by the
            threshold or the quota, or no device pages): the caller recomputes them.
        num_tokens: tokens the pages hold room for: ``cached_len`` + what :meth:`extend` added.
        load_handle: with ``layerwise=True``, the load-back's handle (``wait_layer(l)``) or None.
        overlap: ``(start, end)`` where a two-ended split is in flight
            (cache/loading/overlap.py):
            ``[cached_len, start)`` is the request's to prefill first, ``[start, end)`` is being
            copied into its pages (:meth:`wait_overlap` before anything reads it), the rest is
            prefilled from ``end`` (= ``num_tokens`` at admission); else None.
        state: ``"open"``, ``"finished"`` or ``"aborted"``.
        served: where the prompt was served from (:class:`Served`: device, host and L3
            tokens, tokens recomputed, the load-back's bytes and wait), e.g. for a stack's
            per-request log.
    """

    def __init__(
        self,
        cache: RequestCache,
        extra_key: Hashable,
        match: Match,
        loaded: int,
        *,
        overlap: OverlapCopy | None = None,
        served: Served | None = None,
        declined: int | None = None,
    ) -> None:
        """A handle of ``match``, which the caller has loaded back and LOCKED (what
        :meth:`HiCache.begin` does; a scheduler with an admission plan of its own does the same
        and wraps the result). The handle then owns that lock: :meth:`finish` or :meth:`abort`
        releases it. ``loaded``: tokens of ``match`` the caller's load-back brought in.
        ``overlap``: a two-ended split's copy started for it (its pages become the request's
        own; :attr:`overlap` its span). ``served``: what admission measured (the cache's
        admission passes it); None: the figures ``match`` tells, its matched prefix taken as
        the prompt and no wait (not counted in ``stats()``). ``declined``: tokens of the
        caller's match that the load-back did not serve (:func:`declined_len`); None:
        ``match.host_len``."""
        self._cache, self._extra_key, self._ps = cache, extra_key, cache.spec.page_size
        self._node: NodeRef = match.node
        self._pages = np.asarray(match.device_pages, np.int32)
        self._own_from = self._pages.size  # pages before this index are the tree's (locked)
        self.cached_len = match.device_len
        self.loaded_len = loaded
        self.host_len_declined = match.host_len if declined is None else declined
        self.load_handle = match.load_handle
        self._len = match.device_len
        self._state = _State.OPEN
        self.overlap: tuple[int, int] | None = None
        self._overlap_copy = overlap  # the split's copy until acknowledged
        if overlap is not None:
            self._pages = np.concatenate([self._pages, overlap.pages]).astype(np.int32, copy=False)
            self.overlap, self._len = overlap.span, overlap.span[1]
        if served is None:
            host = loaded - match.l3_len
            served = Served(
                match.device_len + match.host_len,
                match.device_len - loaded,
                host,
                match.l3_len,
                match.host_len,
                loaded // self._ps * cache.spec.page_bytes,
                0.0,
            )
        self.served = served

    # -- reading -----------------------------------------------------------------------------

    @property
    def device_pages(self) -> np.ndarray:
        return self._pages.copy()

    @property
    def num_tokens(self) -> int:
        return self._len

    @property
    def tree_len(self) -> int:
        """Tokens of the request the tree holds, locked for it: the cached prefix at admission,
        what :meth:`commit` inserted since."""
        return self._own_from * self._ps

    @property
    def state(self) -> str:
        return self._state.value

    def __repr__(self) -> str:
        return (
            f"Request({self._state.value}, cached={self.cached_len}, tokens={self._len}, "
            f"pages={self._pages.size})"
        )

    # -- the walk ----------------------------------------------------------------------------

    def extend(self, n_tokens: int) -> np.ndarray:
        """Room for ``n_tokens`` more tokens: the new device pages it takes (int32, possibly
        none while the last page has room), owned by the request until :meth:`finish`.

        Raises:
            OutOfPagesError: not enough free + evictable pages; the request is as it was.
            HiCacheError: the request has ended.
        """
        self._check_open("extend")
        n_tokens = check_int("n_tokens", n_tokens)
        total = self._len + n_tokens
        need = -(-total // self._ps) - self._pages.size
        new = self._cache.alloc_pages(need) if need > 0 else _EMPTY
        self._pages = np.concatenate([self._pages, new]).astype(np.int32, copy=False)
        self._len = total
        return new

    def wait_overlap(self) -> None:
        """Wait for the copy of a two-ended split's back (:attr:`overlap`) and acknowledge it
        (its time is an L2 -> L1 sample); a no-op when none is in flight."""
        if self._overlap_copy is not None and not self._cache.closed:
            self._overlap_copy.wait()
        self._overlap_copy = None

    def commit(self, tokens: Any) -> int:
        """Insert the whole pages of ``tokens`` (the request's tokens so far, e.g. its prompt
        once prefilled) so that other requests hit them while this one decodes; the request's
        lock moves to the new deepest node. A page another request inserted first at the same
        position replaces this request's (which the cache frees). Counts no hit (as a chunk of
        a chunked prefill does).

        Returns:
            Tokens of the request now held by the tree (locked for it).

        Raises:
            ValueError / TypeError: ``tokens`` malformed, or longer than its pages hold.
            HiCacheError: the request has ended.
        """
        self._check_open("commit")
        full = self._whole_pages(tokens)
        self.wait_overlap()  # the tree takes no page a copy is still writing
        if full <= self._own_from:
            return self._own_from * self._ps
        m = self._cache.insert_locked(
            tokens[: full * self._ps], self._pages[:full], self._node, self._extra_key
        )
        self._pages = np.concatenate([m.device_pages, self._pages[full:]]).astype(np.int32)
        self._node, self._own_from = m.node, full
        return m.device_len

    def finish(self, tokens: Any, *, chunked: bool = False, priority: int = 0) -> int:
        """Cache the whole pages of ``tokens`` (everything the request computed: prompt and
        output), then free the pages beyond them (a partial last page, room never used) and
        release the lock. The request has ended.

        ``chunked``: the request stops here but will be served again (a scheduler retracting
        it): count no hit on the nodes it inserts into, as a chunk of a chunked prefill.

        Returns:
            Tokens that were already cached before the insert (:meth:`HiCache.insert`).

        Raises:
            ValueError / TypeError: ``tokens`` malformed or longer than its pages hold,
                before any change (the request stays open).
            HiCacheError: the request has ended already (finished or aborted).
        """
        self._check_open("finish")
        full = self._whole_pages(tokens)
        self.wait_overlap()  # the tree takes no page a copy is still writing
        cache = self._cache
        prefix = (
            cache.insert(
                tokens[: full * self._ps],
                self._pages[:full],
                self._extra_key,
                chunked=chunked,
                priority=priority,
            )
            if full
            else 0
        )
        self._own_from = max(full, self._own_from)
        self._release()
        self._state = _State.FINISHED
        return prefix

    def abort(self) -> None:
        """Release everything without inserting more: free the request's own pages, drop its
        lock. A no-op on a request that has ended, and on one whose cache was closed (closing
        released everything)."""
        if self._state is not _State.OPEN:
            return
        self._state = _State.ABORTED
        if not self._cache.closed:
            self._release()

    def __enter__(self) -> Request:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.abort()  # after finish() a no-op; otherwise nothing leaks

    # -- internals ---------------------------------------------------------------------------

    def _release(self) -> None:
        self.wait_overlap()  # a copy may still be writing the request's pages
        own = self._pages[self._own_from :]
        if own.size:
            self._cache.free_pages(own)
        self._cache.unlock(self._node)
        self._pages = self._pages[: self._own_from]

    def _check_open(self, what: str) -> None:
        if self._state is not _State.OPEN:
            raise HiCacheError(
                f"{what}() of a request that was {self._state.value}: begin a new request"
            )

    def _whole_pages(self, tokens: Any) -> int:
        n, room = len(tokens), self._pages.size * self._ps
        if n > room:
            raise ValueError(
                f"tokens has {n} tokens, but the request's pages hold room for "
                f"{room} (extend() first)"
            )
        return n // self._ps


def admit_matched(
    cache: AdmittingCache,
    matches: Sequence[Match],
    *,
    extra_keys: Sequence[Hashable] | None = None,
    layerwise: bool = False,
    prompt_lens: Sequence[int] | None = None,
) -> list[Request]:
    """Handles of requests a scheduler has already matched and decided to admit (with an
    admission plan of its own): their host parts loaded back in ONE transfer
    (:meth:`HiCache.load_back_many`, which revalidates every match), each result locked and
    wrapped. Each handle then owns its lock (``finish`` / ``abort`` release it).

    ``prompt_lens``: each request's prompt tokens, for :attr:`Request.served` (its
    ``recomputed_tokens`` then count the prompt's uncached rest); None: each match's prefix
    (matched tokens) taken as its prompt. Every handle's figures are added to ``stats()``."""
    keys = [None] * len(matches) if extra_keys is None else list(extra_keys)
    if len(keys) != len(matches):
        raise ValueError(f"extra_keys has {len(keys)} keys for {len(matches)} matches")
    lens = (
        [m.device_len + m.host_len for m in matches] if prompt_lens is None else list(prompt_lens)
    )
    if len(lens) != len(matches):
        raise ValueError(f"prompt_lens has {len(lens)} lengths for {len(matches)} matches")
    for i, (n, m) in enumerate(zip(lens, matches)):
        if check_int(f"prompt_lens[{i}]", n) < m.device_len + m.host_len:
            raise ValueError(
                f"prompt_lens[{i}]={n} is shorter than its match ({m.device_len + m.host_len} "
                "tokens): pass each request's whole prompt length"
            )
    t0 = time.perf_counter()
    loaded = cache.load_back_many(list(matches), layerwise=layerwise) if matches else []
    wait = time.perf_counter() - t0
    for lm in loaded:  # every result locked before anything may evict
        cache.lock(lm.node)
    ps, page_bytes = cache.spec.page_size, cache.spec.page_bytes
    served = [served_of(n, m, lm, page_bytes, ps, wait) for n, m, lm in zip(lens, matches, loaded)]
    cache.record_served(served)
    return [
        Request(cache, k, lm, loaded_len(m, lm), served=sv, declined=declined_len(m, lm))
        for k, m, lm, sv in zip(keys, matches, loaded, served)
    ]


def extend_many(cache: RequestCache, requests: Sequence[Request], n_tokens: Sequence[int]) -> None:
    """:meth:`Request.extend` of several requests (a scheduler's decode step) with ONE page
    allocation: ``requests[i]`` gets room for ``n_tokens[i]`` more tokens.

    Raises:
        OutOfPagesError: the pages of all of them cannot be had; every request as it was.
        HiCacheError / ValueError / TypeError: an ended request, a bad count; before any change.
    """
    if len(requests) != len(n_tokens):
        raise ValueError(f"{len(requests)} requests but {len(n_tokens)} token counts")
    needs = []
    for r, n in zip(requests, n_tokens):
        r._check_open("extend")
        n = check_int("n_tokens", n)
        needs.append((r, r._len + n, max(0, -(-(r._len + n) // r._ps) - r._pages.size)))
    new = cache.alloc_pages(sum(k for _, _, k in needs))
    at = 0
    for r, total, k in needs:
        r._pages = np.concatenate([r._pages, new[at : at + k]]).astype(np.int32, copy=False)
        r._len, at = total, at + k
