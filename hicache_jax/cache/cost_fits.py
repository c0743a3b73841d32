"""The fitted figures of the cost model (ARCHITECTURE.md, "Load or recompute"): a link's
``latency + bytes / bandwidth`` (:class:`LinkFit`, a Theil-Sen line over a window of completed
transfers, with the pessimistic bounds a plan charges an unmeasured link) and the prefill's
``a + b*n + c*n*(cached + n/2)`` (:class:`PrefillFit`, relative least squares with
non-negative coefficients, recent samples weighing more). cache/cost_model.py documents how a
plan uses them.

Pure Python + numpy; the cache's thread only.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import numpy as np

from hicache_jax.validation import is_real

__all__ = ["HALF_LIFE", "LinkFit", "MIN_SAMPLES", "PESSIMISM", "PROBE_EVERY", "PrefillFit", "WARMUP", "WINDOW",
           "check_sample", "rel_err"]

#: Warm-up ``(latency seconds, bytes per second)`` of each link, before it has samples.
#: The L3 link's decides no load (``LinkFit(trust_warmup=False)``): only its first probe.
WARMUP = {"l2_l1": (20e-6, 10e9), "l3_l2": (1e-3, 1e9)}
WINDOW = 32
#: Samples after which a prefill sample's weight in the fit has halved.
HALF_LIFE = 8.0
MIN_SAMPLES = 4
#: Plans without a sample after which a link is probed again.
PROBE_EVERY = 64
#: A link without samples is costed at its warm-up figure times this in a plan.
PESSIMISM = 2.0


def check_sample(what: str, **values: Any) -> None:
    for name, v in values.items():
        if not is_real(v) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}: {name}={v!r} must be a finite number >= 0")


def rel_err(pred: float, actual: float) -> float | None:
    return abs(pred - actual) / actual if actual > 0 else None


class LinkFit:
    """``latency + bytes / bandwidth`` of one link, fitted over a window of transfers.

    Args:
        latency_s, bytes_per_s: the warm-up figure, until :data:`MIN_SAMPLES` transfers.
        window: transfers the fit is over.
        trust_warmup: False: with no sample a plan charges any load over the link as
            infinite, so that its first read is the one-page probe (a store's speed is
            unknown by orders of magnitude: a load decided on its warm-up figure could cost
            many times its recompute); True: the warm-up figure times :data:`PESSIMISM`.
    """

    def __init__(self, latency_s: float, bytes_per_s: float, window: int = WINDOW,
                 trust_warmup: bool = True) -> None:
        self.latency_s, self.bytes_per_s = float(latency_s), float(bytes_per_s)
        self.trust_warmup = bool(trust_warmup)
        self._x: collections.deque = collections.deque(maxlen=window)
        self._y: collections.deque = collections.deque(maxlen=window)
        self._err: collections.deque = collections.deque(maxlen=4 * window)
        self.samples = 0
        self.plans_since_sample = 0
        #: seconds of probing this link may still spend: each plan while it is due adds
        #: a share of the chain's predicted recompute; a probe spends its bound less the
        #: recompute it replaces
        self.probe_credit = 0.0

    def needs_probe(self) -> bool:
        return self.samples < MIN_SAMPLES or self.plans_since_sample >= PROBE_EVERY

    def predict(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bytes_per_s if nbytes > 0 else 0.0

    def _bound(self, n: np.ndarray) -> np.ndarray:
        """The pessimistic cost of each of ``n`` bytes from the last :data:`MIN_SAMPLES`
        samples (at least one): the costliest scaled up to the size (``max(1, n / x) * y``,
        a bound under ``latency + bytes / bandwidth`` with ``latency >= 0``) and, where they
        have two sizes or more, no more than :data:`PESSIMISM` times their own line."""
        recent = list(zip(self._x, self._y))[-MIN_SAMPLES:]
        bound = np.max([np.maximum(1.0, n / x) * y for x, y in recent], axis=0)
        x, y = np.array(recent).T
        dx, dy = x[None, :] - x[:, None], y[None, :] - y[:, None]
        if (dx > 0).any() and (slope := float(np.median(dy[dx > 0] / dx[dx > 0]))) > 0:
            lat = max(0.0, float(np.median(y - slope * x)))
            bound = np.minimum(bound, PESSIMISM * (lat + slope * n))
        return bound

    def worst(self, nbytes: float) -> float:
        """A pessimistic cost of ``nbytes``, what bounds a probe: with no sample the warm-up
        figure, else :meth:`_bound`."""
        if nbytes <= 0:
            return 0.0
        if not self._x:
            return self.predict(nbytes)
        return float(self._bound(np.array([float(nbytes)]))[0])

    def plan_cost(self, nbytes: float) -> float:
        """What a plan charges: the fit once it has :data:`MIN_SAMPLES` samples; before, with
        some, :meth:`worst`; with none, the warm-up figure times :data:`PESSIMISM` (infinite
        where the warm-up figure is not trusted)."""
        return float(self.plan_costs(np.array([float(nbytes)]))[0])

    def plan_costs(self, nbytes: np.ndarray) -> np.ndarray:
        """:meth:`plan_cost` of each of ``nbytes`` (float64, 1-D), at once."""
        n = np.asarray(nbytes, np.float64)
        if self.samples >= MIN_SAMPLES:
            t = self.latency_s + n / self.bytes_per_s
        elif self._x:
            t = self._bound(n)
        elif self.trust_warmup:
            t = PESSIMISM * (self.latency_s + n / self.bytes_per_s)
        else:
            t = np.full_like(n, np.inf)
        return np.where(n > 0, t, 0.0)

    def observe(self, nbytes: float, seconds: float) -> None:
        """One completed transfer; ValueError for a negative or non-finite figure."""
        check_sample("observe_transfer", nbytes=nbytes, seconds=seconds)
        if nbytes == 0:
            return
        err = rel_err(self.predict(nbytes), seconds)
        if err is not None and self.samples >= MIN_SAMPLES:
            self._err.append(err)
        self._x.append(float(nbytes))
        self._y.append(float(seconds))
        self.samples += 1
        self.plans_since_sample = 0
        if len(self._x) >= MIN_SAMPLES:
            self._refit()

    def _refit(self) -> None:
        x, y = np.asarray(self._x), np.asarray(self._y)
        dx = x[None, :] - x[:, None]
        dy = y[None, :] - y[:, None]
        ok = dx > 0
        if ok.sum() >= MIN_SAMPLES:  # spread of sizes: slope and intercept
            slope = float(np.median(dy[ok] / dx[ok]))
            lat = float(np.median(y - slope * x))
            if slope > 0:
                self.bytes_per_s, self.latency_s = 1.0 / slope, max(0.0, lat)
                return
        # one size (or a non-increasing cloud): keep the latency, fit the bandwidth
        per_byte = np.median((y - self.latency_s) / x)
        if per_byte <= 0:  # faster than the latency alone: the latency is too large
            self.latency_s = float(np.median(y)) * 0.5
            per_byte = np.median((y - self.latency_s) / x)
        self.bytes_per_s = 1.0 / float(per_byte)

    def median_error(self) -> float | None:
        return float(np.median(self._err)) if self._err else None


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0``, exact for a few columns: the optimum is the
    least-squares solution on its support, so the best non-negative one over the column subsets,
    all first (clamping an unconstrained solution keeps the others' compensation for it)."""
    n, best, best_r = a.shape[1], np.zeros(a.shape[1]), float(b @ b)
    for mask in range((1 << n) - 1, 0, -1):
        cols = [i for i in range(n) if mask >> i & 1]
        x = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
        if (x >= 0).all() and (r := float(np.sum((a[:, cols] @ x - b) ** 2))) < best_r:
            best, best_r = np.bincount(cols, weights=x, minlength=n), r
            if len(cols) == n:  # the unconstrained solution is >= 0: the optimum
                break
    return best


class PrefillFit:
    """Prefill seconds from samples: ``a + b*n + c*n*(cached + n/2)``, robust least squares,
    a sample's weight halving every ``half_life`` newer samples (None: all weigh alike)."""

    def __init__(self, window: int = 4 * WINDOW, half_life: float | None = HALF_LIFE) -> None:
        self.half_life = half_life
        self._rows: collections.deque = collections.deque(maxlen=window)
        self._err: collections.deque = collections.deque(maxlen=window)
        self.coef: np.ndarray | None = None
        self.samples = 0

    @staticmethod
    def _features(n_new: float, n_cached: float) -> np.ndarray:
        return np.array([1.0, n_new, n_new * (n_cached + n_new / 2.0)])

    def predict(self, n_new: float, n_cached: float) -> float | None:
        if self.coef is None:
            return None
        return float(self._features(n_new, n_cached) @ self.coef) if n_new > 0 else 0.0

    def predict_many(self, n_new: np.ndarray, n_cached: np.ndarray) -> np.ndarray | None:
        """:meth:`predict` of each pair of ``n_new``, ``n_cached`` (1-D), at once."""
        if self.coef is None:
            return None
        n, c = np.asarray(n_new, np.float64), np.asarray(n_cached, np.float64)
        t = self.coef[0] + self.coef[1] * n + self.coef[2] * (n * (c + n / 2.0))
        return np.where(n > 0, t, 0.0)

    def observe(self, n_new: float, n_cached: float, seconds: float) -> None:
        check_sample("observe_prefill", n_new=n_new, n_cached=n_cached, seconds=seconds)
        pred = self.predict(n_new, n_cached)
        if pred is not None and (e := rel_err(pred, seconds)) is not None:
            self._err.append(e)
        self._rows.append((self._features(n_new, n_cached), float(seconds)))
        self.samples += 1
        if len(self._rows) >= MIN_SAMPLES:
            a = np.stack([r[0] for r in self._rows])
            y = np.array([r[1] for r in self._rows])
            scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
            keep = np.ones(y.size, bool)
            w = 1.0 / np.maximum(y, 1e-12)[:, None]  # relative errors: a stall weighs <= 1
            if self.half_life:  # the machine's speed drifts: recent samples weigh more
                w = w * 0.5 ** (np.arange(y.size - 1, -1, -1) / self.half_life)[:, None]
            for _ in range(3):  # least squares, then again without the outliers it exposes
                coef = _nnls((a / scale * w)[keep], (y * w[:, 0])[keep])
                rel = np.abs(a / scale @ coef - y) / np.maximum(y, 1e-12)
                new = rel <= max(3.0 * 1.4826 * float(np.median(rel)), 0.05)
                if new.sum() < MIN_SAMPLES or (new == keep).all():
                    break
                keep = new
            self.coef = coef / scale

    def median_error(self) -> float | None:
        return float(np.median(self._err)) if self._err else None
