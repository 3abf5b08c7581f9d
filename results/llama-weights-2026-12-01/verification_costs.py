"""The llama.cpp backend's verification cost curve for the embedded model's weights in
other GGUF types: the shipped Q4_1 and the same weights converted (dequantised exactly by
gguf-py) to F32 (the same weights), F16, BF16 and Q8_0 (rounded). For each: the target
forward c(n) over n = 1..9 tokens after a 600-token context (median over rounds of the
best of 3, the types interleaved), and whether the load-time batch-invariance check passes.

    python results/llama-weights-2026-12-01/verification_costs.py [ROUNDS]

Conversions: exactspec.backends.gguf_types (the backend's ``weight_type``, --weight-type).

Recorded at commit c1847d6 and runs only there (``git checkout c1847d6``): the backend API
it calls (``prefill(tokens)`` without a sequence id, ``gguf_types``,
``models.resolve_model_path``) has changed since; results/native-2026-12-03/costs.py
measures the same curve on today's API.
"""
import statistics
import sys
import time
from pathlib import Path

from exactspec.backends.gguf_types import WEIGHT_TYPES
from exactspec.backends.llama_cpp_backend import LlamaCppBackend
from exactspec.models import resolve_model_path

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
SIZES = range(1, 10)
source = Path(resolve_model_path("smollm2-135m-instruct"))
backends = {"Q4_1": LlamaCppBackend.load(source)} | {
    name: LlamaCppBackend.load(source, weight_type=name) for name in WEIGHT_TYPES}
files = {name: Path(backend.llama.model_path) for name, backend in backends.items()}
prompt = backends["Q4_1"].tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 80)[:600]
block = prompt[:9]
for backend in backends.values():
    backend.prefill(prompt)
times = {}
for _ in range(ROUNDS):
    for name, backend in backends.items():
        for n in SIZES:
            best = []
            for _ in range(3):
                t = time.perf_counter()
                backend.forward(block[:n])
                best.append(time.perf_counter() - t)
                backend.rollback(n)
            times.setdefault((name, n), []).append(min(best))
print(f"llama.cpp, {backends['Q4_1'].llama.n_threads} thread(s); c(n) in ms, 600-token context, "
      f"median of {ROUNDS} rounds of the best of 3")
print("| weights | file MB | batch-invariant | " + " | ".join(f"n={n}" for n in SIZES)
      + " | c(1) / Q4_1's | c(5)/c(1) | c(9)/c(1) |")
print("|---|---|---|" + "---|" * (len(SIZES) + 3))
base = statistics.median(times[("Q4_1", 1)])
for name, backend in backends.items():
    c = {n: statistics.median(times[(name, n)]) for n in SIZES}
    print(f"| {name} | {files[name].stat().st_size / 1e6:.0f} | {backend.batch_invariant} | "
          + " | ".join(f"{1e3 * c[n]:.1f}" for n in SIZES)
          + f" | {c[1] / base:.2f} | {c[5] / c[1]:.2f} | {c[9] / c[1]:.2f} |")
