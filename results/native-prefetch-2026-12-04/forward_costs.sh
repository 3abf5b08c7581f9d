#!/bin/sh
# forward_costs.py alternately after (the working tree) and before (the commit given,
# default HEAD~1) the prefetch, three times each, nothing else running.
BEFORE=${1:-HEAD~1}
F=src/exactspec/backends/native/decode_kernels.c
cp $F /tmp/after.c
for i in 1 2 3; do
    echo "after:  $(python results/native-prefetch-2026-12-04/forward_costs.py)"
    git show $BEFORE:$F > $F
    echo "before: $(python results/native-prefetch-2026-12-04/forward_costs.py)"
    cp /tmp/after.c $F
done
