"""Smoke tests of benchmarks/bench_policies.py and bench_memory.py on the shipped trace slice:
each runs, prints its figures beside their targets, and writes JSON."""

from __future__ import annotations

import json
import pathlib
import sys

DATA = pathlib.Path(__file__).parent / "data" / "mooncake_synthetic_300.jsonl"


def test_bench_policies_runs_on_the_slice(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_policies

    out = tmp_path / "p.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_policies",
            str(DATA),
            "--l1-tokens",
            "2e5",
            "--repeats",
            "2",
            "--reserve",
            "4",
            "--json",
            str(out),
        ],
    )
    bench_policies.main()
    text = capsys.readouterr().out
    rows = {line.split()[0] for line in text.splitlines() if line.strip()}
    assert {
        "write_through",
        "write_through_selective",
        "write_back",
        "clean_ahead",
        "clean_ahead(4)",
    } <= rows
    assert "target every replay identical across runs: met" in text
    data = json.loads(out.read_text())["results"]
    assert all(data[p]["deterministic"] for p in ("write_through", "clean_ahead"))
    refs = data["references"]
    assert int(refs["None"]) >= data["clean_ahead"]["hit_tokens"] > 0
    assert data["clean_ahead(4)"]["eviction_backup_pages"] >= 0


def test_bench_memory_runs_on_the_slice(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_memory

    out = tmp_path / "m.json"
    monkeypatch.setattr(
        sys, "argv", ["bench_memory", str(DATA), "--limit", "50", "--json", str(out)]
    )
    bench_memory.main()
    assert "target peak growth <= pools + 200 MB:" in capsys.readouterr().out
    data = json.loads(out.read_text())["results"]
    assert data["off"]["requests"] == data["queue"]["requests"] == 50
    assert data["off"]["peak_rss"] >= data["off"]["base_rss"] > 0
