"""The reference engine over 1, 2 and 4 processes: the same tokens and figures as one process?

Runs ``hicache-jax bench`` (serial engine, the default chat workload at a reduced size) as
``--processes N`` for each N (one CPU device each, gloo, the model tensor-parallel over them),
plus, for each N > 1, the same sharded programs in one process over N CPU devices
(``--tensor-parallel``: the same partitioned programs, their all-reduces inside one process).
The one-process unsharded run is the baseline of tokens and figures. Printed per run: whether
every configuration's generated tokens equal the baseline's, whether every hit and transfer
figure does (timings aside): what is judged; whether the first-token logits equal the
baseline's and the same-program reference's bit for bit (by digest: reported, not judged, since
an all-reduce over gloo may add in another order than one inside a process or an unsharded
matmul), and the hicache configuration's tok/s
beside the baseline's (a ratio measured in the same invocation; several processes on a
machine of 2 cores share them).

Usage: ``python -m benchmarks.bench_engine_processes [--processes 1,2,4] [--json PATH]
[-- extra bench flags]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: the chat workload at a size that runs in minutes at 4 processes on 2 cores; 4 kv heads and
#: an FFN width divisible by every process count measured
BENCH = [
    "--quiet",
    "--sessions",
    "4",
    "--turns",
    "3",
    "--kv-heads",
    "4",
    "--max-new-tokens",
    "8",
    "--policy",
    "write_through",
]
TIMINGS = ("ttft_p50_ms", "ttft_p90_ms", "tokens_per_s", "wall_s")


def run(flags: list[str], devices: int) -> tuple[dict, float]:
    """One ``hicache-jax bench`` with ``flags``, this process's devices ``devices``: its JSON and
    wall seconds."""
    path = tempfile.mktemp(suffix=".json")
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
    )
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "hicache_jax", "bench", *flags, "--json", path],
        env=env,
        cwd=ROOT,
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=1800,
    )
    wall = time.perf_counter() - t0
    with open(path) as f:
        data = json.load(f)
    os.unlink(path)
    return data, wall


def _figures(data: dict) -> dict:
    return {n: {k: v for k, v in s.items() if k not in TIMINGS} for n, s in data["summary"].items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", default="1,2,4")
    ap.add_argument("--json")
    ap.add_argument("extra", nargs="*", help="more bench flags (after --)")
    args = ap.parse_args()
    from benchmarks.common import write_json

    flags = BENCH + args.extra
    counts = [int(x) for x in args.processes.split(",")]
    runs: dict[str, tuple[dict, float]] = {"1 process, 1 device": run(flags, 1)}
    refs: dict[int, dict] = {}
    for n in counts:
        if n == 1:
            continue
        runs[f"{n} processes"] = run(flags + ["--processes", str(n)], 1)
        refs[n], wall = run(flags + ["--tensor-parallel"], n)
        runs[f"1 process, {n} devices TP"] = (refs[n], wall)
    base = runs["1 process, 1 device"][0]
    print(
        f"{'run':<26} {'procs':>5} {'devs':>4} {'tokens = 1p':>11} {'figures = 1p':>12} "
        f"{'logits = 1p':>11} {'logits = TP ref':>15} {'hicache tok/s':>13} {'x 1p':>6} "
        f"{'wall s':>7}"
    )
    ok, rows = True, {}
    for name, (d, wall) in runs.items():
        env = d["env"]
        n = env["process_count"]
        tokens, figures = d["outputs"] == base["outputs"], _figures(d) == _figures(base)
        logits = d["first_logits_sha256"] == base["first_logits_sha256"]
        ref = refs.get(env["device_count"])
        same_prog = (
            "-"
            if ref is None
            else ("yes" if d["first_logits_sha256"] == ref["first_logits_sha256"] else "no")
        )
        tps = d["summary"]["hicache"]["tokens_per_s"]
        ratio = tps / base["summary"]["hicache"]["tokens_per_s"]
        ok &= tokens and figures and d["outputs_identical"]  # logits: reported, not judged
        print(
            f"{name:<26} {n:>5} {env['device_count']:>4} {'yes' if tokens else 'NO':>11} "
            f"{'yes' if figures else 'NO':>12} {'yes' if logits else 'no':>11} {same_prog:>15} "
            f"{tps:>13.0f} {ratio:>5.2f}x {wall:>7.1f}"
        )
        rows[name] = {
            "processes": n,
            "devices": env["device_count"],
            "tokens_equal": tokens,
            "figures_equal": figures,
            "logits_equal_unsharded": logits,
            "logits_equal_same_program": same_prog,
            "hicache_tokens_per_s": tps,
            "wall_s": wall,
            "summary": d["summary"],
        }
    print(
        f"tokens and hit/transfer figures identical to one process in every run: "
        f"{'yes' if ok else 'NO'}"
    )
    write_json(args.json, "bench_engine_processes", {"bench_flags": flags, **vars(args)}, rows)
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
