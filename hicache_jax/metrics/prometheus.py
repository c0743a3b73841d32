"""The Prometheus exporter: a collector that reads ``HiCache.stats()`` and
``HiCache.transfer_histograms()`` when it is scraped, never before.

Nothing is counted for it: the cache keeps its counters and its transfer histograms anyway
(``stats()`` and ``memory/histogram.py``), so a cache nobody scrapes pays nothing, and a scrape
pays one ``stats()`` call per cache (both reads are documented as callable from any thread,
so the HTTP server's thread may make them while the cache's thread serves).

```python
from prometheus_client import start_http_server
from hicache_jax.metrics import CacheCollector

CacheCollector({"main": cache})  # registered on prometheus_client's default registry
start_http_server(9400)  # the caller's: curl localhost:9400/metrics
```

The metrics, their names and SGLang's equivalents: docs/guides/metrics.md. Every family is
named ``prefix + name`` (``prefix`` ``"hicache_"`` by default; a stack publishes under its own,
e.g. ``"sglang:"``), and every sample carries the cache's label (``cache_label``, the name
the cache was added under) and the constant labels.

Threading: :meth:`CacheCollector.add` and :meth:`CacheCollector.remove` from any thread
(a lock guards the caches); :meth:`CacheCollector.collect` on the scraping thread.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import REGISTRY, Collector, CollectorRegistry

from hicache_jax.cache.hicache import HiCache
from hicache_jax.memory.histogram import HistogramSnapshot

__all__ = ["FAMILIES", "HISTOGRAMS", "CacheCollector", "Family"]

_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")

#: A sample's value from one cache's ``stats()`` and its page size (None: not reported).
Value = Callable[[Mapping[str, Any], int], "float | None"]


def _key(name: str) -> Value:
    def value(st: Mapping[str, Any], ps: int) -> float | None:
        v = st.get(name)
        return None if v is None else float(v)

    return value


def _tokens(*pages: str) -> Value:
    """Pages counted under ``pages`` keys, as tokens."""

    def value(st: Mapping[str, Any], ps: int) -> float | None:
        return float(sum(st.get(k, 0) for k in pages) * ps)

    return value


def _store(name: str) -> Value:
    """A counter of the L3 store (``l3_store_*``: present once the store counted one)."""

    def value(st: Mapping[str, Any], ps: int) -> float | None:
        return float(st.get(f"l3_store_{name}", 0)) if "l3_available" in st else None

    return value


@dataclass(frozen=True)
class Family:
    """One metric family the collector reports.

    Attributes:
        name: its name after the prefix (a counter's without ``_total``: the client adds it).
        kind: ``"counter"`` or ``"gauge"``.
        help: what it counts (the ``# HELP`` line).
        label: the label that tells its samples apart (None: one sample per cache).
        samples: ``(label value, value)`` per sample; one with label value ``""`` when
            ``label`` is None.
    """

    name: str
    kind: str
    help: str
    label: str | None
    samples: tuple[tuple[str, Value], ...]


def _one(name: str, kind: str, help: str, value: Value) -> Family:
    return Family(name, kind, help, None, (("", value),))


def _by(name: str, kind: str, help: str, label: str, **values: Value) -> Family:
    return Family(name, kind, help, label, tuple(values.items()))


_C, _G = "counter", "gauge"

#: Every family but the transfer histograms, in the order a scrape lists them.
FAMILIES: tuple[Family, ...] = (
    # -- what requests were served from (Request.served, summed) ------------------------------
    _one("admitted_requests", _C, "Requests admitted (begin, begin_many, admit_matched).",
         _key("admitted_requests")),
    _one("prompt_tokens", _C, "Prompt tokens of the admitted requests.",
         _key("admitted_prompt_tokens")),
    _by("cached_tokens", _C,
        "Prompt tokens served from the cache at admission, by tier (device: an L1 hit; host: "
        "loaded back from L2's own copies; storage: loaded back from pages an L3 prefetch "
        "brought in).",
        "cache_source",
        device=_key("served_device_tokens"),
        host=_key("served_host_tokens"),
        storage=_key("served_l3_tokens")),
    _one("recomputed_tokens", _C,
         "Prompt tokens of the admitted requests not served from the cache (declined host "
         "tokens included): the caller computed them.", _key("recomputed_tokens")),
    _one("load_wait_seconds", _C, "Seconds admission spent in load-backs.",
         _key("served_load_wait_seconds")),
    # -- matching -------------------------------------------------------------------------------
    _one("match_tokens", _C, "Tokens looked up by match_prefix (whole pages).",
         _key("match_tokens")),
    _by("match_hit_tokens", _C, "Tokens match_prefix found cached, by tier.", "tier",
        device=_key("device_hit_tokens"), host=_key("host_hit_tokens")),
    # -- L1 <-> L2 ------------------------------------------------------------------------------
    _one("load_backs", _C, "Load-backs (host -> device chains) dispatched.", _key("load_backs")),
    _one("load_back_tokens", _C, "Tokens loaded back from host to device.",
         _key("load_back_tokens")),
    _one("load_backs_declined", _C,
         "Host chains not loaded back (threshold, quota, cost rule, no pages).",
         _key("load_backs_declined")),
    _one("host_backups", _C, "Nodes backed up from device to host.", _key("backups")),
    _one("host_backup_tokens", _C, "Tokens backed up from device to host.",
         _key("backup_tokens")),
    _one("host_backups_skipped", _C, "Backups skipped for want of host pages.",
         _key("backups_skipped")),
    _by("transferred_bytes", _C, "Bytes copied between device and host, by direction.",
        "direction", to_host=_key("bytes_to_host"), to_device=_key("bytes_to_device")),
    _one("evicted_tokens", _C, "Tokens evicted from device.", _key("evicted_tokens")),
    _one("host_evicted_tokens", _C, "Tokens evicted from host.", _key("host_evicted_tokens")),
    # -- L3 ------------------------------------------------------------------------------------
    _by("l3_put_pages", _C,
        "Pages put to the L3 store, by outcome (stored; dropped by the store; skipped: "
        "staging full).",
        "outcome",
        stored=_key("l3_put_pages_stored"),
        dropped=_key("l3_puts_dropped"),
        skipped=_key("l3_puts_skipped")),
    _one("backuped_tokens", _C, "Tokens stored to L3.", _tokens("l3_put_pages_stored")),
    _by("l3_store_pages", _C, "Pages the L3 store read (get) and wrote (put).", "op",
        get=_store("get_pages"), put=_store("put_pages")),
    _by("l3_store_bytes", _C, "Bytes the L3 store read (get) and wrote (put).", "op",
        get=_store("bytes_read"), put=_store("bytes_written")),
    _one("prefetched_tokens", _C,
         "Tokens an L3 prefetch brought into host pages (new leaves and host copies).",
         _tokens("l3_prefetch_hit_pages", "l3_prefetch_backfill_pages")),
    _by("l3_prefetches", _C,
        "L3 prefetches closed, by outcome (complete; partial: pages missed; revoked: landed "
        "pages had nowhere to hang; timed_out: the timeout policy gave up).",
        "outcome",
        complete=_key("l3_prefetches_complete"),
        partial=_key("l3_prefetches_partial"),
        revoked=_key("l3_prefetches_revoked"),
        timed_out=_key("l3_prefetch_timeouts")),
    _by("l3_prefetch_pages", _C, "Pages of L3 prefetches, by what became of them.", "outcome",
        hit=_key("l3_prefetch_hit_pages"),
        backfill=_key("l3_prefetch_backfill_pages"),
        duplicate=_key("l3_prefetch_duplicate_pages"),
        missed=_key("l3_prefetch_missed_pages"),
        dropped=_key("l3_prefetch_dropped_pages")),
    # -- occupancy ------------------------------------------------------------------------------
    _by("pool_pages", _G, "Pages of each pool, by tier.", "tier",
        device=_key("device_pages"), host=_key("host_pages")),
    _by("device_pages_by_state", _G,
        "Device pages by state (free; evictable; locked: held by locked nodes; pinned; "
        "caller: owned by running requests).",
        "state",
        free=_key("device_free_pages"),
        evictable=_key("device_evictable_pages"),
        locked=_key("device_protected_pages"),
        pinned=_key("pinned_device_pages"),
        caller=_key("device_caller_pages")),
    _by("host_pages_by_state", _G,
        "Host pages by state (free; evictable: host-only leaves' pages; pinned).",
        "state",
        free=_key("host_free_pages"),
        evictable=_key("host_evictable_pages"),
        pinned=_key("pinned_host_pages")),
    _one("host_used_tokens", _G, "Tokens the host pool's used pages hold room for.",
         _tokens("host_used_pages")),
    _one("host_total_tokens", _G, "Tokens the host pool holds room for.",
         _tokens("host_pages")),
    _by("cached_tokens_now", _G, "Tokens the tree holds, by tier.", "tier",
        device=_key("device_cached_tokens"), host=_key("host_cached_tokens")),
    _one("transfers_in_flight", _G, "Device <-> host operations in flight.",
         _key("transfers_in_flight")),
    _one("l3_in_flight", _G, "L3 reads and writes in flight.", _key("l3_in_flight")),
    # -- events, cost model, processes ------------------------------------------------------------
    _one("kv_event_batches", _C, "KV event batches published.", _key("kv_event_batches")),
    _one("kv_event_batches_dropped", _C, "KV event batches dropped (buffer full).",
         _key("kv_event_batches_dropped")),
    _one("kv_event_publish_errors", _C, "KV event publish errors.",
         _key("kv_event_publish_errors")),
    _by("cost_decisions", _C,
        "Load-or-recompute decisions of load_policy='cost', by who decided (model: the cost "
        "model; warmup: the threshold rule, no prefill figure yet; fallback: the threshold "
        "rule, prefill_cost failed).",
        "by",
        model=_key("cost_decisions"),
        warmup=_key("cost_warmup_decisions"),
        fallback=_key("cost_fallbacks")),
    _by("cost_model_decisions", _C,
        "The cost model's decisions by kind (partial_load: part of a chain; probe: of an "
        "unmeasured link; split: a two-ended split).",
        "kind",
        partial_load=_key("cost_partial_loads"),
        probe=_key("cost_probes"),
        split=_key("cost_splits")),
    _by("cost_error_median", _G,
        "Median relative error of the cost model's predictions (decision: a decision's whole "
        "time; l2_l1, l3_l2: a transfer; prefill: a prefill).",
        "of",
        decision=_key("cost_decision_err_median"),
        l2_l1=_key("cost_l2_l1_pred_err_median"),
        l3_l2=_key("cost_l3_l2_pred_err_median"),
        prefill=_key("cost_prefill_pred_err_median")),
    _by("cost_link_gbps", _G, "Bandwidth the cost model has fitted per link (GB/s).", "link",
        l2_l1=_key("cost_l2_l1_gbps"), l3_l2=_key("cost_l3_l2_gbps")),
    _one("agreements", _C, "Agreements made with the other processes (several processes).",
         _key("agreements")),
    _one("agreement_seconds", _C, "Seconds spent in agreements, waiting for peers included.",
         _key("agreement_seconds")),
    _one("completion_lag_waits", _C,
         "Request starts that waited for a copy not yet landed (completion_lag).",
         _key("completion_lag_waits")),
    _one("completion_lag_wait_seconds", _C, "Seconds those waits took.",
         _key("completion_lag_wait_seconds")),
)  # fmt: skip

#: The transfer histograms: family name -> (the snapshot's key, help).
HISTOGRAMS: dict[str, tuple[str, str]] = {
    "transfer_duration_seconds": (
        "seconds",
        "Device <-> host transfers: dispatch to observed completion, by direction.",
    ),
    "transfer_size_bytes": ("bytes", "Device <-> host transfers: bytes, by direction."),
    "transfer_bandwidth_gbps": (
        "gbps",
        "Device <-> host transfers: bytes over duration (GB/s), by direction.",
    ),
}


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    return [("+Inf" if b == float("inf") else repr(b), float(n)) for b, n in h.cumulative()]


class CacheCollector(Collector):
    """Reports caches to Prometheus, reading them at scrape time.

    Args:
        caches: ``{name: cache}`` to report now (more with :meth:`add`).
        prefix: put before every family's name (a metric-name prefix: ``"hicache_"``,
            ``"sglang:"``, ``""``).
        const_labels: labels on every sample (e.g. ``{"instance": "prefill-0"}``).
        cache_label: the label whose value tells the caches apart (their names).
        registry: where to register (prometheus_client's default registry when None);
            ``register=False`` registers nowhere (register it yourself).

    Raises:
        ValueError: a malformed prefix or label name, a constant label named as the cache
            label; before anything is registered.
    """

    def __init__(
        self,
        caches: Mapping[str, HiCache] | None = None,
        *,
        prefix: str = "hicache_",
        const_labels: Mapping[str, str] | None = None,
        cache_label: str = "cache",
        registry: CollectorRegistry | None = None,
        register: bool = True,
    ) -> None:
        if not isinstance(prefix, str) or (prefix and not _NAME.match(prefix)):
            raise ValueError(f"prefix={prefix!r} must be a metric-name prefix ([a-zA-Z_:]...)")
        labels = dict(const_labels or {})
        for name in [cache_label, *labels]:
            if not isinstance(name, str) or not _LABEL.match(name) or name.startswith("__"):
                raise ValueError(f"label name {name!r} must match [a-zA-Z_][a-zA-Z0-9_]*")
        if cache_label in labels:
            raise ValueError(f"const_labels names {cache_label!r}, the cache label")
        self._prefix, self._cache_label = prefix, cache_label
        self._const = {k: str(v) for k, v in labels.items()}
        self._caches: dict[str, HiCache] = {}
        self._lock = threading.Lock()
        for name, cache in (caches or {}).items():
            self.add(name, cache)
        if register:
            (REGISTRY if registry is None else registry).register(self)

    def add(self, name: str, cache: HiCache) -> None:
        """Report ``cache`` under the cache label ``name`` from the next scrape on
        (a closed cache still reports its last figures: ``stats()`` works after close).

        Raises:
            TypeError: not a HiCache. ValueError: ``name`` is taken.
        """
        if not isinstance(cache, HiCache):
            raise TypeError(f"cache must be a HiCache, got {type(cache).__name__}")
        with self._lock:
            if str(name) in self._caches:
                raise ValueError(f"a cache named {name!r} is reported already")
            self._caches[str(name)] = cache

    def remove(self, name: str) -> None:
        """Stop reporting the cache added as ``name``; KeyError if none was."""
        with self._lock:
            del self._caches[str(name)]

    def describe(self) -> list[Metric]:
        """The families, without samples (what registering checks names against; reads no
        cache)."""
        return list(self._families([]))

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            caches = list(self._caches.items())
        read = [(n, c.stats(), c.spec.page_size, c.transfer_histograms()) for n, c in caches]
        yield from self._families(read)

    def _families(self, read: list[tuple[str, Any, int, Any]]) -> Iterator[Metric]:
        const = list(self._const.values())
        names = [self._cache_label, *self._const]
        for fam in FAMILIES:
            labels = names if fam.label is None else [*names, fam.label]
            cls = CounterMetricFamily if fam.kind == _C else GaugeMetricFamily
            metric = cls(self._prefix + fam.name, fam.help, labels=labels)
            for cache, st, ps, _ in read:
                for label, value in fam.samples:
                    v = value(st, ps)
                    if v is not None:
                        extra = [] if fam.label is None else [label]
                        metric.add_metric([cache, *const, *extra], v)
            yield metric
        for name, (key, help) in HISTOGRAMS.items():
            hist = HistogramMetricFamily(self._prefix + name, help, labels=[*names, "direction"])
            for cache, _, _, hists in read:
                for direction, snap in hists.items():
                    h = snap[key]
                    hist.add_metric([cache, *const, direction], _buckets(h), h.sum)
            yield hist
