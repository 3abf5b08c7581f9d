#!/bin/sh
# Exactness audits of head v4 on the real model (chain, constant k = 4, and a token tree of
# 6 nodes): block position 2 exercised; the same prompts and sizes as head v3's
# (results/draft-head-native-step-2026-12-06/audit.sh).
set -e
OUT=results/draft-head-v4-2026-12-06
V4=training/smollm2-135m-instruct/heads/head-v4.safetensors
for tree in "" ":tree=6"; do
  name=audit-v4-$([ -n "$tree" ] && echo tree || echo chain)
  .venv/bin/exactspec audit --backend native --proposer "head:$V4$tree" -k 4 --policy constant \
      --temperature 0.8 --top-p 0.9 --samples 1500 --tokens 6 --chat \
      --prompt "Count from 1 to 20, separated by commas." \
      --prompt "List the days of the week in order." --output $OUT/$name
done
