"""`hicache-jax bench --metrics-port N` (hicache_jax/cli/bench_metrics.py): the exporter serves
every configuration's cache, labelled by config, while the bench runs; bad ports are usage
errors."""

from __future__ import annotations

import urllib.request

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from hicache_jax.cli import bench_metrics  # noqa: E402
from hicache_jax.cli.main import main  # noqa: E402
from storage_servers import free_port  # noqa: E402

TINY = [
    *("--quiet", "--no-warmup", "--layers", "2", "--d-model", "32", "--heads", "4"),
    *("--kv-heads", "2", "--head-dim", "8", "--ffn-dim", "48", "--vocab", "97"),
    *("--sessions", "3", "--turns", "3", "--base-tokens", "40", "--segment-tokens", "8"),
    *("--max-new-tokens", "4", "--page-size", "16", "--device-pages", "64"),
    *("--chunk-size", "64"),
]


@pytest.fixture
def servers(monkeypatch):
    """The HTTP servers the bench starts, shut down after the test."""
    started = []
    real = prometheus_client.start_http_server

    def start(*args, **kw):
        started.append(real(*args, **kw))
        return started[-1]

    monkeypatch.setattr(prometheus_client, "start_http_server", start)
    yield started
    for server, thread in started:
        server.shutdown()
        server.server_close()
        thread.join()


def test_bench_serves_every_configurations_cache(servers, capsys):
    port = free_port()
    assert main(["bench", *TINY, "--metrics-port", str(port)]) == 0
    assert len(servers) == 1
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    admitted = {
        s.labels["config"]: s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == "hicache_admitted_requests_total"
    }
    assert set(admitted) == {"none", "device", "hicache"}
    assert admitted["hicache"] == admitted["device"] == 9  # 3 sessions x 3 turns


@pytest.mark.parametrize(
    "port, processes, match", [(0, 1, "1..65535"), (70000, 1, "1..65535"), (9400, 2, "one")]
)
def test_bad_ports_are_refused_before_serving(port, processes, match, servers):
    with pytest.raises(ValueError, match=match):
        bench_metrics.serve(port, processes)
    assert servers == []


def test_a_bad_port_is_a_usage_error(capsys, servers):
    with pytest.raises(SystemExit) as e:
        main(["bench", *TINY, "--metrics-port", "0"])
    assert e.value.code == 2 and "--metrics-port 0" in capsys.readouterr().err


def test_without_a_port_nothing_is_served_and_factories_are_unchanged(servers):
    assert bench_metrics.serve(None) is None

    def build(mode: str) -> str:
        return mode

    assert bench_metrics.watched(None)(build) is build
    assert servers == []


def test_a_configuration_built_again_reports_its_latest_cache():
    from prometheus_client import CollectorRegistry, generate_latest

    from helpers import bookkeeping_spec, make_cache
    from hicache_jax.metrics import CacheCollector

    class Engine:
        def __init__(self) -> None:
            self.cache = make_cache(bookkeeping_spec())

    collector = CacheCollector(cache_label="config", registry=(registry := CollectorRegistry()))
    build = bench_metrics.watched(collector, "batched ")(lambda mode: Engine())
    warm, timed = build("hicache"), build("hicache")  # the warm-up, then the timed run
    timed.cache.begin([1, 2, 3, 4]).abort()
    text = generate_latest(registry).decode()
    assert 'hicache_admitted_requests_total{config="batched hicache"} 1.0' in text
    warm.cache.close(), timed.cache.close()
