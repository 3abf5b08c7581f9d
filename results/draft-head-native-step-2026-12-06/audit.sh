#!/bin/sh
# Exactness audits of head v3 on the real model, with the head's chain step in one C call
# (chain, constant k = 4) and as a token tree of 6 nodes: block position 2 exercised.
set -e
OUT=results/draft-head-native-step-2026-12-06
V3=training/smollm2-135m-instruct/heads/head-v3.safetensors
for spec in "head:$V3" "head:$V3:tree=6"; do
  name=$(echo "$spec" | sed 's/.*head-v3.safetensors/audit-v3/; s/:tree=6/-tree/')
  [ "$name" = audit-v3 ] && name=audit-v3-chain
  .venv/bin/exactspec audit --backend native --proposer "$spec" -k 4 --policy constant \
      --temperature 0.8 --top-p 0.9 --samples 1500 --tokens 6 --chat \
      --prompt "Count from 1 to 20, separated by commas." \
      --prompt "List the days of the week in order." --output $OUT/$name
done
