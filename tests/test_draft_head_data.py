"""The draft head's training data: the target's own answers, resumable, reproducible."""

import pytest

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.training.data import read_conversations, synthesize, topic_words

from conftest import ALPHABET, VOCAB, tiny_backend

TOPICS = ["cats", "rivers", "maps", "tea"]


class ChatTokenizer:
    """The tests' character tokenizer with a chat template: ``question <text>\\nanswer``
    (the text lower-cased, characters outside the alphabet dropped)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, prompt):
        text = prompt if isinstance(prompt, str) else prompt[-1]["content"]
        text = "".join(c for c in text.lower() if c in ALPHABET[:VOCAB])
        return self.inner.encode(f"question {text}\nanswer")


def chat_backend():
    target = tiny_backend(3)
    target.tokenizer = ChatTokenizer(target.tokenizer)
    return target


def test_conversations_are_the_targets_answers_and_a_resumed_file_equals_one_run(tmp_path):
    target = chat_backend()
    kwargs = dict(seed=7, topics=TOPICS, batch_size=3, question_tokens=8, answer_tokens=12,
                  show_progress=False)
    whole = synthesize(target, tmp_path / "whole.jsonl", 5, **kwargs)
    assert [c.index for c in whole] == list(range(5))
    synthesize(target, tmp_path / "resumed.jsonl", 2, **kwargs)
    with open(tmp_path / "resumed.jsonl", "a") as file:
        file.write('{"index": 2, "topic": "ca')  # an interrupted line
    resumed = synthesize(target, tmp_path / "resumed.jsonl", 5, **kwargs)
    assert resumed == whole == read_conversations(tmp_path / "resumed.jsonl")
    plain = SpeculativeGenerator(target, None)
    for conversation in whole:
        assert conversation.topic in TOPICS and conversation.prompt_ids
        expected = plain.generate(conversation.prompt_ids, SamplingParams(max_new_tokens=12))
        assert conversation.answer_ids == expected.token_ids  # greedy: the target's own
    other_seed = synthesize(target, tmp_path / "other.jsonl", 5, **kwargs | {"seed": 8})
    assert [c.prompt_ids for c in other_seed] != [c.prompt_ids for c in whole]
    with pytest.raises(ValueError, match="written with seed 7, not 8"):
        synthesize(target, tmp_path / "whole.jsonl", 6, **kwargs | {"seed": 8})


def test_topics_are_whole_lower_case_words_of_the_vocabulary():
    class Vocab:
        def get_vocab(self):
            return {"Ġriver": 1, "Ġriv": 2, "river": 3, "ĠRivers": 4, "▁mountain": 5,
                    "Ġcafé": 6, "Ġtea42": 7}

    assert topic_words(Vocab(), min_letters=5) == ["mountain", "river"]
    with pytest.raises(ValueError, match="no topics"):
        synthesize(chat_backend(), "unused.jsonl", 1, topics=[], show_progress=False)
