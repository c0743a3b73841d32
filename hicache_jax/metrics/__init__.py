"""Metrics for dashboards: the Prometheus exporter (:mod:`~hicache_jax.metrics.prometheus`),
on ``prometheus_client``, an optional extra (``pip install -e ".[metrics]"``). Nothing below
this package imports ``prometheus_client``: the cache keeps its counters and transfer histograms
itself (``HiCache.stats()``, ``HiCache.transfer_histograms()``) and this package reads them at
scrape time."""

try:
    from hicache_jax.metrics.prometheus import FAMILIES, HISTOGRAMS, CacheCollector, Family
except ModuleNotFoundError as e:  # the extra is not installed: say which
    if (e.name or "").split(".")[0] != "prometheus_client":
        raise
    raise ModuleNotFoundError(
        'hicache_jax.metrics needs prometheus_client: pip install -e ".[metrics]" '
        "(or pip install 'prometheus-client>=0.20')",
        name="prometheus_client",
    ) from e

__all__ = ["FAMILIES", "HISTOGRAMS", "CacheCollector", "Family"]
