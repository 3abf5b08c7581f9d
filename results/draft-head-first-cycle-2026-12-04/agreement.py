"""Issue 43, item 4: is the shipped head's weak second draft in a generation's first cycle
a misalignment between the features training saw and those drafting reads, or the head?

For 24 self-written prompts (none from Spec-Bench), greedy, 64 new tokens, on the
transformers backend (the head's backend): (1) the head drafts inside the engine (k = 2,
a chain, float32) and every cycle's drafts are compared with the training code's
teacher-forced drafts (``extract_features`` by prefill, then ``DraftHead.unrolled``) at the
same position; (2) the teacher-forced agreement with the target's greedy token, by the
answer token drafted (token 0 is drafted from the prompt alone, token 1 is the second
draft of the first cycle), for drafting steps 1 and 2.

    .venv/bin/python results/draft-head-first-cycle-2026-12-04/agreement.py
"""

import collections
import tempfile
from pathlib import Path

import torch

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.models import load_model
from exactspec.proposers.head import HeadProposer
from exactspec.training.data import Conversation
from exactspec.training.train import extract_features, make_batch

PROMPTS = [
    "What is the capital of France?", "Write a short poem about the sea.",
    "Explain how a bicycle works.", "List three fruits that are red.",
    "Summarize the plot of Romeo and Juliet in two sentences.", "How do I boil an egg?",
    "Translate 'good morning' into Spanish.", "What is 17 times 3?",
    "Give me two tips for sleeping better.", "Why is the sky blue?",
    "Write a haiku about autumn leaves.", "What does a librarian do?",
    "Rewrite this sentence politely: Give me the report now.",
    "Name the planets of the solar system.", "How many legs does a spider have?",
    "Suggest a name for a small coffee shop.", "What is photosynthesis?",
    "Describe a rainy day in one paragraph.", "Is a tomato a fruit or a vegetable?",
    "Write a Python function that adds two numbers.", "What causes earthquakes?",
    "Tell me a fun fact about octopuses.", "How do you make a paper airplane?",
    "What is the difference between weather and climate?"]


class Recording(HeadProposer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        proposal = super().propose(token_ids, k, pipeline, rng, min_confidence)
        self.calls.append((len(token_ids), proposal.token_ids))
        return proposal


target = load_model(backend="transformers")
proposer = Recording(target, dtype=torch.float32)
head = proposer.head
generator = SpeculativeGenerator(target, proposer, 2, "constant")
conversations, calls = [], []
for index, prompt in enumerate(PROMPTS):
    proposer.calls = []
    result = generator.generate(prompt, SamplingParams(max_new_tokens=64), chat=True)
    conversations.append(Conversation(index, "", list(result.prompt_token_ids),
                                      list(result.token_ids), result.finish_reason))
    calls.append(proposer.calls)
examples = extract_features(target.model, conversations, Path(tempfile.mkdtemp()),
                            head.config.feature_layers, show_progress=False)
compared = collections.Counter()
agreement = collections.Counter()
with torch.no_grad():
    for example, cycles in zip(examples, calls):
        batch = make_batch([example], 2)
        logits = [head.logits(out[0]) for out in head.unrolled(batch.features,
                                                                batch.token_ids, 2)]
        forced = [head.draft_token_ids[step.argmax(-1)].tolist() for step in logits]
        full, start = example.tokens.tolist(), example.prompt_length
        for at, drafts in cycles:  # drafts tokens at, at + 1 (from row at - 2)
            cycle = "first cycle" if at == start else "later cycles"
            if drafts and at < len(full):
                compared[cycle, 1] += 1
                compared[cycle, 1, "equal"] += drafts[0] == forced[0][at - 2]
                if drafts[0] != forced[0][at - 2]:  # how near a tie teacher forcing had
                    top = logits[0][at - 2].topk(2).values.tolist()
                    print(f"  a depth-1 difference ({cycle}): the teacher-forced top two "
                          f"logits {top[0]:.4f} and {top[1]:.4f}")
            if len(drafts) > 1 and at + 1 < len(full) and drafts[0] == full[at]:
                compared[cycle, 2] += 1
                compared[cycle, 2, "equal"] += drafts[1] == forced[1][at - 2]
        for token in range(start, len(full)):  # answer token `token`, drafted at step 1 or 2
            bucket = min(token - start, 3)
            for step in (0, 1):
                row = token - 2 - step
                if row >= 0 and token - step >= start:
                    agreement[bucket, step] += 1
                    agreement[bucket, step, "agree"] += forced[step][row] == full[token]

print("engine against teacher forcing (drafts equal / compared):")
for cycle in ("first cycle", "later cycles"):
    print(f"  {cycle}: depth 1 {compared[cycle, 1, 'equal']} / {compared[cycle, 1]}, "
          f"depth 2 {compared[cycle, 2, 'equal']} / {compared[cycle, 2]}")
print("teacher-forced agreement with the target's greedy token, by the answer token drafted:")
names = {0: "token 0", 1: "token 1", 2: "token 2", 3: "tokens 3+"}
for bucket in range(4):
    cells = []
    for step in (0, 1):
        n = agreement[bucket, step]
        if n:
            cells.append(f"step {step + 1}: {agreement[bucket, step, 'agree'] / n:.2f} "
                         f"({agreement[bucket, step, 'agree']} / {n})")
    print(f"  {names[bucket]}: " + ", ".join(cells))
