"""Engine: a reference request loop over HiCache and the paged decoder.

For every request, in order (the loop is **serial**: one request at a time, prefill then decode
with a batch of one; it shows the cache's job, not a batching scheduler):

1. ``cache.begin`` on the prompt minus its last token (the last token is always computed, for
   the logits of the first generated token): match, load back the host-only part (layer-wise
   when enabled: the forward waits for layer ``l``'s pages just before running layer ``l``),
   lock;
2. ``extend`` for every position the request will compute (prompt suffix + generated tokens
   but the last, whose K/V is never computed);
3. prefill only the uncached suffix, in chunks of ``chunk_size`` tokens; greedy decode. Under
   ``HiCacheConfig(load_policy="cost", load_overlap=True)`` the cache may give the request a
   two-ended split of its host part (``Request.overlap``, cache/loading/overlap.py): the back's copy
   is in flight at admission; the engine prefills the front, waits for the copy, prefills from
   the back's end (the prefill sample is that last part's alone: the front's time may hold the
   copy where the backend runs the two in order);
4. ``finish``: insert the whole pages of prompt + output (minus its last token), free the
   trailing partial page, unlock (an exception on the way aborts the request instead).

Three modes: ``none`` (no prefix cache: pages are allocated and freed per request), ``device``
(radix cache in device memory only: HiCache with ``host_pages=0``), ``hicache`` (L1 + L2).

A model with recurrent layers (``layer_pattern="R3:F1"``, :mod:`hicache_jax.engine.recurrent`)
keeps a state per request beside the full layers' pages (:class:`Checkpoints`): it starts as
a copy of the checkpoint at ``req.cached_len`` (``HiCache.read_state``; zeros at 0; the cached
checkpoint is never written), the prefill runs the recurrent layers in chunks that end at
every page boundary and writes the checkpoints ``HiCache.checkpoint_positions`` asks for
(asked right after ``begin``, before ``extend`` takes pages that may evict the branch point)
from the chunk-boundary states, decode advances the request's own state and checkpoints the
last whole page of prompt + output where it lies past the prompt's; all before ``finish``
inserts their pages. Its loads are whole (no layer-wise wait).

Threading: an Engine and its cache belong to the thread that calls ``generate``.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.cache.hicache import HiCache
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import bucket
from hicache_jax.errors import OutOfPagesError
from hicache_jax.spec import HiCacheConfig, KVSpec
from hicache_jax.validation import check_bool, is_int


class CacheMode(str, enum.Enum):
    """What the engine caches between requests."""

    NONE = "none"  # recompute every prompt
    DEVICE = "device"  # radix cache in L1 only
    HICACHE = "hicache"  # L1 + L2


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """Per-request figures (tokens are counts; seconds wall clock on the engine's thread).

    Attributes:
        prompt_tokens: prompt length.
        device_hit_tokens: prompt tokens found in L1.
        host_hit_tokens: prompt tokens loaded back from L2.
        host_declined_tokens: prompt tokens on L2 that were recomputed (load-back declined).
        recomputed_tokens: prompt tokens prefilled (prompt_tokens - hits).
        output_tokens: generated tokens.
        ttft_s: request start -> first generated token on host.
        latency_s: request start -> last generated token on host (pages inserted).
    """

    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    host_declined_tokens: int
    recomputed_tokens: int
    output_tokens: int
    ttft_s: float
    latency_s: float


_Record = TypeVar("_Record", bound=RequestRecord, covariant=True)


@dataclasses.dataclass(frozen=True)
class Generation(Generic[_Record]):
    """Result of one request (``Generation[BatchedRecord]`` from the batched engine).

    Attributes:
        tokens: int32 [max_new_tokens] greedy tokens.
        first_logits: float32 [vocab] logits of the first generated token.
        record: its :class:`RequestRecord` (of the engine's record type).
    """

    tokens: np.ndarray
    first_logits: np.ndarray
    record: _Record


@jax.jit
def _argmax(logits: jax.Array) -> jax.Array:
    return jnp.argmax(logits).astype(jnp.int32).reshape(1)


class Engine:
    """Serve prompts with a :class:`DecoderModel` over a :class:`HiCache`.

    Args:
        model: the decoder; its KV layout must match ``cache.spec``.
        cache: the page cache (also the page allocator in mode ``none``).
        mode: "none" | "device" | "hicache" (``none`` never matches or inserts).
        chunk_size: prefill chunk in tokens (a power of two; long prompts take several).
        layerwise: load back layer by layer; the forward waits for layer ``l``'s pages just
            before layer ``l`` (one jit per layer). The copies of later layers can overlap the
            forward of earlier ones only where the backend runs them concurrently; on XLA:CPU
            they run in order and this only adds dispatches (benchmarks/RESULTS.md).
        prefill_bucket: smallest prefill token bucket (a power of two; bounds compiles).
        table_bucket: smallest page-table bucket in pages (a power of two; bounds compiles).
        prefetch: with an L3 store (``cache.cfg.storage``), each request first calls
            ``cache.prefetch`` on its prompt, inside its TTFT (the L3 lookup is a round trip to
            the store; a stack that prefetches ahead of scheduling would move it out).

    Raises:
        ValueError: model and cache disagree on layers / heads / head_dim / dtype, or a bad size.
    """

    def __init__(
        self,
        model: DecoderModel,
        cache: HiCache,
        *,
        mode: CacheMode | str = "hicache",
        chunk_size: int = 512,
        layerwise: bool = True,
        prefill_bucket: int = 16,
        table_bucket: int = 1,
        prefetch: bool = False,
    ) -> None:
        self.mode = parse_mode(mode)
        check_bool("prefetch", prefetch)
        if prefetch and (cache.cfg.storage is None or self.mode is not CacheMode.HICACHE):
            raise ValueError("prefetch=True needs mode 'hicache' and a cache with storage")
        self.prefetch = bool(prefetch)
        spec = cache.spec
        want = model.kv_spec(spec.page_size)
        check_spec(spec, want)
        for name, value in (
            ("chunk_size", chunk_size),
            ("prefill_bucket", prefill_bucket),
            ("table_bucket", table_bucket),
        ):
            if not is_int(value) or value < 1 or bucket(value) != value:
                raise ValueError(f"{name}={value!r} must be a power of two >= 1")
        if model.recurrent and chunk_size % model.recurrent_chunk(spec.page_size):
            raise ValueError(
                f"chunk_size={chunk_size} is not a multiple of the recurrent layers' chunk "
                f"({model.recurrent_chunk(spec.page_size)} tokens): a prefill chunk would "
                "start inside one"
            )
        self.model, self.cache = model, cache
        self._prefill_shapes: set[tuple] = set()  # prefill shape signatures already compiled
        self.pool = cache.device_pool
        self.chunk_size, self.prefill_bucket = chunk_size, min(prefill_bucket, chunk_size)
        self.table_bucket = table_bucket
        self.layerwise = bool(layerwise)
        self.records: list[RequestRecord] = []
        self._positions: list[int] = []  # a recurrent model's checkpoints of the request

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
    ) -> Engine:
        """Build the cache for ``mode`` and the engine over it.

        ``host_pages`` (default ``4 * device_pages``) is used in mode ``hicache`` only; the
        other modes get ``host_pages=0``. ``load_back_threshold`` is one page; ``load_policy``
        is ``HiCacheConfig.load_policy`` ("threshold" | "cost").
        """
        mode = parse_mode(mode)
        cache = build_cache(
            model, mode, page_size, device_pages, host_pages, write_policy, load_policy
        )
        return cls(model, cache, mode=mode, **engine_kwargs)

    def generate(
        self, prompts: Sequence[Any], max_new_tokens: int
    ) -> list[Generation[RequestRecord]]:
        """Greedy-decode ``max_new_tokens`` tokens for each prompt, serially, in order.

        Args:
            prompts: 1-D int sequences of token ids in ``[0, vocab)``, each non-empty.
            max_new_tokens: >= 1.

        Returns:
            One :class:`Generation` per prompt (also appended to ``self.records``).

        Raises:
            ValueError / TypeError: a malformed prompt or size (checked for every prompt before
                any request is served).
            OutOfPagesError: a request needs more device pages than can be freed; the requests
                before it are served and cached, its own pages are released.
        """
        if not is_int(max_new_tokens) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an int >= 1")
        checked = [self._check_prompt(p, i) for i, p in enumerate(prompts)]
        return [self._serve(p, int(max_new_tokens)) for p in checked]

    def _check_prompt(self, prompt: Any, i: int) -> np.ndarray:
        return check_prompt(prompt, self.model.cfg.vocab_size, f"prompts[{i}]")

    def _serve(self, prompt: np.ndarray, max_new: int) -> Generation[RequestRecord]:
        t0 = time.perf_counter()
        cache, n = self.cache, prompt.shape[0]
        kv_len = n + max_new - 1  # positions with K/V: all but the last generated token
        if self.mode is CacheMode.NONE:  # no tree: the request's pages are allocated and freed
            pages = cache.alloc_pages(-(-kv_len // cache.spec.page_size))
            try:
                tokens, first_logits, ttft = self._run(prompt, 0, pages, max_new, None, t0)
            finally:
                cache.free_pages(pages)
            l1 = l2 = declined = cached = 0
        else:
            if self.prefetch:  # the engine matches the prompt minus its last token
                cache.prefetch(prompt[: n - 1])
            layerwise = self.layerwise and not self.model.recurrent
            with cache.begin(prompt[: n - 1], layerwise=layerwise) as req:
                cached = req.cached_len
                if req.loaded_len and not layerwise:  # its copy timed as its own
                    cache.wait_loaded(req.device_pages)
                # A recurrent model's checkpoints are placed before the request's own pages
                # are taken: taking them may evict the tree's pages past the match (the
                # branch point where the prompt leaves them is one of the places).
                self._positions = (
                    cache.checkpoint_positions(prompt, cached) if self.model.recurrent else []
                )
                req.extend(kv_len - req.num_tokens)  # a split's pages are the request's
                tokens, first_logits, ttft = self._run(
                    prompt, cached, req.device_pages, max_new, req.load_handle, t0, req
                )
                req.finish(np.concatenate([prompt, tokens])[:kv_len])
            l1, l2, declined = cached - req.loaded_len, req.loaded_len, req.host_len_declined
            if req.overlap:  # the back was loaded, the front recomputed
                l2, declined = req.overlap[1] - req.overlap[0], req.overlap[0] - cached
                cached += l2
        record = RequestRecord(
            n, l1, l2, declined, n - cached, max_new, ttft, time.perf_counter() - t0
        )
        self.records.append(record)
        return Generation(tokens, first_logits, record)

    def _report_prefill(self, shapes: tuple, n_new: int, n_cached: int, seconds: float) -> None:
        """Feed the cache's prefill fit (``load_policy="cost"``) one timed sample; the first
        prefill of a shape signature is skipped, its time includes jit compilation."""
        if shapes in self._prefill_shapes:
            self.cache.observe_prefill(n_new, n_cached, seconds)
        else:
            self._prefill_shapes.add(shapes)

    def _windows(self, pages: np.ndarray, end: int) -> dict[str, Any]:
        """:func:`window_args` of a forward over positions ``0 .. end-1``."""
        return window_args(self.cache, pages, -(-end // self.cache.spec.page_size))

    def _run(
        self,
        prompt: np.ndarray,
        cached: int,
        pages: np.ndarray,
        max_new: int,
        waiter: Any,
        t0: float,
        req: Any = None,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """Prefill ``prompt[cached:]`` in chunks (the first waits per layer for ``waiter``, a
        layer-wise load's handle, when given; with ``req.overlap``, the front, then the wait
        for the back's copy, then the rest), then decode; returns tokens, logits, TTFT."""
        if self.model.recurrent:
            return self._run_recurrent(prompt, cached, pages, max_new, t0, req)
        starts = list(range(cached, prompt.shape[0], self.chunk_size))
        if req is not None and req.overlap:
            front, back = req.overlap
            for c0 in range(cached, front, self.chunk_size):  # the front, the copy in flight
                end = min(c0 + self.chunk_size, front)
                self.model.forward(
                    self.pool,
                    prompt[c0:end],
                    c0,
                    pages,
                    min_bucket=self.prefill_bucket,
                    min_pages=self.table_bucket,
                    **self._windows(pages, end),
                )
            req.wait_overlap()
            cached, starts = back, list(range(back, prompt.shape[0], self.chunk_size))
        p0, shapes = time.perf_counter(), []
        logits = None
        for c0 in starts:
            chunk = prompt[c0 : c0 + self.chunk_size]
            shapes.append(
                (_pow2(max(chunk.shape[0], self.prefill_bucket)), pages.shape[0], waiter is None)
            )
            logits = self.model.forward(
                self.pool,
                chunk,
                c0,
                pages,
                waiter=waiter,
                min_bucket=self.prefill_bucket,
                min_pages=self.table_bucket,
                **self._windows(pages, c0 + chunk.shape[0]),
            )
            waiter = None  # every layer has been waited for once: later chunks run fused
        assert logits is not None  # the prompt's last token is never cached: a chunk ran
        first_logits = np.asarray(logits)  # blocks: async dispatch has finished the prefill
        self._report_prefill(
            tuple(shapes), prompt.shape[0] - cached, cached, time.perf_counter() - p0
        )
        tok = _argmax(logits)
        out = [tok]
        ttft = time.perf_counter() - t0
        pos = prompt.shape[0]
        for _ in range(max_new - 1):
            logits = self.model.forward(
                self.pool,
                tok,
                pos,
                pages,
                min_pages=self.table_bucket,
                **self._windows(pages, pos + 1),
            )
            tok = _argmax(logits)
            out.append(tok)
            pos += 1
        return np.asarray(jnp.concatenate(out)), first_logits, ttft

    def _run_recurrent(
        self,
        prompt: np.ndarray,
        cached: int,
        pages: np.ndarray,
        max_new: int,
        t0: float,
        req: Any,
    ) -> tuple[np.ndarray, np.ndarray, float]:
        """:meth:`_run` of a model with recurrent layers: the state starts from the
        checkpoint at ``cached`` (a copy: :func:`start_state`), the prefill writes the
        checkpoints ``cache.checkpoint_positions`` asks for from its chunk-boundary states, and
        decode advances the request's own state, checkpointing the last whole page of
        prompt + output (what ``finish`` inserts) where it lies beyond the prompt's. ``req``
        None (mode ``none``): no checkpoint is read or written."""
        cache, model = self.cache, self.model
        n = prompt.shape[0]
        ckpt = Checkpoints(
            cache,
            model,
            pages,
            prompt,
            cached,
            n + max_new - 1,
            self._positions if req is not None else None,
        )
        state = ckpt.state
        p0, shapes = time.perf_counter(), []
        logits = None
        for c0 in range(cached, n, self.chunk_size):
            chunk = prompt[c0 : c0 + self.chunk_size]
            shapes.append((_pow2(max(chunk.shape[0], self.prefill_bucket)), pages.shape[0]))
            logits, state, bounds, step = model.forward_recurrent(
                self.pool,
                chunk,
                c0,
                pages,
                state,
                **recurrent_window_args(cache, pages, c0 + chunk.shape[0]),
                min_bucket=self.prefill_bucket,
                min_pages=self.table_bucket,
            )
            ckpt.prefilled(c0, c0 + chunk.shape[0], bounds, step, pages)
        assert logits is not None  # the prompt's last token is never cached: a chunk ran
        first_logits = np.asarray(logits)
        self._report_prefill(tuple(shapes), n - cached, cached, time.perf_counter() - p0)
        tok = _argmax(logits)
        out = [tok]
        ttft = time.perf_counter() - t0
        for pos in range(n, n + max_new - 1):
            logits, state, _, _ = model.forward_recurrent(
                self.pool,
                tok,
                pos,
                pages,
                state,
                **recurrent_window_args(cache, pages, pos + 1),
                min_pages=self.table_bucket,
            )
            ckpt.decoded(pos + 1, state, pages)
            tok = _argmax(logits)
            out.append(tok)
        return np.asarray(jnp.concatenate(out)), first_logits, ttft


class Checkpoints:
    """A recurrent-pattern request's checkpoints (the serial and the batched engine): its
    start state, the prefill's checkpoints and the decode's last one.

    Args:
        cache: the cache (its first STATE group holds the recurrent layers' state).
        model: the decoder (its zero state).
        pages: the request's device pages now (those past ``cached`` its own, not inserted
            yet).
        tokens: what the request prefills from ``cached`` (its prompt; a re-admitted
            request's prompt and output so far).
        cached: tokens served from the cache (a checkpoint position, or 0).
        kv_len: the positions whose K/V the request computes in all (``finish`` inserts
            their whole pages).
        positions: where the prefill writes checkpoints: ``cache.checkpoint_positions(tokens,
            cached)`` asked before the request took its own pages (which may evict the tree's
            pages past its match, and with them the branch point); None (no prefix cache):
            start from zeros, write nothing.
    """

    def __init__(
        self,
        cache: HiCache,
        model: DecoderModel,
        pages: np.ndarray,
        tokens: np.ndarray,
        cached: int,
        kv_len: int,
        positions: Sequence[int] | None,
    ) -> None:
        enabled = positions is not None
        self.ps = ps = cache.spec.page_size
        self.cache, self.group = cache, cache.spec.state_groups[0]
        self.state = start_state(cache, model, pages, cached) if enabled else model.zero_state()
        self.positions = list(positions or ())
        self.skipped = 0  # checkpoints not written: no state slot could be had
        prompt_end = tokens.shape[0] // ps * ps
        last = kv_len // ps * ps
        #: The last whole page of everything computed, when decode reaches it past the prompt.
        self.decode_end = last if enabled and last > max(prompt_end, cached) else None

    def prefilled(
        self, c0: int, end: int, bounds: Sequence[Any], chunk: int, pages: np.ndarray
    ) -> None:
        """A prefill chunk over positions ``c0 .. end-1`` ran (``forward_recurrent``'s
        boundary states after every ``chunk`` tokens from ``c0``): write the checkpoints in
        ``(c0, end]`` to the request's ``pages`` (its page table now)."""
        here = [p for p in self.positions if c0 < p <= end]
        if not here:
            return
        idx = np.asarray([(p - c0) // chunk - 1 for p in here], np.int32)
        state = [jnp.moveaxis(jnp.take(b, idx, axis=1), 1, 0) for b in bounds]
        self._write(pages[[p // self.ps - 1 for p in here]], state)

    def decoded(self, end: int, state: Sequence[Any], pages: np.ndarray) -> None:
        """Decode computed position ``end - 1``: ``state`` is the state after ``end``
        tokens; checkpoint it if ``end`` is :attr:`decode_end`."""
        if end == self.decode_end:
            self._write(pages[[end // self.ps - 1]], [a[None] for a in state])

    def _write(self, pages: np.ndarray, state: Sequence[Any]) -> None:
        """``write_state``; a checkpoint no slot can be had for (every slot held by locked
        prefixes or requests' own pages) is skipped and counted (:attr:`skipped`): the pages
        go into the tree without it, and a later hit ends at an earlier checkpoint."""
        try:
            self.cache.write_state(self.group, pages, state)
        except OutOfPagesError:
            self.skipped += len(pages)


def start_state(
    cache: HiCache, model: DecoderModel, pages: np.ndarray, cached: int
) -> tuple[Any, ...]:
    """The recurrent state a request served from the cache up to ``cached`` tokens starts
    from: a copy of the checkpoint at the end of its page ``cached // ps - 1`` (never written
    again: the request advances its own), zeros when ``cached`` is 0."""
    if cached == 0:
        return model.zero_state()
    ps = cache.spec.page_size
    g = cache.spec.state_groups[0]
    return tuple(a[0] for a in cache.read_state(g, pages[cached // ps - 1 : cached // ps]))


def check_spec(spec: KVSpec, want: KVSpec) -> None:
    """ValueError unless a cache of ``spec`` holds the K/V of a model that needs ``want``
    (layers, heads, head dim, dtype, MLA, and the layer groups of a ``layer_pattern``)."""
    if (
        spec.num_layers,
        spec.num_kv_heads,
        spec.head_dim,
        spec.dtype,
        spec.mla,
        spec.window_groups,
    ) != (
        want.num_layers,
        want.num_kv_heads,
        want.head_dim,
        want.dtype,
        want.mla,
        want.window_groups,
    ):
        raise ValueError(f"cache.spec {spec} does not hold this model's K/V (needs {want})")


def window_args(cache: HiCache, pages: np.ndarray, used: int) -> dict[str, Any]:
    """The window arguments of a forward over ``pages[:used]`` (``DecoderModel.forward``):
    none for a cache without window groups; else its window pools and the groups' pages of
    those pages, asked each step (an insert may drop a cached prefix's window pages)."""
    if not cache.spec.window_groups:
        return {}
    return {
        "windows": cache.window_pools,
        "window_pages": cache.window_pages(np.asarray(pages)[:used]),
    }


def recurrent_window_args(cache: HiCache, pages: np.ndarray, end: int) -> dict[str, Any]:
    """:func:`window_args` of a recurrent pattern's forward over positions ``0 .. end-1``
    (``DecoderModel.forward_recurrent``): none for ``R3:F1`` (its one window group is the
    STATE group, which the forward does not read: the caller passes the state), every window
    group's for ``R2:S1:F1`` (the forward runs its local layers on theirs)."""
    spec = cache.spec
    if len(spec.window_groups) == len(spec.state_groups):
        return {}
    return window_args(cache, pages, -(-end // spec.page_size))


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def build_cache(
    model: DecoderModel,
    mode: CacheMode,
    page_size: int,
    device_pages: int,
    host_pages: int | None,
    write_policy: str,
    load_policy: str = "threshold",
) -> HiCache:
    """The cache of an engine in ``mode``: ``host_pages`` (default ``4 * device_pages``) in mode
    ``hicache`` only, 0 otherwise; ``load_back_threshold`` one page; ``load_policy`` as
    ``HiCacheConfig``'s; the pools sharded over the model's mesh (tensor parallelism) when it
    has one."""
    if mode is not CacheMode.HICACHE:
        host_pages = 0
    elif host_pages is None:
        host_pages = 4 * device_pages
    cfg = HiCacheConfig(
        device_pages=device_pages,
        host_pages=host_pages,
        write_policy=write_policy,
        load_back_threshold=page_size,
        load_policy=load_policy,
        mesh=model.mesh,
        shard_axis=model.axis,
    )
    return HiCache(model.kv_spec(page_size), cfg)


def check_prompt(prompt: Any, vocab_size: int, name: str = "prompt") -> np.ndarray:
    """A non-empty 1-D sequence of token ids in ``[0, vocab_size)`` -> int32 numpy (TypeError
    for non-integers, ValueError otherwise; the message names ``name``)."""
    arr = np.asarray(prompt)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {arr.shape}")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(
            f"{name} has token ids outside [0, {vocab_size}): min {arr.min()}, max {arr.max()}"
        )
    return arr.astype(np.int32)


def parse_mode(mode: CacheMode | str) -> CacheMode:
    """``mode`` as a CacheMode (the serial and the batched engine); ValueError naming the modes."""
    try:
        return CacheMode(mode)
    except ValueError:
        raise ValueError(
            f"mode={mode!r} is not one of: {', '.join(repr(m.value) for m in CacheMode)}"
        ) from None
