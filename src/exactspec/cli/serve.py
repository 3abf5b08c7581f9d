"""``exactspec serve``: the model behind an OpenAI-compatible HTTP API (FastAPI + uvicorn)."""

from __future__ import annotations

import argparse
import contextlib
import os

from exactspec.cli.common import (DEFAULT_K, EXIT_STATUSES, add_model_options,
                                  add_policy_option, allows_batch_variance,
                                  check_proposer_before_loading, proposer_spec, load_from_args,
                                  positive_int)
from exactspec.batching import DEFAULT_MAX_BATCH_SIZE
from exactspec.proposers.spec import DEFAULT_NGRAM, FORMS, parse_proposer

API_KEY_VARIABLE = "EXACTSPEC_API_KEY"


def add_parser(commands) -> None:
    serve = commands.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Load the model once and serve it over OpenAI's API with exact speculative "
                    "decoding: POST /v1/completions, POST /v1/chat/completions (streaming with "
                    "\"stream\": true), GET /v1/models, GET /health, GET /metrics (Prometheus). "
                    "Requests are batched: up to --max-batch-size of them decode together "
                    "(continuous batching: a request joins between any two cycles, first come "
                    "first served), each exactly what it would be alone; a request may set "
                    "\"speculation\": {\"enabled\", \"num_speculative_tokens\", \"policy\"} and "
                    "every response carries its speculative figures under \"speculation\". "
                    "With --proposer suffix:corpus=N a request also drafts from earlier "
                    "requests' outputs (the last N tokens of them are kept), but only from "
                    "those of its own scope: the same "
                    "\"cache_salt\" (vLLM's request field) and, where several --api-key are "
                    "given, the same key. Requests without a salt share one scope, and an "
                    "accepted draft can tell a client what another one's output held: give "
                    "each client its own secret salt (or key) when outputs must stay private.",
        epilog=EXIT_STATUSES)
    add_model_options(serve)
    spec = serve.add_argument_group("speculation (each request may override)")
    spec.add_argument("--proposer", metavar="SPEC", type=proposer_spec,
                      default=parse_proposer("prompt-lookup"),
                      help=f"the proposer: {FORMS} (default prompt-lookup, ngram="
                           f"{DEFAULT_NGRAM[0]}-{DEFAULT_NGRAM[1]}); none serves plain decoding "
                           "only")
    spec.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_K, metavar="K",
                      help=f"most tokens drafted per cycle (default {DEFAULT_K}; 0 = plain)")
    add_policy_option(spec)
    spec.add_argument("--max-batch-size", type=positive_int, default=DEFAULT_MAX_BATCH_SIZE,
                      metavar="B",
                      help="most prompts decoded together, all in one target forward per cycle "
                           f"(continuous batching: requests join as others finish; default "
                           f"{DEFAULT_MAX_BATCH_SIZE}; 1 with a draft model or early exit, "
                           "whose cache follows one sequence). Each request's output is what "
                           "it would be alone")
    http = serve.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 "
                           "exposes the server to the network, use --api-key then)")
    http.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    http.add_argument("--served-model-name", metavar="NAME", default=None,
                      help="the model's name in the API (default: --model as given)")
    http.add_argument("--api-key", action="append", metavar="KEY",
                      help="require 'Authorization: Bearer KEY' on /v1/*; repeat it to accept "
                           "several keys, one per client: a suffix corpus is then shared only "
                           f"among requests with the same key (default: ${API_KEY_VARIABLE} "
                           "if set, else no key)")
    http.add_argument("--max-queue", type=positive_int, default=64, metavar="N",
                      help="most requests waiting for the engine; more get 503 (default 64)")
    http.add_argument("--max-request-bytes", type=positive_int, default=1 << 20, metavar="B",
                      help="largest request body; larger ones get 413 (default 1 MiB)")
    http.add_argument("--log-level", default="info",
                      choices=["critical", "error", "warning", "info", "debug"],
                      help="uvicorn's log level (default info)")
    testing = serve.add_argument_group("testing audits")
    testing.add_argument("--broken-verifier", choices=["accept-all", "no-residual"],
                         default=None,
                         help="NEVER for real use: verify drafts with a deliberately wrong rule "
                              "(accept every draft, or resample from p instead of the "
                              "residual), so that the output distribution is wrong whenever a "
                              "request speculates; a known-broken server on which an audit "
                              "(exactspec audit --endpoint) must fail")
    serve.set_defaults(subparser=serve)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from rich.console import Console

    from exactspec import UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import LlamaCppNotInstalledError
    from exactspec.model_files import ModelNotFoundError
    from exactspec.proposers.spec import build_proposer

    if args.num_speculative_tokens < 0:
        parser.error(f"-k {args.num_speculative_tokens} is invalid: it must be ≥ 0 "
                     "(0 = plain decoding)")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is invalid: it must be in [0, 65535]")
    console = Console(stderr=True, soft_wrap=True)
    proposer_spec = args.proposer
    try:
        check_proposer_before_loading(args, parser, proposer_spec, f"--proposer {proposer_spec.spec}")
        with console.status(f"Loading {args.model} …"):
            target = load_from_args(args)
        with (console.status(f"Loading draft {proposer_spec.model} …") if proposer_spec.model
              else contextlib.nullcontext()):
            proposer = build_proposer(proposer_spec, target, lambda name: load_from_args(args, name))
        app = _app(args, target, proposer)
    except (ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError,
            ValueError) as error:
        console.print(f"[bold red]error:[/] {error}", highlight=False)
        return 1
    import uvicorn

    speculation = (f"proposer {proposer_spec.description}, k ≤ {args.num_speculative_tokens}, "
                   f"{args.policy} policy" if proposer is not None and args.num_speculative_tokens
                   else "plain decoding")
    batch = 1 if proposer is not None and not proposer.batchable else args.max_batch_size
    if args.broken_verifier:
        console.print(f"[bold red]warning:[/] --broken-verifier {args.broken_verifier}: "
                      "speculative requests get a WRONG output distribution (for testing "
                      "audits only)", highlight=False)
    console.print(f"starting {args.served_model_name or args.model} ({target.description}; "
                  f"{speculation}; up to {batch} request{'s' if batch > 1 else ''} at once, "
                  f"{target.max_context_length} tokens each) on "
                  f"http://{args.host}:{args.port}/v1", highlight=False)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except SystemExit as exit_:  # uvicorn exits this way when it cannot bind
        if exit_.code not in (0, None):
            console.print(f"[bold red]error:[/] the server could not start on "
                          f"{args.host}:{args.port} (see the message above)", highlight=False)
            return 1
    return 0


def _app(args: argparse.Namespace, target, proposer):
    from exactspec.server import SpeculationSettings, create_app

    k = args.num_speculative_tokens if proposer is not None else 0
    return create_app(target, proposer, model_name=args.served_model_name or args.model,
                      speculation=SpeculationSettings(k, args.policy),
                      api_key=args.api_key or os.environ.get(API_KEY_VARIABLE),
                      max_queue=args.max_queue, max_request_bytes=args.max_request_bytes,
                      max_batch_size=args.max_batch_size,
                      allow_batch_variance=allows_batch_variance(args),
                      broken_verifier=args.broken_verifier)

