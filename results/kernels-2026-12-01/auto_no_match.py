"""`auto` where drafting finds (almost) nothing: decoding tokens/s of prompt lookup and
suffix drafting with the auto policy against plain decoding, on prompts whose greedy
answers repeat little, both backends (llama.cpp with the file's Q4_1 weights and with
--weight-type Q8_0), interleaved, median of ROUNDS; prefill excluded.

    python results/kernels-2026-12-01/auto_no_match.py [ROUNDS]
"""
import statistics
import sys

from exactspec import SamplingParams, SpeculativeGenerator, load_model
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import parse_proposer

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
PROMPTS = ["Write a haiku about autumn leaves.", "Name three animals that live in the desert.",
           "What is the capital of Peru? Answer in one sentence."]
params = SamplingParams(max_new_tokens=64)
targets = {"transformers": load_model(backend="transformers"),
           "llama.cpp Q4_1": load_model(backend="llama_cpp"),
           "llama.cpp Q8_0": load_model(backend="llama_cpp", weight_type="Q8_0")}
methods = ["plain", "prompt-lookup", "suffix"]
generators = {(t, m): SpeculativeGenerator(target, build_proposer(parse_proposer(m), target, None),
                                           8, "auto")
              for t, target in targets.items() for m in methods}
rates, drafted = {}, {}
for _ in range(ROUNDS):
    for prompt in PROMPTS:
        for key, generator in generators.items():
            result = generator.generate(prompt, params, chat=True)
            stats = result.stats
            seconds = stats.total_seconds - stats.prefill_seconds
            rates.setdefault(key, []).append(stats.num_generated_tokens / seconds)
            drafted[key] = drafted.get(key, 0) + stats.drafted_tokens
print(f"{len(PROMPTS)} prompts × {ROUNDS} rounds, 64 tokens, greedy; decoding tokens/s "
      "(median over prompts × rounds) and ratio to plain on the same backend")
print("| backend | method (k ≤ 8, auto) | tokens/s | × plain | tokens drafted |")
print("|---|---|---|---|---|")
for t in targets:
    plain = statistics.median(rates[(t, "plain")])
    for m in methods:
        rate = statistics.median(rates[(t, m)])
        ratio = statistics.median(r / p for r, p in zip(rates[(t, m)], rates[(t, "plain")]))
        print(f"| {t} | {m} | {rate:.1f} | {ratio:.3f} | {drafted[(t, m)]} |")
