"""Training data for a draft head: the target's own chat answers, to requests it wrote.

A head drafts well for a target when it was trained on what that target writes in the
format it serves (issue 30's probe: a head trained on package docstrings agreed with the
target's argmax 0.41 of the time on docstrings but 0.16 on its chat answers), and on the
kinds of requests users send (issue 43: a head trained on questions about single words
agreed 0.55 on such questions but 0.26–0.30 on Spec-Bench's tasks). So the data here are
conversations the target writes itself, following the self-synthesis of Magpie (Xu et al.
2024, arXiv 2406.08464: prompts sampled from the aligned model itself) and EAGLE's practice
of training on the target's own responses (Li et al. 2024, arXiv 2401.15077, section 4):

1. a *user turn* of one of the :data:`TASKS`: either the target asked, in its chat format,
   to write a request of that kind (about a *topic*, a word of its own vocabulary, or
   about a *passage*), sampled at ``question_temperature``; or, for the passage tasks
   (:data:`PASSAGE_TASKS`: summarise, rewrite, extract, translate), a fixed instruction
   over a passage; or, for ``follow-up``, a second turn the target writes after its own
   (greedy) answer to a first question, the prompt then holding both turns. Passages are
   paragraphs of the docstrings in Python's standard library (:func:`stdlib_passages`:
   text every machine that runs exactspec has, read from the sources without importing
   them; another Python version has other passages, so a file is extended with the
   Python it was begun with), or with ``passages="written"`` texts the target writes
   itself at ``question_temperature`` (a news report, a story, an email, ... of
   :data:`~exactspec.training.tasks.PASSAGE_KINDS` about a topic word: prose without
   limit, where the standard library's 600-odd docstrings repeat); or, for
   ``translate-from-german`` (:data:`~exactspec.training.tasks.GERMAN_TASKS`), a fixed
   instruction over a German sentence of the machine's message catalogs
   (:func:`german_sentences`);
2. the target's *answer*, in its chat format, at one of ``answer_temperatures`` (greedy
   and 0.7 by default, alternating: the head serves both), cut at the start of its first
   repeated span of :data:`LOOP_SPAN` tokens (a loop kept to the length cap would teach the
   head the loop; ``finish_reason`` ``"loop"``).

No benchmark text is involved: nothing the bench measures (Spec-Bench) can leak into a head.
:func:`deduplicated` drops conversations whose prompt an earlier one had.

File format (``.jsonl``): one conversation per line, ``{"index", "task", "topic",
"prompt", "answer", "finish_reason"}``, ``prompt`` the answer's prompt token ids (chat
template applied) and ``answer`` its token ids, each as base64 of little-endian uint32 (a
line without ``task`` is a ``"question"`` of the first version). A line is written and
flushed as soon as its conversation is complete, so an interrupted run keeps every finished
conversation; :func:`synthesize` resumes after the last complete line, and conversation i
depends only on ``seed``, i and the options, so a resumed file equals an uninterrupted one.
"""

from __future__ import annotations

import ast
import base64
import bz2
import dataclasses
import functools
import gettext
import glob
import gzip
import io
import json
import random
import re
import struct
import subprocess
import sys
import sysconfig
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from exactspec.backends.base import Backend, Tokenizer
from exactspec.batching import BatchedGenerator
from exactspec.generator import SpeculativeGenerator
from exactspec.progress import LoggedProgress
from exactspec.proposers.suffix import SuffixProposer
from exactspec.sampling import SamplingParams
from exactspec.training.tasks import (DEFAULT_TASKS, FOLLOW_UP_REQUEST, GERMAN_TASKS,
                                      PASSAGE_KINDS, PASSAGE_REQUEST, PASSAGE_TASKS, REQUESTS,
                                      TASKS,
                                      TOPIC_TASKS)

LOOP_SPAN = 16
"""An answer is cut where a span of this many tokens first repeats an earlier one."""
WORD_MARKERS = ("Ġ", "▁", " ")
"""How tokenizers mark a token that starts a word (byte-level BPE, SentencePiece, plain)."""


@dataclass(frozen=True)
class Conversation:
    """One synthesized conversation.

    Attributes:
        index: its position in the file (0-based); its randomness depends on it only.
        topic: the word the request is about, or ``passage N`` (:func:`stdlib_passages`).
        prompt_ids: ``[prompt_len]`` the answer's prompt: the user turn(s) (and, for a
            follow-up, the first answer) in the chat template.
        answer_ids: ``[answer_len]`` the target's answer.
        finish_reason: ``"stop"``, ``"length"`` (``answer_tokens`` reached) or ``"loop"``
            (cut at its first repetition, :func:`cut_at_repetition`).
        task: one of :data:`TASKS`.
    """

    index: int
    topic: str
    prompt_ids: list[int]
    answer_ids: list[int]
    finish_reason: str
    task: str = "question"


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


def stdlib_passages(min_chars: int = 300, max_chars: int = 1200) -> list[str]:
    """Paragraph runs of the module and class docstrings in Python's standard library
    (read from its sources with :mod:`ast`, nothing imported), each of ``min_chars`` ..
    ``max_chars`` characters, in a fixed order for a given Python (test suites left out):
    the passages the passage tasks are over (read once per process, a few seconds)."""
    return list(_stdlib_passages(min_chars, max_chars))


@functools.lru_cache(maxsize=4)
def _stdlib_passages(min_chars: int, max_chars: int) -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    passages: list[str] = []
    for source in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        if "test" in source.parts[len(root.parts):][0]:
            continue
        try:
            tree = ast.parse(source.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree] + [node for node in tree.body if isinstance(node, ast.ClassDef)]
        for node in nodes:
            text = ast.get_docstring(node) or ""
            run = ""
            for paragraph in (" ".join(p.split()) for p in text.split("\n\n")):
                if not paragraph or ">>>" in paragraph:
                    continue
                run = f"{run} {paragraph}".strip()
                if len(run) >= min_chars:
                    if len(run) <= max_chars:
                        passages.append(run)
                    run = ""
    return tuple(passages)


def german_sentences(min_chars: int = 60, max_chars: int = 300) -> list[str]:
    """German sentences of ``min_chars`` .. ``max_chars`` characters from the translations in
    the gettext message catalogs of the machine's programs
    (``/usr/share/locale/de/LC_MESSAGES/*.mo`` and ``/usr/share/*/lang/de/LC_MESSAGES/*.mo``
    on Debian, read with :mod:`gettext`): messages of at least nine words without format
    placeholders or line breaks, de-duplicated, in a fixed order for a given set of
    installed packages (another machine may have others, so a file is extended on the
    machine it was begun on). Empty where no German catalogs are installed."""
    return list(_german_sentences(min_chars, max_chars))


@functools.lru_cache(maxsize=4)
def _german_sentences(min_chars: int, max_chars: int) -> tuple[str, ...]:
    files = sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo")
                   + glob.glob("/usr/share/*/lang/de/LC_MESSAGES/*.mo")
                   + glob.glob("/usr/share/*/*/lang/de/LC_MESSAGES/*.mo"))
    sentences: dict[str, None] = {}
    for name in files:
        try:
            with open(name, "rb") as file:
                catalog = gettext.GNUTranslations(file)._catalog
        except (OSError, ValueError, struct.error):  # unreadable or not a catalog
            continue
        for text in catalog.values():
            if (isinstance(text, str) and min_chars <= len(text) <= max_chars
                    and text.count(" ") >= 8 and not any(c in text for c in "%{}$\n\t<>")):
                sentences.setdefault(text.strip(), None)
    return tuple(sentences)


CORPUS_WHEEL = "gensim==4.4.0"
"""The wheel whose test data :func:`corpus_passages` reads (``pip download --no-deps
gensim==4.4.0``: the file is read as a zip archive, nothing is installed or imported)."""
CORPUS_FILES = {
    "news": ("gensim/test/test_data/lee_background.cor", "gensim/test/test_data/lee.cor"),
    "wikipedia": ("gensim/test/test_data/enwiki-latest-pages-articles1.xml-"
                  "p000000010p000030302-shortened.bz2",),
}
"""What :func:`corpus_passages` reads of the wheel: the Lee corpus (350 news articles of the
Australian Broadcasting Corporation, one per line, Latin-1; Lee, Pincombe and Welsh 2005)
and the first 206 articles of a 2017 English Wikipedia dump (MediaWiki XML, bz2)."""
CONTAMINATION_WORDS = 13
"""A passage that shares a run of this many words with an excluded text is left out (the
n-gram decontamination of Brown et al. 2020, GPT-3, appendix C)."""


def corpus_wheel(folder: str | Path) -> Path:
    """gensim's wheel (:data:`CORPUS_WHEEL`) in ``folder``, fetched there with ``pip download
    --no-deps`` (about 28 MB) the first time.

    Raises:
        RuntimeError: if pip cannot fetch it (no access to the package index), with pip's
            message.
    """
    folder = Path(folder)
    name, version = CORPUS_WHEEL.split("==")
    found = sorted(folder.glob(f"{name}-{version}-*.whl"))
    if not found:
        folder.mkdir(parents=True, exist_ok=True)
        result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                                 "--only-binary", ":all:", "-d", str(folder), CORPUS_WHEEL],
                                capture_output=True, text=True)
        found = sorted(folder.glob(f"{name}-{version}-*.whl"))
        if result.returncode or not found:
            raise RuntimeError(f"pip could not fetch {CORPUS_WHEEL} into {folder}: "
                               f"{result.stderr.strip()[-500:]}")
    return found[0]


def corpus_passages(wheel: str | Path, *, exclude: Sequence[str] = (),
                    min_chars: int = 600, max_chars: int = 3500) -> list[str]:
    """Real prose for the passage tasks: news articles and Wikipedia passages from the test
    data shipped in gensim's wheel (:data:`CORPUS_WHEEL`, :data:`CORPUS_FILES`), the kind of
    text users paste to be summarised or asked about (self-written passages and docstrings
    are not: issue 43's Spec-Bench agreement was lowest on summarisation and RAG).

    News articles are kept whole when they have ``min_chars`` .. ``max_chars`` characters;
    Wikipedia articles are stripped of their markup (``mwparserfromhell``, the ``corpus``
    extra), and their prose paragraphs (lines of at least 200 characters) joined into runs
    of ``min_chars`` .. ``max_chars`` within one article. A passage sharing a run of
    :data:`CONTAMINATION_WORDS` words (case and punctuation ignored) with any of
    ``exclude`` (the benchmark's prompts) is left out.

    Returns:
        the passages in a fixed order (news, then Wikipedia in the dump's order).
    Raises:
        ValueError: if ``wheel`` is not a zip archive holding :data:`CORPUS_FILES`.
        ImportError: without ``mwparserfromhell`` (``pip install 'exactspec[corpus]'``).
    """
    try:
        import mwparserfromhell
    except ImportError as error:
        raise ImportError("corpus passages strip Wikipedia's markup with mwparserfromhell: "
                          "pip install 'exactspec[corpus]'") from error
    try:
        with zipfile.ZipFile(wheel) as archive:
            raw = {name: archive.read(name) for names in CORPUS_FILES.values() for name in names}
    except (OSError, zipfile.BadZipFile, KeyError) as error:
        raise ValueError(f"{wheel} is not gensim's wheel with its test data ({error}): "
                         f"pip download --no-deps {CORPUS_WHEEL}") from error
    passages = [line.strip() for name in CORPUS_FILES["news"]
                for line in raw[name].decode("latin-1").splitlines()
                if min_chars <= len(line.strip()) <= max_chars]
    dump = bz2.decompress(raw[CORPUS_FILES["wikipedia"][0]])
    for _, element in ElementTree.iterparse(io.BytesIO(dump)):
        if not element.tag.endswith("}page"):
            continue
        namespace = element.tag[:-len("page")]
        text = element.findtext(f"{namespace}revision/{namespace}text") or ""
        if element.findtext(f"{namespace}ns") == "0" and not text.startswith("#REDIRECT"):
            plain = mwparserfromhell.parse(text).strip_code()
            run = ""
            for line in plain.splitlines():
                line = " ".join(line.split())
                if len(line) < 200 or any(c in line for c in "|{}[]<>="):
                    continue
                if run and len(run) + 1 + len(line) > max_chars:
                    if len(run) >= min_chars:
                        passages.append(run)
                    run = ""
                run = f"{run} {line}".strip()
            if min_chars <= len(run) <= max_chars:
                passages.append(run)
        element.clear()
    banned = {gram for text in exclude for gram in _word_grams(text)}
    return [passage for passage in passages if banned.isdisjoint(_word_grams(passage))]


def _word_grams(text: str, n: int = CONTAMINATION_WORDS) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9]+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def cut_at_repetition(token_ids: Sequence[int], span: int = LOOP_SPAN) -> tuple[list[int], bool]:
    """``token_ids`` up to where a span of ``span`` tokens first repeats an earlier span
    (the repetition left out), and whether it was cut."""
    seen: set[tuple[int, ...]] = set()
    for start in range(len(token_ids) - span + 1):
        window = tuple(token_ids[start:start + span])
        if window in seen:
            return list(token_ids[:start]), True
        seen.add(window)
    return list(token_ids), False


def deduplicated(conversations: Sequence[Conversation]) -> list[Conversation]:
    """The conversations whose prompt no earlier one had, in order."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for conversation in conversations:
        key = tuple(conversation.prompt_ids)
        if key not in seen:
            seen.add(key)
            kept.append(conversation)
    return kept


WRITTEN = "written"
"""``synthesize(passages=WRITTEN)``: the target writes each passage (module docstring)."""


def synthesize(target: Backend, path: str | Path, num_conversations: int, *, seed: int = 0,
               tasks: Sequence[str] = DEFAULT_TASKS, topics: Sequence[str] | None = None,
               passages: Sequence[str] | Literal["written"] | None = None,
               german: Sequence[str] | None = None,
               batch_size: int = 8,
               chunk_size: int = 64,
               question_tokens: int = 64, question_temperature: float = 0.8,
               answer_tokens: int = 256, answer_temperatures: Sequence[float] = (0.0, 0.7),
               show_progress: bool = True) -> list[Conversation]:
    """Write conversations ``0 .. num_conversations - 1`` to ``path`` (see the module
    docstring), resuming after those already there.

    Args:
        target: the target model; it must have a chat template.
        path: the ``.jsonl`` file (created with its folder if missing).
        num_conversations: how many the file should hold in the end (≥ 1).
        seed: the run's seed: conversation i's task, topic or passage, user turn and answer
            depend only on it, i and the options.
        tasks: the tasks drawn from (each of :data:`~exactspec.training.tasks.TASKS`;
            default :data:`~exactspec.training.tasks.DEFAULT_TASKS`).
        topics: the words requests are about (default: :func:`topic_words` of the target).
        passages: the passages of the passage tasks (default: :func:`stdlib_passages`), or
            ``"written"``: each one written by the target (see the module docstring).
        german: the German sentences of the German tasks (default: :func:`german_sentences`).
        batch_size: conversations decoded together (rows of a
            :class:`~exactspec.batching.BatchedGenerator`; suffix drafting, exact).
        chunk_size: conversations submitted together, written when all are done: a row
            that finishes takes the next waiting conversation (continuous batching), so
            a chunk of many batches keeps the rows busy while one long answer finishes.
        question_tokens, answer_tokens: most tokens of a written user turn and of an answer.
        question_temperature: the written user turns' sampling temperature.
        answer_temperatures: conversation i's answer is sampled at entry i % len (0: greedy).
    Returns:
        every conversation in the file, ``[num_conversations]`` (or more if it held more).
    Raises:
        ValueError: for ``num_conversations`` or ``chunk_size`` < 1, an unknown task, no
            topics or passages where the tasks need them, a file of another seed or a
            compressed one (``.gz``), or a target without a chat template.
    """
    if not isinstance(num_conversations, int) or num_conversations < 1:
        raise ValueError(f"num_conversations = {num_conversations!r} is invalid: it must be an "
                         "integer ≥ 1")
    if chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size!r} is invalid: it must be ≥ 1")
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks {unknown or list(tasks)} are invalid: choose from "
                         f"{', '.join(TASKS)}")
    if not answer_temperatures:
        raise ValueError("answer_temperatures is empty: give at least one (0: greedy)")
    tasks = list(tasks)
    with_topic = [task for task in tasks if task in TOPIC_TASKS]
    topics = list(topics) if topics is not None else (
        topic_words(target.tokenizer) if with_topic else [])
    if with_topic and not topics:
        raise ValueError("no topics: the vocabulary has no whole words to ask about; pass "
                         "topics=")
    with_german = [task for task in tasks if task in GERMAN_TASKS]
    german = list(german) if german is not None else (
        german_sentences() if with_german else [])
    if with_german and not german:
        raise ValueError(f"no German sentences for the tasks {with_german}: install German "
                         "message catalogs (e.g. Debian's locales of coreutils, apt) or pass "
                         "german=")
    with_passage = [task for task in tasks if task not in with_topic and task not in with_german]
    written = passages == WRITTEN
    if written and not topics:
        topics = topic_words(target.tokenizer)
    passages = [] if written else list(passages) if passages is not None else (
        stdlib_passages() if with_passage else [])
    limit = target.max_context_length
    if limit is not None and not written:  # a passage's longest user turn must leave room
        passages = [p for p in passages if len(target.tokenizer.apply_chat_template(
            REQUESTS["passage-question"].format(passage=p))) + question_tokens
            + answer_tokens <= limit]
    if with_passage and not passages and not written:
        raise ValueError(f"no passages for the tasks {with_passage}"
                         + (f" fit the context ({limit} tokens) with the answer" if limit
                            else "") + ": pass passages=")
    path = Path(path)
    if path.suffix == ".gz":
        raise ValueError(f"{path} is compressed: synthesis appends to a plain .jsonl file "
                         "(gunzip it to extend it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    done = read_conversations(path)
    if done and _file_seed(path) != seed:
        raise ValueError(f"{path} was written with seed {_file_seed(path)}, not {seed}: use "
                         "that seed to extend it, or another file")
    _truncate_to(path, done)
    generator = SpeculativeGenerator(target, SuffixProposer(), 4)
    batched = BatchedGenerator(generator, batch_size)
    with (LoggedProgress(disable=not show_progress) as progress, open(path, "a") as file):
        task_bar = progress.add_task("synthesizing conversations", total=num_conversations,
                                     completed=len(done))
        for start in range(len(done), num_conversations, chunk_size):
            indices = list(range(start, min(start + chunk_size, num_conversations)))
            drawn = [_draw(seed, i, tasks, topics, passages, german) for i in indices]
            if written:
                drawn = _written_passages(batched, seed, indices, drawn, question_temperature,
                                          answer_tokens)
            users = _user_turns(batched, seed, indices, drawn, question_tokens,
                                question_temperature, answer_tokens)
            answers = batched.generate(users, [
                SamplingParams(temperature=answer_temperatures[i % len(answer_temperatures)],
                               max_new_tokens=answer_tokens, seed=_seed(seed, i, 1))
                for i in indices])
            for i, (task, topic, _), answer in zip(indices, drawn, answers):
                answer_ids, looped = cut_at_repetition(answer.token_ids)
                conversation = Conversation(
                    i, topic, answer.prompt_token_ids, answer_ids,
                    "loop" if looped else answer.finish_reason, task)
                file.write(json.dumps(_encode(conversation, seed)) + "\n")
                file.flush()
                done.append(conversation)
                progress.advance(task_bar)
    return done


def _user_turns(batched: BatchedGenerator, seed: int, indices: Sequence[int],
                drawn: Sequence[tuple[str, str, str]], question_tokens: int,
                question_temperature: float, answer_tokens: int) -> list[list[int]]:
    """The answers' prompts (token ids) of conversations ``indices`` with their drawn
    (task, topic, passage): the user turns the target writes, decoded together; for a
    follow-up, its greedy first answer (at most ``answer_tokens // 2`` tokens, cut at a
    repetition) and the second turn it writes after it."""
    tokenizer = batched.target.tokenizer
    fixed = {**PASSAGE_TASKS, **GERMAN_TASKS}  # instructions over a passage: nothing to write
    written = [i for i, (task, _, _) in zip(indices, drawn) if task not in fixed]
    requests = [REQUESTS.get(task, REQUESTS["question"]).format(topic=topic, passage=passage)
                for task, topic, passage in drawn if task not in fixed]
    turns = {i: result.text.strip() for i, result in zip(written, batched.generate(
        requests, [SamplingParams(temperature=question_temperature,
                                  max_new_tokens=question_tokens, seed=_seed(seed, i, 0))
                   for i in written], chat=True))} if written else {}
    follow = [i for i, (task, _, _) in zip(indices, drawn) if task == "follow-up"]
    history = {}
    if follow:
        first = [tokenizer.decode(cut_at_repetition(result.token_ids)[0]).strip()
                 for result in batched.generate([turns[i] or "Hello" for i in follow],
                                                SamplingParams(max_new_tokens=answer_tokens // 2),
                                                chat=True)]
        nexts = batched.generate(
            [FOLLOW_UP_REQUEST.format(question=turns[i], answer=answer)
             for i, answer in zip(follow, first)],
            [SamplingParams(temperature=question_temperature, max_new_tokens=question_tokens,
                            seed=_seed(seed, i, 2)) for i in follow], chat=True)
        history = {i: [{"role": "user", "content": turns[i] or "Hello"},
                       {"role": "assistant", "content": answer},
                       {"role": "user", "content": result.text.strip() or "Go on."}]
                   for i, answer, result in zip(follow, first, nexts)}
    users = []
    for i, (task, topic, passage) in zip(indices, drawn):
        if task in PASSAGE_TASKS:
            sentence = passage.split(". ")[0].rstrip(".") + "."
            user = PASSAGE_TASKS[task].format(passage=passage, sentence=sentence)
        elif task in GERMAN_TASKS:
            user = GERMAN_TASKS[task].format(passage=passage)
        elif task == "follow-up":
            user = history[i]
        else:
            question = turns[i] or topic or passage
            user = f"{passage}\n\n{question}" if task == "passage-question" else question
        users.append(tokenizer.apply_chat_template(user))
    return users


def _draw(seed: int, index: int, tasks: Sequence[str], topics: Sequence[str],
          passages: Sequence[str], german: Sequence[str] = ()) -> tuple[str, str, str]:
    """Conversation ``index``'s (task, topic, passage): the topic a word for a topic task,
    ``german N`` for a German task, else ``passage N``, or without ``passages`` (written
    ones) ``KIND about WORD`` and no passage yet (:func:`_written_passages`)."""
    rng = random.Random(f"{seed}:{index}")
    task = rng.choice(tasks)
    if task in TOPIC_TASKS:
        return task, rng.choice(topics), ""
    if task in GERMAN_TASKS:
        number = rng.randrange(len(german))
        return task, f"german {number}", german[number]
    if not passages:
        return task, f"{rng.choice(PASSAGE_KINDS)} about {rng.choice(topics)}", ""
    number = rng.randrange(len(passages))
    return task, f"passage {number}", passages[number]


def _written_passages(batched: BatchedGenerator, seed: int, indices: Sequence[int],
                      drawn: Sequence[tuple[str, str, str]], temperature: float,
                      max_tokens: int) -> list[tuple[str, str, str]]:
    """``drawn`` with the passages of its passage tasks written by the target
    (:data:`~exactspec.training.tasks.PASSAGE_REQUEST`, decoded together, cut at a
    repetition)."""
    wanted = [n for n, (task, _, _) in enumerate(drawn)
              if task not in TOPIC_TASKS and task not in GERMAN_TASKS]
    requests = []
    for n in wanted:
        kind, topic = drawn[n][1].split(" about ", 1)
        requests.append(PASSAGE_REQUEST.format(kind=kind, topic=topic))
    results = batched.generate(requests, [
        SamplingParams(temperature=temperature, max_new_tokens=max_tokens,
                       seed=_seed(seed, indices[n], 3)) for n in wanted], chat=True) if wanted else []
    drawn = list(drawn)
    for n, result in zip(wanted, results):
        text = batched.target.tokenizer.decode(cut_at_repetition(result.token_ids)[0]).strip()
        drawn[n] = (drawn[n][0], drawn[n][1], text or drawn[n][1])
    return drawn


def read_conversations(path: str | Path) -> list[Conversation]:
    """The complete conversations in ``path`` (none if it does not exist; a ``.gz`` file is
    read through gzip); a last line cut short by an interruption is ignored."""
    path = Path(path)
    if not path.exists():
        return []
    conversations = []
    text = (gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz"
            else path.read_text())
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            break  # an interrupted last line
        conversations.append(Conversation(record["index"], record["topic"],
                                          _ids(record["prompt"]), _ids(record["answer"]),
                                          record["finish_reason"],
                                          record.get("task", "question")))
    return conversations


def _seed(seed: int, index: int, step: int) -> int:
    """The sampling seed of conversation ``index``'s user turn (step 0), answer (step 1),
    follow-up user turn (step 2) or written passage (step 3; steps 0 and 1 as in the first
    version of the format)."""
    return (seed * 1_000_003 + index) * 2 + min(step, 1) + max(step - 1, 0) * 2**40


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
