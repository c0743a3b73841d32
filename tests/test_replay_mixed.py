"""Replay of a model with all three layer kinds (hicache_jax.replay.mixed, ``hicache-jax replay
--layer-pattern R2:S1:F1 --window W``): patterns pick their replay, the pools never exceed the
all-full model's bytes and give each kind what its own rule asks, the replay writes checkpoints
and hits, it reports both kinds' figures and references, the simulator and the notebook API take
the pattern, and bad flags name themselves."""

from __future__ import annotations

import json

import pytest

from hicache_jax import study
from hicache_jax.cli.main import main
from hicache_jax.replay import driver, simulate
from hicache_jax.replay import mixed as M
from hicache_jax.replay import states as S
from hicache_jax.replay import windows as W
from hicache_jax.replay.trace import load_trace

PS = 16


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    """A tiny Mooncake trace of 16-token blocks: a shared system prompt, conversations that
    grow turn by turn, and branches off the middle of earlier prompts."""
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
    # 2 recurrent, 1 sliding-window (2 pages), 1 full layer; a checkpoint 1.5 full pages' bytes
    return S.state_spec("R2:S1:F1", PS, state_tokens=24, window=2 * PS)


@pytest.mark.parametrize(
    "pattern, kind",
    [("5:1", "window"), ("S5:F1", "window"), ("R3:F1", "state"), ("R2:S1:F1", "mixed")],
)
def test_pattern_kind_picks_the_replay(pattern, kind):
    assert W.pattern_kind(pattern) == kind
    assert S.is_state_pattern(pattern) == (kind == "state")


def test_letter_patterns_are_the_two_kind_specs():
    assert W.pattern_spec("S5:F1", 64, PS) == W.pattern_spec("5:1", 64, PS)
    assert S.state_spec("r3:f1", PS, 24) == S.state_spec("R3:F1", PS, 24)


def test_mixed_spec_has_three_groups(spec):
    assert sorted(g.kind.value for g in spec.groups) == ["full", "state", "window"]
    assert spec.model_page_bytes == 2 * spec.page_bytes  # the full and the window layer
    assert S.slot_bytes(spec) == 24 * 8  # 2 layers x 24 words of float32
    assert W.window_page_bytes(spec) == spec.page_bytes  # the STATE group's slots not in it


@pytest.mark.parametrize("wshare, sshare", [(None, None), (0.2, None), (None, 0.3), (0.2, 0.3)])
@pytest.mark.parametrize("k", [None, 0, 2, "auto"])
def test_pools_never_exceed_the_bytes(spec, wshare, sshare, k):
    kw = dict(longest_tokens=200, mean_tokens=90, checkpoint_every=k)
    p = M.pools_for(spec, 40, 4.0, window_share=wshare, state_share=sshare, **kw)
    l1, l2 = p.bytes_used(spec)
    assert l1 <= 40 * spec.model_page_bytes and l2 <= 160 * spec.model_page_bytes
    for pages, win, slots in (
        (p.device_pages, p.window_device_pages, p.state_device_slots),
        (p.host_pages, p.window_host_pages, p.state_host_slots),
    ):
        assert 1 <= win <= pages and 1 <= slots <= pages
    assert 0 < p.share < 1 and 0 < p.device_share < 1
    if wshare is not None:
        assert p.device_share <= wshare and p.host_share <= wshare
    if sshare is not None:
        assert p.state_device_share <= sshare and p.state_host_share <= sshare
    if k == "auto":
        assert isinstance(p.checkpoint_every, int) and p.checkpoint_every >= 1
    else:
        assert p.checkpoint_every == k


def test_default_rule_asks_each_kind_what_its_own_rule_asks(spec):
    # both demands solved together over the same full-attention pool (per tier: L2 has no
    # request's own pages or checkpoints, so each kind asks a rate of N_f only)
    p = M.pools_for(
        spec, 400, 1.0, window_share=None, state_share=None, longest_tokens=0, mean_tokens=64
    )
    k = 2  # window 32 tokens: 2 pages of tail; a mean prompt of 4 pages
    # (each rounded up from the exact solution, whose N_f the pool rounds down)
    assert 0 <= p.window_host_pages - k * p.host_pages / 4 <= k / 4 + 1
    # two slots a mean prompt (with window groups the cache checkpoints every 2,048 tokens
    # by default: an end and a branch point a prompt)
    assert 0 <= p.state_host_slots - 2 * p.host_pages / 4 <= 2 / 4 + 1
    l2 = p.host_pages * spec.page_bytes + p.window_host_pages * spec.page_bytes
    l2 += p.state_host_slots * S.slot_bytes(spec)
    # the rest of the budget is less than what one more page with its share costs
    assert 0 <= 400 * spec.model_page_bytes - l2 < 3 * spec.page_bytes + 2 * S.slot_bytes(spec)


def test_the_window_rule_takes_the_traces_distinct_pages(spec):
    """As the window replay's (test_replay_windows.py): no full-attention pool holds more than
    the trace's distinct pages plus the longest prompt, and L1 beside an L2 that would keeps
    one window page a full page; the state rule's slots as without them."""
    kw = dict(window_share=None, state_share=None, longest_tokens=200, mean_tokens=90)
    free = M.pools_for(spec, 40, 4.0, **kw)
    assert M.pools_for(spec, 40, 4.0, distinct_pages=10**6, **kw) == free
    limit = free.host_pages - 10  # + ceil(200 / 16) = 13 pages, the longest prompt's
    p = M.pools_for(spec, 40, 4.0, distinct_pages=limit - 13, **kw)
    assert p.host_pages <= limit and p.window_host_pages > free.window_host_pages
    assert p.state_host_slots == free.state_host_slots
    assert p.window_device_pages == p.device_pages  # L1: one window page a full page
    # a trace of a page: as few full pages as one window page each allows (the all-full
    # split of the bytes the slots leave)
    tiny = M.pools_for(spec, 40, 4.0, distinct_pages=1, **kw)
    assert tiny.host_pages == tiny.window_host_pages < p.host_pages
    for q in (p, tiny):
        l1, l2 = q.bytes_used(spec)
        assert l1 <= 40 * spec.model_page_bytes and l2 <= 160 * spec.model_page_bytes
    # a window share given is what it says: no cap
    shared = dict(kw, window_share=0.2)
    assert M.pools_for(spec, 40, 4.0, distinct_pages=1, **shared) == M.pools_for(
        spec, 40, 4.0, **shared
    )


def test_the_window_rule_caps_the_two_tiers_together(spec):
    """As the window replay's: where neither tier's full-attention pool alone holds the trace
    but both together would, both give up the pages past it, to their window pools; the
    slots as without the cap. (A tier gives up no more than one window page a full page
    allows: here L1, whose window pages are as large as its full ones.)"""
    kw = dict(window_share=None, state_share=None, longest_tokens=200, mean_tokens=90)
    free = M.pools_for(spec, 200, 2.0, **kw)
    limit = max(free.device_pages, free.host_pages) + 2
    assert limit < free.device_pages + free.host_pages
    p = M.pools_for(spec, 200, 2.0, distinct_pages=limit - 13, **kw)
    assert p.window_device_pages == p.device_pages  # (L1 at the all-full split)
    assert p.window_host_pages < p.host_pages <= limit - p.device_pages
    assert p.device_pages < free.device_pages and p.host_pages < free.host_pages
    assert p.window_device_pages > free.window_device_pages
    assert p.window_host_pages > free.window_host_pages
    assert (p.state_device_slots, p.state_host_slots) == (
        free.state_device_slots,
        free.state_host_slots,
    )
    l1, l2 = p.bytes_used(spec)
    assert l1 <= 200 * spec.model_page_bytes and l2 <= 400 * spec.model_page_bytes


def test_shares_together_must_leave_pages(trace, spec, monkeypatch):
    with pytest.raises(ValueError, match="must be below 1"):
        M.pools_for(spec, 40, 4.0, window_share=0.5, state_share=0.5, longest_tokens=1,
                    mean_tokens=1)  # fmt: skip
    monkeypatch.setattr(driver, "replay", None)  # refused before anything is replayed
    with pytest.raises(ValueError, match=r"window_share 0.6 \+ state_share 0.4 must be"):
        driver.run(trace, spec, device_pages=[12], window_share=0.6, state_share=0.4)


def test_mixed_replay_hits_and_reports_both_kinds(trace, spec):
    rep = driver.run(trace, spec, device_pages=[12], host_ratio=4.0, checkpoint_every=2)
    (r,) = rep["results"]
    assert r["hit_tokens"] > 0 and r["checkpoints_written"] > 0
    # the window kind's figures
    assert r["bytes_ratio"] > 0 and 0 < r["window_bytes_share"] < 1
    assert r["lru_bytes_ratio_pages"] == int(r["bytes_ratio"] * (12 + 48))
    assert r["vs_lru_bytes_ratio"] == pytest.approx(r["hit_ratio"] / r["lru_bytes_ratio_hit_ratio"])
    assert r["l1_bytes"] <= 12 * spec.model_page_bytes
    assert r["budget_bytes"] == 60 * spec.model_page_bytes
    # the state kind's figures
    assert 0 < r["state_bytes_share"] < 1 and 0 < r["pools"]["share"] < 1
    assert r["oracle_hit_ratio"] == r["lru_total_hit_ratio"] > 0
    assert r["hit_ratio"] <= r["oracle_hit_ratio"] + 1e-12
    assert r["lru_pages_hit_ratio"] > 0 and r["checkpoint_every"] == 2
    assert rep["checkpoint_every"] == 2 and rep["window_share"] is None
    again = driver.run(trace, spec, device_pages=[12], host_ratio=4.0, checkpoint_every=2)
    drop = set(driver.TIMING_FIELDS)
    assert {k: v for k, v in again["results"][0].items() if k not in drop} == {
        k: v for k, v in r.items() if k not in drop
    }
    text = driver.tables(rep)
    assert "hit/LRU(r) >= 0.97" in text and "win bytes share" in text
    assert "hit/oracle >= 0.95" in text and "state bytes held" in text


def test_holding_by_hand(spec):
    h = M.MixedHolding(spec)
    h.sample({"device_used_pages": 0, "host_used_pages": 0})  # nothing held: no sample
    h.sample(
        {
            "device_used_pages": 8,
            "host_used_pages": 2,
            "window_device_used_pages": 3,
            "window_host_used_pages": 1,
            "state_device_used_slots": 2,
            "state_host_used_slots": 0,
        }
    )
    # page 128 bytes, window page 128, slot 192, model page 256: 10 x 128 + 4 x 128 + 2 x 192
    used = 1280 + 512 + 384
    f = h.figures()
    assert f["bytes_ratio"] == pytest.approx(2560 / used)
    assert f["window_bytes_share"] == pytest.approx(512 / used)
    assert f["state_bytes_share"] == pytest.approx(384 / used) == f["state_bytes_share_end"]
    assert f["state_slots_used"] == 2


def test_simulate_and_study_take_the_pattern(trace, spec):
    regime = simulate.Regime(l2_gbps=25.0, prefill_tokens_per_s=2e4, token_bytes=1 << 17)
    pools = M.pools_for(spec, 12, 4.0, window_share=None, state_share=None, longest_tokens=200,
                        mean_tokens=90)  # fmt: skip
    rep = simulate.simulate_all(trace, spec, regime, device_pages=12, host_ratio=4, pools=pools)
    assert rep["pools"]["window_device_pages"] == pools.window_device_pages
    assert rep["pools"]["state_device_slots"] == pools.state_device_slots
    res = study.sweep(
        trace, device_pages=12, layer_pattern="R2:S1:F1", window=2 * PS, progress=False
    )
    (r,) = res.records()
    assert r["checkpoints_written"] > 0 and r["window_bytes_share"] > 0
    with pytest.raises(ValueError, match="spec= is not taken"):
        study.sweep(trace, device_pages=12, layer_pattern="R2:S1:F1", window=32, spec="layers=2")
    with pytest.raises(ValueError, match="layer_pattern R2:S1:F1 needs window"):
        study.sweep(trace, device_pages=12, layer_pattern="R2:S1:F1", progress=False)


def test_cli_mixed_replay_prints_both_tables(trace_path, tmp_path, capsys):
    path = tmp_path / "m.json"
    args = ["replay", str(trace_path), "--quiet", "--block-size", str(PS), "--device-pages", "12"]
    pattern = ["--layer-pattern", "R2:S1:F1", "--window", "32", "--state-tokens", "24"]
    assert main([*args, *pattern, "--checkpoint-every", "auto", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "state layers" in out and "window(32)" in out and "all-full model's pages" in out
    assert "hit/LRU(r) >= 0.97" in out and "hit/oracle >= 0.95" in out
    (r,) = json.loads(path.read_text())["results"]
    assert r["hit_tokens"] > 0 and r["checkpoint_rule"] == "auto"
    assert r["pools"]["window_device_pages"] >= 1 and r["pools"]["state_device_slots"] >= 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layer-pattern", "R2:S1:F1"], "--layer-pattern R2:S1:F1 needs --window"),
        (["--layer-pattern", "R0:S1:F1", "--window", "8"], "needs a recurrent, a sliding-window"),
        (["--layer-pattern", "R2:S1", "--window", "8"], "needs a recurrent, a sliding-window"),
        (["--layer-pattern", "R2:R1:F1"], "--layer-pattern 'R2:R1:F1' must be 'a:b'"),
        (["--layer-pattern", "R2:S1:F1", "--window", "0"], "--window 0 must be a positive"),
        (["--layer-pattern", "R2:S1:F1", "--window", "8", "--spec", "layers=4"], "--spec is not"),
        (
            ["--layer-pattern", "R2:S1:F1", "--window", "8", "--window-share", "0.6"]
            + ["--state-share", "0.4"],
            "--window-share 0.6 + --state-share 0.4 must be below 1",
        ),
        (["--layer-pattern", "S5:F1", "--window", "8", "--state-share", "0.2"], "needs a recurr"),
    ],
)
def test_cli_bad_mixed_flags_exit_2(trace_path, args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(trace_path), "--quiet", "--block-size", str(PS), *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err
