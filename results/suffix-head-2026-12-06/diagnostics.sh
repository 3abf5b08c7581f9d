#!/bin/sh
# Shorter runs (1 repetition) that explain the main run: the head at a constant k = 1 and
# 2 against auto (k1-constant/), and suffix+head at constant k against suffix alone
# (combinations/); then where a head draft's time goes (draft_cost.py). From the repository
# root, nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/suffix-head-2026-12-06
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 2 \
    --max-new-tokens 128 --repetitions 1 --temperature 0 --method plain \
    --method head:k=1:policy=constant --method head:weights=q4_0:k=1:policy=constant \
    --method head:k=2:policy=constant --output $OUT/k1-constant
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 3 \
    --max-new-tokens 128 --repetitions 1 --temperature 0 --method plain \
    --method suffix:k=4:policy=auto --method suffix+head:k=1:policy=constant \
    --method suffix+head:k=2:policy=constant \
    --method suffix+head:weights=q4_0:k=1:policy=constant \
    --method suffix+head:k=4:policy=auto --output $OUT/combinations
for weights in q8_0 q4_0; do .venv/bin/python $OUT/draft_cost.py $weights; done
