"""The pair on code edits: each request gives a function from Python's standard library
(``inspect.getsource``; no benchmark text) and asks for it back with type hints and a
docstring, code unchanged, so most of the answer copies the prompt. Greedy, 256 new tokens,
the methods interleaved per prompt in a rotating order, decoding tokens/s (prefill
excluded), every output checked equal to plain decoding's.

Usage: python edits.py METHOD...   (METHOD: plain or SPEC,K,POLICY, as measure.py)"""
import fnmatch, glob, inspect, json, shutil, sys, textwrap

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.models import ModelSpec
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import parse_proposer

FUNCTIONS = [textwrap.dedent, textwrap.indent, shutil.copyfileobj, shutil.which,
             fnmatch.translate, glob.has_magic, json.dumps, textwrap.shorten]
INSTRUCTION = ("Rewrite this Python function with type hints and a docstring, keeping its "
               "code exactly the same:\n```python\n{source}```")
spec = ModelSpec("qwen2.5-coder-1.5b-instruct")
target = spec.load()
generators = {}
for method in sys.argv[1:]:
    if method == "plain":
        generators[method] = SpeculativeGenerator(target, None)
        continue
    proposer, k, policy = method.split(",")
    generators[method] = SpeculativeGenerator(
        target, build_proposer(parse_proposer(proposer), target, spec.load), int(k), policy)
params = SamplingParams(max_new_tokens=256)
names = list(generators)
totals = {n: {"tokens": 0, "decode_s": 0.0, "drafted": 0, "accepted": 0, "identical": 0}
          for n in names}
for i, function in enumerate(FUNCTIONS):
    ids = target.tokenizer.apply_chat_template(INSTRUCTION.format(source=inspect.getsource(function)))
    outputs = {}
    for name in names[i % len(names):] + names[:i % len(names)]:
        result = generators[name].generate(ids, params)
        s, t = result.stats, totals[name]
        outputs[name] = result.token_ids
        t["tokens"] += s.num_generated_tokens
        t["decode_s"] += s.total_seconds - s.prefill_seconds
        t["drafted"] += s.drafted_tokens
        t["accepted"] += s.accepted_tokens
    for name in names:
        totals[name]["identical"] += outputs[name] == outputs["plain"]
plain = totals["plain"]["tokens"] / totals["plain"]["decode_s"]
for name, t in totals.items():
    speed = t["tokens"] / t["decode_s"]
    print(json.dumps({"method": name, "decode_tok_s": round(speed, 2),
                      "speedup": round(speed / plain, 3),
                      "acceptance_rate": round(t["accepted"] / t["drafted"], 4) if t["drafted"] else None,
                      "identical_to_plain": f"{t['identical']} of {len(FUNCTIONS)}"}), flush=True)
