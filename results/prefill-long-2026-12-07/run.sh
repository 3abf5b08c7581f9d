#!/usr/bin/env bash
# Prefill at long contexts, interleaved: the kernels before this change (3d0d23d) and after
# (5edb20c), on the AVX2 path and the AVX-512 path, two rounds, then llama.cpp; nothing else
# running. Output: runs.jsonl.
set -euo pipefail
cd "$(dirname "$0")"
PY=../../.venv/bin/python
git show 3d0d23d:src/exactspec/backends/native/decode_kernels.c > /tmp/before.c
git show 5edb20c:src/exactspec/backends/native/decode_kernels.c > /tmp/after.c
for round in 1 2; do
  for isa in avx2 avx512; do
    EXACTSPEC_ISA=$isa KERNEL_SOURCE=/tmp/before.c $PY prefill.py before-$isa 1024 4096 8184
    EXACTSPEC_ISA=$isa KERNEL_SOURCE=/tmp/after.c $PY prefill.py after-$isa 1024 4096 8184
  done
done | tee runs.jsonl
$PY prefill.py llama.cpp 1024 4096 8184 | tee -a runs.jsonl
