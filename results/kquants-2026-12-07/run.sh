#!/usr/bin/env bash
# The K-quant figures: c(n) and prefill on both Qwen2.5-Coder files, native against llama.cpp,
# the embedded SmolLM2 before (BASE, a checkout of the previous commit) and after, and each on
# the AVX2 path; two interleaved rounds, one process at a time, nothing else running.
# Usage: BASE=/path/to/old/checkout results/kquants-2026-12-07/run.sh > results.jsonl
set -euo pipefail
here=$(dirname "$0"); py=${PY:-.venv/bin/python}
lscpu | grep -E "Model name|^Flags" >&2
$py "$here/bandwidth.py" >&2
for round in 1 2; do
  for model in qwen2.5-coder-1.5b-instruct qwen2.5-coder-0.5b-instruct; do
    $py "$here/costs.py" $model native
    EXACTSPEC_ISA=avx2 $py "$here/costs.py" $model native
    $py "$here/costs.py" $model llama_cpp 7 1
    $py "$here/costs.py" $model llama_cpp 7 2
  done
  $py "$here/costs.py" smollm2-135m-instruct native
  EXACTSPEC_ISA=avx2 $py "$here/costs.py" smollm2-135m-instruct native
  if [ -n "${BASE:-}" ]; then
    PYTHONPATH=$BASE/src $py "$here/costs.py" smollm2-135m-instruct native | sed 's/"native"/"native-before"/'
    EXACTSPEC_ISA=avx2 PYTHONPATH=$BASE/src $py "$here/costs.py" smollm2-135m-instruct native | sed 's/"native"/"native-before"/'
  fi
done
