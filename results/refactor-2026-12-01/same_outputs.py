import sys, time, json, hashlib
from exactspec import load_model, SpeculativeGenerator, SamplingParams, PromptLookupProposer
from exactspec.proposers.suffix import SuffixProposer
target = load_model(backend=sys.argv[1], device="cpu")
prompts = ["Write a short story about a robot learning to paint.", "Explain how a hash map works, with an example in Python.", "List five facts about the Moon."]
out = {}
for name, proposer, k in (("plain", None, 0), ("suffix", SuffixProposer(), 4)):
    gen = SpeculativeGenerator(target, proposer, k, "constant" if k else "auto")
    toks, secs, ids = 0, 0.0, []
    for p in prompts:
        r = gen.generate(p, SamplingParams(max_new_tokens=96), chat=True)
        toks += len(r.token_ids); secs += r.stats.total_seconds - r.stats.prefill_seconds; ids.append(r.token_ids)
    out[name] = {"tps": toks / secs, "hash": hashlib.md5(json.dumps(ids).encode()).hexdigest()[:8], "tokens": toks}
print(json.dumps(out))
