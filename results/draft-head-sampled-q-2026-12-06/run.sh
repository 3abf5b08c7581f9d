#!/bin/sh
# The head's sampled q over its draft vocabulary only: Spec-Bench at temperature 0.7, native
# backend, from the repository root with nothing else running (the code before:
# results/draft-head-q4-2026-12-06/t0.7).
set -e
Q=../shared/data/spec_bench/question.jsonl
V3=training/smollm2-135m-instruct/heads/head-v3.safetensors
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0.7 --method plain \
    --method suffix:k=4:policy=auto --method head:$V3:k=4:policy=auto \
    --output results/draft-head-sampled-q-2026-12-06/t0.7
