"""The agreement's cost per request: one cache over 1, 2 and 4 local jax.distributed processes.

Each process has one CPU device (gloo collectives); the cache's kv heads are sharded over every
process's device, and every process replays the same slice of the shipped Mooncake trace through
the request handle (:func:`benchmarks.replay_driver.serve`: begin, extend, flush, finish, flush),
with a tiny KVSpec so that what is timed is the control plane. With several processes every
decision input is agreed through the cache's group (ARCHITECTURE.md, "Several processes"; its
transport ``--transport``: direct sockets by default, or jax.distributed's key-value store); the
figure is each run's wall time per request beside the one-process run's of the same slice in
the same invocation (the ratio is what is judged: target <= 1.3x at 2 processes), with the
agreements' share of the time (``Group.seconds``) and their count per request. The hit figures
of every run must equal the one-process run's (printed: a difference fails the benchmark).

Usage: ``python -m benchmarks.bench_multihost [--requests 200] [--processes 1,2,4]
[--transport socket|kv] [--in-flight] [--completion-lag K] [--json PATH]`` (the cache's
group transport; before
the timed loop each multi-process run also times one agreement over both transports and prints
them); ``--in-flight`` leaves out each request's flushes, so the copies it started are in
flight at the next request's start, where several processes agree them (one agreement there;
the hit figures then depend on when copies land, so they are printed, not compared);
``--completion-lag K`` runs the cache with ``HiCacheConfig(completion_lag=K)``: a copy counts
as done at the K-th request start after its dispatch, with no agreement, so with
``--in-flight`` the hit figures are again compared with the one-process run's;
``--beside`` also times, for each count N > 1 of ``--processes``, N independent one-process runs
at once.
``BENCH_MULTIHOST_PROFILE=PREFIX`` writes each process's cProfile of the timed loop to
``PREFIX-<N>p-<id>.prof``. Runs the processes itself (their own coordinator port, killed at
the end).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_TRACE = os.path.join(HERE, "data", "mooncake_synthetic_1000.jsonl")
HEADS = 4  # divisible by every process count measured
FIGURES = (
    "device_hit_tokens",
    "host_hit_tokens",
    "backups",
    "load_backs",
    "evictions",
    "host_evictions",
)


def _round_trips(steps: int = 300) -> dict:
    """The median time of one agreement (an allgather of a short string, as a transfer poll's)
    over each transport, measured here, between the same processes."""
    from hicache_jax.memory.group import DistributedGroup

    out = {}
    for transport in ("kv", "socket"):
        g = DistributedGroup(60.0, name=f"bench/round-trip/{transport}", transport=transport)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            g.agree_min("round trip", [i, 3])
            times.append(time.perf_counter() - t0)
        g.close()
        out[transport] = sorted(times)[steps // 2]
    return out


def _serve(cache, tokens, whole: int, in_flight: bool) -> None:
    """One request: :func:`replay_driver.serve`, or (``in_flight``) its flow without its
    flushes: the copies it starts (write-backs of the pages it evicts, load-backs) stay in
    flight into the next request."""
    from benchmarks import replay_driver as rd

    if not in_flight:
        rd.serve(cache, tokens, whole)
        return
    with cache.begin(tokens) as req:
        req.extend(tokens.shape[0] - req.cached_len)
        req.finish(tokens)


def _worker(
    pid: int,
    n: int,
    port: int,
    requests: int,
    device_tokens: int,
    out: str,
    transport: str,
    in_flight: bool = False,
    lag: int = 0,
) -> None:
    import jax

    if n > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            f"127.0.0.1:{port}", num_processes=n, process_id=pid, initialization_timeout=120
        )
    import numpy as np
    from jax.sharding import Mesh

    from benchmarks import replay_driver as rd
    from hicache_jax import HiCacheConfig, KVSpec
    from hicache_jax.memory.group import DistributedGroup
    from hicache_jax.replay.trace import load_trace

    prompts = rd.Prompts.from_trace(load_trace(DEFAULT_TRACE))
    ps = 16
    spec = KVSpec(num_layers=1, num_kv_heads=HEADS, head_dim=1, dtype="float32", page_size=ps)
    cfg = HiCacheConfig(
        device_pages=device_tokens // ps,
        host_ratio=2.0,
        mesh=Mesh(np.array(jax.devices()), ("heads",)),
        agreement_timeout_s=60.0,
        completion_lag=lag or None,
        group=DistributedGroup(60.0, transport=transport) if n > 1 else None,
    )
    round_trips = _round_trips() if n > 1 else {}
    cache = rd.new_cache(spec, cfg)
    group = cache._group
    seen = [prompts.tokens(i) for i in range(requests)]
    for tokens in seen:  # the same slice once untimed: every page-copy bucket compiles here
        whole = min(tokens.shape[0] // ps, cfg.device_pages)
        _serve(cache, tokens[: whole * ps], whole, in_flight)
    cache.reset()
    prof = os.environ.get("BENCH_MULTIHOST_PROFILE")  # a path prefix: cProfile the timed loop
    if prof:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    tags0 = dict(getattr(group, "calls_by_tag", {}))
    t0, g0, c0 = time.perf_counter(), getattr(group, "seconds", 0.0), getattr(group, "calls", 0)
    cpu0 = time.process_time()
    for tokens in seen:
        whole = min(tokens.shape[0] // ps, cfg.device_pages)
        _serve(cache, tokens[: whole * ps], whole, in_flight)
    cache.flush()  # the last request's copies (--in-flight), inside the time
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0  # this process's CPU (every thread): apart from waiting
    if prof:
        profiler.disable()
        profiler.dump_stats(f"{prof}-{n}p-{pid}.prof")
    # the timed loop's agreements only (the check below waits for the slowest peer)
    g1, c1 = getattr(group, "seconds", 0.0), getattr(group, "calls", 0)
    tags1 = dict(getattr(group, "calls_by_tag", {}))
    stats = cache.stats()
    cache.check_agreement()
    result = {
        "processes": n,
        "requests": requests,
        "wall_s": wall,
        "cpu_s": cpu,
        "transport": transport,
        "in_flight": in_flight,
        "completion_lag": lag,
        "lag_waits": stats.get("completion_lag_waits", 0),
        "lag_wait_s": stats.get("completion_lag_wait_seconds", 0.0),
        "round_trip_s": round_trips,
        "agreement_s": g1 - g0,
        "agreements": c1 - c0,
        "agreements_by_tag": {
            t: c - tags0.get(t, 0) for t, c in tags1.items() if c > tags0.get(t, 0)
        },
        "figures": {k: stats[k] for k in FIGURES},
    }
    if pid == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    sys.stdout.flush()
    if n > 1:
        # Process 0 hosts the coordination service: a peer still connected when it leaves
        # aborts (SIGABRT). The shutdown's barrier lets every process leave together.
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(
    n: int,
    requests: int,
    device_tokens: int,
    transport: str = "socket",
    timeout: float = 600.0,
    copies: int = 1,
    in_flight: bool = False,
    lag: int = 0,
) -> dict:
    """One run over ``n`` processes; process 0's figures. ``copies`` > 1 (``n`` 1 only): that
    many independent one-process runs at once (the CPU load of a ``copies``-process run
    without its agreements); the first one's figures, the times the mean of all."""
    assert n == 1 or copies == 1
    port = _free_port()
    outs = [tempfile.mktemp(suffix=".json") for _ in range(copies)]
    env = dict(
        os.environ,
        XLA_FLAGS="--xla_force_host_platform_device_count=1",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=ROOT,
    )
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.bench_multihost",
                "--worker",
                str(i if copies == 1 else 0),
                str(n),
                str(port),
                str(requests),
                str(device_tokens),
                outs[0 if copies == 1 else i],
                transport,
                "1" if in_flight else "0",
                str(lag),
            ],
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        for i in range(max(n, copies))
    ]
    try:
        deadline = time.monotonic() + timeout
        for p in procs:
            p.wait(max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(
            f"a process of the {n}-process run failed: {[p.returncode for p in procs]}"
        )
    results = []
    for out in outs:
        with open(out) as f:
            results.append(json.load(f))
    first = results[0]
    for k in ("wall_s", "cpu_s"):
        first[k] = sum(r[k] for r in results) / len(results)
    first["copies"] = copies
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--device-tokens", type=int, default=200_000)
    ap.add_argument("--json")
    ap.add_argument(
        "--transport",
        default="socket",
        choices=("socket", "kv"),
        help="the cache's group transport with several processes (default socket)",
    )
    ap.add_argument(
        "--beside",
        action="store_true",
        help="also time, for each N > 1 of --processes, N independent one-process "
        "runs at once: one process's time per request under the CPU load of the "
        "N-process run, "
        "without their agreements (what the agreements add is the ratio to it)",
    )
    ap.add_argument(
        "--in-flight",
        action="store_true",
        help="leave out each request's flushes: its copies are in flight at the "
        "next request's start (agreed there); hit figures not compared "
        "unless --completion-lag",
    )
    ap.add_argument(
        "--completion-lag",
        type=int,
        default=0,
        metavar="K",
        help="HiCacheConfig(completion_lag=K): copies count as done at the K-th "
        "request start after dispatch, with no agreement (default 0: off)",
    )
    ap.add_argument("--worker", nargs=9, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        pid, n, port, requests, tokens = map(int, args.worker[:5])
        _worker(
            pid,
            n,
            port,
            requests,
            tokens,
            args.worker[5],
            args.worker[6],
            args.worker[7] == "1",
            int(args.worker[8]),
        )
        return
    from benchmarks.common import write_json

    counts = [int(x) for x in args.processes.split(",")]
    runs = {
        n: run(
            n,
            args.requests,
            args.device_tokens,
            args.transport,
            in_flight=args.in_flight,
            lag=args.completion_lag,
        )
        for n in counts
    }
    compared = not args.in_flight or args.completion_lag > 0
    base = runs[counts[0]]
    print(
        f"{'processes':>9} {'us/request':>11} {'x 1 process':>12} {'cpu us/req':>11} "
        f"{'agreements/req':>15} {'agreement share':>16}  figures"
    )
    ok = True
    for n, r in runs.items():
        per = r["wall_s"] / r["requests"] * 1e6
        ratio = r["wall_s"] / base["wall_s"]
        share = r["agreement_s"] / r["wall_s"] if r["wall_s"] else 0.0
        same = r["figures"] == base["figures"]
        ok &= same or not compared
        cpu = r["cpu_s"] / r["requests"] * 1e6
        print(
            f"{n:>9} {per:>11.0f} {ratio:>11.2f}x {cpu:>11.0f} "
            f"{r['agreements'] / r['requests']:>15.2f} "
            f"{share:>15.0%}  {'same' if same else r['figures']}"
        )
        if r.get("agreements_by_tag"):
            print(
                " " * 10
                + "agreements/request by call: "
                + ", ".join(
                    f"{t} {c / r['requests']:.2f}"
                    for t, c in sorted(r["agreements_by_tag"].items(), key=lambda kv: -kv[1])
                )
            )
        if r.get("completion_lag"):
            print(
                " " * 10 + f"completion lag {r['completion_lag']}: "
                f"{r['lag_waits'] / r['requests']:.2f} waits/request, "
                f"{r['lag_wait_s'] / r['wall_s']:.0%} of the time"
            )
    for n, r in runs.items():
        rt = r.get("round_trip_s")
        if rt:
            print(
                f"{n} processes: one agreement (median of 300, measured in the run): "
                f"kv store {rt['kv'] * 1e6:.0f} us, socket {rt['socket'] * 1e6:.0f} us "
                f"({rt['kv'] / rt['socket']:.1f}x faster); the cache's group: {r['transport']}"
            )
    if args.beside:
        for n in [c for c in counts if c > 1]:
            b = run(
                1,
                args.requests,
                args.device_tokens,
                copies=n,
                in_flight=args.in_flight,
                lag=args.completion_lag,
            )
            ok &= b["figures"] == base["figures"] or not compared
            print(
                f"{n} one-process runs at once: "
                f"{b['wall_s'] / b['requests'] * 1e6:.0f} us/request "
                f"(cpu {b['cpu_s'] / b['requests'] * 1e6:.0f}); the {n}-process run: "
                f"{runs[n]['wall_s'] / b['wall_s']:.2f}x that"
            )
            runs[f"{n}x1"] = b
    if 2 in runs:
        r2 = runs[2]["wall_s"] / base["wall_s"]
        print(
            f"control plane at 2 processes: {r2:.2f}x one process's time per request "
            f"(target <= 1.3x): {'met' if r2 <= 1.3 else 'NOT met'}"
        )
    write_json(args.json, "bench_multihost", vars(args), runs)
    if not ok:
        raise SystemExit("hit figures differ from the one-process run")


if __name__ == "__main__":
    main()
