#!/bin/sh
# The head's weights in Q4_0 against Q8_0 (head:…:weights=), Spec-Bench greedy and t 0.7,
# native backend, from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-q4-2026-12-06
V3=training/smollm2-135m-instruct/heads/head-v3.safetensors
for T in 0 0.7; do
  .venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
      --max-new-tokens 128 --repetitions 2 --temperature $T --method plain \
      --method suffix:k=4:policy=auto --method head:$V3:k=4:policy=auto \
      --method head:$V3:weights=q4_0:k=4:policy=auto --output $OUT/t$T
done
