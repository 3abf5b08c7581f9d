"""The target's own greedy answers (128 tokens, native backend) to N Spec-Bench questions
per group, and their features by the training code's prefill (``extract_features``) on the
native backend or on transformers' float32 model: what specbench_agreement.py,
vocabulary.py and window.py evaluate the heads on. Measurement only: nothing trains on
Spec-Bench."""
import tempfile
from pathlib import Path

from exactspec.bench.questions import load_questions
from exactspec.generator import SpeculativeGenerator
from exactspec.models import load_model
from exactspec.sampling import SamplingParams
from exactspec.training.data import Conversation
from exactspec.training.train import extract_features

MODEL = "smollm2-135m-instruct"
FEATURE_LAYERS = (2, 15, 27)  # every head here fuses these (EAGLE-3's choice for 30 layers)


def answers(per_group: int) -> list[Conversation]:
    """The answers, each a conversation whose ``task`` is its Spec-Bench group."""
    questions = load_questions("../shared/data/spec_bench/question.jsonl", per_group=per_group)
    writer = load_model(MODEL, backend="native")
    plain = SpeculativeGenerator(writer, None)
    conversations = []
    for i, question in enumerate(questions):
        prompt = writer.tokenizer.apply_chat_template(question.prompt)
        answer = plain.generate(prompt, SamplingParams(max_new_tokens=128)).token_ids
        conversations.append(Conversation(i, question.group, prompt, answer, "length",
                                          question.group))
    return conversations


def features(target, conversations: list[Conversation], backend: str = "native"):
    """The conversations' examples on ``backend``'s features (``target``: the transformers
    model, for the final norm and transformers' own features)."""
    source = load_model(MODEL, backend="native") if backend == "native" else None
    return extract_features(target.model, conversations, Path(tempfile.mkdtemp()),
                            FEATURE_LAYERS, backend=source, show_progress=False)
