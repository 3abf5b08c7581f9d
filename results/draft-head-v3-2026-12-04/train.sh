#!/bin/sh
# The third head (issue 43): v2's data and the v3 data (written passages, the German task),
# warm-started from the v2 head. The v2 run's feature chunks are the same conversations in
# the same order (the first --data file), so they are linked, not recomputed.
set -e
D=training/smollm2-135m-instruct
mkdir -p $D/run-v3/features
for f in $D/run-v2/features/features-*.pt; do ln -sf "$(realpath $f)" $D/run-v3/features/; done
exactspec train-draft --model smollm2-135m-instruct \
    --data $D/conversations-v2.jsonl.gz --data $D/conversations-v3.jsonl.gz \
    --output $D/run-v3 --initial-head $D/heads/head-v2.safetensors \
    --draft-vocab-size 8192 --updates ${UPDATES:-700} --learning-rate 3e-4 --eval-every 100 \
    --minutes ${MINUTES:-32}
