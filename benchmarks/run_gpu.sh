#!/usr/bin/env bash
# One device call: environment, GPU tests, then every benchmark; logs under $OUT (or ./out).
# Usage on the GPU machine, from the repo root:  bash benchmarks/run_gpu.sh [bench_name ...]
set -uo pipefail
out=${OUT:-out}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
python3 -m bridge env 2>&1 | tee "$out/env.log"
python3 -m pytest -m gpu -q -rfE -p no:cacheprovider tests 2>&1 | tee "$out/gpu_tests.log" | tail -n 25
benches=("$@")
[ ${#benches[@]} -eq 0 ] && benches=($(ls benchmarks/bench_*.py | xargs -n1 basename | sed 's/\.py$//'))
for b in "${benches[@]}"; do
  echo "=== $b"
  python3 "benchmarks/$b.py" 2>&1 | tee "$out/$b.log" | tail -n 30
done
