"""``exactspec audit --endpoint URL``: audit engines reached over an OpenAI-compatible HTTP
API (:mod:`exactspec.audit.remote`): the options, and the run."""

from __future__ import annotations

import argparse
import json
import os

from exactspec.audit.remote import MODES
from exactspec.cli.common import DEFAULT_K, print_error

EXACTSPEC_ONLY = {"engine": "exactspec", "proposer": "prompt-lookup", "policy": "constant",
                  "num_speculative_tokens": DEFAULT_K, "max_batch_size": None,
                  "broken": "accept-all"}
"""Options of the local audit that do not apply to an endpoint, with their defaults."""
SPECULATION_OFF = {"exactspec": '{"speculation": {"enabled": false}}'}


def add_endpoint_options(audit: argparse.ArgumentParser) -> None:
    group = audit.add_argument_group(
        "engines behind an HTTP API (vLLM, SGLang, TGI, llama-server, Ollama, exactspec serve)",
        "With --endpoint, the engine at URL (A: speculation on) is audited through its "
        "OpenAI-compatible API; --engine, --proposer, -k, --policy, --max-batch-size and "
        "--broken do not apply (the server is configured where it runs).")
    group.add_argument("--endpoint", metavar="URL", default=None,
                       help="A: the API's base URL, e.g. http://127.0.0.1:8000/v1")
    group.add_argument("--mode", choices=MODES, default="two-sample",
                       help="two-sample (the default, no local model): A's samples against "
                            "B's; reference: A's samples against the exact probabilities of "
                            "the local --model (checked to be the served one first); greedy: "
                            "A against B at temperature 0, token for token, over --questions")
    group.add_argument("--against", metavar="URL", default=None,
                       help="B: the same model with speculation off (another deployment or "
                            "another engine); default: --endpoint itself, with --against-body")
    group.add_argument("--endpoint-model", metavar="NAME", default=None,
                       help="the model's name in A's API (default: the first of GET /models)")
    group.add_argument("--against-model", metavar="NAME", default=None,
                       help="the model's name in B's API (default: the first of its GET /models)")
    group.add_argument("--extra-body", metavar="JSON", type=json_object, default={},
                       help="fields added to every request body (A, B and the control): the "
                            "engine's own, e.g. llama.cpp's '{\"repeat_penalty\": 1.0}'")
    group.add_argument("--against-body", metavar="JSON", type=json_object, default=None,
                       help="fields added to B's requests: the per-request switch that turns "
                            f"speculation off where the engine has one, e.g. exactspec's "
                            f"'{SPECULATION_OFF['exactspec']}'")
    group.add_argument("--control-body", metavar="JSON", type=json_object, default=None,
                       help="fields of the control, A's requests with a known deviation that "
                            "must be caught (default: the temperature raised by a quarter)")
    group.add_argument("--control-samples", type=int, default=None, metavar="N",
                       help="samples per prompt of the control (default: --samples; its "
                            "deviation is large, so fewer often suffice to catch it)")
    group.add_argument("--api-key", default=None, metavar="KEY",
                       help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    group.add_argument("--concurrency", type=int, default=4, metavar="N",
                       help="most requests in flight per engine (default 4)")
    group.add_argument("--samples-per-request", type=int, default=1, metavar="N",
                       help="choices per request (the API's n; default 1: some engines ignore n)")
    group.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                       help="per request (default 120)")
    group.add_argument("--retries", type=int, default=3, metavar="N",
                       help="retries of a failed request, with exponential back-off (default 3)")
    group.add_argument("--no-token-ids", action="store_true",
                       help="do not send vLLM's return_token_ids (for servers refusing "
                            "unknown fields): tokens are then read from the logprobs")
    group.add_argument("--no-logprobs", action="store_true",
                       help="do not ask for logprobs while sampling (llama-cpp-python's server "
                            "computes them over the whole vocabulary in Python, about 4× slower "
                            "per request): where the API gives no token ids, the text is then "
                            "re-tokenised with the local --model's tokenizer")
    group.add_argument("--questions", metavar="PATH", default=None,
                       help="greedy mode's prompts: Spec-Bench-format JSONL (e.g. Spec-Bench's "
                            "data/spec_bench/question.jsonl; default: exactspec's own 12 prompts)")
    group.add_argument("--per-category", type=int, default=None, metavar="N",
                       help="greedy mode: questions per group (default all)")


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def run(args: argparse.Namespace, parser: argparse.ArgumentParser, prompts: list[str],
        params) -> int:
    import dataclasses
    import time
    from importlib.resources import files

    from rich.console import Console

    from exactspec.audit.endpoint import TRANSLATED, Endpoint, EndpointError
    from exactspec.audit.remote import (EndpointAudit, compare_greedy, draw_interleaved,
                                        drafting_counts, local_greedy, model_check,
                                        reference_test, two_sample_test, verdict, verdict_line)
    from exactspec.audit.report import write_endpoint_report
    from exactspec.audit.two_sample import subsample_power
    from exactspec.backends.base import UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import LlamaCppNotInstalledError
    from exactspec.bench import load_questions
    from exactspec.cli.common import load_from_args
    from exactspec.model_files import ModelNotFoundError
    from exactspec.progress import LoggedProgress

    for name, default in EXACTSPEC_ONLY.items():
        if getattr(args, name) != default:
            parser.error(f"--{name.replace('_', '-')} does not apply to --endpoint: configure "
                         "speculation where the server runs")
    for flag, value in (("--concurrency", args.concurrency),
                        ("--control-samples", args.control_samples or 1),
                        ("--samples-per-request", args.samples_per_request)):
        if value < 1:
            parser.error(f"{flag} {value} is invalid: it must be ≥ 1")
    if args.retries < 0 or args.timeout <= 0:
        parser.error("--retries must be ≥ 0 and --timeout > 0")
    if args.against is None and args.against_body is None and args.mode != "reference":
        parser.error(f"B is missing: give --against URL (the model with speculation off) or "
                     f"--against-body JSON (the engine's per-request switch, e.g. exactspec's "
                     f"'{SPECULATION_OFF['exactspec']}')")
    console = Console(stderr=True, soft_wrap=True)
    mode = args.mode
    if mode == "greedy":
        try:
            questions = load_questions(args.questions
                                       or files("exactspec.bench") / "prompts.jsonl",
                                       per_group=args.per_category)
        except (FileNotFoundError, ValueError) as error:
            parser.error(f"--questions: {error}")
        prompts = [q.prompt for q in questions]
    target = tokenizer = None
    try:
        if mode == "reference" or args.no_logprobs:
            with console.status(f"Loading {args.model} (the local copy of the served model) …"):
                target = load_from_args(args)
            tokenizer = target.tokenizer
        common = dict(api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                      chat=args.chat, concurrency=args.concurrency, timeout=args.timeout,
                      max_retries=args.retries, samples_per_request=args.samples_per_request,
                      ask_token_ids=not args.no_token_ids, ask_logprobs=not args.no_logprobs,
                      tokenizer_encode=None if tokenizer is None else tokenizer.encode,
                      ids_only=mode == "reference")
        a = Endpoint(args.endpoint, model=args.endpoint_model, extra_body=dict(args.extra_body),
                     name=f"A {args.endpoint}", **common)
        b = None
        if mode != "reference":
            b = Endpoint(args.against or args.endpoint, model=args.against_model or (
                None if args.against else a.model),
                         extra_body=args.extra_body | (args.against_body or {}),
                         name=f"B {args.against or args.endpoint}"
                              + (f" {json.dumps(args.against_body)}" if args.against_body else ""),
                         seed_offset=1 << 29, **common)
        control_body = args.control_body or {"temperature": round(args.temperature * 1.25, 4)}
        control = Endpoint(args.endpoint, model=a.model, extra_body=args.extra_body | control_body,
                           name=f"control: A with {json.dumps(control_body)}",
                           seed_offset=2 << 29, **common)
    except (EndpointError, ValueError, ModelNotFoundError, UnsupportedModelError,
            LlamaCppNotInstalledError) as error:
        print_error(console, error)
        return 1

    if args.chat and mode == "reference":
        prompt_ids = [tokenizer.apply_chat_template(p) for p in prompts]
    elif mode == "reference":
        prompt_ids = [tokenizer.encode(p) for p in prompts]
    config = {"mode": mode, "A": a.url, "A_model": a.model,
              "B": None if b is None else b.name.removeprefix("B "),
              "control": control.name.removeprefix("control: "), "extra_body": args.extra_body,
              "sampling (sent)": {name: getattr(params, name) for name in TRANSLATED},
              "samples_per_prompt": args.samples,
              "control_samples_per_prompt": args.control_samples or args.samples,
              "tokens_per_sample": args.tokens, "alpha": args.alpha,
              "greedy_tokens": args.greedy_tokens, "chat": args.chat,
              "concurrency": args.concurrency, "samples_per_request": args.samples_per_request,
              "local_model": args.model if tokenizer is not None else None,
              # benchmark questions are named, not copied into the report
              "prompts": prompts if mode != "greedy" else
              [f"question {q.question_id} ({q.category})" for q in questions]}
    result = EndpointAudit(mode, config, [])
    samples: list = []
    start = time.perf_counter()
    try:
        with LoggedProgress(console=console, transient=True) as progress:
            tokens = args.greedy_tokens if mode != "greedy" else max(args.greedy_tokens, 1)
            if tokens:
                task = progress.add_task("greedy", total=len(prompts))
                greedy_params = dataclasses.replace(params, temperature=0.0, top_p=1.0, top_k=0,
                                                    min_p=0.0, seed=None, max_new_tokens=tokens)

                def ask(endpoint):
                    return lambda i: endpoint.complete(prompts[i], greedy_params,
                                                       top_logprobs=5)[0]

                other = (ask(b) if b is not None
                         else local_greedy(target, prompt_ids, greedy_params))
                result.greedy, answers, references = compare_greedy(
                    ask(a), other, len(prompts), lambda n: progress.advance(task, n))
                progress.remove_task(task)
                if mode == "reference":
                    result.model_check = model_check(result.greedy, answers, references)
            if mode != "greedy":
                engines = [a, b, control] if b is not None else [a, control]
                sizes = [args.samples] * (len(engines) - 1) + [args.control_samples
                                                               or args.samples]
                result.samples_asked = sum(sizes) * len(prompts)
                task = progress.add_task("sampling " + ", ".join(
                    ["A", "B", "control"] if b is not None else ["A", "control"]),
                                         total=result.samples_asked)
                before = drafting_counts(a)
                samples, result.interrupted = draw_interleaved(
                    engines, prompts, params, sizes, lambda n: progress.advance(task, n))
                result.samples_drawn = sum(len(s) for per in samples for s in per)
                progress.remove_task(task)
                with console.status("testing …"):
                    if b is not None:
                        result.two_sample = two_sample_test(a, b, samples[0], samples[1],
                                                            args.tokens, args.alpha,
                                                            params.seed or 0, before)
                        result.control = two_sample_test(control, b, samples[2], samples[1],
                                                         args.tokens, args.alpha,
                                                         params.seed or 0)
                        result.power = subsample_power(samples[2][0], samples[1][0],
                                                       args.tokens, args.alpha,
                                                       seed=params.seed or 0)
                    else:
                        result.reference = reference_test(a, target, prompt_ids, params,
                                                          samples[0], args.alpha, before)
                        result.control = reference_test(control, target, prompt_ids, params,
                                                        samples[1], args.alpha)
    except EndpointError as error:
        print_error(console, error)
        return 1
    config["seconds"] = round(time.perf_counter() - start, 1)
    result.token_source = a.token_source
    result.failures = [f"{e.name}: {f}" for e in (a, b, control) if e is not None
                       for f in e.failures]
    result.requests = sum(e.requests for e in (a, b, control) if e is not None)
    describe = (lambda t: repr(tokenizer.decode([t])) if isinstance(t, int) and tokenizer
                else repr(t))
    verdict(result, describe)
    drawn = {engine.name: per_prompt for engine, per_prompt
             in zip([e for e in (a, b, control) if e is not None], samples)}
    files_written = write_endpoint_report(result, args.output, describe, drawn)
    print(files_written[1].read_text())
    console.print(f"wrote {', '.join(str(f) for f in files_written)}", highlight=False)
    console.print(verdict_line(result), highlight=False, style="bold")
    return 0 if result.verdict == "exact" else 1
