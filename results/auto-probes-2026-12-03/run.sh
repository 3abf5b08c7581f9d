#!/usr/bin/env bash
# Issue 40's measurements, on idle cores, one after another (nothing else running):
#   results/auto-probes-2026-12-03/run.sh greedy-1|greedy-2|greedy-3|concurrency|no-match|prefill-stall
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=results/auto-probes-2026-12-03
Q=../shared/data/spec_bench/question.jsonl
case "$1" in
  greedy-*)
    .venv/bin/exactspec bench --backend transformers --questions "$Q" --per-category 5 \
      --max-new-tokens 128 --repetitions 1 --method plain --method suffix:k=8:policy=auto \
      --method prompt-lookup:k=4:policy=auto --method head:k=4:policy=auto --method suffix:k=4 \
      --method prompt-lookup:k=4 --method head:k=4 --output "$HERE/$1" ;;
  concurrency)
    .venv/bin/exactspec bench --backend transformers --questions "$Q" --per-category 2 \
      --max-new-tokens 128 --concurrency 1,8 --method plain --method suffix:k=4 \
      --method suffix:k=4:policy=auto --output "$HERE/concurrency" ;;
  no-match)
    .venv/bin/python results/kernels-2026-12-01/auto_no_match.py 3 | tee "$HERE/no-match.md" ;;
  prefill-stall)
    .venv/bin/python scripts/prefill_stall.py --output "$HERE/prefill-stall.json" ;;
  *) echo "unknown run: $1" >&2; exit 2 ;;
esac
