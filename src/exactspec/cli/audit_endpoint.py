"""``exactspec audit --endpoint URL``: audit engines reached over an OpenAI-compatible HTTP
API (:mod:`exactspec.audit.remote`): the options, and their mapping to an
:class:`~exactspec.audit.EndpointSpec` (``exactspec.cli.audit`` runs it)."""

from __future__ import annotations

import argparse
import json

from exactspec.audit.modes import MODES
from exactspec.cli.common import DEFAULT_K

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


def endpoint_spec(args: argparse.Namespace, parser: argparse.ArgumentParser, spec):
    """``spec`` (an :class:`~exactspec.audit.AuditSpec` of the common flags) with the
    ``--endpoint`` group's flags mapped to its :class:`~exactspec.audit.EndpointSpec`; in
    greedy mode, the prompts are the ``--questions``. Bad flags exit through
    ``parser.error``."""
    import dataclasses
    from importlib.resources import files

    from exactspec.audit import EndpointSpec
    from exactspec.bench import load_questions
    from exactspec.cli import common

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
    if args.mode == "greedy":
        try:
            questions = load_questions(args.questions
                                       or files("exactspec.bench") / "prompts.jsonl",
                                       per_group=args.per_category)
        except (FileNotFoundError, ValueError) as error:
            parser.error(f"--questions: {error}")
        # benchmark questions are named, not copied into the report
        spec = dataclasses.replace(spec, prompts=[q.prompt for q in questions], prompt_names=[
            f"question {q.question_id} ({q.category})" for q in questions])
    return dataclasses.replace(spec, endpoint=EndpointSpec(
        args.endpoint, args.mode, args.endpoint_model, args.against, args.against_model,
        dict(args.extra_body), args.against_body, args.control_body, args.control_samples,
        args.api_key, args.concurrency, args.samples_per_request, args.timeout, args.retries,
        ask_token_ids=not args.no_token_ids, ask_logprobs=not args.no_logprobs,
        local_model=args.model, load_target=common.model_spec(args).load))
