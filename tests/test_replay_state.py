"""Replay of a hybrid recurrent model (hicache_jax.replay.states, ``hicache-jax replay
--layer-pattern R3:F1``): the spec's checkpoint costs what it is asked to, the pools never
exceed the bytes, the replay writes checkpoints and hits, it reports the state bytes' share and
the every-page oracle (an exact LRU of the same bytes), the simulator and the notebook API take
the pattern, and bad flags name themselves."""

from __future__ import annotations

import json

import pytest

from hicache_jax import study
from hicache_jax.cli.main import main
from hicache_jax.replay import driver, simulate
from hicache_jax.replay import states as S
from hicache_jax.replay.trace import load_trace

PS = 16


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    """A tiny Mooncake trace of 16-token blocks: a shared system prompt, conversations that
    grow turn by turn, and branches off the middle of earlier prompts (where no checkpoint
    is until the first request diverging there writes one)."""
    rows = []
    system = list(range(6))
    for conv in range(6):
        own = [100 + 10 * conv + i for i in range(8)]
        for turn in range(1, 4):
            rows.append(system + own[: 2 + 3 * turn])
        rows.append(system + own[:3] + [900 + conv, 901 + conv])  # a branch mid-node
    path = tmp_path_factory.mktemp("trace") / "tiny.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {"timestamp": i, "input_length": PS * len(h), "output_length": 1, "hash_ids": h}
            )
            + "\n"
            for i, h in enumerate(rows)
        )
    )
    return path


@pytest.fixture(scope="module")
def trace(trace_path):
    return load_trace(trace_path, block_size=PS)


@pytest.fixture(scope="module")
def spec():
    return S.state_spec("R3:F1", PS, state_tokens=24)  # a checkpoint: 1.5 pages' bytes


def test_qwen3_next_ratio():
    # 36 x (3 x 8192 x 2 + 32 x 128 x 128 x 4) over 12 x 2 x 2 x 256 x 2 bytes a token
    assert S.qwen3_next_state_tokens() == pytest.approx(3144.0)


def test_state_spec_costs_what_it_is_asked(spec):
    assert [len(g.layers) for g in spec.groups] == [3, 1] or spec.state_groups == (0,)
    assert spec.page_bytes == PS * 8
    assert S.slot_bytes(spec) == 24 * 8  # 3 layers x 16 words of float32
    big = S.state_spec("R3:F1", 512)
    assert S.slot_bytes(big) / big.page_bytes == pytest.approx(3144 / 512, rel=1e-3)


@pytest.mark.parametrize("share", [None, 0.1, 0.5])
@pytest.mark.parametrize("k", [0, 2])
def test_pools_never_exceed_the_bytes(spec, share, k):
    p = S.pools_for(spec, 40, 4.0, share=share, longest_tokens=200, mean_tokens=90,
                    checkpoint_every=k)  # fmt: skip
    sb = S.slot_bytes(spec)
    for pages, slots, model in (
        (p.device_pages, p.state_device_slots, p.model_device_pages),
        (p.host_pages, p.state_host_slots, p.model_host_pages),
    ):
        assert pages >= 1 and slots >= 1
        assert pages * spec.page_bytes + slots * sb <= model * spec.page_bytes
    assert 0 < p.share < 1 and p.checkpoint_every == k


def test_auto_interval_spreads_the_slots_over_the_pages(spec):
    kw = dict(share=None, longest_tokens=200, mean_tokens=90)
    base = S.pools_for(spec, 40, 4.0, **kw)
    auto = S.pools_for(spec, 40, 4.0, checkpoint_every="auto", **kw)
    pages = base.device_pages + base.host_pages
    slots = base.state_device_slots + base.state_host_slots
    assert auto.checkpoint_every == -(-pages // slots) >= 1
    assert S.check_interval("auto") == "auto" and S.check_interval("3") == 3
    with pytest.raises(ValueError, match="'auto'"):
        S.check_interval(-1)


def test_hybrid_replay_hits_and_reports_the_oracle(trace, spec):
    rep = driver.run(trace, spec, device_pages=[12], host_ratio=4.0, checkpoint_every=2)
    (r,) = rep["results"]
    assert r["hit_tokens"] > 0 and r["checkpoints_written"] > 0
    assert 0 < r["state_bytes_share"] < 1 and 0 < r["pools"]["share"] < 1
    assert r["oracle_hit_ratio"] == r["lru_total_hit_ratio"] > 0
    assert r["vs_oracle"] == pytest.approx(r["hit_ratio"] / r["oracle_hit_ratio"])
    assert r["hit_ratio"] <= r["oracle_hit_ratio"] + 1e-12
    assert rep["checkpoint_every"] == 2
    again = driver.run(trace, spec, device_pages=[12], host_ratio=4.0, checkpoint_every=2)
    drop = set(driver.TIMING_FIELDS)
    assert {k: v for k, v in again["results"][0].items() if k not in drop} == {
        k: v for k, v in r.items() if k not in drop
    }
    text = driver.tables(rep)
    assert "hit/oracle >= 0.95" in text and "state bytes held" in text


def test_default_interval_is_the_caches(trace, spec):
    rep = driver.run(trace, spec, device_pages=[12], host_ratio=4.0)
    (r,) = rep["results"]
    assert r["checkpoint_rule"] == "default" and r["checkpoint_every"] == S.default_interval(spec)
    assert r["pools"]["checkpoint_every"] is None and r["hit_tokens"] > 0


def test_plain_replay_refuses_state_settings(trace):
    with pytest.raises(ValueError, match="state group"):
        driver.run(trace, driver.TINY_SPEC, device_pages=[12], checkpoint_every=2)


def test_simulate_and_study_take_the_pattern(trace, spec):
    regime = simulate.Regime(l2_gbps=25.0, prefill_tokens_per_s=2e4, token_bytes=1 << 17)
    pools = S.pools_for(spec, 12, 4.0, share=None, longest_tokens=200, mean_tokens=90)
    rep = simulate.simulate_all(trace, spec, regime, device_pages=12, host_ratio=4, pools=pools)
    assert "cost+split" not in [r["policy"] for r in rep["results"]]
    assert rep["pools"]["state_device_slots"] == pools.state_device_slots
    res = study.sweep(trace, device_pages=12, page_size=PS, layer_pattern="R3:F1", progress=False)
    assert res.reports[0]["results"][0]["checkpoints_written"] > 0


def test_cli_hybrid_replay_prints_the_state_table(trace_path, tmp_path, capsys):
    path = tmp_path / "s.json"
    args = ["replay", str(trace_path), "--quiet", "--block-size", str(PS), "--device-pages", "12"]
    hybrid = ["--layer-pattern", "R3:F1", "--state-tokens", "24", "--checkpoint-every", "auto"]
    assert main([*args, *hybrid, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hit/oracle >= 0.95" in out and "state pool share" in out and "state layers" in out
    (r,) = json.loads(path.read_text())["results"]
    assert r["hit_tokens"] > 0 and r["checkpoint_every"] >= 1 and r["checkpoint_rule"] == "auto"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--checkpoint-every", "4"], "--checkpoint-every needs a recurrent --layer-pattern"),
        (["--state-share", "0.2"], "--state-share needs a recurrent"),
        (["--layer-pattern", "R3:F1", "--window", "8"], "--window is for a sliding-window"),
        (["--layer-pattern", "R3:F1", "--state-share", "1"], "--state-share 1"),
        (["--layer-pattern", "R0:F1"], "needs a recurrent and a full layer"),
        (["--layer-pattern", "R3:F1", "--state-tokens", "0"], "--state-tokens 0"),
        (["--layer-pattern", "R3:F1", "--checkpoint-every", "x"], "--checkpoint-every 'x'"),
    ],
)
def test_cli_bad_state_flags_exit_2(trace_path, args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_path), "--quiet", "--block-size", str(PS), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
