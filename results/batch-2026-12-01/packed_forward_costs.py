"""Seconds of one packed target forward over B sequences (one new token each, after a
300-token prompt each), and the decoding throughput it allows (B tokens per forward), for
B = 1, 2, 4, 8: the bound on batched plain decoding, prefill excluded. Medians of 7, the
backends interleaved per trial.

    python packed_forward_costs.py        # transformers (2- and 4-row kernels), llama.cpp
"""

import statistics
import time

from exactspec import load_model

BATCHES = (1, 2, 4, 8)
TRIALS = 7

targets = {"transformers, batch-invariant": load_model(backend="transformers"),
           "transformers, batch-invariant-4": load_model(backend="transformers",
                                                         kernels="batch-invariant-4"),
           "llama.cpp, 1 thread": load_model(backend="llama_cpp")}
prompt = [(7 * i) % 1000 + 1 for i in range(300)]
for target in targets.values():
    target.reserve_sequences(max(BATCHES))
    for s in range(max(BATCHES)):
        target.prefill_sequence(s, prompt[:-1])
times = {(name, b): [] for name in targets for b in BATCHES}
for _ in range(TRIALS):
    for b in BATCHES:
        for name, target in targets.items():
            start = time.perf_counter()
            target.forward_sequences([(s, [prompt[-1]]) for s in range(b)])
            times[name, b].append(time.perf_counter() - start)
            for s in range(b):
                target.rollback_sequence(s, 1)
print("| backend | " + " | ".join(f"B={b}: ms · tokens/s (× B=1)" for b in BATCHES) + " |")
print("|---" * (len(BATCHES) + 1) + "|")
for name in targets:
    base = statistics.median(times[name, 1])
    cells = []
    for b in BATCHES:
        seconds = statistics.median(times[name, b])
        cells.append(f"{seconds * 1e3:.1f} · {b / seconds:.1f} ({b / seconds * base:.2f}×)")
    print(f"| {name} | " + " | ".join(cells) + " |")
