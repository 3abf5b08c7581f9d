"""Which of the two int8-activation engines is nearer the model: the native backend (inputs
quantised per 32) and llama.cpp (per 256 for K-quant products, Q8_K), each against the
native backend with float32 activations (the same weights, no activation rounding), and
against each other, teacher-forced over the texts of agreement.py (code and prose, 600
positions each): top-1 agreement and mean total variation for each pair.
Usage: python reference.py MODEL QUESTIONS_JSONL   (prints JSON)"""
import itertools, json, sys
from pathlib import Path

import torch

from exactspec import load_model
from exactspec.backends.base import new_sequence_id

name, questions_path = sys.argv[1], Path(sys.argv[2])
POSITIONS, CHUNK = 600, 16
root = Path(__file__).resolve().parents[2] / "src" / "exactspec"
questions = [json.loads(line)["turns"][0] for line in questions_path.open()]
texts = {"code": (root / "generator.py").read_text() + (root / "verification.py").read_text(),
         "prose": "\n\n".join(questions[::4])}
engines = {"native int8": load_model(name, backend="native"),
           "llama.cpp": load_model(name, backend="llama_cpp", threads=2),
           "native float32": load_model(name, backend="native", activations="float32")}


def teacher_forced(backend, ids):
    seq = new_sequence_id()
    backend.prefill(seq, ids[:1])
    for at in range(1, len(ids), CHUNK):
        yield backend.forward([(seq, ids[at:at + CHUNK])])[0].double()
    backend.release(seq)


report = {"model": name}
pairs = list(itertools.combinations(engines, 2))
for kind, text in texts.items():
    ids = engines["native int8"].tokenizer.encode(text)[:POSITIONS + 1]
    sums = {pair: [0, 0.0] for pair in pairs}
    count = 0
    for chunks in zip(*(teacher_forced(e, ids) for e in engines.values()), strict=True):
        logits = dict(zip(engines, chunks))
        for a, b in pairs:
            p, q = torch.softmax(logits[a], -1), torch.softmax(logits[b], -1)
            sums[a, b][0] += int((logits[a].argmax(-1) == logits[b].argmax(-1)).sum())
            sums[a, b][1] += float(0.5 * (p - q).abs().sum(-1).sum())
        count += chunks[0].shape[0]
    report[kind] = {f"{a} vs {b}": {"top1_agreement": round(s[0] / count, 4),
                                    "mean_tv": round(s[1] / count, 5)}
                    for (a, b), s in sums.items()} | {"positions": count}
print(json.dumps(report, indent=1))
