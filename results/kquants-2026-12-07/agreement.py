"""The native backend against llama.cpp (llama-cpp-python) on the same GGUF file:
1. teacher-forced next-token distributions over real text (two Python files of exactspec's
   own source, and Spec-Bench questions as prose): top-1 agreement and mean total variation
   0.5 sum |p - q| (softmax of each backend's logits, float64);
2. greedy 128-token answers to 20 prompts (10 code tasks, 10 Spec-Bench questions, chat
   template), plain decoding on each backend until an end-of-sequence token: the fraction identical, and at each first
   divergence the two tokens' logit margin on each backend (a near-tie when both are small).
Usage: python agreement.py MODEL QUESTIONS_JSONL   (prints JSON)"""
import json, sys
from pathlib import Path

import torch

from exactspec import load_model
from exactspec.backends.base import new_sequence_id

name, questions_path = sys.argv[1], Path(sys.argv[2])
POSITIONS, CHUNK, NEW_TOKENS = 600, 16, 128
root = Path(__file__).resolve().parents[2] / "src" / "exactspec"
questions = [json.loads(line)["turns"][0] for line in questions_path.open()]
texts = {"code": (root / "generator.py").read_text() + (root / "verification.py").read_text(),
         "prose": "\n\n".join(questions[::4])}
CODE_TASKS = ["Write a Python function that reverses a string.",
              "Write a Python function that checks whether a number is prime.",
              "Write a Python function that merges two sorted lists.",
              "Write a Python class for a stack with push, pop and peek.",
              "Write a Python function that counts the words in a text file.",
              "Write a Python function that returns the n-th Fibonacci number iteratively.",
              "Write a binary search in Python.",
              "Write a Python function that parses a CSV line with quoted fields.",
              "Write a Python function that flattens a nested list.",
              "Write a Python function that computes the median of a list."]
prompts = CODE_TASKS + questions[1::8][:10]

native = load_model(name, backend="native")
llama = load_model(name, backend="llama_cpp", threads=2)


def teacher_forced(backend, ids):
    seq = new_sequence_id()
    backend.prefill(seq, ids[:1])
    for at in range(1, len(ids), CHUNK):
        yield backend.forward([(seq, ids[at:at + CHUNK])])[0].double()
    backend.release(seq)


report = {"model": name, "teacher_forced": {}, "greedy": []}
for kind, text in texts.items():
    ids = native.tokenizer.encode(text)[:POSITIONS + 1]
    agree = tv = count = 0
    for a, b in zip(teacher_forced(native, ids), teacher_forced(llama, ids), strict=True):
        p, q = torch.softmax(a, -1), torch.softmax(b, -1)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        tv += float(0.5 * (p - q).abs().sum(-1).sum())
        count += a.shape[0]
    report["teacher_forced"][kind] = {"positions": count, "top1_agreement": round(agree / count, 4),
                                      "mean_tv": round(tv / count, 5)}


def greedy(backend, ids):
    seq, out = new_sequence_id(), []
    backend.prefill(seq, ids[:-1])
    token, logits_seen = ids[-1], []
    for _ in range(NEW_TOKENS):
        logits = backend.forward([(seq, [token])])[0][0]
        logits_seen.append(logits)
        token = int(logits.argmax())
        out.append(token)
        if token in backend.eos_token_ids:
            break
    backend.release(seq)
    return out, logits_seen


identical = 0
for prompt in prompts:
    ids = native.tokenizer.apply_chat_template(prompt)
    ours, our_logits = greedy(native, ids)
    theirs, their_logits = greedy(llama, ids)
    if ours == theirs:
        identical += 1
        report["greedy"].append({"prompt": prompt[:60], "identical": True})
        continue
    at = next(i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y)
    a, b = ours[at], theirs[at]
    margin_ours = float(our_logits[at][a] - our_logits[at][b])
    margin_theirs = float(their_logits[at][b] - their_logits[at][a])
    report["greedy"].append({"prompt": prompt[:60], "identical": False, "first_divergence": at,
                             "tokens": [native.tokenizer.decode([a]), native.tokenizer.decode([b])],
                             "margin_native": round(margin_ours, 4),
                             "margin_llama_cpp": round(margin_theirs, 4)})
report["greedy_identical"] = f"{identical} of {len(prompts)}"
print(json.dumps(report, indent=1))
