"""Smoke test of benchmarks/bench_control_plane.py on a few requests of the shipped slice: it runs
the worker subprocesses, prints every phase and the hit figures, and writes JSON (the comparison
with the base commit needs that commit's history: left to the benchmark's own runs)."""

from __future__ import annotations

import json
import sys


def test_bench_control_plane_runs_on_the_slice(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_control_plane

    out = tmp_path / "cp.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_control_plane",
            "--limit",
            "40",
            "--device-tokens",
            "2e5",
            "--repeats",
            "1",
            "--inner",
            "2",
            "--no-base",
            "--flows",
            "--json",
            str(out),
        ],
    )
    bench_control_plane.main()
    text = capsys.readouterr().out
    # the handle's phases, the primitives' (--flows), and the handle judged against them
    assert "begin us" in text and "match us" in text and "evict us" in text
    assert "the handle at" in text and "the primitives' requests/s" in text
    rows = json.loads(out.read_text())["rows"]
    assert {r["tier"] for r in rows} == {"L1", "L1+L2"}
    for r in rows:
        cur = r["current"]
        assert cur["deterministic"] and cur["requests_per_s"] > 0
        assert cur["us_per_request"]["evict"] is not None
    l1 = next(r for r in rows if r["tier"] == "L1" and r["events"] == "off")["current"]
    l2 = next(r for r in rows if r["tier"] == "L1+L2" and r["events"] == "off")["current"]
    assert l1["host_hit_tokens"] == 0 and l2["device_hit_tokens"] == l1["device_hit_tokens"]
    for r in rows:  # the same calls through the handle and the primitives: the same figures
        if r["events"] == "off":
            assert r["primitives"]["flow"] == "primitives" and r["current"]["flow"] == "handle"
            assert all(
                r["primitives"][k] == r["current"][k] for k in bench_control_plane.HIT_FIGURES
            )


def test_bench_control_plane_sweep_runs_on_the_slice(tmp_path, monkeypatch, capsys):
    """The sweep mode: every L1 x L2 point replayed (warm-up untimed), one row each, JSON."""
    from benchmarks import bench_control_plane

    out = tmp_path / "sweep.json"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench_control_plane",
            "--limit",
            "100",
            "--capacities",
            "1e5,2e5",
            "--host-ratios",
            "2,4",
            "--repeats",
            "1",
            "--warmup",
            "5",
            "--no-base",
            "--json",
            str(out),
        ],
    )
    bench_control_plane.main()
    text = capsys.readouterr().out
    assert "current req/s" in text and "sweep of 4 points" in text
    rows = json.loads(out.read_text())["results"]
    assert [(r["device_pages"], r["host_pages"]) for r in rows] == [
        (195, 390),
        (195, 780),
        (390, 780),
        (390, 1560),
    ]
    for r in rows:
        cur = r["current"]
        assert cur["requests_per_s"] > 0 and cur["deterministic"]
        assert cur["device_hit_tokens"] > 0 and cur["evicted_pages"] > 0
