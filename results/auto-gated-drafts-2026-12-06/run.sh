#!/bin/sh
# auto counting a draft head's self-stopped cycles as a rejected first draft: Spec-Bench
# greedy, native backend, against results/draft-head-native-step-2026-12-06/t0 (the code
# before), from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
V3=training/smollm2-135m-instruct/heads/head-v3.safetensors
.venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
    --max-new-tokens 128 --repetitions 2 --method plain --method suffix:k=4:policy=auto \
    --method head:$V3:k=4:policy=auto --method head:$V3:tree=6:k=4:policy=auto \
    --output results/auto-gated-drafts-2026-12-06/greedy
