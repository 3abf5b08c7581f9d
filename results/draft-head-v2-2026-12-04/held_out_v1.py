"""The shipped (first) head on the v2 run's held-out conversations: the same evaluation the
training report makes (teacher-forced agreement and chained greedy acceptance per drafted
position, 64 held-out conversations, their target features from the run folder), for a
baseline. Run after the v2 run has extracted its features:

    python results/draft-head-v2-2026-12-04/held_out_v1.py training/smollm2-135m-instruct/run-v2
"""
import sys
from pathlib import Path

import torch

from exactspec.draft_head.model import load_head, shipped_head
from exactspec.models import load_model
from exactspec.training.train import Example, TrainingConfig, evaluate

run = Path(sys.argv[1])
config = TrainingConfig(**torch.load(run / "checkpoint.pt", weights_only=False)["config"])
examples = [Example(**item) for path in sorted((run / "features").glob("features-*.pt"))
            for item in torch.load(path)]
held_out = [e for e in examples if e.index % config.held_out_every == 0][:config.eval_conversations]
target = load_model("smollm2-135m-instruct", backend="transformers")
tensors = target.target_tensors()
for name, path in (("shipped head (v1)", shipped_head(tensors)), ("v2 run", run / "head.safetensors")):
    head = load_head(path, tensors)
    losses, agreement, chained = evaluate(head, held_out, config.eval_steps, bfloat16=True)
    print(f"{name}: teacher-forced agreement per position "
          f"{', '.join(f'{a:.3f}' for a in agreement)}; chained {', '.join(f'{c:.3f}' for c in chained)}")
