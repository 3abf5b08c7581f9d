#!/bin/sh
# Token trees with the shipped draft head (issue 30), from the repository root, nothing
# else running. The pilot (1 question per group) chose the trees of the main run.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-trees-2026-12-02
exactspec bench --backend transformers --questions $Q --per-category 1 --max-new-tokens 128 \
    --repetitions 1 --method plain --method head:k=1 --method head:k=1:tree=4 \
    --method head:k=2:tree=6 --method head:k=2:tree=8 --method head:k=3:tree=10 \
    --output $OUT/pilot
