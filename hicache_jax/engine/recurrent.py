"""One recurrent layer of a hybrid model: gated linear attention with a scalar decay per head
after a short causal depthwise convolution (the shape of Qwen3-Next's linear-attention layers
and of Mamba-2's diagonal SSM). Pure jax functions, float32 compute, jittable, no Python state.

The math, per token ``t`` with input ``x_t`` (``d_model`` wide), ``W = conv_width``,
``H`` heads of key width ``dk`` and value width ``dv``::

    u_t = silu(sum_i conv_w[i] * x_{t-(W-1)+i})         # depthwise causal conv, i in [0, W)
    q_t = u_t Wq,  k_t = (u_t Wk) / sqrt(dk),  v_t = u_t Wv   # split per head
    a_t = exp(-softplus(u_t Wa))                         # one decay in (0, 1) per head
    S_t = a_t * S_{t-1} + k_t^T v_t                      # [H, dk, dv], outer product per head
    o_t = q_t S_t,  y_t = o_t Wo

Two forms compute it:

* :func:`recurrent_step`, the decode form: ``lax.scan`` over the tokens, one at a time.
* :func:`recurrent_chunked`, the prefill form: ``lax.scan`` over chunks of ``chunk`` tokens,
  each chunk computed in parallel (its convolution and projections too, so a chunk's arithmetic
  does not depend on ``T``: a run split at a chunk boundary repeats the whole run's arithmetic
  chunk for chunk, and measured bit-identical on XLA:CPU); inside a chunk, with
  ``g = log a`` and ``c`` its inclusive cumulative sum from the chunk's start,
  ``o_t = exp(c_t) q_t S_0 + sum_{s <= t} exp(c_t - c_s) (q_t . k_s) v_s`` and
  ``S_C = exp(c_{C-1}) S_0 + sum_s exp(c_{C-1} - c_s) k_s^T v_s``. The exponents are ``<= 0``
  wherever they are used (``c`` only falls), and the upper triangle of the ``[chunk, chunk]``
  difference matrix is set to ``-inf`` before ``exp``, so nothing overflows and no ``inf * 0``
  appears. It takes a traced ``length``: positions ``>= length`` are padding (decay 1, no key or
  value update, the conv state not advanced past them), so one compiled program serves every
  length of a bucket. It also returns the state at every chunk boundary (clamped to ``length``).

The two forms agree to float32 rounding (a few 1e-6 on outputs of size 1-10, with the
parameters of :func:`init_recurrent_params`). Matmuls use ``Precision.HIGHEST`` so that
accelerators that would default to reduced-precision passes (TF32, bf16) keep that agreement.

State of one layer for one sequence (:func:`state_shapes`), both float32:

* ``conv`` ``[conv_width - 1, d_model]``: the last ``conv_width - 1`` inputs, oldest first
  (zeros at the start of a sequence). ``conv_width == 1`` is allowed: the conv state is then
  ``[0, d_model]`` and the convolution is a per-channel scale.
* ``ssm`` ``[H, dk, dv]``: the matrix state ``S`` (zeros at the start).

Unlike attention's KV, this state does not grow with the sequence and cannot be sliced back to a
shorter prefix: a cache checkpoint of this layer at prefix length ``n`` is exactly the pair
``(conv, ssm)`` after the first ``n`` tokens, and continuing from it gives the same outputs
(to rounding) as running the whole sequence at once. :func:`recurrent_chunked`'s boundary
states are those checkpoints at every multiple of ``chunk``.

Parameters of one layer (:func:`init_recurrent_params`): ``conv_w [conv_width, d_model]``,
``wq [d_model, H*dk]``, ``wk [d_model, H*dk]``, ``wv [d_model, H*dv]``, ``wa [d_model, H]``
(decay-gate logits), ``wo [H*dv, d_model]``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "init_recurrent_params",
    "state_shapes",
    "recurrent_step",
    "recurrent_chunked",
]

Params = Mapping[str, jax.Array]

_HIGHEST = lax.Precision.HIGHEST
_F32 = jnp.float32


def init_recurrent_params(
    key: jax.Array,
    d_model: int,
    heads: int,
    dk: int,
    dv: int,
    conv_width: int,
    dtype: jnp.dtype = _F32,
) -> dict[str, jax.Array]:
    """Random parameters of one recurrent layer, deterministic in ``key``.

    Each matrix is normal with standard deviation ``1 / sqrt(fan_in)`` (the conv taps
    ``1 / sqrt(conv_width)``), so ``u``, ``q``, ``k``, ``v`` and ``y`` stay O(1); the decay
    logits are scaled down by a further 4 so the decays sit near ``exp(-softplus(0)) = 0.5``.

    Args:
        key: a jax PRNG key.
        d_model: the layer's input and output width.
        heads: number of heads ``H``.
        dk: key (and query) width per head.
        dv: value width per head.
        conv_width: taps of the causal depthwise convolution (``>= 1``).
        dtype: the parameters' dtype (compute is float32 whatever it is).

    Returns:
        ``{"conv_w", "wq", "wk", "wv", "wa", "wo"}`` with the shapes in the module docstring.
    """
    _check_dims(d_model, heads, dk, dv, conv_width)
    kc, kq, kk, kv, ka, ko = jax.random.split(key, 6)

    def normal(k: jax.Array, shape: tuple[int, ...], std: float) -> jax.Array:
        return (jax.random.normal(k, shape, _F32) * std).astype(dtype)

    in_std = 1.0 / math.sqrt(d_model)
    return {
        "conv_w": normal(kc, (conv_width, d_model), 1.0 / math.sqrt(conv_width)),
        "wq": normal(kq, (d_model, heads * dk), in_std),
        "wk": normal(kk, (d_model, heads * dk), in_std),
        "wv": normal(kv, (d_model, heads * dv), in_std),
        "wa": normal(ka, (d_model, heads), in_std / 4.0),
        "wo": normal(ko, (heads * dv, d_model), 1.0 / math.sqrt(heads * dv)),
    }


def state_shapes(
    d_model: int, heads: int, dk: int, dv: int, conv_width: int
) -> dict[str, tuple[int, ...]]:
    """Shapes of one layer's state for one sequence (both float32).

    Args:
        d_model: the layer's width.
        heads: number of heads ``H``.
        dk: key width per head.
        dv: value width per head.
        conv_width: taps of the convolution (``>= 1``; 1 gives a ``(0, d_model)`` conv state).

    Returns:
        ``{"conv": (conv_width - 1, d_model), "ssm": (heads, dk, dv)}``.

    Raises:
        ValueError: a dimension below 1.
    """
    _check_dims(d_model, heads, dk, dv, conv_width)
    return {"conv": (conv_width - 1, d_model), "ssm": (heads, dk, dv)}


def recurrent_step(
    params: Params, x: jax.Array, conv: jax.Array, ssm: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The recurrence one token at a time (the decode form), by ``lax.scan`` over ``x``.

    Args:
        params: the layer's parameters (:func:`init_recurrent_params`).
        x: inputs ``[T, d_model]`` (``T == 1`` is a decode step; ``T == 0`` returns the
            state as is).
        conv: conv state ``[conv_width - 1, d_model]`` before ``x``.
        ssm: matrix state ``[H, dk, dv]`` before ``x``.

    Returns:
        ``(y, conv, ssm)``: outputs ``[T, d_model]`` float32 and the state after all ``T``
        tokens.
    """
    p = _as_f32(params)
    heads, dk, dv, _ = _dims(p)
    x = x.astype(_F32)
    _check_state(p, x, conv, ssm)

    def body(
        carry: tuple[jax.Array, jax.Array], x_t: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        c, s = carry
        window = jnp.concatenate([c, x_t[None, :]], axis=0)  # [W, D], oldest first
        u = jax.nn.silu(jnp.sum(p["conv_w"] * window, axis=0))[None, :]  # [1, D]
        q, k, v, g = _project(p, u, heads, dk, dv)  # [1, H, dk], [1, H, dk], [1, H, dv], [1, H]
        s = jnp.exp(g[0])[:, None, None] * s + k[0][:, :, None] * v[0][:, None, :]
        o = jnp.einsum("hk,hkv->hv", q[0], s, precision=_HIGHEST)
        y = jnp.dot(o.reshape(1, heads * dv), p["wo"], precision=_HIGHEST)[0]
        return (window[1:], s), y

    (conv_out, ssm_out), y = lax.scan(body, (conv.astype(_F32), ssm.astype(_F32)), x)
    return y, conv_out, ssm_out


def recurrent_chunked(
    params: Params,
    x: jax.Array,
    conv: jax.Array,
    ssm: jax.Array,
    length: jax.Array | int,
    chunk: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """The chunked form (prefill): parallel within a chunk, ``lax.scan`` over chunks.

    Tokens at positions ``>= length`` are padding: they leave the state as it is (decay 1, no
    key/value update, the conv state ends at ``length``); their outputs are unspecified.
    ``length`` may be traced, so a jitted caller (``chunk`` static) compiles once per ``T``.

    Args:
        params: the layer's parameters (:func:`init_recurrent_params`).
        x: inputs ``[T, d_model]``, ``T`` a multiple of ``chunk``.
        conv: conv state ``[conv_width - 1, d_model]`` before ``x``.
        ssm: matrix state ``[H, dk, dv]`` before ``x``.
        length: int32 scalar in ``[0, T]``: the number of real tokens.
        chunk: tokens per chunk (a static Python int ``>= 1``).

    Returns:
        ``(y, conv, ssm, boundary_conv, boundary_ssm)``: outputs ``[T, d_model]`` float32 (only
        the first ``length`` rows meaningful); the state after ``length`` tokens; and the state
        after tokens ``[0, min((i + 1) * chunk, length))`` for each chunk ``i``:
        ``boundary_conv [T // chunk, conv_width - 1, d_model]``,
        ``boundary_ssm [T // chunk, H, dk, dv]``.

    Raises:
        ValueError: ``chunk`` not a positive int, or ``T`` not a multiple of it.
    """
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a positive static int, got {chunk!r}")
    p = _as_f32(params)
    heads, dk, dv, width = _dims(p)
    x = x.astype(_F32)
    _check_state(p, x, conv, ssm)
    t_len = x.shape[0]
    if t_len % chunk:
        raise ValueError(f"T={t_len} is not a multiple of chunk={chunk}")
    n_chunks = t_len // chunk
    length = jnp.asarray(length, jnp.int32)
    taps = jnp.arange(chunk)[:, None] + jnp.arange(width)[None, :]  # [C, W]
    causal = jnp.tril(jnp.ones((chunk, chunk), dtype=bool))[:, :, None]  # [t, s, 1]

    # Everything, the convolution and the projections included, runs per chunk inside the scan:
    # a chunk's arithmetic is then the same whatever T is, so a sequence split at a chunk
    # boundary (a cache hit) reproduces the unsplit run's outputs and states.
    def body(
        carry: tuple[jax.Array, jax.Array], blk: tuple[jax.Array, jax.Array]
    ) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
        c0, s0 = carry
        xc, start = blk  # [C, D], the chunk's first position
        n_valid = jnp.clip(length - start, 0, chunk)  # real tokens in this chunk
        xe = jnp.concatenate([c0, xc], axis=0)  # [W - 1 + C, D]; window t is xe[t : t + W]
        u = jax.nn.silu(jnp.sum(p["conv_w"][None] * xe[taps], axis=1))  # [C, D]
        qc, kc, vc, gc = _project(p, u, heads, dk, dv)  # [C, H, dk], ..., [C, H, dv], [C, H]
        # Padding: log-decay 0 (decay 1) and a zero key: the state passes through unchanged.
        valid = jnp.arange(chunk) < n_valid  # [C]
        gc = jnp.where(valid[:, None], gc, 0.0)
        kc = jnp.where(valid[:, None, None], kc, 0.0)

        cum = jnp.cumsum(gc, axis=0)  # [C, H], inclusive, non-increasing
        diff = cum[:, None, :] - cum[None, :, :]  # [t, s, H]: <= 0 where s <= t
        decay = jnp.exp(jnp.where(causal, diff, -jnp.inf))  # exactly 0 above the diagonal
        scores = jnp.einsum("thk,shk->tsh", qc, kc, precision=_HIGHEST) * decay
        o = jnp.einsum("tsh,shv->thv", scores, vc, precision=_HIGHEST)
        o = o + jnp.exp(cum)[:, :, None] * jnp.einsum("thk,hkv->thv", qc, s0, precision=_HIGHEST)
        y = jnp.dot(o.reshape(chunk, heads * dv), p["wo"], precision=_HIGHEST)

        tail = jnp.exp(cum[-1][None, :] - cum)  # [C, H]: decay from s to the chunk's end
        s1 = jnp.exp(cum[-1])[:, None, None] * s0 + jnp.einsum(
            "sh,shk,shv->hkv", tail, kc, vc, precision=_HIGHEST
        )
        # The conv state after n_valid more tokens: inputs n_valid - (W - 1) .. n_valid - 1.
        c1 = lax.dynamic_slice_in_dim(xe, n_valid, width - 1, axis=0)
        return (c1, s1), (y, c1, s1)

    starts = jnp.arange(n_chunks, dtype=jnp.int32) * chunk
    (conv_out, ssm_out), (y, boundary_conv, boundary_ssm) = lax.scan(
        body,
        (conv.astype(_F32), ssm.astype(_F32)),
        (x.reshape(n_chunks, chunk, x.shape[1]), starts),
    )
    return y.reshape(t_len, -1), conv_out, ssm_out, boundary_conv, boundary_ssm


def _project(
    p: Params, u: jax.Array, heads: int, dk: int, dv: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``u [T, D]`` -> ``q, k [T, H, dk]``, ``v [T, H, dv]`` and log-decays ``g [T, H]``."""
    t_len = u.shape[0]
    q = jnp.dot(u, p["wq"], precision=_HIGHEST).reshape(t_len, heads, dk)
    k = jnp.dot(u, p["wk"], precision=_HIGHEST).reshape(t_len, heads, dk) / math.sqrt(dk)
    v = jnp.dot(u, p["wv"], precision=_HIGHEST).reshape(t_len, heads, dv)
    g = -jax.nn.softplus(jnp.dot(u, p["wa"], precision=_HIGHEST))
    return q, k, v, g


def _as_f32(params: Params) -> dict[str, jax.Array]:
    names = ("conv_w", "wq", "wk", "wv", "wa", "wo")
    missing = [n for n in names if n not in params]
    if missing:
        raise ValueError(f"recurrent params lack {missing}")
    return {n: jnp.asarray(params[n], _F32) for n in names}


def _dims(p: Params) -> tuple[int, int, int, int]:
    """``(heads, dk, dv, conv_width)`` read off the parameters' shapes."""
    heads = p["wa"].shape[1]
    width = p["conv_w"].shape[0]
    dk, rk = divmod(p["wq"].shape[1], heads)
    dv, rv = divmod(p["wv"].shape[1], heads)
    if rk or rv or p["wk"].shape != p["wq"].shape or p["wo"].shape[0] != p["wv"].shape[1]:
        raise ValueError(
            "inconsistent recurrent params: "
            + ", ".join(f"{n} {tuple(a.shape)}" for n, a in p.items())
        )
    return heads, dk, dv, width


def _check_state(p: Params, x: jax.Array, conv: jax.Array, ssm: jax.Array) -> None:
    heads, dk, dv, width = _dims(p)
    d_model = p["conv_w"].shape[1]
    if x.ndim != 2 or x.shape[1] != d_model:
        raise ValueError(f"x must be [T, {d_model}], got {tuple(x.shape)}")
    if tuple(conv.shape) != (width - 1, d_model):
        raise ValueError(f"conv state must be {(width - 1, d_model)}, got {tuple(conv.shape)}")
    if tuple(ssm.shape) != (heads, dk, dv):
        raise ValueError(f"ssm state must be {(heads, dk, dv)}, got {tuple(ssm.shape)}")


def _check_dims(d_model: int, heads: int, dk: int, dv: int, conv_width: int) -> None:
    dims = dict(d_model=d_model, heads=heads, dk=dk, dv=dv, conv_width=conv_width)
    bad = {n: d for n, d in dims.items() if not isinstance(d, int) or d < 1}
    if bad:
        raise ValueError(f"recurrent layer dimensions must be ints >= 1, got {bad}")
