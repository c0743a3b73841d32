"""BatchedEngine: continuous batching over HiCache and the paged decoder (SGLang's scheduler shape).

Each :meth:`BatchedEngine.step`:

1. **admit** -- requests whose prefill is under way take their next chunk first; then waiting
   requests, oldest first, while the step's prefill token budget (``token_budget``: chunked
   prefill) and ``max_running`` allow: ``match_prefix`` (prompt minus its last token),
   ``cache.prepare`` (clean_ahead backs up what their pages will evict, as ``begin_many``;
   decode pages too), then ``admit_matched``: ONE ``load_back_many`` for their host parts,
   each result locked and wrapped in the cache's request handle, which ``extend``s over the
   prompt's uncached positions. A request that cannot get its pages while keeping
   ``decode_reserve`` x the running requests' remaining decode pages free (or evictable) waits,
   and so does every later one (first come, first served); who fits is counted before anything
   is loaded (``batch_state.AdmissionPlan``): a waiting request is not loaded back, locked or
   given pages. A request whose uncached prompt shares more than a page with one being
   prefilled waits for its pages to be inserted (SGLang's in-batch prefix check);
2. **pages for decode** -- a running request whose next position starts a page gets one; when
   even eviction cannot give them, running requests are **retracted** (fewest generated tokens
   first, as SGLang's ``retract_decode``): their computed pages are inserted, their lock
   released, and they go back to the front of the queue with the tokens generated so far
   (re-admission prefills prompt + those tokens, mostly cache hits). After a retraction the
   admission reserve is raised to 1 and decays back, as SGLang's ``new_token_ratio`` does;
3. **forward** -- one jitted step over this step's work, packed (``forward_batch``): the
   chunks of every admitted request (each through its own page table, cut into query blocks)
   and one token for every running request, so the weights are read once a step and the dense
   layers see no padding between requests; layer-wise over the load-back's handle when one is
   pending. A request whose prompt is done ``commit``s its whole pages (inserted, the lock
   moved onto them), so later requests hit them at once, and decodes from the next step;
4. **read** -- the tokens of the previous step's forward (``overlap``, the default: SGLang's
   overlap scheduler) or of this one: each request's next token and, at the end of a prompt,
   its first-token logits. A decode row never waits for the host: it reads its token from the
   request's device token slot (``packing.TokenSlots``), where the forward that sampled it wrote
   it, so step N+1 is dispatched while step N computes, and the host's scheduling and
   bookkeeping (this list) run meanwhile. A request with all its tokens dispatched leaves the
   running set at once;
5. **finish** -- once every token but the last is read (the last one's forward may still run),
   a request ``finish``es: the whole pages of prompt + output (minus its last token, whose K/V
   is never computed) are inserted, the partial page freed and the lock released, so the next
   admission has its pages; it is returned once its last token is read.

Every pool write and read of a step is ordered on the device after the steps dispatched before
it (the pool is donated from step to step), so a page released or re-used on the host while a
step is in flight is never read before that step's writes. When decode pages run out, the
tokens in flight are read (finished requests give their pages back) before anyone is retracted.

No request is refused for lack of pages: it waits while others run. When nothing runs or is in
flight and the oldest waiting request still cannot get its pages (every page locked or owned
outside the engine), :class:`~hicache_jax.engine.batch_state.EngineStalledError` says so instead
of spinning. Requests that could never fit the device pool are refused at :meth:`submit`.

Modes as :class:`~hicache_jax.engine.engine.Engine`: ``none`` (pages per request, no tree),
``device`` (L1 radix), ``hicache`` (L1 + L2).

A model with recurrent layers (``layer_pattern="R3:F1"``) runs a step's prefill chunks in one
call and its decode rows in another (``DecoderModel.forward_recurrent_rows``: rows padded to
the longest chunk, not packed as ``forward_batch`` packs), each request over its own state: a
copy of the checkpoint at its cached prefix, taken at admission with the checkpoint positions
(asked before its pages are taken), the prefill's checkpoints written from its chunk-boundary
states before ``commit`` inserts their pages, decode's last one before ``finish`` does
(:class:`~hicache_jax.engine.engine.Checkpoints`). Its prefill chunks are whole chunks of the
recurrent layers (``DecoderModel.recurrent_chunk``) but the last; its loads are whole (no
layer-wise wait); its prefills feed the cost model no samples.

The request state and its pages and locks (admission's allocation, a prefill's shared pages,
release on finish or retraction) are in :mod:`hicache_jax.engine.batch_state`; this module is the
scheduler: queues, admission order, batches, retraction choice, and the timing of its forwards
that feeds the cost model prefill samples (:class:`PrefillTimer`).

Threading: an engine and its cache belong to the thread that calls ``submit`` / ``step``.
"""

from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.match import Match, held_pages
from hicache_jax.cache.request import Request, admit_matched, extend_many
from hicache_jax.engine.batch_state import (
    AdmissionPlan,
    BatchedRecord,
    BatchRequest,
    PageLedger,
    shares_uncached,
)
from hicache_jax.engine.engine import (
    CacheMode,
    Checkpoints,
    Generation,
    build_cache,
    check_spec,
    parse_mode,
    recurrent_window_args,
    window_args,
)
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import TokenSlots, bucket
from hicache_jax.engine.workloads import Arrival, ArrivalProcess
from hicache_jax.errors import OutOfPagesError
from hicache_jax.validation import check_bool, is_int, is_real

__all__ = ["BatchedEngine", "PrefillTimer"]

_RESERVE_DECAY = 0.02  # per step, back from 1 to decode_reserve after a retraction
_PLACEHOLDER = np.zeros(1, np.int32)  # a decode chunk whose token is read from its slot


class _Knobs(TypedDict):
    """The packing arguments every step gives ``forward_batch`` / ``batch_shape``."""

    query_block: int
    key_block: int
    min_pages: int
    min_batch: int
    slots: TokenSlots


class BatchedEngine:
    """Serve requests with continuous batching (see the module doc).

    Args:
        model: the decoder; its KV layout must match ``cache.spec``.
        cache: the page cache (also the page allocator in mode ``none``).
        mode: "none" | "device" | "hicache".
        token_budget: prefill tokens per step (a power of two; longer prompts are chunked).
        max_running: requests prefilling or decoding at once (>= 1).
        layerwise: without ``overlap``, load back layer by layer (the forward waits per layer;
            ``forward_batch(layerwise_if_compiled=True)``). With it, a step goes at once: XLA
            orders it after its load, which lands after the step in flight.
        query_block: prefill chunks are cut into blocks of this many tokens (a power of two),
            each an attention row with its request's page table (the dense layers see the
            step's tokens packed, without padding between requests); compiles are bounded by
            the token, row and work-item buckets.
        key_block: tokens of a key block (rounded down to whole pages, at least one): each
            attention row runs over its request's keys in blocks of this size, only up to its
            last query (``forward_batch(key_block=...)``: split-K, no padding to the step's
            longest row).
        table_bucket: smallest bucket, in pages, of a row group's key blocks (a power of two).
        batch_bucket: smallest bucket of a step's packed tokens (a power of two).
        decode_reserve: fraction (in [0, 1]) of the active requests' remaining decode pages
            an admission keeps free or evictable; 1 never retracts, 0 admits greedily.
        compile_mixed: compile a new prefill + decode step shape when one comes up (True, the
            default: while warming up). Off (steady serving, after a warm-up), a step without
            an executable runs padded into a compiled shape that holds it (within
            ``model.REUSE_COST_LIMIT`` x its work), else a mixed one as a prefill step and a
            decode step: mixed shapes are many (prefill tokens x rows x decode rows x pages),
            the two parts' few, and a compile stalls every running request (~0.9 s on CPU).
            Settable at any time.
        overlap: dispatch each step before reading the previous step's tokens (see 4.
            above): :meth:`step` then returns a request one call after its last forward. Off:
            each step's tokens are read before :meth:`step` returns.
        clock: time source (seconds).

    Raises:
        ValueError: model and cache disagree, or a bad size / fraction.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: HiCache,
        *,
        mode: CacheMode | str = "hicache",
        token_budget: int = 512,
        max_running: int = 64,
        layerwise: bool = True,
        query_block: int = 32,
        key_block: int = 64,
        table_bucket: int = 1,
        batch_bucket: int = 1,
        decode_reserve: float = 1.0,
        compile_mixed: bool = True,
        overlap: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.mode = parse_mode(mode)
        if not isinstance(model, DecoderModel):
            raise TypeError(f"model must be a DecoderModel, got {type(model).__name__}")
        if not isinstance(cache, HiCache):
            raise TypeError(f"cache must be a HiCache, got {type(cache).__name__}")
        spec, want = cache.spec, model.kv_spec(cache.spec.page_size)
        check_spec(spec, want)
        for name, value in (
            ("token_budget", token_budget),
            ("query_block", query_block),
            ("key_block", key_block),
            ("table_bucket", table_bucket),
            ("batch_bucket", batch_bucket),
        ):
            if not is_int(value) or value < 1 or bucket(value) != value:
                raise ValueError(f"{name}={value!r} must be a power of two >= 1")
        if not is_int(max_running) or max_running < 1:
            raise ValueError(f"max_running={max_running!r} must be an int >= 1")
        if not is_real(decode_reserve) or not 0.0 <= decode_reserve <= 1.0:
            raise ValueError(f"decode_reserve={decode_reserve!r} must be a number in [0, 1]")
        check_bool("layerwise", layerwise)
        check_bool("compile_mixed", compile_mixed)
        check_bool("overlap", overlap)
        if not callable(clock):
            raise TypeError(f"clock must be callable, got {type(clock).__name__}")
        self.model, self.cache, self.pool = model, cache, cache.device_pool
        self.ps = spec.page_size
        self.token_budget, self.max_running = token_budget, max_running
        self.query_block, self.key_block = min(query_block, token_budget), key_block
        self.table_bucket, self.batch_bucket = table_bucket, batch_bucket
        self.layerwise, self.decode_reserve = bool(layerwise), float(decode_reserve)
        self.compile_mixed, self.overlap = bool(compile_mixed), bool(overlap)
        # (see layerwise; a recurrent model loads back whole: its rows run one by one)
        self._layer_waits = self.layerwise and not self.overlap and not model.recurrent
        #: A recurrent model's prefill chunks are whole chunks of its recurrent layers
        #: (``DecoderModel.recurrent_chunk``) until the last: each starts at a chunk boundary.
        self._align = model.recurrent_chunk(self.ps) if model.recurrent else 1
        if token_budget < self._align:
            raise ValueError(
                f"token_budget={token_budget} is below the recurrent layers' chunk "
                f"({self._align} tokens): no prefill chunk would fit"
            )
        self.clock = clock
        self._pending: list = []  # dispatched forwards whose tokens are not read yet
        self._timer = PrefillTimer(model, cache)  # prefill samples for the cost model
        self._closing: list[BatchRequest] = []  # every token dispatched, not all read yet
        self._finished: list[Generation[BatchedRecord]] = []
        self._reserve = self.decode_reserve
        self.waiting: collections.deque[BatchRequest] = collections.deque()
        self.prefilling: list[BatchRequest] = []
        self.running: list[BatchRequest] = []
        self.records: list[BatchedRecord] = []
        self._ledger = PageLedger(cache, self.mode, clock, TokenSlots(max_running))
        self.slots = self._ledger.slots
        self.counters: collections.Counter[str] = collections.Counter()

    @classmethod
    def create(
        cls,
        model: DecoderModel,
        mode: CacheMode | str,
        *,
        page_size: int = 16,
        device_pages: int = 1024,
        host_pages: int | None = None,
        write_policy: str = "clean_ahead",
        load_policy: str = "threshold",
        **engine_kwargs: Any,
    ) -> BatchedEngine:
        """Build the cache for ``mode`` (as :meth:`Engine.create`) and the engine over it."""
        mode = parse_mode(mode)
        cache = build_cache(
            model, mode, page_size, device_pages, host_pages, write_policy, load_policy
        )
        return cls(model, cache, mode=mode, **engine_kwargs)

    # -- requests in, results out ------------------------------------------------------------

    def submit(
        self,
        prompt: Any,
        max_new_tokens: int,
        *,
        key: Hashable = None,
        arrival: float | None = None,
    ) -> None:
        """Queue a request (served by later :meth:`step` calls).

        Raises:
            ValueError / TypeError: malformed prompt or size, or a request that needs more
                device pages than the pool has (it could never be served).
        """
        vocab = self.model.cfg.vocab_size
        self.waiting.append(self._ledger.request(prompt, max_new_tokens, key, arrival, vocab))

    def generate(
        self, prompts: Sequence[Any], max_new_tokens: int
    ) -> list[Generation[BatchedRecord]]:
        """Serve ``prompts`` (all arriving now) to completion; one Generation each, in order."""
        vocab = self.model.cfg.vocab_size
        reqs = [
            self._ledger.request(p, max_new_tokens, i, None, vocab) for i, p in enumerate(prompts)
        ]
        self.waiting.extend(reqs)
        done: dict[Any, Generation[BatchedRecord]] = {}
        while len(done) < len(reqs):
            for gen in self.step():
                done[gen.record.key] = gen
        return [done[i] for i in range(len(reqs))]

    def serve(self, arrivals: ArrivalProcess) -> list[Generation[BatchedRecord]]:
        """Run an arrival process to completion in real time; Generations in finish order.

        Arrival times are offsets from the call; a request arriving while the engine is idle
        is waited for (``time.sleep``)."""
        t0 = self.clock()
        heap: list[tuple[float, int, Arrival]] = []
        seq = 0

        def push(items: Iterable[Arrival]) -> None:
            nonlocal seq
            for a in items:
                heapq.heappush(heap, (a.at, seq, a))
                seq += 1

        push(arrivals.initial())
        out: list[Generation[BatchedRecord]] = []
        while heap or self.busy:
            now = self.clock() - t0
            while heap and heap[0][0] <= now:
                a = heapq.heappop(heap)[2]
                self.submit(a.prompt, a.max_new_tokens, key=a.key, arrival=t0 + a.at)
            if not self.busy:
                time.sleep(max(0.0, heap[0][0] - now))
                continue
            for gen in self.step():
                out.append(gen)
                push(arrivals.on_done(gen.record.key, gen.tokens, self.clock() - t0))
        return out

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._pending)

    # -- one scheduler step ------------------------------------------------------------------

    def step(self) -> list[Generation[BatchedRecord]]:
        """Admit, then one packed forward: the admitted chunks' prefill and one token for every
        running request; returns the requests whose last token reached the host in this call
        (with ``overlap``: the previous forward's, read after this one is dispatched)."""
        self._reserve = max(self.decode_reserve, self._reserve - _RESERVE_DECAY)
        finished: list[Generation[BatchedRecord]] = []
        self._finished = finished
        batch = self._admit()
        # A running request whose next position starts a page gets one (else retractions).
        decoding = self._grow_pages(list(self.running)) if self.running else []
        prev, self._pending = self._pending, []
        if batch or decoding:
            self._forward(batch, decoding)
        if not self.overlap:
            prev, self._pending = prev + self._pending, []
        self._drain(prev)
        self.counters["steps"] += 1
        return finished

    def _admit(self) -> list[tuple[BatchRequest, int]]:
        """(request, chunk tokens) of this step's prefill batch; see the module doc."""
        budget, batch = self.token_budget, []
        for req in self.prefilling:  # chunks of prefills under way go first
            n = self._chunk(req, budget)
            if n == 0:
                break
            batch.append((req, n))
            budget -= n
        cands = self._candidates(budget, batch)
        if cands:
            self._admit_candidates(cands, batch, budget)
        if not batch and not self.running and not self._pending and self.waiting:
            self._stalled()
        return batch

    def _candidates(self, budget: int, batch: list) -> list[tuple[BatchRequest, Match | None]]:
        """Waiting requests admitted this step, oldest first, with their matches: matched one
        at a time and counted by an :class:`AdmissionPlan` before anything is loaded, stopping
        at the first that cannot get its pages (it and every later one wait, unloaded); those
        deferred by the in-batch prefix check stay queued. The oldest, refused with requests
        active, is not tried again until it could fit (``PageLedger.refused_again``)."""
        cands: list[tuple[BatchRequest, Match | None]] = []
        room = (
            self.max_running
            - len(self.prefilling)
            - len(self.running)
            - sum(r.slot is not None for r in self._closing)
        )
        if not self.waiting or budget <= 0 or room <= 0:
            return cands
        if self._ledger.refused_again(self.waiting[0], self._reserve):
            self.counters["admission_skips"] += 1
            return cands
        plan = AdmissionPlan(self._ledger, self.prefilling + self.running, self._reserve)
        skipped = []
        try:
            while self.waiting and budget > 0 and len(cands) < room:
                req = self.waiting[0]
                m = None
                cached = 0
                if self.mode is not CacheMode.NONE:
                    m = self.cache.match_prefix(req.seq[:-1])
                    cached = m.device_len + (
                        m.host_len if m.host_len >= self.cache.cfg.load_back_threshold else 0
                    )
                    if shares_uncached(
                        req, cached, self.ps, self.prefilling + [c for c, _ in cands]
                    ):
                        skipped.append(self.waiting.popleft())
                        continue
                if not plan.admit(req, m, cached):
                    if not (cands or skipped) and plan.active:
                        self._ledger.refuse(req, self._reserve)
                    break
                cands.append((self.waiting.popleft(), m))
                budget -= min(req.seq.shape[0] - cached, budget)
        finally:
            # Nothing evicts before load_back_many, which holds every match it is given while it
            # takes pages: the first request's lock (an exact count) is no longer needed.
            plan.release()
        self.waiting.extendleft(reversed(skipped))
        return cands

    def _admit_candidates(self, cands: list, batch: list, budget: int) -> None:
        """Load back every candidate's host part in one call (which also revalidates every
        match), lock them all before anything may evict, then allocate in order; the first that
        cannot get its pages (or budget) waits with every later one."""
        handles: list = [None] * len(cands)
        cached = self.mode is not CacheMode.NONE
        if cached:
            if any(m.host_len for _, m in cands):
                self.counters["load_back_calls"] += 1
            self.cache.prepare(
                [m for _, m in cands],
                sum(  # pages beyond the matches'
                    -(-r.seq.shape[0] // self.ps) - held_pages(m) for r, m in cands
                ),
            )
            handles = admit_matched(
                self.cache,
                [m for _, m in cands],
                layerwise=self._layer_waits,
                prompt_lens=[r.seq.shape[0] - 1 for r, _ in cands],  # what was matched
            )
        for k, ((req, _), h) in enumerate(zip(cands, handles)):
            ok = budget > 0 and self._take_pages(req, h, checked=True)
            if budget > 0 and not ok:  # the plan counted pages the allocation did not find
                self.counters["admission_plan_misses"] += 1
            last = False
            if not ok and budget > 0 and k + 1 < len(cands):
                # The later candidates' locks may be what holds the pages: release them (they
                # wait) and try this one once more.
                for later in handles[k + 1 :] if cached else ():
                    later.abort()
                self.waiting.extendleft(reversed([r for r, _ in cands[k + 1 :]]))
                ok, last = self._take_pages(req, h), True
            if not ok:
                if cached:
                    h.abort()
                self.waiting.extendleft(
                    reversed([r for r, _ in cands[k : k + 1 if last else None]])
                )
                return
            if req.hits is None:  # the first admission's hits by tier (as the serial engine)
                req.hits = (
                    (0, 0, 0)
                    if h is None
                    else (h.cached_len - h.loaded_len, h.loaded_len, h.host_len_declined)
                )
            n = self._chunk(req, budget)
            if n:  # (else its first chunk goes next step: a recurrent model's whole chunks)
                batch.append((req, n))
            budget -= n
            self.prefilling.append(req)
            if last:
                return

    def _chunk(self, req: BatchRequest, budget: int) -> int:
        """Tokens of ``req``'s next prefill chunk within ``budget``: a recurrent model's a
        multiple of its chunk unless it is the prompt's last."""
        n = min(req.target - req.kv_done, budget)
        return n if n == req.target - req.kv_done else n // self._align * self._align

    def _take_pages(self, req: BatchRequest, h: Request | None, checked: bool = False) -> bool:
        positions = None
        if self.model.recurrent and h is not None:
            # Asked before its pages are taken (which may evict the tree's pages past the
            # match, the branch point with them): see engine.Checkpoints.
            positions = self.cache.checkpoint_positions(req.seq, h.cached_len)
        if not self._ledger.take(req, h, self.prefilling + self.running, self._reserve, checked):
            return False
        if self.model.recurrent:  # its state: a copy of the checkpoint at its cached prefix
            req.recurrent = Checkpoints(
                self.cache,
                self.model,
                req.pages,
                req.seq,
                req.kv_done,
                req.prompt.shape[0] + req.max_new - 1,
                positions,
            )
        return True

    def _stalled(self, req: BatchRequest | None = None) -> None:
        raise self._ledger.stalled_error(self.waiting[0] if req is None else req)

    # -- the forward steps -------------------------------------------------------------------

    def _forward(self, batch: list[tuple[BatchRequest, int]], decoding: list[BatchRequest]) -> None:
        """Dispatch one jitted step over this step's prefill chunks and decode tokens
        (layer-wise when a load-back is pending) and do the bookkeeping that does not need its
        tokens (:meth:`_dispatched`); the tokens are read by :meth:`_drain`. Decode tokens come
        from the requests' device token slots (the previous step's, which the host may not
        have yet). With ``compile_mixed`` off, a mixed step whose shapes have no executable
        runs as a prefill step and a decode step (shapes of far fewer kinds, which a warm-up
        covers): no compile in steady serving."""
        if self.model.recurrent:
            self._forward_recurrent(batch, decoding)
            return
        waiter = next((r.handle for r, _ in batch if r.handle is not None), None)
        pre = [r.seq[r.kv_done : r.kv_done + n] for r, n in batch]
        dec = [_PLACEHOLDER] * len(decoding)  # read from the slots on the device
        knobs = _Knobs(
            query_block=self.query_block,
            key_block=self.key_block,
            min_pages=self.table_bucket,
            min_batch=self.batch_bucket,
            slots=self.slots,
        )
        parts = [(batch, decoding)]
        if batch and decoding and not self.compile_mixed:
            starts = [r.kv_done for r, _ in batch] + [r.kv_done for r in decoding]
            if not self.model.batch_compiled(
                self.model.batch_shape(
                    self.pool,
                    pre + dec,
                    starts,
                    [r.pages for r, _ in batch] + [r.pages for r in decoding],
                    **knobs,
                ),
                reuse=True,
            ):
                parts = [(batch, []), ([], decoding)]
        for part_batch, part_dec in parts:
            chunks = (pre if part_batch else []) + (dec if part_dec else [])
            reqs = [r for r, _ in part_batch] + part_dec
            sample = self._timer.dispatch(self.pool, part_batch, part_dec, chunks, reqs, knobs)
            windows = {}
            if self.cache.spec.window_groups:  # asked each step: inserts drop window pages
                ends = [r.kv_done + n for r, n in part_batch] + [r.kv_done + 1 for r in part_dec]
                windows = {
                    "windows": self.cache.window_pools,
                    "window_pages": [
                        window_args(self.cache, r.pages, -(-e // self.ps))["window_pages"]
                        for r, e in zip(reqs, ends)
                    ],
                }
            logits, toks = self.model.forward_batch(
                self.pool,
                chunks,
                [r.kv_done for r in reqs],
                [r.pages for r in reqs],
                **windows,
                waiter=waiter if self._layer_waits and part_batch else None,
                layerwise_if_compiled=True,
                reuse_compiled=not self.compile_mixed,
                slot_of=[r.slot for r in reqs],
                from_slot=[False] * len(part_batch) + [True] * len(part_dec),
                **knobs,
            )
            self._pending.append((logits, toks, self._dispatched(part_batch, part_dec), sample))

    def _recurrent_windows(self, rows: list[tuple[BatchRequest, int]]) -> dict[str, Any]:
        """The window pools and each row's window pages (over its positions up to the end
        given) of a three-kind pattern's step (``recurrent_window_args``); none for
        ``R3:F1``. Asked each step: inserts drop window pages."""
        args = [recurrent_window_args(self.cache, r.pages, end) for r, end in rows]
        if not args or not args[0]:
            return {}
        return {"windows": args[0]["windows"], "window_pages": [a["window_pages"] for a in args]}

    def _forward_recurrent(
        self, batch: list[tuple[BatchRequest, int]], decoding: list[BatchRequest]
    ) -> None:
        """:meth:`_forward` of a model with recurrent layers: the prefill chunks in one step
        and the decode rows in another (``forward_recurrent_rows``: rows padded to the
        longest chunk, not packed), each over its own state (``BatchRequest.recurrent``: a
        copy of the checkpoint at its cached prefix, taken at admission; the prefill's
        checkpoints and the decode's last one written as the serial engine does, before
        ``share_prompt`` / ``finish`` insert their pages); the rows' tokens sampled on the
        device and written to their slots, as a packed step does."""
        parts = []
        knobs: dict[str, Any] = dict(min_pages=self.table_bucket, min_batch=self.batch_bucket)
        if batch:  # every prefill chunk in one step
            ckpts: list[Checkpoints] = []
            for r, _ in batch:
                assert r.recurrent is not None and r.slot is not None  # set at admission
                ckpts.append(r.recurrent)
            logits, toks, states, bounds, chunk = self.model.forward_recurrent_rows(
                self.pool,
                [r.seq[r.kv_done : r.kv_done + n] for r, n in batch],
                [r.kv_done for r, _ in batch],
                [r.pages for r, _ in batch],
                [c.state for c in ckpts],
                self.slots,
                [r.slot for r, _ in batch if r.slot is not None],
                **self._recurrent_windows([(r, r.kv_done + n) for r, n in batch]),
                min_bucket=self.query_block,
                **knobs,
            )
            for (r, n), ckpt, state, bound in zip(batch, ckpts, states, bounds):
                ckpt.state = state
                ckpt.prefilled(r.kv_done, r.kv_done + n, bound, chunk, r.pages)
            parts.append((logits, toks, len(batch)))
        if decoding:  # every decode row in one step, its token read from its slot
            ckpts = []
            for r in decoding:
                assert r.recurrent is not None and r.slot is not None  # an admitted request
                ckpts.append(r.recurrent)
            logits, toks, states, _, _ = self.model.forward_recurrent_rows(
                self.pool,
                None,
                [r.kv_done for r in decoding],
                [r.pages for r in decoding],
                [c.state for c in ckpts],
                self.slots,
                [r.slot for r in decoding if r.slot is not None],
                **self._recurrent_windows([(r, r.kv_done + 1) for r in decoding]),
                **knobs,
            )
            for r, ckpt, state in zip(decoding, ckpts, states):
                ckpt.state = state
                ckpt.decoded(r.kv_done + 1, state, r.pages)
            parts.append((logits, toks, len(decoding)))
        if len(parts) == 1:
            logits, toks, _ = parts[0]
        else:
            (la, ta, na), (lb, tb, _) = parts
            logits, toks = _concat_rows(la[:na], ta[:na], lb, tb)
        self._pending.append((logits, toks, self._dispatched(batch, decoding), None))

    def _dispatched(
        self, batch: list[tuple[BatchRequest, int]], decoding: list[BatchRequest]
    ) -> list[tuple[int, BatchRequest, bool]]:
        """What a dispatched forward settles before its tokens are read: positions computed; a
        finished prompt shares its pages (later requests hit them at once) and decodes next
        step; a request with all its tokens dispatched leaves the running set. Returns the rows
        to read, ``(row, request, wants first-token logits)``: the prefill chunks', then one per
        decoding request."""
        self.counters["forward_calls"] += 1
        rows = []
        if batch:
            self.counters["prefill_batches"] += 1
            self.counters["prefill_tokens"] += sum(n for _, n in batch)
        for i, (r, n) in enumerate(batch):
            r.kv_done += n
            r.handle = None
            if r.kv_done != r.target:
                continue
            self.prefilling.remove(r)
            r.pending += 1
            rows.append((i, r, r.first_logits is None))
            if len(r.out) + r.pending == r.max_new:
                self._closing.append(r)
            else:
                self._ledger.share_prompt(r)
                self.running.append(r)
        if decoding:
            self.counters["decode_batches"] += 1
            self.counters["decode_tokens"] += len(decoding)
        for i, r in enumerate(decoding, start=len(batch)):
            r.kv_done += 1
            r.pending += 1
            rows.append((i, r, False))
            if len(r.out) + r.pending == r.max_new:
                self.running.remove(r)
                self._closing.append(r)
        return rows

    def _drain(self, pending: list) -> None:
        """Read dispatched forwards' tokens (waiting for them) into their requests; a request
        with all its tokens releases its pages and joins this call's finished list."""
        for logits, toks, rows, sample in pending:
            toks = np.asarray(toks)
            now = self.clock()
            self._timer.read(sample)
            lg = np.asarray(logits) if any(first for _, _, first in rows) else None
            for i, r, first in rows:
                r.add_token(toks[i : i + 1], now, lg[i] if first and lg is not None else None)
                if len(r.out) == r.max_new:
                    self._closing.remove(r)
                    self._finished.append(self._finish(r))
        # Requests whose last token is in flight release their pages now, for the next admission.
        for r in self._closing:
            if r.slot is not None and len(r.out) == r.max_new - 1:
                self._ledger.release_done(r)

    def _grow_pages(self, reqs: list[BatchRequest]) -> list[BatchRequest]:
        """A page for every request whose next position starts one; when none can be had,
        retract requests (fewest generated tokens, then longest prompt, first) and retry."""
        while True:
            short = [r for r in reqs if r.kv_done // self.ps >= r.pages.shape[0]]
            if not short:
                return reqs
            handles: list[Request] = []
            for r in short:
                assert r.req is not None  # a running request holds its handle
                handles.append(r.req)
            self.cache.prepare([], len(short))  # clean_ahead: what they will evict, backed up
            try:  # one allocation: a page for each (their handles' room up to the next token)
                extend_many(
                    self.cache,
                    handles,
                    [r.kv_done + 1 - h.num_tokens for r, h in zip(short, handles)],
                )
            except OutOfPagesError:
                if self._pending:  # requests finishing there give their pages back first
                    pending, self._pending = self._pending, []
                    self._drain(pending)
                    continue
                if len(reqs) == 1 and not self.prefilling:
                    self._stalled(reqs[0])
                victim = min(reqs, key=lambda r: (len(r.out) + r.pending, -r.prompt.shape[0]))
                self._retract(victim)
                reqs = [r for r in reqs if r is not victim]
                continue
            for r, h in zip(short, handles):
                r.pages = h.device_pages
            return reqs

    def _retract(self, r: BatchRequest) -> None:
        """Give back a running request's pages (the computed whole ones go to the tree) and
        queue it first; re-admission prefills prompt + the tokens generated so far."""
        self.running.remove(r)
        full = r.kv_done // self.ps
        self._ledger.release(r, r.seq[: full * self.ps], full, chunked=True)
        r.retractions += 1
        self.counters["retractions"], self._reserve = self.counters["retractions"] + 1, 1.0
        self.waiting.appendleft(r)

    def _finish(self, r: BatchRequest) -> Generation[BatchedRecord]:
        gen = self._ledger.finish(r)
        self.records.append(gen.record)
        return gen


@jax.jit
def _concat_rows(logits_a, toks_a, logits_b, toks_b) -> tuple:
    return jnp.concatenate([logits_a, logits_b]), jnp.concatenate([toks_a, toks_b])


class PrefillTimer:
    """Prefill samples of a batched engine for its cache's cost model (``load_policy="cost"``,
    ARCHITECTURE.md, "Load or recompute"): a forward that is one request's prefill chunk, with
    no decode rows and no layer-wise wait on a load, of a shape that ran before (the first run
    of a shape includes jit compilation: skipped, as the serial engine does). Its time runs
    from the later of its dispatch and the previous forward's read (the device runs forwards in
    order) to its own read, in real seconds (the engine's ``clock`` may be a test's counter)."""

    def __init__(self, model: Any, cache: HiCache) -> None:
        self.model, self.cache = model, cache
        self.shapes: set[tuple] = set()  # prefill step shapes already run once
        self.last_read = 0.0  # perf_counter when the last forward's tokens were read

    def dispatch(
        self, pool: Any, batch: list, decoding: list, chunks: list, reqs: list, knobs: _Knobs
    ) -> tuple | None:
        """``(n_new, n_cached, t0)`` for a forward about to be dispatched, or None (a
        request with a load-back handle may wait on it per layer: not a sample)."""
        if len(batch) != 1 or decoding or batch[0][0].handle is not None:
            return None
        r, n = batch[0]
        shape = self.model.batch_shape(
            pool, chunks, [q.kv_done for q in reqs], [q.pages for q in reqs], **knobs
        )
        if shape not in self.shapes:
            self.shapes.add(shape)
            return None
        return n, r.kv_done, time.perf_counter()

    def read(self, sample: tuple | None) -> None:
        """A forward's tokens were just read (``sample``: what :meth:`dispatch` gave it)."""
        start, self.last_read = self.last_read, time.perf_counter()
        if sample is not None:
            self.cache.observe_prefill(sample[0], sample[1], self.last_read - max(start, sample[2]))
