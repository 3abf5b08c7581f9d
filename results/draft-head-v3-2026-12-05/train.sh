#!/bin/sh
# The third head (issue 43): the v3 data (written passages, the German task), warm-started
# from the v2 head, which has seen the v2 data for 800 updates. The v2 data's features
# (29 minutes) are not recomputed: continued training on new conversations only.
set -e
D=training/smollm2-135m-instruct
exactspec train-draft --model smollm2-135m-instruct \
    --data $D/conversations-v3.jsonl.gz \
    --output $D/run-v3 --initial-head $D/heads/head-v2.safetensors \
    --draft-vocab-size 8192 --updates ${UPDATES:-400} --learning-rate 3e-4 --eval-every 100 \
    --minutes ${MINUTES:-17}
