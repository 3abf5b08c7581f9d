"""Prefill tokens/s at long contexts: exactspec's native backend and llama.cpp
(llama-cpp-python) on the same GGUF file (the embedded SmolLM2-135M-Instruct), 2 threads.

    python prefill.py LABEL [LENGTHS...]      # one JSON line per length on stdout

LABEL llama.cpp runs llama-cpp-python; any other the native backend, on the kernels' C
source named by $KERNEL_SOURCE (default: the installed one), so that two versions of the
kernels can be compared in one interleaved run (run.sh).

A prompt is Spec-Bench's turns (../shared/data) concatenated and cut to each length; each
backend prefills it once to warm up, then REPEATS times, the best time kept."""

import json
import sys
import time
from pathlib import Path

import os

import torch

from exactspec import load_model
from exactspec.backends import native
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS

REPEATS = 2
label = sys.argv[1]
lengths = [int(n) for n in sys.argv[2:]] or [1024, 4096, 8184]
torch.set_num_threads(2)
data = Path(__file__).resolve().parents[3] / "shared" / "data" / "spec_bench"
text = ""
for path in sorted(data.rglob("*.jsonl")):
    for line in path.read_text().splitlines():
        text += " ".join(json.loads(line).get("turns", [])) + "\n"
path = str(EMBEDDED_MODELS[DEFAULT_MODEL].path())


def timed(prefill, tokens):
    best = float("inf")
    for _ in range(REPEATS + 1):  # the first warms up
        start = time.perf_counter()
        prefill(tokens)
        best = min(best, time.perf_counter() - start)
    return best


if label == "llama.cpp":
    from llama_cpp import Llama

    llama = Llama(path, n_ctx=8192 + 64, n_batch=512, n_ubatch=512, n_threads=2,
                  n_threads_batch=2, verbose=False)
    ids = llama.tokenize(text.encode(), add_bos=False)

    def prefill(tokens):
        llama.reset()
        llama._ctx.memory_clear(True) if hasattr(llama._ctx, "memory_clear") else None
        llama.eval(tokens)
else:
    if os.environ.get("KERNEL_SOURCE"):
        native.SOURCE = Path(os.environ["KERNEL_SOURCE"])
    target = load_model(path, backend="native", threads=2)
    ids = target.tokenizer.encode(text, add_special_tokens=False)

    def prefill(tokens):
        target.release(1)
        target.prefill(1, tokens)

for n in lengths:
    seconds = timed(prefill, ids[:n])
    print(json.dumps({"engine": label, "tokens": n, "seconds": round(seconds, 3),
                      "tokens_per_second": round(n / seconds, 1)}), flush=True)
