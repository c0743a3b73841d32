"""The decoder's layer math and its jitted paged steps (pure functions; no state but a trace
counter).

RMSNorm, rotary position embedding, grouped-query attention, SwiGLU. The KV cache is the device
pool of hicache_jax, raw bits of layout
``[num_layers, kv=2, num_pages + 1, page_size, num_kv_heads, head_dim]`` (page ``num_pages`` is
the scratch page bucket padding points at). A forward step is a pure jitted function
``step(cfg, pool, params, tokens, start, n_new, page_table) -> (pool, logits)`` with the config
static and the pool donated: it writes the new tokens' K/V into their pages in place (a
per-token scatter of bits) and each layer's attention gathers only the request's pages through
its page table and views them as the compute dtype with ``lax.bitcast_convert_type`` inside the
jit (the pool is never copied or converted as a whole). Callers dispatch them through
``DevicePagePool.run`` so the pool object keeps the only reference (see
:class:`hicache_jax.engine.model.DecoderModel`).

The jitted entry points: :data:`STEP` (fused: embedding, all layers by ``lax.scan`` over the
stacked layer weights, or unrolled over per-layer ones for a step of few tokens, head),
:data:`EMBED` / :data:`LAYER` / :data:`HEAD` (the same layer by layer, so a caller can wait for a
layer's pages before running it), and their batched forms
:data:`BATCH_STEP` / :data:`BATCH_EMBED` / :data:`BATCH_LAYER` / :data:`BATCH_HEAD`: a packed step
over the flat tokens of several requests' chunks (prefill and decode in one call), the dense
parts over the flat tokens, attention per row group (prefill query blocks, decode rows), each
row over its request's pages in key blocks up to its last query (split-K work items, merged per
row; blocks every row shares run once). A packed step reads decode tokens the host has not seen
yet from a small device buffer of each request slot's last sampled token and writes its own
sampled tokens there, so the next step can be dispatched before this one's tokens reach the
host (the batched engine's overlap). :func:`reference_logits` is the dense oracle over the same
math.

A config with a ``layer_pattern`` (:func:`layer_plan`: which pool and mask each layer has) runs
through :data:`PATTERN_STEP` / :data:`PATTERN_BATCH_STEP` (layers unrolled, the full pool and
the window group pools donated together) or, per layer, :data:`LAYER` / :data:`BATCH_LAYER`
for full layers and :data:`LOCAL_LAYER` / :data:`LOCAL_BATCH_LAYER` for local ones; a local
layer's query at ``t`` sees keys from ``t - window`` (or ``t``'s chunk start) to ``t``.

A recurrent pattern (``layer_pattern="R3:F1"``, :func:`recurrent_plan`) runs through
:data:`RECURRENT_STEP`: the full layers on the full pool, the recurrent layers
(:mod:`hicache_jax.engine.recurrent`) over the request's own state, which the step takes and
returns with the states at every chunk boundary of a prefill (the cache's checkpoints);
:data:`RECURRENT_ROWS` runs a chunk of each of several requests (prefill chunks, or one
decode token each) in one step.

Threading: the jitted steps dispatch on the caller's thread, which must own the pool
(ARCHITECTURE.md: one dispatching thread); :data:`TRACES` is only written at trace time.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hicache_jax.engine.recurrent import recurrent_chunked, recurrent_step
from hicache_jax.engine.weights import ModelConfig, Params

# ---------------------------------------------------------------------------------------------
# Layer math shared by the fused and the per-layer paths, and by the dense reference.


def _rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    y = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = w.astype(jnp.float32).reshape((1,) * (x.ndim - 1) + w.shape)
    return (y * w).astype(x.dtype)


def _rope(x: jax.Array, pos: jax.Array, theta: float) -> jax.Array:
    """Rotate-half RoPE. x: [T, H, D]; pos: int32 [T]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)  # [D/2]
    ang = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]  # [T, 1, D/2]
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _qkv(cfg: ModelConfig, lp: Params, x: jax.Array, pos: jax.Array):
    """x [T, d] -> normed q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D] (RoPE applied)."""
    t = x.shape[0]
    h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps)
    q = (h @ lp["wq"]).reshape(t, cfg.num_heads, cfg.head_dim)
    k = (h @ lp["wk"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    v = (h @ lp["wv"]).reshape(t, cfg.num_kv_heads, cfg.head_dim)
    return _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta), v


def _attend(
    cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array
) -> jax.Array:
    """GQA. q [T, Hq, D]; k, v [S, Hkv, D]; mask bool [T, S] -> [T, Hq*D] in q.dtype."""
    t = q.shape[0]
    g = cfg.num_heads // cfg.num_kv_heads
    qg = q.reshape(t, cfg.num_kv_heads, g, cfg.head_dim)
    scores = jnp.einsum("tkgd,skd->kgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(cfg.head_dim))
    scores = jnp.where(mask[None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # Masked keys may come from the scratch page or stale pages: zero them so 0 * garbage
    # (NaN/inf) cannot leak into the output.
    v = jnp.where(mask.any(axis=0)[:, None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("kgts,skd->tkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(t, cfg.num_heads * cfg.head_dim).astype(q.dtype)


def _mlp(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    h = _rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
    return (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


def _paged_layer(
    cfg: ModelConfig,
    pool: jax.Array,
    layer: jax.Array | int,
    lp: Params,
    x: jax.Array,
    start: jax.Array,
    n_new: jax.Array,
    page_table: jax.Array,
    local: Local = None,
):
    """One decoder layer over a chunk, K/V written to and read from the paged pool.

    Args:
        pool: bits [L, 2, P+1, ps, Hkv, D] (donated by the caller's jit).
        layer: int32 scalar (or an int, unrolled), which layer of the pool.
        lp: this layer's weights (unstacked).
        x: [T, d] residual stream of the chunk (T is the bucket; rows >= n_new are padding).
        start: int32 scalar, position of x[0].
        n_new: int32 scalar, valid rows of x.
        page_table: int32 [Pb], the request's pages for positions 0 .. Pb*ps-1; entries past the
            request's pages point at the scratch page.
        local: a local-attention layer's mask (:data:`Local`; its pages those of its window
            group's pool); None: full attention.

    Returns:
        (pool with the chunk's K/V written, x after the layer [T, d]).
    """
    t, ps = x.shape[0], pool.shape[3]
    scratch, n_pages = pool.shape[2] - 1, page_table.shape[0]
    rows = jnp.arange(t, dtype=jnp.int32)
    pos = start + rows
    valid = rows < n_new
    q, k, v = _qkv(cfg, lp, x, pos)
    # Padding rows write into the scratch page, never into a page of the request.
    wpage = jnp.where(valid, page_table[jnp.minimum(pos // ps, n_pages - 1)], scratch)
    off = pos % ps
    bits = pool.dtype
    pool = pool.at[layer, 0, wpage, off].set(lax.bitcast_convert_type(k, bits))
    pool = pool.at[layer, 1, wpage, off].set(lax.bitcast_convert_type(v, bits))
    # Gather only this request's pages (after the write, so the chunk sees itself) and view
    # the bits as the compute dtype: [Pb, ps, Hkv, D] -> [Pb*ps, Hkv, D].
    ctx_shape = (n_pages * ps, cfg.num_kv_heads, cfg.head_dim)
    kc = lax.bitcast_convert_type(pool[layer, 0, page_table], x.dtype).reshape(ctx_shape)
    vc = lax.bitcast_convert_type(pool[layer, 1, page_table], x.dtype).reshape(ctx_shape)
    kpos = jnp.arange(n_pages * ps, dtype=jnp.int32)
    mask = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] < start + n_new)
    if local is not None:
        mask = mask & (kpos[None, :] >= _local_start(local, pos)[:, None])
    x = x + _attend(cfg, q, kc, vc, mask) @ lp["wo"]
    return pool, x + _mlp(cfg, lp, x)


#: A local-attention layer's mask, static: ``("window", W)`` (the query at ``t`` sees keys
#: ``t - W .. t``) or ``("chunk", C)`` (keys ``t // C * C .. t``); None for a full layer.
Local = tuple[str, int] | None


def _local_start(local: tuple[str, int], pos: jax.Array) -> jax.Array:
    """The first key position queries at ``pos`` see in a local layer (``Local``)."""
    kind, size = local
    return pos - size if kind == "window" else (pos // size) * size


@functools.cache
def layer_plan(cfg: ModelConfig) -> tuple[tuple[int, int, Local], ...]:
    """Where each model layer's K/V lives, for a config with a ``layer_pattern``:
    ``(pool, index, local)`` per layer: ``pool`` -1 for the full-attention pool (``index`` its
    layer there), else the window group's number in ``KVSpec.window_groups`` order (the
    cache's ``window_pools``), ``index`` the layer's place in that group's ``layers``; ``local``
    its mask (:data:`Local`). Empty for a config whose layers are all full attention."""
    spec = cfg.kv_spec(1)
    if not spec.window_groups or spec.state_groups:  # (a recurrent pattern: recurrent_plan)
        return ()
    plan: dict[int, tuple[int, int, Local]] = {
        layer: (-1, i, None) for i, layer in enumerate(spec.full_group.layers)
    }
    for g, group in enumerate(spec.window_groups):
        local: Local = (
            ("window", int(group.window))
            if group.window is not None
            else ("chunk", int(group.chunk or 0))
        )
        plan.update({layer: (g, i, local) for i, layer in enumerate(group.layers)})
    return tuple(plan[layer] for layer in range(cfg.num_layers))


def _embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def _head(cfg: ModelConfig, params: Params, x: jax.Array, n_new: jax.Array) -> jax.Array:
    """Logits (float32 [V]) of the last valid row of x [T, d]."""
    last = lax.dynamic_index_in_dim(x, n_new - 1, axis=0, keepdims=False)
    h = _rms_norm(last, params["final_norm"], cfg.norm_eps)
    return jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)


#: The default ``DecoderModel(unroll_tokens=)``: steps of at most this many (bucketed) tokens run
#: their layers unrolled over each layer's own weights (``params["per_layer"]``, see
#: :func:`_scan_layers`); longer ones in a ``lax.scan``.
UNROLL_TOKENS = 16


def _scan_layers(layer_fn, cfg, pool, params, x, *args):
    """Every decoder layer: ``layer_fn(cfg, pool, layer, lp, x, *args)`` returns ``(pool, x)``;
    the pool is carried, so each layer writes its K/V in place.

    Over stacked weights (``params["layers"]``) in one ``lax.scan``, whose body slices each
    layer's weights out of the stack: on XLA:CPU a copy of every weight each step, about the
    cost of a memcpy of the model, which is most of a small step's time. Given
    ``params["per_layer"]`` instead (a tuple of each layer's weights), the layers are unrolled
    with no slice: 0.7-0.8x the time of a decode step of 1-8 rows on CPU, but 1.0-1.16x that of
    a prefill of 64-256 tokens (``python -m benchmarks.bench_step``), hence
    :data:`UNROLL_TOKENS`."""
    if "per_layer" in params:
        for layer, lp in enumerate(params["per_layer"]):
            pool, x = layer_fn(cfg, pool, layer, lp, x, *args)
        return pool, x

    def body(carry, xs):
        pool, x = carry
        layer, lp = xs
        return layer_fn(cfg, pool, layer, lp, x, *args), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (pool, x), _ = lax.scan(body, (pool, x), (layers, params["layers"]))
    return pool, x


def _fused_step(cfg, pool, params, tokens, start, n_new, page_table):
    pool, x = _scan_layers(
        _paged_layer, cfg, pool, params, _embed(params, tokens), start, n_new, page_table
    )
    return pool, _head(cfg, params, x, n_new)


def reference_logits(cfg: ModelConfig, params: Params, tokens) -> jax.Array:
    """Dense (non-paged, no cache) forward: float32 logits [T, V] of every position.

    The test oracle for the paged paths: same math, plain causal attention over the prompt
    (local layers of a ``layer_pattern``: their window or chunk mask as well).
    """
    return _reference_jit(cfg, params, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _reference_jit(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    mask = pos[None, :] <= pos[:, None]
    x = _embed(params, tokens)
    plan = layer_plan(cfg)
    rplan = recurrent_plan(cfg)
    for i in range(cfg.num_layers):
        lp = {k: v[i] for k, v in params["layers"].items()}
        j = rplan[i] if rplan else None
        if j is not None and j >= 0:  # a recurrent layer, token by token from a zero state
            rp = {k: v[j] for k, v in params["recurrent"].items()}
            conv, ssm = zero_state(cfg, 1)
            h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps)
            y, _, _ = recurrent_step(rp, h, conv[0], ssm[0])
            x = x + y.astype(x.dtype)
            x = x + _mlp(cfg, lp, x)
            continue
        q, k, v = _qkv(cfg, lp, x, pos)
        entry = (plan or local_plan(cfg) or [None] * cfg.num_layers)[i]
        local = None if entry is None else entry[2]
        m = mask if local is None else mask & (pos[None, :] >= _local_start(local, pos)[:, None])
        x = x + _attend(cfg, q, k, v, m) @ lp["wo"]
        x = x + _mlp(cfg, lp, x)
    h = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    return jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)


def _group_attend(
    cfg: ModelConfig,
    pool: jax.Array,
    layer: jax.Array | int,
    q: jax.Array,
    dtype: Any,
    src: jax.Array,
    qpos: jax.Array,
    item_row: jax.Array,
    item_pages: jax.Array,
    item_k0: jax.Array,
    shared_pages: jax.Array,
    shared_k0: jax.Array,
    local: Local = None,
) -> jax.Array:
    """Attention of one row group of a packed step: ``R`` rows of ``Tq`` query slots, each row
    over only the key blocks it can see (split-K: a row's keys are cut into work items of ``Kb``
    pages, and every item of every row runs in one batched matmul).

    A row's items are the blocks of its request's pages up to its last query's position, so a
    row sees neither the padding of the longest row of the step nor the key blocks past its own
    causal frontier. Each item's scores are taken against the row's max over all its items
    (two passes, no rescaling: the same ``exp(s - max) / sum`` as :func:`_attend`, summed in a
    different order), and the items' sums and outputs are added up per row. Key blocks every
    row reads (a shared system prompt's pages: cascade attention) are gathered once and run as
    one matmul against all the group's queries, merged the same way.

    Args:
        q: [N, Hq, D] queries of the step's flat tokens.
        src: int32 [R, Tq], the flat token of each query slot (padding slots repeat a valid one).
        qpos: int32 [R, Tq], those tokens' positions (a slot sees keys at positions <= its own).
        item_row: int32 [W], each work item's row (padding items: row 0, fully masked).
        item_pages: int32 [W, Kb], the item's pages (padding entries: the scratch page).
        item_k0: int32 [W], the position of the item's first key (padding items: past every
            query, so they see nothing).
        shared_pages / shared_k0: int32 [Ws, Kb] / [Ws], the key blocks every row of the group
            reads, as ``item_pages`` / ``item_k0`` (Ws may be 0).
        local: a local-attention layer's mask (:data:`Local`); None: full attention.

    Returns:
        [R * Tq, Hq * D] attention output of every slot, in the compute dtype (rows without
        items, i.e. padding rows, give zeros).
    """
    r, tq = src.shape
    w, kb = item_pages.shape
    ps, hd, hkv = pool.shape[3], cfg.head_dim, cfg.num_kv_heads
    g, s, ws = cfg.num_heads // hkv, kb * ps, shared_pages.shape[0]
    scale = 1.0 / np.sqrt(hd)

    def blocks(pages, k0, qp):
        """Keys [n, Hkv, S, D], values (unseen ones zeroed), mask [n, Tq', S] of key blocks."""
        n = pages.shape[0]
        flat = pages.reshape(-1)
        k = lax.bitcast_convert_type(pool[layer, 0, flat], dtype).reshape(n, s, hkv, hd)
        v = lax.bitcast_convert_type(pool[layer, 1, flat], dtype).reshape(n, s, hkv, hd)
        kpos = k0[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]  # [n, S]
        mask = kpos[:, None, :] <= qp[:, :, None]  # [n, Tq', S]
        if local is not None:
            mask = mask & (kpos[:, None, :] >= _local_start(local, qp)[:, :, None])
        # Keys no slot sees may be scratch or stale bits: zero them (as _attend).
        v = jnp.where(mask.any(axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
        return k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask

    def masked(scores, mask, n, t):
        m = jnp.broadcast_to(mask[:, None, None], (n, hkv, g, t, s)).reshape(n, hkv, g * t, s)
        return jnp.where(m, scores, -jnp.inf)

    # Plain batched matmuls over (item, kv head): q as [W, Hkv, G*Tq, D], k and v as
    # [W, Hkv, S, D]. XLA:CPU runs the dot_generals of the [.., Tq, Hkv, G, D] layout 2-4x
    # slower (strided operands), and attention is most of a step's time (the batched
    # engine's profile, benchmarks/RESULTS.md).
    qg = q[src.reshape(-1)].reshape(r, tq, hkv, g, hd).transpose(0, 2, 3, 1, 4)
    qg = qg.reshape(r, hkv, g * tq, hd)  # [R, Hkv, G*Tq, D]
    k, v, mask = blocks(item_pages, item_k0, qpos[item_row])
    scores = masked(
        jnp.einsum("wkqd,wksd->wkqs", qg[item_row], k, preferred_element_type=jnp.float32) * scale,
        mask,
        w,
        tq,
    )
    member = item_row[None, :] == jnp.arange(r, dtype=jnp.int32)[:, None]  # [R, W]
    row_max = jnp.max(
        jnp.where(member[:, :, None, None], scores.max(axis=-1)[None], -jnp.inf), axis=1
    )  # [R, Hkv, G*Tq]
    ss: jax.Array | None = None  # the shared blocks' scores and values (when ws > 0)
    vs: jax.Array | None = None
    if ws:
        # Shared blocks: every row's queries at once, [1, Hkv, R*G*Tq, D] against [Ws*S] keys.
        ks, vs, smask = blocks(
            shared_pages, shared_k0, jnp.broadcast_to(qpos.reshape(1, r * tq), (ws, r * tq))
        )
        ks, vs = (a.transpose(1, 0, 2, 3).reshape(1, hkv, ws * s, hd) for a in (ks, vs))
        qa = qg.reshape(r, hkv, g, tq, hd).transpose(1, 2, 0, 3, 4).reshape(1, hkv, -1, hd)
        smask = smask.reshape(ws, r, tq, s).transpose(1, 2, 0, 3).reshape(r, tq, ws * s)
        ss = jnp.einsum("bkqd,bksd->bkqs", qa, ks, preferred_element_type=jnp.float32) * scale
        # [1, Hkv, G*R*Tq, Ws*S] -> per row [R, Hkv, G*Tq, Ws*S], masked as the rows' own.
        ss = ss.reshape(hkv, g, r, tq, ws * s).transpose(2, 0, 1, 3, 4)
        sm = jnp.broadcast_to(smask[:, None, None], (r, hkv, g, tq, ws * s))
        ss = jnp.where(sm, ss, -jnp.inf).reshape(r, hkv, g * tq, ws * s)
        row_max = jnp.maximum(row_max, ss.max(axis=-1))
    # A row with no visible key at all is padding: keep its exps at 0, not NaN.
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    p = jnp.exp(scores - row_max[item_row][..., None])
    onehot = member.astype(jnp.float32)
    # Sums over a row's items by a one-hot matmul: exact (HIGHEST: no reduced-precision passes).
    row_sum = jnp.dot(
        onehot, p.sum(axis=-1).reshape(w, -1), precision=lax.Precision.HIGHEST
    ).reshape(r, hkv, g * tq)
    p_sh: jax.Array | None = None
    if ss is not None:
        p_sh = jnp.exp(ss - row_max[..., None])
        row_sum = row_sum + p_sh.sum(axis=-1)
    denom = jnp.where(row_sum > 0, row_sum, 1.0)
    probs = p / denom[item_row][..., None]
    out = jnp.einsum(
        "wkqs,wksd->wkqd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32
    )
    out = jnp.dot(onehot, out.reshape(w, -1), precision=lax.Precision.HIGHEST)
    out = out.reshape(r, hkv, g * tq, hd)
    if p_sh is not None and vs is not None:
        pa = (p_sh / denom[..., None]).astype(vs.dtype)
        pa = pa.reshape(r, hkv, g, tq, ws * s).transpose(1, 2, 0, 3, 4)
        oa = jnp.einsum(
            "bkqs,bksd->bkqd",
            pa.reshape(1, hkv, -1, ws * s),
            vs,
            preferred_element_type=jnp.float32,
        )
        oa = oa.reshape(hkv, g, r, tq, hd).transpose(2, 0, 1, 3, 4)
        out = out + oa.reshape(r, hkv, g * tq, hd)
    out = out.reshape(r, hkv, g, tq, hd).transpose(0, 3, 1, 2, 4)
    return out.reshape(r * tq, cfg.num_heads * hd).astype(dtype)


def _batch_layer(
    cfg: ModelConfig,
    pool: jax.Array,
    layer: jax.Array | int,
    lp: Params,
    x: jax.Array,
    pos: jax.Array,
    wpage: jax.Array,
    groups: tuple,
    tok_slot: jax.Array,
    local: Local = None,
):
    """:func:`_paged_layer` over a packed step: the flat tokens of several requests' chunks.

    The dense parts (norms, projections, MLP) run over the ``N`` flat tokens, with no padding
    between requests; attention runs per row group (prefill query blocks of ``Tq`` slots, decode
    rows of one), each row over its request's key blocks, and each token takes its slot's
    output back (``tok_slot``).

    Args:
        x: [N, d] the step's tokens, request after request (padding at the end).
        pos: int32 [N] each token's position in its request.
        wpage: int32 [N] the page each token's K/V goes to (padding: the scratch page).
        groups: ``(src, item_row, item_pages, item_k0, shared_pages, shared_k0)`` per row
            group (see :func:`_group_attend`).
        tok_slot: int32 [N] each token's slot in the groups' slots, concatenated.
        local: a local-attention layer's mask (:data:`Local`); None: full attention.
    """
    ps, bits = pool.shape[3], pool.dtype
    q, k, v = _qkv(cfg, lp, x, pos)
    off = pos % ps
    pool = pool.at[layer, 0, wpage, off].set(lax.bitcast_convert_type(k, bits))
    pool = pool.at[layer, 1, wpage, off].set(lax.bitcast_convert_type(v, bits))
    # Every token's K/V is written before any row reads: a block sees the blocks before it.
    outs = [
        _group_attend(cfg, pool, layer, q, x.dtype, src, pos[src], row, pages, k0, sh, sk0, local)
        for src, row, pages, k0, sh, sk0 in groups
    ]
    attn = (outs[0] if len(outs) == 1 else jnp.concatenate(outs))[tok_slot]
    x = x + attn @ lp["wo"]
    return pool, x + _mlp(cfg, lp, x)


def _fed_embed(
    params: Params, tokens: jax.Array, tok_src: jax.Array, slot_tokens: jax.Array
) -> jax.Array:
    """Embeddings of a packed step's flat tokens, those fed from the slot buffer taken there:
    ``tok_src`` int32 [N] is a token's slot in ``slot_tokens`` (int32 [S + 1], each request
    slot's last sampled token) when it is read from there (a decode token the host has not seen
    yet), ``S`` (the padding slot) when ``tokens`` holds it."""
    fed = tok_src < slot_tokens.shape[0] - 1
    return _embed(params, jnp.where(fed, slot_tokens[tok_src], tokens))


def _batch_head(
    cfg: ModelConfig,
    params: Params,
    x: jax.Array,
    out_idx: jax.Array,
    out_slot: jax.Array,
    slot_tokens: jax.Array,
):
    """(float32 logits [B, V] of the flat tokens ``out_idx`` [B] of x [N, d], int32 [B] their
    argmax, the slot buffer with row b's token written to slot ``out_slot[b]``; padding rows
    write the padding slot)."""
    h = _rms_norm(x[out_idx], params["final_norm"], cfg.norm_eps)
    logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
    toks = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return logits, toks, slot_tokens.at[out_slot].set(toks)


def unpack(blob: jax.Array, layout: tuple) -> tuple:
    """A packed step's int32 arguments from their one flat buffer (``packing.flatten``):
    ``(tokens, pos, wpage, groups, tok_slot, out_idx, tok_src, out_slot)``, ``groups`` the
    six arrays of each row group (``layout``: every array's shape, static)."""
    parts, off = [], 0
    for shape in layout:
        n = int(np.prod(shape))
        parts.append(blob[off : off + n].reshape(shape))
        off += n
    groups = tuple(tuple(parts[3 + 6 * g : 9 + 6 * g]) for g in range((len(parts) - 7) // 6))
    return (*parts[:3], groups, *parts[-4:])


def _fused_batch_step(cfg, layout, pool, params, blob, slot_tokens):
    TRACES["batch_step"] += 1  # runs at trace time only: one per compile
    tokens, pos, wpage, groups, tok_slot, out_idx, tok_src, out_slot = unpack(blob, layout)
    x = _fed_embed(params, tokens, tok_src, slot_tokens)
    pool, x = _scan_layers(_batch_layer, cfg, pool, params, x, pos, wpage, groups, tok_slot)
    return pool, _batch_head(cfg, params, x, out_idx, out_slot, slot_tokens)


def _blob_embed(layout, params, blob, slot_tokens):
    tokens, *_, tok_src, _ = unpack(blob, layout)
    return _fed_embed(params, tokens, tok_src, slot_tokens)


def _blob_head(cfg, layout, params, x, blob, slot_tokens):
    *_, out_idx, _, out_slot = unpack(blob, layout)
    return _batch_head(cfg, params, x, out_idx, out_slot, slot_tokens)


def _counted_step(cfg, pool, params, tokens, start, n_new, page_table):
    TRACES["step"] += 1
    return _fused_step(cfg, pool, params, tokens, start, n_new, page_table)


def _counted_batch_layer(cfg, layout, pool, layer, lp, x, blob):
    TRACES["batch_layer"] += 1
    _, pos, wpage, groups, tok_slot, *_ = unpack(blob, layout)
    return _batch_layer(cfg, pool, layer, lp, x, pos, wpage, groups, tok_slot)


# ---------------------------------------------------------------------------------------------
# A model with a layer pattern (``ModelConfig.layer_pattern``): the full-attention layers in the
# full pool, each window group's layers in its own pool (``layer_plan``). The layers run
# unrolled over per-layer weights (``params["per_layer"]``); each reads and writes its own pool.


def _local_layer(cfg, local, pool, layer, lp, x, start, n_new, page_table):
    return _paged_layer(cfg, pool, layer, lp, x, start, n_new, page_table, local)


def _pattern_step(cfg, full, windows, params, tokens, start, n_new, page_table, window_tables):
    """The fused step of a patterned model: ``(full, windows, logits)``; ``window_tables``
    int32 [G, Pb], window group ``g``'s page of each entry of ``page_table`` (pages the group
    keeps none of: its scratch page, masked out by the window)."""
    TRACES["pattern_step"] += 1
    pools = [full, *windows]
    x = _embed(params, tokens)
    for layer, (g, i, local) in enumerate(layer_plan(cfg)):
        table = page_table if g < 0 else window_tables[g]
        pools[g + 1], x = _paged_layer(
            cfg, pools[g + 1], i, params["per_layer"][layer], x, start, n_new, table, local
        )
    return pools[0], tuple(pools[1:]), _head(cfg, params, x, n_new)


def _mapped(page_map: jax.Array, wpage: jax.Array, groups: tuple) -> tuple:
    """A packed step's written pages and row groups with every full-pool page id taken
    through ``page_map`` (int32 [P+1], full page -> a window group's page)."""
    return page_map[wpage], tuple(
        (src, row, page_map[pages], k0, page_map[shared], sk0)
        for src, row, pages, k0, shared, sk0 in groups
    )


def _pattern_batch_step(cfg, layout, full, windows, params, blob, slot_tokens, page_maps):
    """The fused packed step of a patterned model: ``(full, windows, head outputs)``;
    ``page_maps`` int32 [G, P+1]: each window group's page of every full-pool page the step
    reads or writes (others, and pages the group keeps none of: its scratch page)."""
    TRACES["pattern_batch_step"] += 1
    tokens, pos, wpage, groups, tok_slot, out_idx, tok_src, out_slot = unpack(blob, layout)
    x = _fed_embed(params, tokens, tok_src, slot_tokens)
    pools = [full, *windows]
    views = [(wpage, groups)] + [_mapped(m, wpage, groups) for m in page_maps]
    for layer, (g, i, local) in enumerate(layer_plan(cfg)):
        wp, gr = views[g + 1]
        pools[g + 1], x = _batch_layer(
            cfg, pools[g + 1], i, params["per_layer"][layer], x, pos, wp, gr, tok_slot, local
        )
    head = _batch_head(cfg, params, x, out_idx, out_slot, slot_tokens)
    return pools[0], tuple(pools[1:]), head


def _local_batch_layer(cfg, layout, local, pool, layer, lp, x, blob, page_map):
    TRACES["batch_layer"] += 1
    _, pos, wpage, groups, tok_slot, *_ = unpack(blob, layout)
    wpage, groups = _mapped(page_map, wpage, groups)
    return _batch_layer(cfg, pool, layer, lp, x, pos, wpage, groups, tok_slot, local)


# ---------------------------------------------------------------------------------------------
# A recurrent pattern (``ModelConfig(layer_pattern="R3:F1")``): recurrent layers (gated linear
# attention, hicache_jax.engine.recurrent) beside full-attention layers on the full pool. The
# recurrent layers' state is the request's own (the caller's arrays, not a pool): a step takes
# it and returns it advanced, with the state at every ``chunk`` boundary of a prefill (the
# checkpoints the caller writes to the cache, ``HiCache.write_state``).


@functools.cache
def recurrent_plan(cfg: ModelConfig) -> tuple[int | None, ...]:
    """Per model layer of a recurrent pattern: its index among the recurrent layers (its
    weights in ``params["recurrent"]``, its state in the STATE group's layer order),
    ``-(1 + i)`` for the full-attention layer ``i`` of the full pool, or None for a local
    layer of a three-kind pattern (``"R2:S1:F1"``: :func:`local_plan`). Empty without
    recurrent layers."""
    rec = cfg.recurrent_layers()
    if not rec:
        return ()
    full = cfg.kv_spec(1).full_group.layers
    plan: dict[int, int | None] = dict.fromkeys(range(cfg.num_layers))
    plan.update({layer: j for j, layer in enumerate(rec)})
    plan.update({layer: -(1 + i) for i, layer in enumerate(full)})
    return tuple(plan[layer] for layer in range(cfg.num_layers))


def local_groups(spec: Any) -> tuple[int, ...]:
    """Indices in ``spec.window_groups`` of its sliding-window and chunked groups (every
    window group but the STATE ones): the pools a recurrent pattern's step takes."""
    return tuple(g for g in range(len(spec.window_groups)) if g not in spec.state_groups)


@functools.cache
def local_plan(cfg: ModelConfig) -> tuple[tuple[int, int, Local] | None, ...]:
    """Per model layer of a recurrent pattern with local layers (``"R2:S1:F1"``):
    ``(g, i, local)`` for a local layer, ``g`` its group among :func:`local_groups` (the
    window pools a step takes, in that order), ``i`` its layer there, ``local`` its mask; None
    for the other layers. Empty without recurrent or without local layers."""
    spec = cfg.kv_spec(1)
    if not spec.state_groups or not local_groups(spec):
        return ()
    plan: dict[int, tuple[int, int, Local] | None] = dict.fromkeys(range(cfg.num_layers))
    for g, w in enumerate(local_groups(spec)):
        group = spec.window_groups[w]
        local: Local = (
            ("window", int(group.window))
            if group.window is not None
            else ("chunk", int(group.chunk or 0))
        )
        plan.update({layer: (g, i, local) for i, layer in enumerate(group.layers)})
    return tuple(plan[layer] for layer in range(cfg.num_layers))


def zero_state(cfg: ModelConfig, n: int = 1) -> tuple[jax.Array, ...]:
    """The recurrent layers' state at the start of a sequence: ``conv [n, conv_width - 1,
    d_model]`` and ``ssm [n, heads, dk, dv]`` zeros (float32), ``n`` the recurrent layers."""
    return tuple(jnp.zeros((n, *a.shape), jnp.float32) for a in cfg.state_arrays())


def _recurrent_model_step(cfg, chunk, pool, params, tokens, start, n_new, page_table, conv, ssm):
    """A step of a recurrent-pattern model over a chunk of one request:
    ``(pool, (logits, (conv, ssm), (boundary_conv, boundary_ssm)))``.

    Full layers run :func:`_paged_layer` on the pool (K/V written and read through the page
    table); recurrent layer ``j`` runs on the request's state ``conv[j]`` / ``ssm[j]``: a
    one-token step (``T == 1``, decode) in the step form, a longer one in the chunked form
    over chunks of ``chunk`` tokens from ``start`` (padded to a whole chunk; rows ``>= n_new``
    are padding). The boundary states are ``[R, T' // chunk, ...]``, the state after the
    tokens up to each chunk's end (clamped to ``n_new``); ``[R, 0, ...]`` in the step form."""
    TRACES["recurrent_step"] += 1
    (pool,), out = _recurrent_layers(
        cfg, chunk, [pool], params, tokens, start, n_new, page_table, None, conv, ssm
    )
    return pool, out


def _recurrent_pattern_step(
    cfg, chunk, full, windows, params, tokens, start, n_new, page_table, window_tables, conv, ssm
):
    """:func:`_recurrent_model_step` of a three-kind pattern (``"R2:S1:F1"``): ``(full,
    windows, out)``, each local layer on its window pool (:func:`local_plan`) through its row
    of ``window_tables`` (int32 [G, Pb]: the group's page of each entry of ``page_table``;
    pages it keeps none of: its scratch page, masked out by the window)."""
    TRACES["recurrent_step"] += 1
    pools, out = _recurrent_layers(
        cfg, chunk, [full, *windows], params, tokens, start, n_new, page_table, window_tables,
        conv, ssm,
    )  # fmt: skip
    return pools[0], tuple(pools[1:]), out


def _recurrent_layers(
    cfg, chunk, pools, params, tokens, start, n_new, page_table, window_tables, conv, ssm
):
    """The layers of :func:`_recurrent_model_step` over ``pools`` (the full pool, then the
    local groups' pools): ``(pools, out)``."""
    t = tokens.shape[0]
    x = _embed(params, tokens)
    lplan = local_plan(cfg)
    convs, ssms, bconv, bssm = [], [], [], []
    for layer, j in enumerate(recurrent_plan(cfg)):
        lp = params["per_layer"][layer]
        if j is None:
            entry = lplan[layer]
            assert entry is not None  # (local_plan has every local layer)
            g, i, local = entry
            pools[g + 1], x = _paged_layer(
                cfg, pools[g + 1], i, lp, x, start, n_new, window_tables[g], local
            )
            continue
        if j < 0:
            pools[0], x = _paged_layer(cfg, pools[0], -(1 + j), lp, x, start, n_new, page_table)
            continue
        rp = params["recurrent_per_layer"][j]
        h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps)
        if t == 1:
            y, c, s = recurrent_step(rp, h, conv[j], ssm[j])
            bc, bs = c[None, :0], s[None, :0]
        else:
            pad = -t % chunk
            hp = jnp.pad(h, ((0, pad), (0, 0))) if pad else h
            y, c, s, bc, bs = recurrent_chunked(rp, hp, conv[j], ssm[j], n_new, chunk)
            y = y[:t]
        convs.append(c)
        ssms.append(s)
        bconv.append(bc)
        bssm.append(bs)
        x = x + y.astype(x.dtype)
        x = x + _mlp(cfg, lp, x)
    state = (jnp.stack(convs), jnp.stack(ssms))
    return pools, (_head(cfg, params, x, n_new), state, (jnp.stack(bconv), jnp.stack(bssm)))


def _recurrent_rows(
    cfg, chunk, pool, params, tokens, start, n_new, tables, conv, ssm, slot_tokens, slot_of
):
    """One chunk of each of ``B`` requests of a recurrent-pattern model in one step:
    ``(pool, (logits [B, V], tokens [B], slot_tokens, conv [B, R, ...], ssm [B, R, ...],
    boundary_conv [B, R, nb, ...], boundary_ssm [B, R, nb, ...]))``.

    Row ``b`` runs :func:`_recurrent_model_step`'s math on its chunk of ``n_new[b]`` tokens
    at ``start[b]``, with page table ``tables[b]`` and state ``conv[b]`` / ``ssm[b]``: the
    full layers' K/V of every row written first, then each row's attention over its own pages
    (:func:`_attend`, vmapped), the recurrent layers vmapped over the rows (the step form for
    ``T == 1``, else the chunked form with the boundary states; ``nb = 0`` for ``T == 1``).
    ``tokens`` int32 [B, T]; ``T == 1`` rows read their token from slot ``slot_of[b]`` of
    ``slot_tokens`` (the last sampled there) instead. Each row's sampled token (of its last
    valid position) goes to its slot; padding rows have ``n_new`` 0 and slot ``S`` (the
    padding slot), and write their K/V to the scratch page."""
    TRACES["recurrent_rows"] += 1
    (pool,), out = _recurrent_row_layers(
        cfg, chunk, [pool], params, tokens, start, n_new, tables, None, conv, ssm, slot_tokens,
        slot_of,
    )  # fmt: skip
    return pool, out


def _recurrent_pattern_rows(
    cfg, chunk, full, windows, params, tokens, start, n_new, tables, window_tables, conv, ssm,
    slot_tokens, slot_of,
):  # fmt: skip
    """:func:`_recurrent_rows` of a three-kind pattern (``"R2:S1:F1"``): ``(full, windows,
    out)``, each local layer on its window pool through ``window_tables`` (int32 [G, B, Pb]:
    the group's page of each entry of ``tables``; its scratch page where it keeps none), its
    keys masked to its window."""
    TRACES["recurrent_rows"] += 1
    pools, out = _recurrent_row_layers(
        cfg, chunk, [full, *windows], params, tokens, start, n_new, tables, window_tables, conv,
        ssm, slot_tokens, slot_of,
    )  # fmt: skip
    return pools[0], tuple(pools[1:]), out


def _recurrent_row_layers(
    cfg, chunk, pools, params, tokens, start, n_new, tables, window_tables, conv, ssm,
    slot_tokens, slot_of,
):  # fmt: skip
    """The layers of :func:`_recurrent_rows` over ``pools`` (the full pool, then the local
    groups' pools): ``(pools, out)``."""
    b, t = tokens.shape
    n_pages = tables.shape[1]
    ps = pools[0].shape[3]
    if t == 1:
        tokens = slot_tokens[slot_of][:, None]
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    valid = jnp.arange(t, dtype=jnp.int32)[None, :] < n_new[:, None]
    x = _embed(params, tokens).reshape(b * t, -1)  # the rows' tokens, flat
    flat_pos = pos.reshape(-1)
    slot = jnp.minimum(pos // ps, n_pages - 1)
    off = flat_pos % ps
    ctx = (b, n_pages * ps, cfg.num_kv_heads, cfg.head_dim)
    kpos = jnp.arange(n_pages * ps, dtype=jnp.int32)
    mask = (kpos[None, None, :] <= pos[:, :, None]) & (
        kpos[None, None, :] < (start + n_new)[:, None, None]
    )  # [B, T, S]
    attend = jax.vmap(functools.partial(_attend, cfg))
    lplan = local_plan(cfg)

    def attention(p, i, table, lp, m):
        # every row's K/V into pool p's layer i (padding to its scratch page), then each
        # row's attention over its pages of p
        pool = pools[p]
        page = jnp.take_along_axis(table, slot, axis=1)
        wpage = jnp.where(valid, page, pool.shape[2] - 1).reshape(-1)
        q, k, v = _qkv(cfg, lp, x, flat_pos)
        pool = pool.at[i, 0, wpage, off].set(lax.bitcast_convert_type(k, pool.dtype))
        pool = pool.at[i, 1, wpage, off].set(lax.bitcast_convert_type(v, pool.dtype))
        kc = lax.bitcast_convert_type(pool[i, 0, table], x.dtype).reshape(ctx)
        vc = lax.bitcast_convert_type(pool[i, 1, table], x.dtype).reshape(ctx)
        qr = q.reshape(b, t, cfg.num_heads, cfg.head_dim)
        pools[p] = pool
        return attend(qr, kc, vc, m).reshape(b * t, -1) @ lp["wo"]

    convs, ssms, bconv, bssm = [], [], [], []
    for layer, j in enumerate(recurrent_plan(cfg)):
        lp = params["per_layer"][layer]
        if j is None:  # a local layer: its window pool, its keys within its window
            entry = lplan[layer]
            assert entry is not None and entry[2] is not None  # (a local layer's mask)
            g, i, local = entry[0], entry[1], entry[2]
            m = mask & (kpos[None, None, :] >= _local_start(local, pos)[:, :, None])
            x = x + attention(g + 1, i, window_tables[g], lp, m)
        elif j < 0:
            x = x + attention(0, -(1 + j), tables, lp, mask)
        else:
            rp = params["recurrent_per_layer"][j]
            h = _rms_norm(x, lp["attn_norm"], cfg.norm_eps).reshape(b, t, -1)
            if t == 1:
                y, c, st = jax.vmap(recurrent_step, in_axes=(None, 0, 0, 0))(
                    rp, h, conv[:, j], ssm[:, j]
                )
                bc, bs = c[:, None, :0], st[:, None, :0]
            else:
                pad = -t % chunk
                hp = jnp.pad(h, ((0, 0), (0, pad), (0, 0))) if pad else h
                y, c, st, bc, bs = jax.vmap(
                    functools.partial(recurrent_chunked, chunk=chunk), in_axes=(None, 0, 0, 0, 0)
                )(rp, hp, conv[:, j], ssm[:, j], n_new)
                y = y[:, :t]
            convs.append(c)
            ssms.append(st)
            bconv.append(bc)
            bssm.append(bs)
            x = x + y.reshape(b * t, -1).astype(x.dtype)
        x = x + _mlp(cfg, lp, x)
    last = jnp.arange(b, dtype=jnp.int32) * t + jnp.maximum(n_new - 1, 0)
    h = _rms_norm(x[last], params["final_norm"], cfg.norm_eps)
    logits = jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)
    toks = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    states = (jnp.stack(convs, axis=1), jnp.stack(ssms, axis=1))
    bounds = (jnp.stack(bconv, axis=1), jnp.stack(bssm, axis=1))
    return pools, (logits, toks, slot_tokens.at[slot_of].set(toks), *states, *bounds)


#: Traces of each jitted step (``"step"``, ``"batch_step"``, ``"batch_layer"``; a patterned
#: model's ``"pattern_step"``, ``"pattern_batch_step"``; a recurrent one's
#: ``"recurrent_step"``, ``"recurrent_rows"``), counted inside
#: the traced functions: a jit traces once per new shape / static config, i.e. once per compile.
TRACES: collections.Counter[str] = collections.Counter()

# The pool is argument 1 (after the static config) and donated: updated in place.
STEP = jax.jit(_counted_step, static_argnums=0, donate_argnums=1)
LAYER = jax.jit(_paged_layer, static_argnums=0, donate_argnums=1)
# The batched steps take (cfg, layout) static, then the pool (donated), then a flat int32 buffer
# of every packed argument (``packing.flatten``: one host -> device transfer a step).
BATCH_STEP = jax.jit(_fused_batch_step, static_argnums=(0, 1), donate_argnums=2)
BATCH_LAYER = jax.jit(_counted_batch_layer, static_argnums=(0, 1), donate_argnums=2)
# Patterned models: the full pool and the tuple of window pools donated (``run_with``); a local
# layer alone on its window group's pool (``run``).
PATTERN_STEP = jax.jit(_pattern_step, static_argnums=0, donate_argnums=(1, 2))
PATTERN_BATCH_STEP = jax.jit(_pattern_batch_step, static_argnums=(0, 1), donate_argnums=(2, 3))
LOCAL_LAYER = jax.jit(_local_layer, static_argnums=(0, 1), donate_argnums=2)
LOCAL_BATCH_LAYER = jax.jit(_local_batch_layer, static_argnums=(0, 1, 2), donate_argnums=3)
# A recurrent pattern: (cfg, chunk) static, the full pool donated; the state is not donated (a
# checkpoint written from it may still be reading it).
RECURRENT_STEP = jax.jit(_recurrent_model_step, static_argnums=(0, 1), donate_argnums=2)
RECURRENT_ROWS = jax.jit(_recurrent_rows, static_argnums=(0, 1), donate_argnums=2)
# A three-kind pattern: the full pool and the tuple of local window pools donated (``run_with``).
RECURRENT_PATTERN_STEP = jax.jit(
    _recurrent_pattern_step, static_argnums=(0, 1), donate_argnums=(2, 3)
)
RECURRENT_PATTERN_ROWS = jax.jit(
    _recurrent_pattern_rows, static_argnums=(0, 1), donate_argnums=(2, 3)
)
EMBED = jax.jit(_embed)
BATCH_EMBED = jax.jit(_blob_embed, static_argnums=0)
HEAD = jax.jit(_head, static_argnums=0)
BATCH_HEAD = jax.jit(_blob_head, static_argnums=(0, 1))


def trace_count(name: str = "step") -> int:
    """Times the jitted step ``name`` has been traced (= compiled) so far, all configs."""
    names = (
        "step",
        "batch_step",
        "batch_layer",
        "pattern_step",
        "pattern_batch_step",
        "recurrent_step",
        "recurrent_rows",
    )
    if name not in names:
        raise ValueError(f"name={name!r} must be one of {', '.join(map(repr, names))}")
    return TRACES[name]


def compiled_step_count() -> int:
    """Executables compiled so far for the fused single-request step (all configs)."""
    return trace_count("step")
