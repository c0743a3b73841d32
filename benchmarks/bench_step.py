"""One fused forward step of the reference decoder, its layers unrolled over per-layer weights
against a ``lax.scan`` over the stacked weights, by step size (decode rows, prefill tokens).

The scan's body slices each layer's weights out of the stack, which XLA:CPU does as a copy of
every weight each step; unrolled, each layer reads its own arrays. ``DecoderModel`` unrolls the
steps of at most ``unroll_tokens`` (bucketed) tokens (default ``layers.UNROLL_TOKENS``); this
measures both paths at every size, alternated pair by pair (medians), so the threshold can be
checked against the machine it runs on. Beside them, in the same run: numpy's ``copyto`` of the
model's layer weights (what the scan's slices cost at least) and numpy's matmuls of the step's
dense shapes (every weight matrix once, the lm head once: the dense floor of a small step).
Every pair's logits are checked equal (allclose 1e-6).

Run: ``python -m benchmarks.bench_step [--quick] [--pairs N] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks.common import (
    add_model_flags,
    median_time,
    memcpy_fn,
    model_config,
    print_table,
    write_json,
)
from hicache_jax.engine.layers import UNROLL_TOKENS
from hicache_jax.engine.model import DecoderModel
from hicache_jax.engine.packing import bucket
from hicache_jax.engine.weights import ModelConfig
from hicache_jax.memory.device_pool import DevicePagePool

#: (name, decode rows or prefill tokens): decode rows at a 192-token context, one prefill chunk
SIZES = [
    ("decode", 1),
    ("decode", 2),
    ("decode", 4),
    ("decode", 8),
    ("decode", 16),
    ("prefill", 16),
    ("prefill", 64),
    ("prefill", 256),
]
QUICK = dict(
    layers=2,
    d_model=64,
    heads=4,
    kv_heads=2,
    head_dim=16,
    ffn_dim=128,
    pairs=2,
    calls=5,
    sizes=[("decode", 1), ("decode", 16), ("prefill", 64)],
)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_flags(p, dtype=False)  # float32: numpy's floors are float32
    p.add_argument("--pairs", type=int, default=6, help="alternated (scan, unrolled) pairs")
    p.add_argument("--calls", type=int, default=40, help="timed calls per path per pair")
    p.add_argument("--quick", action="store_true", help="a small model, 2 pairs (a smoke run)")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)
    args.sizes = SIZES
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def _case(kind: str, n: int, ps: int):
    """(chunks, starts, page lists) of one step: n decode rows at position 192 of their own
    pages, or one prefill chunk of n tokens at position 64."""
    if kind == "decode":
        per = -(-193 // ps)
        return (
            [np.array([7], np.int32)] * n,
            [192] * n,
            [np.arange(r * per, (r + 1) * per, dtype=np.int32) for r in range(n)],
        )
    return (
        [np.arange(n, dtype=np.int32) % 97],
        [64],
        [np.arange(-(-(64 + n) // ps), dtype=np.int32)],
    )


def _matmul_fn(cfg: ModelConfig, params, rows: int):
    """numpy: ``rows`` activations through every weight matrix of every layer and the head."""
    mats = [
        np.asarray(v[layer])
        for v in params["layers"].values()
        if v.ndim == 3
        for layer in range(cfg.num_layers)
    ]
    mats.append(np.asarray(params["lm_head"]))
    xs = {m.shape[0]: np.ones((rows, m.shape[0]), np.float32) for m in mats}
    return lambda: [xs[m.shape[0]] @ m for m in mats]


def main(argv=None) -> int:
    args = _args(argv)
    cfg = model_config(args)
    ps = 16
    unrolled = DecoderModel(cfg, seed=0)
    scan = DecoderModel(cfg, unrolled.params, unroll_tokens=0)
    models = {"scan": scan, "unrolled": unrolled}
    pools = {k: DevicePagePool(cfg.kv_spec(ps), 256) for k in models}
    weight_bytes = sum(int(v.nbytes) for v in unrolled.params["layers"].values())
    copy_s = median_time(memcpy_fn(weight_bytes), repeats=21, warmup=3)
    print(
        f"model {cfg.num_layers}L d{cfg.d_model} ffn {cfg.ffn_dim}: layer weights "
        f"{weight_bytes / 1e6:.1f} MB, numpy memcpy of them {copy_s * 1e3:.3f} ms; "
        f"default unroll_tokens {UNROLL_TOKENS}",
        flush=True,
    )

    def call(name, case):
        logits, toks = models[name].forward_batch(pools[name], *case, key_block=64)
        toks.block_until_ready()
        return logits

    rows, results, right = [], [], 0
    for kind, n in args.sizes:
        case = _case(kind, n, ps)
        tokens = bucket(n)
        got = {name: np.asarray(call(name, case)) for name in models}  # compiles, then checks
        np.testing.assert_allclose(got["unrolled"], got["scan"], rtol=1e-6, atol=1e-6)
        times = {name: [] for name in models}
        for pair in range(args.pairs):
            for name in ("scan", "unrolled") if pair % 2 == 0 else ("unrolled", "scan"):
                call(name, case)
                ts = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    call(name, case)
                    ts.append(time.perf_counter() - t0)
                times[name].append(statistics.median(ts))
        s, u = (statistics.median(times[k]) for k in ("scan", "unrolled"))
        per_pair = [b / a for a, b in zip(times["scan"], times["unrolled"])]
        mm = median_time(_matmul_fn(cfg, unrolled.params, tokens), repeats=21, warmup=3)
        chosen = "unrolled" if tokens <= UNROLL_TOKENS else "scan"
        right += (u if chosen == "unrolled" else s) <= 1.05 * min(s, u)
        rows.append(
            (
                f"{kind} {n}",
                tokens,
                chosen,
                s * 1e3,
                u * 1e3,
                u / s,
                f"{min(per_pair):.2f}-{max(per_pair):.2f}",
                copy_s * 1e3,
                mm * 1e3,
                min(s, u) / mm,
            )
        )
        results.append(
            dict(
                kind=kind,
                n=n,
                tokens=tokens,
                chosen=chosen,
                scan_ms=s * 1e3,
                unrolled_ms=u * 1e3,
                unrolled_over_scan=u / s,
                per_pair=per_pair,
                weights_memcpy_ms=copy_s * 1e3,
                numpy_matmul_ms=mm * 1e3,
            )
        )
    print_table(
        [
            "step",
            "tokens",
            "default path",
            "scan ms",
            "unrolled ms",
            "unrolled/scan",
            "per pair",
            "memcpy weights ms",
            "numpy matmul ms",
            "best/matmul",
        ],
        rows,
    )
    print(
        f"target: the default path (unrolled at <= {UNROLL_TOKENS} tokens) within 5% of the "
        f"faster one at every size: {right} of {len(rows)} sizes",
        flush=True,
    )
    write_json(
        args.json, "bench_step", {k: v for k, v in vars(args).items() if k != "json"}, results
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
