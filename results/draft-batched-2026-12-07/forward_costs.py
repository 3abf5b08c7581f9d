"""Seconds of one packed forward of the pair on the native backend: the 1.5B target over
S sequences × T new tokens each (a batch of S rows verifying T − 1 drafts), and the 0.5B
draft (Q4_0, draft vocabulary 32768, as `draft:` loads it) over S sequences × 1 token (one
packed draft step). Each sequence holds a 300-token context; median of 15 runs, each rolled
back. Prints one line per shape, in ms and in units of one target step c(1).

    python forward_costs.py
"""
import statistics
import time

from exactspec import load_model
from exactspec.backends.base import new_sequence_id
from exactspec.proposers.draft_model import DEFAULT_DRAFT_WEIGHTS
from exactspec.proposers.draft_vocabulary import draft_vocabulary


def timer(model, count=8):
    model.reserve(count)
    ids = [new_sequence_id() for _ in range(count)]
    for sequence_id in ids:
        model.prefill(sequence_id, list(range(1000, 1300)))

    def seconds(sequences: int, tokens: int, reps: int = 15) -> float:
        rows = [(ids[j], [5] * tokens) for j in range(sequences)]
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            model.forward(rows, num_logits=1)
            times.append(time.perf_counter() - start)
            for sequence_id, tokens_ in rows:
                model.rollback(sequence_id, len(tokens_))
        return statistics.median(times) * 1000
    return seconds


target = timer(load_model("qwen2.5-coder-1.5b-instruct"))
step = target(1, 1)
for sequences, tokens in [(1, 1), (1, 5), (4, 1), (4, 2), (4, 3), (4, 4), (4, 5), (8, 1)]:
    ms = target(sequences, tokens)
    print(f"target {sequences} seqs x {tokens} tokens: {ms:.1f} ms = {ms / step:.2f} c(1)")
draft_model = load_model("qwen2.5-coder-0.5b-instruct", weight_type=DEFAULT_DRAFT_WEIGHTS.upper())
draft_model.restrict_logits(draft_vocabulary(draft_model.tokenizer, 32768,
                                             draft_model.eos_token_ids).tolist())
draft = timer(draft_model)
for sequences in (1, 2, 4, 8):
    ms = draft(sequences, 1)
    print(f"draft {sequences} seqs x 1 token: {ms:.1f} ms = {ms / step:.2f} c(1)")
