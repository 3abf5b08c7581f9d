"""Where a batched cycle's time goes with the head: 8 Spec-Bench prompts (chat, greedy, 128
tokens) decoded together by BatchedGenerator on the native backend, drafting with each
proposer given; the seconds spent in the proposers' propose calls (all rows), in the
target's packed forwards (the decoding rows'), in prefill, and the rest (verification,
bookkeeping). Run from the
repository root with nothing else running:

    python results/draft-head-v4-2026-12-06/batch_breakdown.py PROPOSER...
"""
import sys, time

from exactspec.batching import BatchedGenerator
from exactspec.bench.questions import load_questions
from exactspec.generator import SpeculativeGenerator
from exactspec.models import load_model
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import parse_proposer
from exactspec.sampling import SamplingParams

questions = load_questions("../shared/data/spec_bench/question.jsonl", per_group=2)
prompts = [q.prompt for q in questions][::len(questions) // 8][:8]
target = load_model("smollm2-135m-instruct", backend="native", threads=2)
spent = {"propose": 0.0, "forward": 0.0, "prefill": 0.0}
calls = {key: 0 for key in spent}


def timed(function, key):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - start
            calls[key] += 1
    return wrapper


for name in ("forward", "forward_trees"):
    setattr(target, name, timed(getattr(target, name), "forward"))
target.prefill = timed(target.prefill, "prefill")
print(f"{len(prompts)} prompts, batch of 8, greedy, 128 tokens; seconds")
for spec in sys.argv[1:]:
    for repetition in (1, 2):
        parsed = parse_proposer(spec, options=("k", "policy"))
        generator = SpeculativeGenerator(target, build_proposer(parsed, target, load_model),
                                         parsed.k or 4, parsed.policy or "auto")
        kind = type(generator.proposer)
        original = kind.propose
        kind.propose = timed(original, "propose")
        spent.update(propose=0.0, forward=0.0, prefill=0.0)
        calls.update(propose=0, forward=0, prefill=0)
        start = time.perf_counter()
        results = BatchedGenerator(generator, 8).generate(
            [target.tokenizer.apply_chat_template(p) for p in prompts],
            SamplingParams(max_new_tokens=128))
        total = time.perf_counter() - start
        kind.propose = original
        tokens = sum(len(r.token_ids) for r in results)
        print(f"{spec:60s} {tokens / total:6.1f} tok/s  total {total:5.2f}  propose "
              f"{spent['propose']:5.2f} ({spent['propose'] / total:4.0%}, "
              f"{1e3 * spent['propose'] / max(calls['propose'], 1):.2f} ms a row)  forward "
              f"{spent['forward']:5.2f} ({spent['forward'] / total:4.0%}, {calls['forward']} cycles)  prefill "
              f"{spent['prefill']:5.2f}  rest {total - sum(spent.values()):5.2f}")
