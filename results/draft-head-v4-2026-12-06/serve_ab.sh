#!/bin/sh
# exactspec serve (native backend) under 8 concurrent streaming clients (Spec-Bench prompts,
# greedy): suffix drafting against head v4 (chain), alternated, 2 rounds, nothing else
# running (results/draft-head-native-step-2026-12-06/serve_ab.sh's load, two methods). Run
# from the repository root with .venv/bin on PATH.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=${OUT:-results/draft-head-v4-2026-12-06/serve}
V4=training/smollm2-135m-instruct/heads/head-v4.safetensors
for round in 1 2; do
  for method in suffix "head:$V4"; do
    name=$(echo "$method" | sed "s|head:$V4|head-chain|")-$round
    python scripts/serve_load_test.py --questions $Q --clients 8 --seconds 45 \
        --server-args "--backend native --proposer $method" --output $OUT/$name > /dev/null
    python -c "import json; r = json.load(open('$OUT/$name/report.json')); print('$name', round(r['throughput_tokens_per_second'], 1), 'tok/s, errors', r['errors'], 'mismatches', r['mismatches'])"
  done
done
