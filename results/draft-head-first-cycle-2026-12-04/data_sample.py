"""A sample of the new draft-head data (issue 43 item 1) and what it says: conversations per
task, how answers ended, duplicate prompts, answer tokens, and the shipped head's draft
vocabulary's coverage of the answers (FR-Spec: the share of answer tokens the head can
draft at all).

    .venv/bin/python results/draft-head-first-cycle-2026-12-04/data_sample.py N
"""

import collections
import sys
import tempfile

from exactspec.draft_head.model import load_head, shipped_head
from exactspec.models import load_model
from exactspec.training.data import deduplicated, synthesize

count = int(sys.argv[1]) if len(sys.argv) > 1 else 400
target = load_model(backend="native")
conversations = synthesize(target, f"{tempfile.mkdtemp()}/conversations.jsonl", count,
                           batch_size=8, show_progress=False)
tokens = sum(len(c.answer_ids) for c in conversations)
print(f"{len(conversations)} conversations, {tokens} answer tokens "
      f"({tokens / len(conversations):.0f} per answer); "
      f"{len(conversations) - len(deduplicated(conversations))} repeat an earlier prompt")
print("by task:", dict(collections.Counter(c.task for c in conversations)))
print("answers ended:", dict(collections.Counter(c.finish_reason for c in conversations)))

transformers_target = load_model(backend="transformers")
head = load_head(shipped_head(transformers_target.model), transformers_target.model)
draft_ids = set(head.draft_token_ids.tolist())
answer_tokens = [t for c in conversations for t in c.answer_ids]
covered = sum(t in draft_ids for t in answer_tokens)
print(f"the shipped head's draft vocabulary ({len(draft_ids)} of {target.vocab_size} tokens) "
      f"covers {covered / len(answer_tokens):.3f} of these answer tokens")
