#!/bin/sh
# After fc moved into es_head_step: the shipped head with q8_0 against q4_0 weights, at a
# constant k = 1 and under auto, Spec-Bench greedy, native backend, nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/suffix-head-2026-12-06
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0 --method plain \
    --method head:k=1:policy=constant --method head:weights=q4_0:k=1:policy=constant \
    --method head:k=4:policy=auto --method head:weights=q4_0:k=4:policy=auto \
    --method suffix:k=4:policy=auto --output $OUT/weights
