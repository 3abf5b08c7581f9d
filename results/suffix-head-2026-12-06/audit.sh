#!/bin/sh
# Exactness audit of suffix+head on the real model (constant k = 4), the prompts and sizes
# of head v4's audit (results/draft-head-v4-2026-12-06/audit.sh).
set -e
OUT=results/suffix-head-2026-12-06
.venv/bin/exactspec audit --backend native --proposer "suffix+head" -k 4 --policy constant \
    --temperature 0.8 --top-p 0.9 --samples 1500 --tokens 6 --chat \
    --prompt "Count from 1 to 20, separated by commas." \
    --prompt "List the days of the week in order." --output $OUT/audit-suffix-head
