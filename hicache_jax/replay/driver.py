"""Trace replay: production request traces through the real HiCache, beside exact LRU references.

This module owns the replay itself (:func:`replay`, :func:`run`) and its output (tables, plot,
environment); traces (Mooncake JSONL, token JSONL) are read by :mod:`hicache_jax.replay.trace`,
the LRU references are :mod:`hicache_jax.replay.block_lru`, and ``hicache-jax replay`` (flags,
printing) is :mod:`hicache_jax.cli.replay`.

Requests are served in file order, one at a time (timestamps are not used: no concurrency),
each through the public request handle (``cache.begin``: match, load back, lock;
``extend`` for the pages it computes; ``finish``: insert, unlock).
``write_kv`` of the computed pages is skipped for speed: the pool holds whatever bytes it
holds, but every backup and load-back still moves real bytes between the tiers
(``bytes_to_host`` / ``bytes_to_device`` are real copies). A prompt longer than the device
pool caches only its first ``device_pages`` pages (what a server could hold at once).
The default :data:`TINY_SPEC` (one layer, one head, head_dim 1, float32: 8 bytes a token)
keeps a 60M-token trace in memory; ``spec`` replays with a real model's page bytes.

Determinism: a replay gives identical figures on every run and under any machine load. The
serving path completes transfers asynchronously (whether a backup has landed by the next
eviction depends on timing), so the replay calls ``cache.flush()`` after every request:
transfers complete at request boundaries. It also flushes before ``finish`` (insert, then unlock):
clean_ahead's pass runs at the unlock and would see which nodes a load still in flight holds
locked. The cache gets a virtual clock (a counter that advances at every reading), so eviction
order depends on the order of calls, never on wall time. Only ``wall_s`` and
``requests_per_s`` (:data:`TIMING_FIELDS`) vary between runs.

References: :class:`~hicache_jax.replay.block_lru.BlockLRU` of L1's, L1 + L2's and infinite
capacity.

A spec with window groups (a sliding-window model, :mod:`hicache_jax.replay.windows`, which owns
its pools and the bytes ratio): L1 and L2 sizes are the all-full model's pages, whose bytes
are split between the full-attention and the window pools; a prompt caches at most what L1's
window pool holds; the replay samples the bytes ratio ``r`` after every request, and
:func:`run` adds the LRU of ``r x`` (L1 + L2) pages, one more reference pass after the
replays (``r`` is measured), and :func:`window_table`.

A spec with a state group (a hybrid recurrent model, :mod:`hicache_jax.replay.states`, which
owns its pools, its checkpoint writer and the state bytes held): L1 and L2 sizes are the
hybrid's full-attention pages' bytes, split between pages and state slots; each request writes
its checkpoints (``cache.checkpoint_positions``) before ``finish``; :func:`run` adds the
every-page oracle (the LRU of L1 + L2 pages of the same bytes) and the LRU of the hybrid's
pages alone, and :func:`state_table`.

A spec with both (recurrent, sliding-window and full layers, ``R2:S1:F1``:
:mod:`hicache_jax.replay.mixed`, which owns its pools and what it holds per byte): L1 and L2
sizes are the all-full model's pages, whose bytes are split between full-attention pages,
window pages and state slots; the replay does both kinds' parts (a prompt caches at most what
L1's window pool holds, each request writes its checkpoints) and :func:`run` adds both kinds'
references, so both :func:`window_table` and :func:`state_table` print its rows.
Hits of HiCache and of the references count whole pages only.

Threading: a replay builds, owns and closes its caches on the calling thread.
"""

from __future__ import annotations

import datetime
import itertools
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from hicache_jax.cache.hicache import HiCache
from hicache_jax.replay import mixed as _mixed
from hicache_jax.replay import states as _states
from hicache_jax.replay import windows as _windows
from hicache_jax.replay.block_lru import BlockLRU, PageKeys, distinct_pages, reference_hits
from hicache_jax.replay.trace import Trace
from hicache_jax.spec import HiCacheConfig, KVSpec, resolve_eviction

__all__ = [
    "TINY_SPEC",
    "TIMING_FIELDS",
    "environment",
    "format_table",
    "plot",
    "replay",
    "run",
    "state_table",
    "sweep_table",
    "tables",
    "window_table",
]

#: The replay's default page shape (its page size is the replay's): 8 bytes a token, so a
#: 60M-token trace fits in memory. ``KVSpec.parse(text, TINY_SPEC, page_size=...)`` takes
#: ``--spec`` over it.
TINY_SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
TIMING_FIELDS = ("wall_s", "requests_per_s")
Progress = bool | Callable[[int, str], Any]  # see replay()


# ------------------------------------------------------------------------------------ replay


def _counter_clock() -> Any:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def replay(
    trace: Trace,
    spec: KVSpec,
    cfg: HiCacheConfig,
    *,
    progress: Progress = False,
    desc: str = "replay",
    diagnose: bool = False,
    on_cache: Callable[[HiCache], Any] | None = None,
) -> dict[str, Any]:
    """Serve every request of ``trace`` through a fresh HiCache (see module doc).

    ``progress``: True for a text bar (on a terminal's stderr only), or a factory
    ``(total, desc) -> bar`` (``update(n)``, ``close()``; e.g. tqdm.auto's in a notebook).
    ``diagnose``: also serve an LRU of L1 + L2 pages beside the cache (outside the timed part)
    and add the figures of :func:`_diagnosis` (``diag_*``).
    ``on_cache``: called with the cache once built, before the first request (e.g. to report
    it to Prometheus: :class:`hicache_jax.metrics.CacheCollector`); the replay closes the cache
    at its end, and its ``stats()`` stay readable.

    Returns:
        Prompt tokens, hit tokens by tier, the cache's transfer and eviction counters, wall
        time; hit tokens count whole pages.
    """
    cache = HiCache(spec, cfg, clock=_counter_clock())
    if on_cache is not None:
        try:
            on_cache(cache)
        except BaseException:
            cache.close()
            raise
    ps, cap = spec.page_size, cfg.device_pages
    stateful, windowed = _kinds(spec)
    if windowed:  # a request's own pages hold a window page each
        cap = min(cap, cfg.window_device_pages or cap)
    prompt = device_hit = host_hit = declined = 0  # tokens
    diag = _Diagnosis(cache, cfg) if diagnose else None
    holding: _windows.Holding | _states.StateHolding | _mixed.MixedHolding | None = None
    if stateful and windowed:
        holding = _mixed.MixedHolding(spec)
    elif stateful:
        holding = _states.StateHolding(spec)
    elif windowed:
        holding = _windows.Holding(spec)
    checkpoints = _states.Checkpoints(cache) if stateful else None
    bar = _progress_bar(len(trace.requests), desc, progress)
    untimed = 0.0
    t0 = time.perf_counter()
    try:
        for req in trace.requests:
            tokens = req.tokens()
            prompt += tokens.shape[0]
            whole = min(tokens.shape[0] // ps, cap)  # a prompt beyond L1 caches what L1 holds
            tokens = tokens[: whole * ps]
            with cache.begin(tokens) as r:
                device_hit += r.cached_len - r.loaded_len
                host_hit += r.loaded_len
                declined += r.host_len_declined
                hit = r.cached_len
                r.extend(tokens.shape[0] - r.cached_len)
                if checkpoints is not None:  # the prefill's checkpoints, then finish's
                    checkpoints.write(r, tokens)
                cache.flush()  # the load-back's lock is gone before the unlock (clean_ahead's pass)
                r.finish(tokens)
            cache.flush()  # transfers complete at request boundaries: deterministic
            if holding is not None:  # (a measurement: outside the timed part, like diag)
                t1 = time.perf_counter()
                holding.sample(cache.stats())
                untimed += time.perf_counter() - t1
            if diag is not None:
                diag.sample(req.tokens(), hit // ps)
            if bar is not None:
                bar.update(1)
        wall = time.perf_counter() - t0 - untimed - (diag.seconds if diag is not None else 0.0)
        stats = cache.stats()
    finally:
        if bar is not None:
            bar.close()
        cache.close()
    return (
        {
            "write_policy": _label(cfg.write_policy),
            "eviction": _label(cache.cfg.eviction),
            "device_pages": cap,
            "host_pages": cfg.host_pages,
            "page_size": ps,
            "load_back_threshold": cfg.load_back_threshold,
            "requests": len(trace.requests),
            "prompt_tokens": prompt,
            "device_hit_tokens": device_hit,
            "host_hit_tokens": host_hit,
            "host_declined_tokens": declined,
            "hit_tokens": device_hit + host_hit,
            "hit_ratio": (device_hit + host_hit) / prompt if prompt else 0.0,
        }
        | _counters(stats, ps)
        | ({} if holding is None else holding.figures() | _window_counters(stats))
        | ({} if checkpoints is None else checkpoints.figures())
        | ({} if diag is None else diag.figures())
        | {
            "wall_s": wall,
            "requests_per_s": len(trace.requests) / wall if wall > 0 else 0.0,
        }
    )


def _kinds(spec: KVSpec) -> tuple[bool, bool]:
    """``(stateful, windowed)``: whether ``spec`` has a STATE group, and a sliding-window or
    chunked one."""
    return bool(spec.state_groups), len(spec.window_groups) > len(spec.state_groups)


def _l1_l2_pages(cfg: HiCacheConfig) -> int:
    """Pages of L1 and L2 together (the capacity of the LRU reference beside a cache)."""
    assert cfg.host_pages is not None  # HiCacheConfig.__post_init__ resolves it
    return cfg.device_pages + cfg.host_pages


class _Diagnosis:
    """Where a cache loses against an LRU of L1 + L2 pages, sampled after every request (the
    cache at rest): the pages that LRU hits and the cache does not (and the reverse), and the
    mean pages of L1 and L2 left free and of L2 holding copies of pages still in L1 (what
    clean copies cost L2's room). Its own time is kept out of the replay's wall time."""

    def __init__(self, cache: HiCache, cfg: HiCacheConfig) -> None:
        self.cache, self.cfg, self.seconds = cache, cfg, 0.0
        self.lru = BlockLRU(_l1_l2_pages(cfg))
        self.keys = PageKeys(cache.spec.page_size)
        self.sums = dict.fromkeys(("lost", "gained", "l1_free", "l2_free", "l2_redundant"), 0)
        self.n = 0

    def sample(self, tokens: Any, hit_pages: int) -> None:
        t0 = time.perf_counter()
        ref = self.lru.serve(self.keys(tokens))
        tree, ps, s = self.cache.tree, self.cache.spec.page_size, self.sums
        s["lost"] += max(0, ref - hit_pages)
        s["gained"] += max(0, hit_pages - ref)
        s["l1_free"] += self.cfg.device_pages - tree.device_tokens // ps
        s["l2_free"] += _l1_l2_pages(self.cfg) - self.cfg.device_pages - tree.host_tokens // ps
        s["l2_redundant"] += tree.redundant_tokens // ps
        self.n += 1
        self.seconds += time.perf_counter() - t0

    def figures(self) -> dict[str, float]:
        n, s = max(self.n, 1), self.sums
        return {
            "diag_lost_vs_lru_pages": s["lost"],
            "diag_gained_vs_lru_pages": s["gained"],
            "diag_mean_l1_free_pages": s["l1_free"] / n,
            "diag_mean_l2_free_pages": s["l2_free"] / n,
            "diag_mean_l2_redundant_pages": s["l2_redundant"] / n,
        }


def _label(policy: Any) -> str:
    """A policy as its string (an enum's value), whatever type the config resolved it to."""
    return str(getattr(policy, "value", policy))


def _counters(s: dict[str, Any], ps: int) -> dict[str, int]:
    """The cache's transfer and eviction counters, pages where the cache counts tokens."""
    return {
        "bytes_to_host": s["bytes_to_host"],
        "bytes_to_device": s["bytes_to_device"],
        "backups": s["backups"],
        "load_backs": s["load_backs"],
        "load_backs_declined": s["load_backs_declined"],
        "evicted_pages": s["evicted_tokens"] // ps,
        "eviction_backup_pages": s["eviction_backup_pages"],
        "host_evicted_pages": s["host_evicted_tokens"] // ps,
        "clean_ahead_pages": s["clean_ahead_pages"],
        "admission_clean_pages": s["admission_clean_pages"],
        "host_copies_dropped_pages": s["host_copies_dropped_tokens"] // ps,
    }


def _window_counters(s: dict[str, Any]) -> dict[str, int]:
    """The window groups' counters of the cache (ARCHITECTURE.md, "Layer groups")."""
    keys = ("window_pages_dropped", "window_pages_trimmed", "window_unservable_tokens")
    return {k: s.get(k, 0) for k in keys}


def _progress_bar(total: int, desc: str, enabled: Progress) -> Any:
    if callable(enabled):
        return enabled(total, desc)
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def run(
    trace: Trace,
    spec: KVSpec,
    *,
    device_pages: Sequence[int],
    host_ratio: float = 4.0,
    write_policies: Sequence[str] = ("clean_ahead",),
    evictions: Sequence[str] = ("default",),
    load_back_threshold: int = 16,
    progress: Progress = False,
    diagnose: bool = False,
    window_share: float | None = None,
    state_share: float | None = None,
    checkpoint_every: int | str | None = None,
) -> dict[str, Any]:
    """Replay every (L1 size, write policy, eviction) and compare each with the references
    (``diagnose``: with :func:`replay`'s diagnosis figures).

    Args:
        trace: the requests.
        spec: page shape (``spec.page_size`` is the replay's page size). With window groups
            (:func:`hicache_jax.replay.windows.pattern_spec`), each size is the all-full
            model's bytes, split between the full-attention and the window pools
            (:func:`hicache_jax.replay.windows.pools_for`).
        device_pages: L1 sizes in pages (of the all-full model); L2 = ``round(host_ratio *
            L1)`` pages.
        write_policies, evictions: any strings :class:`HiCacheConfig` accepts.
        window_share: with window groups, the fraction of each tier's bytes in window pages;
            None: the default rule of :mod:`hicache_jax.replay.windows` (given the trace's
            distinct pages: no full-attention pool holds more than the trace has).
        state_share: with a state group (a hybrid recurrent model,
            :func:`hicache_jax.replay.states.state_spec`), the fraction of each tier's bytes in
            state slots; None: the default rule of :mod:`hicache_jax.replay.states`. Each size
            is then the hybrid's full-attention bytes, split between pages and slots
            (:func:`hicache_jax.replay.states.pools_for`). With both a state group and window
            groups (``R2:S1:F1``), each size is the all-full model's bytes, split between
            pages, window pages and slots (:func:`hicache_jax.replay.mixed.pools_for`, both
            shares taken; their sum below 1).
        checkpoint_every: with a state group, ``HiCacheConfig.checkpoint_every_pages`` (None:
            the cache's default, none), or
            ``"auto"``: ``ceil(pages / slots)`` of each size's pools
            (:func:`hicache_jax.replay.states.pools_for`).

    Returns:
        ``{"trace", "spec", "references", "results"}``: each result has the replay's figures
        beside ``infinite_hit_ratio``, ``lru_total_hit_ratio`` (an LRU of L1 + L2 pages),
        ``lru_l1_hit_ratio`` and their ratios ``vs_*``. With window groups also the pools
        (``pools``), the bytes ratio ``r`` (``bytes_ratio``: mean over the run), the window
        bytes share, and ``lru_bytes_ratio_hit_ratio``: an LRU of ``r x (L1 + L2)`` pages,
        with ``vs_lru_bytes_ratio``. With a state group: the pools (``pools``), the state
        bytes' share held (``state_bytes_share``, mean), ``oracle_hit_ratio`` (the exact LRU of
        L1 + L2 pages of the same bytes: every page boundary a free checkpoint) and
        ``vs_oracle``, and ``lru_pages_hit_ratio``: the exact LRU of its pages alone (L1 + L2
        less the slots' bytes: the bytes the states cost, apart from where checkpoints are),
        with ``vs_lru_pages``. Raises ``ValueError`` on a bad configuration before replaying
        anything.
    """
    stateful, windowed = _kinds(spec)
    share = _windows.check_share(window_share, "window_share")
    if share is not None and not windowed:
        raise ValueError("window_share is for a spec with window groups (a layer pattern)")
    sshare = _states.check_state_share(state_share, "state_share")
    checkpoint_every = _states.check_interval(checkpoint_every, "checkpoint_every")
    if (sshare is not None or checkpoint_every is not None) and not stateful:
        raise ValueError(
            "state_share / checkpoint_every are for a spec with a state group (e.g. R3:F1)"
        )
    if share is not None and sshare is not None and share + sshare >= 1:
        raise ValueError(
            f"window_share {share:g} + state_share {sshare:g} must be below 1: the rest of "
            "the bytes are full-attention pages"
        )
    ps = spec.page_size
    longest, mean = _windows.prompt_tokens(trace)
    # (what the window rule takes of the trace beside its prompts: windows.pools_for)
    distinct = distinct_pages(trace, ps) if windowed and share is None else None
    plan: list[tuple[HiCacheConfig, HiCacheConfig, Any]] = []
    # (the budget's config, the config the cache gets, its pools or None)
    for d in device_pages:
        for w in write_policies:
            for e in evictions:
                budget = HiCacheConfig(
                    device_pages=d,
                    host_pages=int(round(host_ratio * d)),
                    write_policy=w,
                    eviction=e,
                    load_back_threshold=load_back_threshold,
                )
                sizes = dict(longest_tokens=longest, mean_tokens=mean)
                pools: _windows.Pools | _states.StatePools | _mixed.MixedPools
                if stateful and windowed:
                    pools = _mixed.pools_for(
                        spec,
                        d,
                        host_ratio,
                        window_share=share,
                        state_share=sshare,
                        checkpoint_every=checkpoint_every,
                        distinct_pages=distinct,
                        write_policy=budget.write_policy,
                        write_through_threshold=budget.write_through_threshold,
                        **sizes,
                    )
                elif stateful:
                    pools = _states.pools_for(
                        spec,
                        d,
                        host_ratio,
                        share=sshare,
                        checkpoint_every=checkpoint_every,
                        **sizes,
                    )
                elif windowed:
                    pools = _windows.pools_for(
                        spec,
                        d,
                        host_ratio,
                        share=share,
                        distinct_pages=distinct,
                        write_policy=budget.write_policy,
                        write_through_threshold=budget.write_through_threshold,
                        **sizes,
                    )
                else:
                    plan.append((budget, budget, None))
                    continue
                plan.append((budget, pools.configure(budget), pools))
    caps = {None} | {b.device_pages for b, _, _ in plan} | {_l1_l2_pages(b) for b, _, _ in plan}
    # a hybrid's pages alone (its slots' bytes given up): what the checkpoints' placement is
    # judged against, apart from the bytes they cost
    caps |= {_l1_l2_pages(c) for _, c, p in plan if stateful}
    hits, distinct = reference_hits(trace, ps, caps)
    prompt = trace.num_tokens
    ratio = {c: h / prompt if prompt else 0.0 for c, h in hits.items()}
    results = []
    for i, (budget, cfg, pools) in enumerate(plan):
        desc = (
            f"[{i + 1}/{len(plan)}] {_label(cfg.write_policy)}/"
            f"{_label(resolve_eviction(cfg.eviction, spec))} "
            f"L1 {budget.device_pages}"
        )
        r = replay(trace, spec, cfg, progress=progress, desc=desc, diagnose=diagnose)
        refs = {
            "infinite": ratio[None],
            "lru_total": ratio[_l1_l2_pages(budget)],
            "lru_l1": ratio[budget.device_pages],
        }
        for name, ref in refs.items():
            r[f"{name}_hit_ratio"] = ref
            r[f"vs_{name}"] = r["hit_ratio"] / ref if ref else None  # no hit possible
        if pools is not None:
            r |= {
                "device_pages": budget.device_pages,  # the budget (see windows / states)
                "host_pages": budget.host_pages,
                "pools": pools.as_json(),
                "budget_bytes": _l1_l2_pages(budget) * spec.model_page_bytes,
            }
        if isinstance(pools, (_states.StatePools, _mixed.MixedPools)):
            r |= {
                "checkpoint_every": _states.default_interval(spec)
                if pools.checkpoint_every is None
                else pools.checkpoint_every,
                "checkpoint_rule": "default" if checkpoint_every is None else checkpoint_every,
                "oracle_hit_ratio": refs["lru_total"],
                "vs_oracle": r["vs_lru_total"],
                "lru_pages_hit_ratio": ratio[_l1_l2_pages(cfg)],
                "vs_lru_pages": r["hit_ratio"] / ratio[_l1_l2_pages(cfg)]
                if ratio[_l1_l2_pages(cfg)]
                else None,
            }
        if isinstance(pools, (_windows.Pools, _mixed.MixedPools)):
            l1_bytes, l2_bytes = pools.bytes_used(spec)
            r |= {
                "l1_bytes": l1_bytes,
                "l2_bytes": l2_bytes,
                "lru_bytes_ratio_pages": int(r["bytes_ratio"] * _l1_l2_pages(budget)),
            }
        results.append(r)
    if windowed:  # the LRU of r x (L1 + L2): r is measured, so one more pass after the replays
        more, _ = reference_hits(trace, ps, {r["lru_bytes_ratio_pages"] for r in results})
        for r in results:
            ref = more[r["lru_bytes_ratio_pages"]] / prompt if prompt else 0.0
            r["lru_bytes_ratio_hit_ratio"] = ref
            r["vs_lru_bytes_ratio"] = r["hit_ratio"] / ref if ref else None
    return (
        {
            "trace": trace.describe() | {"distinct_pages": distinct},
            "spec": spec.as_json(),
            "host_ratio": host_ratio,
            "references": {"page_size": ps, "hit_tokens": {str(c): h for c, h in hits.items()}},
            "results": results,
        }
        | ({"window_share": share} if windowed else {})
        | ({"state_share": sshare, "checkpoint_every": checkpoint_every} if stateful else {})
    )


# ------------------------------------------------------------------------------------ output


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A right-aligned text table; floats get 4 significant digits, None is "-"."""
    body = [
        [f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v) for v in r]
        for r in rows
    ]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    lines = [
        "  ".join(h.rjust(w) for h, w in zip(headers, widths)),
        "  ".join("-" * w for w in widths),
    ]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _name(r: dict[str, Any]) -> str:
    return f"{r['write_policy']}/{r['eviction']}"


def tables(report: dict[str, Any]) -> str:
    """The hit table and the traffic table of every result; with several L1 sizes, the sweep
    (hit ratio versus capacity per configuration) too."""
    res = report["results"]
    hits = format_table(
        [
            "config",
            "L1 pages",
            "L2 pages",
            "prompt tok",
            "L1 hit",
            "L2 hit",
            "L2 declined",
            "hit ratio",
            "hit/inf",
            "hit/LRU(L1+L2)",
            "hit/LRU(L1)",
        ],
        [
            [
                _name(r),
                r["device_pages"],
                r["host_pages"],
                r["prompt_tokens"],
                r["device_hit_tokens"],
                r["host_hit_tokens"],
                r["host_declined_tokens"],
                r["hit_ratio"],
                r["vs_infinite"],
                r["vs_lru_total"],
                r["vs_lru_l1"],
            ]
            for r in res
        ],
    )
    traffic = format_table(
        [
            "config",
            "L1 pages",
            "MB to host",
            "MB to device",
            "backups",
            "load-backs",
            "evicted pg",
            "evict-backup pg",
            "host evicted pg",
            "wall s",
            "req/s",
        ],
        [
            [
                _name(r),
                r["device_pages"],
                f"{r['bytes_to_host'] / 2**20:.1f}",
                f"{r['bytes_to_device'] / 2**20:.1f}",
                r["backups"],
                r["load_backs"],
                r["evicted_pages"],
                r["eviction_backup_pages"],
                r["host_evicted_pages"],
                f"{r['wall_s']:.1f}",
                f"{r['requests_per_s']:.1f}",
            ]
            for r in res
        ],
    )
    out = [hits, "", traffic]
    if res and "diag_lost_vs_lru_pages" in res[0]:
        out += [
            "",
            format_table(
                [
                    "config",
                    "L1 pages",
                    "lost vs LRU pg",
                    "gained pg",
                    "L1 free pg",
                    "L2 free pg",
                    "L2 redundant pg",
                    "cleaned pg",
                    "admission-cleaned pg",
                    "copies given up pg",
                    "evict-backup pg",
                    "L2 declined pg",
                ],
                [
                    [
                        _name(r),
                        r["device_pages"],
                        r["diag_lost_vs_lru_pages"],
                        r["diag_gained_vs_lru_pages"],
                        r["diag_mean_l1_free_pages"],
                        r["diag_mean_l2_free_pages"],
                        r["diag_mean_l2_redundant_pages"],
                        r["clean_ahead_pages"],
                        r["admission_clean_pages"],
                        r["host_copies_dropped_pages"],
                        r["eviction_backup_pages"],
                        r["host_declined_tokens"] // r["page_size"],
                    ]
                    for r in res
                ],
            ),
        ]
    if res and "bytes_ratio" in res[0]:
        out += ["", window_table(report)]
    if res and "state_bytes_share" in res[0]:
        out += ["", state_table(report)]
    sizes = sorted({r["device_pages"] for r in res})
    if len(sizes) > 1:
        out += ["", sweep_table(report)]
    return "\n".join(out)


#: what a windowed cache's hit ratio should reach of the LRU of ``r x`` its bytes
WINDOW_TARGET = 0.97


def window_table(report: dict[str, Any]) -> str:
    """A windowed cache's rows (:mod:`hicache_jax.replay.windows`): its pools (full / window
    pages of L1 and L2, the window share of L1's and L2's bytes), its hit ratio, the bytes
    ratio ``r`` (mean over the run), the exact LRU of an all-full cache of ``r x`` the bytes
    of L1 + L2, the hit ratio over it against :data:`WINDOW_TARGET`, the LRU of the same bytes
    and the gain over it, the window pages' share of the bytes cached (mean), and the tokens
    cut from matches for want of window pages."""
    rows = []
    for r in report["results"]:
        p, vs = r["pools"], r["vs_lru_bytes_ratio"]
        rows.append(
            [
                _name(r),
                r["device_pages"] * r["page_size"],
                f"{report['host_ratio']:g}x",
                f"{p['device_pages']}/{p['window_device_pages']}",
                f"{p['host_pages']}/{p['window_host_pages']}",
                f"{p['device_share']:.3f}/{p['host_share']:.3f}",
                r["hit_ratio"],
                f"{r['bytes_ratio']:.3f}",
                r["lru_bytes_ratio_hit_ratio"],
                None if vs is None else f"{vs:.3f} {'ok' if vs >= WINDOW_TARGET else 'MISS'}",
                r["lru_total_hit_ratio"],
                None if r["vs_lru_total"] is None else f"{r['vs_lru_total']:.3f}",
                f"{r['window_bytes_share']:.3f}",
                r["window_unservable_tokens"],
            ]
        )
    return format_table(
        [
            "config",
            "L1 tokens",
            "L2",
            "L1 full/win pg",
            "L2 full/win pg",
            "win share L1/L2",
            "hit ratio",
            "r",
            "LRU(r x bytes)",
            f"hit/LRU(r) >= {WINDOW_TARGET:g}",
            "LRU(= bytes)",
            "gain",
            "win bytes share",
            "unservable tok",
        ],
        rows,
    )


def state_table(report: dict[str, Any]) -> str:
    """A hybrid recurrent model's rows (:mod:`hicache_jax.replay.states`): its pools (pages /
    state slots of L1 and L2, the slots' share of L1 + L2's bytes), the checkpoint interval,
    its hit ratio, the every-page oracle's (an exact LRU of the same bytes in pages) and the
    ratio against :data:`~hicache_jax.replay.states.STATE_TARGET`, the exact LRU of its pages
    alone (the slots' bytes given up), the state bytes' share of what it holds (mean over the
    run), the checkpoints written and the tokens cut from matches for want of a checkpoint."""
    target = _states.STATE_TARGET
    rows = []
    for r in report["results"]:
        p, vs = r["pools"], r["vs_oracle"]
        rows.append(
            [
                _name(r),
                r["device_pages"] * r["page_size"],
                f"{report['host_ratio']:g}x",
                f"{p['device_pages']}/{p['state_device_slots']}",
                f"{p['host_pages']}/{p['state_host_slots']}",
                f"{p['share']:.3f}",
                r["checkpoint_every"],
                r["hit_ratio"],
                r["oracle_hit_ratio"],
                None if vs is None else f"{vs:.3f} {'met' if vs >= target else 'NOT met'}",
                r["lru_pages_hit_ratio"],
                f"{r['state_bytes_share']:.3f}",
                r["checkpoints_written"],
                r["window_unservable_tokens"],
            ]
        )
    return format_table(
        [
            "config",
            "L1 tokens",
            "L2",
            "L1 pg/slots",
            "L2 pg/slots",
            "state pool share",
            "ckpt every",
            "hit ratio",
            "oracle",
            f"hit/oracle >= {target:g}",
            "LRU(pages)",
            "state bytes held",
            "ckpts written",
            "cut tok",
        ],
        rows,
    )


def sweep_table(report: dict[str, Any]) -> str:
    """Hit ratio versus L1 capacity (tokens): the references, then per config its hit ratio
    and that ratio over LRU(L1+L2) of the same run."""
    res, ps = report["results"], report["references"]["page_size"]
    names = list(dict.fromkeys(_name(r) for r in res))
    by = {(r["device_pages"], _name(r)): r for r in res}
    rows = []
    for d in sorted({r["device_pages"] for r in res}):
        first = next(r for r in res if r["device_pages"] == d)
        cells: list[Any] = []
        for n in names:  # each config's hit ratio, then its ratio to LRU(L1+L2) of this run
            cells += (
                [by[(d, n)]["hit_ratio"], by[(d, n)]["vs_lru_total"]]
                if (d, n) in by
                else ["-", "-"]
            )
        rows.append([d * ps, first["lru_l1_hit_ratio"], first["lru_total_hit_ratio"]] + cells)
    heads = [h for n in names for h in (n, "/LRU(L1+L2)")]
    return format_table(["L1 tokens", "LRU(L1)", "LRU(L1+L2)", *heads], rows)


def plot(report: dict[str, Any], path: str) -> None:
    """Hit ratio versus L1 capacity, one line per configuration, beside LRU(L1), LRU(L1+L2)
    and the infinite cache. Needs matplotlib (``pip install -e ".[plot]"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, ps = report["results"], report["references"]["page_size"]
    sizes = sorted({r["device_pages"] for r in res})
    first = {d: next(r for r in res if r["device_pages"] == d) for d in sizes}
    xs = [d * ps for d in sizes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(_name(r) for r in res):
        pts = sorted((r["device_pages"] * ps, r["hit_ratio"]) for r in res if _name(r) == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.plot(xs, [first[d]["lru_l1_hit_ratio"] for d in sizes], "k--", label="LRU(L1)")
    ax.plot(xs, [first[d]["lru_total_hit_ratio"] for d in sizes], "k-.", label="LRU(L1+L2)")
    ax.axhline(first[sizes[0]]["infinite_hit_ratio"], color="grey", ls=":", label="infinite")
    top = max([first[sizes[0]]["infinite_hit_ratio"]] + [r["hit_ratio"] for r in res])
    ax.set(
        xscale="log",
        xlabel="L1 capacity (tokens)",
        ylabel="prompt tokens hit",
        ylim=(0, min(1.0, 1.15 * top) or 1.0),
        title=f"{os.path.basename(report['trace']['path'])}: L2 = {report['host_ratio']:g} x L1",
    )
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """Date, backend, device, jax version, CPU count and load average: recorded in the JSON."""
    import jax

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
