"""Load or recompute on a real engine: TTFT of never-load, always-load and the cost policy with
L3 on a throttled file store, in one run (ARCHITECTURE.md, "Load or recompute").

The reference engine (serial, CPU) serves ``--requests`` prompts, each a ``--doc-tokens``
document that only L3 holds (written there first by a plain file store; L1 and L2 start empty)
followed by a ``--question-tokens`` question. L3 is ``throttle+file://``
(docs/guides/load-or-recompute.md, "A slow L3 on purpose") at bandwidths set from this
machine's prefill, measured in the same run: ``--ratios`` x the bandwidth at which loading a
document costs what recomputing it does (< 1: L3 slower than recompute, as in sglang#36179;
> 1: faster), each with ``--latency-ms``.

Policies, each on a fresh cache and engine over the same store, their requests interleaved
(one request on each in turn, the order rotating: a drift in the machine's load meets all;
after each request its cache's transfers are waited for, outside any TTFT, so that one cache's
write-through copies do not run inside the next request's prefill):
* never: no L3 prefetch, nothing loaded back (every document recomputed);
* always: the prompt prefetched (``wait_complete``) and everything L3 and L2 hold loaded;
* cost: ``load_policy="cost"`` prefetches and loads what its fitted model says is cheaper.
Every engine first serves the same warm-up requests: prompts L3 does not hold (two of each
of a few lengths; three documents of the requests' length, each served twice with another
question: the second time a prefill of the question after the cached document) and then 12
whose documents it holds, so that the cost policy's prefill fit and L3 link
have samples and every shape is compiled before the measured requests.

Judged (same run): at each throttle the cost policy's TTFT p50 <= 1.05x the better of never and
always; the generated tokens identical across policies; the median |predicted - actual| / actual
of the cost policy's decisions (``stats()["cost_decision_err_median"]``: a request's plan end to
end, its L3 read where it fetched + load + prefill) <= 0.20.
Also printed: the fitted L3 link's prediction error and its fitted bandwidth against the
throttle's; the decision error without the L3 read (each record's load + prefill alone), its
parts (the reads', the loads', the prefills'), the L3 fetch decisions'
error (their predicted read time against the read's), the decision error the previous prefill
fit (every sample weighing alike) makes on the same records, and the noise floor (each shape's
records predicted by the one time that fits them best, in hindsight).

Run: ``python -m benchmarks.bench_load_policy [--quick] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

import numpy as np

from benchmarks.common import add_model_flags, model_config, parse_quick, print_table, write_json
from hicache_jax import HiCacheConfig
from hicache_jax.cache.hicache import HiCache
from hicache_jax.cache.loading.cost_model import PrefillFit
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.model import DecoderModel

POLICIES = ("never", "always", "cost")
#: warm-up requests whose documents L3 holds: the cost model measures its link (probes of 1,
#: 2, 4, 8 pages, each once its credit allows: ~10 requests at the quick size, where a probe's
#: 1 ms latency is a fifth of a recompute)
WARM = 12
#: ``--quick``: a small model and few requests (a smoke run; its ratios mean little).
QUICK = dict(
    doc_tokens=256,
    question_tokens=16,
    requests=3,
    ratios="0.3,3",
    layers=2,
    d_model=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    chunk_size=256,
)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=32)
    p.add_argument(
        "--requests",
        type=int,
        default=32,
        help="measured requests per run (32: a p50 of 16 moved 5-10%% between runs)",
    )
    p.add_argument(
        "--ratios",
        default="0.3,1,3",
        help="L3 bandwidths as multiples of the load-equals-recompute bandwidth",
    )
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--chunk-size", type=int, default=512)
    add_model_flags(p)
    return parse_quick(p, argv, QUICK)


class _Bench:
    def __init__(self, a, root: str):
        self.a, self.root = a, root
        self.cfg = model_config(a)
        self.model = DecoderModel(self.cfg, seed=0)
        self.spec = self.model.kv_spec(a.page_size)
        rng = np.random.default_rng(0)
        v = self.cfg.vocab_size
        n = a.requests
        self.docs = [rng.integers(1, v, a.doc_tokens).astype(np.int32) for _ in range(n + WARM)]
        self.prompts = [
            np.concatenate([d, rng.integers(1, v, a.question_tokens)]).astype(np.int32)
            for d in self.docs
        ]
        # the first WARM documents are warm-up requests: L3 hits before the measured ones
        self.warm_prompts, self.prompts = self.prompts[:WARM], self.prompts[WARM:]
        # warm-up: prompts L3 does not hold, two of each length (the second is a prefill sample
        # of a compiled shape), lengths spread over what the measured requests prefill
        total = a.doc_tokens + a.question_tokens
        lengths = sorted({max(a.page_size + 1, int(total * f)) for f in (0.05, 0.25, 0.5)})
        self.warmup = [rng.integers(1, v, k).astype(np.int32) for k in lengths for _ in (0, 1)]
        # ... then three of the requests' length, each twice with another question: the second
        # time its document is on device (a prefill of the question after the cached document,
        # the shape of a measured request that loads)
        doc = [rng.integers(1, v, a.doc_tokens).astype(np.int32) for _ in range(3)]
        self.warmup += [
            np.concatenate([d, rng.integers(1, v, a.question_tokens)]).astype(np.int32)
            for _ in (0, 1)
            for d in doc
        ]
        self.pages = (n + WARM + len(self.warmup)) * (-(-total // a.page_size) + 2)

    def cache(self, storage: str | None, **cfg) -> HiCache:
        base = dict(
            device_pages=self.pages,
            host_pages=self.pages,
            storage=storage,
            load_back_threshold=self.a.page_size,
            prefetch_policy="wait_complete",
            storage_write_policy="write_back",
            write_policy="write_through",
        )
        return HiCache(self.spec, HiCacheConfig(**(base | cfg)))

    def engine(self, cache: HiCache, prefetch: bool) -> Engine:
        return Engine(
            self.model,
            cache,
            mode="hicache",
            chunk_size=self.a.chunk_size,
            prefill_bucket=16,
            layerwise=False,
            prefetch=prefetch,
        )

    def populate(self) -> None:
        """Every document into the plain file store (write-through to L3)."""
        cache = self.cache(f"file://{self.root}", storage_write_policy="write_through")
        self.engine(cache, False).generate(self.docs, 1)
        cache.flush()
        assert cache.stats()["l3_put_pages_stored"] >= len(self.docs) * (
            self.a.doc_tokens // self.a.page_size
        )
        cache.close()
        # the copy programs of the reads of 1, 2-8 and more pages (the cost policy's probes)
        # compile here, on a cache of their own (jitted once a process): not inside a
        # measured request (a compile is 0.2-0.5 s)
        cache = self.cache(f"file://{self.root}")
        ps = self.a.page_size
        self.engine(cache, True).generate(
            [self.docs[0][: k * ps + 1] for k in (1, 2, 8) if k * ps < self.a.doc_tokens], 1
        )
        cache.close()

    def calibrate(self) -> tuple[float, float]:
        """Median TTFT of a whole prompt recomputed, and of its question alone (the document
        on device): their difference is what recomputing the document costs."""
        cache = self.cache(None)
        eng = self.engine(cache, False)
        eng.generate(self.warmup, 1)
        rng = np.random.default_rng(1)
        full, tail = [], []
        for _ in range(5):
            p = rng.integers(1, self.cfg.vocab_size, self.prompts[0].size).astype(np.int32)
            full.append(eng.generate([p], 1)[0].record.ttft_s)
            tail.append(eng.generate([p], 1)[0].record.ttft_s)
        cache.close()
        return statistics.median(full), statistics.median(tail)

    def run(self, url: str) -> dict:
        """The three policies over the store at ``url``, each on its own cache and engine,
        warmed up alike; the measured requests interleaved (request by request, the order
        rotating), so that a drift in the machine's load meets every policy alike."""
        caches = {
            "never": self.cache(url, load_back_threshold=1 << 40),
            "always": self.cache(url),
            "cost": self.cache(url, load_policy="cost"),
        }
        engines = {p: self.engine(c, p != "never") for p, c in caches.items()}
        shadow = _Shadow(caches["cost"])
        for eng in engines.values():
            eng.generate(self.warmup, 1)
            eng.generate(self.warm_prompts, 2)
        gens = {p: [] for p in POLICIES}
        for i, prompt in enumerate(self.prompts):
            for p in POLICIES[i % 3 :] + POLICIES[: i % 3]:
                gens[p].append(engines[p].generate([prompt], 2)[0])
                caches[p].flush()  # its copies done: none runs inside the next one's TTFT
        out = {}
        for p, cache in caches.items():
            st = cache.stats() | (shadow.stats() if p == "cost" else {})
            cache.close()
            out[p] = {
                "ttft_s": [g.record.ttft_s for g in gens[p]],
                "tokens": [g.tokens.tolist() for g in gens[p]],
                "logits": [g.first_logits for g in gens[p]],
                "l3_hit_tokens": sum(g.record.host_hit_tokens for g in gens[p]),
                "stats": {
                    k: v for k, v in st.items() if k.startswith(("cost_", "l3_prefetch", "shadow_"))
                },
            }
        return out


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


class _Shadow:
    """The previous prefill fit (all samples weigh alike: ``PrefillFit(half_life=None)``) fed
    the cost cache's own prefill samples, so that its decisions' error is computed on the same
    records as the cache's fit: each record's load parts as they were, its prefill predicted by
    this fit just before the record's sample joined it. Also the noise floor: the records of
    each shape (``n_new``, ``n_cached``) predicted by the one time that fits them best in
    hindsight (the least median relative error): what the run's noise leaves to a predictor
    that gives one shape one figure."""

    def __init__(self, cache: HiCache) -> None:
        self.cost, self.samples = cache._cost, []
        observe = cache.observe_prefill

        def observe_prefill(n_new: int, n_cached: int, seconds: float) -> None:
            # kept only: the shadow fit is replayed in stats(), not inside the cost policy's
            # TTFT (a fit's solve is 0.3-0.5 ms, the engine reports before the first token)
            self.samples.append((n_new, n_cached, seconds))
            observe(n_new, n_cached, seconds)

        cache.observe_prefill = observe_prefill

    def stats(self) -> dict:
        fit, self.pred = PrefillFit(half_life=None), []
        for n_new, n_cached, seconds in self.samples:  # each predicted before it joins
            self.pred.append(fit.predict(n_new, n_cached))
            fit.observe(n_new, n_cached, seconds)
        recs = list(self.cost.records)
        actual = [r.actual for r in recs]  # read (a plan that fetched) + load + prefill
        prev = [
            abs(r.read_pred + r.load_pred + self.pred[r.sample] - a) / a
            for r, a in zip(recs, actual)
            if self.pred[r.sample] is not None
        ]
        shapes: dict = {}
        for a, r in zip(actual, recs):
            shapes.setdefault((r.n_new, r.n_cached), []).append(a)
        floor = []
        for acts in shapes.values():  # the constant of least median relative error
            v = np.asarray(acts)
            floor += min(
                (np.abs(m - v) / v for m in np.linspace(v.min(), v.max(), 257)), key=np.median
            ).tolist()
        med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
        return {
            "shadow_prev_fit_decision_err_median": med(prev),
            "shadow_noise_floor_err_median": med(floor),
        }


def main(argv=None) -> int:
    a = _args(argv)
    ratios = [float(r) for r in a.ratios.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench_load_policy_") as root:
        b = _Bench(a, root)
        b.populate()
        full_s, tail_s = b.calibrate()
        doc_bytes = a.doc_tokens // a.page_size * b.spec.page_bytes
        spare = full_s - tail_s - a.latency_ms / 1e3  # seconds a load may take to break even
        equal_gbps = doc_bytes / max(spare, 1e-4) / 1e9
        print(
            f"model {b.cfg.num_layers}L d{b.cfg.d_model} {b.cfg.dtype}; {a.requests} requests "
            f"of {a.doc_tokens} + {a.question_tokens} tokens, page {a.page_size}; document "
            f"{doc_bytes / 2**20:.2f} MiB of KV; TTFT recomputed {1e3 * full_s:.1f} ms, "
            f"document on device {1e3 * tail_s:.1f} ms: load = recompute at "
            f"{equal_gbps:.3f} GB/s with {a.latency_ms:g} ms latency"
        )
        rows, erows, results, fails = [], [], [], []
        for ratio in ratios:
            g = equal_gbps * ratio
            url = f"throttle+file://{root}?gbps={g:.6g}&latency_ms={a.latency_ms:g}"
            res = b.run(url)
            p50 = {p: statistics.median(r["ttft_s"]) for p, r in res.items()}
            better = min(p50["never"], p50["always"])
            cost_ratio = p50["cost"] / better
            same = all(res[p]["tokens"] == res["never"]["tokens"] for p in POLICIES)
            logit_diff = max(
                float(np.max(np.abs(x - y)))
                for p in POLICIES
                for x, y in zip(res[p]["logits"], res["never"]["logits"])
            )
            cst = res["cost"]["stats"]
            err = cst["cost_decision_err_median"]
            l3_err = cst["cost_l3_l2_pred_err_median"]
            ok = cost_ratio <= 1.05 and same and (err is None or err <= 0.20)
            if not ok:
                fails.append(
                    f"L3 {ratio:g}x: cost/better {cost_ratio:.3f}, outputs identical "
                    f"{same}, decision error {err}"
                )
            rows.append(
                (
                    f"{ratio:g}x ({g:.3g} GB/s)",
                    1e3 * p50["never"],
                    1e3 * p50["always"],
                    1e3 * p50["cost"],
                    f"{cost_ratio:.3f}",
                    f"{res['cost']['l3_hit_tokens']}/{res['always']['l3_hit_tokens']}",
                    "-" if err is None else f"{err:.3f} ({cst['cost_decision_records']})",
                    "-" if l3_err is None else f"{l3_err:.3f}",
                    f"{cst['cost_l3_l2_gbps']:.3g}",
                    "yes" if same else "NO",
                    "ok" if ok else "FAIL",
                )
            )
            erows.append(
                (
                    f"{ratio:g}x",
                    *(
                        _f(cst[k])
                        for k in (
                            "cost_decision_err_median",
                            "shadow_prev_fit_decision_err_median",
                            "shadow_noise_floor_err_median",
                            "cost_decision_err_median_without_read",
                            "cost_decision_read_err_median",
                            "cost_decision_load_err_median",
                            "cost_decision_prefill_err_median",
                        )
                    ),
                    f"{_f(cst['cost_fetch_err_median'])} ({cst['cost_fetch_records']})",
                )
            )
            results.append(
                {
                    "ratio": ratio,
                    "gbps": g,
                    "url": url,
                    "ttft_p50_s": p50,
                    "cost_over_better": cost_ratio,
                    "outputs_identical": same,
                    "max_first_logit_diff": logit_diff,
                    "decision_err_median": err,
                    **{
                        p: {k: v for k, v in r.items() if k not in ("logits", "tokens")}
                        for p, r in res.items()
                    },
                }
            )
    print_table(
        (
            "L3 bandwidth",
            "never p50 ms",
            "always p50 ms",
            "cost p50 ms",
            "cost/better",
            "loaded tokens cost/always",
            "decision err (n)",
            "L3 link err",
            "fitted L3 GB/s",
            "identical",
            "verdict",
        ),
        rows,
        title="TTFT p50 per load policy; cost against the better of never and always",
    )
    print_table(
        (
            "L3 bandwidth",
            "decision err",
            "same records, previous fit",
            "noise floor",
            "without the L3 read",
            "its L3 read part",
            "its load part",
            "its prefill part",
            "L3 fetch err (n)",
        ),
        erows,
        title="Decision error median |predicted - actual| / actual (cost policy)",
    )
    errs = [r["decision_err_median"] for r in results if r["decision_err_median"] is not None]
    print(
        f"target cost/better <= 1.05 at every throttle, outputs identical, decision error "
        f"median <= 0.20 (worst {max(errs):.3f})"
        if errs
        else "target cost/better <= 1.05 at every throttle, outputs identical (no decision records)"
    )
    print("all throttles met" if not fails else "NOT met:\n  " + "\n  ".join(fails))
    write_json(
        a.json,
        "bench_load_policy",
        vars(a),
        {
            "ttft_recompute_s": full_s,
            "ttft_document_on_device_s": tail_s,
            "equal_gbps": equal_gbps,
            "throttles": results,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
