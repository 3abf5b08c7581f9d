"""Forward costs c(n) (median of 7, milliseconds) after a 600-token context and 512-token
prefill throughput: the native backend with int8 activations (the default) and with float32
activations, against llama.cpp at 1 and 2 threads, interleaved in one process, on the
embedded SmolLM2 Q4_1 file (and, with an argument, another GGUF file).

    .venv/bin/python results/native-int8-2026-12-03/costs.py [FILE.gguf]
"""

import sys
import time

from exactspec.backends.base import forward_one
from exactspec.backends.llama_cpp_backend import LlamaCppBackend
from exactspec.backends.native_backend import NativeBackend
from exactspec.model_files import resolve_model_path

path = sys.argv[1] if len(sys.argv) > 1 else str(resolve_model_path("smollm2-135m-instruct"))
backends = {
    **{f"native int8, {t} thread{'s' * (t > 1)}": NativeBackend.load(path, threads=t)
       for t in (2, 1)},
    "native float32, 2 threads": NativeBackend.load(path, threads=2, activations="float32"),
    **{f"llama.cpp, {t} thread{'s' * (t > 1)}": LlamaCppBackend.load(path, threads=t)
       for t in (2, 1)}}
context = list(range(1000, 1600))
SIZES = (1, 2, 3, 4, 5, 9, 16)


def cost(backend, n, repetitions=7):
    backend.prefill(7, context)
    times = []
    for _ in range(repetitions):
        start = time.perf_counter()
        forward_one(backend, 7, list(range(100, 100 + n)))
        times.append(time.perf_counter() - start)
        backend.rollback(7, n)
    backend.release(7)
    return sorted(times)[repetitions // 2] * 1e3


print("| runtime | " + " | ".join(f"c({n})" for n in SIZES)
      + " | c(5) / c(9) / c(16) over c(1) | prefill tok/s |")
for repetition in range(2):
    for name, backend in backends.items():
        costs = {n: cost(backend, n) for n in SIZES}
        start = time.perf_counter()
        backend.prefill(8, context[:512])
        prefill = 512 / (time.perf_counter() - start)
        backend.release(8)
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in costs.values())
              + f" | {costs[5] / costs[1]:.2f} / {costs[9] / costs[1]:.2f} / "
              f"{costs[16] / costs[1]:.2f} | {prefill:.0f} |", flush=True)
