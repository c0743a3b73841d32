"""Instructions the control plane executes per request, against a baseline revision: a measure
a loaded machine does not move.

On a machine shared with other jobs, the wall (and CPU) time of a replay moves by tens of percent
from one run to the next (bench_control_plane's ABBA pairs), so a 5% question cannot be settled
by time there. This benchmark counts the instructions of the same replays instead, under
valgrind's callgrind: each worker replays the trace twice uninstrumented (warm-up, jit
compiles), then ``--replays`` times with instrumentation switched on around them only (a
client request from a small helper library compiled here with ``gcc`` against
``valgrind/callgrind.h``); callgrind's "Collected" count is the figure. ``PYTHONHASHSEED=0`` in
every worker; a rerun of one tree moves the count by well under 1% (RESULTS.md).

Rows: L1 only and L1 + L2 (host = 4x L1), events off, one write policy for both trees
(``--write-policy``, default write_back: clean_ahead's code changed since the baseline, so
its hit figures differ and the comparison would not be of the same work). Hit figures are
printed so a change of behaviour shows. Target: current / baseline instructions <= 1.05
(events off unchanged within 5%).

Usage: ``python -m benchmarks.bench_instructions [--baseline REV] [--replays 3]
[--write-policy write_back] [--json PATH]`` (needs valgrind, its headers and gcc; minutes:
valgrind runs the workers' imports ~5x slower).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from benchmarks import replay_driver as rd

DEFAULT_TRACE = os.path.join(os.path.dirname(__file__), "data", "mooncake_synthetic_1000.jsonl")
BASE_COMMIT = "f61da1a"
LIMIT = 1.05
_HELPER = """#include <valgrind/callgrind.h>
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; CALLGRIND_TOGGLE_COLLECT; }
void cg_stop(void) { CALLGRIND_TOGGLE_COLLECT; CALLGRIND_STOP_INSTRUMENTATION; }
"""


def worker(p: dict) -> dict:
    import ctypes

    from hicache_jax import HiCacheConfig

    helper = ctypes.CDLL(p["helper"])
    prompts = rd.load_prompts(p["prompts"])
    spec = rd.tiny_spec(prompts.block_size)
    cfg = HiCacheConfig(
        device_pages=p["device_pages"], host_pages=p["host_pages"], write_policy=p["write_policy"]
    )
    tokens = [prompts.tokens(i) for i in range(len(prompts))]
    for _ in range(2):
        rd.replay(tokens, spec, cfg)  # warm-up, not counted
    helper.cg_start()
    for _ in range(p["replays"]):
        r = rd.replay(tokens, spec, cfg)
    helper.cg_stop()
    return {
        "requests": len(prompts),
        "device_hit_tokens": r["device_hit_tokens"],
        "host_hit_tokens": r["host_hit_tokens"],
        "evictions": r["stats"]["evictions"],
        "backups": r["stats"]["backups"],
    }


def _helper(tmp: str) -> str:
    src, lib = os.path.join(tmp, "cg.c"), os.path.join(tmp, "libcg.so")
    with open(src, "w") as f:
        f.write(_HELPER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", lib, src], check=True)
    return lib


def _count(tree: rd.Tree, payload: dict, out: str) -> dict:
    """One worker under callgrind: its RESULT and the instructions collected."""
    path = tree.lib if tree.lib == rd.REPO else tree.lib + os.pathsep + rd.REPO
    env = dict(
        os.environ,
        PYTHONPATH=path,
        PYTHONHASHSEED="0",
        JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"),
    )
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--collect-atstart=no",
        f"--callgrind-out-file={out}",
        sys.executable,
        "-m",
        "benchmarks.bench_instructions",
        "--worker",
        json.dumps(payload),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=tree.lib)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    got = re.search(r"Collected\s*:\s*(\d+)", proc.stderr)
    if proc.returncode or line is None or got is None:
        raise rd.WorkerError(
            f"worker against {tree.label} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    res = json.loads(line[len("RESULT ") :])
    if not os.path.realpath(res["module"]).startswith(os.path.realpath(tree.lib)):
        raise rd.WorkerError(f"worker imported {res['module']}, not the tree at {tree.lib}")
    return res | {"instructions": int(got.group(1))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", default=DEFAULT_TRACE)
    ap.add_argument("--device-tokens", type=float, default=3e6, help="L1 size in tokens")
    ap.add_argument("--host-ratio", type=float, default=4.0)
    ap.add_argument("--write-policy", default="write_back")
    ap.add_argument("--replays", type=int, default=3)
    ap.add_argument("--baseline", "--base", dest="baseline", default=BASE_COMMIT, metavar="REV")
    ap.add_argument("--json", default=None, help="write the counts and the environment here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return rd.worker_main(worker, args.worker)
    missing = [t for t in ("valgrind", "gcc") if shutil.which(t) is None]
    if missing or not os.path.exists("/usr/include/valgrind/callgrind.h"):
        raise SystemExit(
            f"needs valgrind, gcc and valgrind/callgrind.h (missing: "
            f"{', '.join(missing) or 'callgrind.h'})"
        )
    from hicache_jax.replay.trace import load_trace

    prompts = rd.Prompts.from_trace(load_trace(args.trace))
    l1 = int(args.device_tokens) // prompts.block_size
    print(
        f"{args.trace}: {len(prompts)} requests, page {prompts.block_size}; L1 {l1} pages; "
        f"write policy {args.write_policy}; {args.replays} replays counted per worker"
    )
    with (
        tempfile.TemporaryDirectory(prefix="bench_instr_") as tmp,
        rd.Trees(args.baseline) as trees,
    ):
        npz = os.path.join(tmp, "prompts.npz")
        rd.save_prompts(prompts, npz)
        base = {
            "prompts": npz,
            "helper": _helper(tmp),
            "write_policy": args.write_policy,
            "replays": args.replays,
            "device_pages": l1,
        }
        jobs = [
            (tier, tree, dict(base, host_pages=host))
            for tier, host in (("L1", 0), ("L1+L2", int(round(args.host_ratio * l1))))
            for tree in trees
        ]
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futs = [
                pool.submit(_count, tree, p, os.path.join(tmp, f"cg.{i}"))
                for i, (_, tree, p) in enumerate(jobs)
            ]
            results = [f.result() for f in futs]
    rows: dict[str, dict[str, dict]] = {}
    for (tier, tree, _), res in zip(jobs, results):
        rows.setdefault(tier, {})[tree.label] = res
    if args.json:
        from benchmarks.common import env_info

        with open(args.json, "w") as f:
            json.dump(
                {
                    "env": env_info() | {"load_average": list(os.getloadavg())},
                    "config": vars(args) | {"device_pages": l1},
                    "rows": rows,
                },
                f,
                indent=1,
            )
    for tier, by_tree in rows.items():
        for label, res in by_tree.items():
            per = res["instructions"] / (args.replays * res["requests"])
            hits = [
                res[k] for k in ("device_hit_tokens", "host_hit_tokens", "backups", "evictions")
            ]
            print(
                f"  {tier:6} {label:>8}: {res['instructions']:,} instructions, "
                f"{per:,.0f} a request; hits/backups/evictions {hits}"
            )
        if len(by_tree) == 2:
            cur, bas = by_tree["current"], next(v for k, v in by_tree.items() if k != "current")
            ratio = cur["instructions"] / bas["instructions"]
            same = all(
                cur[k] == bas[k]
                for k in ("device_hit_tokens", "host_hit_tokens", "backups", "evictions")
            )
            print(
                f"  {tier:6} current / {args.baseline}: {ratio:.4f}x instructions (limit "
                f"{LIMIT}: {'met' if ratio <= LIMIT else 'NOT met'}); hits, backups and "
                f"evictions {'identical' if same else 'DIFFER: not the same work'}"
            )


if __name__ == "__main__":
    main()
