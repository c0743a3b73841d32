"""Fixed-bucket histograms of the transfers the transfer engine completes: their duration,
bytes and bandwidth per direction, accumulated where a transfer completes and read by whoever
reports them (``HiCache.transfer_histograms``, the Prometheus exporter of
:mod:`hicache_jax.metrics`).

Recording a transfer is three bisections into short tuples and a few integer adds, so the
accumulation is kept always on: nothing is set up when nobody reads it, and a reader pays its
own cost (a copy of the counts) at read time.

Threading: the owner of the transfer engine records; any thread may call
:meth:`TransferHistogram.snapshot` (a list copy under the GIL: every count it returns was
recorded, and its ``count`` is the sum of its buckets, so a snapshot is self-consistent even
when taken while a transfer is being recorded; its ``sum`` may lag by that transfer).
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

__all__ = [
    "BYTES_BUCKETS",
    "GBPS_BUCKETS",
    "SECONDS_BUCKETS",
    "Histogram",
    "HistogramSnapshot",
    "TransferHistogram",
]

#: Upper bounds (inclusive) of the duration buckets, in seconds: 10 us to 10 s.
SECONDS_BUCKETS: tuple[float, ...] = (
    1e-5,
    3e-5,
    1e-4,
    3e-4,
    1e-3,
    3e-3,
    0.01,
    0.03,
    0.1,
    0.3,
    1.0,
    3.0,
    10.0,
)
#: Upper bounds of the size buckets, in bytes: 4 KiB to 4 GiB, a factor 4 apart.
BYTES_BUCKETS: tuple[float, ...] = tuple(float(4096 * 4**k) for k in range(11))
#: Upper bounds of the bandwidth buckets, in GB/s (1e9 bytes a second).
GBPS_BUCKETS: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0, 300.0)


@dataclass(frozen=True)
class HistogramSnapshot:
    """A histogram as read at one moment.

    Attributes:
        bounds: the buckets' upper bounds (inclusive), ascending; a last bucket (+Inf) follows.
        counts: observations per bucket, NOT cumulative: ``len(bounds) + 1`` of them.
        count: every observation (the sum of ``counts``).
        sum: the sum of the observed values.
    """

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float

    def cumulative(self) -> list[tuple[float, int]]:
        """``(upper bound, observations <= it)`` per bucket, the last bound ``inf`` (the
        form Prometheus' histogram buckets take)."""
        out, total = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            total += n
            out.append((bound, total))
        return out


class Histogram:
    """Counts of observed values per fixed bucket, and their sum.

    Args:
        bounds: the buckets' upper bounds, ascending (a value equal to a bound falls in its
            bucket; values above the last fall in the +Inf bucket).

    Raises:
        ValueError: ``bounds`` empty or not strictly ascending.
    """

    __slots__ = ("bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or any(b >= c for b, c in itertools.pairwise(bounds)):
            raise ValueError(f"bounds={bounds!r} must be non-empty and strictly ascending")
        self.bounds = tuple(float(b) for b in bounds)
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self.bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        counts = tuple(self._counts)  # one copy: count agrees with the buckets
        return HistogramSnapshot(self.bounds, counts, sum(counts), self._sum)


class TransferHistogram:
    """The transfers of one direction: duration (seconds), size (bytes) and bandwidth (GB/s)
    of each, one observation per transfer in each.

    A transfer's duration is its handle's ``seconds`` (dispatch to the poll that saw it
    complete: an upper bound of the copy's own time); its bandwidth is bytes over that
    duration (a zero duration falls in the +Inf bucket).
    """

    __slots__ = ("seconds", "bytes", "gbps")

    def __init__(self) -> None:
        self.seconds = Histogram(SECONDS_BUCKETS)
        self.bytes = Histogram(BYTES_BUCKETS)
        self.gbps = Histogram(GBPS_BUCKETS)

    def record(self, nbytes: int, seconds: float) -> None:
        """One transfer of ``nbytes`` that took ``seconds``."""
        self.seconds.observe(seconds)
        self.bytes.observe(nbytes)
        self.gbps.observe(nbytes / seconds / 1e9 if seconds > 0 else float("inf"))

    def snapshot(self) -> dict[str, HistogramSnapshot]:
        """``{"seconds", "bytes", "gbps"}``: each as read now (any thread)."""
        return {
            "seconds": self.seconds.snapshot(),
            "bytes": self.bytes.snapshot(),
            "gbps": self.gbps.snapshot(),
        }
