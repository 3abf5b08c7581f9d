"""The 0.5B drafting for the 1.5B (the embedded Qwen2.5-Coder pair, native backend, 2 threads)
with its weights as in the file (Q8_0) or converted once to Q4_0 (``draft:…:weights=q4_0``),
k and the policy varied: per method, the draft's cost per drafted token (its proposer time
over the tokens drafted), acceptance rate, mean acceptance length and decoding tokens/s
(prefill excluded), greedy, 192 new tokens, over the prompts given (default: HumanEval's
first N problems, ``--questions humaneval`` as the bench asks them; or our own 14 code and
prose requests with ``own``). Methods are interleaved per prompt in a rotating order; every
speculative output is checked equal to plain decoding's.

Usage: python measure.py [humaneval N | own] METHOD...   (METHOD: plain or SPEC,K,POLICY)
prints one JSON line per prompt on stderr, one per method on stdout."""
import json, sys

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.bench import load_humaneval
from exactspec.models import ModelSpec
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import parse_proposer

OWN = ["Write a Python function that reverses the words of a sentence.",
       "Write a Python function that checks whether a string is a palindrome, ignoring case.",
       "Write a Python class for a queue built from two stacks.",
       "Write a Python function that returns the k most common words in a text.",
       "Write a Python function that converts a Roman numeral to an integer.",
       "Write a Python function that groups a list of words into anagrams.",
       "Write a Python function that rotates a matrix by 90 degrees.",
       "Write a Python generator that yields the primes below n.",
       "Write a Python function that validates an IPv4 address.",
       "Write a Python function that computes the edit distance of two strings.",
       "Explain what a hash table is to a new programmer.",
       "Give three tips for writing clear commit messages.",
       "Describe the water cycle in a short paragraph.",
       "What are the trade-offs between SQL and NoSQL databases?"]


def build(spec, target, methods):
    """method name → its generator on ``target`` (plain, or SPEC,K,POLICY)."""
    generators = {}
    for method in methods:
        if method == "plain":
            generators[method] = SpeculativeGenerator(target, None)
            continue
        proposer, k, policy = method.split(",")
        generators[method] = SpeculativeGenerator(
            target, build_proposer(parse_proposer(proposer), target, spec.load), int(k), policy)
    return generators


def measure(target, generators, prompts, max_new_tokens=192):
    """Every generator on every prompt (a chat request), interleaved in a rotating order;
    one row per method: decoding tokens/s, × plain, outputs equal to plain's, and for the
    speculative ones acceptance, mean acceptance length and the draft's cost per token."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    names = list(generators)
    totals = {name: {"tokens": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0, "draft_s": 0.0,
                     "cycles": 0, "identical": 0} for name in names}
    for i, prompt in enumerate(prompts):
        ids = target.tokenizer.apply_chat_template(prompt)
        order = names[i % len(names):] + names[:i % len(names)]
        outputs = {}
        for name in order:
            result = generators[name].generate(ids, params)
            s, t = result.stats, totals[name]
            outputs[name] = result.token_ids
            t["tokens"] += s.num_generated_tokens
            t["decode_s"] += s.total_seconds - s.prefill_seconds
            t["drafted"] += s.drafted_tokens
            t["accepted"] += s.accepted_tokens
            t["draft_s"] += s.draft_seconds
            t["cycles"] += s.cycles
        for name in names:
            totals[name]["identical"] += outputs[name] == outputs["plain"]
        print(json.dumps({"prompt": i, **{n: round(totals[n]["tokens"] / totals[n]["decode_s"], 2)
                                          for n in names}}), file=sys.stderr, flush=True)
    plain_speed = totals["plain"]["tokens"] / totals["plain"]["decode_s"]
    plain_step = totals["plain"]["decode_s"] / totals["plain"]["tokens"]
    rows = []
    for name, t in totals.items():
        speed = t["tokens"] / t["decode_s"]
        row = {"method": name, "decode_tok_s": round(speed, 2),
               "speedup": round(speed / plain_speed, 3),
               "identical_to_plain": f"{t['identical']} of {len(prompts)}"}
        if t["drafted"]:
            row |= {"acceptance_rate": round(t["accepted"] / t["drafted"], 4),
                    "mean_acceptance_length": round(t["tokens"] / t["cycles"], 3),
                    "draft_ms_per_token": round(1000 * t["draft_s"] / t["drafted"], 2),
                    "draft_token_in_target_steps": round(t["draft_s"] / t["drafted"] / plain_step, 3)}
        rows.append(row)
    return rows


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "humaneval":
        prompts, methods = [q.prompt for q in load_humaneval(int(args[1]))], args[2:]
    else:
        prompts, methods = OWN, args[1:]
    spec = ModelSpec("qwen2.5-coder-1.5b-instruct")
    target = spec.load()
    for row in measure(target, build(spec, target, methods), prompts):
        print(json.dumps(row), flush=True)
