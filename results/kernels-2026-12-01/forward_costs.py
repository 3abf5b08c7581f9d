"""Target forward time c(n) over n = 1..16 tokens after a 600-token context, on the embedded
model (transformers, float32), per kernel path, interleaved in one process; beside it the
same run's PyTorch 2-row products over every weight matrix (the memory-traffic reference);
and the bit-identity of each path's block logits against one-token steps.

    python results/kernels-2026-12-01/forward_costs.py [ROUNDS]
"""
import statistics
import sys
import time

import torch

from exactspec import load_model
from exactspec.backends import native
from exactspec.backends.batch_invariant import _fixed_rows_product

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SIZES = (1, 2, 3, 5, 9, 16)
b = load_model(backend="transformers", device="cpu")
kernels = native.load()
print(b.description, "| torch", torch.__version__, "| threads", torch.get_num_threads())
ids = b.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 80)[:600]
block = b.tokenizer.encode(" and then it ran far away into the deep green forest, where nobody ever saw it again")[:16]
assert len(block) == 16
b.prefill(ids)


def path(name):
    """Switch the backend to a kernel path."""
    b.kernels = "fast" if name == "fast" else "batch-invariant"
    native._loaded = None if name == "pytorch-2-rows" else kernels
    if kernels is not None and name.startswith("native-"):
        kernels.isa = name.removeprefix("native-")


paths = (["native-" + kernels.best_isa] + (["native-avx2"] if kernels.best_isa != "avx2" else [])
         if kernels else []) + ["pytorch-2-rows", "fast"]
weights = [m.weight for m in b.model.modules() if isinstance(m, torch.nn.Linear)]
x = {n: torch.randn(n, 576) for n in (1, 2)}
times = {}
for _ in range(ROUNDS):
    for name in paths:
        path(name)
        for n in SIZES:
            best = []
            for _ in range(3):
                t = time.perf_counter()
                b.forward(block[:n])
                best.append(time.perf_counter() - t)
                b.rollback(n)
            times.setdefault((name, n), []).append(min(best))
    t = time.perf_counter()
    for w in weights:
        _fixed_rows_product(w, x[1].expand(1, w.shape[1]) if w.shape[1] == 576 else
                            torch.randn(1, w.shape[1]), 2)
    times.setdefault(("torch 2-row products, every weight", 1), []).append(time.perf_counter() - t)

print(f"\nc(n), ms (median over {ROUNDS} rounds of the best of 3), 600-token context")
print("| path | " + " | ".join(f"n={n}" for n in SIZES) + " | c(5)/c(1) | c(9)/c(1) | c(16)/c(1) |")
print("|---|" + "---|" * (len(SIZES) + 3))
for name in paths:
    c = {n: 1e3 * statistics.median(times[(name, n)]) for n in SIZES}
    print(f"| {name} | " + " | ".join(f"{c[n]:.1f}" for n in SIZES)
          + f" | {c[5] / c[1]:.2f} | {c[9] / c[1]:.2f} | {c[16] / c[1]:.2f} |")
ref = 1e3 * statistics.median(times[("torch 2-row products, every weight", 1)])
print(f"\nPyTorch 2-row products over every weight matrix (LM head included): {ref:.1f} ms")

print("\nbit-identity: logits of each of n tokens scored as one block vs one token at a time")
for name in paths:
    path(name)
    singles = []
    for token in block:
        singles.append(b.forward([token])[0])
    b.rollback(len(block))
    same = []
    for n in range(1, 17):
        rows = b.forward(block[:n])
        b.rollback(n)
        same.append(all(torch.equal(rows[i], singles[i]) for i in range(n)))
    print(f"{name}: n = 1..16 all rows bit-identical: {all(same)}"
          + ("" if all(same) else f" (differs at n = {[n for n, s in zip(range(1, 17), same) if not s]})"))
path(paths[0])
