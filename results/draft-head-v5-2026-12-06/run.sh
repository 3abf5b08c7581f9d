#!/bin/sh
# Head v5 against v4 (the shipped head until now), suffix and plain: Spec-Bench, native
# backend, greedy then temperature 0.7, from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-v5-2026-12-06
H=training/smollm2-135m-instruct/heads
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0 --method plain \
    --method suffix:k=4:policy=auto \
    --method head:$H/head-v4.safetensors:k=4:policy=auto \
    --method head:$H/head-v5.safetensors:k=4:policy=auto \
    --method head:$H/head-v5.safetensors:tree=6:k=4:policy=auto \
    --method head:$H/head-v5.safetensors:k=2:policy=constant \
    --output $OUT/t0
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0.7 --method plain \
    --method suffix:k=4:policy=auto \
    --method head:$H/head-v4.safetensors:k=4:policy=auto \
    --method head:$H/head-v5.safetensors:k=4:policy=auto \
    --output $OUT/t0.7
