#!/usr/bin/env bash
# Audit wall time on Ray against one process at equal cores (issue 32), on this machine's 2
# cores: one process with 2 threads against 2 Ray workers × 1 thread (a local Ray instance
# started by the command), interleaved A B A B, nothing else running. Each audit: the
# embedded model, the default engine (prompt lookup, k = 4, constant), 5 built-in prompts ×
# $SAMPLES samples of 3 tokens, 24 greedy tokens, the accept-all control. Wall time is the
# whole command (loading, Ray's start and the workers' loads included).
#   results/ray-2026-12-02/run.sh [SAMPLES] [REPETITIONS]
set -euo pipefail
cd "$(dirname "$0")"
SAMPLES=${1:-400}
REPS=${2:-2}
EXACTSPEC=${EXACTSPEC:-../../.venv/bin/exactspec}
: > wall.tsv
for rep in $(seq 1 "$REPS"); do
  for how in one-process ray; do
    extra=(--threads 2)
    [ "$how" = ray ] && extra=(--threads 1 --ray --workers 2)
    start=$(date +%s.%N)
    "$EXACTSPEC" audit --samples "$SAMPLES" --greedy-tokens 24 "${extra[@]}" \
        --output "audit-$how-$rep" > /dev/null 2> "audit-$how-$rep.log" || true
    end=$(date +%s.%N)
    printf '%s\t%s\t%.1f\n' "$how" "$rep" "$(echo "$end - $start" | bc)" | tee -a wall.tsv
  done
done
