#!/bin/sh
# Head v4 against v3, suffix and prompt lookup: Spec-Bench, native backend, greedy then
# temperature 0.7, from the repository root with nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-v4-2026-12-06
H=training/smollm2-135m-instruct/heads
for T in 0 0.7; do
  .venv/bin/exactspec bench --backend native --threads 2 --questions $Q --per-category 5 \
      --max-new-tokens 128 --repetitions 2 --temperature $T --method plain \
      --method suffix:k=4:policy=auto --method prompt-lookup:k=4:policy=auto \
      --method head:$H/head-v3.safetensors:k=4:policy=auto \
      --method head:$H/head-v4.safetensors:k=4:policy=auto \
      --method head:$H/head-v4.safetensors:tree=6:k=4:policy=auto \
      --method head:$H/head-v4.safetensors:k=2:policy=constant \
      --output $OUT/t$T
done
