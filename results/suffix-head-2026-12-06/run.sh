#!/bin/sh
# suffix+head (suffix drafts where it matches, the shipped head v4 in the other cycles)
# against suffix alone, the head alone and plain: Spec-Bench, native backend, greedy then
# temperature 0.7, from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/suffix-head-2026-12-06
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0 --method plain \
    --method suffix:k=4:policy=auto \
    --method suffix+head:k=4:policy=auto \
    --method suffix+head:tree=6:k=4:policy=auto \
    --method head:k=4:policy=auto \
    --output $OUT/t0
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --temperature 0.7 --method plain \
    --method suffix:k=4:policy=auto \
    --method suffix+head:k=4:policy=auto \
    --output $OUT/t0.7
