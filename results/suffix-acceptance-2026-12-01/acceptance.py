"""Mean acceptance length and drafted tokens per cycle of prompt lookup vs suffix drafting
(counts only, no timings): Spec-Bench, greedy, constant k, llama.cpp backend."""
import sys, statistics
from collections import defaultdict
from exactspec import load_model, SamplingParams, SpeculativeGenerator, PromptLookupProposer, SuffixProposer
from exactspec.bench.questions import load_questions
qs = load_questions(sys.argv[1], None, int(sys.argv[2]))
k = int(sys.argv[3])
b = load_model(backend="llama_cpp", threads=1)
drafters = {"prompt-lookup 2:3": lambda: PromptLookupProposer(2, 3),
            "prompt-lookup 1:3": lambda: PromptLookupProposer(1, 3),
            "suffix 1:8 p>=0.1": lambda: SuffixProposer(1, 8, 0.1),
            "suffix 1:8 p>=0": lambda: SuffixProposer(1, 8, 0.0),
            "suffix 2:8 p>=0.1": lambda: SuffixProposer(2, 8, 0.1)}
params = SamplingParams(max_new_tokens=128)
agg = defaultdict(lambda: defaultdict(lambda: [0, 0, 0, 0]))  # drafter → group → [committed, cycles, drafted, accepted]
plain_ids = {}
for q in qs:
    prompt = b.tokenizer.apply_chat_template(q.prompt)
    plain = SpeculativeGenerator(b, None).generate(prompt, params).token_ids
    for name, make in drafters.items():
        r = SpeculativeGenerator(b, make(), k, "constant").generate(prompt, params)
        assert r.token_ids == plain, (name, q.question_id)
        s = r.stats
        a = agg[name][q.group]
        a[0] += s.num_generated_tokens; a[1] += s.cycles; a[2] += s.drafted_tokens; a[3] += s.accepted_tokens
groups = sorted({q.group for q in qs})
print(f"{len(qs)} questions, k={k}, greedy, 128 tokens; mean acceptance length (committed/cycles) | acceptance rate | drafted per cycle")
for name in drafters:
    tot = [sum(agg[name][g][i] for g in groups) for i in range(4)]
    print(f"{name:20s} overall MAL {tot[0]/tot[1]:.2f} rate {tot[3]/max(tot[2],1):.2f} drafted/cycle {tot[2]/tot[1]:.2f} | " +
          " ".join(f"{g[:8]}:{agg[name][g][0]/agg[name][g][1]:.2f}" for g in groups))
