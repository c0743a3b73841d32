"""size_pools: each tier's bytes split between full-attention pages, window pages and state
slots by the replay's default rule; the config it gives builds a cache that serves the longest
prompt; bad input raises a typed error naming the argument."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache_jax import HiCache, KVSpec, PoolSizes, size_pools
from hicache_jax.replay import mixed, states, windows
from hicache_jax.spec import WritePolicy

GiB = 1 << 30
LONGEST, MEAN = 40_000, 6_000


def _gemma_like() -> KVSpec:
    return KVSpec.from_pattern(
        "5:1", num_layers=12, num_kv_heads=2, head_dim=16, dtype="bfloat16", page_size=16, window=64
    )


def test_a_plain_spec_holds_its_bytes_in_whole_pages_and_l2_defaults_to_four_times():
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)
    p = size_pools(spec, 100 * spec.page_bytes + 7)
    assert (p.device_pages, p.host_pages) == (100, 400)
    assert p.window_device_pages is None and p.state_device_slots is None
    assert p.device_bytes == 100 * spec.page_bytes
    assert size_pools(spec, spec.page_bytes, 0).host_pages == 0
    cfg = p.config(write_policy="write_through")
    assert (cfg.device_pages, cfg.host_pages) == (100, 400)


@pytest.mark.parametrize("model_pages", [200, 3_000, 40_000])
@pytest.mark.parametrize("ratio", [0, 2, 8])
def test_window_groups_split_as_the_window_replay_does(model_pages, ratio):
    spec = windows.pattern_spec("5:1", 1024, 512)
    pm = spec.model_page_bytes
    p = size_pools(
        spec, model_pages * pm, ratio * model_pages * pm, longest_prompt_tokens=LONGEST,
        mean_prompt_tokens=MEAN,
    )  # fmt: skip
    ref = windows.pools_for(
        spec, model_pages, ratio, share=None, longest_tokens=LONGEST, mean_tokens=MEAN
    )
    assert (p.device_pages, p.window_device_pages) == (ref.device_pages, ref.window_device_pages)
    assert p.host_pages == ref.host_pages
    assert p.window_host_pages == (ref.window_host_pages or None)
    assert (p.device_bytes, p.host_bytes) == ref.bytes_used(spec)
    assert p.device_bytes <= model_pages * pm and p.host_bytes <= ratio * model_pages * pm


@pytest.mark.parametrize("model_pages", [200, 3_000])
@pytest.mark.parametrize("every", [None, 0, 4])
def test_state_groups_split_as_the_state_replay_does(model_pages, every):
    spec = states.state_spec("R3:F1", 512)
    pf = spec.page_bytes
    p = size_pools(
        spec, model_pages * pf, 4 * model_pages * pf, longest_prompt_tokens=LONGEST,
        mean_prompt_tokens=MEAN, checkpoint_every_pages=every,
    )  # fmt: skip
    ref = states.pools_for(
        spec, model_pages, 4, share=None, longest_tokens=LONGEST, mean_tokens=MEAN,
        checkpoint_every=every,
    )  # fmt: skip
    assert (p.device_pages, p.host_pages) == (ref.device_pages, ref.host_pages)
    assert (p.state_device_slots, p.state_host_slots) == (
        ref.state_device_slots,
        ref.state_host_slots,
    )
    assert p.window_device_pages is None and p.checkpoint_every_pages == every
    assert p.config().checkpoint_every_pages == every


def test_both_kinds_split_as_the_mixed_replay_does():
    spec = states.state_spec("R2:S1:F1", 512, window=1024)
    pm = spec.model_page_bytes
    for model_pages in (300, 5_000):
        p = size_pools(
            spec, model_pages * pm, 4 * model_pages * pm, longest_prompt_tokens=LONGEST,
            mean_prompt_tokens=MEAN,
        )  # fmt: skip
        ref = mixed.pools_for(
            spec, model_pages, 4, window_share=None, state_share=None, longest_tokens=LONGEST,
            mean_tokens=MEAN,
        )  # fmt: skip
        got = (p.device_pages, p.window_device_pages, p.state_device_slots)
        assert got == (ref.device_pages, ref.window_device_pages, ref.state_device_slots)
        got = (p.host_pages, p.window_host_pages, p.state_host_slots)
        assert got == (ref.host_pages, ref.window_host_pages, ref.state_host_slots)
        assert (p.device_bytes, p.host_bytes) == ref.bytes_used(spec)


@pytest.mark.parametrize(
    "pattern, model_pages, ratio",
    [("5:1", 1953, 2), ("5:1", 1953, 4), ("5:1", 585, 2), ("5:1", 195, 8), ("R2:S1:F1", 5859, 2)],
)
def test_a_working_set_caps_the_full_pools_as_the_replays_distinct_pages(
    pattern, model_pages, ratio
):
    """Given the workload's working set, the pools are the replay's with a trace of that many
    distinct pages (each tier capped, L1 all-full beside an L2 that holds it, both together
    capped): the rule measured at equal memory (benchmarks/RESULTS.md)."""
    if pattern.startswith("R"):
        spec = states.state_spec(pattern, 512, window=1024)
    else:
        spec = windows.pattern_spec(pattern, 1024, 512)
    pm, distinct = spec.model_page_bytes, 18_793  # (Mooncake's synthetic trace's pages)
    kw = dict(longest_prompt_tokens=134_773, mean_prompt_tokens=11_852)
    budgets = (model_pages * pm, ratio * model_pages * pm)
    p = size_pools(spec, *budgets, working_set_tokens=distinct * 512 - 100, **kw)
    sizes = dict(longest_tokens=kw["longest_prompt_tokens"], mean_tokens=kw["mean_prompt_tokens"])
    if pattern.startswith("R"):
        ref: Any = mixed.pools_for(spec, model_pages, ratio, window_share=None,
                                   state_share=None, distinct_pages=distinct, **sizes)  # fmt: skip
        assert (p.state_device_slots, p.state_host_slots) == (
            ref.state_device_slots,
            ref.state_host_slots,
        )
    else:
        ref = windows.pools_for(spec, model_pages, ratio, share=None, distinct_pages=distinct,
                                **sizes)  # fmt: skip
    assert (p.device_pages, p.window_device_pages) == (ref.device_pages, ref.window_device_pages)
    assert (p.host_pages, p.window_host_pages) == (ref.host_pages, ref.window_host_pages)
    assert (p.device_bytes, p.host_bytes) == ref.bytes_used(spec)
    assert p.device_bytes <= budgets[0] and p.host_bytes <= budgets[1]
    assert p.write_policy is WritePolicy.CLEAN_AHEAD  # (the default: the tiers summed)
    # a working set larger than the pools: as without one
    big = size_pools(spec, *budgets, working_set_tokens=10**12, **kw)
    assert dataclasses.replace(big, write_policy=None) == size_pools(spec, *budgets, **kw)


def test_the_tiers_are_capped_together_only_under_a_write_policy_that_sums_them():
    """clean_ahead and write_back back up what L1 evicts (the tiers one cache of their summed
    size); write_through's L2 copies L1, write_through_selective drops what it does not copy:
    each tier capped alone there. The config gets the policy sized for, and refuses another."""
    spec = windows.pattern_spec("5:1", 1024, 512)
    pm, distinct = spec.model_page_bytes, 18_793
    kw = dict(longest_prompt_tokens=134_773, mean_prompt_tokens=11_852)
    budgets = (1953 * pm, 2 * 1953 * pm)  # (both tiers together above the working set)
    sizes = dict(longest_tokens=134_773, mean_tokens=11_852, distinct_pages=distinct)
    summed = windows.pools_for(spec, 1953, 2, share=None, **sizes)
    alone = windows.pools_for(spec, 1953, 2, share=None, write_policy="write_through", **sizes)
    assert summed.device_pages + summed.host_pages < alone.device_pages + alone.host_pages
    for policy, ref in (("clean_ahead", summed), ("write_back", summed),
                        ("write_through", alone), ("write_through_selective", alone)):  # fmt: skip
        assert windows.summed_tiers(policy) is (ref is summed)
        p = size_pools(spec, *budgets, working_set_tokens=distinct * 512, write_policy=policy, **kw)
        assert (p.device_pages, p.host_pages) == (ref.device_pages, ref.host_pages)
        assert (p.window_device_pages, p.window_host_pages) == (
            ref.window_device_pages,
            ref.window_host_pages,
        )
        cfg = p.config(eviction="lru")
        assert (
            cfg.write_policy is WritePolicy(policy)
            and p.config(write_policy=policy, eviction="lru") == cfg
        )
        other = "write_back" if policy != "write_back" else "clean_ahead"
        with pytest.raises(ValueError, match=f"sized for '{policy}'"):
            p.config(write_policy=other)
    with pytest.raises(ValueError, match="write_policy applies with working_set_tokens"):
        size_pools(spec, *budgets, write_policy="write_back", **kw)
    with pytest.raises(ValueError, match="write_policy"):
        size_pools(spec, *budgets, working_set_tokens=10**6, write_policy="often", **kw)


def test_a_write_through_threshold_above_1_sizes_as_write_through_selective():
    """write_through at threshold 2 backs up what write_through_selective does (pages hit
    twice), so L2 does not copy every page L1 evicts: L1 keeps the rule's own split beside an
    L2 that holds the working set, as write_through_selective's; write_through_selective at
    threshold 1 is write_through. The config gets the threshold sized for (a write-through
    policy's default where none was given) and refuses another."""
    spec = windows.pattern_spec("5:1", 1024, 512)
    pm, distinct = spec.model_page_bytes, 2960
    kw = dict(longest_prompt_tokens=40 * 512, mean_prompt_tokens=8 * 512)
    budgets, ws = (1000 * pm, 4000 * pm), distinct * 512

    def pools(policy, threshold=None):
        p = size_pools(spec, *budgets, working_set_tokens=ws, write_policy=policy,
                       write_through_threshold=threshold, **kw)  # fmt: skip
        return p, (p.device_pages, p.window_device_pages, p.host_pages, p.window_host_pages)

    through, selective = pools("write_through")[1], pools("write_through_selective")[1]
    assert through[:2] == (1000, 1000) and through != selective  # (L2 holds the working set)
    assert pools("write_through", 2)[1] == pools("write_through", 5)[1] == selective
    assert pools("write_through_selective", 1)[1] == through
    cases = [("write_through", None, 1), ("write_through_selective", None, 2),
             ("write_through", 3, 3), ("clean_ahead", None, None)]  # fmt: skip
    for policy, threshold, want in cases:
        p = pools(policy, threshold)[0]
        assert p.write_through_threshold == want
        cfg = p.config()
        assert cfg.write_through_threshold == (want or 1)  # (clean_ahead: HiCacheConfig's own)
        if want is not None:
            assert p.config(write_through_threshold=want) == cfg
            with pytest.raises(ValueError, match=f"sized for {want}"):
                p.config(write_through_threshold=want + 1)
    with pytest.raises(ValueError, match="write_through_threshold applies with working_set"):
        size_pools(spec, *budgets, write_through_threshold=2, **kw)
    with pytest.raises(ValueError, match="write_through_threshold"):
        size_pools(spec, *budgets, working_set_tokens=ws, write_through_threshold=0, **kw)
    with pytest.raises(TypeError, match="write_through_threshold"):
        size_pools(spec, *budgets, working_set_tokens=ws, write_through_threshold=1.5, **kw)


def test_a_working_set_is_refused_without_window_groups_or_when_not_a_count():
    kw = {"longest_prompt_tokens": LONGEST, "mean_prompt_tokens": MEAN}
    plain = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=16)
    with pytest.raises(ValueError, match=r"working_set_tokens .* no sliding-window"):
        size_pools(plain, GiB, working_set_tokens=10**6)
    with pytest.raises(ValueError, match=r"working_set_tokens .* no sliding-window"):
        size_pools(states.state_spec("R3:F1", 512), GiB, working_set_tokens=10**6, **kw)
    spec = _gemma_like()
    with pytest.raises(ValueError, match="working_set_tokens"):
        size_pools(spec, GiB, working_set_tokens=0, **kw)
    with pytest.raises(TypeError, match="working_set_tokens"):
        size_pools(spec, GiB, working_set_tokens=1.5, **kw)  # type: ignore[arg-type]


def test_the_windowed_model_holds_more_tokens_than_the_all_full_one_at_equal_bytes():
    spec = _gemma_like()
    budget = 2000 * spec.model_page_bytes
    p = size_pools(spec, budget, longest_prompt_tokens=4096, mean_prompt_tokens=1024)
    assert p.device_bytes <= budget
    assert p.device_pages > 2000  # the all-full model's pages of the same bytes
    assert p.window_device_pages >= 4096 // spec.page_size  # the longest prompt's own pages


def test_the_sized_cache_serves_the_longest_prompt_from_an_empty_l1_and_keeps_it():
    spec = _gemma_like()
    longest = 1024
    p = size_pools(
        spec, 96 * spec.model_page_bytes, 0, longest_prompt_tokens=longest, mean_prompt_tokens=256
    )
    assert p.host_pages == 0 and p.window_host_pages is None
    cache = HiCache(spec, p.config())
    try:
        prompt = np.arange(longest)
        with cache.begin(prompt) as req:
            pages = req.extend(longest - req.cached_len)
            assert (cache.window_pages(pages) >= 0).all()  # every group's page held
            req.finish(prompt)
        assert cache.match_prefix(prompt).device_len == longest
        cache.check_invariants()
    finally:
        cache.close()


def test_bad_input_is_refused_with_the_argument_named():
    plain = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=16)
    spec = _gemma_like()
    kw = {"longest_prompt_tokens": LONGEST, "mean_prompt_tokens": MEAN}
    with pytest.raises(TypeError, match="KVSpec"):
        size_pools("5:1", GiB)  # type: ignore[arg-type]
    for bad in (0, -1):
        with pytest.raises(ValueError, match="device_bytes"):
            size_pools(plain, bad)
    for bad in (1.5, True, "1"):
        with pytest.raises(TypeError, match="device_bytes"):
            size_pools(plain, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="host_bytes"):
        size_pools(plain, GiB, -1)
    n = plain.page_bytes
    with pytest.raises(ValueError, match=rf"device_bytes={n - 1} is too small.* {n} bytes"):
        size_pools(plain, n - 1)
    with pytest.raises(ValueError, match="host_bytes=1 is too small"):
        size_pools(plain, n, 1)
    with pytest.raises(ValueError, match="longest_prompt_tokens and mean_prompt_tokens"):
        size_pools(spec, GiB)
    with pytest.raises(ValueError, match="mean_prompt_tokens=9 must be at most"):
        size_pools(spec, GiB, longest_prompt_tokens=8, mean_prompt_tokens=9)
    with pytest.raises(ValueError, match="longest_prompt_tokens"):
        size_pools(spec, GiB, longest_prompt_tokens=0, mean_prompt_tokens=1)
    with pytest.raises(ValueError, match="checkpoint_every_pages applies to STATE"):
        size_pools(spec, GiB, checkpoint_every_pages=4, **kw)
    with pytest.raises(ValueError, match=r"device_bytes=.* is too small"):
        size_pools(spec, spec.model_page_bytes - 1, **kw)
    p = size_pools(spec, GiB, **kw)
    assert isinstance(p, PoolSizes)
    with pytest.raises(TypeError, match="window_device_pages is set by size_pools"):
        p.config(window_device_pages=3)


@settings(max_examples=150)
@given(
    pattern=st.sampled_from(["full", "5:1", "1:3", "R3:F1", "R2:S1:F1"]),
    device_pages=st.floats(0.05, 5_000.0),
    host_ratio=st.sampled_from([0.0, 0.5, 2.0, 8.0]),
    longest=st.integers(1, 200_000),
    mean_share=st.floats(0.0, 1.0),
)
def test_any_budget_gets_pools_within_its_bytes_or_a_clear_error(
    pattern, device_pages, host_ratio, longest, mean_share
):
    """Whatever the bytes: pools that fit them, at least one of each, and a config that
    HiCacheConfig accepts; or a ValueError naming the tier that is too small."""
    if pattern.startswith("R"):
        spec = states.state_spec(pattern, 512, window=1024 if "S" in pattern else None)
    elif pattern == "full":
        spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=1, dtype="float32", page_size=512)
    else:
        spec = windows.pattern_spec(pattern, 1024, 512)
    device = max(1, int(device_pages * spec.model_page_bytes))
    host = int(host_ratio * device)
    mean = max(1, int(mean_share * longest))
    try:
        p = size_pools(spec, device, host, longest_prompt_tokens=longest, mean_prompt_tokens=mean)
    except ValueError as e:
        assert re.match(r"(device|host)_bytes=\d+ is too small for this spec", str(e)), e
        return
    assert 0 < p.device_bytes <= device and 0 <= p.host_bytes <= host
    assert p.device_pages >= 1 and (p.host_pages >= 1 or host == 0)
    for n in (p.window_device_pages, p.window_host_pages, p.state_device_slots, p.state_host_slots):
        assert n is None or n >= 1
    assert (p.window_device_pages is None) == (not windows.window_page_bytes(spec))
    cfg = p.config()
    assert (cfg.device_pages, cfg.host_pages) == (p.device_pages, p.host_pages)


@settings(max_examples=150)
@given(
    pattern=st.sampled_from(["5:1", "1:3", "R2:S1:F1"]),
    device_pages=st.floats(0.05, 5_000.0),
    host_ratio=st.sampled_from([0.0, 0.5, 2.0, 8.0]),
    longest=st.integers(1, 200_000),
    mean_share=st.floats(0.0, 1.0),
    working_set=st.integers(1, 10**8),
    policy=st.sampled_from([None, *(w.value for w in WritePolicy)]),
)
def test_any_working_set_gets_pools_within_their_bytes_or_a_clear_error(
    pattern, device_pages, host_ratio, longest, mean_share, working_set, policy
):
    """With a working set too: pools that fit the bytes, no full-attention pool above the
    working set's pages plus the longest prompt's unless one window page a full page bounds
    it, and the policy in the config; or a ValueError naming the tier that is too small."""
    if pattern.startswith("R"):
        spec = states.state_spec(pattern, 512, window=1024)
    else:
        spec = windows.pattern_spec(pattern, 1024, 512)
    device = max(1, int(device_pages * spec.model_page_bytes))
    host = int(host_ratio * device)
    mean = max(1, int(mean_share * longest))
    kw = dict(longest_prompt_tokens=longest, mean_prompt_tokens=mean)
    try:
        p = size_pools(spec, device, host, working_set_tokens=working_set, write_policy=policy,
                       **kw)  # fmt: skip
    except ValueError as e:
        assert re.match(r"(device|host)_bytes=\d+ is too small for this spec", str(e)), e
        return
    assert 0 < p.device_bytes <= device and 0 <= p.host_bytes <= host
    limit = -(-working_set // 512) + -(-longest // 512)
    for n_f, n_w in ((p.device_pages, p.window_device_pages), (p.host_pages, p.window_host_pages)):
        assert n_f <= limit or n_f == n_w, (n_f, n_w, limit)
    cfg = p.config()
    assert cfg.write_policy is WritePolicy(policy or "clean_ahead")
    assert (cfg.device_pages, cfg.host_pages) == (p.device_pages, p.host_pages)


def test_the_size_command_prints_the_pools_and_the_config(tmp_path, capsys):
    from hicache_jax.cli.main import main

    spec = ["--spec", "layers=12,kv_heads=2,head_dim=16,dtype=bfloat16,page_size=16"]
    flags = ["--layer-pattern", "5:1", "--window", "64", "--longest-prompt", "2048"]
    path = tmp_path / "size.json"
    argv = ["size", *spec, *flags, "--mean-prompt", "512", "--device-bytes", "8MiB"]
    assert main([*argv, "--host-bytes", "32MiB", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    want = size_pools(
        _gemma_like(), 8 << 20, 32 << 20, longest_prompt_tokens=2048, mean_prompt_tokens=512
    )
    assert f"HiCacheConfig(device_pages={want.device_pages}, host_pages={want.host_pages}, " in out
    assert f"window_device_pages={want.window_device_pages}" in out
    assert "all-full tokens" in out and "window(64)" in out
    data = json.loads(path.read_text())
    assert data["device_pages"] == want.device_pages and data["host_bytes"] == want.host_bytes
    assert main(["size", "--device-bytes", "1e9", "--host-bytes", "0"]) == 0
    assert "HiCacheConfig(device_pages=" in capsys.readouterr().out
    # a working set: the pools of size_pools(..., working_set_tokens=...)
    small = size_pools(_gemma_like(), 8 << 20, 32 << 20, longest_prompt_tokens=2048,
                       mean_prompt_tokens=512, working_set_tokens=4096)  # fmt: skip
    assert (small.device_pages, small.host_pages) != (want.device_pages, want.host_pages)
    assert main([*argv, "--host-bytes", "32MiB", "--working-set", "4096"]) == 0
    out = capsys.readouterr().out
    assert (
        f"HiCacheConfig(device_pages={small.device_pages}, host_pages={small.host_pages}, " in out
    )
    assert "write_policy='clean_ahead')" in out  # (the default: what the pools were sized for)
    flags = ["--host-bytes", "32MiB", "--working-set", "4096", "--write-policy", "write_through"]
    assert main([*argv, *flags]) == 0
    alone = size_pools(_gemma_like(), 8 << 20, 32 << 20, longest_prompt_tokens=2048,
                       mean_prompt_tokens=512, working_set_tokens=4096,
                       write_policy="write_through")  # fmt: skip
    out = capsys.readouterr().out
    assert f"device_pages={alone.device_pages}, host_pages={alone.host_pages}, " in out
    assert "write_policy='write_through', write_through_threshold=1)" in out  # (its default)
    assert main([*argv, *flags, "--write-through-threshold", "2"]) == 0
    assert "write_policy='write_through', write_through_threshold=2)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--device-bytes", "10QB"], "--device-bytes '10QB' must be a number of bytes"),
        (["--device-bytes", "8MiB", "--host-bytes", "x"], "--host-bytes 'x' must be"),
        (["--device-bytes", "8MiB", "--layer-pattern", "5:1", "--window", "64"],
         "longest_prompt_tokens and mean_prompt_tokens are needed"),
        (["--device-bytes", "100"], "device_bytes=100 is too small"),
        (["--device-bytes", "8MiB", "--window", "64"], "need --layer-pattern"),
    ],
)  # fmt: skip
def test_the_size_command_refuses_bad_flags_with_exit_2(extra, match, capsys):
    from hicache_jax.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["size", *extra])
    assert e.value.code == 2
    assert match in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "n"),
    [("40GiB", 40 << 30), ("1.5e9", 1_500_000_000), ("512 MiB", 512 << 20), ("2kb", 2000),
     ("7", 7), ("0.5KiB", 512)],
)  # fmt: skip
def test_bytes_are_read_with_their_units(text, n):
    from hicache_jax.cli.size import parse_bytes

    assert parse_bytes(text, "--device-bytes") == n
