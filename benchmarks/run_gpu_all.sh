#!/usr/bin/env bash
# Every GPU check the project has, in one call on a lent accelerator machine (see
# ../.library/device: few, full calls). Runs from the repository root without installing
# (the device image has jax, chex, tqdm, pytest, hypothesis; no network there):
#
#   bash benchmarks/run_gpu_all.sh            # JSON + logs under $OUT (or benchmarks/out)
#
# Each script is bounded by PER_SCRIPT_S seconds so that one hang cannot eat the lease; the
# tables they print go into benchmarks/RESULTS.md by hand, with the date and jax version.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
per="${PER_SCRIPT_S:-240}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$out/env.log"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$out/env.log"

run() {  # name, command...
  local name=$1; shift
  echo "===== $name (limit ${per}s)"
  timeout "$per" "$@" 2>&1 | tee "$out/$name.log"
  echo "===== $name rc=${PIPESTATUS[0]}"
}
# Compiled kernels first: their correctness gates the timing tables.
run pytest_compiled python3 -m pytest -q -x -p no:cacheprovider tests/test_pallas_kernels.py \
    tests/test_device_pool_pallas.py tests/test_transfer.py -k "not interpret"
run gpu_kernels python3 benchmarks/gpu_kernels.py --json "$out/gpu_kernels.json"
run gpu_transfer python3 benchmarks/gpu_transfer.py --json "$out/gpu_transfer.json"
run gpu_ttft python3 benchmarks/gpu_ttft.py --json "$out/gpu_ttft.json"
