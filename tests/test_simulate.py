"""The what-if TTFT simulator (hicache_jax/replay/simulate.py) and ``replay --simulate``."""

import json

import pytest

from hicache_jax.cli import results
from hicache_jax.cli.main import main
from hicache_jax.replay.driver import TINY_SPEC
from hicache_jax.replay.simulate import POLICIES, Regime, simulate, simulate_all
from hicache_jax.replay.trace import load_trace
from hicache_jax.spec import KVSpec

TB = 128 * 1024  # KV bytes a token of an 8B-class model


def _trace(tmp_path, n=40, gap_ms=50):
    """Requests sharing a long prefix in turns: host and L3 hits, arrivals ``gap_ms`` apart."""
    path = tmp_path / "t.jsonl"
    with open(path, "w") as f:
        for i in range(n):
            ids = list(range(100 * (i % 4), 100 * (i % 4) + 6)) + [10_000 + i]
            f.write(
                json.dumps(
                    {
                        "timestamp": i * gap_ms,
                        "input_length": 7 * 16,
                        "output_length": 1,
                        "hash_ids": ids,
                    }
                )
                + "\n"
            )
    return load_trace(path, block_size=16)


def _run(trace, regime, seed=0):
    return simulate_all(
        trace,
        KVSpec.parse(None, TINY_SPEC, page_size=16),
        regime,
        device_pages=8,
        host_ratio=2.0,
        seed=seed,
    )


def test_a_seed_gives_identical_results_and_another_seed_other_timings(tmp_path):
    trace = _trace(tmp_path)
    rg = Regime(l2_gbps=10, l3_gbps=1, prefill_tokens_per_s=20000, token_bytes=TB)
    a, b, c = _run(trace, rg, 3), _run(trace, rg, 3), _run(trace, rg, 4)
    # Every count, hit, TTFT and fitted error figure identical, bit for bit.
    assert a.keys() == b.keys() and len(a["results"]) == len(b["results"])
    assert {k: v for k, v in a.items() if k != "results"} == {
        k: v for k, v in b.items() if k != "results"
    }
    assert a["results"] == b["results"]
    assert any(r["cost_l2_l1_pred_err_median"] is not None for r in a["results"])
    assert [r["ttft_mean_s"] for r in a["results"]] != [r["ttft_mean_s"] for r in c["results"]]
    assert [r["policy"] for r in a["results"]] == list(POLICIES)


def test_never_recomputes_always_loads_and_the_cost_policy_is_no_worse(tmp_path):
    # 100 requests: the cost policy's first L3 read is a one-page probe (the store unmeasured),
    # one request's prefix mostly recomputed; over 40 requests that alone was 2.5% of the mean
    trace = _trace(tmp_path, n=100)
    rg = Regime(l2_gbps=25, l3_gbps=100, prefill_tokens_per_s=2000, token_bytes=TB, jitter=0)
    res = {r["policy"]: r for r in _run(trace, rg)["results"]}
    assert res["never"]["l2_hit_ratio"] == res["never"]["l3_hit_ratio"] == 0
    assert res["always"]["l2_hit_ratio"] + res["always"]["l3_hit_ratio"] > 0
    assert res["always"]["ttft_mean_s"] < res["never"]["ttft_mean_s"]  # loading is far cheaper
    assert res["cost"]["ttft_mean_s"] <= 1.02 * res["always"]["ttft_mean_s"]
    for r in res.values():  # a request waits for the server: TTFT >= its own prefill share
        assert r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
        assert r["ttft_mean_s"] > 0


def test_a_slow_l3_is_recomputed_by_the_cost_policy(tmp_path):
    trace = _trace(tmp_path)
    rg = Regime(l2_gbps=25, l3_gbps=0.01, prefill_tokens_per_s=50000, token_bytes=TB, jitter=0)
    res = {r["policy"]: r for r in _run(trace, rg)["results"]}
    assert res["cost"]["l3_hit_ratio"] < res["always"]["l3_hit_ratio"]
    assert res["cost"]["ttft_mean_s"] < res["always"]["ttft_mean_s"]


def test_a_bad_regime_or_policy_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="l2_gbps"):
        Regime(l2_gbps=0, prefill_tokens_per_s=1, token_bytes=1)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        Regime(l2_gbps=1, prefill_tokens_per_s=float("nan"), token_bytes=1)
    rg = Regime(l2_gbps=1, prefill_tokens_per_s=1, token_bytes=1)
    with pytest.raises(ValueError, match="policy"):
        simulate(
            _trace(tmp_path),
            KVSpec.parse(None, TINY_SPEC, page_size=16),
            rg,
            "sometimes",
            device_pages=8,
        )


def test_replay_simulate_prints_and_writes_json(tmp_path, capsys):
    trace = _trace(tmp_path, n=12)
    out = tmp_path / "sim.json"
    assert (
        main(
            [
                "replay",
                trace.path,
                "--block-size",
                "16",
                "--simulate",
                "--l3-gbps",
                "2",
                "--device-pages",
                "8",
                "--quiet",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "threshold" in text and "p90 ms" in text
    got = json.loads(out.read_text())
    assert [r["policy"] for r in got["results"]] == list(POLICIES)
    # hicache-jax compare reads it: per policy TTFT p50 / p90 against never loading
    figs = {f["name"]: f for f in results.figures_of(got)}
    assert set(figs) == {f"simulated TTFT {q} {p}" for p in POLICIES for q in ("p50", "p90")}
    never = got["results"][0]["ttft_p50_s"] * 1e3
    assert figs["simulated TTFT p50 never"]["limit"] == pytest.approx(never)
    assert got["env"]["backend"] == "cpu"
    with pytest.raises(SystemExit):
        main(
            [
                "replay",
                trace.path,
                "--block-size",
                "16",
                "--simulate",
                "--l2-gbps",
                "-1",
                "--device-pages",
                "8",
                "--quiet",
            ]
        )


def test_results_do_not_depend_on_when_the_copies_are_seen_ready(tmp_path, monkeypatch):
    """XLA marks a copy ready on the wall clock: whether a poll finds it ready (and how often
    the cache reads its clock while it is in flight) must not move any simulated figure."""
    import hicache_jax.memory.transfer as transfer

    trace = _trace(tmp_path)
    rg = Regime(l2_gbps=10, l3_gbps=1, prefill_tokens_per_s=20000, token_bytes=TB)
    base = _run(trace, rg, 5)
    assert any(r["cost_l2_l1_pred_err_median"] for r in base["results"])

    def poll_never_ready(self, agree=True):  # a copy is seen landed only by a wait (flush)
        out, self._finished = self._finished, []
        return out

    monkeypatch.setattr(transfer.TransferEngine, "poll", poll_never_ready)
    assert _run(trace, rg, 5) == base
