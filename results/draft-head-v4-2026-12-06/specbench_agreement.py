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
import sys, tempfile
from pathlib import Path

from exactspec.bench.questions import load_questions
from exactspec.draft_head.model import load_head
from exactspec.models import load_model
from exactspec.sampling import SamplingParams
from exactspec.generator import SpeculativeGenerator
from exactspec.training.data import Conversation
from exactspec.training.train import evaluate, extract_features

per_group, heads = int(sys.argv[1]), sys.argv[2:]
questions = load_questions("../shared/data/spec_bench/question.jsonl", per_group=per_group)
writer = load_model("smollm2-135m-instruct", backend="native")
plain = SpeculativeGenerator(writer, None)
conversations = []
for i, question in enumerate(questions):
    prompt = writer.tokenizer.apply_chat_template(question.prompt)
    answer = plain.generate(prompt, SamplingParams(max_new_tokens=128)).token_ids
    conversations.append(Conversation(i, question.group, prompt, answer, "length", question.group))
del writer, plain
target = load_model("smollm2-135m-instruct", backend="transformers")
tensors = target.target_tensors()
loaded = {Path(h).stem: load_head(h, tensors) for h in heads}
layers = next(iter(loaded.values())).config.feature_layers
features = {
    "native": extract_features(target.model, conversations, Path(tempfile.mkdtemp()), layers,
                               backend=load_model("smollm2-135m-instruct", backend="native"),
                               show_progress=False),
    "transformers": extract_features(target.model, conversations, Path(tempfile.mkdtemp()),
                                     layers, show_progress=False)}
groups = list(dict.fromkeys(c.task for c in conversations))
for name, head in loaded.items():  # the draft vocabulary bounds agreement
    vocab = set(head.draft_token_ids.tolist())
    coverage = {group: [t in vocab for c in conversations if group in ("overall", c.task)
                        for t in c.answer_ids] for group in [*groups, "overall"]}
    print(f"{name}: draft vocabulary coverage of the answers' tokens: " + ", ".join(
        f"{group} {sum(flags) / len(flags):.3f}" for group, flags in coverage.items()))
print(f"{len(conversations)} Spec-Bench answers ({per_group} per group, 128 greedy tokens); "
      "teacher-forced agreement at drafted positions 1/2/3, chained acceptance 1/2/3")
for source, examples in features.items():
    for name, head in loaded.items():
        for group in [*groups, "overall"]:
            part = [e for e, c in zip(examples, conversations) if group in ("overall", c.task)]
            _, agreement, chained = evaluate(head, part, 3, bfloat16=True)
            print(f"{source:12s} {name:10s} {group:24s} agreement "
                  f"{' '.join(f'{a:.3f}' for a in agreement)}"
                  f"  chained {' '.join(f'{c:.3f}' for c in chained)}")
