"""The decoder's size and weights: :class:`ModelConfig`, deterministic random weights from a
seed, and weight files (``.npz``, or ``.safetensors`` when that package is installed) with the flat
key names of :func:`flat_params`.

Params are a pytree ``{"embed", "final_norm", "lm_head", "layers": {name: stacked}}``, the layer
weights stacked on a leading ``num_layers`` axis (what ``lax.scan`` in
:mod:`hicache_jax.engine.layers` runs over).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.spec import KVSpec, StateArray, parse_pattern
from hicache_jax.validation import is_int

Params = dict[str, Any]

# Shapes of each weight as a function of the config; stacked layer weights lead with num_layers.
_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")
# A recurrent pattern's mixer weights (hicache_jax.engine.recurrent), stacked over its recurrent
# layers only: ``params["recurrent"]``, flat names ``recurrent.<key>``.
_RECURRENT_KEYS = ("conv_w", "wq", "wk", "wv", "wa", "wo")


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
        layer_pattern: ``"a:b"``: ``a`` local-attention layers then ``b`` full ones, repeating
            over ``num_layers`` (``KVSpec.from_pattern``); ``"Ra:Fb"``: recurrent layers
            beside full ones (below); ``"Ra:Sb:Fc"`` (letters in layer order): recurrent,
            local and full layers, the local ones by ``window`` / ``chunk``; ``""`` (or
            ``"full"``): every layer full attention.
        window: sliding window in tokens of the local layers (the query at ``t`` sees keys
            ``t - window .. t``).
        chunk: chunked local attention instead: the query at ``t`` sees keys
            ``t // chunk * chunk .. t``.
        recurrent_heads: with a recurrent pattern (``"R3:F1"``: three recurrent layers, then
            one full one): heads of the recurrent layers (gated linear attention,
            :mod:`hicache_jax.engine.recurrent`); None: ``num_heads``. A recurrent layer
            replaces attention by that mixer (its own weights, ``params["recurrent"]``) and
            keeps the norms and the MLP; its attention weights in ``params["layers"]`` are
            unused (kept so that every layer stacks alike).
        recurrent_key_dim / recurrent_value_dim: key and value width per recurrent head;
            None: ``head_dim``.
        conv_width: taps of the recurrent layers' causal convolution (>= 2: the state keeps
            the last ``conv_width - 1`` inputs).
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
    layer_pattern: str = ""
    window: int | None = None
    chunk: int | None = None
    recurrent_heads: int | None = None
    recurrent_key_dim: int | None = None
    recurrent_value_dim: int | None = None
    conv_width: int = 4

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "num_layers",
            "d_model",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "ffn_dim",
        ):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be an int >= 1")
        for name in ("recurrent_heads", "recurrent_key_dim", "recurrent_value_dim"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 1):
                raise ValueError(f"ModelConfig.{name}={value!r} must be None or an int >= 1")
        if not is_int(self.conv_width) or self.conv_width < 2:
            raise ValueError(f"ModelConfig.conv_width={self.conv_width!r} must be an int >= 2")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates halves)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype={self.dtype!r} must be float32, bfloat16 or float16")
        if not isinstance(self.layer_pattern, str):
            raise TypeError(
                f"ModelConfig.layer_pattern={self.layer_pattern!r} must be a str like '5:1'"
            )
        try:  # the pattern, window and chunk checked as the cache's spec checks them
            self.kv_spec(1)
        except (ValueError, TypeError) as exc:
            raise type(exc)(
                f"ModelConfig(layer_pattern={self.layer_pattern!r}, window={self.window!r}, "
                f"chunk={self.chunk!r}): {exc}"
            ) from None

    @property
    def recurrent(self) -> bool:
        """Whether the pattern names recurrent layers (``"R3:F1"``, ``"R2:S1:F1"``; a bad
        pattern: False, and :meth:`kv_spec` names it)."""
        try:
            return any(k == "r" for k, _ in parse_pattern(self.layer_pattern))
        except ValueError:
            return False

    def recurrent_dims(self) -> tuple[int, int, int, int]:
        """``(heads, key dim, value dim, conv width)`` of the recurrent layers (defaults
        resolved)."""
        return (
            self.recurrent_heads or self.num_heads,
            self.recurrent_key_dim or self.head_dim,
            self.recurrent_value_dim or self.head_dim,
            self.conv_width,
        )

    def state_arrays(self) -> list[StateArray]:
        """A recurrent layer's state (:func:`hicache_jax.engine.recurrent.state_shapes`), as
        the cache's STATE group keeps it: ``conv [conv_width - 1, d_model]`` and ``ssm
        [heads, key dim, value dim]``, both float32. ``ssm`` names its head axis, so the slots
        split over the recurrent heads and a mesh shards them as the model's heads (the conv
        state, over the unsplit model width, is spread over the heads' parts evenly)."""
        heads, dk, dv, width = self.recurrent_dims()
        return [
            StateArray("conv", (width - 1, self.d_model), "float32"),
            StateArray("ssm", (heads, dk, dv), "float32", head_axis=0),
        ]

    def recurrent_layers(self) -> tuple[int, ...]:
        """The model layers that are recurrent (the STATE group's), in order; () without."""
        if not self.recurrent:
            return ()
        spec = self.kv_spec(1)
        return tuple(spec.window_groups[spec.state_groups[0]].layers)

    def kv_spec(self, page_size: int) -> KVSpec:
        """The KVSpec of a cache holding this model's K/V in pages of ``page_size`` tokens:
        with a ``layer_pattern``, the grouped spec of ``KVSpec.from_pattern`` (its top-level
        fields describe the full-attention layers; a recurrent pattern's STATE group holds
        :meth:`state_arrays`). Built once per (config, page size): both are immutable, and a
        recurrent engine asks for it at every step (its layers, its zero state)."""
        return _kv_spec(self, page_size)

    def _build_kv_spec(self, page_size: int) -> KVSpec:
        if (
            self.recurrent
            or self.layer_pattern
            or self.window is not None
            or self.chunk is not None
        ):
            return KVSpec.from_pattern(
                self.layer_pattern,
                num_layers=self.num_layers,
                num_kv_heads=self.num_kv_heads,
                head_dim=self.head_dim,
                dtype=self.dtype,
                page_size=page_size,
                window=self.window,
                chunk=self.chunk,
                state=self.state_arrays() if self.recurrent else None,
            )
        return KVSpec(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
        )

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Flat weight name -> shape (layer weights stacked on a leading num_layers axis)."""
        L, d, f = self.num_layers, self.d_model, self.ffn_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {
            "embed": (self.vocab_size, d),
            "layers.attn_norm": (L, d),
            "layers.wq": (L, d, q),
            "layers.wk": (L, d, kv),
            "layers.wv": (L, d, kv),
            "layers.wo": (L, q, d),
            "layers.mlp_norm": (L, d),
            "layers.w_gate": (L, d, f),
            "layers.w_up": (L, d, f),
            "layers.w_down": (L, f, d),
            "final_norm": (d,),
            "lm_head": (d, self.vocab_size),
        }
        n_rec = len(self.recurrent_layers())
        if n_rec:
            heads, dk, dv, width = self.recurrent_dims()
            shapes.update(
                {
                    "recurrent.conv_w": (n_rec, width, d),
                    "recurrent.wq": (n_rec, d, heads * dk),
                    "recurrent.wk": (n_rec, d, heads * dk),
                    "recurrent.wv": (n_rec, d, heads * dv),
                    "recurrent.wa": (n_rec, d, heads),
                    "recurrent.wo": (n_rec, heads * dv, d),
                }
            )
        return shapes


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
            if name == "recurrent.wa":  # decay logits near 0: decays near 0.5 (recurrent.py)
                value = value / 4.0
        flat[name] = value.astype(np.float32)
    return unflatten_params(cfg, flat)


def abstract_params(cfg: ModelConfig) -> Params:
    """The params pytree of :func:`init_params` as ``jax.ShapeDtypeStruct`` leaves in
    ``cfg.dtype``: nothing allocated, so a model of any size can be lowered (e.g. for another
    platform) by a :class:`~hicache_jax.engine.model.DecoderModel` built on them."""
    dt = jnp.dtype(cfg.dtype)
    shapes = cfg.param_shapes()
    params: Params = {
        k: jax.ShapeDtypeStruct(shapes[k], dt) for k in ("embed", "final_norm", "lm_head")
    }
    params["layers"] = {k: jax.ShapeDtypeStruct(shapes[f"layers.{k}"], dt) for k in _LAYER_KEYS}
    if cfg.recurrent:
        params["recurrent"] = {
            k: jax.ShapeDtypeStruct(shapes[f"recurrent.{k}"], dt) for k in _RECURRENT_KEYS
        }
    return params


def flat_params(params: Params) -> dict[str, np.ndarray]:
    """The ``name -> array`` form used in weight files ("layers.wq" etc.)."""
    flat = {k: np.asarray(v) for k, v in params.items() if k not in ("layers", "recurrent")}
    flat.update({f"layers.{k}": np.asarray(v) for k, v in params["layers"].items()})
    flat.update({f"recurrent.{k}": np.asarray(v) for k, v in params.get("recurrent", {}).items()})
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
            raise ValueError(
                f"weight {name!r} has shape {tuple(np.shape(flat[name]))}, the config needs {shape}"
            )
    dt = jnp.dtype(cfg.dtype)
    as_jnp = lambda x: jnp.asarray(np.asarray(x, np.float32), dtype=dt)  # noqa: E731
    params: Params = {k: as_jnp(flat[k]) for k in ("embed", "final_norm", "lm_head")}
    params["layers"] = {k: as_jnp(flat[f"layers.{k}"]) for k in _LAYER_KEYS}
    if cfg.recurrent:
        params["recurrent"] = {k: as_jnp(flat[f"recurrent.{k}"]) for k in _RECURRENT_KEYS}
    return params


#: Tensor parallelism (Megatron's split): the axis of each weight cut over the mesh axis: query,
#: key and value projections by output column (whole heads: a device holds the query heads of
#: its kv heads), the output projection by input row, the FFN's gate and up by column and its
#: down projection by row; embedding, norms and the head replicated. Each layer then ends in
#: one all-reduce after the attention and one after the FFN (the compiler's, from the shardings).
#: A recurrent layer's weights (``params["recurrent"]``, the same names) are cut the same way,
#: by whole recurrent heads, its decay gate ``wa`` by column with them; its convolution
#: (over the layer's input, ``d_model`` wide) is replicated.
_TP_AXIS = {"wq": 2, "wk": 2, "wv": 2, "wa": 2, "wo": 1, "w_gate": 2, "w_up": 2, "w_down": 1}


def shard_params(cfg: ModelConfig, params: Params, mesh: Any, axis: str | None = None) -> Params:
    """``params`` placed tensor-parallel over ``mesh``'s ``axis`` (default: its first), as one
    global ``jax.Array`` each, built from this process's host copy (every process holds the same
    weights: the same seed or file) so it spans the devices of every process of the mesh.

    Raises:
        ValueError: ``axis`` not an axis of the mesh, or heads / kv heads / FFN width /
            recurrent heads not divisible by its size.
    """
    from jax.sharding import NamedSharding, PartitionSpec

    names = tuple(mesh.axis_names)
    axis = names[0] if axis is None else axis
    if axis not in names:
        raise ValueError(f"axis={axis!r} is not an axis of the mesh {names}")
    size = mesh.shape[axis]
    dims = {n: getattr(cfg, n) for n in ("num_heads", "num_kv_heads", "ffn_dim")}
    if cfg.recurrent:
        dims["recurrent_heads"] = cfg.recurrent_dims()[0]
    for name, n in dims.items():
        if n % size:
            raise ValueError(
                f"{name}={n} is not divisible by the {size} "
                f"devices of mesh axis {axis!r} (tensor parallelism)"
            )

    def place(name: str, x: Any) -> Any:
        spec: list[str | None] = [None] * np.ndim(x)
        if name in _TP_AXIS:
            spec[_TP_AXIS[name]] = axis
        host = np.asarray(x)
        return jax.make_array_from_callback(
            host.shape, NamedSharding(mesh, PartitionSpec(*spec)), lambda idx: host[idx]
        )

    stacked = ("layers", "recurrent")
    out: Params = {k: place(k, v) for k, v in params.items() if k not in stacked}
    for group in stacked:
        if group in params:
            out[group] = {k: place(k, v) for k, v in params[group].items()}
    return out


def save_params(params: Params, path: str) -> None:
    """Write weights as an uncompressed ``.npz`` (float32) that :func:`load_params` reads."""
    arrays = {k: v.astype(np.float32) for k, v in flat_params(params).items()}
    # numpy's stub reads a ``**`` dict as possibly holding savez's ``allow_pickle: bool``; these
    # keys are weight names (``layers.wq``, ...), never that flag.
    np.savez(path, **arrays)  # type: ignore[arg-type]


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
            raise ImportError(
                f"reading {path!r} needs the 'safetensors' package "
                "(pip install safetensors), or save the weights as .npz"
            ) from exc
        flat = load_file(path)
    else:
        raise ValueError(f"weights file {path!r}: extension must be .npz or .safetensors")
    return unflatten_params(cfg, flat)


@functools.lru_cache(maxsize=64)
def _kv_spec(cfg: ModelConfig, page_size: int) -> KVSpec:
    return cfg._build_kv_spec(page_size)
