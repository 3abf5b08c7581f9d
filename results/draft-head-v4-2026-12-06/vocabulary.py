"""Does the draft vocabulary bound head v3's Spec-Bench agreement? The head's draft vocabulary
extended (its 8,192 ids, then the v2 + v3 answers' next most frequent tokens, then the rest by id)
to 16,384 / 32,768 / the whole 49,152, the target's LM-head rows for the new ids; teacher-forced
agreement on the target's greedy Spec-Bench answers (5 per group, 128 tokens, native features;
cached in /tmp). Measurement only. Output: vocabulary.txt.

    python results/draft-head-v4-2026-12-06/vocabulary.py HEAD_FILE...
"""
import os, sys
from collections import Counter
from pathlib import Path

import torch

from exactspec.draft_head.model import load_head
from exactspec.models import load_model
from exactspec.training.data import read_conversations
from exactspec.training.train import evaluate

from specbench_answers import MODEL, answers, features

cache = "/tmp/specbench_examples.pt"  # window.py reads it too
target = load_model(MODEL, backend="transformers")
t = target.target_tensors()
if os.path.exists(cache):
    examples, groups_of = torch.load(cache, weights_only=False)
else:
    conversations = answers(5)
    examples, groups_of = features(target, conversations), [c.task for c in conversations]
    torch.save((examples, groups_of), cache)
counts = Counter()
for f in ["conversations-v2.jsonl.gz", "conversations-v3.jsonl.gz"]:
    for c in read_conversations("training/smollm2-135m-instruct/" + f):
        counts.update(c.answer_ids)
freq = [tok for tok, _ in counts.most_common()]
W = torch.as_tensor(t.lm_head_weight)
for path in sys.argv[1:]:
    head = load_head(path, t)
    base = head.draft_token_ids.tolist()
    for size in (8192, 16384, 32768, 49152):
        seen = set(base); ids = list(base)
        for tok in freq + list(range(W.shape[0])):
            if len(ids) >= size: break
            if tok not in seen: ids.append(tok); seen.add(tok)
        ids = torch.tensor(ids[:size])
        head.draft_token_ids = ids
        head.lm_head = W[ids].float().contiguous()
        cov = sum(int(tok in seen) for e in examples for tok in e.tokens[e.prompt_length:].tolist()) / sum(len(e.tokens) - e.prompt_length for e in examples)
        _, a, c = evaluate(head, examples, 3, bfloat16=True)
        by = {}
        for g in dict.fromkeys(groups_of):
            _, ag, _ = evaluate(head, [e for e, gg in zip(examples, groups_of) if gg == g], 1, bfloat16=True)
            by[g[:6]] = round(ag[0], 3)
        print(Path(path).stem, size, f"coverage {cov:.3f}", [round(x, 3) for x in a], [round(x, 3) for x in c], by, flush=True)
