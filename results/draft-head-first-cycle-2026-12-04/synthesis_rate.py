"""The draft-head data's synthesis rate (issue 43 item 1): N conversations of every task
on a backend, B rows at a time, answer tokens per second (the user turns the target writes
are extra work, not counted), and one follow-up conversation's prompt tail.

    .venv/bin/python results/draft-head-first-cycle-2026-12-04/synthesis_rate.py native 48 8
"""
import collections, sys, tempfile, time
from exactspec.models import load_model
from exactspec.training.data import synthesize, stdlib_passages
backend, n, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = load_model(backend=backend)
stdlib_passages()  # read once, outside the timing
start = time.perf_counter()
conv = synthesize(t, f"{tempfile.mkdtemp()}/conversations.jsonl", n, batch_size=batch, show_progress=False)
s = time.perf_counter() - start
tok = sum(len(c.answer_ids) for c in conv)
print(backend, f"batch {batch}", len(conv), "conversations, answer tokens", tok, f"{s:.1f} s", f"{tok/s:.0f} answer tok/s",
      dict(collections.Counter(c.finish_reason for c in conv)))
for c in conv:
    if c.task == "follow-up":
        print(repr(t.tokenizer.decode(c.prompt_ids)[-400:])); print(repr(t.tokenizer.decode(c.answer_ids)[:200])); break
