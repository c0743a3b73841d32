"""benchmarks/replay_driver.py: the benchmarks' one request flow gives the hit figures of
hicache_jax.replay.driver.replay, its phase timer sums to the wall, prompts survive the trip to a
worker, and ``--baseline REV`` runs a worker against REV's hicache_jax."""

from __future__ import annotations

import argparse
import os
import pathlib

import numpy as np
import pytest

from benchmarks import replay_driver as rd
from hicache_jax import HiCacheConfig
from hicache_jax.replay.driver import TINY_SPEC, replay
from hicache_jax.replay.trace import load_trace
from hicache_jax.spec import KVSpec

DATA = pathlib.Path(__file__).parent / "data"
SLICE = DATA / "mooncake_synthetic_300.jsonl"
FIGURES = (
    "prompt_tokens",
    "device_hit_tokens",
    "host_hit_tokens",
    "host_declined_tokens",
    "hit_tokens",
    "backups",
    "load_backs",
    "evicted_pages",
    "eviction_backup_pages",
    "bytes_to_host",
    "bytes_to_device",
    "host_evicted_pages",
)


@pytest.fixture(scope="module")
def trace():
    return load_trace(SLICE, limit=60)


@pytest.mark.parametrize("policy", ["clean_ahead", "write_through", "write_back"])
def test_the_flow_gives_the_library_replays_figures(trace, policy):
    spec = KVSpec.parse(None, TINY_SPEC, page_size=512)
    cfg = HiCacheConfig(
        device_pages=200, host_pages=800, write_policy=policy, load_back_threshold=512
    )
    want = replay(trace, spec, cfg)
    got = rd.replay_counted(rd.Prompts.from_trace(trace), rd.tiny_spec(512), cfg)
    assert want["host_hit_tokens"] > 0 and want["device_hit_tokens"] > 0
    assert {k: got[k] for k in FIGURES} == {k: want[k] for k in FIGURES}


@pytest.mark.parametrize("flow", rd.FLOWS)
def test_phase_clock_covers_every_call_and_sums_under_the_wall(trace, flow):
    cfg = HiCacheConfig(device_pages=120, host_pages=480, load_back_threshold=512)
    prompts = rd.Prompts.from_trace(trace)
    tokens = [prompts.tokens(i) for i in range(len(prompts))]
    timed = rd.replay(tokens, rd.tiny_spec(512), cfg, clock=rd.PhaseClock(flow))
    plain = rd.replay(tokens, rd.tiny_spec(512), cfg)  # the handle: the same figures
    phases = rd.HANDLE_PHASES if flow == "handle" else rd.PHASES
    assert set(timed["phase_s"]) == set(phases) and plain["phase_s"] is None
    assert all(v > 0 for v in timed["phase_s"].values())
    assert sum(timed["phase_s"].values()) <= timed["wall_s"]
    assert timed["hit_tokens"] == plain["hit_tokens"]


def test_prompts_round_trip_and_token_traces(tmp_path, trace):
    prompts = rd.Prompts.from_trace(trace)
    path = str(tmp_path / "p.npz")
    rd.save_prompts(prompts, path)
    back = rd.load_prompts(path)
    assert len(back) == len(trace.requests) and back.num_tokens == trace.num_tokens
    for i in (0, 17, len(back) - 1):
        np.testing.assert_array_equal(back.tokens(i), trace.requests[i].tokens())
    tokens = load_trace(DATA / "tokens_small.jsonl")
    tp = rd.Prompts.from_trace(tokens)
    assert tp.block_size == 0
    np.testing.assert_array_equal(tp.tokens(1), tokens.requests[1].tokens())


def test_a_long_prompt_caches_what_l1_holds(trace):
    cfg = HiCacheConfig(device_pages=4, host_pages=0)
    r = rd.replay(rd.Prompts.from_trace(trace), rd.tiny_spec(512), cfg)
    assert r["prompt_tokens"] == trace.num_tokens
    assert r["stats"]["device_cached_tokens"] <= 4 * 512


def test_baseline_flags():
    ap = argparse.ArgumentParser()
    rd.add_baseline_flags(ap, "abc123")
    assert ap.parse_args([]).baseline == "abc123"
    assert ap.parse_args(["--baseline", "HEAD"]).baseline == "HEAD"
    assert ap.parse_args(["--base", "HEAD~1"]).baseline == "HEAD~1"
    assert ap.parse_args(["--no-baseline"]).baseline is None
    assert ap.parse_args(["--no-base"]).baseline is None


def test_an_unknown_revision_is_a_clear_error():
    with pytest.raises(SystemExit, match="--baseline no-such-rev"), rd.Trees("no-such-rev"):
        pass


def test_a_worker_runs_against_the_baseline_trees_library(tmp_path, trace):
    """``--baseline HEAD``: the worker imports HEAD's hicache_jax from the extracted tree (the
    run checks the module path) and the benchmark code of this checkout."""
    path = str(tmp_path / "p.npz")
    rd.save_prompts(rd.Prompts.from_trace(load_trace(SLICE, limit=20)), path)
    payload = {"prompts": path, "events": "off"}
    with rd.Trees("HEAD") as trees:
        assert [t.label for t in trees] == ["current", "HEAD"]
        base_lib = trees[1].lib
        assert os.path.isfile(os.path.join(base_lib, "hicache_jax", "__init__.py"))
        out = {t.label: rd.run_worker(t, "bench_memory", payload) for t in trees}
    assert not os.path.exists(base_lib)
    assert out["HEAD"]["module"].startswith(base_lib)
    assert out["current"]["hit_ratio"] == out["HEAD"]["hit_ratio"]
    assert out["current"]["requests"] == 20
