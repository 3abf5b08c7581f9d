"""Issue 44's refactor: the same tokens before and after, and the same speed.

Decodes three chat prompts (96 new tokens) on the embedded SmolLM2-135M-Instruct with one
backend: plain, suffix (k = 4, constant) and suffix under ``auto``; greedy, and seeded
sampling (temperature 0.7, n = 2 through ``generate_samples``); and the three prompts as one
batch (``BatchedGenerator``, greedy and seeded). Prints decoding tokens/s per method and an
md5 of every output token id. Run with each tree first on ``PYTHONPATH``:

    PYTHONPATH=<tree>/src python same_outputs.py native|transformers|llama_cpp
"""
import hashlib
import json
import sys

from exactspec import SamplingParams, SpeculativeGenerator, load_model
from exactspec.batching import BatchedGenerator
from exactspec.proposers.suffix import SuffixProposer

target = load_model(backend=sys.argv[1], device="cpu")
prompts = ["Write a short story about a robot learning to paint.",
           "Explain how a hash map works, with an example in Python.",
           "List five facts about the Moon."]
greedy = SamplingParams(max_new_tokens=96)
seeded = SamplingParams(max_new_tokens=96, temperature=0.7, seed=11)
out, ids = {}, []
for name, proposer, k, policy in (("plain", None, 0, "auto"),
                                  ("suffix", SuffixProposer(), 4, "constant"),
                                  ("suffix-auto", SuffixProposer(), 4, "auto")):
    generator = SpeculativeGenerator(target, proposer, k, policy)
    tokens, seconds = 0, 0.0
    for prompt in prompts:
        for params, n in ((greedy, 1), (seeded, 2)):
            for result in generator.generate_samples(prompt, params, n=n, chat=True):
                tokens += len(result.token_ids)
                seconds += result.stats.total_seconds - result.stats.prefill_seconds
                ids.append([name, result.token_ids])
    batch = BatchedGenerator(generator, max_batch_size=3)
    for params in (greedy, seeded):
        for result in batch.generate(prompts, params, chat=True):
            ids.append([name + "-batch", result.token_ids])
    out[name] = round(tokens / seconds, 1)
print(json.dumps({"tokens_per_second": out,
                  "hash": hashlib.md5(json.dumps(ids).encode()).hexdigest()[:8],
                  "sequences": len(ids)}))
