"""Seconds of the native backend's forward over n = 1..6 tokens of the embedded model at a
~100-token context (median of 60, interleaved by n).

    python results/native-prefetch-2026-12-04/forward_costs.py
"""
import statistics, time
from exactspec.models import load_model
from exactspec.backends.base import new_sequence_id

target = load_model("smollm2-135m-instruct")
ids = target.tokenizer.encode("Explain how a refrigerator keeps food cold, step by step. " * 8)
sequence = new_sequence_id()
target.prefill(sequence, ids[:-1])
seconds = {n: [] for n in range(1, 7)}
for _ in range(60):
    for n in seconds:
        t0 = time.perf_counter()
        target.forward([(sequence, [ids[-1]] + [100 + i for i in range(n - 1)])])
        seconds[n].append(time.perf_counter() - t0)
        target.rollback(sequence, n)
one = statistics.median(seconds[1])
print(" ".join(f"c({n}) {statistics.median(s) * 1e3:.2f} ms = {statistics.median(s) / one:.2f}"
               for n, s in seconds.items()))
