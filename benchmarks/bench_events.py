"""What KV events cost: requests/s of a trace replay with events off, queued, and over ZMQ.

Replays a Mooncake-format trace (default: tests/data/mooncake_synthetic_300.jsonl) through the
request flow of :mod:`benchmarks.replay_driver` (the public API, one request at a time) with
``kv_events=None`` (off), ``{"publisher": "queue"}`` (in-process, nobody taking: the bounded
buffer drops and counts) and ``{"publisher": "zmq"}`` with a live subscriber (a SUB socket
drained by another thread of the worker; it counts, and does not decode, so that its own
decoding does not hold the GIL against the cache). The limit it is judged against: the same
replay with events off, in the same run. Target: ZMQ with a live subscriber within 1.5x of
events off.

Each replay runs in a fresh worker subprocess (one untimed warm-up replay first: jit compiles),
for the current tree and for a baseline revision (``--baseline REV``, default 51b3710: before
the background publisher and the XXH3 page hashes; :mod:`benchmarks.replay_driver`),
alternating tree and mode, so that drifts of the shared machine hit every row; medians of
``--repeats``.

Usage: ``python -m benchmarks.bench_events [TRACE] [--quick] [--repeats N] [--baseline REV |
--no-baseline] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import socket
import statistics
import tempfile
import threading
import time

from benchmarks import replay_driver as rd

REPO = str(pathlib.Path(__file__).resolve().parents[1])
TRACE = pathlib.Path(REPO) / "tests" / "data" / "mooncake_synthetic_300.jsonl"
BASE_COMMIT = "51b3710"  # main before the background publisher and XXH3 page hashes
MODES = ("off", "queue", "zmq")
CPU_PARTS = ("main", "publisher", "subscriber", "other", "process")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Drain:
    """A live subscriber on its own thread: receives every batch until stopped (counts)."""

    def __init__(self, endpoint: str) -> None:
        import zmq

        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RECONNECT_IVL, 1)  # the cache binds later: join it at once
        self._sub.connect(endpoint)
        self.batches = self.bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sub.poll(50):
                _, _, payload = self._sub.recv_multipart()
                self.batches += 1
                self.bytes += len(payload)
        self.cpu_s = time.thread_time()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sub.close(linger=0)


def _time_publisher_thread() -> list:
    """CPU seconds of each publisher thread (the current tree's; none in the base's)."""
    try:
        from hicache_jax.events.zmq import _Publisher
    except ImportError:
        return []
    spent, run = [], _Publisher._run

    def timed(self):
        try:
            run(self)
        finally:
            spent.append(time.thread_time())

    _Publisher._run = timed
    return spent


def run_mode(mode: str, prompts, spec, device_pages: int) -> dict:
    """One replay with events ``mode`` (in this process)."""
    from hicache_jax import HiCacheConfig

    kv_events, drain = None, None
    if mode == "queue":
        kv_events = {"publisher": "queue"}
    elif mode == "zmq":
        endpoint = f"tcp://127.0.0.1:{_free_port()}"
        kv_events = {"publisher": "zmq", "endpoint": endpoint}
        drain = Drain(endpoint)
    kw = {} if kv_events is None else {"kv_events": kv_events}  # a revision may lack the field
    cfg = HiCacheConfig(device_pages=device_pages, host_pages=4 * device_pages, **kw)
    publisher = _time_publisher_thread() if mode == "zmq" else []
    main0, proc0 = time.thread_time(), time.process_time()
    try:
        r = rd.replay(prompts, spec, cfg)
    finally:
        if drain is not None:
            drain.close()
    n = len(prompts)
    cpu = {
        "main": time.thread_time() - main0,
        "process": time.process_time() - proc0,
        "publisher": sum(publisher) if publisher else None,
        "subscriber": drain.cpu_s if drain is not None else None,
    }
    # The rest: libzmq's I/O thread, XLA's threads (and the GC of pyzmq, jax's ...).
    cpu["other"] = cpu["process"] - sum(v or 0.0 for k, v in cpu.items() if k != "process")
    # CPU us a request: the whole replay() call (the cache's construction and close too).
    return {
        "requests_per_s": r["requests_per_s"],
        "wall_s": r["wall_s"],
        "hit_ratio": r["hit_ratio"],
        "hit_tokens": r["hit_tokens"],
        "received_batches": None if drain is None else drain.batches,
        "cpu_us_per_request": {k: None if v is None else v / n * 1e6 for k, v in cpu.items()},
    }


def worker(p: dict) -> dict:
    """A worker subprocess (the tree under test): warm up, then one timed replay of mode
    ``p["mode"]``."""
    prompts = rd.load_prompts(p["prompts"])
    spec = rd.tiny_spec(p["block_size"])
    run_mode("off", prompts, spec, p["device_pages"])  # warm-up: jit compiles, page-in
    import msgspec  # noqa: F401  (imported by the zmq publisher: not in the timed CPU)
    import zmq  # noqa: F401

    r = run_mode(p["mode"], prompts, spec, p["device_pages"])
    return r | {"device_pages": p["device_pages"], "requests": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=str(TRACE))
    ap.add_argument("--quick", action="store_true", help="100 requests, 1 repeat, no baseline")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--limit", type=int, default=None, help="first N requests of the trace")
    ap.add_argument("--block-size", type=int, default=512)
    rd.add_baseline_flags(ap, BASE_COMMIT)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return rd.worker_main(worker, args.worker)
    if args.quick:
        args.limit, args.repeats, args.baseline = args.limit or 100, 1, None
    from hicache_jax.replay.block_lru import default_device_pages
    from hicache_jax.replay.trace import load_trace

    trace = load_trace(args.trace, block_size=args.block_size, limit=args.limit)
    with (
        tempfile.TemporaryDirectory(prefix="bench_events_") as tmp,
        rd.Trees(args.baseline) as trees,
    ):
        path = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(rd.Prompts.from_trace(trace), path)
        payload = {
            "prompts": path,
            "block_size": args.block_size,
            "device_pages": default_device_pages(trace, args.block_size),
        }
        runs: dict = {t.label: {m: [] for m in MODES} for t in trees}
        for _, mode, tree in (
            (r, m, t) for r in range(args.repeats) for m in MODES for t in trees
        ):  # interleaved: drifts hit every row
            runs[tree.label][mode].append(
                rd.run_worker(tree, "bench_events", payload | {"mode": mode})
            )
    report(args, [t.label for t in trees], runs)


def report(args, trees: list[str], runs: dict) -> None:
    from benchmarks.common import print_table, write_json
    from hicache_jax.cli.results import figure

    rows, ratios, figures = [], {}, []
    trees = trees[::-1]  # the baseline's rows first
    for t in trees:
        rps = {m: statistics.median(r["requests_per_s"] for r in runs[t][m]) for m in MODES}
        figures += [
            figure(
                f"replay requests/s, events {m} ({t} tree)",
                "req/s",
                rps[m],
                "events off, same run",
                rps["off"],
                "bench_events",
                higher_is_better=True,
            )
            for m in MODES[1:]
        ]
        best = {m: max(r["requests_per_s"] for r in runs[t][m]) for m in MODES}
        main = {
            m: statistics.median(r["cpu_us_per_request"]["main"] for r in runs[t][m]) for m in MODES
        }
        ratios[t] = {m: rps["off"] / rps[m] for m in MODES}
        for m in MODES:
            rows.append(
                [
                    t,
                    m,
                    f"{rps[m]:,.0f}",
                    ratios[t][m],
                    f"{best[m]:,.0f}",
                    best["off"] / best[m],
                    main[m] / main["off"],
                    runs[t][m][-1]["received_batches"],
                ]
            )
    first = runs["current"]["off"][0]
    print_table(
        [
            "tree",
            "events",
            "req/s median",
            "slowdown vs off",
            "req/s best",
            "slowdown (best)",
            "main-thread CPU vs off",
            "batches received",
        ],
        rows,
        title=f"KV events on a replay of {pathlib.Path(args.trace).name} "
        f"({first['requests']} requests, L1 {first['device_pages']} pages, L2 4x; "
        f"median of {args.repeats}; load average {os.getloadavg()[0]:.1f})",
    )
    cpu_rows = []
    for t in trees:
        for m in MODES:
            cpu = [r["cpu_us_per_request"] for r in runs[t][m]]
            cpu_rows.append(
                [t, m]
                + [
                    statistics.median(c[k] for c in cpu) if cpu[0][k] is not None else "-"
                    for k in CPU_PARTS
                ]
            )
    print_table(
        ["tree", "events"] + [f"{k} CPU us/req" for k in CPU_PARTS],
        cpu_rows,
        title="CPU time per request by thread (medians; the whole replay() call, "
        "construction and close included; 'process' is all threads)",
    )
    ok = ratios["current"]["zmq"] <= 1.5
    base = (
        f"; baseline {args.baseline}: {ratios[args.baseline]['zmq']:.2f}x" if args.baseline else ""
    )
    print(
        f"\ntarget zmq with a live subscriber within 1.5x of events off: "
        f"{'met' if ok else 'NOT met'} ({ratios['current']['zmq']:.2f}x{base})"
    )
    write_json(args.json, "bench_events", vars(args), {"runs": runs, "slowdown": ratios}, figures)


if __name__ == "__main__":
    main()
