"""Statistics of the v2 training data (issue 43, item 1): conversations, tokens, tasks,
finish reasons, repeated prompts, and how much of the answers each draft vocabulary covers.

    python results/draft-head-v2-2026-12-04/data_stats.py \
        training/smollm2-135m-instruct/conversations-v2.jsonl.gz > results/draft-head-v2-2026-12-04/data_stats.txt
"""
import sys
from collections import Counter

from exactspec.draft_head.model import head_config
from exactspec.training.data import deduplicated, read_conversations
from safetensors import safe_open

path = sys.argv[1]
conversations = read_conversations(path)
unique = deduplicated(conversations)
answers = sum(len(c.answer_ids) for c in conversations)
prompts = sum(len(c.prompt_ids) for c in conversations)
print(f"{path}: {len(conversations)} conversations, {answers} answer tokens "
      f"({answers / len(conversations):.1f} each), {prompts} prompt tokens; "
      f"{len(conversations) - len(unique)} repeat an earlier prompt")
print("by task:", dict(sorted(Counter(c.task for c in conversations).items())))
print("answer tokens by task:", dict(sorted(Counter(
    {t: sum(len(c.answer_ids) for c in conversations if c.task == t)
     for t in {c.task for c in conversations}}).items())))
reasons = Counter(c.finish_reason for c in conversations)
print("finish reasons:", {k: f"{v} ({v / len(conversations):.1%})" for k, v in reasons.items()})
counts = Counter(t for c in conversations for t in c.answer_ids)
total = sum(counts.values())
ordered = [n for _, n in counts.most_common()]
for size in (4096, 8192, 16384, 32768):
    print(f"the data's own {size} most frequent tokens cover {sum(ordered[:size]) / total:.3f} "
          "of its answer tokens")
for head in sys.argv[2:]:
    with safe_open(head, "pt") as file:
        ids = set(file.get_tensor("draft_token_ids").tolist())
    covered = sum(n for t, n in counts.items() if t in ids)
    print(f"{head} (draft vocabulary {head_config(head).draft_vocab_size}): covers "
          f"{covered / total:.3f} of the answer tokens")
