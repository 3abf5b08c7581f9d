#!/bin/sh
# The fourth head (issue 43): v2 + v3 data together (936,962 answer tokens), features from
# the native backend the head drafts on (not transformers' float32 prefill), warm-started
# from head-v3, v2 + v3's own 8,192-token draft vocabulary.
set -e
D=training/smollm2-135m-instruct
exactspec train-draft --model smollm2-135m-instruct \
    --data $D/conversations-v2.jsonl.gz --data $D/conversations-v3.jsonl.gz \
    --output $D/run-v4 --initial-head $D/heads/head-v3.safetensors \
    --draft-vocab-size 8192 --updates ${UPDATES:-1400} --learning-rate 3e-4 --eval-every 100 \
    --minutes ${MINUTES:-65}
