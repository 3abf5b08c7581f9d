"""Pieces the ``exactspec`` subcommands share: model options and argument types.

Building a command's parser imports nothing that loads PyTorch (``exactspec COMMAND --help``
is immediate); :mod:`exactspec.models` is imported where a model is checked or loaded."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.markup import escape

from exactspec.distributed import RayExecutor, connect, default_workers
from exactspec.load_options import ACTIVATIONS, BACKENDS, KERNELS, default_threads
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS, WEIGHT_TYPES
from exactspec.proposers.spec import ProposerSpec, parse_ngram, parse_proposer
from exactspec.speculation_length import DEFAULT_K, DEFAULT_POLICY, POLICIES

EXIT_UNSTABLE = 3
"""``bench``'s exit status when its measurements look disturbed (and nothing failed)."""
EXIT_INTERRUPTED = 130
"""Exit status after Ctrl-C (128 + SIGINT, as shells report it)."""
EXIT_STATUSES = ("Exit status: 0 success; 1 an error (the message names it), a greedy "
                 "identity failure (bench) or an audit verdict other than 'exact'; 2 bad "
                 f"arguments; {EXIT_UNSTABLE} unstable measurements (bench); "
                 f"{EXIT_INTERRUPTED} interrupted (Ctrl-C).")


def ngram_range(text: str) -> tuple[int, int]:
    """``MIN-MAX`` or ``MIN:MAX`` → (min, max) n-gram sizes (see
    :func:`~exactspec.proposers.spec.parse_ngram`)."""
    try:
        return parse_ngram(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def proposer_spec(text: str):
    """A proposer spec (grammar in :mod:`exactspec.proposers.spec`) → its
    :class:`~exactspec.proposers.spec.ProposerSpec`."""
    try:
        return parse_proposer(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def logit_bias(text: str) -> tuple[int, float]:
    """``ID=BIAS`` → (token id, bias)."""
    try:
        token, bias = text.split("=")
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: give TOKEN_ID=BIAS, e.g. 1234=-100") from None


def add_model_options(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("models")
    model.add_argument("--model", default=DEFAULT_MODEL,
                       help="target model: an embedded model name "
                            f"({', '.join(EMBEDDED_MODELS)}; default {DEFAULT_MODEL}), a local "
                            "Hugging Face model folder, or a .gguf file")
    model.add_argument("--device", default="auto",
                       help="auto (the default: cuda if available), cpu, cuda, cuda:N")
    model.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="runtime: auto (the default: native for a .gguf model of a "
                            "Llama-family architecture on a CPU-only machine when no --dtype is "
                            "given and exactspec's kernels build; llama_cpp for other .gguf "
                            "models when llama-cpp-python is installed; else transformers), "
                            "native (exactspec's own kernels over the GGUF file's quantised "
                            "weights: the fastest plain step and nearly free verification), "
                            "transformers (PyTorch), llama_cpp "
                            "(needs a batch-invariant build: CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" "
                            "pip install --no-cache-dir 'exactspec[llama-cpp]')")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                       help="transformers backend only: weights' dtype (default float32)")
    model.add_argument("--kernels", default=None, choices=KERNELS,
                       help="transformers backend only: batch-invariant (the default: a token "
                            "scored in a verification block gets plain decoding's logits bit for "
                            "bit, so greedy output is identical and sampling uses exactly the "
                            "same probabilities; exactspec's kernels, compiled with the "
                            "machine's C compiler on first use, which read the weights once "
                            "for all tokens; without a compiler, off float32 or on a GPU, "
                            "PyTorch's on fixed 2-row blocks) or fast (PyTorch's own "
                            "kernels, faster on a CPU; identical only up to rounding, so "
                            "near-tied tokens can flip; implies --allow-batch-variance)")
    model.add_argument("--allow-batch-variance", action="store_true",
                       help="speculate even on a backend whose block logits differ from "
                            "single-token logits by rounding (the load-time check failed): the "
                            "output is then exact only up to that rounding")
    model.add_argument("--activations", default=None, choices=ACTIVATIONS,
                       help="native backend: the products' inputs over Q4_0, Q4_1 and Q8_0 "
                            "weights: int8 (the default: quantised per block of 32 with exact "
                            "integer dot products, as llama.cpp; the fastest) or float32 "
                            "(against the dequantised weights: the file's weights as written, "
                            "about 1.8x slower a step)")
    model.add_argument("--weight-type", default=None, choices=WEIGHT_TYPES, type=str.upper,
                       help="native and llama_cpp backends: run the GGUF file's weights converted to "
                            "this type (converted once, cached). Q8_0 makes each extra token "
                            "scored cheaper than Q4_1 at a plain step no slower, so "
                            "speculation gains (results/llama-weights-2026-12-01); F32 is the same weights unrounded; BF16, F16 and Q8_0 round "
                            "them, a model close to the file's (default: the file's own "
                            "weights, Q4_1 for the embedded model)")
    model.add_argument("--threads", type=positive_int, default=None,
                       help="CPU threads. llama_cpp: its threads (default: half the cores, "
                            f"here {default_threads()}); all cores are faster on an idle "
                            "machine, but collapse while another process "
                            "uses the CPU: then use at most the cores that are free. "
                            "transformers and native: the most a forward uses (default: PyTorch's, "
                            "the physical cores); each forward runs on either one thread or "
                            "exactly this many, whichever is measured faster, so a busy core "
                            "costs little")
    model.add_argument("--max-model-len", type=positive_int, default=None, metavar="TOKENS",
                       help="most tokens (prompt + generated) per request (default: the "
                            "model's context; on llama_cpp at most 8192). On llama_cpp this is "
                            "also the KV cache allocated per sequence (with batched decoding, "
                            "per batch row): a lower one takes less memory")


def seed(text: str) -> int:
    """A random seed: an integer in [0, 2**63)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: give an integer in [0, 2**63)")
    return value


def positive_int(text: str) -> int:
    """An integer ≥ 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: give an integer ≥ 1")
    return value


def model_spec(args: argparse.Namespace):
    """The :class:`~exactspec.models.ModelSpec` of ``--model`` and the model options."""
    from exactspec.models import ModelSpec

    return ModelSpec(args.model, backend=args.backend, device=args.device, dtype=args.dtype,
                     threads=args.threads, kernels=args.kernels,
                     max_model_len=args.max_model_len, weight_type=args.weight_type,
                     activations=args.activations)


def speculation_spec(args: argparse.Namespace, proposer: ProposerSpec | None = None):
    """The :class:`~exactspec.speculation.SpeculationSpec` of the model options,
    ``proposer`` (default ``--proposer``), ``-k``, ``--policy``, ``--max-batch-size`` and
    the batch-variance flags, where the command has them."""
    from exactspec.speculation import SpeculationSpec

    k = getattr(args, "num_speculative_tokens", DEFAULT_K)
    return SpeculationSpec(model_spec(args), proposer or args.proposer,
                           num_speculative_tokens=k, policy=getattr(args, "policy", DEFAULT_POLICY),
                           allow_batch_variance=allows_batch_variance(args),
                           max_batch_size=getattr(args, "max_batch_size", None))


def check_spec(spec, parser: argparse.ArgumentParser, flag: str) -> str:
    """:meth:`SpeculationSpec.check <exactspec.speculation.SpeculationSpec.check>` with the
    command line's names (``--model``, ``flag`` for the proposer); a value out of range
    exits through ``parser.error`` (status 2).

    Returns:
        the target's backend (``native``, ``transformers`` or ``llama_cpp``).
    Raises:
        ModelNotFoundError, ValueError: naming the flag and the bad value.
    """
    from exactspec.speculation import InvalidValueError

    try:
        return spec.check(model_flag="--model", proposer_flag=flag)
    except InvalidValueError as error:
        parser.error(str(error))


def allows_batch_variance(args: argparse.Namespace) -> bool:
    """Whether the user accepted rounding differences (``--allow-batch-variance``, or the
    fast kernels chosen explicitly)."""
    return args.allow_batch_variance or args.kernels == "fast"


def add_constraint_options(parser: argparse.ArgumentParser) -> None:
    """The structured-output flags (one of them): ``--json-schema``, ``--json-object``,
    ``--regex``, ``--grammar``, ``--choice`` (:func:`constraint_from_args` reads them)."""
    structured = parser.add_argument_group(
        "structured output (one of these; the output is masked to what it allows, exactly "
        "under speculation too; a complete output ends with EOS, one cut by "
        "--max-new-tokens says finish: length)")
    constraint = structured.add_mutually_exclusive_group()
    constraint.add_argument("--json-schema", metavar="FILE",
                            help="JSON valid against the JSON schema in FILE ('{}': any JSON)")
    constraint.add_argument("--json-object", action="store_true",
                            help="any JSON object (OpenAI's json_object)")
    constraint.add_argument("--regex", metavar="REGEX",
                            help="text matching REGEX whole (Rust regex syntax)")
    constraint.add_argument("--grammar", metavar="FILE",
                            help="text the Lark (or GBNF) grammar in FILE derives")
    constraint.add_argument("--choice", action="append", default=None, metavar="TEXT",
                            help="exactly one of the --choice texts (repeatable)")


def constraint_from_args(args: argparse.Namespace):
    """The structured-output flags' :class:`~exactspec.constraints.Constraint` (None:
    none given).

    Raises:
        ValueError: naming the flag: a file that cannot be read, a schema, regex or grammar
            that is not supported (the construct named).
    """
    from exactspec.constraints import Constraint

    if args.json_object:
        return Constraint.json_object()
    for flag, value, build, from_file in (
            ("--json-schema", args.json_schema, Constraint.json_schema, True),
            ("--regex", args.regex, Constraint.regex, False),
            ("--grammar", args.grammar, Constraint.grammar, True),
            ("--choice", args.choice, Constraint.choice, False)):
        if value is None:
            continue
        try:
            if from_file:
                try:
                    value = Path(value).read_text()
                except OSError as error:
                    raise ValueError(f"could not read {value!r}: {error.strerror}") from None
            return build(value)
        except ValueError as error:
            raise ValueError(f"{flag} is invalid: {error}") from None
    return None


def add_policy_option(group, default: str | None = None, why: str = "") -> None:
    """``--policy``: how many tokens to draft each cycle."""
    default = default or DEFAULT_POLICY
    group.add_argument("--policy", choices=POLICIES, default=default,
                       help=f"speculation length per cycle (default {default}{why}): auto (the k, up to -k, "
                            "that maximises expected tokens/s from measured forward costs and "
                            "acceptance; 0 = a plain step; a draft head also stops where its "
                            "draft's probability falls below the break-even one), constant "
                            "(always -k), heuristic (+2 after a fully accepted cycle, -1 "
                            "otherwise), confidence (draft models and heads stop below "
                            "probability 0.4). Never changes the output distribution")


def add_ray_options(parser: argparse.ArgumentParser, what: str, results: str) -> None:
    """``--ray [ADDRESS]`` and ``--workers N``: shard ``what`` over Ray workers; ``results``
    says how the results compare with a run without Ray."""
    group = parser.add_argument_group("Ray (the optional extra: pip install 'exactspec[ray]')")
    group.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                       help=f"shard the {what} over Ray workers, each loading the model once "
                            "(docs/distributed.md): alone, Ray's default ($RAY_ADDRESS, else "
                            "the cluster 'ray start' started here, else a new local instance "
                            "on this machine's cores); auto: the cluster this machine joined "
                            "with 'ray start'; HOST:6379: that cluster's head; "
                            f"ray://HOST:10001: a cluster through Ray Client. {results} The "
                            "workers must run the same exactspec code as this process "
                            "(checked). A worker that dies is restarted and its work retried "
                            "once; what is still missing is reported")
    group.add_argument("--workers", type=positive_int, default=None, metavar="N",
                       help="with --ray: Ray workers, each reserving --threads CPUs (default "
                            "1 under --ray) (default: as many as the cluster's CPUs hold)")


def check_ray_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse ``--workers`` without ``--ray``."""
    if args.workers is not None and args.ray is None:
        parser.error(f"--workers {args.workers} needs --ray (the workers are Ray's)")


def worker_args(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` as a Ray worker loads from them: picklable (no parser), ``--threads`` the
    CPUs Ray reserves for it (default 1)."""
    return argparse.Namespace(**{**{k: v for k, v in vars(args).items() if k != "subparser"},
                                 "threads": args.threads or 1})


def start_workers(args: argparse.Namespace, build, console):
    """The Ray workers of ``--ray``/``--workers``, each having run ``build()`` (loaded).

    Raises:
        RayNotInstalledError, ConnectionError, RuntimeError: see
            :mod:`exactspec.distributed`.
    """
    connect(args.ray or None)
    threads = args.threads or 1
    workers = args.workers or default_workers(threads)
    with console.status(f"Starting {workers} Ray worker{'s' if workers > 1 else ''} "
                        f"(each loads {args.model}) …"):
        return RayExecutor(build, workers, threads)


def print_error(console, error: Exception | str) -> None:
    """``error: MESSAGE`` in red on ``console``, the message as written (brackets such as
    ``exactspec[ray]`` or ``[1, 2]`` are text, not rich markup)."""
    console.print(f"[bold red]error:[/] {escape(str(error))}", highlight=False)
