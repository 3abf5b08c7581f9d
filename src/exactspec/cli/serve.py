"""``exactspec serve``: the model behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

The server's modules (:mod:`exactspec.server`, uvicorn) are the optional extra
``exactspec[server]``, imported when the command runs; the audit's broken verifiers
(``--broken-verifier``) are injected into the server from here, only when asked for."""

from __future__ import annotations

import argparse
import functools
import os
import signal
import time

from rich.console import Console

from exactspec.cli.common import (DEFAULT_K, EXIT_STATUSES, add_model_options,
                                  add_policy_option, check_spec, positive_int, print_error,
                                  proposer_spec, speculation_spec, worker_args)
from exactspec.distributed import RayNotInstalledError
from exactspec.extras import require
from exactspec.load_options import DEFAULT_MAX_BATCH_SIZE
from exactspec.model_files import ModelNotFoundError
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
                    "requests' outputs (the last N tokens of them are kept per scope), but only from "
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
                           f"{DEFAULT_NGRAM[0]}-{DEFAULT_NGRAM[1]}); plain serves plain decoding "
                           "only")
    spec.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_K, metavar="K",
                      help=f"most tokens drafted per cycle (default {DEFAULT_K}; 0 = plain)")
    add_policy_option(spec)
    spec.add_argument("--max-batch-size", type=positive_int, default=DEFAULT_MAX_BATCH_SIZE,
                      metavar="B",
                      help="most prompts decoded together, all in one target forward per cycle "
                           f"(continuous batching: requests join as others finish; default "
                           f"{DEFAULT_MAX_BATCH_SIZE}; a draft model drafts for every row, "
                           "its forwards packed too). Each request's output is what it would "
                           "be alone")
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
    ray = serve.add_argument_group("replicas (the optional extra: pip install 'exactspec[ray]')")
    ray.add_argument("--replicas", type=positive_int, default=None, metavar="N",
                     help="serve the same API from N Ray Serve replicas, each loading the "
                          "model once and using --threads CPUs (default 1), behind Ray "
                          "Serve's HTTP proxy on --host:--port (docs/distributed.md); default: "
                          "one process, no Ray")
    ray.add_argument("--ray-address", metavar="ADDRESS", default=None,
                     help="with --replicas: the Ray cluster to deploy on (auto: the one this "
                          "machine joined with 'ray start'; default: Ray's: $RAY_ADDRESS, else "
                          "the cluster 'ray start' started here, else a new local instance)")
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
    require("server", "exactspec serve")
    from exactspec.backends.base import UnsupportedModelError  # PyTorch: after --help
    from exactspec.backends.llama_cpp_backend import LlamaCppNotInstalledError
    if args.num_speculative_tokens < 0:
        parser.error(f"-k {args.num_speculative_tokens} is invalid: it must be ≥ 0 "
                     "(0 = plain decoding)")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} is invalid: it must be in [0, 65535]")
    console = Console(stderr=True, soft_wrap=True)
    proposer_spec = args.proposer
    if args.replicas:
        return _run_replicas(args, parser, console)
    try:
        check_spec(speculation_spec(args), parser, f"--proposer {proposer_spec.spec}")
        with console.status(f"Loading {args.model} …"):
            app = build_app(args)
    except (ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError,
            ValueError) as error:
        print_error(console, error)
        return 1
    import uvicorn  # the server extra

    _warn_broken(args, console)
    console.print(f"starting {_describe(args, app.state.worker)} on "
                  f"http://{args.host}:{args.port}/v1", highlight=False)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except SystemExit as exit_:  # uvicorn exits this way when it cannot bind
        if exit_.code not in (0, None):
            console.print(f"[bold red]error:[/] the server could not start on "
                          f"{args.host}:{args.port} (see the message above)", highlight=False)
            return 1
    return 0


def _run_replicas(args: argparse.Namespace, parser, console) -> int:
    """``--replicas N``: the application on N Ray Serve replicas until Ctrl-C."""
    from exactspec.server import replicas  # the server extra

    try:
        check_spec(speculation_spec(args), parser, f"--proposer {args.proposer.spec}")
    except (ModelNotFoundError, ValueError) as error:
        print_error(console, error)
        return 1
    _warn_broken(args, console)
    threads = args.threads or 1
    try:
        with console.status(f"Starting {args.replicas} replicas (each loads {args.model}) …"):
            replicas.start(functools.partial(build_app, worker_args(args), ray_metrics=True),
                           replicas=args.replicas, cpus_per_replica=threads,
                           # each replica queues and answers 503 itself beyond this
                           max_ongoing_requests=args.max_batch_size + args.max_queue,
                           host=args.host, port=args.port, ray_address=args.ray_address)
    except (RayNotInstalledError, ConnectionError, RuntimeError) as error:
        print_error(console, error)
        return 1
    console.print(f"serving {args.served_model_name or args.model} on {args.replicas} Ray Serve "
                  f"replicas ({threads} CPU each) on http://{args.host}:{args.port}/v1;"
                  " Ctrl-C stops them", highlight=False)
    def terminate(signum, frame):  # Ctrl-C, or SIGTERM from a service manager
        raise KeyboardInterrupt
    for stop_signal in (signal.SIGINT, signal.SIGTERM):  # SIGINT too where a shell ignored it
        signal.signal(stop_signal, terminate)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:  # the way to stop a server: not an interruption
        console.print("stopping the replicas …", highlight=False)
    finally:
        replicas.stop()
    return 0


def build_app(args: argparse.Namespace, ray_metrics: bool = False):
    """Load the target and proposer ``args`` name and build the server's application (one
    process, or one Ray Serve replica: ``ray_metrics`` then records every metric as a Ray
    metric too).

    Raises:
        ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError, ValueError:
            as loading does.
    """
    from exactspec.server import create_app  # the server extra

    spec = speculation_spec(args)
    speculation = spec.load()
    factory = {}
    if args.broken_verifier:  # the audit's code, loaded only for this test of audits
        from exactspec.audit.broken import BrokenGenerator

        factory = {"generator_factory": functools.partial(BrokenGenerator,
                                                          broken=args.broken_verifier)}
    return create_app(speculation.target, speculation.proposer,
                      model_name=args.served_model_name or args.model,
                      speculation=speculation.settings,
                      api_key=args.api_key or os.environ.get(API_KEY_VARIABLE),
                      max_queue=args.max_queue, max_request_bytes=args.max_request_bytes,
                      max_batch_size=args.max_batch_size,
                      allow_batch_variance=spec.allow_batch_variance, ray_metrics=ray_metrics,
                      **factory)


def _warn_broken(args: argparse.Namespace, console) -> None:
    if args.broken_verifier:
        console.print(f"[bold red]warning:[/] --broken-verifier {args.broken_verifier}: "
                      "speculative requests get a WRONG output distribution (for testing "
                      "audits only)", highlight=False)


def _describe(args: argparse.Namespace, worker) -> str:
    """E.g. ``smollm2 (transformers …; proposer …, k ≤ 4, auto policy; up to 8 requests at
    once, 8192 tokens each)``."""
    target, proposer = worker.target, worker.proposer
    speculation = (f"proposer {args.proposer.description}, k ≤ {args.num_speculative_tokens}, "
                   f"{args.policy} policy" if proposer is not None and args.num_speculative_tokens
                   else "plain decoding")
    batch = 1 if proposer is not None and not proposer.batchable else args.max_batch_size
    return (f"{args.served_model_name or args.model} ({target.description}; {speculation}; up "
            f"to {batch} request{'s' if batch > 1 else ''} at once, "
            f"{target.max_context_length} tokens each)")
