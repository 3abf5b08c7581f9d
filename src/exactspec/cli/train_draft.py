"""``exactspec train-draft``: train a draft head for a target on the target's own outputs."""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from rich.console import Console

from exactspec.cli.common import (EXIT_STATUSES, add_model_options, model_spec,
                                  positive_int, print_error, seed)
from exactspec.model_files import ModelNotFoundError
from exactspec.training.config import TrainingConfig
from exactspec.training.tasks import DEFAULT_TASKS, TASKS

DEFAULTS = TrainingConfig()


def add_parser(commands) -> None:
    train = commands.add_parser(
        "train-draft", help="train a draft head (EAGLE family) for --proposer head:PATH",
        description="Train a draft head for the target: one decoder layer that drafts from the "
                    "target's own hidden features (EAGLE-3's fused low/mid/high features and "
                    "training-time test, FR-Spec's reduced draft vocabulary; docs/design.md). "
                    "The data are conversations the target wrote itself: with --synthesize N it "
                    "first writes N of them to --data (questions it asks itself about words of "
                    "its vocabulary, answered greedily in its chat format; resumable), then "
                    "recomputes their features by prefill on the backend the head will draft "
                    "on (native for a GGUF file where it runs, else transformers) and trains. "
                    "Progress, checkpoints and plots go to --output; run the same command "
                    "again to resume. The head "
                    "never changes what is generated, only how fast: use it with "
                    "--proposer head:OUTPUT/head.safetensors (native or transformers backend).",
        epilog=EXIT_STATUSES)
    add_model_options(train)
    data = train.add_argument_group("data")
    data.add_argument("--data", type=Path, required=True, action="append", metavar="FILE.jsonl",
                      help="the target's conversations (exactspec.training.data's format; a "
                           ".jsonl.gz file is read, not extended); repeat it to train on "
                           "several files, in order (a conversation whose prompt an earlier "
                           "one had is left out)")
    data.add_argument("--synthesize", type=positive_int, default=None, metavar="N",
                      help="first extend --data to N conversations written by the target "
                           "(user turns of the --tasks, answers greedy and at 0.7 in turn, "
                           "loops cut; resumable), on --backend (auto: the fastest, native "
                           "for a GGUF file)")
    data.add_argument("--tasks", type=_tasks, default=None, metavar="T,T,...",
                      help="the kinds of user turns --synthesize draws from, comma-separated "
                           f"(default: {', '.join(DEFAULT_TASKS)}; also "
                           f"{', '.join(t for t in TASKS if t not in DEFAULT_TASKS)}, over German "
                           "sentences of the machine's message catalogs)")
    data.add_argument("--passages", choices=("stdlib", "written", "corpus"), default=None,
                      help="what the passage tasks (summarise, rewrite, extract, translate, "
                           "questions about a passage) are over: stdlib, paragraphs of Python's "
                           "standard library docstrings (the default; 600-odd, so they repeat "
                           "in large files); written, texts the target writes itself (news "
                           "reports, stories, emails, ... about a word); or corpus, 1,179 "
                           "real news articles and Wikipedia passages (the test data of "
                           "gensim's wheel; needs exactspec[corpus]; see --corpus-wheel, "
                           "--exclude-questions)")
    data.add_argument("--corpus-wheel", type=Path, default=None, metavar="FILE.whl",
                      help="gensim 4.4.0's wheel for --passages corpus (default: fetched once "
                           "with pip download into ~/.cache/exactspec/corpus)")
    data.add_argument("--exclude-questions", type=Path, action="append", default=[],
                      metavar="FILE.jsonl",
                      help="with --passages corpus: leave out every passage that shares 13 "
                           "words in a row with a prompt of this Spec-Bench-format file "
                           "(repeatable): give the questions you will benchmark the head on")
    training = train.add_argument_group("training")
    training.add_argument("--output", type=Path, default=Path("draft-head"), metavar="DIR",
                          help="the run folder: features, checkpoint.pt, head.safetensors, "
                               "history.json, training.png (default ./draft-head); a checkpoint "
                               "there is resumed with its own settings")
    training.add_argument("--minutes", type=float, default=None,
                          help="stop after this long with a checkpoint (run again to go on)")
    training.add_argument("--updates", type=positive_int, default=DEFAULTS.total_updates,
                          help=f"optimizer steps of the schedule (default {DEFAULTS.total_updates})")
    training.add_argument("--batch-tokens", type=positive_int, default=DEFAULTS.batch_tokens,
                          help=f"tokens per step (default {DEFAULTS.batch_tokens})")
    training.add_argument("--learning-rate", type=float, default=DEFAULTS.learning_rate,
                          help=f"peak AdamW learning rate (default {DEFAULTS.learning_rate})")
    training.add_argument("--draft-vocab-size", type=positive_int, default=None, metavar="V",
                          help="tokens the head drafts from, most frequent in the answers first "
                               f"(FR-Spec; default {DEFAULTS.draft_vocab_size}, or the "
                               "--initial-head's)")
    training.add_argument("--initial-head", type=Path, default=None, metavar="FILE",
                          help="start from this head file's weights instead of a fresh "
                               "head's (e.g. the shipped head, to train it further on new "
                               "data; the draft vocabulary is still the data's)")
    training.add_argument("--unroll", type=positive_int, default=DEFAULTS.num_steps,
                          metavar="S",
                          help="drafting steps trained at every position, each on the head's "
                               f"own previous output (training-time test; default "
                               f"{DEFAULTS.num_steps})")
    training.add_argument("--eval-every", type=positive_int, default=DEFAULTS.eval_every,
                          help="steps between held-out evaluations and checkpoints (default "
                               f"{DEFAULTS.eval_every})")
    training.add_argument("--seed", type=seed, default=0, help="the run's seed (default 0)")
    train.set_defaults(subparser=train)


def _tasks(text: str) -> tuple[str, ...]:
    tasks = tuple(task.strip() for task in text.split(",") if task.strip())
    unknown = [task for task in tasks if task not in TASKS]
    if unknown or not tasks:
        raise argparse.ArgumentTypeError(f"{', '.join(unknown) or repr(text)} is not a task: "
                                         f"choose from {', '.join(TASKS)}")
    return tasks


def _corpus_passages(args: argparse.Namespace) -> list[str]:
    """``--passages corpus``: the wheel's passages, less those sharing 13 words in a row
    with a prompt of the ``--exclude-questions`` files."""
    from exactspec.bench.questions import load_questions
    from exactspec.training.data import corpus_passages, corpus_wheel

    wheel = args.corpus_wheel or corpus_wheel(Path.home() / ".cache" / "exactspec" / "corpus")
    return corpus_passages(wheel, exclude=[question.prompt for path in args.exclude_questions
                                           for question in load_questions(path)])


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    # PyTorch and the training tool, imported here so that --help starts at once
    from exactspec.draft_head.model import head_config, head_metadata
    from exactspec.models import check_model_path, choose_backend
    from exactspec.training.data import deduplicated, read_conversations, synthesize
    from exactspec.training.train import train

    console = Console(stderr=True, soft_wrap=True, highlight=False)
    if args.backend == "llama_cpp":
        parser.error("--backend llama_cpp: a draft head is trained on the hidden features of "
                     "the native or the transformers backend (llama.cpp does not expose them)")
    if args.minutes is not None and args.minutes <= 0:
        parser.error(f"--minutes {args.minutes} is invalid: it must be > 0")
    if args.initial_head is not None and not args.initial_head.is_file():
        parser.error(f"--initial-head {args.initial_head}: no such file")
    if args.tasks is not None and args.synthesize is None:
        parser.error("--tasks chooses what --synthesize writes: add --synthesize N")
    if args.passages is not None and args.synthesize is None:
        parser.error("--passages chooses what --synthesize writes: add --synthesize N")
    if (args.corpus_wheel is not None or args.exclude_questions) and args.passages != "corpus":
        parser.error("--corpus-wheel and --exclude-questions are for --passages corpus")
    if args.synthesize is not None and len(args.data) > 1:
        parser.error("--synthesize extends one --data file: give one")
    for path in args.data if args.synthesize is None else ():
        if not path.is_file():
            parser.error(f"--data {path}: no such file (add --synthesize N to write it)")
    passages = "written" if args.passages == "written" else None  # None: the stdlib's
    if args.synthesize and args.passages == "corpus":
        try:  # before the model loads: a bad wheel or questions file fails at once
            with console.status("Reading the corpus passages (the first time, pip fetches "
                                "gensim's wheel, 28 MB) …"):
                passages = _corpus_passages(args)
        except (ImportError, RuntimeError, ValueError, FileNotFoundError) as error:
            parser.error(f"--passages corpus: {error}")
    try:
        vocab_size = args.draft_vocab_size or (
            head_config(args.initial_head).draft_vocab_size if args.initial_head
            else DEFAULTS.draft_vocab_size)
    except Exception as error:  # safetensors raises its own error types
        parser.error(f"--initial-head {args.initial_head} is not a draft head file ({error})")
    config = dataclasses.replace(
        DEFAULTS, total_updates=args.updates, batch_tokens=args.batch_tokens,
        learning_rate=args.learning_rate, draft_vocab_size=vocab_size,
        initial_head=None if args.initial_head is None else str(args.initial_head),
        num_steps=args.unroll, eval_every=args.eval_every, seed=args.seed)
    spec = model_spec(args)
    target = None
    try:
        if args.synthesize:  # on --backend's choice: auto takes the fastest (native for GGUF)
            with console.status(f"Loading {args.model} …"):
                writer = spec.load()
            before = read_conversations(args.data[0])
            start = time.perf_counter()
            conversations = synthesize(writer, args.data[0], args.synthesize, seed=args.seed,
                                       tasks=args.tasks or DEFAULT_TASKS,
                                       passages=passages)
            seconds = time.perf_counter() - start
            written = sum(len(c.answer_ids) for c in conversations[len(before):])
            console.print(f"synthesized {len(conversations) - len(before)} conversations on "
                          f"the {writer.name} backend, {written} answer tokens in "
                          f"{seconds:.0f} s ({written / seconds:.0f} tokens/s)")
            target = writer if writer.name == "transformers" else None
            del writer
        else:
            conversations = [c for path in args.data for c in read_conversations(path)]
        features = None  # the features of the backend the head drafts on: native if it runs
        if choose_backend(check_model_path(args.model), args.backend, device=args.device,
                          dtype=args.dtype, kernels=args.kernels) == "native":
            with console.status(f"Loading {args.model} …"):
                features = dataclasses.replace(spec, backend="native").load()
        if target is None:  # the head's target tensors, the final norm
            with console.status(f"Loading {args.model} …"):
                target = dataclasses.replace(spec, backend="transformers",
                                             activations=None).load()
        config = dataclasses.replace(
            config, features="transformers" if features is None else features.name)
        unique = deduplicated(conversations)
        if len(unique) < len(conversations):
            console.print(f"{len(conversations) - len(unique)} conversations repeat an earlier "
                          "prompt: left out")
        conversations = unique
        console.print(f"the target's features: the {config.features} backend's")
        if (args.output / "checkpoint.pt").exists():
            console.print(f"resuming the run in {args.output} (with its own settings)")
        path = train(target.model, conversations, args.output, config, backend=features,
                     target_name=args.model, max_minutes=args.minutes)
    except (ModelNotFoundError, ValueError) as error:
        print_error(console, error)
        return 1
    report = head_metadata(path)
    agreement = ", ".join(f"{a:.2f}" for a in report["held_out_chained"])
    console.print(f"head: {path} ({report['updates']} of {config.total_updates} steps, "
                  f"{report['seconds'] / 60:.1f} min); held-out greedy acceptance per drafted "
                  f"position: {agreement}; curves: {args.output / 'training.png'}")
    console.print(f"use it: exactspec generate --proposer head:{path} PROMPT")
    return 0
