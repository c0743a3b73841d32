"""``hicache-jax bench --metrics-port N``: the Prometheus exporter (:mod:`hicache_jax.metrics`)
served on port N while the bench runs, reporting every configuration's cache as it is built,
told apart by the label ``config`` (a configuration built again, its warm-up then its timed
run, reports its latest cache). ``curl localhost:N/metrics`` reads it.

Threading: the exporter's HTTP server thread reads the caches' ``stats()`` (any thread may);
the bench's thread builds the engines.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["serve", "watched"]

E = TypeVar("E")  # an engine (it has a ``cache``)


def serve(port: int | None, processes: int = 1) -> Any:
    """The collector serving on ``port`` (all interfaces, a registry of its own), or None
    without a port.

    Raises:
        ValueError: a port outside 1..65535, or several processes (each would take the port).
        ImportError: the ``metrics`` extra is not installed. OSError: the port is taken.
    """
    if port is None:
        return None
    if not 0 < port < 65536:
        raise ValueError(f"--metrics-port {port} must be in 1..65535")
    if processes > 1:
        raise ValueError("--metrics-port serves one process's caches: use --processes 1")
    from prometheus_client import CollectorRegistry, start_http_server

    from hicache_jax.metrics import CacheCollector

    registry = CollectorRegistry()
    collector = CacheCollector(cache_label="config", registry=registry)
    start_http_server(port, registry=registry)
    return collector


def watched(collector: Any, prefix: str = "") -> Callable[[Callable[[str], E]], Callable[[str], E]]:
    """A decorator of an engine factory (by configuration mode): each engine's cache is
    reported under ``config=prefix + mode`` as it is built; the factory unchanged without a
    collector."""

    def decorate(build: Callable[[str], E]) -> Callable[[str], E]:
        if collector is None:
            return build

        def build_watched(mode: str) -> E:
            engine = build(mode)
            with contextlib.suppress(KeyError):  # its warm-up's cache: the new one replaces it
                collector.remove(prefix + mode)
            collector.add(prefix + mode, engine.cache)  # type: ignore[attr-defined]
            return engine

        return build_watched

    return decorate
