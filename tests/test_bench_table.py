"""hicache_jax.cli.bench_table: ``hicache-jax bench`` as a table, the command's own figures."""

import json
import sys

import pytest

from hicache_jax.cli import bench, bench_table
from hicache_jax.cli.main import main

# test_cli.py's tiny model and workload (compiles shared within a run)
FLAGS = dict(
    no_warmup=True,
    layers=2,
    d_model=32,
    heads=4,
    kv_heads=2,
    head_dim=8,
    ffn_dim=48,
    vocab=97,
    sessions=3,
    turns=3,
    base_tokens=40,
    segment_tokens=8,
    max_new_tokens=3,
    page_size=16,
    device_pages=64,
    chunk_size=64,
)


def test_argv_of_keyword_flags():
    assert bench_table.bench_argv(
        dict(sessions=2, no_warmup=True, no_overlap=False, weights=None, host_ratio=2.5)
    ) == ["--sessions", "2", "--no-warmup", "--host-ratio", "2.5"]
    with pytest.raises(TypeError, match="json= is set by bench_table"):
        bench_table.bench_argv(dict(json="x.json"))


def test_table_holds_the_commands_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pandas", None)  # records, whatever is installed
    recs = bench_table.bench_table(policy="write_through", **FLAGS)
    assert capsys.readouterr().out == ""  # quiet: nothing printed
    assert [r["config"] for r in recs] == [name for name, _ in bench.CONFIGS]
    assert all(r["outputs_identical"] for r in recs)
    none, radix, hi = recs
    assert none["hit_ratio"] == 0.0 and none["recomputed_tokens"] == none["prompt_tokens"]
    assert hi["hit_ratio"] >= radix["hit_ratio"] > 0
    assert hi["hit_ratio"] == (hi["l1_hit_tokens"] + hi["l2_hit_tokens"]) / hi["prompt_tokens"]
    path = tmp_path / "bench.json"  # the command itself: the same counts (times differ)
    assert (
        main(
            [
                "bench",
                *bench_table.bench_argv(FLAGS),
                "--policy",
                "write_through",
                "--quiet",
                "--json",
                str(path),
            ]
        )
        == 0
    )
    summary = json.loads(path.read_text())["summary"]
    for r in recs:
        s = summary[r["config"]]
        for key in (
            "prompt_tokens",
            "recomputed_tokens",
            "l1_hit_tokens",
            "l2_hit_tokens",
            "bytes_to_host",
            "bytes_to_device",
        ):
            assert r[key] == s[key]


@pytest.mark.parametrize(
    "flags, match",
    [(dict(sessions=0), "num_clients=0"), (dict(frobs=1), "unrecognized arguments: --frobs 1")],
)
def test_refused_flags_are_value_errors(flags, match):
    with pytest.raises(ValueError, match=match):
        bench_table.bench_table(**flags)
