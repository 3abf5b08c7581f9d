#!/bin/sh
# Issue 43: the v2 head against the shipped one and the draft-free methods, after auto's
# draft-cost fix; from the repository root with nothing else running (≈ 15 min here).
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-v2-bench-2026-12-04
V2=training/smollm2-135m-instruct/heads/head-v2.safetensors
exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --method plain \
    --method suffix:k=4:policy=auto --method prompt-lookup:k=4:policy=auto \
    --method head:k=4:policy=auto --method head:$V2:k=4:policy=auto \
    --method head:$V2:k=4 --method head:$V2:tree=6:k=4:policy=auto \
    --output $OUT/greedy
