"""Replay of a hybrid recurrent model (``R3:F1``): its spec, its pools at equal bytes, the state
bytes it holds, and the oracle it is judged against (ARCHITECTURE.md, "Layer groups"; the
cache's state groups: ``GroupKind.STATE``).

This module owns what ``hicache-jax replay --layer-pattern R3:F1`` (and
:func:`hicache_jax.replay.driver.run`'s ``state_share`` / ``checkpoint_every``) adds for a
model whose local layers are recurrent (Gated DeltaNet, Mamba): a full-attention group plus a
``STATE`` group whose checkpoints (a fixed-size state after exactly ``n`` tokens) are held in
state slots attached to the page ending at ``n``. A prefix is servable only where it ends at a
page holding a checkpoint.

- **The spec** (:func:`state_spec`): ``KVSpec.from_pattern("R3:F1")`` over one period of
  layers, the full layer one KV head of dim 1, float32 (8 bytes a token, as the plain replay's
  ``TINY_SPEC``), and state arrays sized so that one checkpoint costs ``state_tokens`` tokens'
  worth of the full-attention KV bytes: only the ratio slot bytes / page bytes matters to the
  figures. The default, :data:`QWEN3_NEXT_STATE_TOKENS`, is Qwen3-Next-80B-A3B's ratio
  (:func:`qwen3_next_state_tokens`).
- **The pools at equal bytes** (:func:`pools_for`): a capacity is tokens' worth of the hybrid
  model's bytes per token (its full-attention KV bytes a token): L1 of ``D`` pages is ``B = D
  * page_bytes`` bytes, split into ``N_f`` full-attention pages and ``N_s`` state slots:
  ``N_f * page_bytes + N_s * slot_bytes <= B``; L2 the same with its ratio.
- **The default split** (:func:`default_state_slots`), per tier, from numbers a serving stack
  is configured with (pool bytes, page size, slot bytes, its checkpoint interval ``K``, the
  longest prompt it admits, its mean prompt), never from the trace's hits: the slot pool holds

  - the checkpoints one request writes before it is inserted (L1 only): the branch point,
    its tail (``HiCacheConfig.checkpoint_tail_pages`` before its end) and its last page,
    plus one every ``2 K`` pages of the longest prompt (``K`` > 0): the cache admits a
    request's interior checkpoints only into slots that are free or hold a spare checkpoint
    of no higher rank, highest rank first (``Windows.positions``), so a pool short of the
    full count still gets the every-``2 K`` ones;
  - plus one checkpoint for every mean prompt's pages of the full-attention pool: the tree
    holds about one leaf per request it keeps, and under the cache's default eviction for a
    hybrid (``value``: every checkpoint goes by what it saves, ``tree/eviction.py``) a kept
    prompt keeps about the one a later request uses (its tail or its end); two with interior
    checkpoints (``K`` > 0: an end and a branch point each).

  Interior checkpoints (``K`` > 0) beyond those are spare in the tree: they use the slots
  left free and are not budgeted (the interval's trade shows in the hits and the state bytes
  held, not in the split). ``K`` None: the cache's default (``HiCacheConfig
  .checkpoint_every_pages=None``: none). ``K = "auto"`` (:data:`AUTO`) spreads
  the slots over the pages:
  ``K = ceil(pages / slots)`` of the split made without an interval, so that the slot pool
  holds one checkpoint every ``K`` pages of a full page pool (again from the pools' numbers
  only).
- **The state bytes held** (:class:`StateHolding`): sampled after every request, the bytes of
  the state slots used on both tiers over the bytes of the pages and slots used: the state
  bytes' share of what the cache holds (mean over the run).
- **The oracle**: the same bytes as an all-pages cache in which every page boundary holds a
  checkpoint for free, i.e. an exact LRU of ``L1 + L2`` full-attention pages of those bytes
  (the replay's ``lru_total`` reference); :data:`STATE_TARGET` is the ratio the hybrid's hit
  ratio should reach of it.

Threading: plain functions and values; a :class:`StateHolding` belongs to its replay's thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Protocol, TypeVar

import numpy as np

from hicache_jax.cache.windows import interval_pages
from hicache_jax.replay.windows import Demand, pattern_kind, solve_demands
from hicache_jax.spec import HiCacheConfig, KVSpec, StateArray, parse_pattern
from hicache_jax.validation import is_real

__all__ = [
    "AUTO",
    "Checkpoints",
    "QWEN3_NEXT",
    "QWEN3_NEXT_STATE_TOKENS",
    "STATE_TARGET",
    "StateHolding",
    "StatePools",
    "check_interval",
    "default_interval",
    "check_state_share",
    "default_state_slots",
    "is_state_pattern",
    "pools_for",
    "qwen3_next_state_tokens",
    "slot_bytes",
    "slot_floor",
    "state_demand",
    "state_spec",
    "tier_slots",
    "with_interval",
]

#: ``checkpoint_every="auto"``: the interval that spreads a tier pair's slots over its pages.
AUTO = "auto"

#: What the hybrid's hit ratio should reach of the every-page oracle's (an LRU of its bytes).
STATE_TARGET = 0.95

#: Qwen3-Next-80B-A3B's public config (config.json): 48 layers, one full-attention layer every
#: 4 (``full_attention_interval``), GQA 2 KV heads of dim 256 in bf16; the other 36 layers are
#: Gated DeltaNet with 16 key heads and 32 value heads of dim 128, a causal conv of width 4
#: (``linear_conv_kernel_dim``) over the q, k and v channels (2 x 16 x 128 + 32 x 128 = 8192).
#: Assumed as serving stacks keep them (vLLM, SGLang): the recurrent state in float32
#: ``[32, 128, 128]`` a layer, the conv state the last ``width - 1`` = 3 inputs of each
#: channel in the model's dtype (bf16).
QWEN3_NEXT: dict[str, Any] = {
    "layers": 48,
    "full_attention_interval": 4,
    "num_kv_heads": 2,
    "head_dim": 256,
    "kv_dtype_bytes": 2,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_head_dim": 128,
    "conv_width": 4,
    "conv_dtype_bytes": 2,
    "ssm_dtype_bytes": 4,
}


def qwen3_next_state_tokens(c: dict[str, Any] = QWEN3_NEXT) -> float:
    """Bytes of one checkpoint (every recurrent layer's conv and recurrent state) over the
    full-attention KV bytes of one token: what a checkpoint costs in tokens of KV. For
    Qwen3-Next-80B-A3B: 36 x (3 x 8192 x 2 + 32 x 128 x 128 x 4) = 77,266,944 bytes over 12 x 2
    x 2 x 256 x 2 = 24,576 bytes a token: 3,144 tokens (6.14 pages of 512 tokens)."""
    full = c["layers"] // c["full_attention_interval"]
    rec = c["layers"] - full
    kv_token = full * 2 * c["num_kv_heads"] * c["head_dim"] * c["kv_dtype_bytes"]
    d = c["linear_head_dim"]
    channels = 2 * c["linear_num_key_heads"] * d + c["linear_num_value_heads"] * d
    conv = (c["conv_width"] - 1) * channels * c["conv_dtype_bytes"]
    ssm = c["linear_num_value_heads"] * d * d * c["ssm_dtype_bytes"]
    return rec * (conv + ssm) / kv_token


#: The default checkpoint cost in tokens of KV (:func:`qwen3_next_state_tokens`: 3144).
QWEN3_NEXT_STATE_TOKENS = qwen3_next_state_tokens()

#: The conv state array of each recurrent layer (3 x 16 float32: 192 bytes); the recurrent
#: state array takes the rest of the layer's bytes.
_CONV = (3, 16)


def is_state_pattern(pattern: str | None) -> bool:
    """Whether ``pattern`` names recurrent and full layers only (``"R3:F1"``): this module's
    replay (:func:`hicache_jax.replay.windows.pattern_kind`; False for a bad pattern)."""
    try:
        return isinstance(pattern, str) and pattern_kind(pattern) == "state"
    except ValueError:
        return False


def state_spec(
    pattern: str,
    page_size: int,
    state_tokens: float | None = None,
    *,
    window: int | None = None,
    flag: str = "--layer-pattern",
    tokens_flag: str = "--state-tokens",
    window_flag: str = "--window",
) -> KVSpec:
    """The replay's spec of ``pattern`` (``"R3:F1"``, or ``"R2:S1:F1"`` with sliding-window
    layers of ``window`` tokens): one period of layers, the full and sliding-window ones 8
    bytes a token each, the recurrent ones a conv array of :data:`_CONV` and a recurrent array
    so that one checkpoint costs ``state_tokens`` tokens of the full-attention layers' KV
    bytes (default :data:`QWEN3_NEXT_STATE_TOKENS`; rounded to whole float32 words a layer).

    Raises:
        ValueError / TypeError: naming ``flag`` (not a pattern of recurrent and full layers,
            and sliding-window ones with ``window``), ``window_flag`` (missing for a pattern
            with sliding-window layers, given for one without, not a positive int) or
            ``tokens_flag`` (not a positive number).
    """
    kind = pattern_kind(pattern, flag)
    if kind not in ("state", "mixed"):
        raise ValueError(f"{flag} {pattern!r} has no recurrent layer (e.g. R3:F1, R2:S1:F1)")
    if kind == "state" and window is not None:
        raise ValueError(f"{window_flag} is for a sliding-window {flag} (e.g. 5:1, R2:S1:F1)")
    if kind == "mixed":
        if window is None:
            raise ValueError(f"{flag} {pattern} needs {window_flag} (the sliding window in tokens)")
        if not isinstance(window, int) or isinstance(window, bool):
            raise TypeError(f"{window_flag} {window!r} must be an int of tokens")
        if window < 1:
            raise ValueError(f"{window_flag} {window} must be a positive number of tokens")
    count = dict(parse_pattern(pattern))
    a, b = count["r"], count["f"]
    tokens = QWEN3_NEXT_STATE_TOKENS if state_tokens is None else state_tokens
    if not is_real(tokens):
        raise TypeError(f"{tokens_flag} {tokens!r} must be a number of tokens")
    if not (math.isfinite(tokens) and tokens > 0):
        raise ValueError(f"{tokens_flag} {tokens:g} must be a positive number of tokens")
    token_bytes = b * 2 * 4  # K and V, one head of dim 1, float32, per full layer
    layer_words = max(1, round(tokens * token_bytes / (a * 4)))
    conv_words = _CONV[0] * _CONV[1]
    arrays = [StateArray("ssm", (layer_words,), "float32")]  # too small for a conv array
    if layer_words > conv_words:
        arrays = [
            StateArray("conv", _CONV, "float32"),
            StateArray("ssm", (layer_words - conv_words,), "float32"),
        ]
    return KVSpec.from_pattern(
        pattern,
        num_layers=sum(count.values()),
        num_kv_heads=1,
        head_dim=1,
        dtype="float32",
        page_size=page_size,
        window=window,
        state=arrays,
    )


def slot_bytes(spec: KVSpec) -> int:
    """Bytes of one checkpoint's slots across the STATE groups."""
    return sum(spec.window_groups[g].slot_bytes for g in spec.state_groups)


def check_state_share(share: Any, flag: str = "--state-share") -> float | None:
    """``share`` as a float in (0, 1), or None; ValueError / TypeError naming ``flag``."""
    if share is None:
        return None
    if not is_real(share):
        raise TypeError(f"{flag} {share!r} must be a number in (0, 1)")
    if not (math.isfinite(share) and 0 < share < 1):
        raise ValueError(f"{flag} {share:g} must be in (0, 1): the fraction of bytes for states")
    return float(share)


@dataclasses.dataclass(frozen=True)
class StatePools:
    """One tier pair's pools at the hybrid's bytes.

    Attributes:
        model_device_pages, model_host_pages: the budget, in full-attention pages' bytes.
        device_pages, host_pages: full-attention pages of L1 and L2.
        state_device_slots, state_host_slots: state slots of L1 and L2.
        device_share, host_share: the fraction of each tier's budget in state slots.
        slot_pages: one slot's bytes over one page's.
        checkpoint_every: the checkpoint interval in pages the split was made for (0: none;
            None: the cache's default, :func:`default_interval` pages).
    """

    model_device_pages: int
    model_host_pages: int
    device_pages: int
    host_pages: int
    state_device_slots: int
    state_host_slots: int
    device_share: float
    host_share: float
    slot_pages: float
    checkpoint_every: int | None = None

    @property
    def share(self) -> float:
        """The state slots' share of L1 + L2's bytes."""
        total = self.model_device_pages + self.model_host_pages
        slots = self.state_device_slots + self.state_host_slots
        return slots * self.slot_pages / total if total else 0.0

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"share": self.share}

    def configure(self, cfg: HiCacheConfig) -> HiCacheConfig:
        """``cfg`` (the budget's) with these pools and their checkpoint interval."""
        return dataclasses.replace(
            cfg,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            state_device_slots=self.state_device_slots,
            state_host_slots=self.state_host_slots or None,
            checkpoint_every_pages=self.checkpoint_every,
        )


def state_demand(
    spec: KVSpec,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | None = None,
    *,
    requests: bool = True,
) -> Demand:
    """The default rule's state slots of a tier (see the module docstring): one request's
    checkpoints (``requests``: L1 only) plus one a mean prompt's pages of the full-attention
    pool beside them, two with interior checkpoints
    (:func:`hicache_jax.replay.windows.solve_demands`)."""
    ps = spec.page_size
    longest = -(-longest_tokens // ps)
    every = default_interval(spec) if checkpoint_every is None else checkpoint_every
    own = 0
    if requests:
        own = 3 + (longest // (2 * every) if every > 0 else 0)
    span = max(1, -(-mean_tokens // ps))
    return Demand(Fraction(own), Fraction(2 if every > 0 else 1, span), slot_bytes(spec))


def default_state_slots(
    spec: KVSpec,
    model_pages: int,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | None = None,
    *,
    requests: bool = True,
) -> int:
    """The default rule's state slots of a tier of ``model_pages`` pages' bytes
    (:func:`state_demand`)."""
    budget = model_pages * spec.page_bytes
    return _state_slots(spec, budget, longest_tokens, mean_tokens, checkpoint_every, requests)


def _state_slots(
    spec: KVSpec,
    budget: int,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | None,
    requests: bool,
) -> int:
    """The default rule's state slots of a tier of ``budget`` bytes (before the floors)."""
    demand = state_demand(spec, longest_tokens, mean_tokens, checkpoint_every, requests=requests)
    (n_s,) = solve_demands(budget, spec.page_bytes, [demand])
    return n_s


def tier_slots(
    spec: KVSpec,
    budget: int,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | None,
    requests: bool,
    share: float | None = None,
) -> tuple[int, int]:
    """``(N_f, N_s)`` of a tier of ``budget`` bytes: ``share`` of them in state slots, or None:
    the default rule (:func:`state_demand`, :func:`solve_demands`); then at least 8 slots
    (:func:`slot_floor`) and at most one a full-attention page, at least one of each."""
    pf, s = spec.page_bytes, slot_bytes(spec)
    if share is None:
        n_s = _state_slots(spec, budget, longest_tokens, mean_tokens, checkpoint_every, requests)
    else:
        n_s = int(share * budget // s)
    n_s = slot_floor(n_s, budget, pf, s)
    n_f = max(1, (budget - n_s * s) // pf)
    return n_f, max(1, min(n_s, n_f))


def slot_floor(n_s: int, budget: int, page_bytes: int, slot: int) -> int:
    """``n_s`` slots of ``slot`` bytes each within a tier of ``budget`` bytes, at least 8
    (the cache's own floor) and leaving room for one page of ``page_bytes`` (the caller then
    keeps at most one slot a page)."""
    return max(8, min(n_s, (budget - page_bytes) // slot))


class _SlotPools(Protocol):
    """Pools with state slots (:class:`StatePools`, ``mixed.MixedPools``)."""

    @property
    def device_pages(self) -> int: ...
    @property
    def host_pages(self) -> int: ...
    @property
    def state_device_slots(self) -> int: ...
    @property
    def state_host_slots(self) -> int: ...


_P = TypeVar("_P", bound=_SlotPools)


def with_interval(make: Callable[[int | str | None], _P], every: int | str | None) -> _P:
    """``make(every)``, or for ``every`` :data:`AUTO` the interval that spreads the slots over
    the pages: ``ceil(pages / slots)`` of both tiers of ``make(0)`` (the split made for no
    interval), then ``make`` of it."""
    if every != AUTO:
        return make(every)
    base = make(0)
    slots = base.state_device_slots + base.state_host_slots
    return make(max(1, -(-(base.device_pages + base.host_pages) // max(slots, 1))))


def default_interval(spec: KVSpec) -> int:
    """The cache's interval in pages when ``checkpoint_every_pages`` is None: 0 for a
    recurrent hybrid (no interior checkpoints: a tail one instead), every 2,048 tokens with
    window groups beside (``HiCacheConfig``)."""
    return interval_pages(spec, None)


def check_interval(every: Any, flag: str = "--checkpoint-every") -> int | str | None:
    """``every`` as an int >= 0, :data:`AUTO`, or None (``"default"``: the cache's default);
    ValueError naming ``flag`` otherwise."""
    if every is None:
        return None
    if isinstance(every, str):
        text = every.strip().lower()
        if text == AUTO:
            return AUTO
        if text == "default":
            return None
        try:
            every = int(text)
        except ValueError:
            raise ValueError(f"{flag} {every!r} must be an int >= 0, 'auto' or 'default'") from None
    if not isinstance(every, int) or isinstance(every, bool) or every < 0:
        raise ValueError(f"{flag} {every!r} must be an int >= 0, 'auto' or 'default'")
    return every


def pools_for(
    spec: KVSpec,
    model_device_pages: int,
    host_ratio: float,
    *,
    share: float | None,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | str | None = None,
) -> StatePools:
    """The pools of L1 = ``model_device_pages`` and L2 = ``round(host_ratio x L1)`` pages'
    bytes: ``share`` of each tier's bytes in state slots, or None: the default rule
    (:func:`default_state_slots`). A tier keeps at least one page a slot and 8 slots (the
    cache's own floor). ``checkpoint_every`` :data:`AUTO`: the interval that spreads the slots
    over the pages, ``ceil(pages / slots)`` of both tiers of the split made for no interval
    (the split then made again for it)."""
    if checkpoint_every == AUTO:
        return with_interval(
            lambda every: pools_for(
                spec,
                model_device_pages,
                host_ratio,
                share=share,
                longest_tokens=longest_tokens,
                mean_tokens=mean_tokens,
                checkpoint_every=every,
            ),
            AUTO,
        )
    assert checkpoint_every is None or isinstance(checkpoint_every, int)
    model_host = int(round(host_ratio * model_device_pages))
    pf, s = spec.page_bytes, slot_bytes(spec)
    out = []
    for pages, requests in ((model_device_pages, True), (model_host, False)):
        if pages == 0:
            out.append((0, 0, 0.0))
            continue
        budget = pages * pf
        n_f, n_s = tier_slots(
            spec, budget, longest_tokens, mean_tokens, checkpoint_every, requests, share
        )
        out.append((n_f, n_s, n_s * s / budget))
    (df, ds, dsh), (hf, hs, hsh) = out
    return StatePools(
        model_device_pages, model_host, df, hf, ds, hs, dsh, hsh, s / pf, checkpoint_every
    )


class StateHolding:
    """The state bytes' share of what a cache holds (slots used over pages + slots used, both
    tiers), sampled after every request (:meth:`sample`) and averaged over the samples where
    it holds anything."""

    def __init__(self, spec: KVSpec) -> None:
        self.pf, self.ps = spec.page_bytes, slot_bytes(spec)
        self.n, self.sum_share, self.sum_slots = 0, 0.0, 0.0
        self.last = 0.0

    def sample(self, stats: dict[str, Any]) -> None:
        pages = stats["device_used_pages"] + stats["host_used_pages"]
        slots = stats["state_device_used_slots"] + stats["state_host_used_slots"]
        used = pages * self.pf + slots * self.ps
        if used <= 0:
            return
        self.last = slots * self.ps / used
        self.n += 1
        self.sum_share += self.last
        self.sum_slots += slots

    def figures(self) -> dict[str, float]:
        """``state_bytes_share`` (mean over the run), ``state_bytes_share_end`` and
        ``state_slots_used`` (mean, both tiers)."""
        n = max(self.n, 1)
        return {
            "state_bytes_share": self.sum_share / n,
            "state_bytes_share_end": self.last,
            "state_slots_used": self.sum_slots / n,
        }


class Checkpoints:
    """A hybrid model's checkpoints of each request (:mod:`hicache_jax.replay.states`): at
    ``cache.checkpoint_positions`` of its prompt beyond its cached prefix (the tree's branch
    point, every ``checkpoint_every_pages`` pages, its last whole page: what ``finish``
    inserts), written as zeros (the replay never reads state) into the request's own pages.
    At most the device slot pool's count, the last ones kept."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.ps = cache, cache.spec.page_size
        self.groups = cache.spec.state_groups
        self.limit = cache.cfg.state_device_slots
        self.zeros: dict[int, dict[int, list[Any]]] = {}
        self.written = 0

    def _state(self, g: int, n: int) -> list[Any]:
        by = self.zeros.setdefault(g, {})
        if n not in by:
            grp = self.cache.spec.window_groups[g]
            by[n] = [np.zeros((n, len(grp.layers), *a.shape), a.dtype) for a in grp.state]
        return by[n]

    def write(self, r: Any, tokens: Any) -> None:
        pos = self.cache.checkpoint_positions(tokens, r.cached_len)
        if self.limit is not None:
            pos = pos[-self.limit :]
        if not pos:
            return
        pages = r.device_pages[[p // self.ps - 1 for p in pos]]
        for g in self.groups:
            self.cache.write_state(g, pages, self._state(g, len(pos)))
        self.written += len(pos)

    def figures(self) -> dict[str, int]:
        return {"checkpoints_written": self.written}
