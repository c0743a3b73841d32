"""`hicache-jax compare A.json B.json`: two recorded CPU runs side by side
(hicache_jax/cli/compare.py)."""

import json
import pathlib

import pytest

from hicache_jax.cli import compare
from hicache_jax.cli.main import main

DATA = pathlib.Path(__file__).parent / "data"
A, B = str(DATA / "results_cpu_1dev.json"), str(DATA / "results_cpu_2dev.json")


def test_rows_pair_figures_by_name_with_b_over_a():
    a, b = compare.load(A), compare.load(B)
    rows = compare.rows(a, b)
    assert len(rows) == len(a["figures"])  # the two runs of the same scripts: the same figures
    row = next(r for r in rows if r["name"] == "TTFT recomputed")
    assert row["unit"] == "ms"
    assert row["b_over_a"] == pytest.approx(row["b"]["value"] / row["a"]["value"])
    only_b = dict(b, figures=b["figures"] + [dict(b["figures"][0], name="extra")])
    assert compare.rows(a, only_b)[-1]["a"] is None
    assert compare.rows(a, only_b)[-1]["b_over_a"] is None


def test_compare_command_prints_one_table_and_plots(tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert main(["compare", A, B, "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("A: cpu cpu x1, jax 0.10.2") and "\nB: cpu cpu x2, jax 0.10.2" in out
    header = next(line for line in out.splitlines() if line.startswith("figure"))
    assert header.split() == [
        "figure",
        "unit",
        "A",
        "A",
        "limit",
        "A/limit",
        "B",
        "B",
        "limit",
        "B/limit",
        "B/A",
    ]
    for name in (
        "transfer load 128p layer_first",
        "page scatter 3p xla",
        "TTFT prefix from L2",
        "batched serve hicache",
    ):
        assert name in out
    assert png.stat().st_size > 10_000


def test_a_single_script_json_is_compared_directly(tmp_path, capsys):
    doc = {
        "benchmark": "gpu_ttft",
        "env": {"backend": "tpu", "device_kind": "TPU v5 lite"},
        "config": {},
        "results": {"median_s": {"L1": 0.01, "L2 plain": 0.02, "recompute": 0.1}},
    }
    path = tmp_path / "ttft.json"
    path.write_text(json.dumps(doc))
    assert main(["compare", A, str(path)]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("TTFT prefix from L2 "))
    assert line.split()[-2] == "0.5"  # B's share of its limit: 10 ms / 20 ms


def test_bad_files_exit_2_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    for args in ([A, str(bad)], [A, str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit) as e:
            main(["compare", *args])
        assert e.value.code == 2
    assert "bad.json: not JSON" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"benchmark": "bench_pool", "results": {}}))
    with pytest.raises(SystemExit):
        main(["compare", str(other), str(other)])
    assert "neither file has a figure" in capsys.readouterr().err
