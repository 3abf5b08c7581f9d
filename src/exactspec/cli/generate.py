"""``exactspec generate``: one prompt, exact speculative decoding, text and figures out."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape

from exactspec.cli.common import (DEFAULT_K, EXIT_STATUSES, add_constraint_options,
                                  add_model_options, add_policy_option, check_spec,
                                  constraint_from_args, logit_bias, ngram_range, positive_int,
                                  print_error, proposer_spec, seed, speculation_spec)
from exactspec.extras import require
from exactspec.files import readable_json
from exactspec.model_files import ModelNotFoundError
from exactspec.proposers.spec import DEFAULT_NGRAM, FORMS, ProposerSpec, parse_proposer

CHECKED_AFTER_LOAD = "an id outside the model's vocabulary is reported once the model has loaded"
FIELD_FLAGS = {"stop_token_ids": "--stop-token-id", "banned_token_ids": "--ban-token-id",
               "bad_words": "--bad-word"}  # SamplingParams fields whose flag is singular


def add_parser(commands) -> None:
    gen = commands.add_parser(
        "generate", help="generate text with speculative decoding",
        description="Generate a continuation of PROMPT with exact speculative decoding and print "
                    "the text, then a one-line summary (tokens, tokens/s, acceptance rate, mean "
                    "acceptance length) on stderr. By default the proposer is prompt lookup "
                    "(n-gram matching in the prompt and the generated text).",
        epilog=EXIT_STATUSES)
    gen.add_argument("prompt", metavar="PROMPT", help="the prompt text; '-' reads it from stdin")
    add_model_options(gen)
    spec = gen.add_argument_group("speculation")
    how = spec.add_mutually_exclusive_group()
    how.add_argument("--proposer", metavar="SPEC", type=proposer_spec, default=None,
                     help=f"the proposer: {FORMS}; default: prompt-lookup, with "
                          f"ngram={DEFAULT_NGRAM[0]}-{DEFAULT_NGRAM[1]} (docs/generate.md); "
                          "the flags below are shorthands for these")
    how.add_argument("--prompt-lookup", metavar="MIN-MAX", type=ngram_range, nargs="?",
                     const=DEFAULT_NGRAM, default=None,
                     help="draft by prompt lookup with n-grams of MIN..MAX tokens (MIN:MAX "
                          "works too): --proposer prompt-lookup:ngram=MIN-MAX")
    how.add_argument("--suffix", action="store_true",
                     help="draft the most frequent continuation of the longest earlier match "
                          "of the context's end, as long as it looks likely (SuffixDecoding): "
                          "--proposer suffix")
    how.add_argument("--draft-model", metavar="MODEL",
                     help="draft with a smaller model on the same tokenizer (name, folder or "
                          ".gguf): --proposer draft:MODEL")
    how.add_argument("--early-exit", type=positive_int, metavar="L",
                     help="self-draft with the target's first L layers, 1 ≤ L < its layer "
                          "count (shares its weights; transformers' assistant_early_exit; "
                          "transformers backend only): --proposer early-exit:L")
    how.add_argument("--no-speculation", action="store_true",
                     help="plain decoding on the same backend, for comparison: --proposer plain")
    spec.add_argument("-k", "--num-speculative-tokens", type=int, default=DEFAULT_K,
                      metavar="K", help=f"most tokens drafted per cycle (default {DEFAULT_K})")
    add_policy_option(spec)
    sampling = gen.add_argument_group("sampling")
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    sampling.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off, the default)")
    sampling.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (1 = off, the default)")
    sampling.add_argument("--min-p", type=float, default=0.0,
                          help="drop tokens below MIN_P × the top probability (0 = off, the default)")
    sampling.add_argument("--seed", type=seed, default=None, help="random seed (default: a fresh random one)")
    sampling.add_argument("--max-new-tokens", type=int, default=128,
                          help="most tokens to generate (default 128)")
    sampling.add_argument("--min-new-tokens", type=int, default=0,
                          help="suppress EOS, stop token ids and stop strings until this many "
                               "tokens were generated")
    sampling.add_argument("--stop", action="append", default=[], metavar="TEXT",
                          help="end generation at the token that completes TEXT (repeatable)")
    sampling.add_argument("--stop-token-id", action="append", type=int, default=[], metavar="ID",
                          help="end generation at this token id, besides EOS (repeatable; "
                               f"{CHECKED_AFTER_LOAD})")
    sampling.add_argument("--ignore-eos", action="store_true",
                          help="keep generating after the model's EOS token")
    sampling.add_argument("--repetition-penalty", type=float, default=1.0,
                          help="transformers' repetition penalty over prompt and output (1 = off)")
    sampling.add_argument("--presence-penalty", type=float, default=0.0,
                          help="OpenAI's presence penalty over the output, in [-2, 2]")
    sampling.add_argument("--frequency-penalty", type=float, default=0.0,
                          help="OpenAI's frequency penalty over the output, in [-2, 2]")
    sampling.add_argument("--logit-bias", action="append", type=logit_bias, default=[],
                          metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable; "
                                                  f"{CHECKED_AFTER_LOAD})")
    sampling.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                          help="never generate TEXT (repeatable)")
    sampling.add_argument("--ban-token-id", action="append", type=int, default=[], metavar="ID",
                          help=f"never generate token ID (repeatable; {CHECKED_AFTER_LOAD})")
    sampling.add_argument("-n", "--num-samples", type=int, default=1, metavar="N",
                          help="independent samples of the same prompt (sharing its prefill)")
    add_constraint_options(gen)
    out = gen.add_argument_group("output")
    out.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="wrap the prompt in the model's chat template (default: on when the "
                          "model has one)")
    out.add_argument("--json", action="store_true",
                     help="print one JSON object: text, token_ids, finish_reason, usage, "
                          "logprobs, every stats field, and with --trace every cycle under "
                          "'trace' (with -n > 1: a list under 'samples')")
    out.add_argument("--show", action="store_true",
                     help="print the output with each token marked by how it was committed: "
                          "accepted draft, recovered after a rejection, bonus token, plain step "
                          "(colours on a terminal, [ ] { } < > markers elsewhere), cycles "
                          "separated")
    out.add_argument("--trace", metavar="FILE.html", default=None,
                     help="write a self-contained page with every cycle: drafts, p, q, "
                          "min(1, p/q), the uniform drawn, verdicts, residuals, charts; and the "
                          "same data as JSON beside it (FILE.json); both are overwritten")
    out.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's logprob under the target's processed "
                          "distribution and the top N alternatives (0..20)")
    gen.set_defaults(subparser=gen)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.trace is not None:
        require("plots", "exactspec generate --trace")
    # PyTorch and the engine, imported here so that --help starts at once
    from exactspec.backends.base import UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import (LlamaCppNotInstalledError,
                                                      slow_decoding_warning)
    from exactspec.proposers.draft_model import DraftModelProposer
    from exactspec.sampling import SamplingParams
    from exactspec.trace.terminal import show

    try:
        constraint = constraint_from_args(args)
    except ValueError as error:
        parser.error(str(error))
    try:
        params = SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
            seed=args.seed, max_new_tokens=args.max_new_tokens, min_new_tokens=args.min_new_tokens,
            stop=tuple(args.stop), stop_token_ids=tuple(args.stop_token_id),
            ignore_eos=args.ignore_eos, repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
            logit_bias=dict(args.logit_bias), bad_words=tuple(args.bad_word),
            banned_token_ids=tuple(args.ban_token_id), logprobs=args.logprobs,
            constraint=constraint)
    except ValueError as error:
        message = str(error)
        for field, flag in FIELD_FLAGS.items():
            message = message.replace(f"SamplingParams.{field} ", f"{flag} ")
        parser.error(message.replace("SamplingParams.", "--").replace("_", "-"))
    if args.num_samples < 1:
        parser.error(f"-n {args.num_samples} is invalid: it must be ≥ 1")
    if args.num_speculative_tokens < 0:
        parser.error(f"-k {args.num_speculative_tokens} is invalid: it must be ≥ 0 "
                     "(0 = plain decoding)")
    if args.show and args.json:
        parser.error("--show and --json print the output two ways: choose one")
    if args.trace is not None:
        trace = Path(args.trace)
        if trace.suffix.lower() not in (".html", ".htm"):
            parser.error(f"--trace {args.trace} is invalid: give a file name ending in .html")
        if not trace.parent.is_dir():
            parser.error(f"--trace {args.trace} is invalid: the folder {str(trace.parent)!r} "
                         "does not exist (or is not a folder)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        parser.error("PROMPT is empty: give some text")

    console = Console(stderr=True, soft_wrap=True)
    proposer_spec, flag = _proposer_spec(args)
    if proposer_spec.kind == "forced" and constraint is None:
        parser.error(f"{flag} needs a constraint (it drafts only the tokens a "
                     "constraint forces): give --json-schema, --json-object, --regex, "
                     "--grammar or --choice")
    spec = speculation_spec(args, proposer_spec)
    try:  # what can be checked before the (slow) loading
        check_spec(spec, parser, flag)
    except (ModelNotFoundError, ValueError) as error:
        print_error(console, error)
        return 1
    if args.num_speculative_tokens == 0:
        proposer_spec = ProposerSpec("plain", "plain")
        spec = dataclasses.replace(spec, proposer=proposer_spec)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    logging.getLogger("exactspec").setLevel(logging.INFO)
    draft = next((part.model for part in proposer_spec.parts if part.model), None)
    try:
        with console.status(f"Loading {args.model}" + (f" and draft {draft}" if draft else "")
                            + " …"):
            speculation = spec.load()
        target, proposer = speculation.target, speculation.proposer
        method = proposer_spec.description + (
            f" ({proposer.description})" if isinstance(proposer, DraftModelProposer) else "")
        if proposer is not None and not target.batch_invariant and spec.allow_batch_variance:
            console.print(f"note: {target.description} is not batch-invariant: the output is "
                          "exact only up to rounding (near-tied tokens can flip)", highlight=False)
        chat = args.chat if args.chat is not None else speculation.chat_template
        results = speculation.generator().generate_samples(
            prompt, params, n=args.num_samples, chat=chat,
            trace=args.show or args.trace is not None)
    except (ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError,
            ValueError) as error:
        print_error(console, error)
        return 1

    if args.json:
        config = {"model": args.model, "backend": target.description, "method": method, "chat": chat,
                  "sampling_params": vars(params)}
        samples = [result.to_dict() for result in results]
        print(readable_json((samples[0] if len(samples) == 1 else {"samples": samples}) | config))
    stdout = Console(soft_wrap=True, highlight=False)
    for i, result in enumerate(results):
        if not args.json:
            if len(results) > 1:
                console.rule(f"sample {i + 1} of {len(results)}")
            if args.show:
                show(stdout, result.trace, target.tokenizer.decode)
            else:
                print(result.text, flush=True)
        finish = result.finish_reason
        if finish == "length" and (len(result.prompt_token_ids) + len(result.token_ids)
                                   == target.max_context_length):
            finish += f" (the context's {target.max_context_length} tokens are full)"
        parts = [result.stats.summary(), f"finish: {finish}",
                 *([method] if result.stats.num_speculative_tokens else []), target.description]
        console.print(" · ".join(parts), highlight=False, soft_wrap=True)
    if args.trace is not None:
        from exactspec.trace.page import write_trace  # the plots extra (matplotlib)

        try:
            page, data = write_trace(args.trace, results, target.tokenizer.decode, {
            "model": args.model, "backend": target.description, "method": method,
            "num_speculative_tokens": args.num_speculative_tokens, "policy": args.policy,
            "chat": chat, "prompt": prompt,
            "sampling": {k: v for k, v in vars(params).items() if v not in ((), {}, None)}})
        except OSError as error:
            console.print(f"[bold red]error:[/] --trace {escape(args.trace)}: could not write "
                          f"the trace: {escape(str(error))}", highlight=False)
            return 1
        console.print(f"trace: {page} (and {data.name})", highlight=False)
    warning = slow_decoding_warning(
        target, sum(r.stats.num_generated_tokens for r in results),
        sum(r.stats.total_seconds - r.stats.prefill_seconds for r in results))
    if warning:
        console.print(f"[bold yellow]warning:[/] {escape(warning)}", highlight=False)
    return 0


def _proposer_spec(args: argparse.Namespace) -> tuple[ProposerSpec, str]:
    """The proposer that ``--proposer`` or its shorthands name, and the flag that named it
    (for messages); prompt lookup when none is given."""
    if args.proposer is not None:
        return args.proposer, f"--proposer {args.proposer.spec}"
    if args.no_speculation:
        return ProposerSpec("plain", "plain"), "--no-speculation"
    if args.suffix:
        return parse_proposer("suffix"), "--suffix"
    if args.draft_model:
        return ProposerSpec(f"draft:{args.draft_model}", "draft",
                           model=args.draft_model), "--draft-model"
    if args.early_exit is not None:
        return ProposerSpec(f"early-exit:{args.early_exit}", "early-exit",
                           layers=args.early_exit), "--early-exit"
    low, high = args.prompt_lookup or DEFAULT_NGRAM
    return ProposerSpec(f"prompt-lookup:ngram={low}-{high}", "prompt-lookup",
                       (low, high)), "--prompt-lookup"
