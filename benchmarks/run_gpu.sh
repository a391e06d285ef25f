#!/usr/bin/env bash
# One device call: environment, GPU tests, then benchmarks; logs under $OUT (or ./out), a summary last.
# Usage on the GPU machine, from the repo root:
#   bash benchmarks/run_gpu.sh [script_name[:seconds] ...]     (no names: every benchmarks/bench/bench_*.py)
# A name is a script's file name without .py, found in any benchmarks/<kind>/ (bench_gemm, sweep_quantize...);
# each run also writes its result rows to $out/<name>.json where the script takes --json (benchmarks/harness.py).
# GPU_TESTS="tests/kernels ..." picks the GPU tests (default: all of tests/; GPU_TESTS=none skips them).
# Benchmarks named in TORCHRUN run under `torchrun --nproc-per-node $(GPU count)`.
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTEST_INSTAFAIL=1  # tracebacks as they happen (tests/conftest.py)
TORCHRUN=" bench_tp_layer bench_transfer "
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())")
summary=()
step() {  # step NAME SECONDS COMMAND...: run with a time limit, log, remember the outcome
  local name=$1 seconds=$2; shift 2
  local start=$SECONDS
  timeout "$seconds" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-28s rc=%-3s %4ss' "$name" "$rc" "$((SECONDS - start))")")
  echo "=== $name (rc $rc)"; tail -n 25 "$out/$name.log"
}
python3 -m bridge env >"$out/env.log" 2>&1
tests=${GPU_TESTS:-tests}
if [ "$tests" != none ]; then
  step gpu_tests "${GPU_TESTS_SECONDS:-400}" python3 -m pytest -m gpu -q -rfE -p no:cacheprovider $tests
fi
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=($(ls benchmarks/bench/bench_*.py | xargs -n1 basename | sed 's/\.py$//'))
for spec in "${benches[@]}"; do
  name=${spec%%:*}; seconds=${spec#*:}; [ "$seconds" = "$spec" ] && seconds=300
  script=$(ls benchmarks/*/"$name.py" 2>/dev/null | head -n1)
  if [ -z "$script" ]; then
    summary+=("$(printf '%-28s not found under benchmarks/*/' "$name")"); continue
  fi
  json=(); grep -q 'argument_parser(' "$script" && json=(--json "$out/$name.json")  # scripts that print result rows
  if [[ $TORCHRUN == *" $name "* ]]; then
    step "$name" "$seconds" torchrun --standalone --nproc-per-node "$gpus" "$script" ${json[@]+"${json[@]}"}
  else
    step "$name" "$seconds" python3 "$script" ${json[@]+"${json[@]}"}
  fi
done
printf '\n# summary (%s GPUs)\n' "$gpus"; printf '%s\n' "${summary[@]}"
