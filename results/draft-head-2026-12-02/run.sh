#!/bin/sh
# The draft head's benches (issue 30), run from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-2026-12-02
exactspec bench --backend transformers --questions $Q --per-category 5 --max-new-tokens 128 \
    --repetitions 2 --method plain --method suffix:k=8:policy=auto \
    --method head:k=5:policy=auto --method head:k=5 --output $OUT/bench-greedy
exactspec bench --backend transformers --questions $Q --per-category 5 --max-new-tokens 128 \
    --repetitions 2 --temperature 0.7 --seed 0 --method plain --method head:k=5:policy=auto \
    --output $OUT/bench-t0.7
