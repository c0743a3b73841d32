"""Replay of a sliding-window model (hicache_jax.replay.windows, ``hicache-jax replay
--layer-pattern``): the pools never exceed the all-full model's bytes, the replay is
deterministic and hits, it reports the bytes ratio and the LRU of r x the bytes, the plain
replay's figures carry none of it, the notebook API and the simulator take the pattern, and bad
flags name themselves."""

from __future__ import annotations

import json
import pathlib

import pytest

from hicache_jax import study
from hicache_jax.cli.main import main
from hicache_jax.replay import driver, simulate
from hicache_jax.replay import windows as W
from hicache_jax.replay.trace import load_trace

DATA = pathlib.Path(__file__).parent / "data"
SYNTHETIC = DATA / "mooncake_synthetic_300.jsonl"
WINDOW_KEYS = ("bytes_ratio", "pools", "lru_bytes_ratio_hit_ratio", "window_bytes_share")


@pytest.fixture(scope="module")
def trace():
    return load_trace(SYNTHETIC, limit=80)


@pytest.fixture(scope="module")
def spec():
    return W.pattern_spec("5:1", 1024, 512)


def test_pattern_spec_is_one_period_of_tiny_layers(spec):
    assert spec.total_layers == 6 and len(spec.window_groups) == 1
    assert spec.model_page_bytes == 6 * spec.page_bytes == 6 * 512 * 2 * 4
    assert W.window_page_bytes(spec) == 5 * spec.page_bytes


@pytest.mark.parametrize("share", [None, 0.01, 0.1, 0.3, 0.5, 0.8, 0.99])
@pytest.mark.parametrize("model_pages", [1, 2, 7, 195, 1953])
@pytest.mark.parametrize("ratio", [0, 2, 4.5])
def test_the_split_never_exceeds_the_budget(spec, share, model_pages, ratio):
    p = W.pools_for(spec, model_pages, ratio, share=share, longest_tokens=40_000, mean_tokens=6_000)
    l1, l2 = p.bytes_used(spec)
    assert l1 <= model_pages * spec.model_page_bytes
    assert l2 <= p.model_host_pages * spec.model_page_bytes
    assert 1 <= p.window_device_pages <= p.device_pages
    assert p.window_host_pages <= max(p.host_pages, 0)
    assert (p.window_host_pages == 0) == (p.model_host_pages == 0)


def test_default_rule_holds_the_longest_prompt_and_tails(spec):
    longest, mean, d = 40 * 512, 8 * 512, 1000
    n_w = W.default_window_pages(spec, d, longest, mean)
    n_f, _ = W.split_pools(spec, d, n_w)
    # k = ceil(1024 / 512) = 2 pages for each mean prompt's 8 pages of the full pool beside
    assert 0 <= n_w - (40 + n_f * 2 / 8) < 2 and n_f * 4096 + n_w * 5 * 4096 <= d * 6 * 4096
    # L2: no request's own pages, the tails alone
    h_w = W.default_window_pages(spec, d, longest, mean, requests=False)
    h_f, _ = W.split_pools(spec, d, h_w)
    assert h_w < n_w and 0 <= h_w - h_f * 2 / 8 < 2
    # an L1 no larger than the longest prompt: the all-full model's split
    p = W.pools_for(spec, 30, 0, share=None, longest_tokens=longest, mean_tokens=mean)
    assert (p.device_pages, p.window_device_pages) == (30, 30)


def _room_left(spec, n_f, n_w, model_pages):
    """Bytes of a tier of ``model_pages`` all-full model pages that its pools leave."""
    left = model_pages * spec.model_page_bytes - n_f * spec.page_bytes
    return left - n_w * W.window_page_bytes(spec)


@pytest.mark.parametrize("ratio", [2, 4, 8])
def test_no_full_pool_holds_more_pages_than_the_trace_has(spec, ratio):
    longest, mean, d = 40 * 512, 8 * 512, 1000
    kw = dict(share=None, longest_tokens=longest, mean_tokens=mean)
    free = W.pools_for(spec, d, ratio, **kw)
    # a trace of more distinct pages than any pool holds: the cap changes nothing
    assert W.pools_for(spec, d, ratio, distinct_pages=10**6, **kw) == free
    limit = 3000  # distinct pages; + 40, the longest prompt's (a request's own pages)
    assert free.host_pages > limit  # (L2 of 2-8x 1000 model pages would hold more)
    p = W.pools_for(spec, d, ratio, distinct_pages=limit - 40, **kw)
    # L2: capped, the bytes past the cap in window pages (to within a page), or the all-full
    # model's split where that gives more window pages than full ones
    assert p.window_host_pages > free.window_host_pages
    if p.host_pages == p.window_host_pages:
        assert p.host_pages == p.model_host_pages
    else:
        assert p.host_pages <= limit
        assert _room_left(spec, p.host_pages, p.window_host_pages, p.model_host_pages) >= 0
        assert _room_left(spec, p.host_pages, p.window_host_pages, p.model_host_pages) < (
            spec.page_bytes
        )
    # L1 beside an L2 that holds every page: the all-full model's split
    assert (p.device_pages, p.window_device_pages, p.device_share) == (d, d, 5 / 6)
    # an explicit share is what it says: no cap
    shared = dict(kw, share=0.3)
    assert W.pools_for(spec, d, ratio, distinct_pages=10, **shared) == W.pools_for(
        spec, d, ratio, **shared
    )


def test_an_l1_above_the_trace_is_capped_alone(spec):
    """An L2 smaller than L1 (ratio 0.5) that holds fewer pages than the trace: L1's own
    full-attention pool is capped, L2 and the rest of L1's split as the rule gives them."""
    kw = dict(share=None, longest_tokens=40 * 512, mean_tokens=8 * 512)
    free = W.pools_for(spec, 1000, 0.5, **kw)
    limit = (free.host_pages + free.device_pages) // 2  # between L2's and L1's pools
    assert free.host_pages < limit < free.device_pages
    p = W.pools_for(spec, 1000, 0.5, distinct_pages=limit - 40, **kw)
    assert (p.host_pages, p.window_host_pages) == (free.host_pages, free.window_host_pages)
    assert p.device_pages <= limit and p.window_device_pages > free.window_device_pages
    assert _room_left(spec, p.device_pages, p.window_device_pages, 1000) >= 0
    assert _room_left(spec, p.device_pages, p.window_device_pages, 1000) < W.window_page_bytes(spec)


@pytest.mark.parametrize("ratio", [1, 2])
def test_two_tiers_above_the_trace_together_give_up_the_surplus(spec, ratio):
    """Neither tier's full-attention pool alone holds the trace, both together do: each gives
    up the pages past it in proportion to its pool, their bytes to its window pool; the two
    then hold the trace (less the full-attention pages of a window page's bytes a tier, at
    most, the rounding of the split), L1 still the longest prompt."""
    longest, mean, d = 40 * 512, 8 * 512, 1000
    kw = dict(share=None, longest_tokens=longest, mean_tokens=mean)
    free = W.pools_for(spec, d, ratio, **kw)
    limit = max(free.device_pages, free.host_pages) + 10  # neither alone, both together
    assert limit < free.device_pages + free.host_pages
    p = W.pools_for(spec, d, ratio, distinct_pages=limit - 40, **kw)
    per = W.window_page_bytes(spec) // spec.page_bytes  # (5 for 5:1)
    assert limit - 2 * per <= p.device_pages + p.host_pages <= limit
    surplus = free.device_pages + free.host_pages - limit
    gave = (free.device_pages - p.device_pages, free.host_pages - p.host_pages)
    assert abs(gave[0] - surplus * free.device_pages / (free.device_pages + free.host_pages)) <= per
    assert p.window_device_pages > free.window_device_pages >= 1
    assert p.window_host_pages > free.window_host_pages
    assert p.device_pages >= 40 and p.window_device_pages <= p.device_pages
    for pages, n_f, n_w in ((d, p.device_pages, p.window_device_pages),
                            (p.model_host_pages, p.host_pages, p.window_host_pages)):  # fmt: skip
        assert 0 <= _room_left(spec, n_f, n_w, pages) < W.window_page_bytes(spec)
    # a trace both hold with room to spare: as without it
    roomy = free.device_pages + free.host_pages
    assert W.pools_for(spec, d, ratio, distinct_pages=roomy - 40, **kw) == free


def test_write_through_selective_keeps_l1s_own_split_beside_an_l2_that_holds_the_trace(spec):
    """Only a write policy that copies every page L1 evicts to L2 makes L1's full pages
    redundant beside an L2 that holds the trace (L1 then split as the all-full model's);
    write_through_selective copies pages hit again only: L1 keeps the rule's own split (capped
    alone), and the two tiers are not capped together either. (Mooncake's synthetic trace,
    5:1: 0.62 -> 0.97 of its hits summed over 12 rows without the all-full L1 and the
    together cap; benchmarks/RESULTS.md.)"""
    longest, mean, d = 40 * 512, 8 * 512, 1000
    kw = dict(share=None, longest_tokens=longest, mean_tokens=mean, distinct_pages=2960)
    free = W.pools_for(spec, d, 4, share=None, longest_tokens=longest, mean_tokens=mean)
    assert free.host_pages > 3000  # (L2 alone holds the trace)
    for policy in ("clean_ahead", "write_back", "write_through"):
        assert W.l2_keeps_evicted(policy)
        p = W.pools_for(spec, d, 4, write_policy=policy, **kw)
        assert (p.device_pages, p.window_device_pages) == (d, d)
    assert not W.l2_keeps_evicted("write_through_selective")
    p = W.pools_for(spec, d, 4, write_policy="write_through_selective", **kw)
    assert (p.device_pages, p.window_device_pages) == (free.device_pages, free.window_device_pages)
    # (L2's own cap stays: here to the all-full split, one window page a full page)
    assert p.host_pages < free.host_pages and p.window_host_pages > free.window_host_pages
    assert [W.summed_tiers(w) for w in ("clean_ahead", "write_back", "write_through")] == [
        True,
        True,
        False,
    ]
    with pytest.raises(ValueError, match="write_policy"):
        W.pools_for(spec, d, 4, write_policy="sometimes", **kw)
    # what decides is the threshold: write_through at 2 backs up as write_through_selective
    assert not W.l2_keeps_evicted("write_through", 2)
    assert W.l2_keeps_evicted("write_through_selective", 1)
    assert W.l2_keeps_evicted("clean_ahead", 3)  # (no threshold in its backups)
    p2 = W.pools_for(spec, d, 4, write_policy="write_through", write_through_threshold=2, **kw)
    assert p2 == p
    for bad, err in ((0, ValueError), (1.5, TypeError)):
        with pytest.raises(err, match="write_through_threshold"):
            W.l2_keeps_evicted("write_through", bad)


def test_the_surplus_cap_keeps_the_longest_prompt_on_l1():
    assert W.surplus_cap(100, 300, 400, 10) is None  # within the limit
    assert W.surplus_cap(100, 300, 200, 10) == 50  # half of each
    assert W.surplus_cap(100, 300, 40, 30) == 30  # L1 keeps its 30
    assert W.surplus_cap(20, 300, 40, 30) == 20  # (never above what L1 had)


def test_pattern_replay_hits_is_deterministic_and_reports_r(trace, spec):
    def once():
        rep = driver.run(trace, spec, device_pages=[150], host_ratio=2, window_share=0.3)
        (r,) = rep["results"]
        return rep, {k: v for k, v in r.items() if k not in driver.TIMING_FIELDS}

    (rep, a), (_, b) = once(), once()
    assert a == b
    assert a["hit_tokens"] > 0 and a["device_pages"] == 150 and a["host_pages"] == 300
    assert a["l1_bytes"] <= 150 * spec.model_page_bytes
    assert a["l2_bytes"] <= 300 * spec.model_page_bytes
    assert 1.0 <= a["bytes_ratio"] <= spec.model_page_bytes / spec.page_bytes
    assert 0 < a["window_bytes_share"] < 1
    assert a["lru_bytes_ratio_pages"] == int(a["bytes_ratio"] * 450)
    assert a["vs_lru_bytes_ratio"] == pytest.approx(a["hit_ratio"] / a["lru_bytes_ratio_hit_ratio"])
    assert "hit/LRU(r) >= 0.97" in driver.tables(rep)


def test_the_plain_replay_carries_no_window_figures(trace):
    spec = W.pattern_spec("5:1", 1024, 512)
    plain = study.sweep(trace, device_pages=[150], host_ratios=[2], progress=False)
    (r,) = plain.records()
    assert not any(k in r for k in WINDOW_KEYS) and "window_share" not in plain.reports[0]
    with pytest.raises(ValueError, match="window_share is for a spec with window groups"):
        driver.run(trace, driver.TINY_SPEC, device_pages=[150], window_share=0.2)
    assert spec.window_groups  # (the windowed spec is another one)


def test_study_sweep_takes_the_pattern(trace):
    res = study.sweep(
        trace,
        device_pages=[150],
        host_ratios=[2],
        progress=False,
        layer_pattern="5:1",
        window=1024,
        window_share=0.3,
    )
    (r,) = res.records()
    assert r["hit_ratio"] > 0 and r["bytes_ratio"] > 1 and r["pools"]["device_share"] < 0.31
    assert res.reports[0]["spec"]["groups"] and res.reports[0]["window_share"] == 0.3
    assert study.from_json(res.to_json()) == res


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(window=1024), ValueError, "window=1024 needs layer_pattern="),
        (dict(window_share=0.2), ValueError, "window_share=0.2 needs layer_pattern="),
        (dict(layer_pattern="5-1", window=8), ValueError, "layer_pattern '5-1' must be 'a:b'"),
        (dict(layer_pattern="5:1"), ValueError, "give window"),
        (dict(layer_pattern="5:1", window=8, window_share=1.0), ValueError, "window_share 1"),
    ],
)
def test_study_bad_pattern_settings_are_refused_before_replaying(kwargs, error, match, monkeypatch):
    def no_replay(*a, **k):
        raise AssertionError("replayed")

    monkeypatch.setattr(study._replay, "run", no_replay)
    with pytest.raises(error, match=match):
        study.sweep(SYNTHETIC, **kwargs)


def test_simulate_takes_the_pools(trace, spec):
    regime = simulate.Regime(l2_gbps=25.0, prefill_tokens_per_s=2e4, token_bytes=1 << 17)
    pools = W.pools_for(spec, 150, 2, share=0.3, longest_tokens=10**6, mean_tokens=4096)
    rep = simulate.simulate_all(trace, spec, regime, device_pages=150, host_ratio=2, pools=pools)
    assert [r["policy"] for r in rep["results"]] == ["never", "always", "threshold", "cost"]
    assert rep["pools"]["window_device_pages"] == pools.window_device_pages
    assert all(r["device_hit_ratio"] > 0 for r in rep["results"])


def test_cli_pattern_replay_prints_the_window_table(tmp_path, capsys):
    path = tmp_path / "w.json"
    args = ["replay", str(SYNTHETIC), "--quiet", "--limit", "80", "--capacities", "5e4,8e4"]
    pattern = ["--layer-pattern", "5:1", "--window", "1024", "--window-share", "0.3"]
    assert main([*args, *pattern, "--host-ratio", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "hit/LRU(r) >= 0.97" in out and "LRU(= bytes)" in out and "win bytes share" in out
    assert "window(1024)" in out  # the header names the groups
    res = json.loads(path.read_text())["results"]
    assert [r["device_pages"] for r in res] == [97, 156]
    assert all(r["l1_bytes"] <= r["device_pages"] * 6 * 4096 for r in res)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "1024"], "--window needs --layer-pattern"),
        (["--window-share", "0.2"], "--window-share needs --layer-pattern"),
        (["--layer-pattern", "5"], "--layer-pattern '5' must be 'a:b'"),
        (["--layer-pattern", "0:1", "--window", "8"], "--layer-pattern '0:1' needs at least"),
        (["--layer-pattern", "5:1"], "--layer-pattern 5:1 needs --window"),
        (["--layer-pattern", "5:1", "--window", "0"], "--window 0 must be a positive"),
        (["--layer-pattern", "5:1", "--window", "8", "--window-share", "0"], "--window-share 0"),
        (["--layer-pattern", "5:1", "--window", "8", "--window-share", "1"], "--window-share 1"),
    ],
)
def test_cli_bad_pattern_flags_exit_2(args, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["replay", str(SYNTHETIC), "--quiet", *args])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_holding_by_hand(spec):
    h = W.Holding(spec)
    h.sample({"device_used_pages": 0, "host_used_pages": 0})  # nothing held: no sample
    h.sample(
        {
            "device_used_pages": 8,
            "host_used_pages": 2,
            "window_device_used_pages": 2,
            "window_host_used_pages": 0,
        }
    )
    # 10 full pages of 1 unit, 2 window pages of 5 units; 10 model pages of 6 units
    f = h.figures()
    assert f["bytes_ratio"] == pytest.approx(60 / 20) and f["window_bytes_share"] == 0.5
    assert (f["bytes_ratio_end"], f["window_bytes_share_end"]) == (3.0, 0.5)
