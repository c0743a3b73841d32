"""Replay of a model with all three layer kinds (``R2:S1:F1``: recurrent, sliding-window and
full-attention layers; Samba-, Hymba- or Qwen3.5-like hybrids with a global layer): its pools
at the all-full model's bytes and what it holds per byte (ARCHITECTURE.md, "Layer groups" and
"Recurrent state").

This module owns what ``hicache-jax replay --layer-pattern R2:S1:F1 --window W`` (and
:func:`hicache_jax.study.sweep`'s ``layer_pattern``) adds beside the two-kind replays, and
reuses their parts rather than copying them:

- **The spec** is :func:`hicache_jax.replay.states.state_spec` of the pattern with ``window``:
  one period of layers, the full and sliding-window layers 8 bytes a token each, a checkpoint
  ``state_tokens`` tokens of the full-attention layers' KV bytes.
- **The pools at equal bytes** (:func:`pools_for`): a capacity is tokens' worth of the
  all-full model's bytes, the model whose attention layers (full and sliding-window) all keep
  every token (``spec.model_page_bytes`` a page; the recurrent layers have no per-token KV, so
  they add none: for ``R3:F1`` this is the state replay's budget, for ``5:1`` the window
  replay's). L1 of ``D`` pages is ``B = D * model_page_bytes``, split into ``N_f``
  full-attention pages, ``N_w`` pages of each window group and ``N_s`` state slots:
  ``N_f * page_bytes + N_w * window_page_bytes + N_s * slot_bytes <= B``; L2 the same with
  its ratio. The default rule asks what each two-kind rule asks, beside the same
  full-attention pool: the window rule's pages
  (:func:`hicache_jax.replay.windows.window_demand`: the longest prompt's pages on L1, ``k``
  pages of tail a mean prompt's pages) and the state rule's slots
  (:func:`hicache_jax.replay.states.state_demand`: one request's checkpoints on L1, two a mean
  prompt's pages), solved together (:func:`hicache_jax.replay.windows.solve_demands`); a
  share given for either kind fixes that kind's bytes instead. Then each rule's limits: at
  least 8 slots and at most one a full page (:func:`hicache_jax.replay.states.slot_floor`),
  at most one window page a full page, else the all-full split of the bytes the slots leave
  (:func:`hicache_jax.replay.windows.split_bytes`). Given the trace's distinct pages, the
  window rule takes them as the window replay's does
  (:func:`hicache_jax.replay.windows.pools_for`): no full-attention pool holds more (the bytes
  past that in window pages), where L2's alone would, L1 keeps one window page a full page, and
  where only both together would, both give up the pages past it to their window pools.
- **What it holds per byte** (:class:`MixedHolding`): sampled after every request, the bytes
  ratio ``r`` (the all-full model's bytes of the tokens cached over the bytes of the pages
  and slots used: checkpoints are bytes the all-full model would not spend), the window
  pages' share and the state slots' share of those bytes.

The references (:func:`hicache_jax.replay.driver.run`) are both kinds': the LRU of ``r x (L1 +
L2)`` all-full pages (the window replay's: as many tokens as the cache holds, placed by an
LRU), the every-page oracle (the state replay's: an exact LRU of the same bytes in all-full
pages, every page boundary a free checkpoint, every window kept) and the LRU of its
full-attention pages alone.

Threading: plain functions and values; a :class:`MixedHolding` belongs to its replay's thread.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Any

from hicache_jax.replay import states as _states
from hicache_jax.replay import windows as _windows
from hicache_jax.spec import HiCacheConfig, KVSpec, WritePolicy

__all__ = ["MixedHolding", "MixedPools", "pools_for", "split_tiers", "tier_pools"]


@dataclasses.dataclass(frozen=True)
class MixedPools:
    """One tier pair's pools at the all-full model's bytes, of both two-kind replays' fields
    (so both their tables read it: :func:`hicache_jax.replay.driver.window_table`,
    :func:`hicache_jax.replay.driver.state_table`).

    Attributes:
        model_device_pages, model_host_pages: the budget, in all-full model pages.
        device_pages, host_pages: full-attention pages of L1 and L2.
        window_device_pages, window_host_pages: pages of each window group's pool.
        state_device_slots, state_host_slots: state slots of L1 and L2.
        device_share, host_share: the fraction of each tier's budget in window pages.
        state_device_share, state_host_share: the fraction of each tier's budget in slots.
        slot_pages: one slot's bytes over one all-full model page's.
        checkpoint_every: the checkpoint interval in pages the split was made for (0: none;
            None: the cache's default).
    """

    model_device_pages: int
    model_host_pages: int
    device_pages: int
    host_pages: int
    window_device_pages: int
    window_host_pages: int
    state_device_slots: int
    state_host_slots: int
    device_share: float
    host_share: float
    state_device_share: float
    state_host_share: float
    slot_pages: float
    checkpoint_every: int | None = None

    @property
    def share(self) -> float:
        """The state slots' share of L1 + L2's bytes."""
        total = self.model_device_pages + self.model_host_pages
        slots = self.state_device_slots + self.state_host_slots
        return slots * self.slot_pages / total if total else 0.0

    def bytes_used(self, spec: KVSpec) -> tuple[int, int]:
        """Bytes of L1's and L2's pools (full + window + slots), each at most its budget."""
        pf, pw, s = spec.page_bytes, _windows.window_page_bytes(spec), _states.slot_bytes(spec)
        return (
            self.device_pages * pf + self.window_device_pages * pw + self.state_device_slots * s,
            self.host_pages * pf + self.window_host_pages * pw + self.state_host_slots * s,
        )

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"share": self.share}

    def configure(self, cfg: HiCacheConfig) -> HiCacheConfig:
        """``cfg`` (the budget's) with these pools and their checkpoint interval."""
        return dataclasses.replace(
            cfg,
            device_pages=self.device_pages,
            host_pages=self.host_pages,
            window_device_pages=self.window_device_pages,
            window_host_pages=self.window_host_pages or None,
            state_device_slots=self.state_device_slots,
            state_host_slots=self.state_host_slots or None,
            checkpoint_every_pages=self.checkpoint_every,
        )


def tier_pools(
    spec: KVSpec,
    budget: int,
    requests: bool,
    window_share: float | None,
    state_share: float | None,
    longest_tokens: int,
    mean_tokens: int,
    every: int | None,
    limit: int | None = None,
    all_full: bool = False,
) -> tuple[int, int, int, bool]:
    """``(N_f, N_w, N_s, over)`` of a tier of ``budget`` bytes (module docstring). With the
    default window rule: ``limit``, at most that many full-attention pages (the bytes past it
    in window pages; ``over``: the rule would have given more); ``all_full``, one window page
    a full page (L1 beside an L2 that holds the trace)."""
    pf, pw, s = spec.page_bytes, _windows.window_page_bytes(spec), _states.slot_bytes(spec)
    pages = budget // spec.model_page_bytes  # (the all-full model's pages: what L1 admits)
    if window_share is not None:
        win = _windows.Demand(Fraction(int(window_share * budget // pw)), Fraction(0), pw)
    elif all_full:
        win = _windows.Demand(Fraction(0), Fraction(1), pw)
    else:
        win = _windows.window_demand(spec, pages, longest_tokens, mean_tokens, requests=requests)
    slots = (
        _states.state_demand(spec, longest_tokens, mean_tokens, every, requests=requests)
        if state_share is None
        else _windows.Demand(Fraction(int(state_share * budget // s)), Fraction(0), s)
    )
    n_w, n_s = _windows.solve_demands(budget, pf, [win, slots])
    n_s = _states.slot_floor(n_s, budget, pf + pw, s)
    left = max(0, budget - n_s * s)
    n_f, n_w = _windows.split_bytes(left, pf, pw, n_w)
    over = window_share is None and limit is not None and n_f > limit
    if over:
        assert limit is not None
        n_f, n_w = _windows.cap_full_pages(left, pf, pw, n_f, n_w, limit)
    # a tier too small for 8 slots beside a page keeps one of each, as the state replay's
    n_f, n_w = max(1, n_f), max(1, n_w)
    return n_f, n_w, max(1, min(n_s, n_f)), over


def pools_for(
    spec: KVSpec,
    model_device_pages: int,
    host_ratio: float,
    *,
    window_share: float | None,
    state_share: float | None,
    longest_tokens: int,
    mean_tokens: int,
    checkpoint_every: int | str | None = None,
    distinct_pages: int | None = None,
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD,
    write_through_threshold: int | None = None,
) -> MixedPools:
    """The pools of L1 = ``model_device_pages`` and L2 = ``round(host_ratio x L1)`` all-full
    model pages' bytes (see the module docstring): ``window_share`` / ``state_share`` of each
    tier's bytes in window pages / state slots, or None: that kind's default rule.
    ``checkpoint_every``: as :func:`hicache_jax.replay.states.pools_for` (:data:`AUTO
    <hicache_jax.replay.states.AUTO>`: the interval that spreads the slots over the pages).
    ``distinct_pages``: the trace's distinct pages, which the window rule takes as
    :func:`hicache_jax.replay.windows.pools_for` does (no full-attention pool holds more, plus
    the longest prompt; L1 one window page a full page where L2 alone would; both capped by
    :func:`hicache_jax.replay.windows.surplus_cap` where only both together would, each as
    the ``write_policy`` the cache runs allows: :func:`hicache_jax.replay.windows.split_tiers`).

    Raises:
        ValueError: the shares together leave no byte for full-attention pages.
    """
    if window_share is not None and state_share is not None and window_share + state_share >= 1:
        raise ValueError(
            f"window_share {window_share:g} + state_share {state_share:g} must be below 1: "
            "the rest of the bytes are full-attention pages"
        )

    def make(every: int | str | None) -> MixedPools:
        assert every is None or isinstance(every, int)
        model_host = int(round(host_ratio * model_device_pages))
        pm, pw, s = (
            spec.model_page_bytes,
            _windows.window_page_bytes(spec),
            _states.slot_bytes(spec),
        )
        budgets = (model_device_pages * pm, model_host * pm)
        (df, dw, ds), (hf, hw, hs) = split_tiers(
            spec,
            *budgets,
            window_share=window_share,
            state_share=state_share,
            longest_tokens=longest_tokens,
            mean_tokens=mean_tokens,
            every=every,
            distinct_pages=distinct_pages,
            write_policy=write_policy,
            write_through_threshold=write_through_threshold,
        )

        def shares(budget: int, n_w: int, n_s: int) -> tuple[float, float]:
            return (n_w * pw / budget, n_s * s / budget) if budget else (0.0, 0.0)

        (dws, dss), (hws, hss) = shares(budgets[0], dw, ds), shares(budgets[1], hw, hs)
        return MixedPools(
            model_device_pages,
            model_host,
            df,
            hf,
            dw,
            hw,
            ds,
            hs,
            dws,
            hws,
            dss,
            hss,
            s / pm,
            every,
        )

    return _states.with_interval(make, checkpoint_every)


def split_tiers(
    spec: KVSpec,
    device_budget: int,
    host_budget: int,
    *,
    window_share: float | None,
    state_share: float | None,
    longest_tokens: int,
    mean_tokens: int,
    every: int | None,
    distinct_pages: int | None = None,
    write_policy: WritePolicy | str = WritePolicy.CLEAN_AHEAD,
    write_through_threshold: int | None = None,
) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """``((N_f, N_w, N_s) of L1, (N_f, N_w, N_s) of L2)`` of L1's ``device_budget`` and L2's
    ``host_budget`` bytes (:func:`tier_pools` each; a tier of no bytes ``(0, 0, 0)``). With
    ``distinct_pages`` and the default window rule, the window rule's caps as
    :func:`hicache_jax.replay.windows.split_tiers` applies them (the slots as without them)."""

    def tier(budget: int, requests: bool, cap: int | None, all_full: bool) -> Any:
        n_f, n_w, n_s, over = tier_pools(
            spec,
            budget,
            requests,
            window_share,
            state_share,
            longest_tokens,
            mean_tokens,
            every,
            cap,
            all_full=all_full,
        )
        return (n_f, n_w, n_s), over

    device, host = _windows.cap_tiers(
        spec,
        tier,
        device_budget,
        host_budget,
        longest_tokens=longest_tokens,
        # (a window share given is what it says: no cap)
        distinct_pages=distinct_pages if window_share is None else None,
        write_policy=write_policy,
        write_through_threshold=write_through_threshold,
    )
    return device or (0, 0, 0), host or (0, 0, 0)


class MixedHolding:
    """The bytes ratio, the window bytes share and the state bytes share of what a cache
    holds, sampled after every request (:meth:`sample`) and averaged over the samples where it
    holds anything (the figures of :class:`hicache_jax.replay.windows.Holding` and
    :class:`hicache_jax.replay.states.StateHolding` together)."""

    def __init__(self, spec: KVSpec) -> None:
        self.pf, self.pm = spec.page_bytes, spec.model_page_bytes
        self.pw = _windows.window_page_bytes(spec) // max(
            1, len(spec.window_groups) - len(spec.state_groups)
        )
        self.ps = _states.slot_bytes(spec)
        self.n = 0
        self.sums = dict.fromkeys(("ratio", "window", "state", "slots"), 0.0)
        self.last = {"ratio": 1.0, "window": 0.0, "state": 0.0}

    def sample(self, stats: dict[str, Any]) -> None:
        """One sample from ``HiCache.stats()`` between two requests: pages, window pages
        (summed over the window groups, each of the same shape here) and slots used on both
        tiers."""
        full = stats["device_used_pages"] + stats["host_used_pages"]
        if full <= 0:
            return
        win = (stats["window_device_used_pages"] + stats["window_host_used_pages"]) * self.pw
        slots = stats["state_device_used_slots"] + stats["state_host_used_slots"]
        used = full * self.pf + win + slots * self.ps
        now = {
            "ratio": full * self.pm / used,
            "window": win / used,
            "state": slots * self.ps / used,
        }
        for k, v in now.items():
            self.sums[k] += v
        self.sums["slots"] += slots
        self.n += 1
        self.last = now

    def figures(self) -> dict[str, float]:
        """``bytes_ratio``, ``window_bytes_share``, ``state_bytes_share`` (means over the
        run), each with its ``_end`` (after the last request), and ``state_slots_used``
        (mean, both tiers)."""
        n, s = max(self.n, 1), self.sums
        mean = {
            "bytes_ratio": s["ratio"] / n if self.n else 1.0,
            "window_bytes_share": s["window"] / n,
            "state_bytes_share": s["state"] / n,
        }
        ends = dict(
            zip(
                ("bytes_ratio_end", "window_bytes_share_end", "state_bytes_share_end"),
                self.last.values(),
            )
        )
        return mean | ends | {"state_slots_used": s["slots"] / n}
