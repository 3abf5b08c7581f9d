"""Usage: python compare_kernels.py QUESTIONS.jsonl PER_GROUP. Same-run, interleaved: plain and speculative (prompt lookup, policy auto, k<=4) decoding
under the fast kernels and the batch-invariant kernels with 2 and 4 fixed rows."""
import statistics, sys
from collections import defaultdict
import exactspec.backends.batch_invariant as bi
from exactspec import load_model, SamplingParams, SpeculativeGenerator, PromptLookupProposer
from exactspec.bench.questions import load_questions
qs = load_questions(sys.argv[1], None, int(sys.argv[2]))
b = load_model(backend="transformers", device="cpu")
configs = [("fast", 0), ("batch-invariant", 2)]
gens = {}
for kern, w in configs:
    gens[(kern, w, "plain")] = SpeculativeGenerator(b, None, allow_batch_variance=True)
    gens[(kern, w, "auto")] = SpeculativeGenerator(b, PromptLookupProposer(), 4, "auto", allow_batch_variance=True)
params = SamplingParams(temperature=0, max_new_tokens=64)
rates = defaultdict(list); outputs = {}
def run(key, q):
    kern, w, _ = key
    b.kernels = kern
    if w: bi.FIXED_ROWS = w
    r = gens[key].generate(b.tokenizer.apply_chat_template(q.prompt), params)
    dec = r.stats.total_seconds - r.stats.prefill_seconds
    return r.token_ids, (len(r.token_ids) - 1) / max(dec - (r.stats.ttft_seconds - r.stats.prefill_seconds), 1e-9), r
# warm-up
for key in gens: run(key, qs[0])
for rep in range(1):
    for q in qs:
        for key in gens:
            ids, rate, r = run(key, q)
            rates[(key, q.group)].append(len(ids) / (r.stats.total_seconds - r.stats.prefill_seconds))
            outputs.setdefault((key[0], key[1], q.question_id), []).append((key[2], ids))
same = all(len({tuple(i) for _, i in v}) == 1 for k, v in outputs.items() if k[0] != "fast")
print("batch-invariant: speculative == plain for every question:", same)
groups = sorted({q.group for q in qs})
for kern, w in configs:
    for m in ("plain", "auto"):
        key = (kern, w, m)
        overall = statistics.mean(statistics.mean(rates[(key, g)]) for g in groups)
        print(f"{kern:16s} rows={w} {m:5s} decode tok/s (mean over groups) {overall:6.1f} | " +
              " ".join(f"{g[:8]}:{statistics.mean(rates[(key, g)]):.1f}" for g in groups))
