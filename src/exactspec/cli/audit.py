"""``exactspec audit``: test statistically that speculative decoding leaves the target's
distribution unchanged, on exactspec, on transformers' or llama-cpp-python's own assisted
generation, or on any engine behind an OpenAI-compatible API (``--endpoint``:
:mod:`exactspec.cli.audit_endpoint`)."""

from __future__ import annotations

import argparse
import dataclasses

from exactspec.audit.modes import BROKEN, CONSTRAINT_CONTROL, ENGINES, PEERS
from exactspec.cli.audit_endpoint import add_endpoint_options
from exactspec.cli.common import (DEFAULT_K, add_constraint_options, add_model_options,
                                  add_policy_option, add_ray_options, check_ray_options,
                                  check_spec, constraint_from_args, positive_int, print_error,
                                  seed, speculation_spec, start_workers)
from exactspec.extras import require
from exactspec.proposers.spec import FORMS, parse_proposer

QUICK = {"samples": 200, "greedy_tokens": 24, "num_prompts": 3}
FULL = {"samples": 1000, "greedy_tokens": 64}
"""Test sizes when neither --quick nor the flag itself is given."""


def add_parser(commands) -> None:
    audit = commands.add_parser(
        "audit", help="test that speculative decoding keeps the target's distribution exactly",
        description="Audit exactness on a real model: (1) greedy output token for token equal to "
                    "plain decoding; (2) samples of the first --tokens tokens of each prompt: "
                    "at each position, the tokens drawn after every sampled prefix against the "
                    "target's exact processed conditional probabilities (chi-square tests "
                    "summed per position, Holm's correction over prompts and positions; a "
                    "token of probability 0 fails at once), with the smallest deviation each "
                    "test detects; (3) a power check: the same test on a deliberately broken "
                    "verifier must fail. With --endpoint, an engine behind an OpenAI-compatible "
                    "API instead (see that group below). Writes audit.json, "
                    "report.md and one plot per prompt to --output. Exit status 0 only for the "
                    "verdict 'exact'.")
    add_model_options(audit)
    what = audit.add_argument_group("what to audit")
    what.add_argument("--engine", choices=ENGINES,
                      default="exactspec",
                      help="exactspec (the default); transformers generate() in the matching "
                           "mode: prompt_lookup_num_tokens, assistant_early_exit or "
                           "assistant_model; or llama_cpp: llama-cpp-python's generate() with "
                           "its LlamaPromptLookupDecoding draft (--backend llama_cpp, prompt "
                           "lookup or none, temperature only: --top-p 1)")
    what.add_argument("--proposer", default="prompt-lookup", metavar="SPEC",
                      help=f"the proposer: {FORMS} (default prompt-lookup); the same "
                           "grammar as generate --proposer")
    what.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_K, metavar="K",
                      help=f"most tokens drafted per cycle (default {DEFAULT_K})")
    add_policy_option(what, "constant", ": every cycle drafts, so verification is exercised; "
                      "auto may find that drafting does not pay and test plain decoding")
    what.add_argument("--max-batch-size", type=positive_int, default=None, metavar="B",
                      help="exactspec only: decode the samples as concurrent requests, B at a "
                           "time, with batched decoding as exactspec serve runs it (each an "
                           "unseeded request, so under auto its k follows the batch, drawing "
                           "from its own generator); the broken control is batched too "
                           "(default: one sample after another)")
    what.add_argument("--broken", choices=BROKEN, default=None,
                      help="broken control for the power check: accept every draft (the "
                           "default), or resample from p instead of the residual after a "
                           f"rejection; {CONSTRAINT_CONTROL} (the default with a structured-"
                           "output flag): the constraint masks the verified position only, "
                           "drafts are judged by the unconstrained p; none skips it (the "
                           "verdict is then inconclusive)")
    sampling = audit.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.8, help="default 0.8")
    sampling.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    sampling.add_argument("--top-p", type=float, default=0.9, help="default 0.9")
    sampling.add_argument("--min-p", type=float, default=0.0, help="default 0 (off)")
    sampling.add_argument("--seed", type=seed, default=0, help="default 0")
    test = audit.add_argument_group("test size")
    test.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                      help="a prompt to test (repeatable); default: 5 built-in prompts on which "
                           "prompt lookup drafts from the first token")
    test.add_argument("--prompts", metavar="FILE", default=None,
                      help="a text file with one prompt per line")
    test.add_argument("--samples", type=int, default=None,
                      help=f"samples per prompt for the distribution test, ≥ 1 (default "
                           f"{FULL['samples']}; {QUICK['samples']} with --quick)")
    test.add_argument("--tokens", type=int, default=3, metavar="M",
                      help="new tokens per sample (default 3; ≥ 2 so that drafts are verified)")
    test.add_argument("--greedy-tokens", type=int, default=None,
                      help=f"tokens per prompt for the greedy identity check (default "
                           f"{FULL['greedy_tokens']}; {QUICK['greedy_tokens']} with --quick; "
                           "0 skips)")
    test.add_argument("--alpha", type=float, default=0.01,
                      help="false-alarm rate of the whole audit (default 0.01)")
    test.add_argument("--chat", action="store_true",
                      help="wrap prompts in the model's chat template (default: raw text); "
                           "with --endpoint, send each as one user message to "
                           "/v1/chat/completions")
    test.add_argument("--quick", action="store_true",
                      help=f"{QUICK['num_prompts']} prompts, {QUICK['samples']} samples, "
                           f"{QUICK['greedy_tokens']} greedy tokens: a few minutes on the "
                           "embedded model; --samples, --greedy-tokens and --prompt given "
                           "explicitly override these")
    add_constraint_options(audit)
    audit.add_argument("--output", default="audit-results", metavar="DIR",
                       help="where audit.json, report.md and the plots go (default audit-results)")
    add_ray_options(audit, "greedy checks, sample chunks and per-prompt tests",
                    "Seeded, audit.json equals the run without Ray at the same --threads.")
    add_endpoint_options(audit)
    audit.set_defaults(subparser=audit)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Map the flags to an :class:`~exactspec.audit.AuditSpec`, run it
    (:func:`exactspec.audit.run`), write and print the report; the exit status."""
    require("audit", "exactspec audit")
    import functools
    from pathlib import Path

    from rich.console import Console

    from exactspec import SamplingParams
    from exactspec.audit import AUDIT_PROMPTS, AuditSpec, verdict_line, write_report
    from exactspec.audit import run as run_audit
    from exactspec.audit.pipeline import audit_setup
    from exactspec.audit.endpoint import EndpointError
    from exactspec.backends.base import UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import LlamaCppNotInstalledError
    from exactspec.distributed import RayNotInstalledError, connect
    from exactspec.model_files import ModelNotFoundError
    from exactspec.peers import check_peer_runs
    from exactspec.progress import LoggedProgress

    check_ray_options(args, parser)
    for name in FULL:  # explicit flags win over --quick's sizes
        if getattr(args, name) is None:
            setattr(args, name, (QUICK if args.quick else FULL)[name])
    for flag, value, low in (("--samples", args.samples, 1), ("--tokens", args.tokens, 2),
                             ("--greedy-tokens", args.greedy_tokens, 0),
                             ("-k", args.num_speculative_tokens, 1)):
        if value < low:
            parser.error(f"{flag} {value} is invalid: it must be ≥ {low}")
    if not 0 < args.alpha < 1:
        parser.error(f"--alpha {args.alpha} is invalid: it must be in (0, 1)")
    if args.temperature == 0:
        parser.error("--temperature 0 is greedy: the distribution test needs sampling "
                     "(greedy identity is checked in every audit)")
    prompts = list(args.prompt or [])
    if args.prompts:
        try:
            prompts += [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
        except OSError as error:
            parser.error(f"--prompts {args.prompts!r} cannot be read: {error.strerror}")
    prompts = prompts or list(AUDIT_PROMPTS[: QUICK["num_prompts"] if args.quick else None])
    try:
        constraint = constraint_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.broken is None:
        args.broken = CONSTRAINT_CONTROL if constraint is not None else "accept-all"
    elif args.broken == CONSTRAINT_CONTROL and constraint is None:
        parser.error(f"--broken {CONSTRAINT_CONTROL} breaks a constraint: give one "
                     "(--json-schema, --json-object, --regex, --grammar or --choice)")
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                                max_new_tokens=args.tokens, constraint=constraint)
    except ValueError as error:
        parser.error(str(error).replace("SamplingParams.", "--").replace("_", "-"))

    spec = AuditSpec(prompts, params, args.samples, args.alpha, args.greedy_tokens, args.chat)
    console = Console(stderr=True, soft_wrap=True)
    if args.endpoint:
        from exactspec.cli import audit_endpoint

        if args.ray is not None:
            parser.error("--ray shards a local audit; --endpoint audits a server (raise "
                         "--concurrency, or give the server replicas: serve --replicas)")
        spec = audit_endpoint.endpoint_spec(args, parser, spec)
    elif args.max_batch_size and args.engine != "exactspec":
        parser.error(f"--max-batch-size audits exactspec's batched decoding, not --engine "
                     f"{args.engine}")
    try:
        if not args.endpoint:
            proposer_spec = parse_proposer(args.proposer)
            if args.engine != "exactspec":
                check_peer_runs(dataclasses.replace(proposer_spec, peer=PEERS[args.engine]))
            setup = speculation_spec(args, proposer_spec)
            check_spec(setup, parser, f"--proposer {args.proposer}")
            if args.ray is not None:  # before loading: a missing Ray or cluster fails at once
                connect(args.ray or None)
            spec = dataclasses.replace(
                spec, setup=setup, engine=args.engine, broken=args.broken,
                config={"model": args.model, "proposer": args.proposer,
                        "k": args.num_speculative_tokens, "policy": args.policy,
                        "max_batch_size": args.max_batch_size})
            if args.ray is not None:  # each worker loads with the CPUs Ray reserves for it
                workers = dataclasses.replace(spec, setup=dataclasses.replace(
                    setup, model=dataclasses.replace(setup.model, threads=args.threads or 1)))
                spec.executor = lambda loaded: start_workers(
                    args, functools.partial(audit_setup, workers), console)
        with LoggedProgress(console=console, transient=True) as progress:
            result = run_audit(spec, progress)
    except (ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError,
            RayNotInstalledError, EndpointError, ConnectionError, RuntimeError,
            ValueError) as error:
        print_error(console, error)
        return 1
    files = write_report(result, args.output)
    print(files[1].read_text())
    console.print(f"wrote {', '.join(str(f) for f in files)}", highlight=False)
    console.print(verdict_line(result, quick=args.quick and not args.endpoint),
                  highlight=False, style="bold")
    return 0 if result.verdict == "exact" else 1

