"""What-if TTFT: a trace through the real cache on a simulated clock (ARCHITECTURE.md, "Load or
recompute"; ``hicache-jax replay TRACE --simulate``).

The cache runs unchanged (the same match, load-back, eviction and policies as
:func:`hicache_jax.replay.driver.replay`) with a discrete-event clock injected as its ``clock``
and as its transfer engine's: a load-back dispatched at ``t`` is acknowledged at
``t + modelled seconds``, so the cache's cost model fits the modelled link from its own
acknowledgements. One server prefills one request at a time; requests arrive at the trace's
timestamps and queue (first come, first served). A request's time to first token is its wait
plus its service: the load of its host part (L2 -> L1), then the load of what L3 holds after it
(L3 -> L2 -> L1), then the prefill of the rest. Decode is not modelled.

The model: a link moves ``b`` bytes in ``latency + b / bandwidth``; prefill of ``n`` tokens
takes ``n / prefill_tokens_per_s``; bytes are the modelled model's (``token_bytes`` a token),
whatever spec the replay's cache holds. Every modelled time is multiplied by a lognormal
jitter (``jitter``, drawn from ``seed``): the same seed gives the same figures.

L3 is modelled as a store that keeps every whole page of every served prompt (write-through,
infinite); the pages a request finds there, consecutive after its host part, are its L3 hit.
Policies: ``never`` (recompute every host and L3 hit), ``always`` (load all of them),
``threshold`` (load a hit of at least ``threshold`` tokens), ``cost`` (the cache's
``load_policy="cost"`` for L2, the same cost model's plan for L3), ``cost+split`` (``cost`` on
a server that overlaps a load with its prefill: ``load_overlap=True``, so the cache may give a
request a two-ended split of its host part, and the L3 plan may split the L3 hit; the service
is then the loads of the backs dispatched at once while the fronts are prefilled, see
``_overlapped``).

A spec with window groups (``--layer-pattern``) gets the pools of
:func:`hicache_jax.replay.windows.pools_for` (``pools``): the all-full model's bytes of L1 and
L2 split between the full-attention and the window pools. A load is still charged
``token_bytes`` a token (the all-full model's: an upper bound, the windows' trimmed pages are
not copied), and ``cost+split`` is left out (the cache does not overlap loads with window
groups yet).

Threading: a simulation builds, owns and closes its cache on the calling thread.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.loading.cost_model import CostModel
from hicache_jax.memory.transfer import TransferEngine
from hicache_jax.replay.block_lru import PageKeys
from hicache_jax.replay.mixed import MixedPools
from hicache_jax.replay.states import Checkpoints, StatePools
from hicache_jax.replay.trace import Trace
from hicache_jax.replay.windows import Pools
from hicache_jax.spec import HiCacheConfig, KVSpec
from hicache_jax.validation import is_real

__all__ = [
    "POLICIES",
    "Regime",
    "SWEEP",
    "SimClock",
    "bandwidth_sweep",
    "plot_sweep",
    "simulate",
    "simulate_all",
    "ttft_table",
]

POLICIES = ("never", "always", "threshold", "cost", "cost+split")
_NEVER = 1 << 62


@dataclasses.dataclass(frozen=True)
class Regime:
    """The modelled hardware: links in GB/s (1e9 bytes), prefill in tokens a second."""

    l2_gbps: float
    prefill_tokens_per_s: float
    token_bytes: int
    l3_gbps: float | None = None
    l2_latency_s: float = 20e-6
    l3_latency_s: float = 1e-3
    jitter: float = 0.05

    def __post_init__(self) -> None:
        for name in ("l2_gbps", "prefill_tokens_per_s", "token_bytes", "l3_gbps"):
            v = getattr(self, name)
            if v is None and name == "l3_gbps":
                continue
            if not is_real(v) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        for name in ("l2_latency_s", "l3_latency_s", "jitter"):
            v = getattr(self, name)
            if not is_real(v) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")

    def prefill_s(self, n_new: int, n_cached: int) -> float:
        return n_new / self.prefill_tokens_per_s

    def link_s(self, hop: str, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        gbps, lat = (
            (self.l2_gbps, self.l2_latency_s)
            if hop == "l2_l1"
            else (self.l3_gbps, self.l3_latency_s)
        )
        assert gbps is not None, "an L3 hop in a regime without l3_gbps"
        return lat + tokens * self.token_bytes / (gbps * 1e9)


class SimClock:
    """The simulated time: ``advance`` moves it; every reading adds a picosecond (so access
    stamps keep the order of the calls). :meth:`exact` reads it without the picosecond: the
    transfer engine's clock, so that a transfer's seconds are the modelled ones alone (how many
    times the cache reads the clock while a copy is in flight depends on when XLA marks the
    copy ready, a wall-clock matter: with the ticks in, a figure fitted from those seconds
    would differ between runs of one seed)."""

    def __init__(self) -> None:
        self.now, self._ticks = 0.0, 0

    def __call__(self) -> float:
        self._ticks += 1
        return self.now + self._ticks * 1e-12

    def exact(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _config(
    policy: str,
    regime: Regime,
    device_pages: int,
    host_pages: int,
    threshold: int,
    page_size: int,
    pools: Pools | StatePools | MixedPools | None = None,
) -> HiCacheConfig:
    if policy not in POLICIES:
        raise ValueError(f"policy={policy!r} must be one of {', '.join(POLICIES)}")
    cost = dict(
        load_back_threshold=threshold,
        load_policy="cost",
        prefill_cost=regime.prefill_s,
        cost_page_bytes=regime.token_bytes * page_size,
    )
    kws: dict[str, dict[str, Any]] = {
        "never": dict(load_back_threshold=_NEVER),
        "always": dict(load_back_threshold=0),
        "threshold": dict(load_back_threshold=threshold),
        "cost": cost,
        "cost+split": dict(cost, load_overlap=True),
    }
    if pools is None:
        return HiCacheConfig(device_pages=device_pages, host_pages=host_pages, **kws[policy])
    if policy == "cost+split":
        raise ValueError(
            "policy='cost+split' with window groups: the cache does not support "
            "load_overlap=True with window groups yet"
        )
    base = HiCacheConfig(device_pages=device_pages, host_pages=host_pages, **kws[policy])
    return pools.configure(base)


def _l3_tokens(
    policy: str, run: int, cached: int, ps: int, threshold: int, model: CostModel
) -> tuple[int, int]:
    """``(front, loaded)`` of an L3 hit of ``run`` pages: tokens the policy recomputes first
    (a two-ended split's front, ``cost+split`` only), then tokens it loads."""
    if run == 0 or policy == "never":
        return 0, 0
    if policy == "always":
        return 0, run * ps
    if policy in ("cost", "cost+split"):
        n = model.plan(
            [ps] * run,
            cached,
            1 << 62,
            None,
            links=("l3_l2", "l2_l1"),
            overlap=policy == "cost+split",
        )
        if n is not None:
            return model.last_split or 0, n
    return 0, (run * ps if run * ps >= threshold else 0)


def _overlapped(
    regime: Regime,
    jit: Any,
    model: CostModel,
    cached: int,
    l2: tuple[float, int],
    l3: tuple[int, int],
    rest: int,
) -> float:
    """Seconds of a ``cost+split`` request's service after its L2 back's copy (``l2``:
    ``(t2, front)``: the copy was dispatched at its start and has landed at ``t2`` seconds;
    the front's tokens) and with ``l3`` ``(front, back)`` of its L3 hit: the L3 read starts at
    once, its L2 -> L1 hop after it and the L2 copy; the prefill runs the L2 front, the L3
    front once the L2 back is in, the rest once the L3 back is in."""
    (t2, front2), (front3, back3) = l2, l3
    r3 = h3 = 0.0
    if back3:
        r3, h3 = (regime.link_s(hop, back3) * jit() for hop in ("l3_l2", "l2_l1"))
        model.observe_transfer("l3_l2", back3 * regime.token_bytes, r3)
        model.observe_transfer("l2_l1", back3 * regime.token_bytes, h3)
    c = regime.prefill_s(front2, cached) * jit() if front2 else 0.0
    c = max(c, t2)
    if front3:
        c += regime.prefill_s(front3, cached + front2) * jit()
    t3 = max(t2, r3) + h3 if back3 else 0.0
    return max(c, t3) + regime.prefill_s(rest, cached) * jit()


def simulate(
    trace: Trace,
    spec: KVSpec,
    regime: Regime,
    policy: str,
    *,
    device_pages: int,
    host_ratio: float = 4.0,
    threshold: int = 16,
    seed: int = 0,
    pools: Pools | StatePools | MixedPools | None = None,
) -> dict[str, Any]:
    """One policy's TTFT on ``trace`` under ``regime`` (see module doc). Deterministic for
    ``seed``. ``pools``: with a spec of window groups, the pools at the all-full model's bytes
    of ``device_pages`` and ``host_ratio`` (:func:`hicache_jax.replay.windows.pools_for`);
    with a state group (a hybrid recurrent model), its pages and state slots
    (:func:`hicache_jax.replay.states.pools_for`; each request writes its checkpoints as the
    replay does); with both (``R2:S1:F1``), its pages, window pages and slots
    (:func:`hicache_jax.replay.mixed.pools_for`); None: the plain pools."""
    cfg = _config(
        policy,
        regime,
        device_pages,
        int(round(host_ratio * device_pages)),
        threshold,
        spec.page_size,
        pools,
    )
    clock, rng = SimClock(), np.random.default_rng(seed)
    cache = HiCache(
        spec, cfg, clock=clock, transfer_engine=lambda d, h: TransferEngine(d, h, clock=clock.exact)
    )
    ps, cap = spec.page_size, cfg.device_pages
    if cfg.window_device_pages is not None:  # a request's own pages hold a window page each
        cap = min(cap, cfg.window_device_pages)
    checkpoints = Checkpoints(cache) if spec.state_groups else None
    l3_model = CostModel(regime.token_bytes * ps, ps, regime.prefill_s)
    keys_of, store = PageKeys(ps), set()
    t_first = trace.requests[0].timestamp_ms if trace.requests else 0.0
    free_at, ttft, tok = 0.0, [], dict(prompt=0, device=0, l2=0, l3=0, recomputed=0)

    def jit() -> float:
        return float(rng.lognormal(0.0, regime.jitter)) if regime.jitter else 1.0

    try:
        for req in trace.requests:
            full = req.tokens()
            whole = min(full.shape[0] // ps, cap)
            tokens = full[: whole * ps]
            arrival = max(0.0, (req.timestamp_ms - t_first) / 1000.0)
            clock.now = max(clock.now, arrival, free_at)
            with cache.begin(tokens) as r:
                dev, l2 = r.cached_len - r.loaded_len, r.loaded_len
                start = clock.now
                front2, back2 = (
                    (r.overlap[0] - r.cached_len, r.overlap[1] - r.overlap[0])
                    if r.overlap
                    else (0, 0)
                )
                clock.advance(regime.link_s("l2_l1", l2 + back2) * jit())
                r.wait_overlap()  # a split's copy lands at the modelled time: its sample
                cache.flush()  # the load lands at the modelled time: the cache's sample
                served = r.num_tokens  # the tokens before the L3 hit: a split's back's end
                keys, run = keys_of(tokens), 0
                if regime.l3_gbps is not None and (r.overlap or not r.host_len_declined):
                    while served // ps + run < len(keys) and keys[served // ps + run] in store:
                        run += 1
                front3, l3 = _l3_tokens(policy, run, served, ps, threshold, l3_model)
                n_new = full.shape[0] - served - l3
                if policy == "cost+split":
                    clock.now = start + _overlapped(
                        regime,
                        jit,
                        l3_model,
                        r.cached_len,
                        (clock.now - start, front2),
                        (front3, l3),
                        n_new - front3,
                    )
                    n_new += front2
                else:
                    if l3:
                        for hop in ("l3_l2", "l2_l1"):
                            s = regime.link_s(hop, l3) * jit()
                            l3_model.observe_transfer(hop, l3 * regime.token_bytes, s)
                            clock.advance(s)
                    clock.advance(regime.prefill_s(n_new, r.cached_len + l3) * jit())
                l2 += back2
                r.extend(tokens.shape[0] - r.num_tokens)
                if checkpoints is not None:  # a hybrid's checkpoints (replay.states)
                    checkpoints.write(r, tokens)
                cache.flush()
                r.finish(tokens)
            cache.flush()
            store.update(keys)
            free_at = clock.now
            ttft.append(clock.now - arrival)
            tok["prompt"] += full.shape[0]
            tok["device"] += dev
            tok["l2"] += l2
            tok["l3"] += l3
            tok["recomputed"] += n_new
        stats = cache.stats()
    finally:
        cache.close()
    t = np.asarray(ttft)
    p = max(tok["prompt"], 1)
    return {
        "policy": policy,
        "requests": len(ttft),
        "ttft_mean_s": float(t.mean()) if t.size else 0.0,
        **{f"ttft_p{q}_s": float(np.percentile(t, q)) if t.size else 0.0 for q in (50, 90, 99)},
        "device_hit_ratio": tok["device"] / p,
        "l2_hit_ratio": tok["l2"] / p,
        "l3_hit_ratio": tok["l3"] / p,
        "recomputed_ratio": tok["recomputed"] / p,
        "makespan_s": clock.now,
        "cost_decisions": stats.get("cost_decisions", 0) + l3_model.n["cost_decisions"],
        "cost_fallbacks": stats.get("cost_fallbacks", 0) + l3_model.n["cost_fallbacks"],
        "cost_l2_l1_pred_err_median": stats.get("cost_l2_l1_pred_err_median"),
    }


def simulate_all(
    trace: Trace,
    spec: KVSpec,
    regime: Regime,
    *,
    device_pages: int,
    host_ratio: float = 4.0,
    threshold: int = 16,
    seed: int = 0,
    policies: Sequence[str] | None = None,
    pools: Pools | StatePools | MixedPools | None = None,
) -> dict[str, Any]:
    """:func:`simulate` of every policy (None: :data:`POLICIES`, less ``cost+split`` with
    ``pools``: the cache does not overlap loads with window groups yet);
    ``{"regime", "results"}``."""
    if policies is None:
        policies = [p for p in POLICIES if pools is None or p != "cost+split"]
    return {
        "regime": dataclasses.asdict(regime),
        "device_pages": device_pages,
        "host_ratio": host_ratio,
        "threshold": threshold,
        "seed": seed,
        "results": [
            simulate(
                trace,
                spec,
                regime,
                p,
                device_pages=device_pages,
                host_ratio=host_ratio,
                threshold=threshold,
                seed=seed,
                pools=pools,
            )
            for p in policies
        ],
    } | ({} if pools is None else {"pools": pools.as_json()})


def ttft_table(report: dict[str, Any]) -> str:
    """The policies' TTFT (ms) and hit ratios, one row each."""
    head = (
        "policy",
        "mean ms",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "L1 hit",
        "L2 load",
        "L3 load",
        "recomputed",
    )
    rows = [
        (
            r["policy"],
            *(
                f"{1e3 * r[k]:.1f}"
                for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s")
            ),
            *(
                f"{r[k]:.3f}"
                for k in ("device_hit_ratio", "l2_hit_ratio", "l3_hit_ratio", "recomputed_ratio")
            ),
        )
        for r in report["results"]
    ]
    width = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    return "\n".join(
        "  ".join(str(x).rjust(w) for x, w in zip(row, width)) for row in (head, *rows)
    )


#: ``--plot``: the L3 bandwidths swept, as multiples of the regime's (L2's without an L3).
SWEEP = (0.1, 0.3, 1.0, 3.0, 10.0)


def bandwidth_sweep(trace: Trace, spec: KVSpec, regime: Regime, **kw: Any) -> list[dict]:
    """:func:`simulate_all` at each :data:`SWEEP` multiple of the L3 link (of L2's without
    L3); ``[{"gbps", "results"}]``."""
    out = []
    for m in SWEEP:
        r = (
            dataclasses.replace(regime, l3_gbps=regime.l3_gbps * m)
            if regime.l3_gbps
            else dataclasses.replace(regime, l2_gbps=regime.l2_gbps * m)
        )
        out.append(
            {
                "gbps": r.l3_gbps or r.l2_gbps,
                "results": simulate_all(trace, spec, r, **kw)["results"],
            }
        )
    return out


def plot_sweep(sweep: list[dict], path: str, link: str) -> None:
    """Mean and p90 TTFT against the link's bandwidth, one line per policy (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, name in zip(axes, ("ttft_mean_s", "ttft_p90_s"), ("mean", "p90")):
        for pol in [r["policy"] for r in sweep[0]["results"]]:
            pts = [
                (s["gbps"], next(r[key] for r in s["results"] if r["policy"] == pol)) for s in sweep
            ]
            ax.plot(*zip(*pts), marker="o", label=pol)
        ax.set(
            xscale="log", yscale="log", xlabel=f"{link} bandwidth (GB/s)", ylabel=f"TTFT {name} (s)"
        )
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
