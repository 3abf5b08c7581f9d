"""The 1.7 B random file's plain step (median of 9, interleaved) at 1 and 2 threads after an
8-token and a 600-token context: how much of a step the float32 KV cache costs.

    .venv/bin/python results/native-2026-12-04/c1_context.py
"""
import time, statistics, sys
from exactspec.backends.base import forward_one
from exactspec.backends.native_backend import NativeBackend
p = "/root/.cache/exactspec/random-llama-1.7b-q4_0.gguf"
bs = {t: NativeBackend.load(p, threads=t) for t in (1, 2)}
for ctx in (8, 600):
    for b in bs.values(): b.prefill(7, list(range(1000, 1000 + ctx)))
    ts = {t: [] for t in bs}
    for r in range(9):
        for t, b in bs.items():
            t0 = time.perf_counter(); forward_one(b, 7, [5]); ts[t].append(time.perf_counter() - t0); b.rollback(7, 1)
    print("ctx", ctx, {t: round(statistics.median(v) * 1e3, 1) for t, v in ts.items()})
    for b in bs.values(): b.release(7)
