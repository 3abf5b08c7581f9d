"""Seconds of one packed target forward over B sequences (one new token each, after a
300-token prompt each) on the transformers backend, and the decoding throughput it allows
(B tokens per forward), for B = 1, 2, 4, 8: the bound on batched plain decoding, prefill
excluded. The native kernels against the PyTorch 2-row fallback, interleaved per trial,
medians of 7 (as results/batch-2026-12-01/packed_forward_costs.py).

    python results/kernels-2026-12-01/packed_forward_costs.py
"""
import statistics
import time

from exactspec import load_model
from exactspec.backends import native

BATCHES = (1, 2, 4, 8)
TRIALS = 7
target = load_model(backend="transformers")
kernels = native.load()
paths = {f"native {kernels.best_isa}": kernels, "PyTorch 2-row fallback": None}
prompt = [(7 * i) % 1000 + 1 for i in range(300)]
target.reserve_sequences(max(BATCHES))
for s in range(max(BATCHES)):
    target.prefill_sequence(s, prompt[:-1])
times = {(name, b): [] for name in paths for b in BATCHES}
for _ in range(TRIALS):
    for b in BATCHES:
        for name, loaded in paths.items():
            native._loaded = loaded
            start = time.perf_counter()
            target.forward_sequences([(s, [prompt[-1]]) for s in range(b)])
            times[(name, b)].append(time.perf_counter() - start)
            for s in range(b):
                target.rollback_sequence(s, 1)
native._loaded = kernels
print("| kernels | " + " | ".join(f"B={b}: ms · tokens/s (× B=1)" for b in BATCHES) + " |")
print("|---|" + "---|" * len(BATCHES))
for name in paths:
    ms = {b: 1e3 * statistics.median(times[(name, b)]) for b in BATCHES}
    rate = {b: b / ms[b] * 1e3 for b in BATCHES}
    print(f"| {name} | " + " | ".join(f"{ms[b]:.1f} · {rate[b]:.1f} ({rate[b] / rate[1]:.2f}×)"
                                      for b in BATCHES) + " |")
