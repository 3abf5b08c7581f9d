#!/bin/sh
# exactspec serve under 8 concurrent streaming clients (Spec-Bench prompts, greedy, 64 tokens):
# suffix drafting against the v2 head with trees, alternated A B A B, nothing else running.
set -e
Q=../shared/data/spec_bench/question.jsonl
OUT=results/draft-head-v2-2026-12-04/serve
V2=${V2:-training/smollm2-135m-instruct/heads/head-v2.safetensors}
for round in 1 2; do
  for method in suffix "head:$V2:tree=6"; do
    name=$(echo "$method" | cut -d: -f1)-$round
    python scripts/serve_load_test.py --questions $Q --clients 8 --seconds 45 \
        --server-args "--proposer $method" --output $OUT/$name > /dev/null
    python -c "import json; r = json.load(open('$OUT/$name/report.json')); print('$name', round(r['throughput_tokens_per_second'], 1), 'tok/s')"
  done
done
