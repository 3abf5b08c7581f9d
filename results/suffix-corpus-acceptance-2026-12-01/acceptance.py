"""Suffix drafting with and without a corpus of earlier outputs, against prompt lookup:
mean acceptance length and drafted tokens per cycle (counts only, no timings). Spec-Bench,
greedy, constant k, llama.cpp backend.

The corpus never holds the question being measured: for each question it is refilled with
the outputs of all the *other* questions (leave-one-out; outputs from a first plain-decoding
pass, which greedy speculative decoding reproduces token for token), in file order.

    python results/suffix-corpus-acceptance-2026-12-01/acceptance.py QUESTIONS PER_GROUP K
"""
import sys
from collections import defaultdict

from exactspec import (PromptLookupProposer, SamplingParams, SpeculativeGenerator, SuffixCorpus,
                       SuffixProposer, load_model)
from exactspec.bench.questions import load_questions

questions = load_questions(sys.argv[1], None, int(sys.argv[2]))
k = int(sys.argv[3])
target = load_model(backend="llama_cpp", threads=1)
params = SamplingParams(max_new_tokens=128)
prompts = {q.question_id: target.tokenizer.apply_chat_template(q.prompt) for q in questions}
plain = {q.question_id: SpeculativeGenerator(target, None).generate(prompts[q.question_id],
                                                                    params).token_ids
         for q in questions}


def corpus_without(question_id: int) -> SuffixCorpus:
    corpus = SuffixCorpus(100_000)
    for other, output in plain.items():
        if other != question_id:
            corpus.add(output)
    return corpus


drafters = {"prompt lookup 2:3 (default)": lambda q: PromptLookupProposer(2, 3),
            "suffix 1:8, own text only": lambda q: SuffixProposer(),
            "suffix 1:8 + corpus of the other questions' outputs":
                lambda q: SuffixProposer(corpus=corpus_without(q)),
            "suffix 1:8 + corpus, no threshold":
                lambda q: SuffixProposer(min_probability=0.0, corpus=corpus_without(q))}
totals = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0]))  # name → group → counts
for q in questions:
    for name, make in drafters.items():
        proposer = make(q.question_id)
        result = SpeculativeGenerator(target, proposer, k, "constant").generate(
            prompts[q.question_id], params)
        assert result.token_ids == plain[q.question_id], (name, q.question_id)
        s = result.stats
        counts = totals[name][q.group]
        for i, value in enumerate((s.num_generated_tokens, s.cycles, s.drafted_tokens,
                                   s.accepted_tokens)):
            counts[i] += value
    print(f"question {q.question_id} done", file=sys.stderr, flush=True)

groups = sorted({q.group for q in questions})
print(f"{len(questions)} questions, k = {k}, greedy, 128 tokens, every output equal to plain "
      "decoding\n")
print("| drafter | mean acceptance length | acceptance rate | drafted per cycle | "
      + " | ".join(groups) + " |")
print("|---|---|---|---|" + "---|" * len(groups))
for name in drafters:
    overall = [sum(totals[name][g][i] for g in groups) for i in range(4)]
    print(f"| {name} | {overall[0] / overall[1]:.2f} | {overall[3] / max(overall[2], 1):.2f} | "
          f"{overall[2] / overall[1]:.2f} | " + " | ".join(
              f"{totals[name][g][0] / totals[name][g][1]:.2f}" for g in groups) + " |")
