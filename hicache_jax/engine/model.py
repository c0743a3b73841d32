"""DecoderModel: a small Llama-style decoder whose attention reads K/V straight from the paged
device pool; the host side of a forward (bucketing, page tables, dispatch).

The size and weights are in :mod:`hicache_jax.engine.weights`, the layer math and the jitted steps
in :mod:`hicache_jax.engine.layers`; this module pads a call's tokens and page tables to buckets
and dispatches the steps through ``DevicePagePool.run`` so the pool object keeps the only
reference to its (donated) array. The public names of both modules are re-exported here.

Two ways to run a forward over the same layer math:

* fused: one jit for embedding, all layers (``lax.scan`` over stacked layer weights) and head;
* per layer: embedding, then one donated jit per layer, then the head, so a caller can wait for
  layer ``l``'s pages (``handle.wait_layer(l)``) just before running layer ``l`` while later layers
  are still being loaded back from host.

Token counts are padded to power-of-two buckets (at most ``chunk`` tokens) and page tables to
power-of-two page counts, so the number of compiles stays logarithmic in prompt length.
:meth:`DecoderModel.forward_batch` (the batched engine's one call a step) packs several requests'
prefill chunks and decode tokens into one flat token list, bucketed as a whole (see there).

Threading: every call dispatches on the caller's thread, which must be the thread that owns the
pool (DESIGN rule 4).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.engine.layers import (BATCH_HEAD, BATCH_LAYER, BATCH_STEP, EMBED, HEAD, LAYER,
                                       STEP, TRACES, compiled_step_count, reference_logits,
                                       trace_count)
from hicache_jax.engine.weights import (ModelConfig, Params, flat_params, init_params,
                                        load_params, save_params, unflatten_params)
from hicache_jax.spec import KVSpec

__all__ = ["DecoderModel", "LayerWaiter", "ModelConfig", "Params", "PoolLike", "TRACES",
           "bucket", "compiled_step_count", "fine_bucket", "flat_params", "init_params",
           "load_params", "reference_logits", "save_params", "trace_count", "unflatten_params"]

# The stateful shell: bucketing on the host, dispatch through the pool's donated run().


class PoolLike(Protocol):
    """What the model needs of a device pool (hicache_jax.device_pool.DevicePagePool)."""

    num_pages: int

    def run(self, fn: Callable, *args: Any) -> Any: ...


class LayerWaiter(Protocol):
    def wait_layer(self, layer: int) -> Any: ...


def bucket(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def fine_bucket(n: int, minimum: int = 1) -> int:
    """Smallest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (2^k and 3 * 2^k) >= max(n, minimum):
    at most 1.5x padding, two buckets per octave."""
    n = max(int(n), minimum)
    p = bucket(n)
    return p * 3 // 4 if p >= 4 and n <= p * 3 // 4 else p


class DecoderModel:
    """Weights plus the jitted steps over the paged pool.

    Args:
        cfg: model size.
        params: weights from :func:`init_params` / :func:`load_params`; None -> ``init_params(cfg, seed)``.
        seed: used when ``params`` is None.
    """

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, seed: int = 0) -> None:
        self.cfg = cfg
        self.params = init_params(cfg, seed) if params is None else params
        # Per-layer weight slices, sliced once here (not per call) for the per-layer path.
        self._layer_params = [{k: v[i] for k, v in self.params["layers"].items()}
                              for i in range(cfg.num_layers)]
        # Module-level jits with the config static: models of equal config share compiles.
        self._step = functools.partial(STEP, cfg)
        self._layer = functools.partial(LAYER, cfg)
        self._head = functools.partial(HEAD, cfg)
        self._batch_step = functools.partial(BATCH_STEP, cfg)
        self._batch_layer = functools.partial(BATCH_LAYER, cfg)
        self._batch_head = functools.partial(BATCH_HEAD, cfg)

    def kv_spec(self, page_size: int) -> KVSpec:
        return self.cfg.kv_spec(page_size)

    def forward(self, pool: PoolLike, tokens, start: int, page_ids, *,
                waiter: LayerWaiter | None = None, min_bucket: int = 1,
                min_pages: int = 1) -> jax.Array:
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

        Returns:
            float32 [vocab] logits of the last token (a jax array, not synchronized).
        """
        n = int(tokens.shape[0])
        ps = self._page_size(pool)
        if n < 1 or start < 0:
            raise ValueError(f"need >= 1 token at start >= 0, got n={n}, start={start}")
        used = -(-(start + n) // ps)
        page_ids = np.asarray(page_ids, np.int32)
        if page_ids.ndim != 1 or page_ids.shape[0] < used:
            raise ValueError(f"page_ids has shape {page_ids.shape}; positions 0..{start + n - 1} "
                             f"need {used} pages of {ps} tokens")
        table = np.full(bucket(used, min_pages), pool.num_pages, np.int32)
        table[:used] = page_ids[:used]
        tb = bucket(n, min_bucket)
        if isinstance(tokens, np.ndarray):
            toks = np.zeros(tb, np.int32)
            toks[:n] = tokens
        elif tb != n:
            toks = jnp.pad(jnp.asarray(tokens, jnp.int32), (0, tb - n))
        else:
            toks = tokens  # a device token from the previous decode step: no host round trip
        args = (jnp.int32(start), jnp.int32(n), table)
        if waiter is None:
            return pool.run(self._step, self.params, toks, *args)
        x = EMBED(self.params, toks)
        for layer, lp in enumerate(self._layer_params):
            waiter.wait_layer(layer)
            x = pool.run(self._layer, jnp.int32(layer), lp, x, *args)
        return self._head(self.params, x, jnp.int32(n))

    def forward_batch(self, pool: PoolLike, chunks, starts, page_ids, *,
                      waiter: LayerWaiter | None = None, query_block: int = 32,
                      key_block: int = 128, min_pages: int = 1, min_batch: int = 1,
                      layerwise_if_compiled: bool = False) -> tuple[jax.Array, jax.Array]:
        """One packed step over several requests' chunks (prefill chunks and decode tokens
        alike): each chunk's K/V into its pages, the last token's logits of each chunk.

        The chunks' tokens are packed one after another into flat rows (the prefill chunks'
        padded to ``fine_bucket`` of their count, then a slot per decode token: see ``_pack``),
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

        Returns:
            (float32 ``[R, vocab]`` logits, int32 ``[R]`` greedy tokens), row ``b < B`` for
            chunk ``b``; rows ``>= B`` are padding. Jax arrays, not synchronized.
        """
        b = len(chunks)
        if b < 1 or len(starts) != b or len(page_ids) != b:
            raise ValueError(f"need >= 1 chunk and one start and page list each, got {b} "
                             f"chunks, {len(starts)} starts, {len(page_ids)} page lists")
        if query_block < 1 or bucket(query_block) != query_block:
            raise ValueError(f"query_block={query_block!r} must be a power of two >= 1")
        if not isinstance(key_block, int) or key_block < 1:
            raise ValueError(f"key_block={key_block!r} must be an int >= 1 (tokens)")
        ps, scratch = self._page_size(pool), pool.num_pages
        starts = [int(s) for s in starts]
        lens, used = _lens_used(chunks, starts, ps)
        for i, (s, n, u) in enumerate(zip(starts, lens, used)):
            if n < 1 or s < 0 or np.shape(page_ids[i])[0] < u:
                raise ValueError(f"request {i}: chunk of {n} tokens at {s} with "
                                 f"{np.shape(page_ids[i])[0]} pages (needs >= 1 token at "
                                 f"start >= 0 and {u} pages of {ps} tokens)")
        key, rows = _plan(self.cfg, lens, starts, page_ids, ps, query_block, key_block,
                          min_pages, min_batch)
        packed = _pack(chunks, starts, page_ids, lens, used, ps, scratch, key, rows)
        # numpy arguments go to the jit as they are: its C++ dispatch moves them to the device
        # (a jnp.asarray each would cost ~40 us of Python per array, per step).
        toks, rest = packed[0], packed[1:]
        if (waiter is not None and layerwise_if_compiled and (key, "layers") not in _RAN
                and (key, "fused") in _RAN):
            for layer in range(self.cfg.num_layers):
                waiter.wait_layer(layer)
            waiter = None
        if waiter is None:
            _RAN.add((key, "fused"))
            return pool.run(self._batch_step, self.params, toks, *rest)
        _RAN.add((key, "layers"))
        x = EMBED(self.params, toks)
        for layer, lp in enumerate(self._layer_params):
            waiter.wait_layer(layer)
            x = pool.run(self._batch_layer, jnp.int32(layer), lp, x, *rest[:-1])
        return self._batch_head(self.params, x, rest[-1])

    def batch_shape(self, pool: PoolLike, chunks, starts, page_ids, *, query_block: int = 32,
                    key_block: int = 128, min_pages: int = 1, min_batch: int = 1) -> tuple:
        """The shapes (hashable) :meth:`forward_batch` would compile for these chunks (its
        arguments; the page lists decide the key blocks the rows share)."""
        ps = self._page_size(pool)
        starts = [int(s) for s in starts]
        lens, _ = _lens_used(chunks, starts, ps)
        return _plan(self.cfg, lens, starts, page_ids, ps, query_block, key_block, min_pages,
                     min_batch)[0]

    @staticmethod
    def batch_compiled(shape: tuple) -> bool:
        """Whether a fused step of ``shape`` (:meth:`batch_shape`) ran before, in any model of
        its config: :meth:`forward_batch` would reuse its executable rather than compile."""
        return (shape, "fused") in _RAN

    @staticmethod
    def _page_size(pool: PoolLike) -> int:
        spec = getattr(pool, "spec", None)
        return spec.page_size if spec is not None else int(pool.array.shape[3])


#: (config, packed shapes) x ("fused" | "layers") of every batched step run so far: the jits are
#: module-level, so a shape one model ran is compiled for every model of the same config.
_RAN: set[tuple[Any, str]] = set()


def _lens_used(chunks, starts, ps: int) -> tuple[list[int], list[int]]:
    """Each chunk's tokens, and the pages its positions up to the chunk's end take."""
    lens = [int(np.shape(c)[0]) for c in chunks]
    return lens, [-(-(int(s) + n) // ps) for s, n in zip(starts, lens)]


def _rows(lens: list[int], starts: list[int], qb: int) -> tuple[list, list]:
    """The attention rows of a packed step, per group (prefill query blocks, decode tokens):
    ``(chunk, offset in the chunk, tokens, first query's position, keys the row sees)``."""
    groups: tuple[list, list] = ([], [])
    for i, (n, s0) in enumerate(zip(lens, starts)):
        rows = groups[0] if n > 1 else groups[1]
        rows.extend((i, j, min(qb, n - j), s0 + j, s0 + min(j + qb, n)) for j in range(0, n, qb))
    return groups


def _shared_blocks(rows: list, page_ids, kb: int, span: int) -> int:
    """Leading key blocks the rows of a group all read (the same pages) and all see whole
    (every row's first query lies past them): computed once for the group (cascade), not once
    a row. 0 for fewer than two requests' rows (nothing to share)."""
    if len({r[0] for r in rows}) < 2:
        return 0
    cand = min(r[3] for r in rows) // span
    if cand == 0:
        return 0
    ref = np.asarray(page_ids[rows[0][0]][:cand * kb])
    for i in {r[0] for r in rows}:
        diff = np.flatnonzero(np.asarray(page_ids[i][:cand * kb]) != ref)
        if diff.size:
            cand = min(cand, int(diff[0]) // kb)
            if cand == 0:
                return 0
            ref = ref[:cand * kb]
    return cand


def _plan(cfg: ModelConfig, lens: list[int], starts: list[int], page_ids, ps: int, qb: int,
          key_block: int, min_pages: int, min_batch: int) -> tuple[tuple, tuple]:
    """The packed step's layout: ``(key, ((prefill rows, their shared blocks), (decode rows,
    theirs)))``, rows as :func:`_rows` gives them.

    The key is what decides the step's shapes (see :func:`_pack`): the config, the flat prefill
    and decode slots, the prefill rows, the query block, the work items of each group (a row's
    key blocks of ``kb`` pages, ``key_block`` tokens rounded down to whole pages, up to its last
    query, minus the group's shared blocks; at least ``min_pages`` pages' worth), the shared
    blocks of each group, and ``kb``."""
    pre, dec = _rows(lens, starts, qb)
    kb = max(1, key_block // ps)
    span, min_items = kb * ps, -(-min_pages // kb)
    nd = 0 if not dec else bucket(len(dec)) if pre else fine_bucket(len(dec), min_batch)
    work, shared = [], []  # per group: its rows' own work items, its shared blocks
    # Work items bucket as the group's rows do: the decode group's beside a prefill by powers
    # of two (the shapes a mixed step compiles stay few).
    for rows, fit in ((pre, fine_bucket), (dec, bucket if pre else fine_bucket)):
        sh = _shared_blocks(rows, page_ids, kb, span)
        w = sum(-(-r[4] // span) - sh for r in rows)
        work += [fit(w, min_items) if rows else 0, fine_bucket(sh) if sh else 0]
        shared.append(sh)
    key = (cfg, fine_bucket(sum(n for n in lens if n > 1), min_batch) if pre else 0, nd,
           fine_bucket(len(pre)) if pre else 0, qb, *work, kb)
    return key, ((pre, shared[0]), (dec, shared[1]))


def _pack(chunks, starts, page_ids, lens, used, ps, scratch, key, rows):
    """Host arrays of :meth:`DecoderModel.forward_batch`'s packed step of layout ``key, rows``
    (:func:`_plan`): flat tokens, their positions and K/V pages, the row groups
    ``((src, item_row, item_pages, item_k0, shared_pages, shared_k0), ...)``, each token's
    slot, and each chunk's last flat token (``[prefill rows + decode rows]``; padding repeats
    row 0).

    The flat tokens are the prefill chunks' (padded to ``fine_bucket`` of their count), then one
    slot per decode row (``fine_bucket`` rows in a decode-only step, a power of two beside a
    prefill): a full token budget plus the decode rows does not jump to the next bucket, and
    the shapes a mixed step compiles stay few. A row's work items are its request's pages in
    blocks of ``kb``, up to the page of its last query, after the group's shared blocks
    (padding items and padding shared blocks see nothing)."""
    _, np_, nd, rp, qb, wp, sp, wd, sd, kb = key
    span = kb * ps
    never = 1 << 30  # the first key of a padding item: past every position
    nflat = np_ + nd
    toks = np.zeros(nflat, np.int32)
    pos = np.zeros(nflat, np.int32)
    wpage = np.full(nflat, scratch, np.int32)
    tok_slot = np.zeros(nflat, np.int32)
    out_idx = np.zeros(rp + nd, np.int32)
    first = {}  # chunk -> its first flat token: prefill chunks first, then the decode tokens
    for group, off in ((True, 0), (False, np_)):
        for i, n in enumerate(lens):
            if (n > 1) != group:
                continue
            p = np.arange(starts[i], starts[i] + n, dtype=np.int32)
            toks[off:off + n] = chunks[i]
            pos[off:off + n] = p
            wpage[off:off + n] = np.asarray(page_ids[i], np.int32)[p // ps]
            out_idx[i] = off + n - 1
            first[i] = off
            off += n
    groups, base = [], 0
    (pre, sh_pre), (dec, sh_dec) = rows
    for rows, sh, tq, r, w, ws in ((pre, sh_pre, qb, rp, wp, sp), (dec, sh_dec, 1, nd, wd, sd)):
        if not rows:
            continue
        src = np.empty((r, tq), np.int32)
        item_row = np.zeros(w, np.int32)
        item_pages = np.full((w, kb), scratch, np.int32)
        item_k0 = np.full(w, never, np.int32)
        sh_pages = np.full((ws, kb), scratch, np.int32)
        sh_k0 = np.full(ws, never, np.int32)
        if sh:
            sh_pages[:sh] = np.asarray(page_ids[rows[0][0]][:sh * kb], np.int32).reshape(sh, kb)
            sh_k0[:sh] = np.arange(sh, dtype=np.int32) * span
        slots = np.arange(tq, dtype=np.int32)
        it = 0
        for k, (i, j, n, _, keys) in enumerate(rows):
            f = first[i] + j
            src[k] = f + np.minimum(slots, n - 1)  # padding slots repeat the last token
            tok_slot[f:f + n] = base + k * tq + slots[:n]
            n_it = -(-keys // span)
            pages = np.full(n_it * kb, scratch, np.int32)
            m = min(used[i], n_it * kb)
            pages[:m] = np.asarray(page_ids[i][:m], np.int32)
            own = n_it - sh
            item_pages[it:it + own] = pages.reshape(n_it, kb)[sh:]
            item_row[it:it + own] = k
            item_k0[it:it + own] = np.arange(sh, n_it, dtype=np.int32) * span
            it += own
        src[len(rows):] = src[0]
        groups.append((src, item_row, item_pages, item_k0, sh_pages, sh_k0))
        base += r * tq
    return toks, pos, wpage, tuple(groups), tok_slot, out_idx
