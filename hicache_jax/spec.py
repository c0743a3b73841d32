"""KVSpec (what one page holds) and HiCacheConfig (sizes, policies, thresholds).

Both are frozen dataclasses validated at construction: a bad field raises ``ValueError`` /
``TypeError`` naming the field. Policy strings are resolved once into ``str`` enums here, so
``cfg.write_policy == "write_back"`` still reads naturally while the code dispatches on enums.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import itertools
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import ml_dtypes  # jax's own dtypes package: the KV dtypes without importing jax
import numpy as np

from hicache_jax.validation import check_bool, check_int, is_int, is_real, parse_enum

#: KV dtypes the pools accept -> the unsigned integer of the same width the pools store.
_BITS_DTYPE = {
    "bfloat16": np.uint16,
    "float16": np.uint16,
    "float32": np.uint32,
    "float8_e4m3fn": np.uint8,
    "int8": np.uint8,
}
SUPPORTED_DTYPES = tuple(_BITS_DTYPE)


class EvictionPolicy(str, enum.Enum):
    """Which node to evict first. A ``str`` enum: ``EvictionPolicy.LRU == "lru"``."""

    LRU = "lru"  # least recently used
    LFU = "lfu"  # least frequently used, ties by recency
    FIFO = "fifo"  # oldest node first
    MRU = "mru"  # most recently used first
    FILO = "filo"  # newest node first
    PRIORITY = "priority"  # lowest request priority first, ties by recency
    SLRU = "slru"  # segmented LRU: probationary (hit_count < 2) before protected
    # GreedyDual over what a recompute costs: a node is worth (its last prompt's pages) ** 2
    # above a clock that host evictions raise (tree/eviction.py); the default with local groups
    VALUE = "value"

    @classmethod
    def parse(cls, value: str | EvictionPolicy | None) -> EvictionPolicy:
        """Turn a user string into the enum, with an error that lists the choices (None, a
        config's default, has no order of its own: :func:`resolve_eviction` gives it one)."""
        if value is None:
            raise ValueError("eviction=None: resolve_eviction(None, spec) names the default")
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(p.value for p in cls)
            raise ValueError(f"eviction={value!r} is not one of: {choices}") from None


def resolve_eviction(eviction: EvictionPolicy | str | None, spec: KVSpec) -> EvictionPolicy:
    """``HiCacheConfig.eviction`` for a cache of ``spec``: as given, or for None (the default)
    ``value`` where the full group has local groups of one kind beside it (sliding-window or
    chunked layers, or recurrent ones: :func:`recurrent_only`), else ``lru`` (a model of full
    attention alone, or one with window and state groups both)."""
    if eviction is not None:
        return EvictionPolicy.parse(eviction)
    one_kind = len(spec.state_groups) in (0, len(spec.window_groups))  # (none, or all state)
    return EvictionPolicy.VALUE if spec.window_groups and one_kind else EvictionPolicy.LRU


def default_write_through_threshold(policy: WritePolicy) -> int:
    """``HiCacheConfig.write_through_threshold`` where none is given: 2 for
    ``write_through_selective`` (a backup at a node's second access), else 1."""
    return 2 if policy is WritePolicy.WRITE_THROUGH_SELECTIVE else 1


def recurrent_only(spec: KVSpec) -> bool:
    """Whether ``spec``'s local groups are all ``STATE`` ones (``R3:F1``; not ``R2:S1:F1``,
    whose window groups the ``value`` eviction and a cache without interior checkpoints
    served worse: ``HiCacheConfig.eviction``)."""
    return bool(spec.state_groups) and len(spec.state_groups) == len(spec.window_groups)


class WritePolicy(str, enum.Enum):
    """When device pages are backed up to host (SGLang HiCache semantics)."""

    WRITE_THROUGH = "write_through"  # once hit_count >= threshold (default 1)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # same, default threshold 2
    WRITE_BACK = "write_back"  # only when evicted from device
    CLEAN_AHEAD = "clean_ahead"  # the eviction end of L1, in the background; L2 ~ exclusive


class HostLayout(str, enum.Enum):
    """Layout of the host pool buffer."""

    LAYER_FIRST = "layer_first"  # [num_layers, kv, num_pages, page_size, heads, dim]
    PAGE_FIRST = "page_first"  # [num_pages, num_layers, kv, page_size, heads, dim]


class CopyBackend(str, enum.Enum):
    """How the device pool moves pages: XLA scatter/gather, or Pallas kernels."""

    AUTO = "auto"
    XLA = "xla"
    PALLAS = "pallas"


class PrefetchPolicy(str, enum.Enum):
    """How match_prefix treats an L3 prefetch still in flight."""

    BEST_EFFORT = "best_effort"
    WAIT_COMPLETE = "wait_complete"
    TIMEOUT = "timeout"


def _parse_dtype(value: Any) -> str:
    """A KV dtype (a name, or a numpy / jax dtype) -> its name in ``SUPPORTED_DTYPES``."""
    dtype = value
    if not isinstance(dtype, str):
        try:
            dtype = np.dtype(dtype).name  # accept jnp.bfloat16 / np.float16 too
        except TypeError:
            raise TypeError(
                f"dtype={value!r} is not a dtype; use one of: {', '.join(SUPPORTED_DTYPES)}"
            ) from None
    if dtype not in _BITS_DTYPE:
        raise ValueError(f"dtype={value!r} is not one of: {', '.join(SUPPORTED_DTYPES)}")
    return str(dtype)


class GroupKind(str, enum.Enum):
    """Which tokens' K/V a layer reads again when a request continues a cached prefix.

    A ``str`` enum: ``GroupKind.WINDOW == "window"``. For a continuation at prefix length
    ``n`` (see :meth:`LayerGroup.need_start`):

    * ``FULL``: every token ``[0, n)`` (MHA/GQA, or an MLA latent).
    * ``WINDOW``: a sliding window of ``window`` tokens, ``[n - window, n)``.
    * ``CHUNK``: chunked local attention over ``chunk``-token chunks,
      ``[n // chunk * chunk, n)``.
    * ``STATE``: recurrent layers (linear attention, Mamba-2, Gated DeltaNet): no token's K/V,
      only the layers' fixed-size state after exactly ``n`` tokens (a *checkpoint*, held in a
      *state slot* at the end of the page ending at ``n``).
    """

    FULL = "full"
    WINDOW = "window"
    CHUNK = "chunk"
    STATE = "state"


@dataclasses.dataclass(frozen=True)
class StateArray:
    """One array of a recurrent layer's state, e.g. a convolution state
    ``StateArray("conv", (3, 2048), "float32")`` or a recurrent state
    ``StateArray("ssm", (16, 128, 128), "float32")``. Every layer of a ``STATE`` group keeps
    the group's arrays; a state slot holds them all for every layer of the group.

    Args:
        name: a non-empty identifier, unique in its group.
        shape: the array's shape for one layer and one sequence (ints >= 1; a list is
            accepted, stored as a tuple).
        dtype: one of ``SUPPORTED_DTYPES``.
        head_axis: the axis of ``shape`` that a tensor-parallel model splits over its devices
            (the heads of a recurrent state, the head-sharded channels of a convolution);
            None (the default) for an array every device keeps whole. A group whose arrays
            name one keeps its slots split in ``LayerGroup.state_heads`` parts, so a mesh
            shards the slot pools as it shards K/V.

    Raises:
        ValueError / TypeError: a bad field, the message naming it; a ``LayerGroup`` prefixes
            it with ``state[i].``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    head_axis: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ValueError(f"name={self.name!r} must be a non-empty identifier")
        shape: Any = self.shape
        if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
            raise TypeError(f"shape={shape!r} must be a sequence of positive ints")
        object.__setattr__(
            self, "shape", tuple(_positive(f"shape[{i}]", v) for i, v in enumerate(shape))
        )
        object.__setattr__(self, "dtype", _parse_dtype(self.dtype))
        if self.head_axis is not None:
            if not is_int(self.head_axis):
                raise TypeError(f"head_axis={self.head_axis!r} must be an int or None")
            if not 0 <= self.head_axis < len(self.shape):
                raise ValueError(
                    f"head_axis={self.head_axis!r} must be an axis of shape={self.shape} "
                    f"(0 to {len(self.shape) - 1})"
                )
            object.__setattr__(self, "head_axis", int(self.head_axis))

    @property
    def heads(self) -> int | None:
        """The size of :attr:`head_axis` (None without one)."""
        return None if self.head_axis is None else self.shape[self.head_axis]

    @property
    def nbytes(self) -> int:
        """Bytes of the array for one layer."""
        return math.prod(self.shape) * np.dtype(_BITS_DTYPE[self.dtype]).itemsize

    def as_json(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        return out if self.head_axis is None else out | {"head_axis": self.head_axis}

    def head_words(self, heads: int) -> int:
        """uint32 words of one of ``heads`` parts of this array in a slot: its bytes per head
        (split along :attr:`head_axis`, which ``heads`` divides) rounded up to words; without
        a head axis, its words split evenly (the last part padded)."""
        if self.head_axis is None:
            words = -(-self.nbytes // 4)
            return -(-words // heads)
        return -(-(self.nbytes // heads) // 4)

    @classmethod
    def parse_list(cls, text: str, flag: str = "--state") -> tuple[StateArray, ...]:
        """Arrays from a command line: ``"conv:3x8192,ssm:h32x128x128:float32"`` (comma-
        separated ``name:shape[:dtype]``, the shape ``x``-separated, one axis prefixed ``h``
        at most: the head axis, ``head_axis``; dtype float32 when left out).

        Raises:
            ValueError: naming ``flag`` and the item.
        """
        out = []
        for item in (t.strip() for t in text.split(",")):
            parts = item.split(":")
            if len(parts) not in (2, 3) or not parts[1]:
                raise ValueError(f"{flag}: {item!r} must be name:AxBxC[:dtype]")
            try:
                axes = parts[1].lower().split("x")
                heads = [i for i, v in enumerate(axes) if v.startswith("h")]
                if len(heads) > 1:
                    raise ValueError("one head axis (h) at most")
                shape = tuple(int(v.removeprefix("h")) for v in axes)
                dtype = parts[2] if len(parts) == 3 else "float32"
                out.append(cls(parts[0], shape, dtype, heads[0] if heads else None))
            except (ValueError, TypeError) as e:
                raise ValueError(f"{flag}: {item!r}: {e}") from None
        return _as_state(out)


def _as_state(state: Any) -> tuple[StateArray, ...]:
    """``LayerGroup.state`` checked: StateArrays or dicts of their fields, names unique."""
    if isinstance(state, (str, bytes, Mapping)) or not isinstance(state, Sequence):
        raise TypeError(f"state={state!r} must be a sequence of StateArray")
    out = []
    for i, a in enumerate(state):
        try:
            if isinstance(a, StateArray):
                out.append(StateArray(a.name, a.shape, a.dtype, a.head_axis))
            elif isinstance(a, Mapping):
                unknown = sorted(set(a) - {"name", "shape", "dtype", "head_axis"})
                if unknown:
                    raise ValueError(
                        f"unknown field(s) {unknown}; known: name, shape, dtype, head_axis"
                    )
                out.append(StateArray(**a))
            else:
                raise TypeError(f"state[{i}]={a!r} must be a StateArray or a dict of its fields")
        except (ValueError, TypeError) as e:
            text = str(e)
            raise type(e)(text if text.startswith("state[") else f"state[{i}].{text}") from None
    names = [a.name for a in out]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        raise ValueError(f"state has duplicate name(s) {dups}")
    return tuple(out)


def _positive(name: str, value: Any) -> int:
    """``int(value)`` for an int >= 1, else TypeError / ValueError naming ``name``."""
    if not is_int(value):
        raise TypeError(f"{name}={value!r} must be a positive int")
    if value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def _layers_text(layers: Sequence[int]) -> str:
    """``(0, 1, 2, 4)`` -> ``"0-2,4"``: runs of consecutive layers."""
    runs: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        runs.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ",".join(runs)


#: The letters of a tagged layer pattern (``"R2:S1:F1"``): recurrent, local (sliding-window or
#: chunked), full-attention layers.
PATTERN_KINDS = {"r": "recurrent", "s": "local", "f": "full"}


def parse_pattern(pattern: Any, name: str = "pattern") -> tuple[tuple[str, int], ...]:
    """The runs of one period of a layer pattern, in layer order: ``(letter, count)`` with
    letters of :data:`PATTERN_KINDS` (ARCHITECTURE.md, "Layer groups").

    - ``"a:b"``: ``a`` local layers then ``b`` full ones (``(("s", a), ("f", b))``);
    - letter-tagged counts, two or three of ``Ra`` (recurrent), ``Sb`` (local: a sliding
      window, or chunked local attention) and ``Fc`` (full), each letter at most once, in
      any order, the layers of a period laid out in the order written: ``"R3:F1"``,
      ``"S5:F1"`` (= ``"5:1"``), ``"R2:S1:F1"`` (a hybrid with recurrent, sliding-window and
      global layers);
    - ``"full"`` or ``""``: ``(("f", 1),)``.

    Counts are non-negative ints (a zero count is no layer of that kind). Case and spaces
    around the parts are ignored.

    Raises:
        TypeError / ValueError: naming ``name`` (not a str, not one of those forms).
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{name}={pattern!r} must be a str like '5:1', 'R3:F1' or 'full'")
    text = pattern.strip().lower()
    if text in ("", "full"):
        return (("f", 1),)
    parts = [p.strip() for p in text.split(":")]
    if len(parts) == 2 and all(re.fullmatch(r"\d+", p) for p in parts):
        return (("s", int(parts[0])), ("f", int(parts[1])))
    tagged = [re.fullmatch(r"([rsf])\s*(\d+)", p) for p in parts]
    letters = [m.group(1) for m in tagged if m is not None]
    if 2 <= len(parts) <= 3 and len(letters) == len(parts) and len(set(letters)) == len(parts):
        return tuple((m.group(1), int(m.group(2))) for m in tagged if m is not None)
    raise ValueError(
        f"{name}={pattern!r} must be 'a:b' (a local layers then b full ones, repeating; "
        "non-negative ints), two or three of 'Ra', 'Sb', 'Fc' (recurrent, local, full "
        "layers, each letter once, in layer order: 'R3:F1', 'R2:S1:F1') or 'full'"
    )


def pattern_state(
    pattern: str | None, text: str | None, flag: str = "--state"
) -> tuple[StateArray, ...] | None:
    """A command's ``--state`` for its ``--layer-pattern``: the parsed arrays (or
    ``QWEN3_NEXT_STATE`` when left out) for a recurrent pattern (``"R3:F1"``), None for any
    other; ``--state`` with another pattern is refused (``from_pattern`` names it)."""
    try:
        recurrent = pattern is not None and any(k == "r" for k, _ in parse_pattern(pattern))
    except (TypeError, ValueError):  # (from_pattern names a bad pattern)
        recurrent = False
    if text is None:
        return QWEN3_NEXT_STATE if recurrent else None
    return StateArray.parse_list(text, flag)


#: A Qwen3-Next-like Gated DeltaNet layer's state (per layer: a width-4 convolution over the
#: q, k, v channels, 16 + 16 key heads and 32 value heads of 128; a 32 x 128 x 128 recurrent
#: state), float32: what ``--layer-pattern R3:F1`` assumes without ``--state``. The conv
#: state is one array per projection, each with its heads' axis named, as a tensor-parallel
#: model splits q, k and v by heads apart (one array over their concatenated channels could
#: not be split so): slots split into ``gcd(16, 16, 32, 32)`` = 16 head parts, 3 x 8192 +
#: 32 x 128 x 128 words in all, as one conv array of 8192 channels.
QWEN3_NEXT_STATE = (
    StateArray("conv_q", (3, 16, 128), "float32", head_axis=1),
    StateArray("conv_k", (3, 16, 128), "float32", head_axis=1),
    StateArray("conv_v", (3, 32, 128), "float32", head_axis=1),
    StateArray("ssm", (32, 128, 128), "float32", head_axis=0),
)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Layers of one model that share an attention kind and a KV page shape.

    A model may mix full-attention layers with sliding-window or chunked local-attention
    layers. A continuation of a cached prefix of ``n`` tokens reads, in each layer, the K/V of
    the tokens ``[need_start(n), n)``: all of them for a full layer, only the last ``window``
    (or those of the current chunk) for a local one. That range is the kept set: the pages a
    local group must still hold for a prefix to be resumable; older ones are never read again.

    Args:
        kind: a ``GroupKind`` or its value ("full", "window", "chunk").
        layers: the model's layer indices in this group (any sequence of ints >= 0; stored as
            a sorted tuple, duplicates refused).
        num_kv_heads: KV heads of these layers (1 for an MLA latent).
        head_dim: head dimension (the latent width for MLA).
        dtype: one of ``SUPPORTED_DTYPES`` (a numpy / jax dtype is accepted, stored by name).
        window: ``WINDOW``: the window in tokens, a positive int; None for the other kinds.
        chunk: ``CHUNK``: the chunk in tokens, a positive int; None for the other kinds.
        mla: K and V are one latent tensor (``FULL`` only; needs ``num_kv_heads=1``).
        page_size: tokens per page; None (the default) takes the spec's, otherwise it must
            equal it (every group pages the same tokens).
        state: ``STATE`` only (and required there): each layer's state arrays
            (:class:`StateArray`, or dicts of their fields). A ``STATE`` group has no K/V:
            ``num_kv_heads`` and ``head_dim`` stay 0 and ``dtype`` is unused (each array has
            its own).

    Raises:
        ValueError / TypeError: a bad field, the message naming it (``window=0 must be a
            positive int``); a ``KVSpec`` prefixes it with ``groups[i].``.
    """

    kind: GroupKind | str
    layers: tuple[int, ...]
    num_kv_heads: int = 0
    head_dim: int = 0
    dtype: str = "bfloat16"
    window: int | None = None
    chunk: int | None = None
    mla: bool = False
    page_size: int | None = None
    state: tuple[StateArray, ...] = ()

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        kind = parse_enum(GroupKind, "kind", self.kind)
        set_("kind", kind)
        layers: Any = self.layers
        if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
            raise TypeError(f"layers={layers!r} must be a sequence of ints")
        out = sorted(check_int(f"layers[{i}]", v, 0) for i, v in enumerate(layers))
        if not out:
            raise ValueError("layers=() must name at least one layer")
        dups = sorted({a for a, b in itertools.pairwise(out) if a == b})
        if dups:
            raise ValueError(f"layers={tuple(layers)!r} has duplicate layer(s) {dups}")
        set_("layers", tuple(out))
        if kind is GroupKind.STATE:
            for name in ("num_kv_heads", "head_dim"):
                if getattr(self, name) != 0:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r}: a 'state' group has no K/V (leave it 0;"
                        " the state arrays say what a layer keeps)"
                    )
            st = _as_state(self.state)
            if not st:
                raise ValueError("state=() must name at least one array for a 'state' group")
            set_("state", st)
        else:
            set_("num_kv_heads", check_int("num_kv_heads", self.num_kv_heads, 1))
            set_("head_dim", check_int("head_dim", self.head_dim, 1))
            if self.state != ():
                raise ValueError(f"state={self.state!r} is for 'state' groups only")
        set_("dtype", _parse_dtype(self.dtype))
        for name, own in (("window", GroupKind.WINDOW), ("chunk", GroupKind.CHUNK)):
            value = getattr(self, name)
            if kind is own:
                set_(name, _positive(name, value))
            elif value is not None:
                raise ValueError(f"{name}={value!r} must be None for a {kind.value!r} group")
        set_("mla", check_bool("mla", self.mla))
        if self.mla and kind is not GroupKind.FULL:
            raise ValueError(f"mla=True is for full groups only, not a {kind.value!r} group")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(
                f"mla=True needs num_kv_heads=1 (one latent 'head'), got {self.num_kv_heads}"
            )
        if self.page_size is not None:
            set_("page_size", _positive("page_size", self.page_size))

    def need_start(self, n: int) -> int:
        """The first token a continuation at prefix length ``n`` reads in these layers.

        Tokens before it are outside the kept set: their K/V in these layers is never read
        again by a request that continues at ``n`` or later.

        Args:
            n: the cached prefix's length in tokens (an int >= 0).

        Returns:
            ``FULL``: 0; ``WINDOW``: ``max(0, n - window)``; ``CHUNK``: ``n // chunk * chunk``;
            ``STATE``: ``n`` (no token: the checkpoint at ``n``).

        Raises:
            TypeError / ValueError: ``n`` not an int >= 0.
        """
        n = check_int("n", n, 0)
        if self.kind is GroupKind.WINDOW:
            assert self.window is not None
            return max(0, n - self.window)
        if self.kind is GroupKind.CHUNK:
            assert self.chunk is not None
            return n // self.chunk * self.chunk
        if self.kind is GroupKind.STATE:
            return n
        return 0

    @property
    def layer_state_bytes(self) -> int:
        """``STATE``: bytes of one layer's state arrays, unpadded (0 for other kinds)."""
        return sum(a.nbytes for a in self.state)

    @property
    def state_heads(self) -> int:
        """``STATE``: the parts a slot's layer row is split into (what a mesh shards): the
        greatest common divisor of the arrays' head axes (``StateArray.head_axis``), 1 when
        none names one (every device keeps whole slots) and for other kinds."""
        sizes = [a.heads for a in self.state if a.heads is not None]
        return math.gcd(*sizes) if sizes else 1

    @property
    def head_words(self) -> int:
        """``STATE``: uint32 words of one head's part of one layer's row: each array's part
        (``StateArray.head_words``) back to back; with more than one head, rounded up to an
        even count (the part is stored as two halves, see :meth:`spec`)."""
        h = self.state_heads
        words = sum(a.head_words(h) for a in self.state)
        return words if h == 1 else words + words % 2

    @property
    def slot_words(self) -> int:
        """``STATE``: uint32 words one layer's state takes in a slot (with one head: its
        arrays' bytes back to back, each array starting at a 4-byte boundary; with
        ``state_heads`` > 1, that many parts of :attr:`head_words`)."""
        return self.state_heads * self.head_words

    @property
    def slot_bytes(self) -> int:
        """``STATE``: bytes of one state slot (every layer's state at one prefix position);
        0 for other kinds."""
        return len(self.layers) * self.slot_words * 4

    def spec(self, page_size: int, shard: str = "") -> KVSpec:
        """A plain ``KVSpec`` of this group's pages: ``len(layers)`` layers of its heads, dim,
        dtype and mla, ``page_size`` tokens a page. A ``STATE`` group's "page" is one state
        slot: ``len(layers)`` layers of one ``slot_words``-wide float32 row (raw bits, one
        "token", one latent head), so its pools, copies and L3 entries are those of pages;
        with ``state_heads`` > 1, ``state_heads`` kv heads of ``head_words / 2`` as K and V
        (each head's part in two halves), so that a mesh splits slots over heads as pages.

        Raises:
            ValueError: ``page_size`` differs from this group's own ``page_size``.
        """
        if self.page_size is not None and page_size != self.page_size:
            raise ValueError(f"page_size={page_size!r} differs from the group's {self.page_size}")
        if self.kind is GroupKind.STATE:
            one = self.state_heads == 1  # one latent row, else heads of K and V halves
            return KVSpec(
                num_layers=len(self.layers),
                num_kv_heads=self.state_heads,
                head_dim=self.head_words if one else self.head_words // 2,
                dtype="float32",
                page_size=1,
                mla=one,
                shard=shard,
            )
        return KVSpec(
            num_layers=len(self.layers),
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
            mla=self.mla,
            shard=shard,
        )

    def describe(self) -> str:
        """One readable line: ``"window(4096) layers 0-4,6-10: 8x128 bfloat16"``."""
        kind = self.kind.value if isinstance(self.kind, GroupKind) else str(self.kind)
        if self.window is not None:
            kind += f"({self.window})"
        if self.chunk is not None:
            kind += f"({self.chunk})"
        mla = " mla" if self.mla else ""
        page = "" if self.page_size is None else f" P{self.page_size}"
        if self.state:
            arrays = ", ".join(
                f"{a.name}[{','.join(map(str, a.shape))}] {a.dtype}" for a in self.state
            )
            return f"{kind} layers {_layers_text(self.layers)}: {arrays}{page}"
        return (
            f"{kind} layers {_layers_text(self.layers)}: "
            f"{self.num_kv_heads}x{self.head_dim} {self.dtype}{mla}{page}"
        )

    def as_json(self) -> dict[str, Any]:
        """The group as plain JSON-able data (``kind`` as its string, ``layers`` a list)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["kind"] = GroupKind(self.kind).value
        out["layers"] = list(self.layers)
        if self.state:
            out["state"] = [a.as_json() for a in self.state]
        else:  # (attention groups' JSON stays what it was)
            del out["state"]
        return out


_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(LayerGroup))


def _as_groups(groups: Any) -> tuple[LayerGroup, ...]:
    """``KVSpec.groups`` (a sequence of LayerGroups or dicts of their fields) checked, each
    error prefixed by ``groups[i].``."""
    if isinstance(groups, (str, bytes, Mapping)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups={groups!r} must be a sequence of LayerGroup")
    out = []
    for i, g in enumerate(groups):
        if isinstance(g, LayerGroup):
            fields = {name: getattr(g, name) for name in _GROUP_FIELDS}
        elif isinstance(g, Mapping):
            fields = dict(g)
            unknown = sorted(set(fields) - set(_GROUP_FIELDS))
            if unknown:
                raise ValueError(
                    f"groups[{i}] has unknown field(s) {unknown}; known: {list(_GROUP_FIELDS)}"
                )
            need = ["kind", "layers"]
            if str(fields.get("kind", "")).lower() != "state":
                need += ["num_kv_heads", "head_dim"]
            missing = [n for n in need if n not in g]
            if missing:
                raise ValueError(f"groups[{i}] lacks field(s) {missing}")
        else:
            raise TypeError(f"groups[{i}]={g!r} must be a LayerGroup or a dict of its fields")
        try:
            out.append(LayerGroup(**fields))  # checked again: a frozen instance may be forged
        except (ValueError, TypeError) as e:
            raise type(e)(f"groups[{i}].{e}") from None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class KVSpec:
    """Shape and dtype of the KV cache of one model.

    Args:
        num_layers: transformer layers.
        num_kv_heads: KV heads (1 for an MLA latent cache).
        head_dim: head dimension (the latent width for MLA).
        dtype: one of ``SUPPORTED_DTYPES``.
        page_size: tokens per page.
        mla: K and V are one tensor (a latent cache); the KV axis then has size 1.
        shard: which kv heads of a larger cache these pages hold ("" for all): the spec of
            one process's share of a cache sharded over several processes (``"2:4/8"``:
            heads 2 to 4 of 8). Part of the fingerprint when set, so L3 keys carry the shard
            and a different process count is a miss.
        groups: the model's layer groups, when it mixes full attention with sliding-window or
            chunked local layers (a list is accepted; stored as a tuple of ``LayerGroup`` in
            order of their first layer). Empty (the default): every layer is full attention and
            the other fields say everything. Otherwise exactly one ``FULL`` group, every layer
            ``0 .. total_layers - 1`` in exactly one group, and ``num_layers``,
            ``num_kv_heads``, ``head_dim``, ``dtype`` and ``mla`` describe the full group's
            pages (``num_layers = len(full_group.layers)``): those are "the" pages of the page
            pools and copies. A local group only needs a prefix's last tokens again
            (``LayerGroup.need_start``). One full group over all layers is today's spec and is
            stored as ``groups=()``. See ``from_groups`` and ``from_pattern``.

    The KV of ``n`` pages, as every public API takes and returns it, has shape
    ``kv_shape(n) = (num_layers, kv_factor, n, page_size, num_kv_heads, head_dim)``.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    page_size: int = 16
    mla: bool = False
    shard: str = ""
    groups: tuple[LayerGroup, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):  # stored as int
            object.__setattr__(self, name, check_int(name, getattr(self, name), 1))
        # a str once built; the constructor takes a numpy/jax dtype too
        object.__setattr__(self, "dtype", _parse_dtype(self.dtype))
        object.__setattr__(self, "mla", check_bool("mla", self.mla))
        if not isinstance(self.shard, str):
            raise TypeError(f"shard={self.shard!r} must be a str")
        if self.mla and self.num_kv_heads != 1:
            raise ValueError(
                f"mla=True needs num_kv_heads=1 (one latent 'head'), got {self.num_kv_heads}"
            )
        object.__setattr__(self, "groups", self._checked_groups(_as_groups(self.groups)))

    def _checked_groups(self, groups: tuple[LayerGroup, ...]) -> tuple[LayerGroup, ...]:
        """The groups in canonical form (by first layer; () for one full group), or the
        error naming what is wrong."""
        if not groups:
            return ()
        fulls = [i for i, g in enumerate(groups) if g.kind is GroupKind.FULL]
        if len(fulls) != 1:
            kinds = [GroupKind(g.kind).value for g in groups]
            raise ValueError(
                f"groups (kinds {kinds}) needs exactly one full-attention group, got {len(fulls)}"
            )
        total = sum(len(g.layers) for g in groups)
        owner: dict[int, int] = {}
        for i, g in enumerate(groups):
            if g.page_size is not None and g.page_size != self.page_size:
                raise ValueError(
                    f"groups[{i}].page_size={g.page_size} differs from page_size={self.page_size}"
                    " (every group pages the same tokens)"
                )
            for layer in g.layers:
                if layer in owner:
                    raise ValueError(
                        f"groups: layer {layer} is in both groups[{owner[layer]}] and groups[{i}]"
                    )
                owner[layer] = i
        for layer in range(total):
            if layer not in owner:
                beyond = sorted(x for x in owner if x >= total)
                raise ValueError(
                    f"groups: layer {layer} is in no group (the {total} layers of the groups "
                    f"must be 0..{total - 1}; beyond: {beyond})"
                )
        i = fulls[0]
        full = groups[i]
        for name, want in (
            ("num_layers", len(full.layers)),
            ("num_kv_heads", full.num_kv_heads),
            ("head_dim", full.head_dim),
            ("dtype", full.dtype),
            ("mla", full.mla),
        ):
            if getattr(self, name) != want:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} differs from the full group's "
                    f"(groups[{i}]: {want!r}); the top-level fields describe its pages"
                )
        if len(groups) == 1:
            return ()  # one full group over every layer: today's plain spec
        return tuple(sorted(groups, key=lambda g: g.layers[0]))

    @classmethod
    def from_groups(
        cls,
        groups: Sequence[LayerGroup | Mapping[str, Any]],
        *,
        page_size: int = 16,
        shard: str = "",
    ) -> KVSpec:
        """A spec of these layer groups, the top-level fields taken from the full group.

        Raises:
            ValueError / TypeError: as the constructor (not exactly one full group, a layer in
                two groups or in none, a page size differing, a bad group field).
        """
        gs = _as_groups(groups)
        fulls = [g for g in gs if g.kind is GroupKind.FULL]
        if len(fulls) != 1:
            kinds = [GroupKind(g.kind).value for g in gs]
            raise ValueError(
                f"groups (kinds {kinds}) needs exactly one full-attention group, got {len(fulls)}"
            )
        full = fulls[0]
        return cls(
            num_layers=len(full.layers),
            num_kv_heads=full.num_kv_heads,
            head_dim=full.head_dim,
            dtype=full.dtype,
            page_size=page_size,
            mla=full.mla,
            shard=shard,
            groups=gs,
        )

    @classmethod
    def from_pattern(
        cls,
        pattern: str,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: Any = "bfloat16",
        page_size: int = 16,
        window: int | None = None,
        chunk: int | None = None,
        mla: bool = False,
        state: Sequence[StateArray | Mapping[str, Any]] | None = None,
    ) -> KVSpec:
        """A spec of a repeating layer pattern (:func:`parse_pattern`): ``"5:1"`` is five
        local layers then one full one, repeated over ``num_layers`` (the last repetition may
        be cut short); ``"R3:F1"`` is three recurrent layers (a ``STATE`` group of ``state``
        arrays) then one full one; ``"R2:S1:F1"`` two recurrent, one local and one full layer
        (all three kinds: the groups full, local, state in that order).

        The local layers are sliding-window layers of ``window`` tokens, or chunked
        local-attention layers of ``chunk`` tokens when ``chunk`` is given instead. Every layer
        has the same heads, dim and dtype. ``"0:1"``, ``"full"`` or ``""``: every layer full
        (the plain spec, ``groups=()``).

        Args:
            pattern: ``"a:b"``, ``a`` local then ``b`` full layers (non-negative ints); letter
                tagged counts (``"Ra:Fb"``, ``"Ra:Sb:Fc"``, any order); or ``"full"`` / ``""``.
            num_layers: layers of the model.
            num_kv_heads: KV heads of every layer.
            head_dim: head dimension of every layer.
            dtype: KV dtype of every layer.
            page_size: tokens per page.
            window: sliding window in tokens (local layers as ``WINDOW``).
            chunk: chunk in tokens (local layers as ``CHUNK``).
            mla: the full layers hold an MLA latent (refused with local layers: a local group
                is never MLA).
            state: the recurrent layers' state arrays, for a pattern with ``R`` (required
                there, refused otherwise).

        Raises:
            ValueError / TypeError: naming ``pattern`` (not one of the forms, no layers, no
                full layer left), ``window`` / ``chunk`` (both given, neither for a pattern
                with local layers, one for a pattern without), ``state`` (missing or given
                as for ``window``), or a field as the constructor does.
        """
        runs = parse_pattern(pattern)
        count = dict(runs)
        n_rec = count.get("r", 0)
        if "r" in count and "s" not in count:
            for name, value in (("window", window), ("chunk", chunk)):
                if value is not None:
                    raise ValueError(
                        f"{name}={value!r} with pattern={pattern!r}: a recurrent layer keeps a "
                        "state, not a window"
                    )
        if "r" in count:
            if not n_rec and state is not None:
                raise ValueError(f"state= given, but pattern={pattern!r} has no recurrent layer")
            if n_rec and not state:
                raise ValueError(
                    f"pattern={pattern!r} has recurrent layers: give state= (their arrays)"
                )
        elif state is not None:
            raise ValueError(
                f"state= is for a recurrent pattern ('R3:F1'), not pattern={pattern!r}"
            )
        period = [k for k, n in runs for _ in range(n)]
        if not period:
            raise ValueError(f"pattern={pattern!r} has no layers")
        num_layers = check_int("num_layers", num_layers, 1)
        if window is not None and chunk is not None:
            raise ValueError(f"window={window!r} and chunk={chunk!r}: give one, not both")
        kinds = [period[i % len(period)] for i in range(num_layers)]
        full, local, recurrent = ([i for i, k in enumerate(kinds) if k == c] for c in "fsr")
        if not full:
            raise ValueError(
                f"pattern={pattern!r} over num_layers={num_layers} leaves no full-attention layer"
            )
        if not local:
            for name, value in (("window", window), ("chunk", chunk)):
                if value is not None:
                    raise ValueError(
                        f"{name}={value!r} given, but pattern={pattern!r} over "
                        f"num_layers={num_layers} has no local layer"
                    )
        elif window is None and chunk is None:
            raise ValueError(
                f"pattern={pattern!r} has local layers: give window= (sliding window) or "
                "chunk= (chunked local attention)"
            )
        elif mla:
            raise ValueError(f"mla=True: only the full layers may be MLA; pattern={pattern!r}")
        if n_rec and not recurrent:
            raise ValueError(
                f"state= given, but pattern={pattern!r} over num_layers={num_layers} has no "
                "recurrent layer"
            )
        shape = {"num_kv_heads": num_kv_heads, "head_dim": head_dim, "dtype": dtype}
        groups = [LayerGroup(GroupKind.FULL, tuple(full), **shape, mla=mla)]
        if local:
            kind = GroupKind.WINDOW if window is not None else GroupKind.CHUNK
            groups.append(LayerGroup(kind, tuple(local), **shape, window=window, chunk=chunk))
        if recurrent:
            assert state is not None
            try:
                groups.append(LayerGroup(GroupKind.STATE, tuple(recurrent), state=_as_state(state)))
            except (ValueError, TypeError) as e:
                raise type(e)(str(e) if str(e).startswith("state") else f"state: {e}") from None
        return cls.from_groups(groups, page_size=page_size)

    @property
    def window_groups(self) -> tuple[LayerGroup, ...]:
        """Every group but the full one (``WINDOW``, ``CHUNK`` and ``STATE``), in order:
        the groups whose pages (or state slots) are attached to the full-attention pages, and
        what every per-group index of the cache's API counts (``group=`` of
        ``write_window_kv``, ``write_state``; rows of ``window_pages``); empty for a plain
        spec."""
        return tuple(g for g in self.groups if g.kind is not GroupKind.FULL)

    @property
    def state_groups(self) -> tuple[int, ...]:
        """Indices in ``window_groups`` of the ``STATE`` groups (recurrent layers)."""
        return tuple(i for i, g in enumerate(self.window_groups) if g.kind is GroupKind.STATE)

    @property
    def state_bytes(self) -> int:
        """Bytes of one checkpoint: every ``STATE`` group's slot (0 without one)."""
        return sum(g.slot_bytes for g in self.groups)

    @property
    def total_layers(self) -> int:
        """Layers of the whole model, every group's (``num_layers`` for a plain spec)."""
        return sum(len(g.layers) for g in self.groups) if self.groups else self.num_layers

    @property
    def full_group(self) -> LayerGroup:
        """The full-attention group (for a plain spec, every layer's, from the top-level
        fields)."""
        for g in self.groups:
            if g.kind is GroupKind.FULL:
                return g
        return LayerGroup(
            GroupKind.FULL,
            tuple(range(self.num_layers)),
            self.num_kv_heads,
            self.head_dim,
            self.dtype,
            mla=self.mla,
        )

    @property
    def model_page_bytes(self) -> int:
        """Bytes of one page across every attention group's layers (``page_bytes`` for a
        plain spec; a ``STATE`` group's are per checkpoint, ``state_bytes``)."""
        if not self.groups:
            return self.page_bytes
        return sum(
            g.spec(self.page_size).page_bytes
            for g in self.groups
            if g.kind is not GroupKind.STATE  # (a checkpoint's bytes: ``state_bytes``)
        )

    def as_json(self) -> dict[str, Any]:
        """The spec as plain JSON-able data (``groups`` a list of dicts, kinds as strings)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["groups"] = [g.as_json() for g in self.groups]
        return out

    def describe_groups(self) -> str:
        """The groups readably, ``"; "``-separated (``"()"`` for a plain spec)."""
        return "; ".join(g.describe() for g in self.groups) if self.groups else "()"

    @property
    def kv_factor(self) -> int:
        """2 (K and V) or 1 (MLA latent)."""
        return 1 if self.mla else 2

    @property
    def jnp_dtype(self) -> np.dtype:
        """The compute dtype (``jnp.bfloat16`` etc.)."""
        return np.dtype(getattr(ml_dtypes, self.dtype, self.dtype))

    @property
    def bits_dtype(self) -> np.dtype:
        """Unsigned integer of the dtype's width: what the pools store (ARCHITECTURE.md: the
        pool is stored as raw bits)."""
        return np.dtype(_BITS_DTYPE[self.dtype])

    @property
    def itemsize(self) -> int:
        return self.bits_dtype.itemsize

    def kv_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """Shape of the KV of ``num_pages`` pages: [layers, kv, pages, page_size, heads, dim]."""
        return (
            self.num_layers,
            self.kv_factor,
            num_pages,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    def page_major_shape(self, num_pages: int) -> tuple[int, int, int, int, int, int]:
        """Shape of ``num_pages`` pages page-major (the ``page_first`` host layout, L3 entries):
        [pages, layers, kv, page_size, heads, dim]."""
        return (
            num_pages,
            self.num_layers,
            self.kv_factor,
            self.page_size,
            self.num_kv_heads,
            self.head_dim,
        )

    @property
    def page_elems(self) -> int:
        """Elements of one page across all layers and K/V."""
        return self.num_layers * self.kv_factor * self.page_size * self.num_kv_heads * self.head_dim

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all layers and K/V."""
        return self.page_elems * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one page of one layer and one of K/V (contiguous in every layout)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self.itemsize

    def fingerprint(self) -> str:
        """Stable short hash of everything that makes two caches' bytes incompatible."""
        text = (
            f"L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/{self.dtype}"
            f"/P{self.page_size}/mla{int(self.mla)}"
        )
        if self.shard:  # (unsharded keys stay what they were)
            text += f"/shard{self.shard}"
        for g in self.groups:  # (a plain spec has none: its keys stay what they were)
            text += (
                f"/group:{GroupKind(g.kind).value}:layers{','.join(map(str, g.layers))}"
                f":H{g.num_kv_heads}:D{g.head_dim}:{g.dtype}:window{g.window}:chunk{g.chunk}"
                f":mla{int(g.mla)}"
            )
            for a in g.state:  # (only STATE groups have arrays: other keys stay what they were)
                text += f":state:{a.name}:{'x'.join(map(str, a.shape))}:{a.dtype}"
                if a.head_axis is not None:  # (the slot's layout splits over heads)
                    text += f":head{a.head_axis}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def parse(
        cls,
        text: str | None,
        default: KVSpec,
        *,
        page_size: int | None = None,
        flag: str = "--spec",
    ) -> KVSpec:
        """A spec from a command's ``--spec``: ``"layers=32,kv_heads=8,head_dim=128,
        dtype=bfloat16,page_size=16,mla=1"`` (comma-separated ``key=value`` items, any subset).

        Args:
            text: the items; None or empty: ``default`` itself (page size aside).
            default: where a key left out takes its value (``hicache-jax lower``: Llama-3-8B's
                KV; ``hicache-jax replay``: one layer, one head of 1, float32).
            page_size: the page size, when the command sets it by its own flag (``replay
                --page-size``): then ``page_size`` is not a key of ``text``.
            flag: the flag named in errors.

        Raises:
            ValueError: an item that is not ``key=value`` with a known key (naming the item and
                the keys), or an int key whose value is not an int; KVSpec's own checks.
        """
        keys = {
            "layers": "num_layers",
            "kv_heads": "num_kv_heads",
            "head_dim": "head_dim",
            "dtype": "dtype",
            "page_size": "page_size",
            "mla": "mla",
        }
        # (not dataclasses.asdict: it would turn the LayerGroups into dicts)
        fields = {f.name: getattr(default, f.name) for f in dataclasses.fields(default)}
        if page_size is not None:
            del keys["page_size"]
            fields["page_size"] = page_size
        for item in filter(None, (text or "").split(",")):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in keys:
                raise ValueError(
                    f"{flag} item {item!r}: expected key=value with key one of {', '.join(keys)}"
                )
            name = keys[key]
            if name == "dtype":
                fields[name] = value
            elif name == "mla":
                fields[name] = value.lower() in ("1", "true", "yes")
            else:
                try:
                    fields[name] = int(value)
                except ValueError:
                    raise ValueError(f"{flag} {item!r}: {value!r} is not an int") from None
        return cls(**fields)


@dataclasses.dataclass(frozen=True)
class HiCacheConfig:
    """Sizes and policies of one HiCache.

    Args:
        device_pages: pages in the device pool (L1).
        host_pages: pages in the host pool (L2); None -> ``round(host_ratio * device_pages)``.
        host_ratio: used only when ``host_pages`` is None.
        write_policy: "clean_ahead" (the default) | "write_through" |
            "write_through_selective" | "write_back" (see hicache.py).
        write_through_threshold: backup once ``hit_count >= threshold``; None -> 1 for
            write_through, 2 for write_through_selective (unused by write_back).
        eviction: "lru" | "lfu" | "fifo" | "mru" | "filo" | "priority" | "slru" | "value"
            (GreedyDual over what a recompute costs: ``tree/eviction.py``); None or
            "default" (the default): "value" where the full group has local groups of one
            kind beside it: window (or chunked) groups, whose long prompts cost fewer bytes a
            token (ARCHITECTURE.md, "Layer groups"), or ``STATE`` groups, whose checkpoints
            and pages are kept by what they save ("Recurrent state"); else "lru" (full
            attention alone, and window and state groups both, measured better with lru;
            ``HiCache`` resolves it: ``HiCache.cfg.eviction``, :func:`resolve_eviction`).
        load_back_threshold: tokens; host hits (``Match.host_len``, resident pages included)
            shorter than this are recomputed instead.
        load_back_quota: tokens; host hits that would copy more tokens than this are declined
            (None: unlimited).
        load_policy: "threshold" (the default: ``load_back_threshold`` / ``load_back_quota``) |
            "cost" (per request, the part of the host hit to load that the fitted cost model
            predicts fastest, the rest recomputed; see cache/loading/cost_model.py).
        prefill_cost: "cost": the serving stack's ``(n_new, n_cached) -> seconds``; None: the
            fit of ``HiCache.observe_prefill`` samples.
        max_load_tokens: "cost": at most this many tokens loaded per request (None: no cap).
        load_step_budget_tokens: "cost": at most this many tokens loaded per
            ``load_back_many`` call (a batched admission step; None: no budget).
        cost_page_bytes: "cost": the bytes one page weighs in the cost model's link figures
            (None: the spec's ``page_bytes``). A cache whose spec stands in for a larger model
            (the what-if simulator's) passes the modelled model's page, so that the warm-up
            figure and the fitted bandwidth speak of the modelled bytes.
        load_overlap: "cost": the request handle (``HiCache.begin``) may take a two-ended
            split of a host chain: its front recomputed while its back is copied into the
            request's own pages (cache/loading/overlap.py); the serving loop prefills the front,
            waits for the copy (``Request.wait_overlap``), prefills the rest. Default False.
        host_layout: "layer_first" | "page_first".
        copy_backend: "auto" | "xla" | "pallas" (device pool page movement).
        huge_pages: CPU backend: back both pools with transparent huge pages (Linux; ~2 ms
            per MiB at construction on the project's CPU machine, scattered copies ~10% faster;
            see hugepages.py and benchmarks/RESULTS.md).
        mesh: optional ``jax.sharding.Mesh``; the device pool is sharded over kv heads on
            ``shard_axis`` of it.
        shard_axis: mesh axis name; defaults to the mesh's first axis.
        storage: L3 URL ("file:///dir", "mooncake://host:port") or None.
        prefetch_policy: "best_effort" | "wait_complete" | "timeout".
        prefetch_timeout_s: base deadline of the "timeout" policy (grows with size).
        storage_write_policy: "write_through" (backed-up host pages also go to L3) |
            "write_back" (only host pages evicted from L2 go to L3).
        clean_ahead_pages: ``write_policy="clean_ahead"``: how many device pages at the
            eviction end of L1 are kept backed up ahead of eviction; None (the default): twice
            the largest allocation seen so far (alloc_pages / load_back), at least
            device_pages // 16 and at most device_pages // 2 (at least 1).
        kv_events: KV events, off by default (None: nothing recorded, ``take_events()``
            raises). A dict or its JSON string, like SGLang's ``--kv-events-config``:
            ``{"publisher": "queue"}`` keeps them for ``take_events()`` in-process;
            ``{"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "kv-events",
            "replay_endpoint": None, "buffer_steps": 10000}`` publishes them in vLLM's wire
            format (see events.py, events_zmq.py). Stored parsed, as a ``KVEventsConfig``.
        pin_max_share: the most of each pool (device, host) that ``HiCache.pin`` may hold, as a
            share of its pages (default 0.5: pins can never starve requests of more than half
            of a tier); a pin beyond it raises ``PinLimitError``.
        group: how the caches of several ``jax.distributed`` processes agree
            (``memory/group.py``); None: one process alone, else every process of
            ``jax.distributed`` (ARCHITECTURE.md, "Several processes").
        agreement_check_every: run ``HiCache.check_agreement()`` after every N-th public call
            (0: never; the tests use 1).
        agreement_timeout_s: how long an agreement waits for a peer process before
            ``GroupTimeoutError`` names it (the default group's timeout).
        completion_lag: None (default): a copy between L1 and L2 counts as done once it is
            seen landed (several processes: once every process has seen it, agreed at a
            request's start). An int K >= 1: it counts as done at the K-th request start
            (``match_prefix``, ``prefetch``) after its dispatch, waited for there if still
            moving, and at a wait; so what the cache decides depends on its calls alone, not
            on when copies land: every process decides alike with no agreement for it, and
            the same calls give the same decisions in every run. The price: a start whose
            copy of K starts ago is still moving waits for it (``stats()``:
            ``completion_lag_waits``, ``completion_lag_wait_seconds``); a larger K waits less
            and holds pages under copies longer (ARCHITECTURE.md, "Several processes").
        window_device_pages: with window groups (``KVSpec.window_groups``), the pages of each
            window group's device pool; None (default): ``device_pages`` (every full-attention
            page can hold one, so no window page is ever short). Fewer keeps less memory for
            the windows (the tree keeps only what continuations read): a caller's allocation
            then evicts until its window pages fit, and a load-back or backup that finds none
            free copies the full-attention pages without them (``window_pages_dropped``), so
            that prefix is not served from there (ARCHITECTURE.md, "Layer groups").
            ``hicache_jax.size_pools`` splits a tier's bytes between the pools by the default
            rule (the longest prompt's own window pages on L1, ``ceil(W / page_size)`` a mean
            prompt's pages of the full-attention pool).
        window_host_pages: the same for each window group's host pool; None: ``host_pages``.
        window_spare: True (default): a window page no node end reads any more stays
            as a spare page, freed first (oldest first) when its pool needs a page, so that a
            later request diverging there (a split of the node) still finds the window its
            new end reads; a backup or load-back copies them after the pages node ends
            read, where there is room, and they stay spare there (the host's own spare pages
            go first when the host pool needs a page). False: free them when their node enters
            the tree, on every tier (each split point where no request has diverged before
            then costs a recompute back to a servable end).
        storage_window_spare: with L3 (``storage``), also put the spare window pages a
            backup carries (False: only those a node end reads, so L3 keeps the windowed
            model's bytes, ``1/6 + 5/6 W/n`` of the all-full model's for a 5:1 pattern; None,
            the default: the same, but with ``STATE`` groups beside the window ones also those
            the interior checkpoints' ends read, as ``k`` below with ``k`` the largest power
            of two dividing ``checkpoint_every_pages``: every checkpoint is put to L3, and one
            whose window pages L3 lacks serves nothing from there).
            True: another cache on the same store (a restart, a second server) serves a prompt
            that leaves a stored one inside its node from L3 (``bench_state_l3 --layer-pattern
            5:1``: 1.00 of the all-full model's L3 hits, 0.53 without), at the cost of L3
            holding the window groups' pages of (almost) every position. An int ``k`` (a power
            of two, in pages): only the spare pages that the ends at multiples of ``k`` pages
            from the root read, so such a prompt is served from L3 up to the last of them
            before the point where it leaves the stored one (W 1024, 512-token pages, ``k`` 8:
            0.97 of the all-full model's L3 hits for 0.39 of its L3 bytes; 1 is True). A
            recurrent group's checkpoints are always all put.
        state_device_slots: with ``STATE`` groups (recurrent layers), the state slots of each
            such group's device pool: how many checkpoints L1 holds. None (default): as many
            as take a quarter of the full-attention device pool's bytes (at least 8, at most
            ``device_pages``). A checkpoint is usually worth many pages (a slot of a real
            hybrid is often megabytes): size this by bytes (``hicache_jax.size_pools``;
            ARCHITECTURE.md, "Recurrent state").
        state_host_slots: the same for the host pools; None: a quarter of the host pool's
            bytes (at least 8, at most ``host_pages``).
        checkpoint_every_pages: with ``STATE`` groups: besides the checkpoints at a request's
            commit, finish, the point where its prefix leaves the tree and its tail (below),
            one every this many pages of a prefill (``HiCache.checkpoint_positions``) where the
            device slots have room for them (free, or holding spare checkpoints of no higher
            rank: the every-``2 k`` ones asked for first); 0: none of those; None (default):
            none for a recurrent hybrid (``STATE`` groups beside the full group alone), every
            2,048 tokens with window groups beside them (``R2:S1:F1``, which they serve).
            Interior checkpoints are spare once their node is in the tree: kept while slots
            are free (they serve a later request that diverges there), thinned evenly as slots
            run short (ARCHITECTURE.md, "Recurrent state"). On Mooncake's trace they cost more
            slots than they serve (``bench_state_replay``): a later request leaves an earlier
            prompt at its end or a few pages before it, rarely deep inside it.
        checkpoint_tail_pages: with ``STATE`` groups: a checkpoint this many pages before each
            prompt's last whole page too (4, the default: where a later request that asks
            something else after the same context leaves it; measured on Mooncake's trace,
            ``bench_state_replay``); 0: none.
    """

    device_pages: int
    host_pages: int | None = None
    host_ratio: float = 4.0
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD
    write_through_threshold: int | None = None
    eviction: EvictionPolicy | str | None = None
    load_back_threshold: int = 16
    load_back_quota: int | None = None
    load_policy: str = "threshold"
    prefill_cost: Any = None
    max_load_tokens: int | None = None
    load_step_budget_tokens: int | None = None
    cost_page_bytes: int | None = None
    load_overlap: bool = False
    host_layout: HostLayout | str = HostLayout.LAYER_FIRST
    copy_backend: CopyBackend | str = CopyBackend.AUTO
    huge_pages: bool = True
    mesh: Any = None
    shard_axis: str | None = None
    storage: str | None = None
    prefetch_policy: PrefetchPolicy | str = PrefetchPolicy.BEST_EFFORT
    prefetch_timeout_s: float = 1.0
    storage_write_policy: WritePolicy | str = WritePolicy.WRITE_THROUGH
    clean_ahead_pages: int | None = None
    kv_events: KVEventsConfig | dict | str | None = None
    pin_max_share: float = 0.5
    group: Any = None
    agreement_check_every: int = 0
    agreement_timeout_s: float = 60.0
    completion_lag: int | None = None
    window_device_pages: int | None = None
    window_host_pages: int | None = None
    window_spare: bool = True
    storage_window_spare: bool | int | None = None
    state_device_slots: int | None = None
    state_host_slots: int | None = None
    checkpoint_every_pages: int | None = None
    checkpoint_tail_pages: int = 4

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("device_pages", check_int("device_pages", self.device_pages, 1))
        if self.host_pages is None:
            ratio = self.host_ratio
            if not is_real(ratio) or not math.isfinite(ratio) or ratio < 0:
                raise ValueError(f"host_ratio={self.host_ratio!r} must be a finite number >= 0")
            set_("host_pages", int(round(self.host_ratio * self.device_pages)))
        set_("host_pages", check_int("host_pages", self.host_pages, 0))
        set_("write_policy", parse_enum(WritePolicy, "write_policy", self.write_policy))
        if self.eviction is not None and self.eviction != "default":
            set_("eviction", EvictionPolicy.parse(self.eviction))
        else:
            set_("eviction", None)
        set_("host_layout", parse_enum(HostLayout, "host_layout", self.host_layout))
        set_("copy_backend", parse_enum(CopyBackend, "copy_backend", self.copy_backend))
        set_("huge_pages", check_bool("huge_pages", self.huge_pages))
        set_("prefetch_policy", parse_enum(PrefetchPolicy, "prefetch_policy", self.prefetch_policy))
        set_(
            "storage_write_policy",
            parse_enum(WritePolicy, "storage_write_policy", self.storage_write_policy),
        )
        if self.storage_write_policy is WritePolicy.CLEAN_AHEAD:
            raise ValueError(
                "storage_write_policy='clean_ahead' is not an L3 policy: use "
                "write_through, write_through_selective or write_back"
            )
        if self.clean_ahead_pages is not None:
            set_("clean_ahead_pages", check_int("clean_ahead_pages", self.clean_ahead_pages, 1))
        if self.write_through_threshold is None:
            set_(
                "write_through_threshold",
                default_write_through_threshold(WritePolicy(self.write_policy)),
            )
        set_(
            "write_through_threshold",
            check_int("write_through_threshold", self.write_through_threshold, 1),
        )
        set_("load_back_threshold", check_int("load_back_threshold", self.load_back_threshold, 0))
        if self.load_back_quota is not None:
            set_("load_back_quota", check_int("load_back_quota", self.load_back_quota, 0))
        if self.load_policy not in ("threshold", "cost"):
            raise ValueError(f"load_policy={self.load_policy!r} must be 'threshold' or 'cost'")
        if self.prefill_cost is not None and not callable(self.prefill_cost):
            raise TypeError(
                f"prefill_cost must be callable (n_new, n_cached) -> seconds, got "
                f"{type(self.prefill_cost).__name__}"
            )
        for name in ("max_load_tokens", "load_step_budget_tokens"):
            if getattr(self, name) is not None:
                set_(name, check_int(name, getattr(self, name), 0))
        if self.cost_page_bytes is not None:
            set_("cost_page_bytes", check_int("cost_page_bytes", self.cost_page_bytes, 1))
        check_bool("load_overlap", self.load_overlap)
        if self.load_overlap and self.load_policy != "cost":
            raise ValueError(
                "load_overlap=True needs load_policy='cost' (the split is the cost "
                "model's decision)"
            )
        if self.storage is not None and not isinstance(self.storage, str):
            raise TypeError(f"storage={self.storage!r} must be a URL string or None")
        timeout = self.prefetch_timeout_s
        if not is_real(timeout) or math.isnan(timeout) or timeout <= 0:
            raise ValueError(f"prefetch_timeout_s={self.prefetch_timeout_s!r} must be > 0")
        set_("kv_events", parse_kv_events(self.kv_events))
        share = self.pin_max_share
        if not is_real(share) or not 0.0 <= share <= 1.0:
            raise ValueError(f"pin_max_share={share!r} must be a number in [0, 1]")
        set_(
            "agreement_check_every",
            check_int("agreement_check_every", self.agreement_check_every, 0),
        )
        t = self.agreement_timeout_s
        if not is_real(t) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"agreement_timeout_s={t!r} must be a finite number > 0")
        if self.completion_lag is not None:
            set_("completion_lag", check_int("completion_lag", self.completion_lag, 1))
        set_("window_spare", check_bool("window_spare", self.window_spare))
        set_("storage_window_spare", _check_spare_every(self.storage_window_spare))
        for name in (
            "window_device_pages",
            "window_host_pages",
            "state_device_slots",
            "state_host_slots",
        ):
            if getattr(self, name) is not None:
                set_(name, check_int(name, getattr(self, name), 1))
        if self.checkpoint_every_pages is not None:
            every = check_int("checkpoint_every_pages", self.checkpoint_every_pages, 0)
            set_("checkpoint_every_pages", every)
        tail = check_int("checkpoint_tail_pages", self.checkpoint_tail_pages, 0)
        set_("checkpoint_tail_pages", tail)
        if self.shard_axis is not None and self.mesh is None:
            raise ValueError(f"shard_axis={self.shard_axis!r} given without a mesh")
        if self.mesh is not None:
            names = tuple(self.mesh.axis_names)
            axis = self.shard_axis if self.shard_axis is not None else names[0]
            if axis not in names:
                raise ValueError(f"shard_axis={axis!r} is not an axis of the mesh {names}")
            set_("shard_axis", axis)


# -- kv_events configuration -----------------------------------------------------------------

_ENDPOINT = re.compile(
    r"^(tcp://(\*|[A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d{1,5})|ipc://.+|inproc://.+)$"
)


@dataclass(frozen=True)
class KVEventsConfig:
    """``HiCacheConfig(kv_events=...)``, parsed and checked (like SGLang's ``--kv-events-config``).

    Attributes:
        publisher: "queue" (in-process ``take_events()``) | "zmq" (vLLM's wire format).
        endpoint: zmq: the PUB socket's address, bound by the cache ("tcp://*:5557",
            "tcp://127.0.0.1:5557", "ipc:///tmp/kv").
        topic: zmq: the first frame of every message.
        replay_endpoint: zmq: a ROUTER address for replay requests, or None.
        buffer_steps: batches kept (queue: waiting to be taken; zmq: waiting for the
            publisher thread, and again sent, for replay).
        buffer_bytes: bytes those batches may hold (queue: their page hashes and tokens, see
            :func:`record_bytes`; zmq: the same while waiting, the encoded payloads for replay).
            Default 16 MiB: ~2M tokens of int64 keys, ~170 batches of 12K-token requests (with
            their host copies), a few hundred ms of a busy cache's events: enough for a
            consumer that takes them every scheduler step, and small beside the 200 MB over
            the pools that a long replay may use in all (``benchmarks/bench_memory.py``).
        data_parallel_rank: zmq: the ``data_parallel_rank`` of every batch.
        encoding: zmq: each event as vLLM's releases encode it: ``"map"`` (the default,
            vLLM's since PR #42892, in v0.26: a map of field names tagged by ``"type"``) or
            ``"array"`` (vLLM's earlier positional form). The batch is an array either way.
        l3_medium: announce L3 pages too, under this wire ``medium``: None (the default: L3
            is not announced, a router routes on L1 and L2), ``"auto"`` (``"DISK"`` for a
            ``file://`` store, ``"EXTERNAL"`` for a shared one) or a name of its own
            (``"STORAGE"``, ``"REMOTE"``, ...).
        block_hash: the ``block_hashes`` sent: ``"tree"`` (the tree's chained XXH3 page
            hashes) or the ids vLLM computes for the same tokens, ``"vllm:sha256"`` /
            ``"vllm:sha256_cbor"`` (see events/block_ids.py).
        hash_seed: vLLM ids: the seed of ``NONE_HASH`` (as vLLM's ``PYTHONHASHSEED``); None:
            ``PYTHONHASHSEED`` if set, else random (ids then match no other process).
        groups: a spec with window groups (``KVSpec.window_groups``): which layer groups' pages
            are announced, each event naming its group (``group_idx``, ``kv_cache_spec_kind``):
            ``"all"`` (the default: the full-attention pages and every window group's pages
            the tree keeps) or ``"full"`` (the full-attention pages only, for a router that
            scores by them). Without window groups events name no group either way.
    """

    publisher: str = "queue"
    endpoint: str = "tcp://*:5557"
    topic: str = "kv-events"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    buffer_bytes: int = 16 << 20
    data_parallel_rank: int = 0
    encoding: str = "map"
    l3_medium: str | None = None
    block_hash: str = "tree"
    hash_seed: str | None = None
    groups: str = "all"


_PUBLISHERS = ("queue", "zmq")
_ENCODINGS = ("map", "array")
_BLOCK_HASHES = ("tree", "vllm:sha256", "vllm:sha256_cbor")
_GROUPS = ("all", "full")


def _check_endpoint(field: str, value: Any) -> None:
    m = _ENDPOINT.match(value) if isinstance(value, str) else None
    if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        raise ValueError(
            f"kv_events {field}={value!r} is not a ZMQ endpoint: use "
            "'tcp://HOST:PORT' (HOST '*' for every interface, PORT 1-65535), "
            "'ipc://PATH' or 'inproc://NAME'"
        )


def parse_kv_events(value: Any) -> KVEventsConfig | None:
    """``HiCacheConfig.kv_events`` (None, a dict, its JSON string or a KVEventsConfig) checked.

    Raises:
        ValueError / TypeError: naming the field (unknown publisher or key, malformed endpoint,
            buffer_steps or buffer_bytes not an int >= 1, ...).
    """
    if value is None or (isinstance(value, KVEventsConfig) and _checked(value)):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_events={value!r} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise TypeError(
            f"kv_events={value!r} must be None, a dict or its JSON string, e.g. "
            '{"publisher": "zmq", "endpoint": "tcp://*:5557"}'
        )
    names = {f.name for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(value) - names)
    if unknown:
        raise ValueError(f"kv_events has unknown field(s) {unknown}; known: {sorted(names)}")
    cfg = KVEventsConfig(**value)
    _checked(cfg)
    return cfg


def _checked(cfg: KVEventsConfig) -> bool:
    if cfg.publisher not in _PUBLISHERS:
        raise ValueError(
            f"kv_events publisher={cfg.publisher!r} is not one of: "
            f"{', '.join(map(repr, _PUBLISHERS))}"
        )
    for field, low in (("buffer_steps", 1), ("buffer_bytes", 1), ("data_parallel_rank", 0)):
        v = getattr(cfg, field)
        if not is_int(v) or v < low:
            raise ValueError(f"kv_events {field}={v!r} must be an int >= {low}")
    if not isinstance(cfg.topic, str):
        raise TypeError(f"kv_events topic={cfg.topic!r} must be a str")
    for field, allowed in (
        ("encoding", _ENCODINGS),
        ("block_hash", _BLOCK_HASHES),
        ("groups", _GROUPS),
    ):
        if getattr(cfg, field) not in allowed:
            raise ValueError(
                f"kv_events {field}={getattr(cfg, field)!r} is not one of: "
                f"{', '.join(map(repr, allowed))}"
            )
    for field in ("l3_medium", "hash_seed"):
        v = getattr(cfg, field)
        if v is not None and (not isinstance(v, str) or not v):
            raise TypeError(f"kv_events {field}={v!r} must be None or a non-empty str")
    _check_endpoint("endpoint", cfg.endpoint)
    if cfg.replay_endpoint is not None:
        _check_endpoint("replay_endpoint", cfg.replay_endpoint)
        if cfg.replay_endpoint == cfg.endpoint:
            raise ValueError(
                f"kv_events replay_endpoint={cfg.replay_endpoint!r} must differ from endpoint"
            )
    return True


def _check_spare_every(value: Any) -> bool | int | None:
    """``HiCacheConfig.storage_window_spare``: None, a bool, or an int of pages that is a
    power of two (the spacing of the ends whose window pages are put); TypeError / ValueError
    naming the field."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not is_int(value):
        raise TypeError(
            f"storage_window_spare={value!r} must be a bool, None, or an int of pages (a power "
            "of two)"
        )
    k = int(value)
    if k < 1 or k & (k - 1):
        raise ValueError(
            f"storage_window_spare={k} must be a power of two >= 1 (pages between the ends "
            "whose spare window pages are put)"
        )
    return k
