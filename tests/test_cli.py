"""`hicache-jax bench` end to end on a tiny model: table, identical-output check, JSON, flags."""

import json
import runpy
import sys

import numpy as np
import pytest

from hicache_jax.cli import bench
from hicache_jax.cli.main import main
from storage_servers import free_port, mooncake_skip_reason

# The model and pool of test_engine.py (page 16, 64 device pages, chunk 64): compiles are shared.
TINY = [
    "--quiet",
    "--no-warmup",
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
    "--page-size",
    "16",
    "--device-pages",
    "64",
    "--chunk-size",
    "64",
]


def test_bench_table_identical_outputs_and_json(tmp_path, capsys):
    path = tmp_path / "out" / "bench.json"
    # write_through: backs up at insert, so L2 sees traffic even in a workload this small (the
    # default, clean_ahead, copies only once L1 is near full).
    assert main(["bench", *TINY, "--policy", "write_through", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "outputs identical across configurations: yes" in out
    for header in (
        "prompt tok",
        "recomputed",
        "L1 hit",
        "L2 hit",
        "TTFT p50 ms",
        "TTFT p90 ms",
        "tok/s",
        "MB to host",
        "MB to device",
    ):
        assert header in out
    assert "L3" not in out  # no --storage: no L3 columns
    data = json.loads(path.read_text())
    assert data["outputs_identical"] is True
    assert set(data["summary"]) == {"no cache", "device radix", "hicache"}
    none, radix, hi = (data["summary"][k] for k in ("no cache", "device radix", "hicache"))
    assert none["recomputed_tokens"] == none["prompt_tokens"] > 0
    assert none["l1_hit_tokens"] == none["bytes_to_host"] == 0
    assert radix["l1_hit_tokens"] > 0 and radix["bytes_to_host"] == 0
    assert hi["recomputed_tokens"] <= radix["recomputed_tokens"]
    assert hi["bytes_to_host"] > 0  # write_through backs pages up at insert
    assert len(data["requests"]["hicache"]) == 9
    assert data["config"]["no_overlap"] is False  # the batched engine overlaps by default
    assert data["env"]["backend"] == "cpu"
    # device radix and hicache: 5 paired repeats by default; the verdict line and its figures
    assert data["config"]["repeats"] == 5 and data["config"]["load_policy"] == "threshold"
    p = data["paired_ttft"]
    assert (p["a"], p["b"], p["repeats"], p["requests"]) == ("device radix", "hicache", 5, 9)
    assert p["low"] <= p["median"] <= p["high"] and len(p["per_repeat_median"]) == 5
    (verdict,) = [line for line in out.splitlines() if line.startswith("verdict: ")]
    assert verdict == data["verdict"]
    assert f"hicache recomputes {hi['recomputed_tokens']:,} tokens vs " in verdict
    assert f"{p['median']:.2f}x [{p['low']:.2f}-{p['high']:.2f}]" in verdict
    for name in ("device radix", "hicache"):
        s = data["summary"][name]
        assert len(s["ttft_p50_ms_runs"]) == 5
        assert s["ttft_p50_ms"] == pytest.approx(np.median(s["ttft_p50_ms_runs"]))
        assert "recomputed_tokens_runs" not in s  # the same in every repeat (threshold policy)
        reqs = data["requests"][name]
        assert all(len(r["ttft_s_repeats"]) == 5 for r in reqs)
        assert [r["ttft_s"] for r in reqs] == [r["ttft_s_repeats"][0] for r in reqs]
    times = {
        n: np.array([r["ttft_s_repeats"] for r in data["requests"][n]])
        for n in ("device radix", "hicache")
    }
    assert p["median"] == pytest.approx(np.median(times["hicache"] / times["device radix"]))
    assert "ttft_s_repeats" not in data["requests"]["no cache"][0]  # timed once


def test_bench_load_policy_cost_serial_and_batched(tmp_path, capsys):
    path = tmp_path / "cost.json"
    flags = [*TINY, "--policy", "write_through", "--load-policy", "cost", "--repeats", "2"]
    assert main(["bench", *flags, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "load policy cost" in out and "verdict: " in out
    data = json.loads(path.read_text())
    assert data["config"]["load_policy"] == "cost" and data["paired_ttft"]["repeats"] == 2
    assert main(["bench", *flags, *BATCHED, "--json", str(path)]) == 0
    assert "load policy cost; batched engine" in capsys.readouterr().out
    assert json.loads(path.read_text())["config"]["load_policy"] == "cost"


def test_plot_without_matplotlib_exits_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    path = tmp_path / "p.png"
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--plot", str(path)])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "--plot needs matplotlib: pip install" in err
    assert not path.exists() and "workload" not in out  # nothing ran


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason='--plot needs matplotlib: pip install -e ".[plot]"')
    path = tmp_path / "p.png"
    assert main(["bench", *TINY, "--workload", "docqa", "--plot", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_storage_mooncake_not_installed_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # as if not installed
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--storage", f"mooncake://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert "pip install mooncake-transfer-engine-non-cuda" in err and "libibverbs1" in err


@pytest.mark.skipif(mooncake_skip_reason() is not None, reason=str(mooncake_skip_reason()))
def test_storage_unreachable_mooncake_names_the_address(capsys):
    addr = f"127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, "--storage", f"mooncake://{addr}?setup_timeout_s=1"])
    assert exc.value.code == 2 and addr in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--workload", "nope"],
        ["bench", "--policy", "x"],
        ["bench", "--sessions", "two"],
        ["bench", "--load-policy", "never"],
        [],
    ],
)
def test_bad_flags_exit_with_usage(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--sessions", "0"], "num_clients=0"),
        (["--heads", "3", "--kv-heads", "2"], "multiple of num_kv_heads"),
        (["--chunk-size", "48"], "power of two"),
        (["--page-size", "0"], "page_size=0"),
        (["--weights", "/nonexistent.npz"], "does not exist"),
        (["--device-pages", "3"], "cannot hold the longest request"),
        (["--device-pages", "0"], "--device-pages 0"),
        (["--host-ratio", "inf"], "--host-ratio"),
        (["--host-ratio", "nan"], "--host-ratio"),
        (["--vocab", "1"], "--vocab"),
        (["--seed", "-1"], "--seed"),
        (["--json", "/proc/nope/x.json"], "--json"),
        (["--repeats", "0"], "--repeats 0 must be >= 1"),
        (["--layer-pattern", "1:1"], "window"),  # local layers need --window or --chunk
        (["--layer-pattern", "1:1", "--window", "0"], "window=0"),
        (["--layer-pattern", "9"], "layer_pattern"),
        (["--layer-pattern", "R1:F1", "--window", "8"], "keeps a state, not a window"),
        (["--layer-pattern", "R2:S1:F1", "--layers", "4"], "has local layers: give window="),
        (["--layer-pattern", "R2:S1:F1", "--window", "8"], "leaves no full-attention layer"),
        (["--layer-pattern", "R2:R1:F1", "--window", "8"], "pattern='R2:R1:F1' must be"),
        (
            ["--layer-pattern", "R1:F1", "--tensor-parallel", "--heads", "6", "--kv-heads", "2"],
            "not divisible",
        ),
    ],
)
def test_bad_sizes_are_usage_errors(flags, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, *flags])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    "pattern, layers", [("5:1", 6), ("R3:F1", 4), ("R2:S1:F1", 4), ("s1:f1:r2", 4), ("", 0)]
)
def test_layers_default_to_one_period(pattern, layers):
    assert bench._pattern_period(pattern) == layers


@pytest.mark.parametrize(
    "page_size,bucket", [(1, 32), (16, 32), (24, 16), (48, 8), (64, 8), (300, 1), (1024, 1)]
)
def test_table_bucket_is_a_power_of_two_for_any_page_size(page_size, bucket):
    # --page-size 24 used to crash the engine
    assert bench.table_bucket(page_size) == bucket


def test_python_dash_m_entry_point(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["hicache_jax", "bench", "--help"])
    with pytest.raises(SystemExit) as exc:
        runpy.run_module("hicache_jax", run_name="__main__")
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--workload" in out and "--plot" in out


BATCHED = ["--engine", "batched", "--token-budget", "64", "--query-block", "32"]


def test_batched_bench_matches_serial_and_writes_json(tmp_path, capsys):
    path = tmp_path / "batched.json"
    assert main(["bench", *TINY, *BATCHED, "--policy", "write_through", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "outputs identical to the serial engine" in out and ": yes;" in out
    assert "pages leaked or locked after the drain: 0" in out
    for header in (
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "prompt tok/s",
        "gen tok/s",
        "x serial",
        "retract",
        "MB to device",
    ):
        assert header in out
    data = json.loads(path.read_text())
    assert data["benchmark"] == "hicache-jax bench --engine batched"
    assert data["env"]["backend"] == "cpu" and data["outputs_identical"] is True
    hi = data["summary"]["hicache"]
    assert hi["tokens_identical"] and hi["first_logits_max_abs_diff"] <= 1e-5
    assert hi["requests"] == 9 and hi["bytes_to_host"] > 0
    assert data["summary"]["no cache"]["recomputed_tokens"] == hi["prompt_tokens"]
    assert len(data["requests"]["hicache"]) == 9
    assert data["config"]["no_overlap"] is False  # the batched engine overlaps by default


def test_batched_bench_runs_the_configurations_in_rounds(tmp_path, capsys):
    """Each round runs every configuration, so the ones compared with each other (hicache /
    radix TTFT) meet the same machine load; times are medians over the rounds."""
    path = tmp_path / "rounds.json"
    loud = [a for a in TINY if a != "--quiet"]
    assert main(["bench", *loud, *BATCHED, "--repeats", "2", "--json", str(path)]) == 0
    out, err = capsys.readouterr()
    err = [line for line in err.splitlines() if "(1/2)" in line or "(2/2)" in line]
    order = [line.split(": ")[0] + (" 2" if "(2/2)" in line else " 1") for line in err]
    names = ["no cache", "device radix", "hicache"]
    want = [f"{n} {r}" for r in "12" for n in names for _ in ("serial", "batched")]
    assert order == want
    runs = json.loads(path.read_text())["summary"]["hicache"]
    assert len(runs["ttft_p50_ms_runs"]) == len(runs["wall_s_runs"]) == 2
    assert runs["ttft_p50_ms"] == float(np.median(runs["ttft_p50_ms_runs"]))
    radix = json.loads(path.read_text())["summary"]["device radix"]["ttft_p50_ms_runs"]
    rounds = ", ".join(f"{h / d:.2f}" for h, d in zip(runs["ttft_p50_ms_runs"], radix))
    assert f"(per round: {rounds})" in out


def test_batched_bench_poisson_and_plot(tmp_path):
    pytest.importorskip("matplotlib", reason='--plot needs matplotlib: pip install -e ".[plot]"')
    path = tmp_path / "ttft.png"
    assert (
        main(
            [
                "bench",
                *TINY,
                *BATCHED,
                "--arrivals",
                "poisson",
                "--rate",
                "200",
                "--no-overlap",
                "--plot",
                str(path),
            ]
        )
        == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "flags,match",
    [
        (["--arrivals", "poisson"], "needs --rate"),
        (["--arrivals", "trace"], "needs --trace"),
        (["--trace", "x.jsonl"], "only used with --arrivals trace"),
        (["--token-budget", "48"], "--token-budget 48 must be a power of two"),
        (["--key-block", "0"], "--key-block 0 must be a power of two"),
        (["--query-block", "0"], "--query-block 0"),
        (["--decode-reserve", "2"], "--decode-reserve"),
        (["--max-running", "0"], "--max-running 0"),
        (["--repeats", "0"], "--repeats 0"),
        (["--warmup-passes", "0"], "--warmup-passes 0"),
        (["--storage", "file:///tmp/x"], "not supported with --engine batched"),
    ],
)
def test_bad_batched_flags_are_usage_errors(flags, match, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", *TINY, *BATCHED, *flags])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_gpu_serve_runs_tiny_on_cpu(capsys):
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_serve.py")
    spec = importlib.util.spec_from_file_location("gpu_serve", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([]) == 2  # not a GPU: refused without --tiny / --allow-cpu
    assert "not 'gpu'" in capsys.readouterr().err
    assert mod.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16" in out and "outputs identical to the serial engine" in out


def test_batched_bench_warmup_compiles_the_mixed_steps_it_meets(tmp_path):
    """The warm-up compiles the prefill + decode steps it meets, so a timed run (which never
    compiles) runs each as one forward; with --no-mixed-warmup it runs them as two. Either way a
    timed run compiles nothing and matches the serial engine."""
    runs = {}
    # Compiled shapes are kept per model config for the process: a vocabulary of its own, and
    # the run without mixed compiles first.
    for extra in (["--no-mixed-warmup"], []):
        path = tmp_path / f"warm{len(extra)}.json"
        flags = (
            [a for a in TINY if a != "--no-warmup"]
            + BATCHED
            + ["--vocab", "89", "--json", str(path)]
        )
        assert main(["bench", *flags, *extra]) == 0
        data = json.loads(path.read_text())
        assert data["config"]["mixed_warmup"] is (not extra)
        runs[bool(extra)] = data["summary"]["no cache"]  # closed loop: the warm-up's schedule
    for s in runs.values():
        assert s["compiles_in_timed_runs"] == [0] and s["tokens_identical"]
    merged, split = runs[False], runs[True]
    assert merged["steps"] == split["steps"]  # the same schedule, in fewer forwards
    assert merged["forward_calls"] < split["forward_calls"]
