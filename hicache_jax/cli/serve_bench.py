"""``hicache-jax bench --engine batched``: the continuous-batching engine under an arrival
process, beside the serial engine on the same requests, for no cache / device radix / HiCache.

For each configuration (fresh cache each; an untimed warm-up pass of each engine first unless
``--no-warmup``, the batched one repeated until a pass compiles nothing, at most
``--warmup-passes``: first with ``compile_mixed=False``, as the timed runs go, then compiling
the mixed prefill + decode steps it meets, unless ``--no-mixed-warmup``. A timed run is meant
to compile nothing, since one compile stalls every running request (the bench counts those it
does): it runs a mixed step of shapes the warm-up did not meet padded into a compiled shape
that holds it, or else as a prefill step and a decode step, shapes the first phase compiled):
the serial engine serves
the requests back to back (rounds of the workload, or
the trace in order), then the batched engine serves them as they arrive (``--arrivals``: closed
loop multi-turn clients, Poisson at ``--rate``, or a Mooncake trace's timestamps x
``--time-scale``). The table gives, for the batched run: tokens recomputed, hit tokens by tier,
throughput (prompt and generated tokens/s), TTFT and inter-token latency p50/p90/p99, bytes moved,
retractions, and its throughput over the serial engine's. Every request's generated tokens are
compared with the serial engine's (exactly) and its first-token logits (max abs difference
reported, <= ``LOGITS_TOL`` required).

Every configuration is warmed up first; the timed runs then go in ``--repeats`` rounds, each
running every configuration (serial, then batched), so drifting machine load hits the runs
compared with each other alike: a configuration's serial and batched runs (x serial) and the
configurations (hicache / radix TTFT). Times are medians over the rounds.
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

from hicache_jax.engine.batch_state import BatchedRecord
from hicache_jax.engine.batched import BatchedEngine
from hicache_jax.engine.engine import Engine, Generation, RequestRecord
from hicache_jax.engine.layers import trace_count
from hicache_jax.engine.workloads import ClosedLoop, PoissonArrivals, TraceArrivals, Workload
from hicache_jax.replay.driver import format_table

LOGITS_TOL = 1e-5  # float32: first-token logits, batched vs serial (max abs difference)
LOW_PRECISION_TOL = 2e-2  # bfloat16 / float16: summation order differs between the batchings


def logits_tol(dtype: str) -> float:
    return LOGITS_TOL if dtype == "float32" else LOW_PRECISION_TOL


def arrivals_for(args: argparse.Namespace, workload: Workload) -> Any:
    """The arrival process the flags name (a fresh one: each run consumes its own)."""
    if args.arrivals == "closed":
        return ClosedLoop(workload)
    if args.arrivals == "poisson":
        return PoissonArrivals(workload, args.rate, seed=args.seed)
    return TraceArrivals(
        args.trace,
        time_scale=args.time_scale,
        block_tokens=args.block_tokens,
        max_new_tokens=args.max_new_tokens,
        vocab_size=args.vocab,
        limit=args.limit,
        seed=args.seed,
    )


def check_flags(args: argparse.Namespace) -> None:
    """ValueError naming a bad batched-engine flag (before any work)."""
    if args.arrivals == "poisson" and not (
        args.rate is not None and np.isfinite(args.rate) and args.rate > 0
    ):
        raise ValueError(f"--arrivals poisson needs --rate > 0 (requests/s), got {args.rate}")
    if args.arrivals == "trace" and not args.trace:
        raise ValueError("--arrivals trace needs --trace PATH (a Mooncake JSONL)")
    if args.arrivals != "trace" and args.trace:
        raise ValueError("--trace is only used with --arrivals trace")
    if args.storage:
        raise ValueError("--storage is not supported with --engine batched")
    if not 0.0 <= args.decode_reserve <= 1.0:
        raise ValueError(f"--decode-reserve {args.decode_reserve} must be in [0, 1]")
    for flag, value in (
        ("--token-budget", args.token_budget),
        ("--max-running", args.max_running),
        ("--repeats", args.repeats),
        ("--warmup-passes", args.warmup_passes),
    ):
        if value < 1:
            raise ValueError(f"{flag} {value} must be >= 1")


def trace_device_pages(args: argparse.Namespace, workload: Workload, page_size: int) -> int:
    """Default L1 for a trace: 5/8 of its distinct whole pages, at least the longest request."""
    arrivals = arrivals_for(args, workload).initial()
    keys = {
        hash(a.prompt[: (i + 1) * page_size].tobytes())
        for a in arrivals
        for i in range(a.prompt.size // page_size)
    }
    longest = max(-(-(a.prompt.size + a.max_new_tokens) // page_size) for a in arrivals)
    return max(len(keys) * 5 // 8, longest + 1)


def serial_run(
    engine: Engine, args: argparse.Namespace, workload: Workload
) -> tuple[dict[Any, Generation[RequestRecord]], float]:
    """The serial engine over the same requests: keyed as the batched run keys them."""
    import time

    gens: dict[Any, Generation[RequestRecord]] = {}
    t0 = time.perf_counter()
    if args.arrivals == "trace":
        for a in arrivals_for(args, workload).initial():
            gens[a.key] = engine.generate([a.prompt], a.max_new_tokens)[0]
    else:
        order: Iterator[tuple[int, int]] = iter([])

        def serve(prompts: list[np.ndarray]) -> list[np.ndarray]:
            out = []
            for p in prompts:
                key = next(order)
                gens[key] = engine.generate([p], workload.max_new_tokens)[0]
                out.append(gens[key].tokens)
            return out

        order = iter(
            [
                (i, t)
                for t in range(workload.num_rounds)
                for i, s in enumerate(workload.sessions)
                if t < len(s.segments)
            ]
        )
        workload.run(serve)
    engine.cache.flush()
    return gens, time.perf_counter() - t0


def batched_run(
    engine: BatchedEngine, args: argparse.Namespace, workload: Workload
) -> tuple[dict[Any, Generation[BatchedRecord]], float]:
    import time

    t0 = time.perf_counter()
    gens = {g.record.key: g for g in engine.serve(arrivals_for(args, workload))}
    engine.cache.flush()
    return gens, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q) * 1e3) if values else 0.0


def summary(
    gens: Mapping[Any, Generation[BatchedRecord]],
    wall: float,
    stats: dict[str, Any],
    counters: collections.Counter,
) -> dict[str, Any]:
    """The table's figures of one batched run (``stats``: its cache's ``stats()``;
    ``counters``: its engine's)."""
    recs = [g.record for g in gens.values()]
    ttft = [r.ttft_s for r in recs]
    itl = [x for r in recs for x in r.itl_s]
    prompt = sum(r.prompt_tokens for r in recs)
    generated = sum(r.output_tokens for r in recs)
    st = stats
    out = {
        "requests": len(recs),
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "recomputed_tokens": sum(r.recomputed_tokens for r in recs),
        "l1_hit_tokens": sum(r.device_hit_tokens for r in recs),
        "l2_hit_tokens": sum(r.host_hit_tokens for r in recs),
        "l2_declined_tokens": sum(r.host_declined_tokens for r in recs),
        "prompt_tokens_per_s": prompt / wall,
        "generated_tokens_per_s": generated / wall,
        "tokens_per_s": (prompt + generated) / wall,
        "wall_s": wall,
        "bytes_to_host": st["bytes_to_host"],
        "bytes_to_device": st["bytes_to_device"],
        "retractions": counters["retractions"],
        "load_back_calls": counters["load_back_calls"],
        "load_backs": st["load_backs"],
        "steps": counters["steps"],
        "forward_calls": counters["forward_calls"],
        "leaked_caller_pages": st["device_caller_pages"],
        "locked_pages_after_drain": st["device_protected_pages"],
    }
    for q in (50, 90, 99):
        out[f"ttft_p{q}_ms"] = _pct(ttft, q)
        out[f"itl_p{q}_ms"] = _pct(itl, q)
    return out


def compare(
    batched: Mapping[Any, Generation[RequestRecord]],
    serial: Mapping[Any, Generation[RequestRecord]],
    tol: float = LOGITS_TOL,
) -> dict[str, Any]:
    """Tokens identical per request, and the max abs difference of first-token logits."""
    same = set(batched) == set(serial) and all(
        np.array_equal(batched[k].tokens, serial[k].tokens) for k in serial
    )
    diff = max(
        (
            float(np.abs(batched[k].first_logits - serial[k].first_logits).max())
            for k in serial
            if k in batched
        ),
        default=float("inf"),
    )
    return {
        "tokens_identical": bool(same),
        "first_logits_max_abs_diff": diff,
        "logits_within_tol": diff <= tol,
    }


#: (header, summary key) of the table's columns after the configuration's name
COLUMNS = [
    ("recomputed", "recomputed_tokens"),
    ("L1 hit", "l1_hit_tokens"),
    ("L2 hit", "l2_hit_tokens"),
    ("prompt tok/s", "prompt_tokens_per_s"),
    ("gen tok/s", "generated_tokens_per_s"),
    ("x serial", "speedup_vs_serial"),
    ("TTFT p50/p90/p99 ms", "ttft"),
    ("ITL p50/p90/p99 ms", "itl"),
    ("MB to host", "bytes_to_host"),
    ("MB to device", "bytes_to_device"),
    ("retract", "retractions"),
    ("same tokens", "tokens_identical"),
    ("logits diff", "first_logits_max_abs_diff"),
]


def table(summaries: dict[str, dict[str, Any]]) -> str:
    rows = []
    for name, s in summaries.items():
        row = [name]
        for _, key in COLUMNS:
            if key in ("ttft", "itl"):
                row.append("/".join(f"{s[f'{key}_p{q}_ms']:.1f}" for q in (50, 90, 99)))
            elif key.startswith("bytes"):
                row.append(f"{s[key] / 2**20:.2f}")
            elif key == "tokens_identical":
                row.append("yes" if s[key] else "NO")
            elif key == "first_logits_max_abs_diff":
                row.append(f"{s[key]:.1e}")
            elif isinstance(s[key], float):
                row.append(f"{s[key]:.2f}" if key == "speedup_vs_serial" else f"{s[key]:.0f}")
            else:
                row.append(str(s[key]))
        rows.append(row)
    return format_table(["config", *(h for h, _ in COLUMNS)], rows)


def bench_batched(
    args: argparse.Namespace,
    workload: Workload,
    make_serial: Callable[[str], Engine],
    make_batched: Callable[[str], BatchedEngine],
    configs: tuple[tuple[str, str], ...],
    progress: Callable[[str], None],
) -> tuple[dict[str, Any], dict[str, list[dict]]]:
    """Every configuration warmed up (unless --no-warmup), then ``--repeats`` rounds, each
    running every configuration's serial then batched engine: drifting machine load hits the
    serial and batched runs of a configuration alike, and the configurations compared with each
    other (hicache / radix TTFT) alike too.

    Returns:
        (summary per configuration, per-request records of the batched runs).
    """
    if not args.no_warmup:
        for name, mode in configs:
            progress(f"{name}: warm-up")
            warm = make_serial(mode)
            serial_run(warm, args, workload)
            warm.cache.close()
            # A pass that compiles stalls at each compile, and that changes its schedule (more
            # arrives, more copies land meanwhile): the stall-free timed runs then meet shapes
            # it did not. Warm up until a pass compiles nothing (at most --warmup-passes), first
            # as the timed runs go (compile_mixed off: no mixed shape is compiled yet, so this
            # compiles the prefill and decode parts of every mixed step met), then compiling
            # the mixed steps (one forward a step, not two: 0.75-0.9x the wall of a run without
            # a cache or with the radix cache on CPU, benchmarks/RESULTS.md).
            for mixed in (False, True) if args.mixed_warmup else (False,):
                for _ in range(args.warmup_passes):
                    traced = _traces()
                    warm_b = make_batched(mode)
                    warm_b.compile_mixed = mixed
                    batched_run(warm_b, args, workload)
                    warm_b.cache.close()
                    if _traces() == traced:
                        break
    runs: dict[str, Any] = {name: collections.defaultdict(list) for name, _ in configs}
    for rep in range(args.repeats):
        for name, mode in configs:
            r = runs[name]
            progress(f"{name}: serial ({rep + 1}/{args.repeats})")
            ser = make_serial(mode)
            s_gens, s_wall = serial_run(ser, args, workload)
            ser.cache.close()
            progress(f"{name}: batched ({rep + 1}/{args.repeats})")
            eng = make_batched(mode)
            traced = _traces()
            b_gens, b_wall = batched_run(eng, args, workload)
            counts = (eng.cache.stats(), eng.counters)
            r["summaries"].append(summary(b_gens, b_wall, *counts))
            r["compiles"].append(_traces() - traced)
            eng.cache.close()
            r["s_walls"].append(s_wall)
            r["b_walls"].append(b_wall)
            r["last"] = (s_gens, b_gens, counts)  # counts and outputs: the last round's
            del ser, eng  # their pools go now, not at the end of the bench
    summaries: dict[str, Any] = {}
    per_request: dict[str, list[dict]] = {}
    for name, _ in configs:
        r = runs[name]
        s_gens, b_gens, counts = r["last"]
        s = summary(b_gens, float(np.median(r["b_walls"])), *counts)  # the last run's counts
        for key in [k for k in s if k.startswith(("ttft_", "itl_"))]:  # times: the median run
            s[key] = float(np.median([x[key] for x in r["summaries"]]))
        s["wall_s_runs"], s["serial_wall_s_runs"] = r["b_walls"], r["s_walls"]
        s["ttft_p50_ms_runs"] = [x["ttft_p50_ms"] for x in r["summaries"]]
        s["compiles_in_timed_runs"] = r["compiles"]  # a compile stalls every running request
        s_tokens = sum(g.record.prompt_tokens + g.record.output_tokens for g in s_gens.values())
        s["serial_tokens_per_s"] = s_tokens / float(np.median(r["s_walls"]))
        s["serial_ttft_p50_ms"] = _pct([g.record.ttft_s for g in s_gens.values()], 50)
        s["speedup_vs_serial"] = s["tokens_per_s"] / s["serial_tokens_per_s"]
        s.update(compare(b_gens, s_gens, logits_tol(args.dtype)))
        summaries[name] = s
        per_request[name] = [dict(vars(g.record)) for g in b_gens.values()]
    return summaries, per_request


def _traces() -> int:
    """Batched-step traces (= compiles) so far: both paths, all shapes."""
    return trace_count("batch_step") + trace_count("batch_layer")


def plot(path: str, per_request: dict[str, list[dict]]) -> None:
    """TTFT under load: per configuration, TTFT against arrival time, and its CDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in per_request.items():
        t0 = min(r["arrival_s"] for r in recs)
        pts = sorted((r["arrival_s"] - t0, 1e3 * r["ttft_s"]) for r in recs)
        ax_t.plot([p[0] for p in pts], [p[1] for p in pts], marker=".", ls="-", label=name)
        ttft = np.sort([1e3 * r["ttft_s"] for r in recs])
        ax_c.plot(ttft, np.arange(1, ttft.size + 1) / ttft.size, label=name)
    ax_t.set(xlabel="arrival (s since start)", ylabel="TTFT (ms)", title="TTFT under load")
    ax_c.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1))
    ax_t.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
