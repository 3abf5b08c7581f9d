"""The heads' teacher-forced agreement on Spec-Bench answers (issue 43's first target,
>= 0.50 at the first drafted position), on the features each backend gives: the target's own
greedy answers (128 tokens, native backend) to N questions per group, their features by the
training code's prefill (``extract_features``) on the native backend (what drafting reads
there) and on transformers' float32 model (what heads v1-v3 were trained on), then the
training code's evaluation (``evaluate``: top-1 agreement per drafted position,
teacher-forced, and chained greedy acceptance) for each head. Measurement only: nothing
here trains on Spec-Bench.

    python results/draft-head-v4-2026-12-06/specbench_agreement.py N HEAD_FILE...
"""
import sys
from pathlib import Path

from exactspec.draft_head.model import load_head
from exactspec.models import load_model
from exactspec.training.train import evaluate

from specbench_answers import FEATURE_LAYERS, MODEL, answers, features

per_group, heads = int(sys.argv[1]), sys.argv[2:]
conversations = answers(per_group)
target = load_model(MODEL, backend="transformers")
tensors = target.target_tensors()
loaded = {Path(h).stem: load_head(h, tensors) for h in heads}
assert all(head.config.feature_layers == FEATURE_LAYERS for head in loaded.values())
examples_by_source = {source: features(target, conversations, source)
                      for source in ("native", "transformers")}
groups = list(dict.fromkeys(c.task for c in conversations))
for name, head in loaded.items():  # the draft vocabulary bounds agreement
    vocab = set(head.draft_token_ids.tolist())
    coverage = {group: [t in vocab for c in conversations if group in ("overall", c.task)
                        for t in c.answer_ids] for group in [*groups, "overall"]}
    print(f"{name}: draft vocabulary coverage of the answers' tokens: " + ", ".join(
        f"{group} {sum(flags) / len(flags):.3f}" for group, flags in coverage.items()))
print(f"{len(conversations)} Spec-Bench answers ({per_group} per group, 128 greedy tokens); "
      "teacher-forced agreement at drafted positions 1/2/3, chained acceptance 1/2/3")
for source, examples in examples_by_source.items():
    for name, head in loaded.items():
        for group in [*groups, "overall"]:
            part = [e for e, c in zip(examples, conversations) if group in ("overall", c.task)]
            _, agreement, chained = evaluate(head, part, 3, bfloat16=True)
            print(f"{source:12s} {name:10s} {group:24s} agreement "
                  f"{' '.join(f'{a:.3f}' for a in agreement)}"
                  f"  chained {' '.join(f'{c:.3f}' for c in chained)}")
