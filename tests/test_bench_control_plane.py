"""Smoke test of benchmarks/bench_control_plane.py on a few requests of the shipped slice: it runs
the worker subprocesses, prints every phase and the hit figures, and writes JSON (the comparison
with the base commit needs that commit's history: left to the benchmark's own runs)."""

from __future__ import annotations

import json
import sys


def test_bench_control_plane_runs_on_the_slice(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_control_plane
    out = tmp_path / "cp.json"
    monkeypatch.setattr(sys, "argv", ["bench_control_plane", "--limit", "40", "--device-tokens",
                                      "2e5", "--repeats", "1", "--no-base", "--json", str(out)])
    bench_control_plane.main()
    text = capsys.readouterr().out
    assert "match us" in text and "evict us" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["tier"] for r in rows} == {"L1", "L1+L2"}
    for r in rows:
        cur = r["current"]
        assert cur["deterministic"] and cur["requests_per_s"] > 0
        assert cur["us_per_request"]["evict"] is not None
    l1 = next(r for r in rows if r["tier"] == "L1" and r["events"] == "off")["current"]
    l2 = next(r for r in rows if r["tier"] == "L1+L2" and r["events"] == "off")["current"]
    assert l1["host_hit_tokens"] == 0 and l2["device_hit_tokens"] == l1["device_hit_tokens"]
