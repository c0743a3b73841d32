"""One result schema for the device benchmark runs, so two runs can be put side by side.

``benchmarks/run_gpu_all.sh`` and ``benchmarks/run_tpu_all.sh`` run several scripts, each
writing its own JSON (``{"benchmark", "env", "config", "results"}``, ``benchmarks/common.py``).
:func:`collect` turns them into one document of :data:`SCHEMA`::

    {"schema": "hicache-jax results 1",
     "env": {"backend", "device_kind", "device_count", "jax", "jaxlib", "date", ...},
     "figures": [{"name", "unit", "value", "limit_name", "limit", "ratio",
                  "higher_is_better", "source"}, ...],
     "sources": {benchmark name: that script's "config"}}

``ratio`` is the figure's share of its limit, measured in the same run, oriented so that 1.0 is
at the limit whatever the unit: ``value / limit`` for rates (GB/s, tokens/s), ``limit / value``
for times (ms). What each script's figures are judged against:

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

Pure functions of the documents; reading and writing files is the callers'.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

SCHEMA = "hicache-jax results 1"

Figure = dict[str, Any]


def figure(
    name: str,
    unit: str,
    value: float,
    limit_name: str,
    limit: float,
    source: str,
    *,
    higher_is_better: bool,
    ratio: float | None = None,
) -> Figure:
    """One figure beside its limit; ``ratio`` defaults to value/limit (rates) or limit/value
    (times)."""
    if ratio is None:
        num, den = (value, limit) if higher_is_better else (limit, value)
        ratio = num / den if den else float("nan")
    return dict(
        name=name,
        unit=unit,
        value=float(value),
        limit_name=limit_name,
        limit=float(limit),
        ratio=float(ratio),
        higher_is_better=higher_is_better,
        source=source,
    )


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


_EXTRACTORS: dict[str, Callable[[dict], list[Figure]]] = {
    "gpu_transfer": _transfer,
    "gpu_kernels": _kernels,
    "tpu_kernels": _kernels,
    "gpu_ttft": _ttft,
    "bench_ttft": _ttft,
    "hicache-jax bench --engine batched": _serve,
}


def figures_of(doc: dict) -> list[Figure]:
    """The figures of one script's JSON (``{"benchmark", "env", "config", "results"}``).

    Raises:
        ValueError: not such a document, or a benchmark this module does not know.
    """
    if (
        not isinstance(doc, dict)
        or "benchmark" not in doc
        or not ("results" in doc or "summary" in doc)
    ):
        raise ValueError(
            "not a benchmark result (needs 'benchmark' and 'results' or 'summary' keys)"
        )
    name = doc["benchmark"]
    if name not in _EXTRACTORS:
        raise ValueError(f"benchmark {name!r} is not one of {sorted(_EXTRACTORS)}")
    return _EXTRACTORS[name](doc)


def collect(docs: list[dict]) -> dict[str, Any]:
    """One :data:`SCHEMA` document from several scripts' JSONs of one run (the environment of
    the first; documents of unknown benchmarks are skipped and listed under ``skipped``)."""
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
    """Median ``ratio`` over a results document's figures (nan when it has none)."""
    ratios = [f["ratio"] for f in doc.get("figures", [])]
    return statistics.median(ratios) if ratios else float("nan")
