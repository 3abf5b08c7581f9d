#!/bin/sh
# exactspec serve (native backend) under 8 concurrent streaming clients (Spec-Bench prompts,
# greedy, 64 tokens): suffix drafting against head v3 chain and tree of 6, alternated,
# 2 rounds, nothing else running. Run from the repository root with .venv/bin on PATH.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=${OUT:-results/draft-head-native-step-2026-12-06/serve}
V3=training/smollm2-135m-instruct/heads/head-v3.safetensors
for round in 1 2; do
  for method in suffix "head:$V3" "head:$V3:tree=6"; do
    name=$(echo "$method" | sed "s|head:$V3:tree=6|head-tree|; s|head:$V3|head-chain|")-$round
    python scripts/serve_load_test.py --questions $Q --clients 8 --seconds 45 \
        --server-args "--backend native --proposer $method" --output $OUT/$name > /dev/null
    python -c "import json; r = json.load(open('$OUT/$name/report.json')); print('$name', round(r['throughput_tokens_per_second'], 1), 'tok/s')"
  done
done
