"""Pallas TPU page-copy kernels (HBM-to-HBM DMAs) vs a device-to-device copy and vs the XLA path.

The TPU counterpart of ``benchmarks/gpu_kernels.py``, with the same sizes, timing, correctness
check (bit-exact against ``pallas_kernels.ref_*`` before timing) and table: for 16, 128 and
1024 scattered 2 MiB pages of a Llama-3-8B-like pool, ``gather_pages`` and ``scatter_pages``
(donated) of :mod:`pallas_kernels.tpu` at a few (DMA window, programs) settings and of XLA,
as GB/s of bytes read + written beside the **limit**: one contiguous ``jnp.copy`` of 2 GiB in
the same run. Target: >= 0.8 of the limit at 1024 pages, faster than XLA at every size.

Needs a TPU (the pool is 6 GiB: a v5e's 16 GiB HBM holds it). ``--smoke`` runs the same code
path on CPU with tiny shapes in the TPU interpreter. Never run on a TPU yet.

Usage: python -m benchmarks.tpu_kernels [--smoke] [--json benchmarks/out/tpu_kernels.json]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time

import jax

import pallas_kernels as pk
from benchmarks import gpu_kernels
from benchmarks.common import write_json
from pallas_kernels import tpu as pk_tpu

#: (DMA window, programs): the default, a deeper window, one program (no megacore split).
SETTINGS = ((pk_tpu.DEFAULT_WINDOW, pk_tpu.DEFAULT_PROGRAMS), (16, 2), (8, 1))
FULL = {**gpu_kernels.FULL, "configs": SETTINGS}
SMOKE = {**gpu_kernels.SMOKE, "configs": ((2, 2),)}


def tpu_impls(cfg: dict, smoke: bool) -> dict:
    """name -> (gather, scatter) of the TPU DMA kernels at each (window, programs) setting
    (``smoke``: in the TPU interpreter)."""
    interpret = pk.interpret_params(pk.Impl.TPU_INTERPRET) if smoke else None
    impls = {}
    for window, programs in cfg["configs"]:
        kw = dict(window=window, num_programs=programs, interpret=interpret)
        # jitted: outside jit the wrappers range-check concrete ids (a device->host sync).
        impls[f"pallas window={window} programs={programs}"] = (
            jax.jit(functools.partial(pk_tpu.gather_pages, **kw)),
            functools.partial(pk_tpu.scatter_pages, **kw),
        )
    return impls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, TPU interpreter")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    args = ap.parse_args(argv)
    if not args.smoke and pk.compiled_impl() is not pk.Impl.TPU:
        print(f"needs a TPU (found {jax.devices()[0]}); try --smoke")
        return 2
    cfg = SMOKE if args.smoke else FULL
    config = dict(cfg) | {"smoke": args.smoke}
    t0 = time.perf_counter()
    results = gpu_kernels.run(
        cfg,
        args.smoke,
        make_impls=tpu_impls,
        checkpoint=lambda partial: write_json(args.json, "tpu_kernels", config, partial),
    )
    results["wall_seconds"] = time.perf_counter() - t0
    print(f"wall {results['wall_seconds']:.0f} s")
    write_json(args.json, "tpu_kernels", config, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
