"""Target forward time (ms, median of per-round minima) over n = 1..9 tokens after a
300-token prompt, fast kernels vs batch-invariant kernels with FIXED_ROWS = w, interleaved."""
import time, statistics
import exactspec.backends.batch_invariant as bi
from exactspec import load_model
b = load_model(backend="transformers", device="cpu")
ids = b.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 40)[:300]
b.prefill(ids)
configs = [("fast", 0), ("batch-invariant", 2), ("batch-invariant", 3), ("batch-invariant", 4), ("batch-invariant", 6), ("batch-invariant", 8)]
res = {}
for rep in range(4):
    for kern, w in configs:
        b.kernels = kern
        if w: bi.FIXED_ROWS = w
        for n in (1, 2, 3, 5, 7, 9):
            ts = []
            for r in range(3):
                t = time.perf_counter(); b.forward(ids[:n]); ts.append(time.perf_counter() - t); b.rollback(n)
            res.setdefault((kern, w, n), []).append(min(ts))
for kern, w in configs:
    print(f"{kern:16s} rows={w}", " ".join("%d:%.1f" % (n, 1000 * statistics.median(res[(kern, w, n)])) for n in (1, 2, 3, 5, 7, 9)))
