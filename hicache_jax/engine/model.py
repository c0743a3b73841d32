"""DecoderModel: a small Llama-style decoder whose attention reads K/V straight from the paged
device pool; the host side of a forward (bucketing, page tables, dispatch).

The size and weights are in :mod:`hicache_jax.engine.weights`, the layer math and the jitted steps
in :mod:`hicache_jax.engine.layers`, a packed step's host arrays in
:mod:`hicache_jax.engine.packing`; this module pads a call's tokens and page tables to buckets
and dispatches the steps through ``DevicePagePool.run`` so the pool object keeps the only
reference to its (donated) array.

Two ways to run a forward over the same layer math:

* fused: one jit for embedding, all layers (``lax.scan`` over stacked layer weights; unrolled
  over per-layer weights for a step of at most ``unroll_tokens`` tokens) and head;
* per layer: embedding, then one donated jit per layer, then the head, so a caller can wait for
  layer ``l``'s pages (``handle.wait_layer(l)``) just before running layer ``l`` while later layers
  are still being loaded back from host.

Token counts are padded to power-of-two buckets (at most ``chunk`` tokens) and page tables to
power-of-two page counts, so the number of compiles stays logarithmic in prompt length.
:meth:`DecoderModel.forward_batch` (the batched engine's one call a step) packs several requests'
prefill chunks and decode tokens into one flat token list, bucketed as a whole (see there).

A model with a ``layer_pattern`` (sliding-window or chunked local layers beside full ones) keeps
each local layer's K/V in its window group's pool (``HiCache.window_pools``): both calls then
take ``windows`` and ``window_pages`` (each window group's page of each request page, asked of
the cache every step) and run the fused step through ``DevicePagePool.run_with`` (every pool
donated at once), the per-layer path a pool a layer. A plain model's steps are unchanged.

A model with recurrent layers (``layer_pattern="R3:F1"``) runs with
:meth:`DecoderModel.forward_recurrent` instead, one request a call
(:meth:`DecoderModel.forward_recurrent_rows`: several, one chunk each, in one step): the caller
holds the request's recurrent state and passes it in; the call returns it advanced, with the
states at every chunk boundary of a prefill (the checkpoints a caller writes to the cache).

Threading: every call dispatches on the caller's thread, which must be the thread that owns the
pool (ARCHITECTURE.md: one dispatching thread).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.engine.layers import (
    BATCH_EMBED,
    BATCH_HEAD,
    BATCH_LAYER,
    BATCH_STEP,
    EMBED,
    HEAD,
    LAYER,
    LOCAL_BATCH_LAYER,
    LOCAL_LAYER,
    PATTERN_BATCH_STEP,
    PATTERN_STEP,
    RECURRENT_PATTERN_ROWS,
    RECURRENT_PATTERN_STEP,
    RECURRENT_ROWS,
    RECURRENT_STEP,
    STEP,
    TRACES,
    UNROLL_TOKENS,
    layer_plan,
    local_groups,
    recurrent_plan,
    zero_state,
)
from hicache_jax.engine.packing import (
    NO_SLOTS,
    TokenSlots,
    bucket,
    check_slots,
    cover,
    feed_arrays,
    flatten,
    lens_used,
    pack,
    plan,
)
from hicache_jax.engine.weights import ModelConfig, Params, init_params, shard_params
from hicache_jax.spec import KVSpec
from hicache_jax.validation import is_int

__all__ = ["DecoderModel", "LayerWaiter", "PoolLike", "step_records_kept"]

# The stateful shell: bucketing on the host, dispatch through the pool's donated run().


class PoolLike(Protocol):
    """What the model needs of a device pool (hicache_jax.memory.device_pool.DevicePagePool)."""

    num_pages: int
    array: Any  # the pool's array (its page size, where the pool has no ``spec``)

    def run(self, fn: Callable, *args: Any) -> Any: ...


class LayerWaiter(Protocol):
    def wait_layer(self, layer: int) -> Any: ...


class DecoderModel:
    """Weights plus the jitted steps over the paged pool.

    Args:
        cfg: model size.
        params: weights from :func:`init_params` / :func:`load_params`; None ->
            ``init_params(cfg, seed)``.
        seed: used when ``params`` is None.
        unroll_tokens: a fused step of at most this many (bucketed) tokens runs its layers
            unrolled over each layer's own weights, a longer one as a ``lax.scan`` over the
            stacked weights (see ``layers._scan_layers``); 0: always the scan.
        mesh: tensor parallelism: the weights are placed over this ``jax.sharding.Mesh``
            (``shard_params``: heads and the FFN width split over ``axis``, default the
            mesh's first), possibly spanning several processes; the cache's pools must be
            sharded over the same mesh and axis (``HiCacheConfig(mesh=...)``). The steps are
            the same jits; the compiler partitions them from the shardings. A layer pattern's
            window pools are sharded over kv heads as the full group's; a recurrent layer's
            heads are split as attention's, and its state slots with them (the ``ssm`` array
            names its head axis: ``ModelConfig.state_arrays``).
    """

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params | None = None,
        *,
        seed: int = 0,
        unroll_tokens: int = UNROLL_TOKENS,
        mesh: Any = None,
        axis: str | None = None,
    ) -> None:
        if not is_int(unroll_tokens) or unroll_tokens < 0:
            raise ValueError(f"unroll_tokens={unroll_tokens!r} must be an int >= 0")
        #: Per layer, its pool and mask (``layers.layer_plan``); empty: every layer full.
        self.plan = layer_plan(cfg)
        #: A recurrent pattern's layers (``layers.recurrent_plan``); empty: none recurrent.
        self.recurrent = recurrent_plan(cfg)
        self.cfg = cfg
        self.unroll_tokens = int(unroll_tokens)
        self._zero_state: tuple[jax.Array, ...] | None = None
        self.params = init_params(cfg, seed) if params is None else params
        self.mesh, self.axis = mesh, axis
        if mesh is not None:
            self.params = shard_params(cfg, self.params, mesh, axis)
        # Per-layer weight slices, sliced once here (not per call) for the per-layer path.
        self._layer_params = [
            {k: _layer_slice(v, i) for k, v in self.params["layers"].items()}
            for i in range(cfg.num_layers)
        ]
        # The same slices for the fused steps of few tokens, which run their layers unrolled
        # (unroll_tokens: no per-layer weight copy inside the step).
        self._unrolled_params = {
            **{k: v for k, v in self.params.items() if k != "layers"},
            "per_layer": tuple(self._layer_params),
        }
        if self.recurrent:
            self._unrolled_params["recurrent_per_layer"] = tuple(
                {k: _layer_slice(v, j) for k, v in self.params["recurrent"].items()}
                for j in range(len(cfg.recurrent_layers()))
            )
        # Module-level jits with the config static: models of equal config share compiles.
        self._step = functools.partial(STEP, cfg)
        self._layer = functools.partial(LAYER, cfg)
        self._head = functools.partial(HEAD, cfg)

    def _fused_params(self, tokens: int) -> Params:
        """The weights a fused step of ``tokens`` (bucketed) tokens takes: per layer (its
        layers unrolled) up to ``unroll_tokens``, else stacked (a scan)."""
        return self._unrolled_params if tokens <= self.unroll_tokens else self.params

    def kv_spec(self, page_size: int) -> KVSpec:
        """The cache's spec for this model (``ModelConfig.kv_spec``: grouped with a
        ``layer_pattern``)."""
        return self.cfg.kv_spec(page_size)

    def _recurrent_windows(
        self, windows: Sequence[Any], window_pages: Any, used: Sequence[int], shape: tuple
    ) -> tuple[list[Any], np.ndarray | None]:
        """A recurrent pattern's local pools and their page tables: of ``windows`` (every
        window group's pool, ``HiCache.window_pools``: the STATE group's is left out) and
        ``window_pages`` (one ``[G, >= used[b]]`` array a row, ``HiCache.window_pages``),
        the local groups' pools and int32 ``[G', *shape]`` tables (``shape``: rows, pages;
        the scratch page where a group keeps no page, past ``used[b]`` and in padding rows);
        ``([], None)`` for ``R3:F1``. ValueError where the call's windows do not fit the
        model."""
        spec = self.cfg.kv_spec(1)
        want = len(spec.window_groups) if local_groups(spec) else 0
        if len(windows) != want or (want and window_pages is None):
            raise ValueError(
                f"windows: {len(windows)} window pools and window_pages="
                f"{'None' if window_pages is None else 'given'}; this model "
                f"(layer_pattern={self.cfg.layer_pattern!r}) needs {want} pools"
                + (" and window_pages (HiCache.window_pools / window_pages)" if want else "")
            )
        if not want:
            return [], None
        local = [windows[g] for g in local_groups(spec)]
        tables = np.empty((len(local), *shape), np.int32)
        for j, wpool in enumerate(local):
            tables[j] = wpool.num_pages  # its scratch page
        for b, (wp, u) in enumerate(zip(window_pages, used)):
            wp = np.asarray(wp, np.int32)
            if wp.ndim != 2 or wp.shape[0] != want or wp.shape[1] < u:
                raise ValueError(f"window_pages[{b}] has shape {wp.shape}; needs [{want}, >= {u}]")
            for j, (g, wpool) in enumerate(zip(local_groups(spec), local)):
                tables[j, b, :u] = np.where(wp[g, :u] < 0, wpool.num_pages, wp[g, :u])
        return local, tables

    def _window_args(self, windows: Sequence[Any], window_pages: Any, name: str) -> None:
        """Check that a patterned model's call got its window pools and pages (and a plain
        model's none)."""
        want = len(self.plan and self.cfg.kv_spec(1).window_groups)
        if len(windows) != want or (want and window_pages is None):
            raise ValueError(
                f"windows: {len(windows)} window pools and {name}="
                f"{'None' if window_pages is None else 'given'}; this model "
                f"(layer_pattern={self.cfg.layer_pattern!r}) needs {want} pools"
                + (f" and {name}" if want else "")
            )

    def forward(
        self,
        pool: PoolLike,
        tokens,
        start: int,
        page_ids,
        *,
        waiter: LayerWaiter | None = None,
        min_bucket: int = 1,
        min_pages: int = 1,
        windows: Sequence[Any] = (),
        window_pages: Any = None,
    ) -> jax.Array:
        """Run one chunk: write its K/V into its pages and return the last token's logits.

        Args:
            pool: the device pool (its array is donated and rebound by ``pool.run``).
            tokens: int [n] token ids at positions ``start .. start+n-1`` (numpy or a jax
                array; n >= 1).
            start: position of ``tokens[0]``; positions ``0 .. start-1`` must already hold K/V
                in ``page_ids``.
            page_ids: int [>= ceil((start+n)/ps)] the request's pages in position order (numpy);
                only the first ``ceil((start+n)/ps)`` are used.
            waiter: a layer-wise load handle: run layer by layer, waiting for layer ``l``'s pages
                before layer ``l``; None -> the fused single-jit step.
            min_bucket: smallest token bucket (prefill uses e.g. 16 to limit compiles; decode 1).
            min_pages: smallest page-table bucket (fewer compiles for short contexts).
            windows: a patterned model's window group pools (``HiCache.window_pools``); the
                step then runs through ``pool.run_with`` (fused) or one pool per layer.
            window_pages: int [G, >= ceil((start+n)/ps)], each window group's page of each of
                ``page_ids`` (``HiCache.window_pages``; -1: the group keeps none, read as its
                scratch page, which the window masks out).

        Returns:
            float32 [vocab] logits of the last token (a jax array, not synchronized).
        """
        self._not_recurrent("forward")
        self._window_args(windows, window_pages, "window_pages")
        n = int(tokens.shape[0])
        ps = self._page_size(pool)
        if n < 1 or start < 0:
            raise ValueError(f"need >= 1 token at start >= 0, got n={n}, start={start}")
        used = -(-(start + n) // ps)
        page_ids = np.asarray(page_ids, np.int32)
        if page_ids.ndim != 1 or page_ids.shape[0] < used:
            raise ValueError(
                f"page_ids has shape {page_ids.shape}; positions 0..{start + n - 1} "
                f"need {used} pages of {ps} tokens"
            )
        table = np.full(bucket(used, min_pages), pool.num_pages, np.int32)
        table[:used] = page_ids[:used]
        tb = bucket(n, min_bucket)
        toks: np.ndarray | jax.Array
        if isinstance(tokens, np.ndarray):
            toks = np.zeros(tb, np.int32)
            toks[:n] = tokens
        elif tb != n:
            toks = jnp.pad(jnp.asarray(tokens, jnp.int32), (0, tb - n))
        else:
            toks = tokens  # a device token from the previous decode step: no host round trip
        args = (jnp.int32(start), jnp.int32(n), table)
        if self.plan:
            return self._pattern_forward(pool, windows, window_pages, toks, args, used, waiter)
        if waiter is None:
            return pool.run(self._step, self._fused_params(tb), toks, *args)
        x = EMBED(self.params, toks)
        for layer, lp in enumerate(self._layer_params):
            waiter.wait_layer(layer)
            x = pool.run(self._layer, jnp.int32(layer), lp, x, *args)
        return self._head(self.params, x, jnp.int32(n))

    def _not_recurrent(self, name: str) -> None:
        if self.recurrent:
            raise ValueError(
                f"{name}: a model with recurrent layers (layer_pattern="
                f"{self.cfg.layer_pattern!r}) runs with forward_recurrent (it keeps a state)"
            )

    def zero_state(self) -> tuple[jax.Array, ...]:
        """A recurrent model's state at the start of a sequence (``(conv, ssm)``, each with a
        leading axis of its recurrent layers). Built once (immutable arrays, never donated:
        every sequence start and every padding row of a batch shares them)."""
        if self._zero_state is None:
            self._zero_state = zero_state(self.cfg, len(self.cfg.recurrent_layers()))
        return self._zero_state

    def recurrent_chunk(self, page_size: int) -> int:
        """Tokens of a chunk of the recurrent layers' prefill (``recurrent_chunked``): the
        largest power of two dividing ``page_size``, at most ``self.max_recurrent_chunk``, so
        that chunks starting at a page boundary (a checkpoint: every cached prefix ends at
        one) end at every page boundary, and a prefill served from a checkpoint repeats a
        recompute's arithmetic chunk for chunk; an engine's power-of-two prefill chunks are
        whole chunks of it."""
        return math.gcd(page_size, self.max_recurrent_chunk)

    #: The longest chunk of :meth:`recurrent_chunk` (a power of two).
    max_recurrent_chunk = 16

    def forward_recurrent(
        self,
        pool: PoolLike,
        tokens,
        start: int,
        page_ids,
        state: Sequence[Any],
        *,
        windows: Sequence[Any] = (),
        window_pages: Any = None,
        min_bucket: int = 1,
        min_pages: int = 1,
    ) -> tuple[jax.Array, tuple[jax.Array, ...], tuple[jax.Array, ...], int]:
        """One chunk of a request of a recurrent-pattern model: the full layers' K/V into its
        pages, the recurrent layers from ``state`` (the state after ``start`` tokens).

        Args:
            pool: the device pool (the full-attention layers; donated and rebound).
            tokens: int [n] token ids at positions ``start ..`` (numpy or a jax array; one
                token: the step form of decode, else the chunked form of prefill).
            start: position of ``tokens[0]``; a prefill starts at a multiple of
                :meth:`recurrent_chunk` (its chunks then end at every page boundary).
            page_ids: the request's pages in position order (as :meth:`forward`).
            state: ``(conv [R, conv_width-1, d_model], ssm [R, H, dk, dv])`` float32, R the
                recurrent layers (:meth:`zero_state`, or ``HiCache.read_state`` of a
                checkpoint without its page axis); not modified.
            windows / window_pages: a three-kind pattern's (``"R2:S1:F1"``) window pools
                and pages, as :meth:`forward` takes them (every window group's:
                ``HiCache.window_pools``, ``HiCache.window_pages``); the local layers run on
                theirs.
            min_bucket / min_pages: as :meth:`forward`.

        Returns:
            ``(logits [vocab], state after the chunk, boundary states, chunk)``: the boundary
            states ``(conv [R, nb, ...], ssm [R, nb, ...])`` after each ``chunk`` tokens of
            the prefill (``start + (i+1) * chunk``, clamped to the chunk's end; nb = 0 for
            one token). Jax arrays, not synchronized.
        """
        if not self.recurrent:
            raise ValueError("forward_recurrent: this model has no recurrent layers")
        n = int(tokens.shape[0])
        ps = self._page_size(pool)
        if n < 1 or start < 0:
            raise ValueError(f"need >= 1 token at start >= 0, got n={n}, start={start}")
        chunk = self.recurrent_chunk(ps)
        if n > 1 and start % chunk:
            raise ValueError(
                f"start={start}: a recurrent prefill starts at a multiple of its chunk "
                f"({chunk} tokens, recurrent_chunk)"
            )
        used = -(-(start + n) // ps)
        page_ids = np.asarray(page_ids, np.int32)
        if page_ids.ndim != 1 or page_ids.shape[0] < used:
            raise ValueError(
                f"page_ids has shape {page_ids.shape}; positions 0..{start + n - 1} "
                f"need {used} pages of {ps} tokens"
            )
        conv, ssm = (jnp.asarray(a, jnp.float32) for a in state)
        want = tuple(a.shape for a in self.zero_state())
        if (conv.shape, ssm.shape) != want:
            raise ValueError(f"state has shapes {(conv.shape, ssm.shape)}, needs {want}")
        table = np.full(bucket(used, min_pages), pool.num_pages, np.int32)
        table[:used] = page_ids[:used]
        local, wtables = self._recurrent_windows(
            windows, None if window_pages is None else [window_pages], [used], (1, len(table))
        )
        tb = 1 if n == 1 else max(2, bucket(n, min_bucket))
        toks: np.ndarray | jax.Array
        if isinstance(tokens, np.ndarray):
            toks = np.zeros(tb, np.int32)
            toks[:n] = tokens
        elif tb != n:
            toks = jnp.pad(jnp.asarray(tokens, jnp.int32), (0, tb - n))
        else:
            toks = tokens
        args = (toks, jnp.int32(start), jnp.int32(n), table)
        if wtables is not None:
            logits, new_state, bounds = cast(Any, pool).run_with(
                local,
                functools.partial(RECURRENT_PATTERN_STEP, self.cfg, chunk),
                self._unrolled_params,
                *args,
                wtables[:, 0],
                conv,
                ssm,
            )
            return logits, new_state, bounds, chunk
        logits, new_state, bounds = pool.run(
            functools.partial(RECURRENT_STEP, self.cfg, chunk),
            self._unrolled_params,
            *args,
            conv,
            ssm,
        )
        return logits, new_state, bounds, chunk

    def forward_recurrent_rows(
        self,
        pool: PoolLike,
        chunks: Sequence[Any] | None,
        starts: Sequence[int],
        page_ids: Sequence[Any],
        states: Sequence[Sequence[Any]],
        slots: TokenSlots,
        slot_of: Sequence[int],
        *,
        windows: Sequence[Any] = (),
        window_pages: Sequence[Any] | None = None,
        min_bucket: int = 1,
        min_pages: int = 1,
        min_batch: int = 1,
    ) -> tuple[jax.Array, jax.Array, list[tuple[Any, ...]], list[tuple[Any, ...]], int]:
        """A chunk of each of ``B`` requests of a recurrent-pattern model in one step (the
        batched engine's rows): :meth:`forward_recurrent`'s math a row, the rows at once.

        Args:
            pool: the device pool (donated and rebound).
            chunks: B int arrays (numpy), request b's prefill chunk at ``starts[b]`` (a
                multiple of :meth:`recurrent_chunk`), run in the chunked form; None: one decode
                token per request, read from its slot (the last token sampled there, on the
                device), run in the step form.
            starts: B positions of the chunks' first tokens.
            page_ids: B page lists (as :meth:`forward`).
            states: B states (as :meth:`forward_recurrent`'s); not modified.
            slots: the token slots: each row's sampled token is written to its slot.
            slot_of: B slots.
            windows / window_pages: a three-kind pattern's window pools (every window
                group's, ``HiCache.window_pools``) and each row's window pages (B arrays of
                ``HiCache.window_pages`` of its pages).
            min_bucket / min_pages / min_batch: the smallest bucket of the chunks' tokens, the
                page tables' pages, the rows (powers of two).

        Returns:
            ``(logits [R, vocab], tokens [R], states, boundary states, chunk)``: row ``b < B``
            for request b; its new state and its boundary states as
            :meth:`forward_recurrent` returns them. Jax arrays, not synchronized.
        """
        if not self.recurrent:
            raise ValueError("forward_recurrent_rows: this model has no recurrent layers")
        b = len(starts)
        if b < 1 or len(page_ids) != b or len(states) != b or len(slot_of) != b:
            raise ValueError(
                f"need >= 1 row and one page list, state and slot each: {b} starts, "
                f"{len(page_ids)} page lists, {len(states)} states, {len(slot_of)} slots"
            )
        ps = self._page_size(pool)
        chunk = self.recurrent_chunk(ps)
        lens = [1] * b if chunks is None else [int(np.shape(c)[0]) for c in chunks]
        if chunks is not None and b != len(chunks):
            raise ValueError(f"{len(chunks)} chunks for {b} starts")
        t = 1 if chunks is None else max(2, bucket(max(lens), min_bucket))
        rows = bucket(b, min_batch)
        used = [-(-(int(s) + n) // ps) for s, n in zip(starts, lens)]
        tables = np.full((rows, bucket(max(used), min_pages)), pool.num_pages, np.int32)
        toks = np.zeros((rows, t), np.int32)
        start = np.zeros(rows, np.int32)
        n_new = np.zeros(rows, np.int32)
        for i, (s0, n, u) in enumerate(zip(starts, lens, used)):
            ids = np.asarray(page_ids[i], np.int32)
            if n < 1 or s0 < 0 or ids.ndim != 1 or ids.shape[0] < u:
                raise ValueError(
                    f"row {i}: {n} tokens at {s0} with pages of shape {ids.shape} (needs >= 1 "
                    f"token at start >= 0 and {u} pages of {ps} tokens)"
                )
            if chunks is not None:
                if s0 % chunk:
                    raise ValueError(
                        f"row {i}: start={s0}: a recurrent prefill starts at a multiple of "
                        f"its chunk ({chunk} tokens, recurrent_chunk)"
                    )
                toks[i, :n] = chunks[i]
            tables[i, :u] = ids[:u]
            start[i], n_new[i] = s0, n
        if window_pages is not None and len(window_pages) != b:
            raise ValueError(f"{len(window_pages)} window page arrays for {b} rows")
        local, wtables = self._recurrent_windows(windows, window_pages, used, tables.shape)
        slot_ids = np.full(rows, slots.n, np.int32)  # padding rows: the padding slot
        slot_ids[:b] = slot_of
        zero = self.zero_state()
        conv = jnp.stack([jnp.asarray(s[0]) for s in states] + [zero[0]] * (rows - b))
        ssm = jnp.stack([jnp.asarray(s[1]) for s in states] + [zero[1]] * (rows - b))
        if wtables is not None:
            logits, out, slots.array, conv, ssm, bconv, bssm = cast(Any, pool).run_with(
                local,
                functools.partial(RECURRENT_PATTERN_ROWS, self.cfg, chunk),
                self._unrolled_params,
                toks,
                start,
                n_new,
                tables,
                wtables,
                conv,
                ssm,
                slots.array,
                slot_ids,
            )
        else:
            logits, out, slots.array, conv, ssm, bconv, bssm = pool.run(
                functools.partial(RECURRENT_ROWS, self.cfg, chunk),
                self._unrolled_params,
                toks,
                start,
                n_new,
                tables,
                conv,
                ssm,
                slots.array,
                slot_ids,
            )
        new = [(conv[i], ssm[i]) for i in range(b)]
        bounds = [(bconv[i], bssm[i]) for i in range(b)] if chunks is not None else []
        return logits, out, new, bounds, chunk

    def _pattern_forward(
        self,
        pool: PoolLike,
        windows: Sequence[Any],
        window_pages: Any,
        toks: Any,
        args: tuple,
        used: int,
        waiter: LayerWaiter | None,
    ) -> jax.Array:
        """:meth:`forward` of a patterned model: the full layers on ``pool`` with the page
        table, each local layer on its group's pool with its window table."""
        table = args[2]
        wp = np.asarray(window_pages, np.int32)
        if wp.ndim != 2 or wp.shape[0] != len(windows) or wp.shape[1] < used:
            raise ValueError(
                f"window_pages has shape {wp.shape}; needs [{len(windows)}, >= {used}]"
            )
        wtables = np.empty((len(windows), table.shape[0]), np.int32)
        for g, wpool in enumerate(windows):
            wtables[g] = wpool.num_pages  # its scratch page
            wtables[g, :used] = np.where(wp[g, :used] < 0, wpool.num_pages, wp[g, :used])
        if waiter is None:
            return cast(Any, pool).run_with(
                windows,
                functools.partial(PATTERN_STEP, self.cfg),
                self._unrolled_params,
                toks,
                *args,
                wtables,
            )
        x = EMBED(self.params, toks)
        for layer, (g, i, local) in enumerate(self.plan):
            lp = self._layer_params[layer]
            # Waiting any full layer also waits the window groups' copies.
            waiter.wait_layer(i if g < 0 else 0)
            if g < 0:
                x = pool.run(self._layer, jnp.int32(i), lp, x, *args)
            else:
                step = functools.partial(LOCAL_LAYER, self.cfg, local)
                x = windows[g].run(step, jnp.int32(i), lp, x, *args[:2], wtables[g])
        return self._head(self.params, x, args[1])

    def forward_batch(
        self,
        pool: PoolLike,
        chunks,
        starts,
        page_ids,
        *,
        waiter: LayerWaiter | None = None,
        query_block: int = 32,
        key_block: int = 128,
        min_pages: int = 1,
        min_batch: int = 1,
        layerwise_if_compiled: bool = False,
        reuse_compiled: bool = False,
        slots: TokenSlots | None = None,
        slot_of=None,
        from_slot=None,
        windows: Sequence[Any] = (),
        window_pages=None,
    ) -> tuple[jax.Array, jax.Array]:
        """One packed step over several requests' chunks (prefill chunks and decode tokens
        alike): each chunk's K/V into its pages, the last token's logits of each chunk.

        The chunks' tokens are packed one after another into flat rows (the prefill chunks'
        padded to ``fine_bucket`` of their count, then a slot per decode token: see ``pack``),
        so the dense layers see no padding between requests. Attention runs in two row groups:
        chunks of more than one token cut into query blocks of ``query_block`` slots, and
        one-token chunks (decode) in rows of one slot. A row reads its request's pages in key
        blocks of ``key_block`` tokens, only up to the block of its last query (split-K work
        items, merged per row), so it pays neither for the step's longest row nor for the keys
        past its causal frontier. Compiles stay bounded by the buckets (``fine_bucket`` rows and
        work items a group). Every chunk's K/V is written before any is read, and each token
        attends to positions up to its own, so a block sees the blocks before it.

        Args:
            pool: the device pool (donated and rebound by ``pool.run``).
            chunks: B int arrays (numpy), chunk ``b`` at positions ``starts[b] ..``; each >= 1.
            starts: B ints: positions ``0 .. starts[b]-1`` of request b already hold K/V.
            page_ids: B int arrays, request b's pages in position order (>= the pages its
                positions up to the chunk's end need; only those are used).
            waiter: a layer-wise load handle (as :meth:`forward`); None -> one fused jit.
            query_block: query slots of a prefill row (a power of two).
            key_block: tokens of a key block (rounded down to whole pages, at least one).
            min_pages / min_batch: smallest bucket of a group's key blocks, counted in pages /
                of the flat tokens.
            layerwise_if_compiled: with a ``waiter``, run layer by layer only when this step's
                shapes have per-layer executables already, or have no fused one either (a
                compile is due anyway); otherwise wait for every layer, then run the fused
                step. The per-layer path then never compiles a shape the fused one has: it runs
                only when a load-back is pending, so a warm-up sees few of its shapes, and a
                compile in a timed run stalls every running request (~0.9 s on CPU).
            reuse_compiled: when this step's shapes have no executable, run it padded into
                the cheapest compiled fused shape that holds every part of it (as many or more
                flat tokens, rows, work items and shared blocks a group; at most
                ``REUSE_COST_LIMIT`` x the work), if any, instead of compiling (padding sees
                nothing: the results are the same). Steady serving: a compile stalls every
                running request.
            slots: a :class:`TokenSlots` buffer: chunk ``b``'s sampled token is written to slot
                ``slot_of[b]`` on the device, and a chunk with ``from_slot[b]`` (one token)
                takes its token from that slot instead of ``chunks[b]`` (whose value is then
                ignored): the last token sampled there, by an earlier step that may still be
                running. None: no slot is read or written.
            slot_of: B ints, each chunk's slot (with ``slots``).
            from_slot: B bools, which chunks read their token from their slot (default none).
            windows: a patterned model's window group pools (``HiCache.window_pools``): the
                fused step runs through ``pool.run_with``, the per-layer one a pool a layer.
            window_pages: B int arrays ``[G, >= pages used]``, each window group's page of each
                of request b's pages (``HiCache.window_pages``; -1: the group keeps none, read
                as its scratch page, which the window masks out).

        Returns:
            (float32 ``[R, vocab]`` logits, int32 ``[R]`` greedy tokens), row ``b < B`` for
            chunk ``b``; rows ``>= B`` are padding. Jax arrays, not synchronized.
        """
        self._not_recurrent("forward_batch")
        b = len(chunks)
        if b < 1 or len(starts) != b or len(page_ids) != b:
            raise ValueError(
                f"need >= 1 chunk and one start and page list each, got {b} "
                f"chunks, {len(starts)} starts, {len(page_ids)} page lists"
            )
        if query_block < 1 or bucket(query_block) != query_block:
            raise ValueError(f"query_block={query_block!r} must be a power of two >= 1")
        if not isinstance(key_block, int) or key_block < 1:
            raise ValueError(f"key_block={key_block!r} must be an int >= 1 (tokens)")
        ps, scratch = self._page_size(pool), pool.num_pages
        starts = [int(s) for s in starts]
        lens, used = lens_used(chunks, starts, ps)
        for i, (s, n, u) in enumerate(zip(starts, lens, used)):
            if n < 1 or s < 0 or np.shape(page_ids[i])[0] < u:
                raise ValueError(
                    f"request {i}: chunk of {n} tokens at {s} with "
                    f"{np.shape(page_ids[i])[0]} pages (needs >= 1 token at "
                    f"start >= 0 and {u} pages of {ps} tokens)"
                )
        self._window_args(windows, window_pages, "window_pages")
        page_maps = None
        if self.plan:
            if len(window_pages) != b:
                raise ValueError(f"window_pages: {len(window_pages)} arrays for {b} chunks")
            page_maps = np.empty((len(windows), scratch + 1), np.int32)
            for g, wpool in enumerate(windows):
                page_maps[g] = wpool.num_pages  # its scratch page
            for i, u in enumerate(used):
                wp = np.asarray(window_pages[i], np.int32)
                if wp.ndim != 2 or wp.shape[0] != len(windows) or wp.shape[1] < u:
                    raise ValueError(
                        f"window_pages[{i}] has shape {wp.shape}; needs [{len(windows)}, >= {u}]"
                    )
                ids = np.asarray(page_ids[i], np.int32)[:u]
                page_maps[:, ids] = np.where(
                    wp[:, :u] < 0, page_maps[:, scratch : scratch + 1], wp[:, :u]
                )
        feed_in = check_slots(slots, slot_of, from_slot, lens)
        key, rows = _step_shape(
            self.cfg,
            lens,
            starts,
            page_ids,
            ps,
            query_block,
            key_block,
            min_pages,
            min_batch,
            feed_in[0],
        )
        if (
            reuse_compiled
            and (key, "fused") not in _RAN
            and (waiter is None or (key, "layers") not in _RAN)
        ):
            key = _cover(key) or key
        toks, pos, wpage, groups, tok_slot, out_idx = pack(
            chunks, starts, page_ids, lens, used, ps, scratch, key[0], rows
        )
        tok_src, out_slot = feed_arrays(toks.shape[0], out_idx, *feed_in)
        # Every int32 argument in one host buffer: one transfer a step (the jit's C++ dispatch
        # moves a numpy argument to the device at ~10 us each; a jnp.asarray costs ~40 us).
        layout, blob = flatten(
            (
                toks,
                pos,
                wpage,
                *[a for g in groups for a in g],
                tok_slot,
                out_idx,
                tok_src,
                out_slot,
            )
        )
        buf = feed_in[0]
        if (
            waiter is not None
            and (layerwise_if_compiled or reuse_compiled)
            and (key, "layers") not in _RAN
            and (key, "fused") in _RAN
        ):
            for layer in range(self.cfg.kv_spec(1).num_layers):  # the full pool's layers
                waiter.wait_layer(layer)
            waiter = None
        if waiter is None and page_maps is not None:
            _ran(key, "fused")
            logits, out, buf = cast(Any, pool).run_with(
                windows,
                functools.partial(PATTERN_BATCH_STEP, self.cfg, layout),
                self._unrolled_params,
                blob,
                buf,
                page_maps,
            )
        elif waiter is None:
            _ran(key, "fused")
            logits, out, buf = pool.run(
                functools.partial(BATCH_STEP, self.cfg, layout),
                self._fused_params(toks.shape[0]),
                blob,
                buf,
            )
        elif page_maps is not None:
            _ran(key, "layers")
            blob = jax.device_put(blob)  # once, for every layer's call
            x = BATCH_EMBED(layout, self.params, blob, buf)
            step = functools.partial(BATCH_LAYER, self.cfg, layout)
            for layer, (g, i, local) in enumerate(self.plan):
                lp = self._layer_params[layer]
                waiter.wait_layer(i if g < 0 else 0)  # (any layer waits the window groups too)
                if g < 0:
                    x = pool.run(step, jnp.int32(i), lp, x, blob)
                else:
                    local_step = functools.partial(LOCAL_BATCH_LAYER, self.cfg, layout, local)
                    x = windows[g].run(local_step, jnp.int32(i), lp, x, blob, page_maps[g])
            logits, out, buf = BATCH_HEAD(self.cfg, layout, self.params, x, blob, buf)
        else:
            _ran(key, "layers")
            blob = jax.device_put(blob)  # once, for every layer's call
            x = BATCH_EMBED(layout, self.params, blob, buf)
            step = functools.partial(BATCH_LAYER, self.cfg, layout)
            for layer, lp in enumerate(self._layer_params):
                waiter.wait_layer(layer)
                x = pool.run(step, jnp.int32(layer), lp, x, blob)
            logits, out, buf = BATCH_HEAD(self.cfg, layout, self.params, x, blob, buf)
        if slots is not None:
            slots.array = buf
        return logits, out

    def batch_shape(
        self,
        pool: PoolLike,
        chunks,
        starts,
        page_ids,
        *,
        query_block: int = 32,
        key_block: int = 128,
        min_pages: int = 1,
        min_batch: int = 1,
        slots: TokenSlots | None = None,
    ) -> tuple:
        """The shapes (hashable) :meth:`forward_batch` would compile for these chunks (its
        arguments; the page lists decide the key blocks the rows share)."""
        ps = self._page_size(pool)
        starts = [int(s) for s in starts]
        lens, _ = lens_used(chunks, starts, ps)
        return _step_shape(
            self.cfg,
            lens,
            starts,
            page_ids,
            ps,
            query_block,
            key_block,
            min_pages,
            min_batch,
            NO_SLOTS if slots is None else slots.array,
        )[0]

    @staticmethod
    def batch_compiled(shape: tuple, *, reuse: bool = False) -> bool:
        """Whether a fused step of ``shape`` (:meth:`batch_shape`) ran before, in any model of
        its config: :meth:`forward_batch` would reuse its executable rather than compile.
        ``reuse``: or a compiled shape holds it (``forward_batch(reuse_compiled=True)``)."""
        return (shape, "fused") in _RAN or (reuse and _cover(shape) is not None)

    @staticmethod
    def _page_size(pool: PoolLike) -> int:
        spec = getattr(pool, "spec", None)
        return spec.page_size if spec is not None else int(pool.array.shape[3])


def _layer_slice(stacked: Any, layer: int) -> Any:
    """Layer ``layer`` of a stacked weight; of a ``jax.ShapeDtypeStruct`` (``abstract_params``:
    a model for lowering only), its shape without the layer axis."""
    if isinstance(stacked, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(stacked.shape[1:], stacked.dtype)
    return stacked[layer]


#: (config, packed shapes) x ("fused" | "layers") of every batched step run so far: the jits are
#: module-level, so a shape one model ran is compiled for every model of the same config.
_RAN: set[tuple[Any, str]] = set()
#: shape -> packing.cover's answer over _RAN as it is (cleared when _RAN grows): a step shape
#: with no executable of its own recurs, and the engine asks before forward_batch does.
_COVERS: dict[tuple, tuple | None] = {}


@contextlib.contextmanager
def step_records_kept() -> Iterator[None]:
    """Within the block, steps dispatched to a pool that only records them (a lowering tool's:
    nothing runs) leave no trace: the shapes :meth:`DecoderModel.forward_batch` notes as run
    (and would later reuse as compiled) and :data:`TRACES` are restored on exit."""
    ran, covers, traces = set(_RAN), dict(_COVERS), TRACES.copy()
    try:
        yield
    finally:
        _RAN.clear()
        _RAN.update(ran)
        _COVERS.clear()
        _COVERS.update(covers)
        TRACES.clear()
        TRACES.update(traces)


def _ran(key: tuple, kind: str) -> None:
    if (key, kind) not in _RAN:
        _RAN.add((key, kind))
        _COVERS.clear()


def _cover(shape: tuple) -> tuple | None:
    if shape not in _COVERS:
        _COVERS[shape] = cover(shape, _RAN)
    return _COVERS[shape]


def _step_shape(
    cfg: ModelConfig,
    lens: list[int],
    starts: list[int],
    page_ids,
    ps: int,
    qb: int,
    key_block: int,
    min_pages: int,
    min_batch: int,
    slot_buf,
) -> tuple:
    """``(shape, rows)`` of a packed step: :func:`packing.plan`'s key with the slot buffer's size
    and the page size (part of the compiled shapes too), and its rows."""
    key, rows = plan(cfg, lens, starts, page_ids, ps, qb, key_block, min_pages, min_batch)
    return (key, slot_buf.shape[0], ps), rows
