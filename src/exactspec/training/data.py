"""Training data for a draft head: the target's own chat answers, to questions it wrote.

A head drafts well for a target when it was trained on what that target writes in the
format it serves (issue 30's probe: a head trained on package docstrings agreed with the
target's argmax 0.41 of the time on docstrings but 0.16 on its chat answers). So the data
here are conversations the target writes itself, in two steps, following the self-synthesis
of Magpie (Xu et al. 2024, arXiv 2406.08464: prompts sampled from the aligned model itself)
and EAGLE's practice of training on the target's own responses (Li et al. 2024, arXiv
2401.15077, section 4):

1. a *question*: the target asked, in its chat format, to write one question a curious
   person could ask an AI assistant about a *topic*, a word drawn from the target's own
   vocabulary (sampled at ``question_temperature``, seeded per conversation);
2. its *answer* to that question, in its chat format (greedy by default).

No benchmark text is involved: nothing the bench measures (Spec-Bench) can leak into a head.

File format (``.jsonl``): one conversation per line, ``{"index", "topic", "prompt",
"answer", "finish_reason"}``, ``prompt`` the answer's prompt token ids (chat template
applied) and ``answer`` its token ids, each as base64 of little-endian uint32. A line is
written and flushed as soon as its conversation is complete, so an interrupted run keeps
every finished conversation; :func:`synthesize` resumes after the last complete line, and
conversation i depends only on ``seed`` and i, so a resumed file equals an uninterrupted one.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exactspec.backends.base import Backend, Tokenizer
from exactspec.batching import BatchedGenerator
from exactspec.generator import SpeculativeGenerator
from exactspec.progress import LoggedProgress
from exactspec.proposers.suffix import SuffixProposer
from exactspec.sampling import SamplingParams

QUESTION_REQUEST = ("Write one question that a curious person could ask an AI assistant about "
                    "{topic}. Reply with the question only.")
"""The user turn that asks the target for a question about ``{topic}``."""
WORD_MARKERS = ("Ġ", "▁", " ")
"""How tokenizers mark a token that starts a word (byte-level BPE, SentencePiece, plain)."""


@dataclass(frozen=True)
class Conversation:
    """One synthesized conversation.

    Attributes:
        index: its position in the file (0-based); its randomness depends on it only.
        topic: the word the question is about.
        prompt_ids: ``[prompt_len]`` the answer's prompt: the question in the chat template.
        answer_ids: ``[answer_len]`` the target's answer.
        finish_reason: ``"stop"`` or ``"length"`` (``answer_tokens`` reached).
    """

    index: int
    topic: str
    prompt_ids: list[int]
    answer_ids: list[int]
    finish_reason: str


def topic_words(tokenizer: Tokenizer, min_letters: int = 6) -> list[str]:
    """Whole lower-case words of at least ``min_letters`` letters in the vocabulary (tokens
    that start a word), sorted: the topics questions are asked about."""
    words = set()
    for token in tokenizer.get_vocab():
        for marker in WORD_MARKERS:
            if token.startswith(marker):
                word = token[len(marker):]
                if len(word) >= min_letters and word.isascii() and word.isalpha() \
                        and word.islower():
                    words.add(word)
    return sorted(words)


def synthesize(target: Backend, path: str | Path, num_conversations: int, *, seed: int = 0,
               topics: Sequence[str] | None = None, batch_size: int = 8,
               question_tokens: int = 48, question_temperature: float = 0.8,
               answer_tokens: int = 256, answer_temperature: float = 0.0,
               show_progress: bool = True) -> list[Conversation]:
    """Write conversations ``0 .. num_conversations - 1`` to ``path`` (see the module
    docstring), resuming after those already there.

    Args:
        target: the target model; it must have a chat template.
        path: the ``.jsonl`` file (created with its folder if missing).
        num_conversations: how many the file should hold in the end (≥ 1).
        seed: the run's seed: conversation i's topic, question and answer depend only on it
            and i.
        topics: the words questions are about (default: :func:`topic_words` of the target).
        batch_size: conversations decoded together (rows of a
            :class:`~exactspec.batching.BatchedGenerator`; suffix drafting, exact).
        question_tokens, answer_tokens: most tokens of a question and of an answer.
        question_temperature, answer_temperature: their sampling temperatures (0: greedy).
    Returns:
        every conversation in the file, ``[num_conversations]`` (or more if it held more).
    Raises:
        ValueError: for ``num_conversations`` < 1, no topics, a file of another seed, or a
            target without a chat template.
    """
    if not isinstance(num_conversations, int) or num_conversations < 1:
        raise ValueError(f"num_conversations = {num_conversations!r} is invalid: it must be an "
                         "integer ≥ 1")
    topics = list(topics) if topics is not None else topic_words(target.tokenizer)
    if not topics:
        raise ValueError("no topics: the vocabulary has no whole words to ask about; pass "
                         "topics=")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_conversations(path)
    if done and _file_seed(path) != seed:
        raise ValueError(f"{path} was written with seed {_file_seed(path)}, not {seed}: use "
                         "that seed to extend it, or another file")
    _truncate_to(path, done)
    generator = SpeculativeGenerator(target, SuffixProposer(), 4)
    batched = BatchedGenerator(generator, batch_size)
    with (LoggedProgress(disable=not show_progress) as progress, open(path, "a") as file):
        task = progress.add_task("synthesizing conversations", total=num_conversations,
                                 completed=len(done))
        for start in range(len(done), num_conversations, batch_size):
            indices = list(range(start, min(start + batch_size, num_conversations)))
            chosen = [random.Random(f"{seed}:{i}").choice(topics) for i in indices]
            questions = batched.generate(
                [QUESTION_REQUEST.format(topic=topic) for topic in chosen],
                [SamplingParams(temperature=question_temperature, max_new_tokens=question_tokens,
                                seed=_seed(seed, i, 0)) for i in indices], chat=True)
            answers = batched.generate(
                [q.text.strip() or topic for q, topic in zip(questions, chosen)],
                [SamplingParams(temperature=answer_temperature, max_new_tokens=answer_tokens,
                                seed=_seed(seed, i, 1)) for i in indices], chat=True)
            for i, topic, answer in zip(indices, chosen, answers):
                conversation = Conversation(i, topic, answer.prompt_token_ids, answer.token_ids,
                                            answer.finish_reason)
                file.write(json.dumps(_encode(conversation, seed)) + "\n")
                file.flush()
                done.append(conversation)
                progress.advance(task)
    return done


def read_conversations(path: str | Path) -> list[Conversation]:
    """The complete conversations in ``path`` (none if it does not exist); a last line cut
    short by an interruption is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    conversations = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break  # an interrupted last line
        conversations.append(Conversation(record["index"], record["topic"],
                                          _ids(record["prompt"]), _ids(record["answer"]),
                                          record["finish_reason"]))
    return conversations


def _seed(seed: int, index: int, step: int) -> int:
    """The sampling seed of conversation ``index``'s question (step 0) or answer (step 1)."""
    return (seed * 1_000_003 + index) * 2 + step


def _encode(conversation: Conversation, seed: int) -> dict:
    record = dataclasses.asdict(conversation)
    for key, ids in (("prompt", record.pop("prompt_ids")), ("answer", record.pop("answer_ids"))):
        record[key] = base64.b64encode(np.asarray(ids, dtype="<u4").tobytes()).decode()
    return record | {"seed": seed}


def _ids(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<u4").tolist()


def _file_seed(path: Path) -> int | None:
    with open(path) as file:
        first = file.readline()
    try:
        return json.loads(first).get("seed")
    except ValueError:
        return None


def _truncate_to(path: Path, conversations: list[Conversation]) -> None:
    """Drop whatever follows the complete lines (an interrupted last line)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)[:len(conversations)]
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    path.write_text("".join(lines))
