"""One result schema for every JSON the project writes for a comparison, so two runs can be put
side by side (``hicache-jax compare``).

The writers: ``hicache-jax bench --json`` (serial and ``--engine batched``), ``hicache-jax
replay --json`` (and ``--simulate``), and the benchmark scripts (``benchmarks/``; each writes
``{"benchmark", "env", "config", "results"}``, ``benchmarks/common.py``), several of which
``benchmarks/run_gpu_all.sh`` and ``benchmarks/run_tpu_all.sh`` run in one device run.
:func:`collect` turns them into one document of :data:`SCHEMA`::

    {"schema": "hicache-jax results 1",
     "env": {"backend", "device_kind", "device_count", "jax", "jaxlib", "date", ...},
     "figures": [{"name", "unit", "value", "limit_name", "limit", "ratio",
                  "higher_is_better", "source"[, "interval"]}, ...],
     "sources": {benchmark name: that script's "config"},
     "skipped": [benchmark names that gave no figure]}

``ratio`` is the figure's share of its limit, measured in the same run, oriented so that 1.0 is
at the limit whatever the unit: ``value / limit`` for rates (GB/s, tokens/s), ``limit / value``
for times (ms). A figure without a limit (bytes moved, a figure of the generic adapter below)
has ``limit_name``, ``limit`` and ``ratio`` None. ``interval``, where present, is ``[low,
high]`` around ``value`` (the bench's paired TTFT ratio). A writer's document is mapped by the
adapter of its ``benchmark`` name (:data:`ADAPTERS`), or else by the generic one, unless the
writer put its figures in it itself (a ``figures`` list of this schema's figures:
``benchmarks/common.py``'s ``write_json(..., figures=...)``, e.g. ``bench_events``: replay
requests/s with events queued and over ZMQ against events off; ``bench_guard``: the
owning-thread check against the noise of a ``match_prefix``; ``bench_hicache``: hit ratios
against the infinite cache's, moved GB/s against memcpy; ``bench_pins``: the system prompt's hit
rate, pinned and not, against 1; ``bench_transfer``: scattered-page backup / load GB/s against
``numpy.copyto`` of the same bytes, a layer-wise load against a plain one):

* ``gpu_transfer``: backup / load GB/s of scattered pages against one contiguous
  ``device_put`` of the same bytes in the same direction (that row's median ratio); a
  layer-wise load of all layers against a plain load of the same pages.
* ``gpu_kernels`` / ``tpu_kernels``: per op and page count, the best Pallas setting's and the
  XLA path's GB/s against one contiguous device-to-device copy.
* ``gpu_ttft`` (``bench_ttft``): TTFT with the prefix loaded back from L2 (plain, layer-wise)
  and recomputed, against TTFT with the prefix already in L1.
* ``gpu_serve`` (its JSON is ``hicache-jax bench --engine batched``'s): each configuration's
  batched throughput (prompt + generated tokens/s) against the serial engine's on the same
  requests.
* ``hicache-jax bench`` (serial): per configuration, TTFT p50 / p90 and tokens/s against the
  no-cache configuration's in the same run, tokens recomputed against the prompt tokens, hit
  tokens against the infinite cache's, bytes moved each way (no limit); the paired TTFT ratio
  of hicache over device radix against 1 (equal TTFT), with its interval.
* ``hicache-jax replay``: per configuration (write policy / eviction, L1 pages, L2 ratio), the
  hit ratio against LRU over L1 + L2's capacity on the same trace; requests/s and bytes moved
  (no limit).
* ``hicache-jax replay --simulate``: per load policy, simulated TTFT p50 / p90 against the
  policy that never loads (everything recomputed) on the same trace.
* any other benchmark (the generic adapter): every number of its ``results``, named by its path
  (``results.rows[3].gbps``), without a limit; lists of more than :data:`SAMPLES_MAX` numbers
  are raw samples and left out. Two runs of the same script line up figure by figure.

Pure functions of the documents; reading and writing files is the callers'.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from typing import Any

SCHEMA = "hicache-jax results 1"

Figure = dict[str, Any]


def figure(
    name: str,
    unit: str,
    value: float,
    limit_name: str | None,
    limit: float | None,
    source: str,
    *,
    higher_is_better: bool,
    ratio: float | None = None,
    interval: tuple[float, float] | None = None,
) -> Figure:
    """One figure beside its limit (None: a figure without one); ``ratio`` defaults to
    value/limit (rates) or limit/value (times)."""
    if ratio is None and limit is not None:
        num, den = (value, limit) if higher_is_better else (limit, value)
        ratio = num / den if den else float("nan")
    out = dict(
        name=name,
        unit=unit,
        value=float(value),
        limit_name=limit_name,
        limit=None if limit is None else float(limit),
        ratio=None if ratio is None else float(ratio),
        higher_is_better=higher_is_better,
        source=source,
    )
    if interval is not None:
        out["interval"] = [float(interval[0]), float(interval[1])]
    return out


def _transfer(doc: dict) -> list[Figure]:
    res, src, out = doc["results"], doc["benchmark"], []
    for r in res.get("directions", []):
        if r.get("pages", 0) > 0 and r.get("gbps", 0) > 0:
            out.append(
                figure(
                    f"transfer {r['direction']} {r['pages']}p {r['layout']}",
                    "GB/s",
                    r["gbps"],
                    r["limit"],
                    r["limit_gbps"],
                    src,
                    higher_is_better=True,
                    ratio=r["ratio"],
                )
            )
    for r in res.get("layerwise", []):
        out.append(
            figure(
                f"layer-wise load {r['pages']}p {r['layout']}",
                "ms",
                r["all_ms"],
                "plain load of the same pages",
                r["plain_load_ms"],
                src,
                higher_is_better=False,
            )
        )
    return out


def _kernels(doc: dict) -> list[Figure]:
    res, src = doc["results"], doc["benchmark"]
    limit = res["limit"]
    best: dict[tuple, dict] = {}
    for r in res.get("rows", []):
        if not r.get("ok") or not r.get("gbps"):
            continue
        kind = "xla" if r["impl"] == "xla" else "pallas"
        key = (r["op"], r["pages"], kind)
        if key not in best or r["gbps"] > best[key]["gbps"]:
            best[key] = r
    return [
        figure(
            f"page {op} {pages}p {kind}" + ("" if kind == "xla" else " (best setting)"),
            "GB/s",
            r["gbps"],
            limit["kind"],
            limit["gbps"],
            src,
            higher_is_better=True,
        )
        for (op, pages, kind), r in sorted(best.items())
    ]


def _ttft(doc: dict) -> list[Figure]:
    med, src = doc["results"]["median_s"], doc["benchmark"]
    l1 = med["L1"] * 1e3
    return [
        figure(
            f"TTFT {label}",
            "ms",
            med[key] * 1e3,
            "TTFT with the prefix in L1",
            l1,
            src,
            higher_is_better=False,
        )
        for key, label in (
            ("L2 layer-wise", "prefix from L2, layer-wise"),
            ("L2 plain", "prefix from L2"),
            ("recompute", "recomputed"),
        )
        if key in med
    ]


def _serve(doc: dict) -> list[Figure]:
    """``hicache-jax bench --engine batched``: each configuration's batched throughput against
    the serial engine's on the same requests (its ``summary``)."""
    src, out = doc["benchmark"], []
    for cfg, row in (doc.get("summary") or {}).items():
        tps, serial = row.get("tokens_per_s"), row.get("serial_tokens_per_s")
        if tps and serial:
            out.append(
                figure(
                    f"batched serve {cfg}",
                    "tok/s",
                    tps,
                    "serial engine, same requests",
                    serial,
                    src,
                    higher_is_better=True,
                )
            )
    return out


_MIB = 2**20


def _bench(doc: dict) -> list[Figure]:
    """``hicache-jax bench`` (serial): see the module doc."""
    src, summary, out = doc["benchmark"], doc.get("summary") or {}, []
    base = summary.get("no cache")
    infinite = doc.get("infinite_cache_hit_ratio")
    for cfg, s in summary.items():
        own = s is base  # the no-cache configuration is the limit of the others
        for key, label, unit, higher in (
            ("ttft_p50_ms", "TTFT p50", "ms", False),
            ("ttft_p90_ms", "TTFT p90", "ms", False),
            ("tokens_per_s", "tokens/s", "tok/s", True),
        ):
            if key in s:
                limit = base[key] if base and key in base and not own else None
                name = None if limit is None else "no cache, same run"
                out.append(
                    figure(
                        f"{label} {cfg}", unit, s[key], name, limit, src, higher_is_better=higher
                    )
                )
        prompt = s.get("prompt_tokens")
        if "recomputed_tokens" in s:
            out.append(
                figure(
                    f"tokens recomputed {cfg}",
                    "tokens",
                    s["recomputed_tokens"],
                    "prompt tokens (all recomputed)",
                    prompt,
                    src,
                    higher_is_better=False,
                )
            )
        if "l1_hit_tokens" in s and prompt is not None:
            hits = s["l1_hit_tokens"] + s.get("l2_hit_tokens", 0)
            limit = None if infinite is None else infinite * prompt
            out.append(
                figure(
                    f"hit tokens {cfg}",
                    "tokens",
                    hits,
                    None if limit is None else "infinite cache, same workload",
                    limit,
                    src,
                    higher_is_better=True,
                )
            )
        for key, label in (("bytes_to_host", "to host"), ("bytes_to_device", "to device")):
            if key in s:
                out.append(
                    figure(
                        f"MiB {label} {cfg}",
                        "MiB",
                        s[key] / _MIB,
                        None,
                        None,
                        src,
                        higher_is_better=False,
                    )
                )
    paired = doc.get("paired_ttft")
    if paired:
        out.append(
            figure(
                f"paired TTFT ratio {paired['b']}/{paired['a']}",
                "x",
                paired["median"],
                "equal TTFT",
                1.0,
                src,
                higher_is_better=False,
                interval=(paired["low"], paired["high"]),
            )
        )
    return out


def _replay(doc: dict) -> list[Figure]:
    """``hicache-jax replay``: see the module doc."""
    src, out = doc["benchmark"], []
    reports = doc.get("reports") or [doc]
    for rep in reports:
        for r in rep.get("results", []):
            key = (
                f"{r['write_policy']}/{r['eviction']} L1 {r['device_pages']}p "
                f"L2 {rep.get('host_ratio', 0):g}x"
            )
            lru = r.get("lru_total_hit_ratio")
            out.append(
                figure(
                    f"hit ratio {key}",
                    "share",
                    r["hit_ratio"],
                    None if lru is None else "LRU over L1 + L2, same trace",
                    lru,
                    src,
                    higher_is_better=True,
                    ratio=r.get("vs_lru_total"),
                )
            )
            out.append(
                figure(
                    f"requests/s {key}",
                    "req/s",
                    r["requests_per_s"],
                    None,
                    None,
                    src,
                    higher_is_better=True,
                )
            )
            for k, label in (("bytes_to_host", "to host"), ("bytes_to_device", "to device")):
                out.append(
                    figure(
                        f"MiB {label} {key}",
                        "MiB",
                        r[k] / _MIB,
                        None,
                        None,
                        src,
                        higher_is_better=False,
                    )
                )
    return out


def _simulate(doc: dict) -> list[Figure]:
    """``hicache-jax replay --simulate``: see the module doc."""
    src, rows = doc["benchmark"], doc.get("results", [])
    never = next((r for r in rows if r["policy"] == "never"), None)
    out = []
    for r in rows:
        for key, label in (("ttft_p50_s", "p50"), ("ttft_p90_s", "p90")):
            limit = None if never is None else never[key] * 1e3
            out.append(
                figure(
                    f"simulated TTFT {label} {r['policy']}",
                    "ms",
                    r[key] * 1e3,
                    None if never is None else "never load (all recomputed), same trace",
                    limit,
                    src,
                    higher_is_better=False,
                )
            )
    return out


#: A list of more numbers than this in a document the generic adapter maps is raw samples.
SAMPLES_MAX = 16


def _generic(doc: dict) -> list[Figure]:
    """Every number of ``doc["results"]`` by its path, without a limit (see the module doc)."""
    src, out = doc["benchmark"], []

    def walk(x: Any, path: str) -> None:
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return
        if isinstance(x, (int, float)):
            if math.isfinite(x):
                out.append(figure(path, "", x, None, None, src, higher_is_better=True))
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}")
        elif isinstance(x, list):
            numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in x)
            if numbers and len(x) > SAMPLES_MAX:
                return
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(doc.get("results"), "results")
    return out


#: The adapter of each writer's ``benchmark`` name (others: the generic adapter).
ADAPTERS: dict[str, Callable[[dict], list[Figure]]] = {
    "gpu_transfer": _transfer,
    "gpu_kernels": _kernels,
    "tpu_kernels": _kernels,
    "gpu_ttft": _ttft,
    "bench_ttft": _ttft,
    "hicache-jax bench --engine batched": _serve,
    "hicache-jax bench": _bench,
    "hicache-jax replay": _replay,
    "hicache-jax replay --simulate": _simulate,
}


def _own(f: Any, source: str) -> Figure:
    """A figure a writer put in its document itself, checked against the schema."""
    if not isinstance(f, dict) or not {"name", "unit", "value"} <= set(f):
        raise ValueError(f"benchmark {source!r}: a figure needs 'name', 'unit' and 'value': {f!r}")
    return figure(
        f["name"],
        f["unit"],
        f["value"],
        f.get("limit_name"),
        f.get("limit"),
        f.get("source", source),
        higher_is_better=bool(f.get("higher_is_better", True)),
        ratio=f.get("ratio"),
        interval=f.get("interval"),
    )


def figures_of(doc: dict) -> list[Figure]:
    """The figures of one writer's JSON (``{"benchmark", "env", "config", "results"}`` or a
    ``hicache-jax`` command's, with ``summary`` / ``reports`` instead of ``results``).

    Raises:
        ValueError: not such a document, or it gives no figure.
    """
    if (
        not isinstance(doc, dict)
        or "benchmark" not in doc
        or not any(k in doc for k in ("results", "summary", "reports"))
    ):
        raise ValueError(
            "not a benchmark result (needs 'benchmark' and 'results', 'summary' or 'reports' keys)"
        )
    name = doc["benchmark"]
    if isinstance(doc.get("figures"), list):  # the writer's own, in this schema
        return [_own(f, name) for f in doc["figures"]]
    try:
        figures = ADAPTERS.get(name, _generic)(doc)
    except (KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f"benchmark {name!r}: not the document its adapter reads ({e!r})"
        ) from None
    if not figures:
        raise ValueError(f"benchmark {name!r}: no figure in the document")
    return figures


def collect(docs: list[dict]) -> dict[str, Any]:
    """One :data:`SCHEMA` document from several writers' JSONs of one run (the environment of
    the first; documents that give no figure are skipped and listed under ``skipped``)."""
    if not docs:
        raise ValueError("no benchmark results to collect")
    figures, sources, skipped = [], {}, []
    for doc in docs:
        try:
            figures += figures_of(doc)
        except ValueError:
            skipped.append(doc.get("benchmark", "?") if isinstance(doc, dict) else "?")
            continue
        sources[doc["benchmark"]] = doc.get("config", {})
    return {
        "schema": SCHEMA,
        "env": docs[0].get("env", {}),
        "figures": figures,
        "sources": sources,
        "skipped": skipped,
    }


def as_results(doc: dict) -> dict[str, Any]:
    """``doc`` if it is a :data:`SCHEMA` document, else :func:`collect` of it alone (one
    script's JSON can be compared directly)."""
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
        return doc
    return collect([doc])


def median_ratio(doc: dict) -> float:
    """Median ``ratio`` over a results document's figures that have a limit (nan when none
    has)."""
    ratios = [f["ratio"] for f in doc.get("figures", []) if f.get("ratio") is not None]
    return statistics.median(ratios) if ratios else float("nan")
