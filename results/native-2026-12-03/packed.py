"""Tokens/s of 8 sequences decoded together (one packed forward of 8 one-token rows, each
after its own 600-token context) against one sequence alone, native backend, embedded
model. Median of 9 forwards each.

    .venv/bin/python results/native-2026-12-03/packed.py
"""

import time

from exactspec.backends.native_backend import NativeBackend
from exactspec.model_files import resolve_model_path

backend = NativeBackend.load(resolve_model_path("smollm2-135m-instruct"), threads=2)
for i in range(8):
    backend.prefill(i, [(1000 + 7 * i + j) % 40000 for j in range(600)])


def step(rows, repetitions=9):
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        backend.forward([(i, [100 + i]) for i in rows])
        times.append(time.perf_counter() - start)
        for i in rows:
            backend.rollback(i, 1)
    return sorted(times)[repetitions // 2]


for repetition in range(2):
    one, eight = step([0]), step(range(8))
    print(f"one sequence {1e3 * one:.2f} ms a step ({1 / one:.1f} tokens/s); 8 packed "
          f"{1e3 * eight:.2f} ms ({8 / eight:.1f} tokens/s): {one * 8 / eight:.2f}x")
