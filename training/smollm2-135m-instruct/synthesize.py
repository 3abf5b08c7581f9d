"""Synthesize the draft head's training conversations for the embedded model (issue 30):
the target's own greedy chat answers to questions it wrote (exactspec.draft_head.data).
Resumable: run it again to extend the file. Usage: python synthesize.py [NUM_CONVERSATIONS]"""

import sys
from pathlib import Path

from exactspec import load_model
from exactspec.draft_head.data import synthesize

target = load_model(backend="transformers", device="cpu")  # float32, the features a head uses
conversations = synthesize(target, Path(__file__).with_name("conversations.jsonl"),
                           int(sys.argv[1]) if len(sys.argv) > 1 else 4000, seed=0)
print(f"{len(conversations)} conversations, "
      f"{sum(len(c.answer_ids) for c in conversations)} answer tokens")
