"""A small Llama-style decoder whose attention reads K/V straight from the paged device pool.

RMSNorm, rotary position embedding, grouped-query attention, SwiGLU; configurable size;
deterministic random weights from a seed, or weights from a ``.npz`` (or ``.safetensors`` when
that package is installed) with the flat key names of :func:`flat_params`.

The KV cache is the device pool of hicache_jax, raw bits of layout
``[num_layers, kv=2, num_pages + 1, page_size, num_kv_heads, head_dim]`` (page ``num_pages`` is
the scratch page bucket padding points at). A forward step is a pure jitted function
``step(pool, params, tokens, start, n_new, page_table) -> (pool, logits)`` with the pool donated:
it writes the new tokens' K/V into their pages in place (a per-token scatter of bits) and each
layer's attention gathers only the request's pages through its page table and views them as the
compute dtype with ``lax.bitcast_convert_type`` inside the jit (the pool is never copied or
converted as a whole). Callers dispatch it through ``DevicePagePool.run`` so the pool object keeps
the only reference.

Two ways to run a forward over the same layer math:

* fused: one jit for embedding, all layers (``lax.scan`` over stacked layer weights) and head;
* per layer: embedding, then one donated jit per layer, then the head, so a caller can wait for
  layer ``l``'s pages (``handle.wait_layer(l)``) just before running layer ``l`` while later layers
  are still being loaded back from host.

Token counts are padded to power-of-two buckets (at most ``chunk`` tokens) and page tables to
power-of-two page counts, so the number of compiles stays logarithmic in prompt length.

Threading: every call dispatches on the caller's thread, which must be the thread that owns the
pool (DESIGN rule 4).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import os
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hicache_jax.spec import KVSpec
from hicache_jax.validation import is_int

Params = dict[str, Any]

# Shapes of each weight as a function of the config; stacked layer weights lead with num_layers.
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Size of the decoder.

    Args:
        vocab_size: token ids are ``0 .. vocab_size-1``.
        num_layers: decoder layers.
        d_model: residual width.
        num_heads: query heads.
        num_kv_heads: K/V heads (``num_heads`` must be a multiple: grouped-query attention).
        head_dim: per-head width (even: RoPE rotates halves).
        ffn_dim: SwiGLU hidden width.
        rope_theta: RoPE base.
        norm_eps: RMSNorm epsilon.
        dtype: compute and KV dtype ("float32", "bfloat16", "float16").
    """

    vocab_size: int = 512
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    ffn_dim: int = 768
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads",
                     "head_dim", "ffn_dim"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be an int >= 1")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} must be a multiple of "
                             f"num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates halves)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")

    def kv_spec(self, page_size: int) -> KVSpec:
        """The KVSpec of a cache holding this model's K/V in pages of ``page_size`` tokens."""
        return KVSpec(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                      head_dim=self.head_dim, dtype=self.dtype, page_size=page_size)

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Flat weight name -> shape (layer weights stacked on a leading num_layers axis)."""
        L, d, f = self.num_layers, self.d_model, self.ffn_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "embed": (self.vocab_size, d),
            "layers.attn_norm": (L, d), "layers.wq": (L, d, q), "layers.wk": (L, d, kv),
            "layers.wv": (L, d, kv), "layers.wo": (L, q, d), "layers.mlp_norm": (L, d),
            "layers.w_gate": (L, d, f), "layers.w_up": (L, d, f), "layers.w_down": (L, f, d),
            "final_norm": (d,), "lm_head": (d, self.vocab_size),
        }


def init_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Deterministic random weights (same seed -> same bits on every backend's host RNG).

    Drawn with numpy so the weights do not depend on the JAX PRNG implementation; matrices are
    normal with std ``1/sqrt(fan_in)``, norm weights ``1 + 0.1 * normal`` (not all ones, so a
    test notices a norm applied to the wrong axis).
    """
    rng = np.random.default_rng(seed)
    flat = {}
    for name, shape in cfg.param_shapes().items():
        if name.endswith("norm"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / np.sqrt(shape[-2])
        flat[name] = value.astype(np.float32)
    return unflatten_params(cfg, flat)


def flat_params(params: Params) -> dict[str, np.ndarray]:
    """The ``name -> array`` form used in weight files ("layers.wq" etc.)."""
    flat = {k: np.asarray(v) for k, v in params.items() if k != "layers"}
    flat.update({f"layers.{k}": np.asarray(v) for k, v in params["layers"].items()})
    return flat


def unflatten_params(cfg: ModelConfig, flat: dict[str, Any]) -> Params:
    """Check names and shapes against ``cfg`` and build the params pytree in ``cfg.dtype``.

    Raises:
        ValueError: a weight missing, unexpected, or of the wrong shape (named in the message).
    """
    shapes = cfg.param_shapes()
    missing = sorted(set(shapes) - set(flat))
    extra = sorted(set(flat) - set(shapes))
    if missing or extra:
        raise ValueError(f"weights do not match the config: missing {missing}, unexpected {extra}")
    for name, shape in shapes.items():
        if tuple(np.shape(flat[name])) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(np.shape(flat[name]))}, "
                             f"the config needs {shape}")
    dt = jnp.dtype(cfg.dtype)
    as_jnp = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype=dt)  # noqa: E731
    params: Params = {k: as_jnp(flat[k]) for k in ("embed", "final_norm", "lm_head")}
    params["layers"] = {k: as_jnp(flat[f"layers.{k}"]) for k in _LAYER_KEYS}
    return params


def save_params(params: Params, path: str) -> None:
    """Write weights as an uncompressed ``.npz`` (float32) that :func:`load_params` reads."""
    np.savez(path, **{k: v.astype(np.float32) for k, v in flat_params(params).items()})


def load_params(cfg: ModelConfig, path: str) -> Params:
    """Load weights from ``.npz`` or ``.safetensors`` (the latter needs the safetensors package).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown extension, or names/shapes that do not match ``cfg``.
        ImportError: a ``.safetensors`` file without the safetensors package installed.
    """
    if not os.path.exists(path):
        raise FileNotFoundError(f"weights file {path!r} does not exist")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".npz":
        with np.load(path) as data:
            flat = {k: data[k] for k in data.files}
    elif ext == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError as exc:
            raise ImportError(f"reading {path!r} needs the 'safetensors' package "
                              "(pip install safetensors), or save the weights as .npz") from exc
        flat = load_file(path)
    else:
        raise ValueError(f"weights file {path!r}: extension must be .npz or .safetensors")
    return unflatten_params(cfg, flat)


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
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)          # [D/2]
    ang = pos.astype(jnp.float32)[:, None] * inv_freq[None, :]                   # [T, D/2]
    cos, sin = jnp.cos(ang)[:, None, :], jnp.sin(ang)[:, None, :]               # [T, 1, D/2]
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


def _attend(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array,
            mask: jax.Array) -> jax.Array:
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
    out = jnp.einsum("kgts,skd->tkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(t, cfg.num_heads * cfg.head_dim).astype(q.dtype)


def _mlp(cfg: ModelConfig, lp: Params, x: jax.Array) -> jax.Array:
    h = _rms_norm(x, lp["mlp_norm"], cfg.norm_eps)
    return (jax.nn.silu(h @ lp["w_gate"]) * (h @ lp["w_up"])) @ lp["w_down"]


def _paged_layer(cfg: ModelConfig, pool: jax.Array, layer: jax.Array, lp: Params, x: jax.Array,
                 start: jax.Array, n_new: jax.Array, page_table: jax.Array):
    """One decoder layer over a chunk, K/V written to and read from the paged pool.

    Args:
        pool: bits [L, 2, P+1, ps, Hkv, D] (donated by the caller's jit).
        layer: int32 scalar, which layer of the pool.
        lp: this layer's weights (unstacked).
        x: [T, d] residual stream of the chunk (T is the bucket; rows >= n_new are padding).
        start: int32 scalar, position of x[0].
        n_new: int32 scalar, valid rows of x.
        page_table: int32 [Pb], the request's pages for positions 0 .. Pb*ps-1; entries past the
            request's pages point at the scratch page.

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
    x = x + _attend(cfg, q, kc, vc, mask) @ lp["wo"]
    return pool, x + _mlp(cfg, lp, x)


def _embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def _head(cfg: ModelConfig, params: Params, x: jax.Array, n_new: jax.Array) -> jax.Array:
    """Logits (float32 [V]) of the last valid row of x [T, d]."""
    last = lax.dynamic_index_in_dim(x, n_new - 1, axis=0, keepdims=False)
    h = _rms_norm(last, params["final_norm"], cfg.norm_eps)
    return jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)


def _fused_step(cfg, pool, params, tokens, start, n_new, page_table):
    x = _embed(params, tokens)

    def body(carry, xs):
        pool, x = carry
        layer, lp = xs
        return _paged_layer(cfg, pool, layer, lp, x, start, n_new, page_table), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (pool, x), _ = lax.scan(body, (pool, x), (layers, params["layers"]))
    return pool, _head(cfg, params, x, n_new)


def reference_logits(cfg: ModelConfig, params: Params, tokens) -> jax.Array:
    """Dense (non-paged, no cache) forward: float32 logits [T, V] of every position.

    The test oracle for the paged paths: same math, plain causal attention over the prompt.
    """
    return _reference_jit(cfg, params, jnp.asarray(tokens, jnp.int32))


@functools.partial(jax.jit, static_argnums=0)
def _reference_jit(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    t = tokens.shape[0]
    pos = jnp.arange(t, dtype=jnp.int32)
    mask = pos[None, :] <= pos[:, None]
    x = _embed(params, tokens)
    for i in range(cfg.num_layers):
        lp = {k: v[i] for k, v in params["layers"].items()}
        q, k, v = _qkv(cfg, lp, x, pos)
        x = x + _attend(cfg, q, k, v, mask) @ lp["wo"]
        x = x + _mlp(cfg, lp, x)
    h = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    return jnp.dot(h, params["lm_head"], preferred_element_type=jnp.float32)


def _batch_layer(cfg: ModelConfig, pool: jax.Array, layer: jax.Array, lp: Params, x: jax.Array,
                 start: jax.Array, n_new: jax.Array, page_table: jax.Array):
    """:func:`_paged_layer` over a batch of requests, each with its own chunk and page table.

    Args:
        x: [B, T, d] the chunks (row ``b`` is request ``b``'s; rows >= n_new[b] are padding).
        start, n_new: int32 [B] position of each chunk's first token, its valid rows (0: a
            padding request, whose rows all write the scratch page).
        page_table: int32 [B, Pb] each request's pages (padding entries: the scratch page).
    """
    b, t, d = x.shape
    ps, scratch, n_pages = pool.shape[3], pool.shape[2] - 1, page_table.shape[1]
    hkv, hd = cfg.num_kv_heads, cfg.head_dim
    rows = jnp.arange(t, dtype=jnp.int32)
    pos = start[:, None] + rows[None, :]                                        # [B, T]
    valid = rows[None, :] < n_new[:, None]
    # The dense parts see B*T rows, as the single-request path sees T (flat 1-D indices: XLA:CPU
    # runs 2-D scatters and gathers of the pool far slower).
    q, k, v = _qkv(cfg, lp, x.reshape(b * t, d), pos.reshape(-1))
    slot = jnp.take_along_axis(page_table, jnp.minimum(pos // ps, n_pages - 1), axis=1)
    wpage, off = jnp.where(valid, slot, scratch).reshape(-1), (pos % ps).reshape(-1)
    bits = pool.dtype
    pool = pool.at[layer, 0, wpage, off].set(lax.bitcast_convert_type(k, bits))
    pool = pool.at[layer, 1, wpage, off].set(lax.bitcast_convert_type(v, bits))
    ctx_shape = (b, n_pages * ps, hkv, hd)
    table = page_table.reshape(-1)
    kc = lax.bitcast_convert_type(pool[layer, 0, table], x.dtype).reshape(ctx_shape)
    vc = lax.bitcast_convert_type(pool[layer, 1, table], x.dtype).reshape(ctx_shape)
    kpos = jnp.arange(n_pages * ps, dtype=jnp.int32)[None, None, :]
    mask = (kpos <= pos[:, :, None]) & (kpos < (start + n_new)[:, None, None])   # [B, T, S]
    attn = _attend_batch(cfg, q.reshape(b, t, cfg.num_heads, hd), kc, vc, mask)
    x = x + attn @ lp["wo"]
    return pool, x + _mlp(cfg, lp, x)


def _attend_batch(cfg: ModelConfig, q: jax.Array, k: jax.Array, v: jax.Array,
                  mask: jax.Array) -> jax.Array:
    """:func:`_attend` per request: q [B, T, Hq, D]; k, v [B, S, Hkv, D]; mask bool [B, T, S]
    -> [B, T, Hq*D] in q.dtype."""
    b, t = q.shape[:2]
    g = cfg.num_heads // cfg.num_kv_heads
    qg = q.reshape(b, t, cfg.num_kv_heads, g, cfg.head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / np.sqrt(cfg.head_dim))
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    v = jnp.where(mask.any(axis=1)[:, :, None, None], v, jnp.zeros((), v.dtype))
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, cfg.num_heads * cfg.head_dim).astype(q.dtype)


def _batch_head(cfg: ModelConfig, params: Params, x: jax.Array, n_new: jax.Array):
    """(float32 logits [B, V] of each request's last valid row, int32 [B] their argmax)."""
    idx = jnp.maximum(n_new - 1, 0)[:, None, None]
    last = jnp.take_along_axis(x, idx, axis=1)[:, 0]                            # [B, d]
    logits = jax.vmap(lambda h: jnp.dot(_rms_norm(h, params["final_norm"], cfg.norm_eps),
                                        params["lm_head"], preferred_element_type=jnp.float32))(last)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _fused_batch_step(cfg, pool, params, tokens, start, n_new, page_table):
    TRACES["batch_step"] += 1  # runs at trace time only: one per compile
    x = _embed(params, tokens)

    def body(carry, xs):
        pool, x = carry
        layer, lp = xs
        return _batch_layer(cfg, pool, layer, lp, x, start, n_new, page_table), None

    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    (pool, x), _ = lax.scan(body, (pool, x), (layers, params["layers"]))
    return pool, _batch_head(cfg, params, x, n_new)


def _counted_step(cfg, pool, params, tokens, start, n_new, page_table):
    TRACES["step"] += 1
    return _fused_step(cfg, pool, params, tokens, start, n_new, page_table)


def _counted_batch_layer(cfg, pool, layer, lp, x, start, n_new, page_table):
    TRACES["batch_layer"] += 1
    return _batch_layer(cfg, pool, layer, lp, x, start, n_new, page_table)


#: Traces of each jitted step (``"step"``, ``"batch_step"``, ``"batch_layer"``), counted inside
#: the traced functions: a jit traces once per new shape / static config, i.e. once per compile.
TRACES: collections.Counter[str] = collections.Counter()

# The pool is argument 1 (after the static config) and donated: updated in place.
_STEP = jax.jit(_counted_step, static_argnums=0, donate_argnums=1)
_LAYER = jax.jit(_paged_layer, static_argnums=0, donate_argnums=1)
_BATCH_STEP = jax.jit(_fused_batch_step, static_argnums=0, donate_argnums=1)
_BATCH_LAYER = jax.jit(_counted_batch_layer, static_argnums=0, donate_argnums=1)
_EMBED = jax.jit(_embed)
_HEAD = jax.jit(_head, static_argnums=0)
_BATCH_HEAD = jax.jit(_batch_head, static_argnums=0)


def trace_count(name: str = "step") -> int:
    """Times the jitted step ``name`` has been traced (= compiled) so far, all configs."""
    if name not in ("step", "batch_step", "batch_layer"):
        raise ValueError(f"name={name!r} must be 'step', 'batch_step' or 'batch_layer'")
    return TRACES[name]


def compiled_step_count() -> int:
    """Executables compiled so far for the fused single-request step (all configs)."""
    return trace_count("step")


# ---------------------------------------------------------------------------------------------
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
        self._step = functools.partial(_STEP, cfg)
        self._layer = functools.partial(_LAYER, cfg)
        self._head = functools.partial(_HEAD, cfg)
        self._batch_step = functools.partial(_BATCH_STEP, cfg)
        self._batch_layer = functools.partial(_BATCH_LAYER, cfg)
        self._batch_head = functools.partial(_BATCH_HEAD, cfg)

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
        x = _EMBED(self.params, toks)
        for layer, lp in enumerate(self._layer_params):
            waiter.wait_layer(layer)
            x = pool.run(self._layer, jnp.int32(layer), lp, x, *args)
        return self._head(self.params, x, jnp.int32(n))

    def forward_batch(self, pool: PoolLike, chunks, starts, page_ids, *,
                      waiter: LayerWaiter | None = None, min_bucket: int = 1,
                      min_pages: int = 1, min_batch: int = 1) -> tuple[jax.Array, jax.Array]:
        """One step over several requests: each chunk's K/V into its pages, last-token logits.

        The chunks are padded to ``[fine_bucket(B), bucket(max len)]`` tokens and the page
        tables to ``[fine_bucket(B), bucket(max pages)]`` (compiles stay logarithmic); a decode
        step is the case of chunks of one token. Several chunks may belong to one request (its
        prompt cut into query blocks, each with the request's page table and its own start):
        every chunk's K/V is written before any is read, and each row attends to positions up
        to its own, so a block sees the blocks before it.

        Args:
            pool: the device pool (donated and rebound by ``pool.run``).
            chunks: B int arrays (numpy), chunk ``b`` at positions ``starts[b] ..``; each >= 1.
            starts: B ints: positions ``0 .. starts[b]-1`` of request b already hold K/V.
            page_ids: B int arrays, request b's pages in position order (>= the pages its
                positions up to the chunk's end need; only those are used).
            waiter: a layer-wise load handle (as :meth:`forward`); None -> one fused jit.
            min_bucket / min_pages / min_batch: smallest token / page-table / batch buckets.

        Returns:
            (float32 ``[fine_bucket(B), vocab]`` logits, int32 ``[fine_bucket(B)]`` greedy tokens): rows
            ``>= B`` are padding. Jax arrays, not synchronized.
        """
        b = len(chunks)
        if b < 1 or len(starts) != b or len(page_ids) != b:
            raise ValueError(f"need >= 1 chunk and one start and page list each, got {b} "
                             f"chunks, {len(starts)} starts, {len(page_ids)} page lists")
        ps = self._page_size(pool)
        lens = [int(np.shape(c)[0]) for c in chunks]
        used = [-(-(int(s) + n) // ps) for s, n in zip(starts, lens)]
        for i, (s, n, u) in enumerate(zip(starts, lens, used)):
            if n < 1 or s < 0 or np.shape(page_ids[i])[0] < u:
                raise ValueError(f"request {i}: chunk of {n} tokens at {s} with "
                                 f"{np.shape(page_ids[i])[0]} pages (needs >= 1 token at "
                                 f"start >= 0 and {u} pages of {ps} tokens)")
        bb, tb = fine_bucket(b, min_batch), bucket(max(lens), min_bucket)
        toks = np.zeros((bb, tb), np.int32)
        table = np.full((bb, fine_bucket(max(used), min_pages)), pool.num_pages, np.int32)
        start = np.zeros(bb, np.int32)
        n_new = np.zeros(bb, np.int32)
        for i in range(b):
            toks[i, :lens[i]] = chunks[i]
            table[i, :used[i]] = np.asarray(page_ids[i][:used[i]])
        start[:b], n_new[:b] = starts, lens
        args = (jnp.asarray(start), jnp.asarray(n_new), jnp.asarray(table))
        if waiter is None:
            return pool.run(self._batch_step, self.params, jnp.asarray(toks), *args)
        x = _EMBED(self.params, jnp.asarray(toks))
        for layer, lp in enumerate(self._layer_params):
            waiter.wait_layer(layer)
            x = pool.run(self._batch_layer, jnp.int32(layer), lp, x, *args)
        return self._batch_head(self.params, x, args[1])

    @staticmethod
    def _page_size(pool: PoolLike) -> int:
        spec = getattr(pool, "spec", None)
        return spec.page_size if spec is not None else int(pool.array.shape[3])
