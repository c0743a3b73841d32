"""What the Prometheus exporter costs: requests/s of a trace replay with the exporter registered
and scraped over HTTP every 0.5 s, against the same replay without it.

Replays a Mooncake-format trace (default: benchmarks/data/mooncake_synthetic_1000.jsonl,
``--passes`` times over in one replay, so that a replay lasts seconds: many scrapes) through
:func:`hicache_jax.replay.driver.replay` (the request handle, one request at a time; L1 1/8 of
the trace's distinct pages, L2 4x). "on": a :class:`hicache_jax.metrics.CacheCollector`
reports the replay's cache on a registry served by ``prometheus_client.start_http_server``, and
a thread scrapes it every ``--interval`` seconds while the replay runs (each scrape reads
``stats()`` and the transfer histograms on the server's thread); "off": no exporter at all.
The limit it is judged against: the same replay off, in the same run, alternating on and off
(one untimed warm-up replay first: jit compiles), medians of ``--repeats``. Target: on within 5%
of off (on/off >= 0.95).

Usage: ``python -m benchmarks.bench_metrics [TRACE] [--quick] [--repeats N] [--limit N]
[--passes K] [--interval S] [--json PATH]``. ``--quick`` (200 requests, 3 passes, 2 repeats,
a scrape every 0.02 s) checks that it works; its figure is not the measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import statistics
import threading
import urllib.request
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
TRACE = REPO / "benchmarks" / "data" / "mooncake_synthetic_1000.jsonl"
MODES = ("off", "on")
TARGET = 0.95


class Scraper:
    """A thread that GETs ``url`` every ``interval`` seconds until closed (counts them)."""

    def __init__(self, url: str, interval: float) -> None:
        self.url, self.interval, self.scrapes, self.bytes = url, interval, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with urllib.request.urlopen(self.url, timeout=30) as r:
                self.bytes += len(r.read())
            self.scrapes += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def run(mode: str, trace: Any, spec: Any, cfg: Any, interval: float) -> dict[str, Any]:
    """One replay, with the exporter scraped (``"on"``) or none (``"off"``)."""
    from hicache_jax.replay.driver import replay

    if mode == "off":
        r = replay(trace, spec, cfg)
        return {"requests_per_s": r["requests_per_s"], "wall_s": r["wall_s"], "scrapes": 0}
    from prometheus_client import CollectorRegistry, start_http_server

    from hicache_jax.metrics import CacheCollector

    registry = CollectorRegistry()
    collector = CacheCollector(registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    scraper = Scraper(f"http://127.0.0.1:{server.server_port}/metrics", interval)
    try:
        r = replay(trace, spec, cfg, on_cache=lambda cache: collector.add("replay", cache))
    finally:
        scraper.close()
        server.shutdown()
        server.server_close()
        thread.join()
    return {
        "requests_per_s": r["requests_per_s"],
        "wall_s": r["wall_s"],
        "scrapes": scraper.scrapes,
        "scrape_bytes": scraper.bytes // max(scraper.scrapes, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument(
        "--quick", action="store_true", help="200 requests, 3 passes, 2 repeats, 0.02 s scrapes"
    )
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--passes", type=int, default=10, help="times over the trace per replay")
    ap.add_argument("--interval", type=float, default=None, help="seconds between scrapes (0.5)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.limit, args.repeats, args.passes = args.limit or 200, 2, 3
        args.interval = args.interval or 0.02
    args.interval = args.interval or 0.5
    from hicache_jax import HiCacheConfig, KVSpec
    from hicache_jax.replay.block_lru import default_device_pages
    from hicache_jax.replay.driver import TINY_SPEC
    from hicache_jax.replay.trace import load_trace

    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    trace = dataclasses.replace(trace, requests=trace.requests * args.passes)
    spec = KVSpec.parse(None, TINY_SPEC, page_size=args.block_size)
    pages = default_device_pages(trace, args.block_size)
    cfg = HiCacheConfig(device_pages=pages, host_pages=4 * pages, load_back_threshold=512)
    run("on", trace, spec, cfg, args.interval)  # warm-up: jit compiles, the server's imports
    runs: dict[str, list] = {m: [] for m in MODES}
    for i in range(args.repeats):  # alternating, the first mode swapped each repeat
        for mode in MODES if i % 2 == 0 else MODES[::-1]:
            runs[mode].append(run(mode, trace, spec, cfg, args.interval))
    report(args, runs, len(trace.requests), pages)


def report(args: argparse.Namespace, runs: dict, requests: int, pages: int) -> None:
    from benchmarks.common import print_table, write_json

    rps = {m: statistics.median(r["requests_per_s"] for r in runs[m]) for m in MODES}
    ratio = rps["on"] / rps["off"]
    pairs = [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(runs["on"], runs["off"])]
    print_table(
        ["exporter", "req/s median", "req/s min", "req/s max", "scrapes/run", "on/off"],
        [
            [
                m,
                f"{rps[m]:,.0f}",
                f"{min(r['requests_per_s'] for r in runs[m]):,.0f}",
                f"{max(r['requests_per_s'] for r in runs[m]):,.0f}",
                statistics.median(r["scrapes"] for r in runs[m]),
                rps[m] / rps["off"],
            ]
            for m in MODES
        ],
        title=f"The Prometheus exporter on a replay of {pathlib.Path(args.trace).name} "
        f"({requests} requests: {args.passes} passes, L1 {pages} pages, L2 4x; "
        f"scraped every {args.interval:g} s; "
        f"median of {args.repeats}, alternating; load average {os.getloadavg()[0]:.1f})",
    )
    print(
        f"paired on/off per repeat: {', '.join(f'{p:.3f}' for p in pairs)} "
        f"(median {statistics.median(pairs):.3f})"
    )
    print(
        f"\ntarget on/off >= {TARGET} (the exporter within 5% of off): "
        f"{'met' if ratio >= TARGET else 'NOT met'} ({ratio:.3f})"
    )
    write_json(
        args.json,
        "bench_metrics",
        vars(args),
        {"runs": runs, "requests_per_s": rps, "on_off": ratio, "paired": pairs},
    )


if __name__ == "__main__":
    main()
