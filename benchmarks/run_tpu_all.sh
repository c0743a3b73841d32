#!/usr/bin/env bash
# Every TPU check the project has, in one call on a TPU VM (the counterpart of run_gpu_all.sh;
# never run on a TPU yet). Runs from the repository root without installing (needs jax[tpu],
# numpy, pytest, hypothesis, chex):
#
#   bash benchmarks/run_tpu_all.sh            # JSONs + run.log + results.json under $OUT
#                                             # (or benchmarks/out)
#
# Then, beside a GPU run's results.json:  hicache-jax compare gpu/results.json tpu/results.json
#
# One budget for the whole run (BUDGET_S, default 600 s); each step gets the smaller of its own
# cap and what is left, and is killed past it. The steps write their JSON as they go, so a step
# killed or aborted keeps what it finished. What runs, each figure beside its limit:
#   tpu_kernels   Pallas TPU DMA gather/scatter vs one contiguous HBM copy (and vs XLA)
#   gpu_transfer  backup (D2H) / load (H2D) of scattered pages vs device_put of the same bytes
#                 (platform-agnostic despite its name: pinned_host <-> device on any backend)
#   gpu_ttft      TTFT with the prefix from L2 (plain, layer-wise) vs from L1, vs recomputed
#   gpu_serve     the batched engine beside the serial one (sized to fit one chip's HBM)
#   lower         every device program lowered for TPU, checked (hicache-jax lower)
#   pytest        the compiled kernels and the transfer engine on this device
# and last, benchmarks/collect.py: one results.json of the schema hicache-jax compare reads.
set -uo pipefail
DEFAULT_BUDGET_S=600
. "$(dirname "$0")/device_run.sh"  # out, log, budget, run()
run env 60 python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
run tpu_kernels 120 python3 -m benchmarks.tpu_kernels --json "$out/tpu_kernels.json"
run gpu_transfer 90 python3 -m benchmarks.gpu_transfer --json "$out/gpu_transfer.json"
run gpu_ttft 90 python3 -m benchmarks.gpu_ttft --json "$out/gpu_ttft.json"
# A sliding-window model (5:1, window 128) through the serial engine: outputs identical across
# no cache, device radix and hicache, window pages moved between the tiers on this device.
run windows 60 python3 -m hicache_jax bench --layer-pattern 5:1 --window 128 --layers 6 \
    --quiet --json "$out/windows.json"
run gpu_serve 240 python3 -m benchmarks.gpu_serve --json "$out/gpu_serve.json"
run lower 60 python3 -m hicache_jax lower --platform tpu --no-engine
# Not -x: one failure must not hide the rest. Left out: tests that need 4 devices or assume CPU.
run pytest_compiled 60 python3 -m pytest -q -p no:cacheprovider \
    tests/test_pallas_kernels.py::test_compiled_kernels_match_reference \
    "tests/test_device_pool_pallas.py::test_pallas_pool_matches_xla_pool[bfloat16-16]" \
    tests/test_transfer.py -k "not mismatched_pools and not dispatched_asynchronously"
run collect 30 python3 -m benchmarks.collect "$out"
echo "===== all done in $((SECONDS - t0))s" | tee -a "$log"
