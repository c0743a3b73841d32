"""Paired TTFT ratios of two cache configurations and the verdict ``hicache-jax bench`` prints.

Both configurations serve the same requests in the same order, each on a fresh cache, in several
repeats; within a repeat the two serve each request back to back (``hicache-jax bench``), so a
request's two TTFTs meet the same machine load. This module owns what is made of them:

* the **paired ratio** of request ``i`` in repeat ``k``: B's TTFT over A's (``ttft_b[k, i] /
  ttft_a[k, i]``; below 1: B is faster on that request);
* the **headline**: the median of all ``repeats x requests`` ratios;
* its **90% interval**: the 5th and 95th percentiles of that median over :data:`RESAMPLES`
  bootstrap resamples, each drawing the requests with replacement and, for each request drawn,
  one of its repeats at random (a two-stage bootstrap: it carries both the spread between
  requests and the run-to-run timing noise; its generator is seeded, so the same timings give
  the same interval);
* the **verdict**: B is faster (interval wholly below 1), slower (wholly above 1), or "no clear
  difference" (the interval straddles 1), with the figures that do not depend on timing (tokens
  recomputed, bytes moved) beside it.

Pure functions of numpy arrays; no clock, no cache.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["RESAMPLES", "LEVEL", "paired_ratios", "verdict_line"]

#: Bootstrap resamples behind the interval.
RESAMPLES = 2000
#: Coverage of the interval.
LEVEL = 0.90


def paired_ratios(ttft_a: Any, ttft_b: Any, *, seed: int = 0) -> dict[str, Any]:
    """B's TTFT over A's, request by request, with the median and its bootstrap interval.

    Args:
        ttft_a, ttft_b: float seconds ``[repeats, requests]`` (the same requests, same order).
        seed: the bootstrap's generator seed.

    Returns:
        ``median`` (of all ratios), ``low`` / ``high`` (the :data:`LEVEL` interval),
        ``per_repeat_median`` (one median per repeat), ``repeats``, ``requests``,
        ``interval`` (how the interval was formed, in words).

    Raises:
        ValueError: shapes differ, are not 2-D, are empty, or a TTFT is not finite and > 0.
    """
    a, b = np.asarray(ttft_a, dtype=np.float64), np.asarray(ttft_b, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 2 or a.size == 0:
        raise ValueError(
            f"ttft_a {a.shape} and ttft_b {b.shape} must be the same non-empty "
            "[repeats, requests] shape"
        )
    if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b)) and a.min() > 0 and b.min() > 0):
        raise ValueError("every TTFT must be a finite number of seconds > 0")
    ratios = b / a
    repeats, requests = ratios.shape
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, repeats, (RESAMPLES, requests))
    cols = rng.integers(0, requests, (RESAMPLES, requests))
    medians = np.median(ratios[rows, cols], axis=1)
    tail = (1 - LEVEL) / 2 * 100
    low, high = np.percentile(medians, [tail, 100 - tail])
    return {
        "median": float(np.median(ratios)),
        "low": float(low),
        "high": float(high),
        "per_repeat_median": [float(m) for m in np.median(ratios, axis=1)],
        "repeats": repeats,
        "requests": requests,
        "interval": (
            f"{LEVEL:.0%}: percentiles of the median over {RESAMPLES} bootstrap resamples of "
            "the requests, each request drawn with one of its repeats at random"
        ),
    }


def _mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def verdict_line(
    name_a: str, summary_a: dict[str, Any], name_b: str, summary_b: dict[str, Any], paired: dict
) -> str:
    """One line: which of B and A is faster at the median request (or no clear difference),
    the median paired ratio with its interval, then tokens recomputed and bytes moved.

    ``summary_*``: ``recomputed_tokens``, ``bytes_to_host``, ``bytes_to_device`` (the
    ``hicache-jax bench`` summary of each); ``paired``: :func:`paired_ratios` of A, B."""
    low, high, med = paired["low"], paired["high"], paired["median"]
    if high < 1:
        head = f"{name_b} is faster than {name_a} at p50 TTFT"
    elif low > 1:
        head = f"{name_b} is slower than {name_a} at p50 TTFT"
    else:
        head = f"no clear difference in p50 TTFT between {name_b} and {name_a}"
    return (
        f"verdict: {head}: {med:.2f}x [{low:.2f}-{high:.2f}] (median paired TTFT ratio "
        f"{name_b}/{name_a}, {LEVEL:.0%} interval, {paired['requests']} requests x "
        f"{paired['repeats']} repeats); {name_b} recomputes "
        f"{summary_b['recomputed_tokens']:,} tokens vs {summary_a['recomputed_tokens']:,}; "
        f"moves {_mb(summary_b['bytes_to_host'])} to host, {_mb(summary_b['bytes_to_device'])} "
        f"back (vs {_mb(summary_a['bytes_to_host'])}, {_mb(summary_a['bytes_to_device'])})"
    )
