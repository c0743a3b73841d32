"""GPU variant of ``hicache-jax bench --engine batched``: continuous batching beside the serial
engine on one GPU (sized for an H200, finishing in under 4 minutes).

A model sized for a GPU (8 layers, d_model 2048, 16 query / 8 KV heads of 128, SwiGLU 5632,
vocab 32000, bfloat16) and 8K-token prompts: document QA over 4 documents of 7,936 tokens, 6
questions each of ~128 tokens (24 requests, 16 new tokens each), closed-loop clients, for no
cache / device radix / HiCache (L1 holds ~2 documents, L2 4x L1). Prefill token budget 2048
(chunked), query blocks of 128, key blocks of 1024; at most two untimed batched passes before
the timed ones, which compile no mixed prefill + decode step (``--no-mixed-warmup``: a timed
mixed step then runs as two forwards unless a compiled shape holds it), to keep within the time
budget (never measured on a GPU yet). Every request's tokens and first-token logits are compared
with the serial engine's (bf16 tolerance 2e-2). Any flag of ``hicache-jax bench`` can still be
given (later flags win).

Run on the GPU machine: ``python -m benchmarks.gpu_serve --json benchmarks/gpu_serve.json``.
Also the TPU run's (benchmarks/run_tpu_all.sh: the sizes fit one chip's HBM). Refuses CPU
unless ``--allow-cpu``; ``--tiny`` runs a CPU-sized model and workload (the smoke test's
configuration).
"""

from __future__ import annotations

import sys

from hicache_jax.cli.main import main as hicache_jax_main

GPU_FLAGS = [
    "--workload",
    "docqa",
    "--sessions",
    "4",
    "--turns",
    "6",
    "--base-tokens",
    "7936",
    "--segment-tokens",
    "128",
    "--max-new-tokens",
    "16",
    "--layers",
    "8",
    "--d-model",
    "2048",
    "--heads",
    "16",
    "--kv-heads",
    "8",
    "--head-dim",
    "128",
    "--ffn-dim",
    "5632",
    "--vocab",
    "32000",
    "--dtype",
    "bfloat16",
    "--page-size",
    "16",
    "--device-pages",
    "1024",
    "--host-ratio",
    "4",
    "--chunk-size",
    "2048",
    "--token-budget",
    "2048",
    "--query-block",
    "128",
    "--key-block",
    "1024",
    "--warmup-passes",
    "2",
    "--no-mixed-warmup",
    "--quiet",
]
TINY_FLAGS = [
    "--workload",
    "docqa",
    "--sessions",
    "2",
    "--turns",
    "2",
    "--base-tokens",
    "40",
    "--segment-tokens",
    "8",
    "--max-new-tokens",
    "2",
    "--layers",
    "1",
    "--d-model",
    "32",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "8",
    "--ffn-dim",
    "48",
    "--vocab",
    "97",
    "--dtype",
    "bfloat16",
    "--page-size",
    "16",
    "--device-pages",
    "8",
    "--host-ratio",
    "4",
    "--chunk-size",
    "64",
    "--token-budget",
    "64",
    "--query-block",
    "32",
    "--no-warmup",
    "--quiet",
]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    allow_cpu, tiny = "--allow-cpu" in argv, "--tiny" in argv
    argv = [a for a in argv if a not in ("--allow-cpu", "--tiny")]
    import jax

    if jax.default_backend() not in ("gpu", "tpu") and not (allow_cpu or tiny):
        print(
            f"gpu_serve: the default JAX backend is {jax.default_backend()!r}, "
            "not 'gpu' or 'tpu' "
            "(pass --allow-cpu to run anyway, or --tiny for the CPU-sized smoke run)",
            file=sys.stderr,
        )
        return 2
    return hicache_jax_main(
        ["bench", "--engine", "batched", *(TINY_FLAGS if tiny else GPU_FLAGS), *argv]
    )


if __name__ == "__main__":
    raise SystemExit(main())
