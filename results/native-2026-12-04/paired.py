"""c(n) of the native backend compiled from several versions of the C source, one backend
each, their forwards interleaved round by round in one process (this machine's timings
drift by ±30 % from minute to minute; pairing cancels it). Median of ROUNDS (25) rounds,
600-token context, 2 threads (T), the embedded file (or MODEL).

    git show 7b73d0d:src/exactspec/backends/native/decode_kernels.c > /tmp/before.c
    .venv/bin/python results/native-2026-12-04/paired.py /tmp/before.c \\
        src/exactspec/backends/native/decode_kernels.c
"""

import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

from exactspec.backends import native
from exactspec.backends.base import forward_one
from exactspec.backends.native_backend import NativeBackend
from exactspec.model_files import resolve_model_path

path = os.environ.get("MODEL") or str(resolve_model_path("smollm2-135m-instruct"))
threads, rounds = int(os.environ.get("T", "2")), int(os.environ.get("ROUNDS", "25"))
sizes = (1, 5, 9, 16)
backends = {}
for number, source in enumerate(sys.argv[1:]):
    native.SOURCE = Path(source)  # the backend keeps the kernels it was loaded with
    native._loaded = native.NativeKernels(ctypes.CDLL(str(native._compile())), None)
    backends[f"{number}: {source}"] = NativeBackend.load(path, threads=threads)
for backend in backends.values():
    backend.prefill(7, list(range(1000, 1600)))
times = {(name, n): [] for name in backends for n in sizes}
for n in sizes:
    for round_ in range(rounds):
        order = list(backends.items())
        for name, backend in (order if round_ % 2 else order[::-1]):
            start = time.perf_counter()
            forward_one(backend, 7, list(range(100, 100 + n)))
            times[name, n].append(time.perf_counter() - start)
            backend.rollback(7, n)
for name in backends:
    c = {n: statistics.median(times[name, n]) * 1e3 for n in sizes}
    print(name, " ".join(f"c({n}) {c[n]:.2f}" for n in sizes), "| over c(1):",
          " / ".join(f"{c[n] / c[1]:.2f}" for n in sizes[1:]), flush=True)
