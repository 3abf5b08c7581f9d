#!/usr/bin/env bash
# Audits over HTTP (exactspec audit --endpoint) behind results/audit-http-2026-12-02/README.md.
# Usage: results/audit-http-2026-12-02/run.sh CONFIGURATION, one of exactspec, exactspec-broken,
#   exactspec-reference, llama-cpp-python, llama-cpp-python-top-p, llama-server-draft,
#   llama-server-ngram, llama-server-draft-token-1, greedy-exactspec, greedy-llama-server-draft
# Each configuration starts its servers on loopback, audits, and stops them.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/audit-http-2026-12-02
PY=${PYTHON:-.venv/bin/python}
EXACTSPEC=${EXACTSPEC:-.venv/bin/exactspec}
GGUF=$($PY -c 'from exactspec.model_files import resolve_model_path; print(resolve_model_path("smollm2-135m-instruct"))')
PROMPT="The cat sat on the mat. The dog sat on the mat. The cat sat on the"
SIZE=(--prompt "$PROMPT" --tokens 2 --samples 7000 --control-samples 1000 --greedy-tokens 32)
SMALL=(--samples 2000 --control-samples 500)  # where no detectable-TV target is set
pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap cleanup EXIT
wait_for() { for _ in $(seq 120); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "no server at $1" >&2; exit 1; }

case "$1" in
exactspec|exactspec-broken|exactspec-reference)
  extra=(); [ "$1" = exactspec-broken ] && extra=(--broken-verifier accept-all)
  $EXACTSPEC serve --port 8021 --proposer prompt-lookup -k 4 --policy constant \
      --log-level warning "${extra[@]}" & pids+=($!)
  wait_for http://127.0.0.1:8021
  if [ "$1" = exactspec-reference ]; then
    $EXACTSPEC audit --endpoint http://127.0.0.1:8021 --mode reference --backend llama_cpp \
        "${SIZE[@]}" --samples 4000 --samples-per-request 16 --output "$OUT/$1" || true
  else
    size=("${SIZE[@]}"); [ "$1" = exactspec-broken ] && size+=("${SMALL[@]}")
    $EXACTSPEC audit --endpoint http://127.0.0.1:8021 \
        --against-body '{"speculation": {"enabled": false}}' "${size[@]}" \
        --samples-per-request 16 --output "$OUT/$1" || true
  fi ;;
llama-cpp-python|llama-cpp-python-top-p)
  # llama.cpp applies top-k/top-p before the temperature: top-p 0.9 then keeps ~70 tokens
  # (70 degrees of freedom at token 1); top-k is the same set either way
  sampling=(--top-k 5 --top-p 1.0); [ "$1" = llama-cpp-python-top-p ] && sampling=()
  $PY -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --port 8022 --n_threads 1 \
      --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens 10 >/dev/null 2>&1 & pids+=($!)
  $PY -m llama_cpp.server --model "$GGUF" --model_alias smollm2 --port 8023 --n_threads 1 \
      >/dev/null 2>&1 & pids+=($!)
  wait_for http://127.0.0.1:8022; wait_for http://127.0.0.1:8023
  $EXACTSPEC audit --endpoint http://127.0.0.1:8022 --against http://127.0.0.1:8023 \
      --extra-body '{"repeat_penalty": 1.0}' "${SIZE[@]}" "${sampling[@]}" --concurrency 2 \
      --no-logprobs --backend llama_cpp --output "$OUT/$1" || true ;;
llama-server-draft|llama-server-ngram|llama-server-draft-token-1)
  # 3 tokens: llama-server drafts nothing for the last token (2 tokens: 0 drafted);
  # llama-server-draft-token-1 (issue 45): the 2-token run that flagged token 1, at 10,000
  # samples per side, to settle that flag
  SERVER=${LLAMA_SERVER:-.cache/llama-server/bin/llama-server}
  [ -x "$SERVER" ] || scripts/build_llama_server.sh
  if [ "$1" != llama-server-ngram ]; then spec=(-md "$GGUF" --spec-type draft-simple --spec-draft-n-max 4)
  else spec=(--spec-type ngram-simple --spec-ngram-simple-size-n 3 --spec-ngram-simple-size-m 8); fi
  common=(-m "$GGUF" -t 1 -fa off --host 127.0.0.1)
  "$SERVER" "${common[@]}" --port 8024 "${spec[@]}" >/dev/null 2>&1 & pids+=($!)
  "$SERVER" "${common[@]}" --port 8025 >/dev/null 2>&1 & pids+=($!)
  wait_for http://127.0.0.1:8024; wait_for http://127.0.0.1:8025
  size=("${SMALL[@]}" --tokens 3)
  [ "$1" = llama-server-draft-token-1 ] && size=(--samples 10000 --control-samples 1000 --tokens 2)
  $EXACTSPEC audit --endpoint http://127.0.0.1:8024 --against http://127.0.0.1:8025 \
      --no-token-ids "${SIZE[@]}" "${size[@]}" --output "$OUT/$1" || true ;;
greedy-exactspec|greedy-llama-server-draft)
  # greedy mode over Spec-Bench (read from the shared data folder, never copied), chat
  QUESTIONS=${QUESTIONS:-../shared/data/spec_bench/question.jsonl}
  GREEDY=(--mode greedy --chat --questions "$QUESTIONS" --per-category 5 --greedy-tokens 64)
  if [ "$1" = greedy-exactspec ]; then
    $EXACTSPEC serve --port 8021 --proposer prompt-lookup -k 4 --policy constant \
        --log-level warning & pids+=($!)
    wait_for http://127.0.0.1:8021
    $EXACTSPEC audit --endpoint http://127.0.0.1:8021 \
        --against-body '{"speculation": {"enabled": false}}' "${GREEDY[@]}" --output "$OUT/$1" || true
  else
    SERVER=${LLAMA_SERVER:-.cache/llama-server/bin/llama-server}
    common=(-m "$GGUF" -t 1 -fa off --host 127.0.0.1)
    "$SERVER" "${common[@]}" --port 8024 -md "$GGUF" --spec-type draft-simple \
        --spec-draft-n-max 4 >/dev/null 2>&1 & pids+=($!)
    "$SERVER" "${common[@]}" --port 8025 >/dev/null 2>&1 & pids+=($!)
    wait_for http://127.0.0.1:8024; wait_for http://127.0.0.1:8025
    $EXACTSPEC audit --endpoint http://127.0.0.1:8024 --against http://127.0.0.1:8025 \
        --no-token-ids "${GREEDY[@]}" --output "$OUT/$1" || true
  fi ;;
*) echo "unknown configuration $1" >&2; exit 2 ;;
esac
