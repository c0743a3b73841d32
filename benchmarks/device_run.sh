# Sourced by run_gpu_all.sh and run_tpu_all.sh (not run by itself): the output folder, the log,
# one budget for the whole run (BUDGET_S, default DEFAULT_BUDGET_S set by the caller) and run(),
# which gives each step the smaller of its own cap and what is left, and kills it past that.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${OUT:-benchmarks/out}"
mkdir -p "$out"
log="$out/run.log"
: > "$log"
budget="${BUDGET_S:-$DEFAULT_BUDGET_S}"
t0=$SECONDS
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

run() {  # name, cap seconds, command...
  local name=$1 cap=$2; shift 2
  local left=$((budget - (SECONDS - t0)))
  if ((left < 20)); then echo "===== $name skipped: budget spent" | tee -a "$log"; return; fi
  ((cap > left)) && cap=$left
  echo "===== $name (limit ${cap}s, $((SECONDS - t0))s into the run)" | tee -a "$log"
  timeout -k 10 "$cap" "$@" 2>&1 | tee -a "$log"
  echo "===== $name rc=${PIPESTATUS[0]}" | tee -a "$log"
}
