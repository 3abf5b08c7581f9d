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
# The first main run (bench-greedy-first) had plain, suffix:k=8:policy=auto, head:k=1,
# head:k=1:tree=4, head:k=2:tree=4 and head:k=2:tree=6, before the tree attention kernel's
# weighted sum used four accumulators. The main run, after it:
exactspec bench --backend transformers --questions $Q --per-category 5 --max-new-tokens 128 \
    --repetitions 2 --method plain --method suffix:k=8:policy=auto --method head:k=1 \
    --method head:k=1:tree=4 --method head:k=2:tree=4 --output $OUT/bench-greedy
# Temperature 0.7 (seed 0), 3 questions per group, 1 repetition.
exactspec bench --backend transformers --questions $Q --per-category 3 --max-new-tokens 128 \
    --repetitions 1 --temperature 0.7 --seed 0 --method plain --method head:k=1 \
    --method head:k=1:tree=4 --output $OUT/bench-t0.7
# With an attention kernel that took all the queries of a head together (reverted after:
# 10-15 % slower per call in an A/B of the two compiled kernels), the main run again:
exactspec bench --backend transformers --questions $Q --per-category 5 --max-new-tokens 128 \
    --repetitions 2 --method plain --method suffix:k=8:policy=auto --method head:k=1 \
    --method head:k=1:tree=4 --method head:k=2:tree=4 --output $OUT/bench-greedy-blocked
