"""Trace replay: production request traces through the real HiCache, beside exact LRU references.

Input (one request a line, format auto-detected from the first record):

* **Mooncake JSONL** (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``; FAST'25
  release): block ``h`` becomes ``block_size`` tokens unique to it, ``h * block_size +
  arange(block_size)``; a prompt is ``input_length`` tokens made of its blocks in order, the
  last one possibly partial. A prompt with fewer ids than blocks gets fresh ids (never shared)
  for the rest.
* **token JSONL**: a JSON list of ints, or ``{"tokens": [...]}``, per line.

Bad input raises ``ValueError`` naming the file and the line.

Requests are served in file order, one at a time (timestamps are not used: no concurrency),
each with the serving pattern of DESIGN.md through the public API only: ``match_prefix``,
``load_back``, ``lock``, ``alloc_pages`` (the pages it computes), ``insert``, ``unlock``.
``write_kv`` of the computed pages is skipped for speed: the pool holds whatever bytes it
holds, but every backup and load-back still moves real bytes between the tiers
(``bytes_to_host`` / ``bytes_to_device`` are real copies). A prompt longer than the device
pool caches only its first ``device_pages`` pages (what a server could hold at once).
The default :data:`TINY_SPEC` (one layer, one head, head_dim 1, float32: 8 bytes a token)
keeps a 60M-token trace in memory; ``spec`` replays with a real model's page bytes.

Determinism: a replay gives identical figures on every run and under any machine load. The
serving path completes transfers asynchronously (whether a backup has landed by the next
eviction depends on timing), so the replay calls ``cache.flush()`` after every request:
transfers complete at request boundaries. It also flushes between ``insert`` and ``unlock``:
clean_ahead's pass runs at the unlock and sees which nodes a load still in flight holds locked. The cache gets a virtual clock (a counter that
advances at every reading), so eviction order depends on the order of calls, never on wall
time. Only ``wall_s`` and ``requests_per_s`` (:data:`TIMING_FIELDS`) vary between runs.

References (:class:`BlockLRU`, independent of the tree): a cache of ``C`` whole pages keyed by
the prefix up to and including the page. A request hits its longest run of leading pages
present; then all its whole pages are touched deepest-first, so a prefix's ancestors are always
more recent than its descendants and the LRU evicts leaf-most pages as the radix tree must;
pages beyond ``C`` are evicted least recent first. Infinite capacity gives the infinite-cache
hit figure. Hits of HiCache and of the references count whole pages only.

Threading: a replay builds, owns and closes its caches on the calling thread.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import hashlib
import itertools
import json
import math
import os
import sys
import time
from typing import Any, Iterable, Sequence

import numpy as np

from hicache_jax.hicache import HiCache
from hicache_jax.spec import HiCacheConfig, KVSpec

MOONCAKE_BLOCK = 512
TOKEN_PAGE_SIZE = 16  # default page size of token traces
TINY_SPEC = dict(num_layers=1, num_kv_heads=1, head_dim=1, dtype="float32")
TIMING_FIELDS = ("wall_s", "requests_per_s")
_INT64_MAX = np.iinfo(np.int64).max


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    """One prompt of a trace.

    Attributes:
        line: 1-based line of the trace file.
        num_tokens: prompt length.
        hash_ids: Mooncake block ids (int64 ``[ceil(num_tokens / block_size)]``), or None.
        block_size: tokens per Mooncake block.
        token_ids: int64 ``[num_tokens]`` of a token trace, or None.
    """

    line: int
    num_tokens: int
    hash_ids: np.ndarray | None = None
    block_size: int = MOONCAKE_BLOCK
    token_ids: np.ndarray | None = None

    def tokens(self) -> np.ndarray:
        """The prompt: int64 ``[num_tokens]`` (made on demand for Mooncake records)."""
        if self.token_ids is not None:
            return self.token_ids
        bs = self.block_size
        blocks = self.hash_ids[:, None] * bs + np.arange(bs, dtype=np.int64)
        return blocks.reshape(-1)[: self.num_tokens]


@dataclasses.dataclass(frozen=True, eq=False)
class Trace:
    """Requests of one trace file, in order. ``format`` is "mooncake" or "tokens"."""

    path: str
    format: str
    block_size: int
    requests: tuple[Request, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.requests)

    def default_page_size(self) -> int:
        return self.block_size if self.format == "mooncake" else TOKEN_PAGE_SIZE

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "block_size": self.block_size,
                "requests": len(self.requests), "prompt_tokens": self.num_tokens}


# ------------------------------------------------------------------------------------ parsing

def _int_list(values: Any, field: str, where: str) -> np.ndarray:
    if not isinstance(values, list):
        raise ValueError(f"{where}: {field} must be a list of ints, got {type(values).__name__}")
    bad = next((v for v in values if type(v) is not int), None)  # bools and floats refused
    if bad is not None:
        raise ValueError(f"{where}: {field} holds {bad!r}, not an int")
    if values and (min(values) < 0 or max(values) > _INT64_MAX):
        raise ValueError(f"{where}: {field} must hold ints in [0, 2**63)")
    return np.array(values, dtype=np.int64)


def _length(obj: dict, field: str, where: str, required: bool) -> int:
    if field not in obj and not required:
        return 0
    value = obj.get(field)
    if type(value) is not int or value < 0:
        raise ValueError(f"{where}: {field}={value!r} must be an int >= 0")
    return value


def _parse_record(obj: Any, where: str, block_size: int, line: int) -> tuple[str, Request]:
    if isinstance(obj, list) or (isinstance(obj, dict) and "tokens" in obj):
        ids = _int_list(obj if isinstance(obj, list) else obj["tokens"], "tokens", where)
        return "tokens", Request(line, ids.size, token_ids=ids)
    if not isinstance(obj, dict) or "hash_ids" not in obj or "input_length" not in obj:
        raise ValueError(f"{where}: expected a Mooncake record (input_length, hash_ids), a "
                         "JSON list of token ids or {\"tokens\": [...]}")
    n = _length(obj, "input_length", where, True)
    _length(obj, "output_length", where, False)
    ts = obj.get("timestamp", 0)
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
        raise ValueError(f"{where}: timestamp={ts!r} must be a number")
    ids = _int_list(obj["hash_ids"], "hash_ids", where)
    blocks = -(-n // block_size)
    if ids.size > blocks:
        raise ValueError(f"{where}: {ids.size} hash_ids but input_length={n} has only {blocks} "
                         f"blocks of {block_size} tokens")
    if ids.size and int(ids.max()) > _INT64_MAX // block_size - 1:
        raise ValueError(f"{where}: hash id {int(ids.max())} too large for block size {block_size}")
    return "mooncake", Request(line, n, hash_ids=ids, block_size=block_size)


def load_trace(path: str | os.PathLike, *, block_size: int = MOONCAKE_BLOCK,
               limit: int | None = None) -> Trace:
    """Read a Mooncake or token JSONL trace (blank lines skipped).

    Args:
        path: the file.
        block_size: tokens per Mooncake block (``hash_ids`` entry).
        limit: read only the first ``limit`` requests.

    Raises:
        ValueError: malformed line (names the file and line); OSError: unreadable file.
    """
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be an int >= 1")
    if limit is not None and (type(limit) is not int or limit < 1):
        raise ValueError(f"limit={limit!r} must be an int >= 1")
    path = os.fspath(path)
    fmt, requests = None, []
    with open(path) as f:
        for lineno, text in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: malformed JSON ({exc.msg} at column "
                                 f"{exc.colno})") from None
            kind, req = _parse_record(obj, where, block_size, lineno)
            if fmt is not None and kind != fmt:
                raise ValueError(f"{where}: a {kind} record in a {fmt} trace")
            fmt = kind
            requests.append(req)
    if not requests:
        raise ValueError(f"{path}: no requests in the trace")
    if fmt == "mooncake":
        requests = _fill_missing_blocks(requests, block_size)
    return Trace(path, fmt, block_size, tuple(requests))


def _fill_missing_blocks(requests: list[Request], bs: int) -> list[Request]:
    """Prompts with fewer ids than blocks get fresh ids past the trace's largest: never shared."""
    fresh = 1 + max((int(r.hash_ids.max()) for r in requests if r.hash_ids.size), default=-1)
    out = []
    for r in requests:
        missing = -(-r.num_tokens // bs) - r.hash_ids.size
        if missing:
            ids = np.concatenate([r.hash_ids, np.arange(fresh, fresh + missing, dtype=np.int64)])
            fresh += missing
            r = dataclasses.replace(r, hash_ids=ids)
        out.append(r)
    return out


def parse_spec(text: str | None, page_size: int) -> KVSpec:
    """``"layers=32,kv_heads=8,head_dim=128,dtype=bfloat16[,mla=1]"`` -> KVSpec; missing keys
    take :data:`TINY_SPEC`'s values. None -> the tiny spec."""
    fields = dict(TINY_SPEC)
    names = {"layers": "num_layers", "kv_heads": "num_kv_heads", "head_dim": "head_dim",
             "dtype": "dtype", "mla": "mla"}
    for item in filter(None, (text or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep or key.strip() not in names:
            raise ValueError(f"--spec item {item!r}: expected key=value with key one of "
                             f"{', '.join(names)}")
        key, value = names[key.strip()], value.strip()
        if key == "dtype":
            fields[key] = value
        elif key == "mla":
            fields[key] = value.lower() in ("1", "true", "yes")
        else:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"--spec {item!r}: {value!r} is not an int") from None
    return KVSpec(page_size=page_size, **fields)


# -------------------------------------------------------------------------------- references

class PageKeys:
    """Names every whole page by its prefix: page ``i`` of a prompt gets the id of (id of page
    ``i - 1``, 16-byte blake2b of page ``i``'s tokens), ids handed out in order of first sight."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._ids: dict[tuple[int, bytes], int] = {}

    def __call__(self, tokens: np.ndarray) -> list[int]:
        ps, ids = self.page_size, self._ids
        n = tokens.shape[0] // ps
        data, step = np.ascontiguousarray(tokens[: n * ps], dtype="<i8").tobytes(), ps * 8
        parent, out = -1, []
        for start in range(0, n * step, step):  # one digest per page, not per token
            key = (parent, hashlib.blake2b(data[start:start + step], digest_size=16).digest())
            parent = ids.setdefault(key, len(ids))
            out.append(parent)
        return out

    def __len__(self) -> int:
        """Distinct pages seen (what an infinite cache ends up holding)."""
        return len(self._ids)


class BlockLRU:
    """Exact LRU of ``capacity`` whole pages (None: infinite) over prefix-keyed pages."""

    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._pages: collections.OrderedDict[int, None] = collections.OrderedDict()

    def serve(self, keys: Sequence[int]) -> int:
        """Serve one prompt's page keys (root first); returns the pages hit."""
        pages = self._pages
        hit = 0
        for k in keys:
            if k not in pages:
                break
            hit += 1
        for k in reversed(keys):  # deepest first: ancestors end up more recent
            if k in pages:
                pages.move_to_end(k)
            else:
                pages[k] = None
        if self.capacity is not None:
            while len(pages) > self.capacity:
                pages.popitem(last=False)
        return hit

    def __len__(self) -> int:
        return len(self._pages)


def default_device_pages(trace: Trace, page_size: int) -> int:
    """An L1 of 1/8 of the trace's distinct whole pages (what an infinite cache would end up
    holding), but at least the longest prompt's pages."""
    keys_of = PageKeys(page_size)
    for req in trace.requests:
        keys_of(req.tokens())
    longest = max(r.num_tokens for r in trace.requests) // page_size
    return max(len(keys_of) // 8, longest, 1)


def reference_hits(trace: Trace, page_size: int,
                   capacities: Iterable[int | None]) -> tuple[dict[int | None, int], int]:
    """Hit tokens of a :class:`BlockLRU` of each capacity (pages; None: infinite) over the
    trace, and the distinct pages of the trace."""
    lrus = {c: BlockLRU(c) for c in set(capacities)}
    hits = dict.fromkeys(lrus, 0)
    keys_of = PageKeys(page_size)
    for req in trace.requests:
        keys = keys_of(req.tokens())
        for c, lru in lrus.items():
            hits[c] += lru.serve(keys) * page_size
    return hits, len(keys_of)


# ------------------------------------------------------------------------------------ replay

def _counter_clock() -> Any:
    ticks = itertools.count()
    return lambda: float(next(ticks))


def replay(trace: Trace, spec: KVSpec, cfg: HiCacheConfig, *, progress: bool = False,
           desc: str = "replay") -> dict[str, Any]:
    """Serve every request of ``trace`` through a fresh HiCache (see module doc).

    Returns:
        Prompt tokens, hit tokens by tier, the cache's transfer and eviction counters, wall
        time; hit tokens count whole pages.
    """
    cache = HiCache(spec, cfg, clock=_counter_clock())
    ps, cap = spec.page_size, cfg.device_pages
    prompt = device_hit = host_hit = declined = 0  # tokens
    bar = _progress_bar(len(trace.requests), desc, progress)
    t0 = time.perf_counter()
    try:
        for req in trace.requests:
            tokens = req.tokens()
            prompt += tokens.shape[0]
            whole = min(tokens.shape[0] // ps, cap)  # a prompt beyond L1 caches what L1 holds
            tokens = tokens[: whole * ps]
            m = cache.match_prefix(tokens)
            on_device = m.device_len
            m = cache.load_back(m)
            device_hit += on_device
            host_hit += m.device_len - on_device
            declined += m.host_len
            cache.lock(m.node)
            new = cache.alloc_pages(whole - m.device_pages.shape[0])
            cache.insert(tokens, np.concatenate([m.device_pages, new]))
            cache.flush()  # the load-back's lock is gone before the unlock (clean_ahead's pass)
            cache.unlock(m.node)
            cache.flush()  # transfers complete at request boundaries: deterministic
            if bar is not None:
                bar.update(1)
        wall = time.perf_counter() - t0
        stats = cache.stats()
    finally:
        if bar is not None:
            bar.close()
        cache.close()
    return {
        "write_policy": _label(cfg.write_policy), "eviction": _label(cfg.eviction),
        "device_pages": cap, "host_pages": cfg.host_pages, "page_size": ps,
        "load_back_threshold": cfg.load_back_threshold,
        "requests": len(trace.requests), "prompt_tokens": prompt,
        "device_hit_tokens": device_hit, "host_hit_tokens": host_hit,
        "host_declined_tokens": declined, "hit_tokens": device_hit + host_hit,
        "hit_ratio": (device_hit + host_hit) / prompt if prompt else 0.0,
    } | _counters(stats, ps) | {
        "wall_s": wall, "requests_per_s": len(trace.requests) / wall if wall > 0 else 0.0,
    }


def _label(policy: Any) -> str:
    """A policy as its string (an enum's value), whatever type the config resolved it to."""
    return str(getattr(policy, "value", policy))


def _counters(s: dict[str, Any], ps: int) -> dict[str, int]:
    """The cache's transfer and eviction counters, pages where the cache counts tokens."""
    return {
        "bytes_to_host": s["bytes_to_host"], "bytes_to_device": s["bytes_to_device"],
        "backups": s["backups"], "load_backs": s["load_backs"],
        "load_backs_declined": s["load_backs_declined"],
        "evicted_pages": s["evicted_tokens"] // ps,
        "eviction_backup_pages": s["eviction_backup_pages"],
        "host_evicted_pages": s["host_evicted_tokens"] // ps,
        "clean_ahead_pages": s["clean_ahead_pages"],
        "host_copies_dropped_pages": s["host_copies_dropped_tokens"] // ps,
    }


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False)


def run(trace: Trace, spec: KVSpec, *, device_pages: Sequence[int], host_ratio: float = 4.0,
        write_policies: Sequence[str] = ("clean_ahead",), evictions: Sequence[str] = ("lru",),
        load_back_threshold: int = 16, progress: bool = False) -> dict[str, Any]:
    """Replay every (L1 size, write policy, eviction) and compare each with the references.

    Args:
        trace: the requests.
        spec: page shape (``spec.page_size`` is the replay's page size).
        device_pages: L1 sizes in pages; L2 = ``round(host_ratio * L1)`` pages.
        write_policies, evictions: any strings :class:`HiCacheConfig` accepts.

    Returns:
        ``{"trace", "spec", "references", "results"}``: each result has the replay's figures
        beside ``infinite_hit_ratio``, ``lru_total_hit_ratio`` (an LRU of L1 + L2 pages),
        ``lru_l1_hit_ratio`` and their ratios ``vs_*``. Raises ``ValueError`` on a bad
        configuration before replaying anything.
    """
    cfgs = [HiCacheConfig(device_pages=d, host_pages=int(round(host_ratio * d)), write_policy=w,
                          eviction=e, load_back_threshold=load_back_threshold)
            for d in device_pages for w in write_policies for e in evictions]
    ps = spec.page_size
    caps = {None} | {c.device_pages for c in cfgs} | {c.device_pages + c.host_pages for c in cfgs}
    hits, distinct = reference_hits(trace, ps, caps)
    prompt = trace.num_tokens
    ratio = {c: h / prompt if prompt else 0.0 for c, h in hits.items()}
    results = []
    for i, cfg in enumerate(cfgs):
        desc = (f"[{i + 1}/{len(cfgs)}] {_label(cfg.write_policy)}/{_label(cfg.eviction)} "
                f"L1 {cfg.device_pages}")
        r = replay(trace, spec, cfg, progress=progress, desc=desc)
        refs = {"infinite": ratio[None], "lru_total": ratio[cfg.device_pages + cfg.host_pages],
                "lru_l1": ratio[cfg.device_pages]}
        for name, ref in refs.items():
            r[f"{name}_hit_ratio"] = ref
            r[f"vs_{name}"] = r["hit_ratio"] / ref if ref else None  # no hit possible
        results.append(r)
    return {"trace": trace.describe() | {"distinct_pages": distinct},
            "spec": dataclasses.asdict(spec), "host_ratio": host_ratio,
            "references": {"page_size": ps, "hit_tokens": {str(c): h for c, h in hits.items()}},
            "results": results}


# ------------------------------------------------------------------------------------ output

def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A right-aligned text table; floats get 4 significant digits, None is "-"."""
    body = [[f"{v:.4g}" if isinstance(v, float) else "-" if v is None else str(v) for v in r]
            for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _name(r: dict[str, Any]) -> str:
    return f"{r['write_policy']}/{r['eviction']}"


def tables(report: dict[str, Any]) -> str:
    """The hit table and the traffic table of every result; with several L1 sizes, the sweep
    (hit ratio versus capacity per configuration) too."""
    res = report["results"]
    hits = format_table(
        ["config", "L1 pages", "L2 pages", "prompt tok", "L1 hit", "L2 hit", "L2 declined",
         "hit ratio", "hit/inf", "hit/LRU(L1+L2)", "hit/LRU(L1)"],
        [[_name(r), r["device_pages"], r["host_pages"], r["prompt_tokens"], r["device_hit_tokens"],
          r["host_hit_tokens"], r["host_declined_tokens"], r["hit_ratio"], r["vs_infinite"],
          r["vs_lru_total"], r["vs_lru_l1"]] for r in res])
    traffic = format_table(
        ["config", "L1 pages", "MB to host", "MB to device", "backups", "load-backs",
         "evicted pg", "evict-backup pg", "host evicted pg", "wall s", "req/s"],
        [[_name(r), r["device_pages"], f"{r['bytes_to_host'] / 2**20:.1f}",
          f"{r['bytes_to_device'] / 2**20:.1f}", r["backups"], r["load_backs"],
          r["evicted_pages"], r["eviction_backup_pages"], r["host_evicted_pages"],
          f"{r['wall_s']:.1f}", f"{r['requests_per_s']:.1f}"] for r in res])
    out = [hits, "", traffic]
    sizes = sorted({r["device_pages"] for r in res})
    if len(sizes) > 1:
        out += ["", sweep_table(report)]
    return "\n".join(out)


def sweep_table(report: dict[str, Any]) -> str:
    """Hit ratio versus L1 capacity (tokens): the references, then one column per config."""
    res, ps = report["results"], report["references"]["page_size"]
    names = list(dict.fromkeys(_name(r) for r in res))
    by = {(r["device_pages"], _name(r)): r for r in res}
    rows = []
    for d in sorted({r["device_pages"] for r in res}):
        first = next(r for r in res if r["device_pages"] == d)
        rows.append([d * ps, first["lru_l1_hit_ratio"], first["lru_total_hit_ratio"]]
                    + [by[(d, n)]["hit_ratio"] if (d, n) in by else "-" for n in names])
    return format_table(["L1 tokens", "LRU(L1)", "LRU(L1+L2)", *names], rows)


def require_matplotlib() -> None:
    """ImportError saying what to install when matplotlib is missing (check before replaying)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ImportError('--plot needs matplotlib: pip install -e ".[plot]" '
                          "(or pip install matplotlib)") from None


def plot(report: dict[str, Any], path: str) -> None:
    """Hit ratio versus L1 capacity, one line per configuration, beside LRU(L1), LRU(L1+L2)
    and the infinite cache. Needs matplotlib (``pip install -e ".[plot]"``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res, ps = report["results"], report["references"]["page_size"]
    sizes = sorted({r["device_pages"] for r in res})
    first = {d: next(r for r in res if r["device_pages"] == d) for d in sizes}
    xs = [d * ps for d in sizes]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(_name(r) for r in res):
        pts = sorted((r["device_pages"] * ps, r["hit_ratio"]) for r in res if _name(r) == name)
        ax.plot(*zip(*pts), marker="o", label=name)
    ax.plot(xs, [first[d]["lru_l1_hit_ratio"] for d in sizes], "k--", label="LRU(L1)")
    ax.plot(xs, [first[d]["lru_total_hit_ratio"] for d in sizes], "k-.", label="LRU(L1+L2)")
    ax.axhline(first[sizes[0]]["infinite_hit_ratio"], color="grey", ls=":", label="infinite")
    top = max([first[sizes[0]]["infinite_hit_ratio"]] + [r["hit_ratio"] for r in res])
    ax.set(xscale="log", xlabel="L1 capacity (tokens)", ylabel="prompt tokens hit",
           ylim=(0, min(1.0, 1.15 * top) or 1.0),
           title=f"{os.path.basename(report['trace']['path'])}: L2 = {report['host_ratio']:g} x L1")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def environment() -> dict[str, Any]:
    """Date, backend, device, jax version, CPU count and load average: recorded in the JSON."""
    import jax

    dev = jax.devices()[0]
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "backend": jax.default_backend(), "device_kind": getattr(dev, "device_kind", str(dev)),
            "jax": jax.__version__, "cpu_count": os.cpu_count(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
