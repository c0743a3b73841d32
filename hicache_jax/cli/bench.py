"""``hicache-jax bench``: a workload through three cache configurations, one comparison table.

Configurations (same model, same device pool size, same workload; fresh cache each):

* ``no cache``      every prompt is prefilled from scratch;
* ``device radix``  a radix prefix cache in device memory only (HiCache with ``host_pages=0``);
* ``hicache``       L1 + L2 (host pool ``--host-ratio`` x the device pool), ``--policy``;
* ``hicache+L3``    with ``--storage URL`` only: the same plus an L3 store; each request first
                    ``prefetch``es its prompt (policy ``wait_complete``), inside its TTFT (the L3
                    lookup is a round trip to the store). A ``file://`` store gets
                    a fresh subdirectory per run (one instance's own reuse); a Mooncake store keeps
                    what earlier runs (the warm-up) stored, so its hits include theirs.

Each configuration first plays the workload once untimed (so compiles are not charged to
whichever configuration happens to run first), then timed with a fresh cache: ``no cache``
(and ``hicache+L3``) once; ``device radix`` and ``hicache`` ``--repeats`` times (5), each
repeat on two fresh caches that serve each request back to back (:func:`_play_paired`), so that
a request's two TTFTs meet the same machine load. The table gives prompt tokens, tokens
recomputed, hit tokens by tier, TTFT p50/p90 (the median over the repeats), end-to-end tokens/s
((prompt + generated tokens) / wall time) and bytes moved each way, then checks that every
configuration (and repeat) generated exactly the same tokens; a verdict line follows: hicache's
TTFT over the device radix cache's on the same request, the median over requests and repeats
with a 90% interval (:mod:`hicache_jax.cli.paired`), beside tokens recomputed and bytes moved,
which do not depend on timing. ``--load-policy cost`` gives HiCache the cost model's
load-or-recompute decision (``HiCacheConfig.load_policy``); it decides on measured times, so
its tokens recomputed and bytes moved may differ from repeat to repeat (their median is shown,
each repeat's is in the JSON). ``--engine batched`` runs
:mod:`hicache_jax.cli.serve_bench` instead. Over several processes (``--processes N``,
``--coordinator``; the model tensor-parallel): :mod:`hicache_jax.cli.bench_processes`.

This module owns the command: its flags (:func:`add_parser`) and its run on them (:func:`bench`).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import sys
import time
from typing import Any

import numpy as np

from hicache_jax.cache.hicache import HiCache
from hicache_jax.cli import bench_metrics, bench_processes, serve_bench
from hicache_jax.cli.output import check_writable, require_matplotlib, write_json
from hicache_jax.cli.paired import paired_ratios, verdict_line
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine, Generation, RequestRecord
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import bucket
from hicache_jax.engine.weights import ModelConfig, load_params
from hicache_jax.engine.workloads import ARRIVALS, WORKLOADS, Workload
from hicache_jax.l3.storage import StorageError
from hicache_jax.replay.driver import format_table
from hicache_jax.spec import HiCacheConfig, parse_pattern

__all__ = ["CONFIGS", "add_parser", "bench", "build_workload", "table_bucket"]

CONFIGS = (("no cache", "none"), ("device radix", "device"), ("hicache", "hicache"))

# --sessions / --turns / --base-tokens / --segment-tokens mean, per workload:
_SIZE_NAMES = {
    "chat": ("num_clients", "num_turns", "system_tokens", "question_tokens"),
    "docqa": ("num_documents", "questions_per_document", "document_tokens", "question_tokens"),
    "agent": ("num_agents", "num_steps", "prompt_tokens", "observation_tokens"),
}
# Defaults sized so that the whole default run (chat) takes about a minute on 2 CPU cores.
_SIZE_DEFAULTS = {
    "chat": (8, 5, 256, 32),
    "docqa": (3, 8, 768, 32),
    "agent": (2, 8, 192, 64),
}


def add_parser(sub: Any) -> None:
    """The ``bench`` subcommand's flags (``hicache-jax bench``)."""
    b = sub.add_parser(
        "bench",
        help="run a workload through no cache / device radix / HiCache",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    w = b.add_argument_group("workload")
    w.add_argument("--workload", choices=sorted(WORKLOADS), default="chat")
    w.add_argument("--sessions", type=int, help="clients / documents / agents")
    w.add_argument("--turns", type=int, help="turns / questions per document / steps")
    w.add_argument("--base-tokens", type=int, help="system prompt / document / task tokens")
    w.add_argument("--segment-tokens", type=int, help="question / observation tokens (mean)")
    w.add_argument("--max-new-tokens", type=int, default=16)
    w.add_argument("--seed", type=int, default=0, help="workload and weight seed")
    m = b.add_argument_group("model")
    m.add_argument(
        "--layers",
        type=int,
        help="decoder layers (default 4; with --layer-pattern a:b, one repetition: a + b; "
        "R2:S1:F1: 4)",
    )
    m.add_argument(
        "--layer-pattern",
        default="",
        metavar="A:B",
        help="A local-attention layers (--window or --chunk) then B full ones, repeating "
        "(e.g. 5:1); the cache keeps each local group's pages only as far back as a "
        "continuation reads them. Hits come from continued conversations: the default chat "
        "workload (prompts of 256+ tokens) with --window 128 shows L1 and L2 hits. RA:FB "
        "(e.g. R3:F1): A recurrent layers (gated linear attention, a state per request; "
        "the cache keeps checkpoints of it at page boundaries) then B full ones. RA:SB:FC "
        "(e.g. R2:S1:F1, letters in layer order): recurrent, local (--window or --chunk) and "
        "full layers together",
    )
    m.add_argument("--window", type=int, help="with --layer-pattern: sliding window in tokens")
    m.add_argument(
        "--chunk", type=int, help="with --layer-pattern: chunked local attention, chunk in tokens"
    )
    m.add_argument("--d-model", type=int, default=256)
    m.add_argument("--heads", type=int, default=8)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--head-dim", type=int, default=32)
    m.add_argument("--ffn-dim", type=int, default=768)
    m.add_argument("--vocab", type=int, default=512)
    m.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    m.add_argument("--weights", help=".npz / .safetensors weights matching the model flags")
    c = b.add_argument_group("cache")
    c.add_argument("--page-size", type=int, default=16)
    c.add_argument(
        "--device-pages",
        type=int,
        help="default: 3/8 (serial engine) or 5/8 (batched) of the workload's distinct "
        "tokens, at least what the longest request needs",
    )
    c.add_argument("--host-ratio", type=float, default=4.0, help="host pages / device pages")
    c.add_argument(
        "--policy",
        default="clean_ahead",
        choices=["clean_ahead", "write_through", "write_through_selective", "write_back"],
    )
    c.add_argument(
        "--load-policy",
        default="threshold",
        choices=["threshold", "cost"],
        help="hicache: load back every host hit of a page or more (threshold), or load what "
        "the fitted cost model predicts is cheaper than recomputing it (cost)",
    )
    c.add_argument("--chunk-size", type=int, default=256, help="prefill chunk (power of two)")
    c.add_argument(
        "--storage",
        metavar="URL",
        help="L3 store (file:///dir, mooncake://host:port): adds a 'hicache+L3' run",
    )
    c.add_argument("--no-layerwise", action="store_true", help="plain (not layer-wise) load-back")
    c.add_argument("--no-warmup", action="store_true", help="skip the untimed first pass")
    e = b.add_argument_group("engine")
    e.add_argument(
        "--engine",
        choices=["serial", "batched"],
        default="serial",
        help="batched: continuous batching under --arrivals, beside the serial "
        "engine on the same requests",
    )
    e.add_argument(
        "--arrivals",
        choices=list(ARRIVALS),
        default="closed",
        help="batched: closed-loop clients, Poisson at --rate, or --trace timestamps",
    )
    e.add_argument("--rate", type=float, help="Poisson arrivals: requests/s")
    e.add_argument("--trace", metavar="PATH", help="Mooncake JSONL for --arrivals trace")
    e.add_argument(
        "--time-scale", type=float, default=1.0, help="trace timestamps x this (0: all at once)"
    )
    e.add_argument(
        "--block-tokens",
        type=int,
        default=16,
        help="trace: tokens per hash id (input lengths scaled by this / 512)",
    )
    e.add_argument("--limit", type=int, help="trace: first N requests")
    e.add_argument(
        "--token-budget",
        type=int,
        default=256,
        help="batched: prefill tokens per step (power of two)",
    )
    e.add_argument(
        "--query-block",
        type=int,
        default=32,
        help="batched: prefill rows of this many tokens (power of two)",
    )
    e.add_argument(
        "--key-block",
        type=int,
        default=64,
        help="batched: attention runs over each row's keys in blocks of this many "
        "tokens (power of two; whole pages), up to the row's last query",
    )
    e.add_argument("--max-running", type=int, default=64, help="batched: requests at once")
    e.add_argument(
        "--repeats",
        type=int,
        help="rounds of timed runs (default: 5 serial, 1 batched). Serial: device radix and "
        "hicache on fresh caches each round, serving each request back to back (the paired "
        "TTFT ratios); batched: each config's serial then batched run in each round "
        "(medians over the rounds)",
    )
    e.add_argument(
        "--decode-reserve",
        type=float,
        default=1.0,
        help="batched: fraction of remaining decode pages an admission keeps",
    )
    e.add_argument(
        "--warmup-passes",
        type=int,
        default=3,
        help="batched: untimed passes at most, until one compiles nothing (twice: "
        "as the timed runs go, then compiling mixed prefill + decode steps)",
    )
    e.add_argument(
        "--no-mixed-warmup",
        dest="mixed_warmup",
        action="store_false",
        help="batched: the warm-up compiles no mixed prefill + decode step (timed "
        "runs then run one as two forwards unless a compiled shape holds it)",
    )
    e.add_argument(
        "--no-overlap",
        action="store_true",
        help="batched: read each step's tokens before dispatching the next (default: "
        "dispatch step N+1 while step N computes)",
    )
    o = b.add_argument_group("output")
    o.add_argument("--json", metavar="PATH", help="write every figure and record as JSON")
    o.add_argument("--plot", metavar="PATH", help="hit ratio and TTFT per turn (needs matplotlib)")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    o.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve Prometheus metrics of every configuration's cache on port N while it runs "
        '(label config; needs pip install -e ".[metrics]")',
    )
    bench_processes.add_flags(b)
    b.set_defaults(func=bench)


def build_workload(args: argparse.Namespace) -> Workload:
    names, defaults = _SIZE_NAMES[args.workload], _SIZE_DEFAULTS[args.workload]
    given = (args.sessions, args.turns, args.base_tokens, args.segment_tokens)
    sizes = {n: d if g is None else g for n, g, d in zip(names, given, defaults)}
    return WORKLOADS[args.workload](
        **sizes, max_new_tokens=args.max_new_tokens, vocab_size=args.vocab, seed=args.seed
    )


def _pattern_period(pattern: str) -> int:
    """Layers of one repetition of a ``--layer-pattern`` (``"a:b"``, ``"Ra:Fb"``,
    ``"Ra:Sb:Fc"``: the sum of the counts); 0 for none or one that does not parse
    (``ModelConfig`` then names the problem)."""
    if not pattern.strip():
        return 0
    try:
        return sum(n for _, n in parse_pattern(pattern))
    except ValueError:
        return 0


def _device_pages(workload: Workload, page_size: int, given: int | None, share: float) -> int:
    """``given``, checked to hold the longest request; by default ``share`` of the workload's
    distinct tokens, but at least what the longest request needs (plus a page of slack): the
    device tier alone cannot hold the working set, L1 + L2 can."""
    served = workload.placeholder_run()
    longest = max(len(r.prompt) for r, _ in served) + workload.max_new_tokens
    needed = -(-longest // page_size)
    if given is not None:
        if given < needed:
            raise ValueError(
                f"--device-pages {given} cannot hold the longest request "
                f"({longest} tokens = {needed} pages of {page_size})"
            )
        return given
    working = workload.working_set_tokens(page_size, served)
    return max(int(working * share) // page_size, needed + 1)


def table_bucket(page_size: int) -> int:
    """Smallest page-table bucket: about 512 tokens of pages, at most 32, a power of two."""
    pages = max(1, min(32, 512 // page_size))
    return 1 << (pages.bit_length() - 1)


def _play(
    engine: Engine, workload: Workload, bar: Any
) -> tuple[list[Generation[RequestRecord]], float]:
    gens: list[Generation[RequestRecord]] = []

    def serve(prompts: list[np.ndarray]) -> list[np.ndarray]:
        out = []
        for p in prompts:
            gens.extend(engine.generate([p], workload.max_new_tokens))
            out.append(gens[-1].tokens)
            if bar is not None:
                bar.update(1)
        return out

    t0 = time.perf_counter()
    workload.run(serve)
    engine.cache.flush()
    return gens, time.perf_counter() - t0


def _play_paired(
    engines: dict[str, Engine], workload: Workload, bar: Any
) -> dict[str, tuple[list[Generation[RequestRecord]], float]]:
    """The workload through every engine at once, request by request: each request is served
    by each engine back to back (the order alternating from one request to the next), so that
    its TTFTs meet the same machine load. Each engine's transfers are waited for after its
    request (``flush``), outside the TTFT, so none runs inside another engine's request. The
    next round's prompts carry the first engine's answers (every engine's are checked equal).
    Returns each engine's generations and its wall time (its own requests and flushes)."""
    names = list(engines)
    gens: dict[str, list[Generation[RequestRecord]]] = {n: [] for n in names}
    wall = dict.fromkeys(names, 0.0)

    def serve(prompts: list[np.ndarray]) -> list[np.ndarray]:
        out = []
        for p in prompts:
            order = names if len(gens[names[0]]) % 2 == 0 else names[::-1]
            for n in order:
                t0 = time.perf_counter()
                gens[n].extend(engines[n].generate([p], workload.max_new_tokens))
                engines[n].cache.flush()
                wall[n] += time.perf_counter() - t0
            out.append(gens[names[0]][-1].tokens)
            if bar is not None:
                bar.update(1)
        return out

    workload.run(serve)
    return {n: (gens[n], wall[n]) for n in names}


def _combine(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of a configuration's repeats: the timed figures their median over the
    repeats (each repeat's under ``<name>_runs``); the others the first repeat's (equal in
    every repeat unless a policy decides on measured times, as ``--load-policy cost`` does:
    then their median, and ``<name>_runs`` too)."""
    out = dict(runs[0])
    for key, first in runs[0].items():
        values = [r[key] for r in runs]
        timed = key in bench_processes.TIMINGS
        if timed or any(v != first for v in values):
            med = float(np.median(values))
            out[key] = med if timed or isinstance(first, float) else int(round(med))
            out[f"{key}_runs"] = values
    return out


def _progress(total: int, desc: str, quiet: bool) -> Any:
    if quiet:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=True)


def _summary(
    gens: list[Generation[RequestRecord]], wall: float, stats: dict[str, Any]
) -> dict[str, Any]:
    recs = [g.record for g in gens]
    ttft = np.array([r.ttft_s for r in recs])
    prompt = sum(r.prompt_tokens for r in recs)
    generated = sum(r.output_tokens for r in recs)
    return {
        "requests": len(recs),
        "prompt_tokens": prompt,
        "recomputed_tokens": sum(r.recomputed_tokens for r in recs),
        "l1_hit_tokens": sum(r.device_hit_tokens for r in recs),
        "l2_hit_tokens": sum(r.host_hit_tokens for r in recs),
        "l2_declined_tokens": sum(r.host_declined_tokens for r in recs),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1e3),
        "ttft_p90_ms": float(np.percentile(ttft, 90) * 1e3),
        "tokens_per_s": (prompt + generated) / wall,
        "wall_s": wall,
        "bytes_to_host": stats["bytes_to_host"],
        "bytes_to_device": stats["bytes_to_device"],
        "l3_fetched_pages": stats.get("l3_prefetch_hit_pages", 0),
        "l3_stored_pages": stats.get("l3_put_pages_stored", 0),
    }


def _table(summaries: dict[str, dict[str, Any]], l3: bool) -> str:
    """The results table; the L3 columns only when an L3 store was configured."""
    cols = [
        ("prompt tok", "prompt_tokens"),
        ("recomputed", "recomputed_tokens"),
        ("L1 hit", "l1_hit_tokens"),
        ("L2 hit", "l2_hit_tokens"),
        ("TTFT p50 ms", "ttft_p50_ms"),
        ("TTFT p90 ms", "ttft_p90_ms"),
        ("tok/s", "tokens_per_s"),
        ("MB to host", "bytes_to_host"),
        ("MB to device", "bytes_to_device"),
    ]
    if l3:  # pages fetched from L3 land in L2 and are loaded back from there
        cols[3] = ("L2 hit (incl. L3)", "l2_hit_tokens")
        cols += [("L3 fetched pg", "l3_fetched_pages"), ("L3 stored pg", "l3_stored_pages")]
    rows = []
    for name, s in summaries.items():
        row = [name]
        for _, key in cols:
            v = s[key]
            row.append(
                f"{v / 2**20:.2f}"
                if key.startswith("bytes")
                else f"{v:.1f}"
                if isinstance(v, float)
                else str(v)
            )
        rows.append(row)
    return format_table(["config", *(h for h, _ in cols)], rows)


def _env() -> dict[str, Any]:
    import jax

    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "jax": jax.__version__,
    }


def bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:  # bad sizes or weights: a usage error naming the problem, not a traceback
        if args.plot:  # fail before minutes of work, not after
            require_matplotlib()
        bench_processes.check_flags(args)
        if args.seed < 0:
            raise ValueError(f"--seed {args.seed} must be >= 0")
        if args.vocab < 2:
            raise ValueError(f"--vocab {args.vocab} must be >= 2")
        if not (np.isfinite(args.host_ratio) and args.host_ratio >= 0):
            raise ValueError(f"--host-ratio {args.host_ratio} must be a finite number >= 0")
        if args.repeats is None:
            args.repeats = 5 if args.engine == "serial" else 1
        if args.repeats < 1:
            raise ValueError(f"--repeats {args.repeats} must be >= 1")
        if args.json:
            check_writable(args.json)
        args.metrics = bench_metrics.serve(args.metrics_port, args.processes)
        workload = build_workload(args)
        if args.layers is None:
            args.layers = _pattern_period(args.layer_pattern) or 4
        cfg = ModelConfig(
            vocab_size=args.vocab,
            num_layers=args.layers,
            d_model=args.d_model,
            num_heads=args.heads,
            num_kv_heads=args.kv_heads,
            head_dim=args.head_dim,
            ffn_dim=args.ffn_dim,
            dtype=args.dtype,
            layer_pattern=args.layer_pattern,
            window=args.window,
            chunk=args.chunk,
        )
        bench_processes.check_divisible(args, cfg)
        ps = args.page_size
        cfg.kv_spec(ps)  # validates the page size, before it divides anything
        # Serial: 3/8, so that most requests' history has left the device tier when they
        # come back (the device radix cache recomputes it, HiCache loads it from host): the
        # paired TTFT ratio then judges the tiers, not the few requests that differ. Batched:
        # 5/8, as its running requests' decode pages share the device tier.
        share = 3 / 8 if args.engine == "serial" else 5 / 8
        device_pages = _device_pages(workload, ps, args.device_pages, share)
        if args.engine == "batched":
            serve_bench.check_flags(args)
            if args.arrivals == "trace" and args.device_pages is None:
                device_pages = serve_bench.trace_device_pages(args, workload, ps)
        host_pages = int(round(args.host_ratio * device_pages))
        HiCacheConfig(
            device_pages=device_pages,
            host_pages=host_pages,
            write_policy=args.policy,
            load_policy=args.load_policy,
            storage=args.storage,
        )  # validates the sizes
        if bucket(args.chunk_size) != args.chunk_size:
            raise ValueError(f"--chunk-size {args.chunk_size} must be a power of two")
        if args.engine == "batched":
            for flag, v in (
                ("--token-budget", args.token_budget),
                ("--query-block", args.query_block),
                ("--key-block", args.key_block),
            ):
                if v < 1 or bucket(v) != v:
                    raise ValueError(f"{flag} {v} must be a power of two")
    except (ValueError, TypeError, OSError, ImportError) as exc:
        parser.exit(2, f"hicache-jax bench: error: {exc}\n")
    if args.processes > 1:
        return bench_processes.launch_local(args)
    with bench_processes.joined(args) as mesh:  # (jax.distributed first: weights are arrays)
        try:
            params = load_params(cfg, args.weights) if args.weights else None
            model = DecoderModel(cfg, params, seed=args.seed, mesh=mesh)
        except (ValueError, TypeError, OSError, ImportError) as exc:
            parser.exit(2, f"hicache-jax bench: error: {exc}\n")
        return _run(args, parser, workload, model, device_pages, host_pages)


def _run(
    args: argparse.Namespace,
    parser: argparse.ArgumentParser,
    workload: Workload,
    model: DecoderModel,
    device_pages: int,
    host_pages: int,
) -> int:
    """The bench in this process (one of several with a mesh over processes)."""
    cfg, ps = model.cfg, args.page_size
    infinite = workload.infinite_cache_hit_ratio(ps)
    print(
        f"workload {workload.name}: {workload.num_requests} requests in {workload.num_rounds} "
        f"rounds, {workload.max_new_tokens} new tokens each; infinite-cache hit ratio "
        f"{infinite:.3f} (page {ps})"
    )
    print(
        f"model {cfg.num_layers}L d{cfg.d_model} {cfg.num_heads}/{cfg.num_kv_heads} heads "
        f"{cfg.dtype}{_pattern_text(cfg)}; device pool {device_pages} pages "
        f"({device_pages * ps} tokens), "
        f"host pool {host_pages} pages; policy {args.policy}, load policy "
        f"{args.load_policy}; {args.engine} engine",
        flush=True,
    )

    knobs = dict(
        chunk_size=args.chunk_size,
        layerwise=not args.no_layerwise,
        prefill_bucket=min(64, args.chunk_size),
        table_bucket=table_bucket(ps),
    )
    runs = iter(range(1 << 30))

    @bench_metrics.watched(args.metrics)  # --metrics-port
    def engine(mode: str) -> Engine:
        if mode != "hicache+L3":
            return Engine.create(
                model,
                mode,
                page_size=ps,
                device_pages=device_pages,
                host_pages=host_pages,
                write_policy=args.policy,
                load_policy=args.load_policy,
                **knobs,
            )
        url = args.storage
        if url.startswith("file://"):  # a fresh store per run: this instance's reuse only
            base, _, query = url.partition("?")
            url = f"{base.rstrip('/')}/run-{os.getpid()}-{next(runs)}" + (
                f"?{query}" if query else ""
            )
        hc = HiCacheConfig(
            device_pages=device_pages,
            host_pages=host_pages,
            write_policy=args.policy,
            load_back_threshold=ps,
            load_policy=args.load_policy,
            storage=url,
            prefetch_policy="wait_complete",
            mesh=model.mesh,
        )
        try:
            cache = HiCache(cfg.kv_spec(ps), hc)
        except (StorageError, ValueError) as exc:
            parser.exit(2, f"hicache-jax bench: error: --storage: {exc}\n")
        return Engine(model, cache, mode="hicache", prefetch=True, **knobs)

    if args.engine == "batched":
        return _bench_batched(
            args, workload, model, cfg, engine, device_pages, host_pages, infinite
        )
    summaries, outputs, per_request, logits = {}, {}, {}, {}
    repeat_outputs: list[list[np.ndarray]] = []  # the paired configurations' later repeats

    def record(name: str, gens: list[Generation[RequestRecord]]) -> None:
        outputs[name] = [g.tokens for g in gens]
        logits[name] = hashlib.sha256(b"".join(g.first_logits.tobytes() for g in gens)).hexdigest()
        per_request[name] = [dict(vars(g.record)) for g in gens]

    def alone(name: str, mode: str) -> None:
        if not args.no_warmup:
            warm = engine(mode)
            _play(warm, workload, _progress(workload.num_requests, f"{name} (warm-up)", args.quiet))
            warm.cache.close()
        eng = engine(mode)
        gens, wall = _play(eng, workload, _progress(workload.num_requests, name, args.quiet))
        summaries[name] = _summary(gens, wall, eng.cache.stats())
        eng.cache.close()
        record(name, gens)

    alone(*CONFIGS[0])
    pair = dict(CONFIGS[1:])  # device radix, hicache: paired
    passes = args.repeats + (0 if args.no_warmup else 1)
    bar = _progress(passes * workload.num_requests, " & ".join(pair), args.quiet)
    repeats: dict[str, list[dict[str, Any]]] = {name: [] for name in pair}
    ttfts: dict[str, list[list[float]]] = {name: [] for name in pair}
    for rep in range(-1 if not args.no_warmup else 0, args.repeats):  # -1: the warm-up
        engines = {name: engine(mode) for name, mode in pair.items()}
        played = _play_paired(engines, workload, bar)
        for name, (gens, wall) in played.items():
            stats = engines[name].cache.stats()
            engines[name].cache.close()
            if rep < 0:
                continue
            repeats[name].append(_summary(gens, wall, stats))
            ttfts[name].append([g.record.ttft_s for g in gens])
            if rep == 0:
                record(name, gens)
            else:
                repeat_outputs.append([g.tokens for g in gens])
    if bar is not None:
        bar.close()
    for name in pair:
        summaries[name] = _combine(repeats[name])
        for rec, times in zip(per_request[name], zip(*ttfts[name])):
            rec["ttft_s_repeats"] = list(times)
    (name_a, _), (name_b, _) = CONFIGS[1:]
    paired = paired_ratios(ttfts[name_a], ttfts[name_b])
    if args.storage:
        alone("hicache+L3", "hicache+L3")
    first = outputs[CONFIGS[0][0]]
    identical = all(
        len(o) == len(first) and all(np.array_equal(a, b) for a, b in zip(o, first))
        for o in [*outputs.values(), *repeat_outputs]
    )
    print(_table(summaries, l3=bool(args.storage)))
    hits = {
        n: (s["l1_hit_tokens"] + s["l2_hit_tokens"]) / s["prompt_tokens"]
        for n, s in summaries.items()
    }
    print(
        "hit ratio / infinite-cache hit ratio: "
        + ", ".join(f"{n} {h / infinite:.2f}" if infinite else f"{n} -" for n, h in hits.items())
    )
    print(f"outputs identical across configurations: {'yes' if identical else 'no'}")
    verdict = verdict_line(name_a, summaries[name_a], name_b, summaries[name_b], paired)
    print(verdict, flush=True)
    everywhere = bench_processes.same_on_every_process(outputs, summaries)
    if model.mesh is not None:
        import jax

        print(
            f"tensor-parallel over {jax.device_count()} devices of {jax.process_count()} "
            f"process(es); outputs and figures (timings aside) identical on every process: "
            f"{'yes' if everywhere else 'no'}",
            flush=True,
        )
    identical = identical and everywhere
    turns = [(r.session, r.turn) for r, _ in workload.placeholder_run()]
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "hicache-jax bench",
                "env": _env(),
                "config": _config_record(args, device_pages, host_pages, cfg),
                "infinite_cache_hit_ratio": infinite,
                "outputs_identical": identical,
                "summary": summaries,
                "paired_ttft": {"a": name_a, "b": name_b, **paired},
                "verdict": verdict,
                "outputs": {n: [t.tolist() for t in o] for n, o in outputs.items()},
                "first_logits_sha256": logits,  # bit-exactness between runs, by digest
                "requests": {
                    n: [{"session": s, "turn": t, **rec} for (s, t), rec in zip(turns, recs)]
                    for n, recs in per_request.items()
                },
            },
        )
    if args.plot:
        _plot(args.plot, turns, per_request)
    return 0 if identical else 1


def _bench_batched(
    args: argparse.Namespace,
    workload: Workload,
    model: DecoderModel,
    cfg: ModelConfig,
    serial: Any,
    device_pages: int,
    host_pages: int,
    infinite: float,
) -> int:
    """``--engine batched``: see :mod:`hicache_jax.cli.serve_bench`."""
    ps = args.page_size
    knobs = dict(
        token_budget=args.token_budget,
        max_running=args.max_running,
        layerwise=not args.no_layerwise,
        query_block=min(args.query_block, args.token_budget),
        key_block=args.key_block,
        table_bucket=table_bucket(ps),
        decode_reserve=args.decode_reserve,
        overlap=not args.no_overlap,
        compile_mixed=False,
    )  # see serve_bench: no compile in a timed run

    @bench_metrics.watched(args.metrics, "batched ")  # --metrics-port
    def batched(mode: str) -> BatchedEngine:
        return BatchedEngine.create(
            model,
            mode,
            page_size=ps,
            device_pages=device_pages,
            host_pages=host_pages,
            write_policy=args.policy,
            load_policy=args.load_policy,
            **knobs,
        )

    say = (
        (lambda msg: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    )
    summaries, per_request = serve_bench.bench_batched(
        args, workload, serial, batched, CONFIGS, say
    )
    print(
        f"arrivals {args.arrivals}"
        + (f" at {args.rate:g}/s" if args.arrivals == "poisson" else "")
        + f"; token budget {args.token_budget}"
    )
    print(serve_bench.table(summaries))
    ok = all(s["tokens_identical"] and s["logits_within_tol"] for s in summaries.values())
    radix, hi = summaries["device radix"], summaries["hicache"]
    if radix["ttft_p50_ms"] > 0:
        # Per round too: the two runs of a round are minutes closer than the medians' runs.
        rounds = [h / d for h, d in zip(hi["ttft_p50_ms_runs"], radix["ttft_p50_ms_runs"]) if d > 0]
        print(
            f"hicache TTFT p50 / device radix TTFT p50: "
            f"{hi['ttft_p50_ms'] / radix['ttft_p50_ms']:.2f}"
            + (f" (per round: {', '.join(f'{x:.2f}' for x in rounds)})" if len(rounds) > 1 else "")
        )
    leaks = sum(
        s["leaked_caller_pages"] + s["locked_pages_after_drain"] for s in summaries.values()
    )
    print(
        "compiles during the timed batched runs (each stalls every running request): "
        + ", ".join(
            f"{name} {'/'.join(map(str, s['compiles_in_timed_runs']))}"
            for name, s in summaries.items()
        )
    )
    print(
        f"outputs identical to the serial engine (tokens, first-token logits <= "
        f"{serve_bench.logits_tol(args.dtype):g}): {'yes' if ok else 'no'}; pages leaked or "
        f"locked after the drain: {leaks}",
        flush=True,
    )
    if args.json:
        write_json(
            args.json,
            {
                "benchmark": "hicache-jax bench --engine batched",
                "env": _env(),
                "config": _config_record(args, device_pages, host_pages, cfg),
                "infinite_cache_hit_ratio": infinite,
                "outputs_identical": ok,
                "summary": summaries,
                "requests": per_request,
            },
        )
    if args.plot:
        serve_bench.plot(args.plot, per_request)
    return 0 if ok and not leaks else 1


def _pattern_text(cfg: ModelConfig) -> str:
    """`` (layers 5:1, window 128)`` for a model with a layer pattern (a recurrent one: its
    heads x key x value dims and conv width), else ``""``."""
    if not cfg.layer_pattern:
        return ""
    local = (
        f", window {cfg.window}"
        if cfg.window is not None
        else f", chunk {cfg.chunk}"
        if cfg.chunk is not None
        else ""
    )
    if cfg.recurrent:
        heads, dk, dv, width = cfg.recurrent_dims()
        return f" (layers {cfg.layer_pattern}{local}, recurrent {heads}x{dk}x{dv}, conv {width})"
    return f" (layers {cfg.layer_pattern}{local})"


def _config_record(
    args: argparse.Namespace, device_pages: int, host_pages: int, cfg: ModelConfig
) -> dict[str, Any]:
    """The JSON's ``config``: every flag, the pool sizes the run used, the model."""
    return {
        **{k: v for k, v in vars(args).items() if k != "func"},
        "device_pages": device_pages,
        "host_pages": host_pages,
        "model": vars(cfg),
    }


def _plot(path: str, turns: list[tuple[int, int]], per_request: dict[str, list[dict]]) -> None:
    """Two panels, one line per configuration: prompt-token hit ratio and mean TTFT per turn
    (per request when the workload has a single round, e.g. docqa)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    by_turn = len({t for _, t in turns}) > 1
    keys = [t for _, t in turns] if by_turn else list(range(len(turns)))
    xs = sorted(set(keys))
    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in per_request.items():
        hit, ttft = [], []
        for x in xs:
            sel = [r for k, r in zip(keys, recs) if k == x]
            prompt = sum(r["prompt_tokens"] for r in sel)
            hit.append(sum(r["device_hit_tokens"] + r["host_hit_tokens"] for r in sel) / prompt)
            ttft.append(1e3 * float(np.mean([r["ttft_s"] for r in sel])))
        ax_hit.plot(xs, hit, marker="o", label=name)
        ax_ttft.plot(xs, ttft, marker="o", label=name)
    xlabel = "turn" if by_turn else "request"
    ax_hit.set(xlabel=xlabel, ylabel="prompt tokens served from cache", ylim=(0, 1))
    ax_ttft.set(xlabel=xlabel, ylabel="mean TTFT (ms)")
    for ax in (ax_hit, ax_ttft):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax_hit.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
