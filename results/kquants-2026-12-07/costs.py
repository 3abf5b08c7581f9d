"""c(n): the cost of scoring n tokens after a 600-token context (medians of interleaved
rounds), and prefill tokens/s over those 600 tokens, for one model on one backend.
Usage: python costs.py MODEL BACKEND [ROUNDS] [THREADS]   (prints one JSON line)"""
import json, os, statistics, sys, time

from exactspec import load_model
from exactspec.backends.base import new_sequence_id

name, backend = sys.argv[1], sys.argv[2]
rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 7
threads = int(sys.argv[4]) if len(sys.argv) > 4 else None
target = load_model(name, backend=backend, threads=threads)
ids = target.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 60)[:600]
prefill = []
for _ in range(3):
    seq = new_sequence_id()
    t = time.perf_counter(); target.prefill(seq, ids); prefill.append(time.perf_counter() - t)
    target.release(seq)
seq = new_sequence_id(); target.prefill(seq, ids)

def score(n):
    t = time.perf_counter(); target.forward([(seq, ids[:n])]); target.rollback(seq, n)
    return time.perf_counter() - t

ns = [1, 2, 3, 5, 9, 16]
for n in ns: score(n)
samples = {n: [] for n in ns}
for _ in range(rounds):
    for n in ns: samples[n].append(score(n))
c = {n: round(statistics.median(v) * 1e3, 2) for n, v in samples.items()}
print(json.dumps({"model": name, "backend": backend, "threads": threads, "isa": os.environ.get("EXACTSPEC_ISA", "best"),
                  "c_ms": c, "ratio": {n: round(c[n] / c[1], 2) for n in ns},
                  "prefill_tok_s": round(600 / statistics.median(prefill), 1)}))
