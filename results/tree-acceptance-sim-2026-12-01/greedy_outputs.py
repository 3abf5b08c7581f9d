"""Greedy outputs of the target on Spec-Bench, with the target's top-8 candidates at every
generated position: the input of simulate.py.

    python greedy_outputs.py ../../../shared/data/spec_bench/question.jsonl 5 outputs.json

(llama.cpp backend, plain decoding, 128 new tokens, chat template; 30 questions ≈ 2 min.)
"""

import json
import sys

from exactspec import SamplingParams, SpeculativeGenerator, load_model
from exactspec.bench.questions import load_questions

questions = load_questions(sys.argv[1], per_group=int(sys.argv[2]))
generator = SpeculativeGenerator(load_model(backend="llama_cpp"), None, 0)
out = []
for question in questions:
    result = generator.generate(question.prompt, SamplingParams(max_new_tokens=128, logprobs=8),
                                chat=True)
    out.append({"id": question.question_id, "group": question.group,
                "prompt": result.prompt_token_ids, "output": result.token_ids,
                "top": [[t for t, _ in lp.top] for lp in result.logprobs],
                "topp": [[v for _, v in lp.top] for lp in result.logprobs]})
json.dump(out, open(sys.argv[3], "w"))
