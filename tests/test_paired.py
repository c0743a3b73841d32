"""Paired TTFT ratios, their interval and the verdict line (hicache_jax/cli/paired.py)."""

import numpy as np
import pytest

from hicache_jax.cli import paired

SUMMARY_A = {"recomputed_tokens": 4561, "bytes_to_host": 0, "bytes_to_device": 0}
SUMMARY_B = {"recomputed_tokens": 1905, "bytes_to_host": 3 * 2**20, "bytes_to_device": 5 * 2**20}


def _ttft(repeats=5, requests=40, seed=0):
    rng = np.random.default_rng(seed)
    return rng.uniform(0.01, 0.05, (repeats, requests))


def test_a_constant_ratio_is_the_median_and_both_ends_of_the_interval():
    a = _ttft()
    got = paired.paired_ratios(a, 0.5 * a)
    assert got["median"] == pytest.approx(0.5)
    assert got["low"] == pytest.approx(0.5) and got["high"] == pytest.approx(0.5)
    assert got["per_repeat_median"] == pytest.approx([0.5] * 5)
    assert (got["repeats"], got["requests"]) == (5, 40)
    assert "bootstrap" in got["interval"]


def test_the_interval_holds_the_median_and_is_the_same_for_the_same_timings():
    a = _ttft()
    b = a * np.random.default_rng(1).uniform(0.3, 0.9, a.shape)
    got = paired.paired_ratios(a, b)
    assert got["low"] < got["median"] < got["high"] < 1
    assert paired.paired_ratios(a, b) == got  # the bootstrap is seeded
    assert paired.paired_ratios(a, b, seed=1)["median"] == got["median"]


def test_noise_around_one_straddles_it():
    a = _ttft()
    b = a * np.random.default_rng(2).uniform(0.7, 1.3, a.shape)
    got = paired.paired_ratios(a, b)
    assert got["low"] < 1 < got["high"]


@pytest.mark.parametrize(
    "factor,noise,head",
    [
        (0.5, 0.0, "hicache is faster than device radix at p50 TTFT: 0.50x [0.50-0.50]"),
        (2.0, 0.0, "hicache is slower than device radix at p50 TTFT: 2.00x [2.00-2.00]"),
        (1.0, 0.3, "no clear difference in p50 TTFT between hicache and device radix"),
    ],
)
def test_the_verdict_says_which_is_faster_and_names_the_deterministic_figures(factor, noise, head):
    a = _ttft()
    b = factor * a * np.random.default_rng(3).uniform(1 - noise, 1 + noise, a.shape)
    line = paired.verdict_line(
        "device radix", SUMMARY_A, "hicache", SUMMARY_B, paired.paired_ratios(a, b)
    )
    assert line.startswith(f"verdict: {head}")
    assert "40 requests x 5 repeats" in line
    assert "hicache recomputes 1,905 tokens vs 4,561" in line
    assert "moves 3.00 MiB to host, 5.00 MiB back (vs 0.00 MiB, 0.00 MiB)" in line


@pytest.mark.parametrize(
    "a,b,match",
    [
        (np.ones((2, 3)), np.ones((3, 2)), "same non-empty"),
        (np.ones(3), np.ones(3), "same non-empty"),
        (np.ones((0, 3)), np.ones((0, 3)), "same non-empty"),
        (np.ones((2, 3)), np.zeros((2, 3)), "finite number of seconds > 0"),
        (np.full((2, 3), np.nan), np.ones((2, 3)), "finite number of seconds > 0"),
    ],
)
def test_bad_timings_raise_naming_the_problem(a, b, match):
    with pytest.raises(ValueError, match=match):
        paired.paired_ratios(a, b)
