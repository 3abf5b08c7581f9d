"""Forward costs c(n) (milliseconds of one forward over n new tokens after a 600-token
context, median of 15 rounds) and prefill throughput (tokens/s of a 512-token prefill,
median of 3), the runtimes interleaved round by round in one process so that the machine's
drift falls on all of them alike: the native backend (int8 activations, and float32
activations on the embedded file) against llama.cpp, at 2 and 1 threads, on the embedded
SmolLM2 Q4_1 file, its Q8_0 and F16 conversions (``--weight-type``), and, with an argument,
another GGUF file (2 threads, 7 rounds: the 1.7 B random file of ``random_llama.py``).

    .venv/bin/python results/native-2026-12-04/costs.py [FILE.gguf]
"""

import statistics
import sys
import time
from pathlib import Path

from exactspec.backends.base import forward_one
from exactspec.backends.llama_cpp_backend import LlamaCppBackend
from exactspec.backends.native_backend import NativeBackend
from exactspec.model_files import converted_gguf, resolve_model_path

SIZES = (1, 2, 3, 4, 5, 9, 16)
CONTEXT = list(range(1000, 1600))


def runtimes(path, threads, float32=False):
    found = {}
    for t in threads:
        found[f"native, {t} thread{'s' * (t > 1)}"] = NativeBackend.load(path, threads=t)
    if float32:
        found["native float32 activations, 2 threads"] = NativeBackend.load(
            path, threads=2, activations="float32")
    for t in threads:
        found[f"llama.cpp, {t} thread{'s' * (t > 1)}"] = LlamaCppBackend.load(path, threads=t)
    return found


def measure(name, backends, rounds, sizes=SIZES, prefill=512):
    for backend in backends.values():
        backend.prefill(7, CONTEXT)
    times = {(runtime, n): [] for runtime in backends for n in sizes}
    for n in sizes:
        for round_ in range(rounds):
            order = list(backends.items())
            order = order[round_ % len(order):] + order[:round_ % len(order)]
            for runtime, backend in order:
                start = time.perf_counter()
                forward_one(backend, 7, list(range(100, 100 + n)))
                times[runtime, n].append(time.perf_counter() - start)
                backend.rollback(7, n)
    for backend in backends.values():
        backend.release(7)
    rates = {runtime: [] for runtime in backends}
    for _ in range(3):
        for runtime, backend in backends.items():
            start = time.perf_counter()
            backend.prefill(8, CONTEXT[:prefill])
            rates[runtime].append(prefill / (time.perf_counter() - start))
            backend.release(8)
    print(f"\n{name}\n\n| runtime | " + " | ".join(f"c({n})" for n in sizes)
          + " | c(5) / c(9) / c(16) over c(1) | prefill tok/s |\n|---"
          + "|---" * (len(sizes) + 2) + "|")
    for runtime in backends:
        c = {n: statistics.median(times[runtime, n]) * 1e3 for n in sizes}
        print(f"| {runtime} | " + " | ".join(f"{c[n]:.2f}" for n in sizes)
              + f" | {c[5] / c[1]:.2f} / {c[9] / c[1]:.2f} / {c[16] / c[1]:.2f} | "
              f"{statistics.median(rates[runtime]):.0f} |", flush=True)


if len(sys.argv) > 1:
    measure(Path(sys.argv[1]).name, runtimes(sys.argv[1], (2,)), rounds=7,
            sizes=(1, 5, 9, 16), prefill=256)
else:
    embedded = resolve_model_path("smollm2-135m-instruct")
    measure("Q4_1 (the embedded file)", runtimes(embedded, (2, 1), float32=True), rounds=15)
    for weight_type in ("Q8_0", "F16"):
        measure(weight_type, runtimes(converted_gguf(Path(embedded), weight_type), (2, 1)),
                rounds=15)
