#!/bin/sh
# Exactness audits of the shipped head with q4_0 weights on the native kernels (chain,
# constant k = 4, and a token tree of 6 nodes), the prompts and sizes of head v4's audit
# (results/draft-head-v4-2026-12-06/audit.sh), before q4_0 became the default.
set -e
OUT=results/suffix-head-2026-12-06
for tree in "" ":tree=6"; do
  name=audit-q4_0-$([ -n "$tree" ] && echo tree || echo chain)
  .venv/bin/exactspec audit --backend native --proposer "head:weights=q4_0$tree" -k 4 \
      --policy constant --temperature 0.8 --top-p 0.9 --samples 1500 --tokens 6 --chat \
      --prompt "Count from 1 to 20, separated by commas." \
      --prompt "List the days of the week in order." --output $OUT/$name
done
