#!/usr/bin/env bash
# Every GPU check the project has, in one call on a lent accelerator machine (see
# ../.library/device: few, full calls). Runs from the repository root without installing
# (the device image has jax, chex, tqdm, pytest, hypothesis; no network there):
#
#   bash benchmarks/run_gpu_all.sh            # JSON + run.log under $OUT (or benchmarks/out)
#
# One budget for the whole run (BUDGET_S, default 330 s: call the device with timeout_s ~400,
# which leaves room in a 15-minute lease for the machine's start and one rerun); each step gets
# the smaller of its own cap and what is left, and is killed past it. The steps write their JSON
# as they go, so a step killed or aborted keeps what it finished. Order: the tables first, the
# risky probe (a kernel on a pinned_host operand may abort the process) and the compiled-kernel
# tests last. Files under $OUT: run.log and one JSON per step (the device returns 8 files at
# most: these are 8).
# The tables go into benchmarks/RESULTS.md by hand, with the date and jax version; results.json
# (benchmarks/collect.py, last) is what hicache-jax compare puts beside a TPU run's.
set -uo pipefail
DEFAULT_BUDGET_S=330
. "$(dirname "$0")/device_run.sh"  # out, log, budget, run()
run env 60 python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$log"
run gpu_kernels 120 python3 -m benchmarks.gpu_kernels --no-probe --json "$out/gpu_kernels.json"
run gpu_transfer 70 python3 -m benchmarks.gpu_transfer --json "$out/gpu_transfer.json"
run gpu_ttft 80 python3 -m benchmarks.gpu_ttft --json "$out/gpu_ttft.json"
# A sliding-window model (5:1, window 128) through the serial engine: outputs identical across
# no cache, device radix and hicache, window pages moved between the tiers on this device.
run windows 60 python3 -m hicache_jax bench --layer-pattern 5:1 --window 128 --layers 6 \
    --quiet --json "$out/windows.json"
# gpu_serve (continuous batching vs serial, < 4 min alone) needs BUDGET_S >= ~560 to run here.
run gpu_serve 240 python3 -m benchmarks.gpu_serve --json "$out/gpu_serve.json"
run gpu_kernels_probe 30 python3 -m benchmarks.gpu_kernels --probe-only \
    --json "$out/gpu_kernels_probe.json"
# The compiled kernels and the transfer engine on this device. Not -x: one failure must not hide
# the rest. Left out: tests that need 4 devices or assume CPU, and the fp8 page-size-1 pool case
# (16-byte chunks, which the GPU kernel refuses by design).
run pytest_compiled 45 python3 -m pytest -q -p no:cacheprovider \
    tests/test_pallas_kernels.py::test_compiled_kernels_match_reference \
    "tests/test_device_pool_pallas.py::test_pallas_pool_matches_xla_pool[bfloat16-16]" \
    tests/test_transfer.py -k "not mismatched_pools and not dispatched_asynchronously"
# One results.json of every figure beside its limit (hicache-jax compare A.json B.json).
run collect 30 python3 -m benchmarks.collect "$out"
echo "===== all done in $((SECONDS - t0))s" | tee -a "$log"
