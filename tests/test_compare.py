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


# The tiny model of test_cli.py (compiles shared with test_engine.py), two repeats.
TINY_BENCH = [
    "--quiet",
    "--no-warmup",
    "--repeats",
    "2",
    "--layers",
    "2",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
    "--ffn-dim",
    "48",
    "--vocab",
    "97",
    "--sessions",
    "3",
    "--turns",
    "3",
    "--base-tokens",
    "40",
    "--segment-tokens",
    "8",
    "--max-new-tokens",
    "3",
    "--device-pages",
    "64",
    "--chunk-size",
    "64",
    "--policy",
    "write_through",
]


def _table_rows(out):
    """The side-by-side table's rows by figure name: the cells after the name's two-space gap."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("figure ")) + 2
    end = lines.index("", start)
    return {line.split("  ")[0]: line.split("  ")[1:] for line in lines[start:end]}


def test_two_bench_outputs_one_with_the_cost_policy_side_by_side(tmp_path, capsys):
    a, b = tmp_path / "threshold.json", tmp_path / "cost.json"
    assert main(["bench", *TINY_BENCH, "--json", str(a)]) == 0
    assert main(["bench", *TINY_BENCH, "--load-policy", "cost", "--json", str(b)]) == 0
    capsys.readouterr()
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "settings that differ (A vs B): load_policy: 'threshold' vs 'cost'\n" in out
    rows = _table_rows(out)
    da, db = json.loads(a.read_text()), json.loads(b.read_text())
    for config in ("no cache", "device radix", "hicache"):
        for figure in ("TTFT p50", "TTFT p90", "tokens/s", "tokens recomputed", "hit tokens"):
            assert f"{figure} {config}" in rows
        for figure in ("MiB to host", "MiB to device"):  # no limit: '-' in the limit columns
            cells = [c.strip() for c in rows[f"{figure} {config}"] if c.strip()]
            assert cells[2:4] == ["-", "-"] and cells[5:7] == ["-", "-"]
    recomputed = [c.strip() for c in rows["tokens recomputed hicache"] if c.strip()]
    sa, sb = da["summary"]["hicache"], db["summary"]["hicache"]
    assert recomputed[:5] == [
        "tokens",
        compare._num(sa["recomputed_tokens"]),
        compare._num(sa["prompt_tokens"]),  # its limit: every prompt token recomputed
        compare._num(sa["prompt_tokens"] / sa["recomputed_tokens"]),
        compare._num(sb["recomputed_tokens"]),
    ]
    paired = next(n for n in rows if n.startswith("paired TTFT ratio"))
    assert paired == "paired TTFT ratio hicache/device radix"
    p = da["paired_ttft"]
    assert f"{p['median']:.3g} [{p['low']:.3g}-{p['high']:.3g}]" in "  ".join(rows[paired])
    assert "figures in both: 22\nonly in A (0): none\nonly in B (0): none" in out


def _replay(tmp_path, name, *flags):
    path = tmp_path / name
    trace = str(DATA / "mooncake_synthetic_300.jsonl")
    assert main(["replay", trace, "--quiet", "--limit", "60", *flags, "--json", str(path)]) == 0
    return str(path)


def test_two_replay_outputs_and_what_only_one_has(tmp_path, capsys):
    a = _replay(tmp_path, "a.json", "--policy", "clean_ahead,write_back")
    b = _replay(tmp_path, "b.json", "--policy", "clean_ahead")
    capsys.readouterr()
    assert main(["compare", a, b]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    (shared,) = [n for n in rows if n.startswith("hit ratio clean_ahead/lru")]
    cells = [c.strip() for c in rows[shared] if c.strip()]
    assert cells[-1] == "1"  # the same trace and configuration: the same hit ratio
    only_a = [n for n in rows if "write_back" in n]
    assert len(only_a) == 4 and all(rows[n][-1].strip() == "-" for n in only_a)
    assert f"only in A (4): {'; '.join(only_a)}\nonly in B (0): none" in out
    assert "settings that differ (A vs B): policy: 'clean_ahead,write_back' vs 'clean_ahead'" in out


def test_a_script_json_without_an_adapter_is_compared_by_its_numbers(tmp_path, capsys):
    def doc(gbps, extra):
        return {
            "benchmark": "bench_pool",
            "env": {"backend": "cpu"},
            "config": {},
            "results": {"rows": [{"pages": 8, "gbps": gbps, "impl": "xla"}], **extra},
        }

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(doc(2.0, {"samples_s": [0.1] * 50})))
    b.write_text(json.dumps(doc(3.0, {"memcpy_gbps": 9.0})))
    assert main(["compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    rows = _table_rows(out)
    assert set(rows) == {"results.rows[0].pages", "results.rows[0].gbps", "results.memcpy_gbps"}
    assert rows["results.rows[0].gbps"][-1].strip() == "1.5"
    assert "only in A (0): none\nonly in B (1): results.memcpy_gbps" in out
