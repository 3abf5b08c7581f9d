"""The draft head's training data: the target's own answers, resumable, reproducible."""

import gzip

import pytest

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.training.data import (LOOP_SPAN, PASSAGE_TASKS,
                                     cut_at_repetition, deduplicated, read_conversations,
                                     stdlib_passages, synthesize, topic_words)
from exactspec.training.tasks import DEFAULT_TASKS, GERMAN_TASKS, PASSAGE_KINDS, PASSAGE_REQUEST

from conftest import ALPHABET, VOCAB, tiny_backend, write_corpus_wheel

TOPICS = ["cats", "rivers", "maps", "tea"]


class ChatTokenizer:
    """The tests' character tokenizer with a chat template: ``question <text>\\n`` per user
    turn, ``answer <text>\\n`` per assistant turn, then ``answer`` (the text lower-cased,
    characters outside the alphabet dropped)."""

    def __init__(self, tokenizer):
        self.inner = tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_chat_template(self, prompt):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        text = ""
        for message in messages:
            content = "".join(c for c in message["content"].lower() if c in ALPHABET[:VOCAB])
            text += f"{'question' if message['role'] == 'user' else 'answer'} {content}\n"
        return self.inner.encode(f"{text}answer")


def chat_backend():
    target = tiny_backend(3)
    target.tokenizer = ChatTokenizer(target.tokenizer)
    return target


def test_conversations_are_the_targets_answers_and_a_resumed_file_equals_one_run(tmp_path):
    target = chat_backend()
    kwargs = dict(seed=7, tasks=("question",), topics=TOPICS, batch_size=3, question_tokens=8,
                  answer_tokens=12, answer_temperatures=(0.0,), show_progress=False)
    whole = synthesize(target, tmp_path / "whole.jsonl", 5, **kwargs)  # one chunk, 3 rows
    assert [c.index for c in whole] == list(range(5))
    # resumed, in chunks of 2 on 2 rows: conversation i depends only on the seed and i
    synthesize(target, tmp_path / "resumed.jsonl", 2, **kwargs | {"chunk_size": 2})
    with open(tmp_path / "resumed.jsonl", "a") as file:
        file.write('{"index": 2, "topic": "ca')  # an interrupted line
    resumed = synthesize(target, tmp_path / "resumed.jsonl", 5,
                         **kwargs | {"chunk_size": 2, "batch_size": 2})
    assert resumed == whole == read_conversations(tmp_path / "resumed.jsonl")
    packed = tmp_path / "whole.jsonl.gz"  # the form a finished file is committed in
    packed.write_bytes(gzip.compress((tmp_path / "whole.jsonl").read_bytes()))
    assert read_conversations(packed) == whole
    with pytest.raises(ValueError, match="is compressed: synthesis appends to a plain"):
        synthesize(target, packed, 6, **kwargs)
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


PASSAGES = ["cats sleep in the sun. they purr when warm and fed by their people",
            "rivers run to the sea. maps show where they bend and where towns stand"]


def test_every_task_makes_its_user_turn_and_answers_alternate_greedy_and_sampled(tmp_path):
    """Each task's user turn comes from its own request (the passage before a passage
    question) or instruction; answers are the target's own, greedy and sampled at 0.7 in
    turn; a resumed file equals one run."""
    target = chat_backend()
    kwargs = dict(seed=3, topics=TOPICS, passages=PASSAGES, batch_size=4, question_tokens=6,
                  answer_tokens=10, show_progress=False)
    conversations = synthesize(target, tmp_path / "mix.jsonl", 30, **kwargs)
    assert {c.task for c in conversations} == set(DEFAULT_TASKS)
    assert read_conversations(tmp_path / "mix.jsonl") == conversations
    tokenizer, sampled_differently, follow_ups = target.tokenizer, 0, 0
    for conversation in conversations:
        prompt = tokenizer.decode(conversation.prompt_ids)
        if conversation.task in PASSAGE_TASKS or conversation.task == "passage-question":
            number = int(conversation.topic.split()[1])
            # the chat template keeps the alphabet's characters only
            kept = "".join(ch for ch in PASSAGES[number][:20] if ch in ALPHABET[:VOCAB])
            assert kept in prompt, (conversation.task, prompt)
        else:
            assert conversation.topic in TOPICS
        if conversation.task == "follow-up":  # two user turns and the first answer
            assert prompt.count("question ") == 2 and prompt.count("answer ") == 1
            follow_ups += 1
        greedy = SpeculativeGenerator(target, None).generate(
            conversation.prompt_ids, SamplingParams(max_new_tokens=10)).token_ids
        if conversation.index % 2 == 0:  # greedy: the target's own answer
            assert conversation.answer_ids == cut_at_repetition(greedy)[0]
        else:
            sampled_differently += conversation.answer_ids != cut_at_repetition(greedy)[0]
    assert sampled_differently >= 5  # the odd ones were sampled (at 0.7)
    assert follow_ups >= 1
    synthesize(target, tmp_path / "resumed.jsonl", 13, **kwargs)
    assert synthesize(target, tmp_path / "resumed.jsonl", 30, **kwargs) == conversations


def test_written_passages_are_the_targets_own_texts_and_a_resumed_file_equals_one_run(tmp_path):
    """With passages="written", each passage task is over a text the target wrote (a kind of
    PASSAGE_KINDS about a topic; greedy here, so that the test can write it again), and a
    resumed file equals one run."""
    target = chat_backend()
    kwargs = dict(seed=5, tasks=("summarize", "passage-question", "question"), topics=TOPICS,
                  passages="written", batch_size=3, question_tokens=6, answer_tokens=10,
                  question_temperature=0.0, show_progress=False)
    conversations = synthesize(target, tmp_path / "written.jsonl", 12, **kwargs)
    tokenizer, passage_tasks = target.tokenizer, 0
    for conversation in conversations:
        if conversation.task == "question":
            assert conversation.topic in TOPICS
            continue
        passage_tasks += 1
        kind, topic = conversation.topic.split(" about ")
        assert kind in PASSAGE_KINDS and topic in TOPICS
        request = PASSAGE_REQUEST.format(kind=kind, topic=topic)
        written = SpeculativeGenerator(target, None).generate(
            tokenizer.apply_chat_template(request),
            SamplingParams(max_new_tokens=10))
        text = tokenizer.decode(cut_at_repetition(written.token_ids)[0]).strip()
        kept = "".join(ch for ch in text.lower() if ch in ALPHABET[:VOCAB])
        assert kept and kept in tokenizer.decode(conversation.prompt_ids), conversation
    assert passage_tasks >= 4
    synthesize(target, tmp_path / "resumed.jsonl", 5, **kwargs | {"chunk_size": 2})
    assert synthesize(target, tmp_path / "resumed.jsonl", 12, **kwargs) == conversations


def test_the_german_task_translates_a_given_sentence_and_needs_sentences(tmp_path):
    target = chat_backend()
    german = ["ein satz", "noch ein satz", "der dritte satz"]
    conversations = synthesize(target, tmp_path / "de.jsonl", 6, tasks=("translate-from-german",),
                               german=german, batch_size=2, answer_tokens=6, show_progress=False)
    for conversation in conversations:
        number = int(conversation.topic.split()[1])
        expected = GERMAN_TASKS["translate-from-german"].format(passage=german[number])
        assert conversation.prompt_ids == target.tokenizer.apply_chat_template(expected)
    with pytest.raises(ValueError, match="no German sentences for the tasks"):
        synthesize(target, tmp_path / "none.jsonl", 1, tasks=("translate-from-german",),
                   german=[], show_progress=False)


def test_answers_are_cut_at_their_first_repetition():
    loop = list(range(20)) + list(range(4, 4 + LOOP_SPAN)) + [99]
    assert cut_at_repetition(loop) == (list(range(20)), True)
    assert cut_at_repetition(list(range(40))) == (list(range(40)), False)
    assert cut_at_repetition([1, 2, 1, 2, 1], span=2) == ([1, 2], True)


def test_deduplicated_keeps_the_first_of_each_prompt():
    from exactspec.training.data import Conversation

    items = [Conversation(i, "", prompt, [i], "stop") for i, prompt in
             enumerate([[1, 2], [3], [1, 2], [3, 4], [3]])]
    assert [c.index for c in deduplicated(items)] == [0, 1, 3]


def test_passages_are_standard_library_docstring_paragraphs():
    passages = stdlib_passages()
    assert len(passages) > 100
    assert all(300 <= len(p) <= 1200 and ">>>" not in p for p in passages)
    assert passages == stdlib_passages()  # a fixed order


def test_synthesis_refusals(tmp_path):
    target = chat_backend()
    with pytest.raises(ValueError, match="tasks \\['poetry'\\] are invalid: choose from question"):
        synthesize(target, tmp_path / "x.jsonl", 2, tasks=("poetry",), show_progress=False)
    with pytest.raises(ValueError, match="no passages for the tasks \\['summarize'\\]"):
        synthesize(target, tmp_path / "x.jsonl", 2, tasks=("summarize",), passages=[],
                   show_progress=False)
    with pytest.raises(ValueError, match="no passages for the tasks \\['rewrite'\\] fit the "
                                         "context \\(512 tokens\\) with the answer"):
        synthesize(target, tmp_path / "x.jsonl", 2, tasks=("rewrite",), passages=["ab " * 200],
                   show_progress=False)
    with pytest.raises(ValueError, match="chunk_size = 0 is invalid: it must be ≥ 1"):
        synthesize(target, tmp_path / "x.jsonl", 2, chunk_size=0, show_progress=False)
    with pytest.raises(ValueError, match="answer_temperatures is empty"):
        synthesize(target, tmp_path / "x.jsonl", 2, topics=TOPICS, passages=PASSAGES,
                   answer_temperatures=(), show_progress=False)


def test_corpus_passages_are_news_and_wikipedia_prose_without_the_benchmarks_text(tmp_path):
    from exactspec.training.data import corpus_passages

    words = [f"w{i}" for i in range(400)]
    news = [" ".join(words[:120]) + " costs £5.", "too short", " ".join(words[200:330])]
    paragraph = "The ''river'' flows past [[Old Town|the old town]] and " + " ".join(words[:60])
    article = (f"{{{{Infobox river|name=Test}}}}\n{paragraph}\n\n== History ==\n"
               f"A [[mill]] was built here. {' '.join(words[60:110])}\n\n"
               f"[[File:Mill.jpg|thumb|A mill]]\n{' '.join(words[110:170])} and more.")
    wheel = write_corpus_wheel(tmp_path / "gensim.whl", news, [
        ("River", "0", article), ("Talk:River", "1", article),
        ("Stream", "0", "#REDIRECT [[River]]")])
    passages = corpus_passages(wheel, min_chars=300, max_chars=1200)
    assert passages[0] == news[0] and passages[1] == news[2]  # Latin-1 read, short ones left out
    assert len(passages) == 3, passages  # the talk page and the redirect are left out
    wiki = passages[2]
    assert wiki.startswith("The river flows past the old town and w0 w1")  # markup stripped
    assert "History" not in wiki and "thumb" not in wiki and "{" not in wiki
    assert wiki.endswith("w169 and more.")
    # a passage sharing 13 words in a row with an excluded text is left out; 12 are allowed
    exclude = ["Summarize: " + " ".join(words[205:218]).upper() + "!"]
    assert news[2] not in corpus_passages(wheel, exclude=exclude, min_chars=300, max_chars=1200)
    assert news[2] in corpus_passages(wheel, exclude=[" ".join(words[205:217])],
                                      min_chars=300, max_chars=1200)
    with pytest.raises(ValueError, match="is not gensim's wheel with its test data"):
        corpus_passages(tmp_path / "missing.whl")
