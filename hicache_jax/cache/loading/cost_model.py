"""The cost model behind ``HiCacheConfig(load_policy="cost")``: seconds to move pages between two
tiers and to recompute tokens, fitted online (ARCHITECTURE.md, "Load or recompute"). It owns the
fits (:class:`LinkFit` per link, :class:`PrefillFit`), the load-or-recompute plan of a chain
(:meth:`CostModel.plan`) and the record of every decision against its actual time.

* A link (``"l2_l1"``, ``"l3_l2"``) costs ``latency + bytes / bandwidth``. Its fit is a
  Theil-Sen line (the median of pairwise slopes, then the median intercept) over the last
  :data:`WINDOW` completed transfers: a third of the samples can be outliers, and a link that
  slows mid-run moves the figure once half the window saw the new speed. Until
  :data:`MIN_SAMPLES` transfers completed, the link keeps its warm-up figure
  (:data:`WARMUP`: host-to-device over PCIe gen4-like 10 GB/s with 20 us latency; storage at
  1 GB/s with 1 ms).
* Prefill of ``n_new`` tokens after ``n_cached`` cached ones: the serving stack's callable
  ``prefill_cost(n_new, n_cached) -> seconds``, else a robust least-squares fit of
  ``a + b * n_new + c * n_new * (n_cached + n_new / 2)`` (linear work plus attention over the
  context; relative least squares with ``a, b, c >= 0`` solved as such, not clamped after,
  refitted without the samples whose relative residual exceeds 3 MADs; a sample's weight
  halves every :data:`HALF_LIFE` newer samples, so that the fit follows a machine whose speed
  drifts, as a shared CPU's does) to the samples reported by ``observe_prefill``. Without a
  callable and before
  :data:`MIN_SAMPLES` samples there is no prefill figure: decisions use the threshold policy
  (counted as ``cost_warmup_decisions``). A callable that raises or returns anything but a
  finite number >= 0 makes that decision fall back to the threshold policy
  (``cost_fallbacks``, the last error in ``cost_last_error``); it never picks a load.
* A plan never leaves a link unmeasured, and a link it has not measured is cheap to discover.
  While a link has ``k <`` :data:`MIN_SAMPLES` samples its cost in a plan is a pessimistic
  bound (:meth:`LinkFit.plan_cost`: with no sample the warm-up figure times
  :data:`PESSIMISM`, or for the L3 link any load infinite, so that a store's first read is a
  probe; after, the costliest of its recent samples scaled up to the size, which over-counts
  the latency, and with two sizes sampled at most :data:`PESSIMISM` times their line: a load is
  then taken only where it pays even so), and the plan loads at least a probe of ``2**k``
  pages (sizes spread apart: one size alone cannot tell latency from bandwidth) once what it
  spends (its bound, :meth:`LinkFit.worst`, less the recompute it replaces) fits the link's
  credit, each plan while the link is due adding :data:`PROBE_SHARE` of the chain's predicted
  recompute (a probe that does not fit waits; the first, of one page, is made whatever the
  credit, none where recompute is free); with no sample in its last
  :data:`PROBE_EVERY` plans, a probe of one page (``cost_probes``), so a warm-up figure or a
  link that got faster since is measured again rather than trusted forever. A probe may end
  inside a node: the load rule splits the node there (cache/loading/load_policy.py).
* With ``overlap`` (a caller that prefills while a copy is in flight), a plan also prices
  Cake's two-ended split of the chain at each page boundary ``s``: ``max(prefill(s | cached),
  load(rest of the chain)) + prefill(one page | cached + chain)`` plus the back's eviction
  charge, and takes the least split where it is strictly below every load-first-k candidate
  and the plan is not raised to a probe (``cost_splits``; ``last_split``: its front's tokens).
* Bytes: the cache reports the transfers' bytes of its spec; with ``observed_page_bytes``
  (``HiCacheConfig.cost_page_bytes``: a spec standing in for a larger model) they are scaled to
  ``page_bytes`` a page, the bytes the warm-up figure and the fits speak of.
* Every completed transfer and every prefill sample is predicted first, then joins the fit:
  ``stats()`` reports the median ``|predicted - actual| / actual`` of each.
* Every decision is recorded (:class:`Decision`): its predicted time, load plus prefill, with
  the figures it was made on, and its actual time once known: the share of its load's transfer
  (the L2 -> L1 acknowledgements come in dispatch order, as the loads were decided) plus the
  prefill the serving stack reports next with ``n_cached`` = the tokens on device after the
  load (the newest such decision). The prefill part is predicted for the tokens actually
  prefilled, on the decision's own figures. A request whose plan fetched from L3 (a prefetch
  decided here, :meth:`CostModel.settle_fetch`) is recorded as that plan, end to end: the
  fetch decision's predicted read + L2 -> L1 load + prefill against the read's measured time
  plus the load and the prefill of the load-back decision that followed it (same ``n_cached``),
  one record in place of the load-back's. ``stats()``: ``cost_decision_err_median``,
  ``cost_decision_records`` (decisions whose actual time is known), and its parts:
  ``cost_decision_read_err_median`` (the plans that fetched), ``cost_decision_load_err_median``
  (the decisions that loaded), ``cost_decision_prefill_err_median``, and
  ``cost_decision_err_median_without_read`` (each record's load + prefill alone); the settled
  records themselves are ``records`` (:class:`DecisionRecord`). Every L3 fetch decision's read
  time, predicted on the L3 link's figures at the decision, against the read's measured time:
  ``cost_fetch_err_median``, ``cost_fetch_records``.

Pure Python + numpy; the cache's thread only.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from hicache_jax.validation import is_real

__all__ = [
    "CostModel",
    "Decision",
    "DecisionRecord",
    "Fetch",
    "HALF_LIFE",
    "LinkFit",
    "MIN_SAMPLES",
    "PESSIMISM",
    "PROBE_EVERY",
    "PROBE_SHARE",
    "PrefillFit",
    "WARMUP",
    "WINDOW",
]

#: Probes spend at most this share of the planned chains' predicted recompute (a credit).
PROBE_SHARE = 0.1

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


def _check_sample(what: str, **values: Any) -> None:
    for name, v in values.items():
        if not is_real(v) or not math.isfinite(v) or v < 0:
            raise ValueError(f"{what}: {name}={v!r} must be a finite number >= 0")


def _rel_err(pred: float, actual: float) -> float | None:
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

    def __init__(
        self, latency_s: float, bytes_per_s: float, window: int = WINDOW, trust_warmup: bool = True
    ) -> None:
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
        _check_sample("observe_transfer", nbytes=nbytes, seconds=seconds)
        if nbytes == 0:
            return
        err = _rel_err(self.predict(nbytes), seconds)
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
    n, best_r = a.shape[1], float(b @ b)
    best: np.ndarray = np.zeros(n)
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
        _check_sample("observe_prefill", n_new=n_new, n_cached=n_cached, seconds=seconds)
        pred = self.predict(n_new, n_cached)
        if pred is not None and (e := _rel_err(pred, seconds)) is not None:
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
            coef = np.zeros(a.shape[1])
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


class Decision:
    """One load-or-recompute decision: predicted seconds and, once known, actual seconds.

    Attributes:
        load_s: predicted seconds of its load over every hop (0.0 when nothing is loaded).
        nbytes: bytes it loads over L2 -> L1.
        cached_after: tokens on device after the load (the prefill's ``n_cached``).
        prefill: ``(n_new, n_cached) -> seconds`` on the figures the decision was made on.
        read_s: the L3 -> L2 hop's share of ``load_s`` (a fetch decision's read; else 0.0).
        load_actual: the measured seconds of its load (None until acknowledged).
        read_actual: a fetch decision's measured read seconds (None until it landed).
    """

    __slots__ = (
        "load_s",
        "nbytes",
        "cached_after",
        "prefill",
        "read_s",
        "load_actual",
        "read_actual",
    )

    def __init__(
        self,
        load_s: float,
        nbytes: int,
        cached_after: int,
        prefill: Callable[[int, int], float],
        read_s: float = 0.0,
    ) -> None:
        self.load_s, self.nbytes, self.cached_after = load_s, nbytes, cached_after
        self.prefill, self.read_s = prefill, read_s
        self.load_actual: float | None = 0.0 if nbytes == 0 else None
        self.read_actual: float | None = None


class Fetch(NamedTuple):
    """An L3 fetch decision as its read is checked (:meth:`CostModel.settle_fetch`): the L3
    link's figures it was decided on and the plan's :class:`Decision` (None: not recorded)."""

    latency_s: float
    bytes_per_s: float
    decision: Decision | None = None


class DecisionRecord(NamedTuple):
    """A settled decision: its prefill's tokens, its predicted and actual load (L2 -> L1) and
    prefill seconds, ``sample``: the index of the prefill sample that settled it (the
    ``observe_prefill`` calls counted from 0), and, for a plan that fetched from L3, its read's
    predicted and actual seconds (0.0 for a load-back decision alone)."""

    n_new: int
    n_cached: int
    load_pred: float
    load_actual: float
    prefill_pred: float
    prefill_actual: float
    sample: int
    read_pred: float = 0.0
    read_actual: float = 0.0

    @property
    def pred(self) -> float:
        return self.read_pred + self.load_pred + self.prefill_pred

    @property
    def actual(self) -> float:
        return self.read_actual + self.load_actual + self.prefill_actual


def _median_rel(pairs: list[tuple[float, float]]) -> float | None:
    errs = [abs(p - a) / a for p, a in pairs if a > 0]
    return float(np.median(errs)) if errs else None


class CostModel:
    """The links' and the prefill's fitted figures, and the load-or-recompute plan of a chain.

    Args:
        page_bytes: bytes of one page on every tier.
        page_size: tokens per page.
        prefill_cost: the serving stack's ``(n_new, n_cached) -> seconds``, or None (samples).
        eviction_weight: the expected share of an evicted device page that a later request
            would have hit; a load that evicts is charged this share of what getting the
            evicted pages back costs: their reload from L2 (the write policies keep a host
            copy of what L1 evicts while L2 has room) or their recompute, the cheaper.
        observed_page_bytes: bytes of one page in the transfers reported to
            :meth:`observe_transfer` and :meth:`settle_fetch` (None: ``page_bytes``); they
            are scaled to ``page_bytes`` a page.
        group_bytes: with layer groups, the bytes besides the full-attention pages that a
            load of each of ``pages`` pages (an int64 array) moves with them, in observed
            bytes: the window groups' pages a continuation at its end reads, a checkpoint's
            state slot (ARCHITECTURE.md, "Recurrent state"); None: nothing besides.
    """

    def __init__(
        self,
        page_bytes: int,
        page_size: int,
        prefill_cost: Callable[[int, int], float] | None = None,
        eviction_weight: float = 0.5,
        observed_page_bytes: int | None = None,
        group_bytes: Callable[[np.ndarray], np.ndarray] | None = None,
    ) -> None:
        self.page_bytes, self.page_size = int(page_bytes), int(page_size)
        self.byte_scale = self.page_bytes / int(observed_page_bytes or page_bytes)
        self.group_bytes = group_bytes
        self.prefill_cost, self.eviction_weight = prefill_cost, float(eviction_weight)
        self.links = {k: LinkFit(*v, trust_warmup=k != "l3_l2") for k, v in WARMUP.items()}
        self.prefill_fit = PrefillFit()
        self.n: collections.Counter[str] = collections.Counter()
        self.last_error: str | None = None
        self.last_decision: Decision | None = None  # of the last plan() that decided
        self.last_split: int | None = None  # the last plan()'s split front (None: no split)
        # decisions waiting for their load's acknowledgement (dispatch order; None: a load the
        # model did not decide, which only takes its bytes), then for their prefill sample
        self._awaiting_load: collections.deque = collections.deque(maxlen=4 * WINDOW)
        self._awaiting_prefill: collections.deque = collections.deque(maxlen=4 * WINDOW)
        # fetch decisions whose read landed, waiting for the load-back and prefill after it
        self._awaiting_fetched: collections.deque = collections.deque(maxlen=4 * WINDOW)
        self.records: collections.deque[DecisionRecord] = collections.deque(maxlen=4 * WINDOW)
        self._fetch_err: collections.deque = collections.deque(maxlen=4 * WINDOW)

    def observe_transfer(
        self, link: str, nbytes: float, seconds: float, sample: bool = True
    ) -> None:
        """A completed transfer; ``sample=False``: it settles the decisions it served but does
        not join the link's fit (a time that holds a compile)."""
        if link not in self.links:
            raise ValueError(f"link={link!r} must be one of {sorted(self.links)}")
        _check_sample("observe_transfer", nbytes=nbytes, seconds=seconds)
        nbytes = nbytes * self.byte_scale
        if sample:
            self.links[link].observe(nbytes, seconds)
        if link == "l2_l1":
            self._settle_load(nbytes, seconds)

    def observe_prefill(self, n_new: float, n_cached: float, seconds: float) -> None:
        self.prefill_fit.observe(n_new, n_cached, seconds)
        self._settle_prefill(n_new, n_cached, seconds)

    def load_bytes(self, pages: Any) -> np.ndarray:
        """Bytes (float64, in ``page_bytes`` units) a load of each of ``pages`` pages moves:
        the full-attention pages and, with layer groups, what they carry (``group_bytes``)."""
        n = np.asarray(pages, np.int64)
        out = n * float(self.page_bytes)
        if self.group_bytes is not None:
            out = out + np.asarray(self.group_bytes(n), np.float64) * self.byte_scale
        return out

    def load_nbytes(self, pages: int) -> int:
        """:meth:`load_bytes` of one load of ``pages`` pages, an int."""
        return int(self.load_bytes(np.array([pages]))[0])

    # -- decision records -----------------------------------------------------------------------

    def track(self, decisions: list[tuple[Decision | None, int]]) -> None:
        """The decisions of one dispatched load-back, in its order, as ``(decision, nbytes
        it loads)`` (decision None: a chain the model did not decide, e.g. a fallback)."""
        for d, nbytes in decisions:
            if nbytes:
                self._awaiting_load.append((d, nbytes))
            elif d is not None:
                self._awaiting_prefill.append(d)

    def _settle_load(self, nbytes: float, seconds: float) -> None:
        """One acknowledged load of ``nbytes``: the oldest tracked loads it covers take their
        share of its seconds."""
        left = nbytes
        while self._awaiting_load and self._awaiting_load[0][1] <= left:
            d, b = self._awaiting_load.popleft()
            left -= b
            if d is not None:
                d.load_actual = seconds * b / nbytes
                self._awaiting_prefill.append(d)

    @staticmethod
    def _newest(waiting: collections.deque, n_cached: float) -> Decision | None:
        """Take the newest decision of ``waiting`` whose prefill starts at ``n_cached``."""
        for i in range(len(waiting) - 1, -1, -1):
            if waiting[i].cached_after == n_cached:
                d = waiting[i]
                del waiting[i]
                return d
        return None

    def _settle_prefill(self, n_new: float, n_cached: float, seconds: float) -> None:
        d = self._newest(self._awaiting_prefill, n_cached)
        if d is None:
            return
        f = self._newest(self._awaiting_fetched, n_cached)  # the L3 fetch this load followed
        try:
            prefill = float((f or d).prefill(int(n_new), int(n_cached)))
        except Exception:  # the serving stack's callable: no prediction to compare
            return
        # measured before they wait here: the load when acknowledged (0.0 when it loaded
        # nothing), the fetch's read when it landed
        load_actual, read_actual = d.load_actual, 0.0 if f is None else f.read_actual
        assert load_actual is not None and read_actual is not None
        rec = (
            DecisionRecord(
                int(n_new),
                int(n_cached),
                d.load_s,
                load_actual,
                prefill,
                float(seconds),
                self.prefill_fit.samples - 1,
            )
            if f is None
            else DecisionRecord(
                int(n_new),
                int(n_cached),
                f.load_s - f.read_s,
                load_actual,
                prefill,
                float(seconds),
                self.prefill_fit.samples - 1,
                f.read_s,
                read_actual,
            )
        )
        if rec.actual > 0 and math.isfinite(rec.pred):
            self.n["cost_decision_records"] += 1
            self.records.append(rec)

    def fetch_figures(self) -> tuple[float, float]:
        """The L3 link's ``(latency, bytes/s)`` now: what an L3 fetch is decided on."""
        fit = self.links["l3_l2"]
        return fit.latency_s, fit.bytes_per_s

    def settle_fetch(self, fetch: Fetch, nbytes: float, seconds: float) -> None:
        """A fetch decided on ``fetch``'s figures read ``nbytes`` in ``seconds``: its
        predicted read time (for those bytes) against the measured one; its decision then
        waits for the load-back and the prefill after it (its end-to-end record,
        :meth:`_settle_prefill`)."""
        if nbytes > 0 and seconds > 0:
            pred = fetch.latency_s + nbytes * self.byte_scale / fetch.bytes_per_s
            self._fetch_err.append(abs(pred - seconds) / seconds)
            self.n["cost_fetch_records"] += 1
            d = fetch.decision
            if d is not None and math.isclose(d.nbytes, nbytes * self.byte_scale):  # as planned
                d.read_actual = float(seconds)
                self._awaiting_fetched.append(d)

    def _prefill_predictor(self) -> Callable[[int, int], float]:
        """The prefill figure as it stands now (a copy of the fit's coefficients)."""
        if self.prefill_cost is not None:
            return self.prefill_cost
        coef = np.array(self.prefill_fit.coef)
        return lambda n, c: float(PrefillFit._features(n, c) @ coef) if n > 0 else 0.0

    def prefill_seconds(self, n_new: int, n_cached: int) -> float:
        """Seconds to prefill; raises ValueError where the figure is unusable."""
        if n_new <= 0:
            return 0.0
        if self.prefill_cost is None:
            v = self.prefill_fit.predict(n_new, n_cached)
            if v is None:
                raise LookupError("no prefill samples yet")
            return v
        v = self.prefill_cost(int(n_new), int(n_cached))
        if not is_real(v) or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"prefill_cost({n_new}, {n_cached}) returned {v!r}: expected a "
                "finite number of seconds >= 0"
            )
        return float(v)

    def plan(
        self,
        chain_tokens: list[int],
        cached: int,
        free_pages: int,
        cap_tokens: int | None,
        links: tuple[str, ...] = ("l2_l1",),
        probe: tuple[str, ...] | None = None,
        overlap: bool = False,
        ends: Callable[[int], int] | None = None,
    ) -> int | None:
        """How many tokens of a host chain to load (root-first; a page multiple), the rest
        recomputed, for the least predicted time: ``load(pages) + prefill(rest + one page,
        cached + loaded) + eviction charge`` over the chain's node boundaries, ``load`` summed
        over ``links`` (the hops, e.g. ``("l3_l2", "l2_l1")``, each at
        :meth:`LinkFit.plan_cost`); at least a probe (see the module doc; ``probe``: the links
        it may probe, default ``links``), which may end inside a node.
        ``overlap`` (the caller can load while it prefills): also the two-ended splits
        (:meth:`_split_times`); where one is least, ``last_split`` is its front's tokens
        (recomputed first, from ``cached``) and the return value the back's tokens (loaded
        at once, concurrently); else ``last_split`` is None.
        ``ends`` (with window or STATE groups): of a load of the chain's first ``n`` tokens,
        the longest that serves; each candidate is then priced as that load (it serves no
        further), so the least time is over loads that serve as far as they go.
        None: no usable prefill figure (the caller falls back, counted)."""
        self.last_split = None
        ps, fits = self.page_size, [self.links[k] for k in links]
        total = sum(chain_tokens)
        loaded = np.cumsum([0] + list(chain_tokens))
        if cap_tokens is not None:
            loaded = loaded[loaded <= max(cap_tokens, 0)]
        if ends is not None:  # (0 first: t[0] is the whole chain recomputed)
            loaded = np.unique(np.array([0, *(ends(int(n)) for n in loaded[1:])], np.int64))
        try:
            t = self._candidate_times(loaded, total, cached, free_pages, fits)
            t0 = float(t[0])  # the whole chain recomputed
            best = int(loaded[int(np.argmin(t))])  # the first of the least
            split = (
                self._split_times(total, cached, free_pages, cap_tokens, fits) if overlap else None
            )
        except LookupError:
            self.n["cost_warmup_decisions"] += 1
            return None
        except Exception as exc:  # the serving stack's callable: counted, never a wrong load
            self.n["cost_fallbacks"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            return None
        self.n["cost_decisions"] += 1
        for f in fits:
            f.plans_since_sample += 1
        due = [
            f
            for f in (fits if probe is None else [self.links[k] for k in probe])
            if f.needs_probe()
        ]
        for f in due:
            f.probe_credit += PROBE_SHARE * t0
        probe_at = self._probe_tokens(
            total,
            cached,
            cap_tokens,
            due,
            fits,
            min((f.probe_credit for f in due), default=0.0),
            t0,
        )
        if probe_at:
            spent = self._probe_spend(probe_at, total, cached, fits)
            for f in due:
                f.probe_credit -= spent
        if best < probe_at:
            best = probe_at
            self.n["cost_probes"] += 1
        elif split is not None and split[1] < float(np.min(t)):  # strictly less: a tie loads
            front = int(split[0])
            self.last_split, self.n["cost_splits"] = front, self.n["cost_splits"] + 1
            nbytes = self.load_nbytes((total - front) // ps)
            self.last_decision = self._decision(nbytes, cached + total, links)
            return total - front
        self.n["cost_partial_loads"] += 0 < best < total
        nbytes = self.load_nbytes(best // ps)
        self.last_decision = self._decision(nbytes, cached + best, links)
        return best

    def _decision(self, nbytes: int, cached_after: int, links: tuple[str, ...]) -> Decision:
        """A plan's :class:`Decision` on the figures as they stand (its load over ``links``)."""
        hops = {k: self.links[k].predict(nbytes) for k in links}
        return Decision(
            sum(hops.values()),
            nbytes,
            cached_after,
            self._prefill_predictor(),
            hops.get("l3_l2", 0.0),
        )

    def _candidate_times(
        self, loaded: np.ndarray, total: int, cached: int, free_pages: int, fits: list[LinkFit]
    ) -> np.ndarray:
        """:meth:`plan`'s predicted seconds for loading each of ``loaded`` tokens: the load
        over ``fits``, the prefill of the rest plus a page, the eviction charge. Raises
        LookupError (no prefill figure) or the callable's error."""
        ps, pages = self.page_size, loaded // self.page_size
        t = sum(f.plan_costs(self.load_bytes(pages)) for f in fits)
        pre = self._prefill_many(total - loaded + ps, cached + loaded)
        return t + pre + self._eviction_charge(pages, free_pages)

    def _split_times(
        self, total: int, cached: int, free_pages: int, cap_tokens: int | None, fits: list[LinkFit]
    ) -> tuple[int, float] | None:
        """The least-time two-ended split of a chain of ``total`` tokens as ``(front tokens,
        seconds)``: the front ``[0, s)`` recomputed while the back ``[s, total)`` is loaded
        (the load dispatched first), then the rest: ``max(prefill(s | cached), load(total -
        s)) + prefill(one page | cached + total)`` plus the back's eviction charge, over the
        page boundaries ``0 < s < total`` (the back within ``cap_tokens``; at most 512 evenly
        spread). None: no split (a chain of one page, or the cap leaves no back)."""
        ps = self.page_size
        pages = total // ps
        lo = 1 if cap_tokens is None else max(1, pages - max(cap_tokens, 0) // ps)
        if pages < 2 or lo > pages - 1:
            return None
        front = np.unique(np.linspace(lo, pages - 1, min(512, pages - lo)).astype(np.int64)) * ps
        back = (total - front) // ps
        load = sum(f.plan_costs(self.load_bytes(back)) for f in fits)
        t = (
            np.maximum(self._prefill_many(front, np.full_like(front, cached)), load)
            + self.prefill_seconds(ps, cached + total)
            + self._eviction_charge(back, free_pages)
        )
        i = int(np.argmin(t))
        return int(front[i]), float(t[i])

    def _prefill_many(self, n_new: np.ndarray, n_cached: np.ndarray) -> np.ndarray:
        """Prefill seconds of each pair (the fit's, or the callable's, each checked); raises
        LookupError (no figure) or the callable's error."""
        fit = self.prefill_fit if self.prefill_cost is None else None
        if fit is not None:
            t = fit.predict_many(n_new, n_cached)
            if t is None:
                raise LookupError("no prefill samples yet")
            return t
        return np.array(
            [
                self.prefill_seconds(n, c)
                for n, c in zip(np.asarray(n_new).tolist(), np.asarray(n_cached).tolist())
            ],
            np.float64,
        )

    def _eviction_charge(self, pages: np.ndarray, free_pages: int) -> np.ndarray:
        """The charge of loading each of ``pages`` pages into ``free_pages`` free ones: the
        evicted pages' reload from L2 or their recompute, the cheaper, times the weight."""
        evicted = np.maximum(0, pages - free_pages)
        if not evicted.any():
            return np.zeros(evicted.shape)
        redo = self._prefill_many(evicted * self.page_size, 0 * evicted)
        reload = self.links["l2_l1"].plan_costs(self.load_bytes(evicted))
        return np.where(evicted > 0, self.eviction_weight * np.minimum(reload, redo), 0.0)

    def _probe_spend(self, ntok: int, total: int, cached: int, fits: list[LinkFit]) -> float:
        """What a probe of ``ntok`` tokens spends of the credit: its pessimistic cost over
        ``fits`` less the recompute it replaces (what it adds to the request's time at worst;
        none is counted where the prefill figure fails here)."""
        bound = sum(f.worst(self.load_nbytes(ntok // self.page_size)) for f in fits)
        try:
            saved = self.prefill_seconds(total + self.page_size, cached) - self.prefill_seconds(
                total - ntok + self.page_size, cached + ntok
            )
        except Exception:  # the serving stack's callable: the bound alone
            saved = 0.0
        return bound - max(0.0, saved)

    def _probe_tokens(
        self,
        total: int,
        cached: int,
        cap_tokens: int | None,
        due: list[LinkFit],
        fits: list[LinkFit],
        budget: float,
        recompute: float,
    ) -> int:
        """Tokens a probe loads (0: none due, or none within ``budget`` seconds, the due links'
        credit): ``2**k`` pages while a due link has ``k <`` :data:`MIN_SAMPLES` samples,
        then one; never past the chain or the cap; none while what it spends
        (:meth:`_probe_spend`) exceeds ``budget``; a due link without any sample gets at least
        one page where the chain's predicted ``recompute`` is not free (its warm-up figure is
        a guess: a prefill fit that under-predicts would otherwise starve the credit)."""
        if not due or total <= 0:
            return 0
        k = min(f.samples for f in due)
        most = total // self.page_size
        if cap_tokens is not None:
            most = min(most, cap_tokens // self.page_size)
        pages = min(1 << k if k < MIN_SAMPLES else 1, most)
        if pages and self._probe_spend(pages * self.page_size, total, cached, fits) > budget:
            pages = 0  # the credit grows until it fits: a smaller one would repeat a size
        if k == 0 and recompute > 0:  # no sample to bound it: one page, the least that gives one
            pages = max(pages, min(1, most))
        return pages * self.page_size

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: self.n[k]
            for k in (
                "cost_decisions",
                "cost_partial_loads",
                "cost_probes",
                "cost_splits",
                "cost_fallbacks",
                "cost_warmup_decisions",
            )
        }
        for name, fit in self.links.items():
            out[f"cost_{name}_latency_s"] = fit.latency_s
            out[f"cost_{name}_gbps"] = fit.bytes_per_s / 1e9
            out[f"cost_{name}_samples"] = fit.samples
            out[f"cost_{name}_pred_err_median"] = fit.median_error()
        coef = self.prefill_fit.coef
        out["cost_prefill_source"] = "callable" if self.prefill_cost is not None else "samples"
        out["cost_prefill_samples"] = self.prefill_fit.samples
        out["cost_prefill_coef"] = None if coef is None else [float(c) for c in coef]
        out["cost_prefill_pred_err_median"] = self.prefill_fit.median_error()
        out["cost_last_error"] = self.last_error
        out["cost_decision_records"] = self.n["cost_decision_records"]
        # one copy (in C, under the GIL): stats() may run on another thread while the owner
        # appends, and iterating the deque itself would then raise
        records = tuple(self.records)
        out["cost_decision_err_median"] = _median_rel([(r.pred, r.actual) for r in records])
        # the two parts of the decisions' error: their loads (those that loaded), prefills
        out["cost_decision_load_err_median"] = _median_rel(
            [(r.load_pred, r.load_actual) for r in records if r.load_pred > 0]
        )
        out["cost_decision_prefill_err_median"] = _median_rel(
            [(r.prefill_pred, r.prefill_actual) for r in records]
        )
        out["cost_decision_read_err_median"] = _median_rel(
            [(r.read_pred, r.read_actual) for r in records if r.read_pred > 0]
        )
        out["cost_decision_err_median_without_read"] = _median_rel(
            [(r.load_pred + r.prefill_pred, r.load_actual + r.prefill_actual) for r in records]
        )
        out["cost_fetch_records"] = self.n["cost_fetch_records"]
        out["cost_fetch_err_median"] = (
            float(np.median(self._fetch_err)) if self._fetch_err else None
        )
        return out
