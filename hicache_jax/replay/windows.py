"""Replay of a sliding-window model: its spec, its pools at the all-full model's bytes, what it
holds per byte (ARCHITECTURE.md, "Layer groups").

This module owns three things of ``hicache-jax replay --layer-pattern`` (and of
:func:`hicache_jax.study.sweep`'s ``layer_pattern``):

- **The spec** (:func:`pattern_spec`): ``KVSpec.from_pattern`` over a small per-layer shape
  (one KV head of dim 1, float32: 8 bytes a token and layer; one period of the pattern, e.g.
  6 layers for ``5:1``), so that a 60M-token trace fits in memory as the plain replay's
  ``TINY_SPEC`` does: the replay never writes KV bytes, but the pools are allocated. Only the
  ratios of the groups' page bytes matter to the figures.
- **The pools at equal bytes** (:func:`split_pools`): a capacity stays "tokens' worth of the
  all-full model's bytes": L1 of ``D`` model pages is ``B = D * spec.model_page_bytes`` bytes,
  and the windowed cache gets the same ``B`` split between its full-attention pool (``N_f``
  pages of ``spec.page_bytes``) and its window pools (``N_w`` pages of each window group,
  :func:`window_page_bytes` a page across the groups): ``N_f * page_bytes + N_w *
  window_page_bytes <= B``; L2 the same with its ratio. The window share ``F`` (the fraction
  of each tier's bytes given to window pages) picks the split; :func:`default_window_pages`
  is the default rule.
- **What it holds per byte** (:class:`Holding`): sampled after every request, the model bytes
  of the tokens cached (full-attention pages used on both tiers, each a model page's worth)
  over the bytes of the full-attention and window pages used, averaged over the run: the
  bytes ratio ``r`` (1 for an all-full cache), and the window pages' share of those bytes.

The default rule (:func:`default_window_pages`), per tier, from numbers a serving stack is
configured with (its pool bytes, the page size, ``W``, the longest prompt it admits, its mean
prompt), never from the trace's hits (the replay takes the longest and the mean prompt of the
trace, :func:`prompt_tokens`): the window pool holds

- the longest admitted prompt's pages (a request's own pages hold every group's page until
  it is inserted; L1 only), admitted up to the all-full model's L1 (what the all-full cache of
  the same bytes admits);
- plus the tails the tree keeps: ``k = ceil(W / page_size)`` pages a node, one node per mean
  prompt's pages of the tier's full-attention pool (a node keeps at most ``k`` pages; the tree
  holds about one leaf per request it keeps).

And one number of the trace beyond its prompts, where :func:`pools_for` is given it (the
replay does): its distinct pages, ``D`` (a serving stack's analogue is the working set it is
sized for). Three consequences:

- a tier's full-attention pool never holds more than ``D`` pages (plus the longest prompt: a
  request's own pages before they are inserted); where the rule would give it more, the bytes
  past that go to the window pool, where they can still hold something;
- where L2's full-attention pool alone would hold more than that and L2 keeps a copy of every
  page L1 evicts (:func:`l2_keeps_evicted`: every write policy but write-through at a
  threshold above 1, ``write_through_selective``'s default),
  L1 is split as the all-full model's (a window page for every full-attention page, so it
  never reclaims a spare window page). Its full-attention pages then add no page that L2
  could not hold (the write policy backs L1's pages up to L2, which has room for all of
  them), only hits served without a load-back; as window pages, the same bytes keep every
  end inside L1's nodes servable and ride every backup to L2. Hits win over load-backs: this
  trades L1 hits for L2 hits and recomputed split points for hits (benchmarks/RESULTS.md,
  "Layer groups");
- where neither tier's full-attention pool alone would hold more than that but both together
  would (:func:`surplus_cap`), and the write policy makes the tiers one cache of their summed
  size (:func:`summed_tiers`: ``clean_ahead``, ``write_back``), each gives up the pages past it
  in proportion to its pool (L1 keeping the longest prompt's), their bytes to its window
  pool: the tiers' pages of the trace then still fit, and more of its split points keep
  their windows on the tier that serves them (what the 5:1 model lost at such a budget were
  matches cut for want of window pages on either tier; benchmarks/RESULTS.md, "Layer
  groups").

At most one window page per full-attention page: where the rule asks for more, the split is
the all-full model's (one window page per full page, which never runs short). So where the
longest prompt is as long as the all-full L1, the rule saves nothing on L1.

Threading: plain functions and values; a :class:`Holding` belongs to its replay's thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

from hicache_jax.replay.trace import Trace
from hicache_jax.spec import (
    GroupKind,
    HiCacheConfig,
    KVSpec,
    WritePolicy,
    default_write_through_threshold,
    parse_pattern,
)
from hicache_jax.validation import check_int, is_real, parse_enum

__all__ = [
    "Demand",
    "Holding",
    "PATTERN_SHAPE",
    "Pools",
    "cap_full_pages",
    "cap_tiers",
    "check_share",
    "default_window_pages",
    "full_page_limit",
    "l2_keeps_evicted",
    "pattern_kind",
    "pattern_period",
    "pattern_spec",
    "pools_for",
    "prompt_tokens",
    "solve_demands",
    "split_bytes",
    "split_pools",
    "split_tiers",
    "summed_tiers",
    "surplus_cap",
    "tier_pools",
    "window_demand",
    "window_page_bytes",
]

#: The replay's per-layer shape of a pattern's layers: one KV head of dim 1, float32.
PATTERN_SHAPE: dict[str, Any] = {"num_kv_heads": 1, "head_dim": 1, "dtype": "float32"}


def pattern_spec(
    pattern: str,
    window: int | None,
    page_size: int,
    *,
    base: KVSpec | None = None,
    flag: str = "--layer-pattern",
    window_flag: str = "--window",
) -> KVSpec:
    """The replay's spec of a layer pattern (``"5:1"``) with sliding windows of ``window``
    tokens: :data:`PATTERN_SHAPE` over one period of the pattern, or ``base``'s layers, heads,
    dim and dtype when given (e.g. from ``--spec``).

    Raises:
        ValueError / TypeError: naming ``flag`` (not ``a:b`` with ``a, b >= 1``, or a
            ``base`` whose layers leave no full one) or ``window_flag`` (missing, not a
            positive int).
    """
    if pattern_kind(pattern, flag) != "window":
        raise ValueError(
            f"{flag} {pattern}: recurrent layers are replayed by hicache_jax.replay.states "
            "(R3:F1) or hicache_jax.replay.mixed (R2:S1:F1)"
        )
    if window is None:
        raise ValueError(f"{flag} {pattern}: give {window_flag} (the sliding window in tokens)")
    if not isinstance(window, int) or isinstance(window, bool):
        raise TypeError(f"{window_flag} {window!r} must be an int of tokens")
    if window < 1:
        raise ValueError(f"{window_flag} {window} must be a positive number of tokens")
    if base is not None:
        if base.mla or base.groups:
            raise ValueError(f"{flag}: the per-layer shape must be plain (no mla, no groups)")
        heads, dim, dtype, layers = base.num_kv_heads, base.head_dim, base.dtype, base.num_layers
    else:
        heads, dim, dtype = (PATTERN_SHAPE[k] for k in ("num_kv_heads", "head_dim", "dtype"))
        layers = pattern_period(pattern, flag)
    try:
        return KVSpec.from_pattern(
            pattern,
            num_layers=layers,
            num_kv_heads=int(heads),
            head_dim=int(dim),
            dtype=dtype,
            page_size=page_size,
            window=window,
        )
    except ValueError as exc:
        raise ValueError(f"{flag} {pattern} with {layers} layers: {exc}") from None


def pattern_kind(pattern: str, flag: str = "--layer-pattern") -> str:
    """Which replay a layer pattern takes (:func:`hicache_jax.spec.parse_pattern`):
    ``"window"`` (sliding-window and full layers: ``5:1``, ``S5:F1``; this module),
    ``"state"`` (recurrent and full: ``R3:F1``; :mod:`hicache_jax.replay.states`) or
    ``"mixed"`` (all three: ``R2:S1:F1``; :mod:`hicache_jax.replay.mixed`).

    Raises:
        ValueError / TypeError: naming ``flag``: not a pattern, or a kind it names with no
            layer (each count >= 1), no full layer, or no layer but full ones.
    """
    if not isinstance(pattern, str):
        raise TypeError(f"{flag} {pattern!r} must be a string like 5:1, R3:F1 or R2:S1:F1")
    try:
        count = dict(parse_pattern(pattern))
    except ValueError:
        raise ValueError(
            f"{flag} {pattern!r} must be 'a:b' (a sliding-window layers then b full ones, "
            "repeating), e.g. 5:1; 'Ra:Fb' (a recurrent layers then b full ones), e.g. R3:F1; "
            "or two or three of Ra, Sb, Fc (recurrent, sliding-window, full layers, each "
            "letter once, in layer order), e.g. R2:S1:F1"
        ) from None
    if count.get("f", 0) < 1 or not ({"r", "s"} & count.keys()) or 0 in count.values():
        need = {
            frozenset("s"): "needs at least one sliding-window and one full layer (a, b >= 1)",
            frozenset("r"): "needs a recurrent and a full layer (a, b >= 1)",
            frozenset("rs"): "needs a recurrent, a sliding-window and a full layer (each >= 1)",
        }.get(
            frozenset(count.keys() - {"f"}),
            "needs a sliding-window or recurrent layer "
            "beside a full one (e.g. 5:1, R3:F1, R2:S1:F1)",
        )
        raise ValueError(f"{flag} {pattern!r} {need}")
    return {"s": "window", "r": "state"}.get("".join(sorted(count.keys() - {"f"})), "mixed")


def pattern_period(pattern: str, flag: str = "--layer-pattern") -> int:
    """Layers of one period of a replayable layer pattern (``5:1``: 6, ``R2:S1:F1``: 4);
    ValueError naming ``flag`` as :func:`pattern_kind`."""
    pattern_kind(pattern, flag)
    return sum(n for _, n in parse_pattern(pattern))


def check_share(share: Any, flag: str = "--window-share") -> float | None:
    """``share`` as a float in (0, 1), or None; ValueError / TypeError naming ``flag``."""
    if share is None:
        return None
    if not is_real(share):
        raise TypeError(f"{flag} {share!r} must be a number in (0, 1)")
    if not (math.isfinite(share) and 0 < share < 1):
        raise ValueError(f"{flag} {share:g} must be in (0, 1): the fraction of bytes for windows")
    return float(share)


def window_page_bytes(spec: KVSpec) -> int:
    """Bytes of one window page of every window group (what ``N_w`` pages cost a page; a
    ``STATE`` group's slots are :func:`hicache_jax.replay.states.slot_bytes`)."""
    return sum(g.spec(spec.page_size).page_bytes for g in _local_groups(spec))


def _local_groups(spec: KVSpec) -> tuple[Any, ...]:
    """The sliding-window and chunked groups of ``spec`` (its window groups but STATE)."""
    return tuple(g for g in spec.window_groups if g.kind is not GroupKind.STATE)


@dataclasses.dataclass(frozen=True)
class Pools:
    """One tier pair's pools at the all-full model's bytes.

    Attributes:
        model_device_pages, model_host_pages: the budget, in all-full model pages.
        device_pages, host_pages: full-attention pages of L1 and L2.
        window_device_pages, window_host_pages: pages of each window group's pool (L2: 0
            when L2 has no bytes).
        device_share, host_share: the fraction of each tier's budget in window pages.
    """

    model_device_pages: int
    model_host_pages: int
    device_pages: int
    host_pages: int
    window_device_pages: int
    window_host_pages: int
    device_share: float
    host_share: float

    def bytes_used(self, spec: KVSpec) -> tuple[int, int]:
        """Bytes of L1's and L2's pools (full + window), each at most its budget."""
        pf, pw = spec.page_bytes, window_page_bytes(spec)
        return (
            self.device_pages * pf + self.window_device_pages * pw,
            self.host_pages * pf + self.window_host_pages * pw,
        )

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def configure(self, cfg: HiCacheConfig) -> HiCacheConfig:
        """``cfg`` (the budget's) with these pools."""
        return dataclasses.replace(
            cfg,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            window_device_pages=self.window_device_pages,
            window_host_pages=self.window_host_pages or None,
        )


def split_bytes(budget: int, page_bytes: int, pw: int, window_pages: int) -> tuple[int, int]:
    """``(N_f, N_w)`` of ``budget`` bytes that gives ``window_pages`` pages of ``pw`` bytes to
    the window groups and the rest to full-attention pages of ``page_bytes``. ``N_w`` is at
    most ``N_f``; where it would be more, both are ``budget // (page_bytes + pw)`` (the
    all-full model's split: one window page per full-attention page)."""
    n_w = max(0, min(window_pages, budget // pw))
    n_f = (budget - n_w * pw) // page_bytes
    if n_w >= n_f:
        both = budget // (page_bytes + pw)
        return both, both
    return n_f, n_w


def split_pools(spec: KVSpec, model_pages: int, window_pages: int) -> tuple[int, int]:
    """``(N_f, N_w)`` of a tier of ``model_pages`` all-full model pages' bytes that gives
    ``window_pages`` pages to each window group: the rest of the bytes in full-attention
    pages. ``N_w`` is at most ``N_f``; where it would be more, both are ``model_pages`` (the
    all-full model's split: one window page per full-attention page)."""
    return split_bytes(
        model_pages * spec.model_page_bytes, spec.page_bytes, window_page_bytes(spec), window_pages
    )


def full_page_limit(distinct_pages: int, longest_tokens: int, page_size: int) -> int:
    """The most full-attention pages the default rule gives a tier of a trace of
    ``distinct_pages`` pages: those, plus the longest prompt's (a request's own pages before
    they are inserted)."""
    return distinct_pages + -(-longest_tokens // page_size)


def cap_full_pages(
    budget: int, page_bytes: int, pw: int, n_f: int, n_w: int, limit: int
) -> tuple[int, int]:
    """``(N_f, N_w)`` of a tier's ``budget`` bytes split ``(n_f, n_w)`` (full-attention pages
    of ``page_bytes``, window pages of ``pw``), with at most ``limit`` full-attention pages:
    the bytes of the pages past it go to the window pool (what :func:`split_bytes` gives, so
    at most one window page a full one), the last part of one in full-attention pages."""
    if n_f <= limit:
        return n_f, n_w
    spare = budget - max(limit, 1) * page_bytes
    return split_bytes(budget, page_bytes, pw, max(n_w, -(-spare // pw)))


def prompt_tokens(trace: Trace) -> tuple[int, int]:
    """``(longest, mean)`` prompt of ``trace`` in tokens (0, 0 for no request): what the
    default rule takes as the stack's admitted longest prompt and its mean prompt."""
    lens = [r.num_tokens for r in trace.requests]
    return (max(lens), -(-sum(lens) // len(lens))) if lens else (0, 0)


class Demand(NamedTuple):
    """What a default rule asks of a tier for one kind of attachment (window pages, state
    slots): ``own + rate * N_f`` of ``unit`` bytes each, ``N_f`` the tier's full-attention
    pages (:func:`solve_demands`)."""

    own: Fraction
    rate: Fraction
    unit: int


def solve_demands(budget: int, page_bytes: int, demands: Sequence[Demand]) -> list[int]:
    """Each demand's count (at least 1) in a tier of ``budget`` bytes whose full-attention
    pages of ``page_bytes`` take what the demands leave: ``N_f * page_bytes + sum(n_i *
    unit_i) = budget`` with ``n_i = own_i + rate_i * N_f``, solved exactly, each ``n_i``
    rounded up. One rule for the window pages (:func:`window_demand`), the state slots
    (:func:`hicache_jax.replay.states.state_demand`) and both at once
    (:mod:`hicache_jax.replay.mixed`)."""
    fixed = sum(d.own * d.unit for d in demands)
    n_f = (budget - fixed) / (page_bytes + sum(d.rate * d.unit for d in demands))
    return [max(math.ceil(d.own + d.rate * n_f), 1) for d in demands]


def window_demand(
    spec: KVSpec, model_pages: int, longest_tokens: int, mean_tokens: int, *, requests: bool
) -> Demand:
    """The default rule's window pages of a tier of ``model_pages`` all-full model pages
    (see the module docstring): the longest prompt's pages (``requests``: L1, where a
    request's own pages live; at most ``model_pages``) plus ``k`` pages for every mean
    prompt's pages of the full-attention pool beside them."""
    ps, k = spec.page_size, _tail_pages(spec)
    own = min(-(-longest_tokens // ps), model_pages) if requests else 0
    span = max(k, -(-mean_tokens // ps))  # a node keeps at most k pages, all of a shorter one
    return Demand(Fraction(own), Fraction(k, span), window_page_bytes(spec))


def default_window_pages(
    spec: KVSpec,
    model_pages: int,
    longest_tokens: int,
    mean_tokens: int,
    *,
    requests: bool = True,
) -> int:
    """The default rule's window pages of a tier of ``model_pages`` all-full model pages'
    bytes (:func:`window_demand`, :func:`solve_demands`)."""
    budget = model_pages * spec.model_page_bytes
    return _window_pages(spec, budget, longest_tokens, mean_tokens, requests)


def _window_pages(
    spec: KVSpec, budget: int, longest_tokens: int, mean_tokens: int, requests: bool
) -> int:
    """The default rule's window pages of a tier of ``budget`` bytes (before the split)."""
    pages = budget // spec.model_page_bytes  # (the all-full model's pages: what L1 admits)
    demand = window_demand(spec, pages, longest_tokens, mean_tokens, requests=requests)
    (n_w,) = solve_demands(budget, spec.page_bytes, [demand])
    return n_w


def tier_pools(
    spec: KVSpec, budget: int, longest_tokens: int, mean_tokens: int, *, requests: bool
) -> tuple[int, int]:
    """``(N_f, N_w)`` of a tier of ``budget`` bytes by the default rule
    (:func:`window_demand` of the all-full model pages those bytes hold, :func:`solve_demands`,
    :func:`split_bytes`), without the trace's cap (:func:`cap_full_pages`)."""
    n_w = _window_pages(spec, budget, longest_tokens, mean_tokens, requests)
    return split_bytes(budget, spec.page_bytes, window_page_bytes(spec), max(n_w, 1))


def _tail_pages(spec: KVSpec) -> int:
    """``k``: the most pages a continuation reads of any window group (``ceil(W / page)``)."""
    ws = [g.window for g in _local_groups(spec) if g.window is not None]
    return max(1, -(-max(ws) // spec.page_size)) if ws else 1


def pools_for(
    spec: KVSpec,
    model_device_pages: int,
    host_ratio: float,
    *,
    share: float | None,
    longest_tokens: int,
    mean_tokens: int,
    distinct_pages: int | None = None,
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD,
    write_through_threshold: int | None = None,
) -> Pools:
    """The pools of L1 = ``model_device_pages`` and L2 = ``round(host_ratio x L1)`` all-full
    model pages' bytes: ``share`` of each tier's bytes in window pages, or None: the default
    rule (:func:`split_tiers`, with ``distinct_pages``, the trace's distinct pages, and
    the ``write_policy`` the cache runs: see the module docstring)."""
    model_host = int(round(host_ratio * model_device_pages))
    mb, pw = spec.model_page_bytes, window_page_bytes(spec)
    budgets = (model_device_pages * mb, model_host * mb)
    if share is None:
        (df, dw), (hf, hw) = split_tiers(
            spec,
            *budgets,
            longest_tokens=longest_tokens,
            mean_tokens=mean_tokens,
            distinct_pages=distinct_pages,
            write_policy=write_policy,
            write_through_threshold=write_through_threshold,
        )
    else:  # a share given is what it says: no cap
        (df, dw), (hf, hw) = (
            split_bytes(b, spec.page_bytes, pw, max(int(share * b // pw), 1)) if b else (0, 0)
            for b in budgets
        )
    return Pools(
        model_device_pages=model_device_pages,
        model_host_pages=model_host,
        device_pages=df,
        host_pages=hf,
        window_device_pages=dw,
        window_host_pages=hw,
        device_share=dw * pw / budgets[0] if budgets[0] else 0.0,
        host_share=hw * pw / budgets[1] if budgets[1] else 0.0,
    )


def split_tiers(
    spec: KVSpec,
    device_budget: int,
    host_budget: int,
    *,
    longest_tokens: int,
    mean_tokens: int,
    distinct_pages: int | None = None,
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD,
    write_through_threshold: int | None = None,
) -> tuple[tuple[int, int], tuple[int, int]]:
    """``((N_f, N_w) of L1, (N_f, N_w) of L2)``: the default rule's split of L1's
    ``device_budget`` and L2's ``host_budget`` bytes (:func:`tier_pools` each; a tier of no
    bytes ``(0, 0)``). With ``distinct_pages`` (a trace's distinct pages, or the working set a
    stack is sized for), its caps (module docstring): each tier's full-attention pool capped
    by :func:`cap_full_pages`; where L2's alone would hold more and L2 keeps a copy of every
    page L1 evicts (:func:`l2_keeps_evicted` of ``write_policy`` and
    ``write_through_threshold``), L1 split as the all-full
    model's; where only both together would and the tiers act as one cache of their summed
    size (:func:`summed_tiers`), both capped by :func:`surplus_cap`."""
    pf, pw, mb = spec.page_bytes, window_page_bytes(spec), spec.model_page_bytes

    def tier(budget: int, requests: bool, cap: int | None, all_full: bool) -> Any:
        if all_full:  # (no spare window page ever reclaimed)
            return (budget // mb, budget // mb), False
        n_f, n_w = tier_pools(spec, budget, longest_tokens, mean_tokens, requests=requests)
        if cap is None:
            return (n_f, n_w), False
        return cap_full_pages(budget, pf, pw, n_f, n_w, cap), n_f > cap

    device, host = cap_tiers(
        spec,
        tier,
        device_budget,
        host_budget,
        longest_tokens=longest_tokens,
        distinct_pages=distinct_pages,
        write_policy=write_policy,
        write_through_threshold=write_through_threshold,
    )
    return device or (0, 0), host or (0, 0)


def cap_tiers(
    spec: KVSpec,
    tier: Callable[[int, bool, int | None, bool], tuple[Any, bool]],
    device_budget: int,
    host_budget: int,
    *,
    longest_tokens: int,
    distinct_pages: int | None,
    write_policy: WritePolicy | str,
    write_through_threshold: int | None = None,
) -> tuple[Any, Any]:
    """``(L1's sizes, L2's sizes)`` (None for a tier of no bytes) of a tier rule under the
    caps of ``distinct_pages`` (module docstring; None: no cap), for the window replay's rule
    and the mixed one alike. ``tier(budget, requests, cap, all_full) -> (sizes, over)``: a
    tier's sizes, ``sizes[0]`` its full-attention pages, at most ``cap`` of them (None: any),
    or the all-full model's split where ``all_full``; ``over``: the rule alone gave more than
    ``cap``. L2 first: where its pool alone would hold the trace and L2 keeps a copy of every
    page L1 evicts (:func:`l2_keeps_evicted`), L1 is split as the all-full model's; where
    neither alone but both together would and the tiers are one cache of their summed size
    (:func:`summed_tiers`), both capped by :func:`surplus_cap`."""
    keeps = l2_keeps_evicted(write_policy, write_through_threshold)
    summed = summed_tiers(write_policy)
    limit = None
    if distinct_pages is not None:
        limit = full_page_limit(distinct_pages, longest_tokens, spec.page_size)
    sizes: dict[bool, Any] = {}
    whole = False  # L2's full-attention pool would hold every page of the trace
    capped = False  # a tier's would
    for budget, requests in ((host_budget, False), (device_budget, True)):  # L2 first
        if budget == 0:
            sizes[requests] = None
            continue
        sizes[requests], over = tier(budget, requests, limit, requests and whole and keeps)
        whole = whole or (over and not requests)
        capped = capped or over
    device, host = sizes[True], sizes[False]
    if summed and limit is not None and not capped and device is not None and host is not None:
        # neither tier's alone holds the trace, both together at most (module docstring)
        own = min(-(-longest_tokens // spec.page_size), device_budget // spec.model_page_bytes)
        cap = surplus_cap(device[0], host[0], limit, own)
        if cap is not None:
            device = tier(device_budget, True, cap, False)[0]
            host = tier(host_budget, False, max(limit - device[0], 1), False)[0]
    return device, host


def l2_keeps_evicted(write_policy: Any, write_through_threshold: int | None = None) -> bool:
    """Whether L2 keeps a copy of every page L1 evicts under ``write_policy`` (a
    ``WritePolicy`` or its name) and ``write_through_threshold`` (None: the policy's default,
    as ``HiCacheConfig`` resolves it): ``clean_ahead`` and ``write_back`` copy what eviction
    takes, a write-through policy at threshold 1 every page at insert (``write_through``'s
    default); at a higher threshold (``write_through_selective``'s default 2) only pages hit
    that often, the rest leaving the cache with L1. Only where it does is L1 split as the
    all-full model's beside an L2 that holds the trace (:func:`split_tiers`).

    Raises:
        ValueError: not a write policy (naming ``write_policy``), or a threshold below 1.
        TypeError: a threshold not an int.
    """
    policy = parse_enum(WritePolicy, "write_policy", write_policy)
    if summed_tiers(policy):  # (they copy what L1 evicts)
        return True
    if write_through_threshold is None:
        return default_write_through_threshold(policy) == 1
    return check_int("write_through_threshold", write_through_threshold, 1) == 1


def summed_tiers(write_policy: Any) -> bool:
    """Whether L1 and L2 act as one cache of their summed size under ``write_policy`` (a
    ``WritePolicy`` or its name): those that back up what L1 evicts (``clean_ahead``,
    ``write_back``). Not ``write_through`` (L2 holds copies of L1's pages: L2 alone is what
    holds the trace) nor ``write_through_selective`` (a page it does not back up leaves the
    cache with L1). The two tiers' full-attention pools are capped together only where it is
    (:func:`split_tiers`).

    Raises:
        ValueError: not a write policy (naming ``write_policy``).
    """
    policy = parse_enum(WritePolicy, "write_policy", write_policy)
    return policy in (WritePolicy.CLEAN_AHEAD, WritePolicy.WRITE_BACK)


def surplus_cap(device_full: int, host_full: int, limit: int, own: int) -> int | None:
    """L1's cap on its full-attention pages where L1's ``device_full`` and L2's ``host_full``
    together hold more than ``limit`` (the trace's distinct pages and the longest prompt's:
    :func:`full_page_limit`), else None: the pages past it (the surplus) are given up by both
    tiers in proportion to their pools, L1 keeping at least ``own`` (the longest prompt's
    pages: a request's own pages live there). L2's cap is then ``limit`` less the pages L1
    keeps (more than its cap where one window page a full page bounds it). Their bytes go to
    the tiers' window pools (:func:`cap_full_pages`)."""
    surplus = device_full + host_full - limit
    if surplus <= 0:
        return None
    cap = max(device_full - round(surplus * device_full / (device_full + host_full)), own)
    return min(cap, device_full)


class Holding:
    """The bytes ratio and the window bytes share of what a cache holds, sampled after every
    request (:meth:`sample`) and averaged over the samples where it holds anything.

    Args:
        spec: the cache's spec (with window groups).
    """

    def __init__(self, spec: KVSpec) -> None:
        self.pf, self.pw = spec.page_bytes, window_page_bytes(spec) // len(_local_groups(spec))
        self.pm = spec.model_page_bytes
        self.n, self.sum_ratio, self.sum_share = 0, 0.0, 0.0
        self.last: tuple[float, float] = (1.0, 0.0)

    def sample(self, stats: dict[str, Any]) -> None:
        """One sample from ``HiCache.stats()`` between two requests (every page used is the
        tree's then): full-attention and window pages used on both tiers."""
        full_pages = stats["device_used_pages"] + stats["host_used_pages"]
        if full_pages <= 0:
            return
        # window_*_used_pages sum over the groups; every group's page has the same shape here
        win = (stats["window_device_used_pages"] + stats["window_host_used_pages"]) * self.pw
        used = full_pages * self.pf + win
        ratio, share = full_pages * self.pm / used, win / used
        self.n += 1
        self.sum_ratio += ratio
        self.sum_share += share
        self.last = (ratio, share)

    def figures(self) -> dict[str, float]:
        """``bytes_ratio`` (mean over the run), ``bytes_ratio_end`` (after the last request),
        ``window_bytes_share`` (mean) and ``window_bytes_share_end``."""
        n = max(self.n, 1)
        return {
            "bytes_ratio": self.sum_ratio / n if self.n else 1.0,
            "bytes_ratio_end": self.last[0],
            "window_bytes_share": self.sum_share / n if self.n else 0.0,
            "window_bytes_share_end": self.last[1],
        }
