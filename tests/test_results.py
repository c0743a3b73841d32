"""One result schema from the device benchmarks' JSONs (hicache_jax/cli/results.py)."""

import json
import math
import pathlib

import pytest

from hicache_jax.cli import results

DATA = pathlib.Path(__file__).parent / "data"
ENV = {"backend": "cpu", "device_kind": "cpu", "device_count": 1, "jax": "0.10.2"}


def _doc(name, res, **extra):
    return {"benchmark": name, "env": ENV, "config": {"quick": True}, "results": res, **extra}


TRANSFER = _doc(
    "gpu_transfer",
    {
        "directions": [
            dict(
                layout="layer_first",
                direction="load",
                pages=128,
                mib=16.0,
                limit="device_put",
                limit_gbps=10.0,
                gbps=8.0,
                ratio=0.79,
                device_gather_gbps=1.0,
            ),
            dict(
                layout="layer_first",
                direction="both",
                pages=0,
                mib=0.0,
                limit="failed: X",
                limit_gbps=0.0,
                gbps=0.0,
                ratio=0.0,
                device_gather_gbps=0.0,
            ),
        ],
        "layerwise": [
            dict(layout="layer_first", pages=16, layer0_ms=1.0, all_ms=4.0, plain_load_ms=2.0)
        ],
    },
)
KERNELS = _doc(
    "tpu_kernels",
    {
        "limit": {"kind": "jnp.copy", "gbps": 100.0},
        "rows": [
            dict(op="gather", pages=16, impl="xla", ok=True, gbps=20.0),
            dict(op="gather", pages=16, impl="pallas window=8", ok=True, gbps=50.0),
            dict(op="gather", pages=16, impl="pallas window=16", ok=True, gbps=60.0),
            dict(op="gather", pages=16, impl="pallas broken", ok="ValueError: x", gbps=None),
        ],
    },
)
TTFT = _doc(
    "gpu_ttft",
    {"median_s": {"L1": 0.01, "L2 plain": 0.02, "L2 layer-wise": 0.04, "recompute": 0.1}},
)
SERVE = {
    "benchmark": "hicache-jax bench --engine batched",
    "env": ENV,
    "config": {},
    "summary": {"hicache": {"tokens_per_s": 300.0, "serial_tokens_per_s": 100.0}},
}


def test_each_benchmark_gives_its_figures_beside_their_limits():
    got = {f["name"]: f for f in results.figures_of(TRANSFER)}
    assert set(got) == {"transfer load 128p layer_first", "layer-wise load 16p layer_first"}
    assert got["transfer load 128p layer_first"]["ratio"] == 0.79  # the run's own median ratio
    assert got["layer-wise load 16p layer_first"]["ratio"] == 0.5  # a time: limit / value
    got = {f["name"]: f for f in results.figures_of(KERNELS)}
    assert got["page gather 16p pallas (best setting)"]["value"] == 60.0
    assert got["page gather 16p xla"]["ratio"] == pytest.approx(0.2)
    got = {f["name"]: f for f in results.figures_of(TTFT)}
    assert got["TTFT prefix from L2"]["ratio"] == pytest.approx(0.5)
    assert got["TTFT recomputed"]["unit"] == "ms" and not got["TTFT recomputed"]["higher_is_better"]
    (serve,) = results.figures_of(SERVE)
    assert serve["name"] == "batched serve hicache" and serve["ratio"] == 3.0


def test_collect_makes_one_document_and_lists_what_it_skips():
    doc = results.collect([TRANSFER, KERNELS, TTFT, SERVE, _doc("bench_pool", {})])
    assert doc["schema"] == results.SCHEMA and doc["env"] == ENV
    assert len(doc["figures"]) == 2 + 2 + 3 + 1  # kernels: the best Pallas setting, XLA
    assert doc["skipped"] == ["bench_pool"]
    assert results.as_results(doc) is doc
    assert results.as_results(TTFT)["figures"] == results.figures_of(TTFT)
    assert results.median_ratio(doc) > 0
    assert math.isnan(results.median_ratio({"figures": []}))


def test_bad_documents_raise_naming_the_problem():
    with pytest.raises(ValueError, match="'benchmark'"):
        results.figures_of({"rows": []})
    with pytest.raises(ValueError, match="bench_pool"):
        results.figures_of(_doc("bench_pool", {}))
    with pytest.raises(ValueError, match="no benchmark"):
        results.collect([])


@pytest.mark.parametrize("name", ["results_cpu_1dev.json", "results_cpu_2dev.json"])
def test_the_recorded_cpu_runs_follow_the_schema(name):
    doc = json.loads((DATA / name).read_text())
    assert doc["schema"] == results.SCHEMA and doc["env"]["backend"] == "cpu"
    sources = {f["source"] for f in doc["figures"]}
    assert sources == {
        "gpu_transfer",
        "gpu_kernels",
        "gpu_ttft",
        "hicache-jax bench --engine batched",
    }
    for f in doc["figures"]:
        assert set(f) == {
            "name",
            "unit",
            "value",
            "limit_name",
            "limit",
            "ratio",
            "higher_is_better",
            "source",
        }


def test_a_script_without_an_adapter_gives_every_number_by_its_path():
    doc = _doc(
        "bench_pool",
        {
            "rows": [{"pages": 8, "impl": "xla", "ok": True, "gbps": 2.5, "err": None}],
            "samples_s": [0.1] * (results.SAMPLES_MAX + 1),  # raw samples: left out
            "few": [1, 2],
            "inf": float("inf"),
        },
    )
    got = {f["name"]: f for f in results.figures_of(doc)}
    assert set(got) == {
        "results.rows[0].pages",
        "results.rows[0].gbps",
        "results.few[0]",
        "results.few[1]",
    }
    f = got["results.rows[0].gbps"]
    assert (f["value"], f["limit"], f["limit_name"], f["ratio"]) == (2.5, None, None, None)
    assert f["source"] == "bench_pool"
    assert math.isnan(results.median_ratio(results.collect([doc])))  # no figure with a limit


def test_a_document_its_adapter_cannot_read_raises_naming_the_writer():
    bad = {"benchmark": "hicache-jax replay", "results": [{"write_policy": "lru"}]}
    with pytest.raises(ValueError, match="'hicache-jax replay': not the document"):
        results.figures_of(bad)
    assert results.collect([bad, TTFT])["skipped"] == ["hicache-jax replay"]


def test_a_figure_with_an_interval_and_one_without_a_limit():
    f = results.figure(
        "x", "x", 0.5, "equal", 1.0, "s", higher_is_better=False, interval=(0.4, 0.6)
    )
    assert f["ratio"] == 2.0 and f["interval"] == [0.4, 0.6]
    g = results.figure("y", "MiB", 3.0, None, None, "s", higher_is_better=False)
    assert g["ratio"] is None and "interval" not in g
