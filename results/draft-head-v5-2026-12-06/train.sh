#!/bin/sh
# The fifth head (issue 43): v2 + v3 + v5 data together, the native backend's features,
# warm-started from head-v4, the data's own 8,192-token draft vocabulary. v2 + v3 come
# first in the same order as run-v4, so run-v4's feature chunks of 128 conversations are
# theirs here too (hard-linked when present; recomputed otherwise). Head v5 is this run's
# checkpoint at update 700 of 850 (stopped there for the session's time; the learning rate
# was at 0.19 of its peak).
set -e
D=training/smollm2-135m-instruct
mkdir -p $D/run-v5/features-native
for f in $D/run-v4/features-native/features-*-128.pt; do
  [ -f "$f" ] && ln -f "$f" $D/run-v5/features-native/
done
exactspec train-draft --model smollm2-135m-instruct \
    --data $D/conversations-v2.jsonl.gz --data $D/conversations-v3.jsonl.gz \
    --data $D/conversations-v5.jsonl.gz \
    --output $D/run-v5 --initial-head $D/heads/head-v4.safetensors \
    --draft-vocab-size 8192 --updates ${UPDATES:-850} --learning-rate 3e-4 --eval-every 100 \
    --minutes ${MINUTES:-40}
