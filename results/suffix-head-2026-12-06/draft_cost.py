"""Where a head draft's time goes: the shipped head at constant k = 1 on 7 Spec-Bench
questions (every 10th of the first 80), native backend, each part of ``HeadProposer.propose``
timed (mean milliseconds per cycle). Usage: python draft_cost.py q8_0|q4_0"""

import collections
import json
import sys
import time

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.models import load_model
from exactspec.proposers import head as head_module
from exactspec.proposers.head import HeadProposer

target = load_model("smollm2-135m-instruct", backend="native")
questions = [json.loads(line) for line in open("../shared/data/spec_bench/question.jsonl")]
prompts = [target.tokenizer.apply_chat_template(q["turns"][0]) for q in questions[:80:10]]
proposer = HeadProposer(target, weights=sys.argv[1])
seconds, calls = collections.defaultdict(float), collections.Counter()


def timed(name, function):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        seconds[name] += time.perf_counter() - start
        calls[name] += 1
        return result
    return wrapper


proposer.propose = timed("propose (all)", proposer.propose)
proposer._sync = timed("  sync (feed the new rows)", proposer._sync)
target.hidden_features = timed("    target's features", target.hidden_features)
proposer.head.fc = timed("    fc (fused features)", proposer.head.fc)
proposer.head.feature_step = timed("    feature_step (fc in C)", proposer.head.feature_step)
proposer.head._native_step = timed("    head layer + LM head", proposer.head._native_step)
head_module._greedy_draw = timed("  greedy draw", head_module._greedy_draw)
generator = SpeculativeGenerator(target, proposer, 1, "constant")
params = SamplingParams(max_new_tokens=128)
generator.generate(prompts[0], params)  # warm-up
seconds.clear()
calls.clear()
forward = time.perf_counter()
tokens = sum(len(generator.generate(prompt, params).token_ids) for prompt in prompts[1:])
print(f"weights {sys.argv[1]}: {tokens} tokens in {time.perf_counter() - forward:.2f} s")
for name in seconds:
    print(f"{name:30s} {calls[name]:5d} calls {seconds[name] / calls[name] * 1e3:.3f} ms")
