"""GPU variant of bench_ttft.py (one GPU, finishes in well under 5 minutes on an H200).

Same measurement (TTFT of a long prompt with its prefix served from L1, from L2 plain and
layer-wise, and recomputed; first-token logits checked across paths) with a model and prompt
sized for a GPU: 8 layers, d_model 2048, 16 query / 8 KV heads of 128, SwiGLU 5632, vocab
32000, bfloat16; an 8192-token prompt with 7680 tokens cached (32 KiB of KV per token: 240 MiB),
chunked prefill of 1024. Every flag of bench_ttft.py can still be given.

Run on the GPU machine: ``python -m benchmarks.gpu_ttft --json benchmarks/gpu_ttft.json``.
Also the TPU run's (benchmarks/run_tpu_all.sh): the sizes fit one TPU chip's HBM.
Refuses to run on CPU unless ``--allow-cpu`` (the figures would be meaningless).
"""

from __future__ import annotations

import sys

from benchmarks import bench_ttft

GPU_DEFAULTS = dict(
    prompt_tokens=8192,
    cached_tokens=7680,
    page_size=16,
    chunk_size=1024,
    repeats=10,
    layers=8,
    d_model=2048,
    heads=16,
    kv_heads=8,
    head_dim=128,
    ffn_dim=5632,
    vocab=32000,
    dtype="bfloat16",
)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    allow_cpu = "--allow-cpu" in argv
    if allow_cpu:
        argv.remove("--allow-cpu")
    import jax

    if jax.default_backend() not in ("gpu", "tpu") and not allow_cpu:
        print(
            f"gpu_ttft: the default JAX backend is {jax.default_backend()!r}, "
            "not 'gpu' or 'tpu' "
            "(pass --allow-cpu to run anyway)",
            file=sys.stderr,
        )
        return 2
    return bench_ttft.main(argv, defaults=GPU_DEFAULTS, name="gpu_ttft")


if __name__ == "__main__":
    raise SystemExit(main())
