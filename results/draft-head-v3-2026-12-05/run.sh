#!/bin/sh
# Issue 43's Spec-Bench comparison with the v3 head (after auto's draft-cost fix and the int8
# prefetch), from the repository root with nothing else running. The v1 head is left out
# (0.95x in results/draft-head-v2-bench-2026-12-04, below v2 everywhere it was measured).
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-v3-2026-12-05
V2=training/smollm2-135m-instruct/heads/head-v2.safetensors
V3=${V3:-training/smollm2-135m-instruct/heads/head-v3.safetensors}
exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --method plain \
    --method suffix:k=4:policy=auto --method prompt-lookup:k=4:policy=auto \
    --method head:$V2:k=4:policy=auto \
    --method head:$V3:k=4:policy=auto --method head:$V3:tree=6:k=4:policy=auto \
    --output $OUT/greedy
