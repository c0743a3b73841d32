"""The Prometheus exporter (hicache_jax/metrics/prometheus.py): scraped over HTTP during and after
a trace replay, its per-tier token counters equal ``stats()`` and the replay's own figures and
its transfer histograms count every transfer; names, prefix and labels; bad arguments; the
core never imports prometheus_client."""

from __future__ import annotations

import itertools
import pathlib
import subprocess
import sys
import threading
import urllib.request

import numpy as np
import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry, generate_latest, start_http_server  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from helpers import bookkeeping_spec, make_cache  # noqa: E402
from hicache_jax import HiCacheConfig, KVSpec  # noqa: E402
from hicache_jax.metrics import FAMILIES, HISTOGRAMS, CacheCollector  # noqa: E402
from hicache_jax.replay.driver import TINY_SPEC, replay  # noqa: E402
from hicache_jax.replay.trace import load_trace  # noqa: E402

ROOT = pathlib.Path(__file__).parent.parent
TRACE = ROOT / "benchmarks" / "data" / "mooncake_synthetic_1000.jsonl"
REQUESTS = 300


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """``{(sample name, sorted labels): value}`` of a scrape."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def value(scrape: dict, name: str, **labels) -> float:
    return scrape[(name, tuple(sorted({"cache": "replay", **labels}.items())))]


def scrape_http(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return samples(r.read().decode())


class MidwayScrape:
    """A progress bar for ``replay`` that scrapes the exporter over HTTP after request
    ``at``: the cache's thread waits in the scrape, so the figures are those of exactly the
    first ``at`` requests."""

    def __init__(self, port: int, at: int) -> None:
        self.port, self.at, self.done, self.scrape = port, at, 0, None

    def __call__(self, total: int, desc: str) -> MidwayScrape:
        return self

    def update(self, n: int) -> None:
        self.done += n
        if self.done == self.at:
            self.scrape = scrape_http(self.port)

    def close(self) -> None:
        pass


def test_a_scrape_during_and_after_a_replay_agrees_with_stats_and_the_replay():
    registry = CollectorRegistry()
    collector = CacheCollector(registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    port = server.server_port
    caches: list = []
    background: list[dict] = []
    stop = threading.Event()

    def keep_scraping() -> None:  # concurrent scrapes while the cache's thread serves
        while not stop.is_set():
            background.append(scrape_http(port))
            stop.wait(0.01)

    def watch(cache) -> None:
        caches.append(cache)
        collector.add("replay", cache)

    scraper = threading.Thread(target=keep_scraping)
    spec = KVSpec.parse(None, TINY_SPEC, page_size=512)
    # L1 far smaller than the trace's working set: load-backs from L2 happen
    cfg = HiCacheConfig(device_pages=48, host_pages=600, load_back_threshold=512)
    midway = MidwayScrape(port, REQUESTS // 2)
    try:
        scraper.start()
        result = replay(
            load_trace(TRACE, limit=REQUESTS), spec, cfg, progress=midway, on_cache=watch
        )
    finally:
        stop.set()
        scraper.join()
    try:
        after = scrape_http(port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    (cache,) = caches
    st = cache.stats()
    assert result["host_hit_tokens"] > 0 and result["device_hit_tokens"] > 0

    # during: exactly the first half of the requests had been admitted
    mid = midway.scrape
    assert mid is not None and value(mid, "hicache_admitted_requests_total") == REQUESTS // 2
    assert (
        0
        < value(mid, "hicache_cached_tokens_total", cache_source="device")
        <= (value(after, "hicache_cached_tokens_total", cache_source="device"))
    )
    assert background, "no scrape while the replay ran"
    for earlier, later in itertools.pairwise(background):  # counters never go down
        key = ("hicache_admitted_requests_total", (("cache", "replay"),))
        if key in earlier and key in later:
            assert earlier[key] <= later[key]

    # after: the per-tier counters are stats() and the replay's own figures, exactly
    device = value(after, "hicache_cached_tokens_total", cache_source="device")
    host = value(after, "hicache_cached_tokens_total", cache_source="host")
    storage = value(after, "hicache_cached_tokens_total", cache_source="storage")
    assert (device, host, storage) == (
        st["served_device_tokens"],
        st["served_host_tokens"],
        st["served_l3_tokens"],
    )
    assert device == result["device_hit_tokens"] and host + storage == result["host_hit_tokens"]
    assert storage == 0  # no L3 configured
    assert value(after, "hicache_recomputed_tokens_total") == st["recomputed_tokens"]
    assert value(after, "hicache_admitted_requests_total") == REQUESTS == st["admitted_requests"]
    assert value(after, "hicache_load_backs_total") == st["load_backs"] == result["load_backs"]

    # the histograms saw every transfer: one load-back chain per transfer in a replay
    to_host = {"direction": "to_host"}
    to_device = {"direction": "to_device"}
    for name in HISTOGRAMS:
        assert value(after, f"hicache_{name}_count", **to_device) == st["transfers_to_device"]
        assert value(after, f"hicache_{name}_count", **to_host) == st["transfers_to_host"]
    assert st["transfers_to_device"] == st["load_backs"] > 0
    assert 0 < st["transfers_to_host"] <= st["backups"]
    assert value(after, "hicache_transfer_size_bytes_sum", **to_device) == st["bytes_to_device"]
    assert value(after, "hicache_transfer_size_bytes_sum", **to_host) == st["bytes_to_host"]
    assert value(after, "hicache_transferred_bytes_total", **to_host) == st["bytes_to_host"]
    inf = value(after, "hicache_transfer_duration_seconds_bucket", le="+Inf", **to_device)
    assert inf == st["transfers_to_device"]


def _served_cache():
    spec = bookkeeping_spec(page_size=4)
    cache = make_cache(spec, device_pages=4, host_pages=16, write_policy="write_through")
    for start in (0, 100, 0):  # the third is back on host: a load-back
        toks = np.arange(start, start + 12)
        with cache.begin(toks) as req:
            req.extend(len(toks) - req.cached_len)
            req.finish(toks)
    cache.flush()
    return cache


def test_prefix_constant_labels_and_several_caches():
    a, b = _served_cache(), make_cache(bookkeeping_spec(page_size=4))
    registry = CollectorRegistry()
    collector = CacheCollector(
        {"a": a},
        prefix="sglang:",
        const_labels={"instance": "prefill-0"},
        cache_label="config",
        registry=registry,
    )
    collector.add("b", b)
    text = generate_latest(registry).decode()
    got = samples(text)
    assert all(name.startswith("sglang:") for name, _ in got)
    helps = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP")}
    want = {f"sglang:{f.name}" + ("_total" if f.kind == "counter" else "") for f in FAMILIES}
    assert helps == want | {f"sglang:{name}" for name in HISTOGRAMS}  # L3's without samples
    key = (("cache_source", "host"), ("config", "a"), ("instance", "prefill-0"))
    assert got[("sglang:cached_tokens_total", key)] == a.stats()["served_host_tokens"] == 12
    key_b = (("cache_source", "host"), ("config", "b"), ("instance", "prefill-0"))
    assert got[("sglang:cached_tokens_total", key_b)] == 0
    collector.remove("b")
    got = samples(generate_latest(registry).decode())
    assert ("sglang:cached_tokens_total", key_b) not in got
    a.close(), b.close()


def test_bad_arguments_raise_before_anything_is_registered():
    registry = CollectorRegistry()
    cache = make_cache(bookkeeping_spec(page_size=4))
    for kw, match in [
        ({"prefix": "9x"}, "prefix"),
        ({"prefix": "a-b"}, "prefix"),
        ({"cache_label": "bad-label"}, "label name"),
        ({"const_labels": {"__x": "1"}}, "label name"),
        ({"const_labels": {"cache": "x"}}, "the cache label"),
    ]:
        with pytest.raises(ValueError, match=match):
            CacheCollector({"c": cache}, registry=registry, **kw)
    assert generate_latest(registry) == b""  # nothing registered
    collector = CacheCollector({"c": cache}, registry=registry)
    with pytest.raises(ValueError, match="reported already"):
        collector.add("c", cache)
    with pytest.raises(TypeError, match="HiCache"):
        collector.add("d", object())
    with pytest.raises(KeyError):
        collector.remove("d")
    with pytest.raises(ValueError, match="Duplicated"):  # the client's own name check
        CacheCollector({"c": cache}, registry=registry)
    cache.close()


def test_the_collector_reads_nothing_until_scraped():
    cache = _served_cache()
    reads = []
    stats, hists = cache.stats, cache.transfer_histograms
    cache.stats = lambda: reads.append("stats") or stats()  # type: ignore[method-assign]
    cache.transfer_histograms = lambda: reads.append("h") or hists()  # type: ignore[method-assign]
    registry = CollectorRegistry()
    CacheCollector({"c": cache}, registry=registry)
    assert reads == []  # registering describes the families without reading the cache
    generate_latest(registry)
    assert reads == ["stats", "h"]
    cache.close()


def test_the_core_never_imports_prometheus_client():
    code = (
        "import sys, hicache_jax, hicache_jax.replay, hicache_jax.study, hicache_jax.cli.main\n"
        "assert 'prometheus_client' not in sys.modules, 'imported by the core'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_without_the_extra_the_import_says_what_to_install():
    code = (
        "import sys\n"
        "sys.modules['prometheus_client'] = None  # not installed\n"
        "try:\n"
        "    import hicache_jax.metrics\n"
        "except ModuleNotFoundError as e:\n"
        "    assert 'pip install' in str(e) and e.name == 'prometheus_client', e\n"
        "else:\n"
        "    raise SystemExit('imported')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
