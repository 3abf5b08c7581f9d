"""The audit as one call: :func:`run` takes an :class:`AuditSpec` (what to audit, how hard)
and returns the :class:`~exactspec.audit.result.AuditResult`, verdict filled in, which
:func:`~exactspec.audit.report.write_report` writes out. ``exactspec audit`` maps its flags
to a spec and prints.

Two ways to sample, one result:

- **local** (:attr:`AuditSpec.setup`, a :class:`~exactspec.speculation.SpeculationSpec`):
  the engine and its broken control, loaded by :func:`audit_setup`, run here (or on Ray
  workers, :attr:`AuditSpec.executor`); greedy identity against plain decoding, then
  each engine's samples against the target's exact probabilities
  (:mod:`exactspec.audit.runner`).
- **over HTTP** (:attr:`AuditSpec.endpoint`): A (speculation on), B (off) and a control
  reached through their APIs, sampled interleaved (:mod:`exactspec.audit.remote`); A's
  samples against B's (two-sample) or against a local copy's exact probabilities
  (reference), or greedy identity alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from exactspec.extras import require

require("audit", "exactspec.audit")

from exactspec.audit.modes import (BROKEN, CONSTRAINT_CONTROL, ENGINES, MODES,  # noqa: E402
                                   PEERS)  # (after the check)
from exactspec.audit.endpoint import TRANSLATED, Endpoint  # noqa: E402
from exactspec.audit.reference import ExactReference, SampledReference  # noqa: E402
from exactspec.audit.remote import (compare_greedy, draw_interleaved, local_greedy,
                                    model_check)
from exactspec.audit.result import (AuditResult, DistributionTest, describer, distribution_test,
                                    draft_snapshot, drafted_since, verdict)
from exactspec.audit.runner import AuditSetup, audit_distribution, run_greedy_checks
from exactspec.audit.two_sample import subsample_power
from exactspec.distributed import Executor, LocalExecutor
from exactspec.request import prompt_tokens
from exactspec.sampling import SamplingParams
from exactspec.speculation import SpeculationSettings, SpeculationSpec


class Progress(Protocol):
    """Where :func:`run` reports progress: :class:`rich.progress.Progress`'s methods
    (e.g. :class:`~exactspec.progress.LoggedProgress`)."""

    def add_task(self, description: str, total: float | None = ...) -> int: ...

    def advance(self, task_id: int, advance: float = 1) -> None: ...

    def remove_task(self, task_id: int) -> None: ...


@dataclass
class EndpointSpec:
    """The engines of an audit over HTTP (:class:`~exactspec.audit.endpoint.Endpoint`).

    Attributes:
        url: A's base URL (speculation on).
        mode: one of :data:`~exactspec.audit.modes.MODES`.
        model: the model's name in A's API (None: the first of ``GET /models``).
        against: B's base URL (None: ``url``, with ``against_body``; not used in reference
            mode).
        against_model: the model's name in B's API (None: A's when B is A's server, else
            the first of B's ``GET /models``).
        extra_body: fields added to every request body (A, B and the control).
        against_body: fields added to B's requests (the switch that turns speculation off).
        control_body: fields of the control, A with a known deviation (None: the
            temperature raised by a quarter).
        control_samples: samples per prompt of the control (None: the audit's).
        api_key, concurrency, samples_per_request, timeout, retries, ask_token_ids,
        ask_logprobs: as :class:`~exactspec.audit.endpoint.Endpoint`'s (``retries``:
            its ``max_retries``; ``api_key`` None: ``$OPENAI_API_KEY``).
        local_model: how the report names the local model (None: none).
        load_target: loads the local copy of the served model (needed in reference mode,
            and to re-tokenise the text of APIs giving neither ids nor logprobs).
        http_client: the ``httpx.Client`` requests go through (tests: a mock transport).
    """

    url: str
    mode: str = "two-sample"
    model: str | None = None
    against: str | None = None
    against_model: str | None = None
    extra_body: dict = field(default_factory=dict)
    against_body: dict | None = None
    control_body: dict | None = None
    control_samples: int | None = None
    api_key: str | None = None
    concurrency: int = 4
    samples_per_request: int = 1
    timeout: float = 120.0
    retries: int = 3
    ask_token_ids: bool = True
    ask_logprobs: bool = True
    local_model: str | None = None
    load_target: Callable[[], object] | None = None
    http_client: object | None = None


@dataclass
class AuditSpec:
    """What an audit tests and how hard; give exactly one of ``setup`` and ``endpoint``.

    Attributes:
        prompts: the prompts' texts.
        params: the distribution test's sampling parameters (seeded for a reproducible
            audit; ``max_new_tokens`` is m, the tokens per sample and positions tested).
        samples: samples per prompt (≥ 1).
        alpha: the family-wise false-alarm rate of the whole audit, in (0, 1).
        greedy_tokens: tokens per prompt of the greedy identity check (0: skipped; over
            HTTP in greedy mode, at least 1).
        chat: the prompts are chat messages (the chat template locally, one user message
            to ``/chat/completions`` over HTTP).
        prompt_names: how the report lists the prompts (None: the prompts themselves).
        config: what the report lists about the audited setup beside what the spec holds
            (model, proposer, k ...), first.
        setup: what a local audit tests: the target, proposer, k, policy and batching
            (:func:`audit_setup` loads it).
        engine: who runs ``setup`` in a local audit: ``exactspec`` or a peer
            (:data:`ENGINES`: transformers' or llama-cpp-python's own assisted generation).
        broken: a local audit's broken control (:data:`BROKEN`; exactspec only).
        executor: makes the executor of a local audit's units from the loaded
            :class:`~exactspec.audit.runner.AuditSetup` (None: here,
            :class:`~exactspec.distributed.LocalExecutor`); closed at the end when it has
            ``close``.
        endpoint: the engines of an audit over HTTP.
    """

    prompts: Sequence[str]
    params: SamplingParams
    samples: int = 1000
    alpha: float = 0.01
    greedy_tokens: int = 64
    chat: bool = False
    prompt_names: Sequence[str] | None = None
    config: dict = field(default_factory=dict)
    setup: SpeculationSpec | None = None
    engine: str = "exactspec"
    broken: str = "accept-all"
    executor: Callable[[AuditSetup], Executor] | None = None
    endpoint: EndpointSpec | None = None


class _Quiet:
    """No progress shown."""

    def add_task(self, description, total=None):
        return 0

    def advance(self, task_id, advance=1):
        pass

    def remove_task(self, task_id):
        pass


def run(spec: AuditSpec, progress: Progress | None = None) -> AuditResult:
    """Run the audit ``spec`` describes and return its result, verdict and reasons filled
    in (:func:`~exactspec.audit.result.verdict`), with the samples drawn over HTTP and how
    to show tokens for :func:`~exactspec.audit.report.write_report`.

    Raises:
        ValueError: for a spec that is not one audit (both or neither of ``setup`` and
            ``endpoint``, sizes out of range, an unknown mode), or parameters an engine
            cannot honour.
        EndpointError: an endpoint refused a request or could not be reached.
        ModelNotFoundError, UnsupportedModelError, ...: as loading the models does.
    """
    if (spec.setup is None) == (spec.endpoint is None):
        raise ValueError("an audit spec needs exactly one of setup (a local audit) and "
                         "endpoint (an audit over HTTP)")
    if spec.samples < 1 or spec.greedy_tokens < 0 or not 0 < spec.alpha < 1:
        raise ValueError(f"samples {spec.samples} must be ≥ 1, greedy tokens "
                         f"{spec.greedy_tokens} ≥ 0 and alpha {spec.alpha} in (0, 1)")
    progress = progress or _Quiet()
    if spec.setup is not None:
        return _run_local(spec, progress)
    return _run_endpoint(spec, progress)


def _common_config(spec: AuditSpec) -> dict:
    return {"tokens_per_sample": spec.params.max_new_tokens, "alpha": spec.alpha,
            "greedy_tokens": spec.greedy_tokens, "chat": spec.chat}


def audit_setup(spec: AuditSpec) -> AuditSetup:
    """Load what a local audit runs on (:class:`~exactspec.audit.runner.AuditSetup`): the
    target of ``spec.setup``, the engine and the broken control, the prompts tokenised.
    With Ray each worker runs this once, in its own process.

    Raises:
        ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError, ValueError:
            as loading the models and proposer does; ValueError for an unknown engine or
            control, or a peer that cannot run the proposer.
    """
    from exactspec.audit.broken import BrokenGenerator, ConstraintControl
    from exactspec.engines import BatchedEngine, ExactspecEngine

    if spec.engine not in ENGINES or spec.broken not in BROKEN:
        raise ValueError(f"engine {spec.engine!r} or control {spec.broken!r} is invalid: "
                         f"choose from {', '.join(ENGINES)} and {', '.join(BROKEN)}")
    speculation = spec.setup.load()
    proposer_spec, settings = spec.setup.proposer, spec.setup.settings
    k, batch = spec.setup.num_speculative_tokens, spec.setup.max_batch_size
    described = f"{proposer_spec.spec} k={k}"

    def as_engine(generator, name):
        if not batch:
            return ExactspecEngine(generator, name)
        return BatchedEngine(speculation.batched_generator(batch, generator),
                             f"{name}, batched ×{batch}")

    if spec.engine == "exactspec":
        engine = as_engine(speculation.generator(),
                           f"exactspec {described} {settings.policy}")
    else:
        engine = speculation.peer(dataclasses.replace(proposer_spec, peer=PEERS[spec.engine]),
                                  k)
        engine.name = f"{engine.label} {described}"
    engines = {"engine": engine}
    control = f"broken control: {spec.broken}, {described}"
    constant = SpeculationSettings(k, "constant")
    if spec.broken == CONSTRAINT_CONTROL and speculation.proposer is not None:
        engines["control"] = ConstraintControl(as_engine(speculation.generator(constant),
                                                         control), control)
    elif spec.broken != "none" and speculation.proposer is not None:
        engines["control"] = as_engine(speculation.generator(
            constant, factory=functools.partial(BrokenGenerator, broken=spec.broken)), control)
    return AuditSetup(speculation.target, engines,
                      [speculation.prompt_ids(p, spec.chat) for p in spec.prompts], spec.params)


def _run_local(spec: AuditSpec, progress: Progress) -> AuditResult:
    task = progress.add_task(f"loading {spec.config.get('model', 'the models')} …", total=None)
    setup = audit_setup(spec)
    progress.remove_task(task)
    executor = spec.executor(setup) if spec.executor is not None else LocalExecutor(setup)
    try:
        engine, control = setup.engines["engine"], setup.engines.get("control")
        target = setup.target
        config = ({"model": spec.config.get("model"), "backend": target.description,
                   "engine": engine.name} | spec.config
                  | {"sampling": vars(setup.params), "samples_per_prompt": spec.samples}
                  | _common_config(spec)
                  | {"prompts": list(spec.prompt_names or spec.prompts)})
        start = time.perf_counter()
        greedy, missing = [], []
        if spec.greedy_tokens:
            task = progress.add_task("greedy identity", total=len(setup.prompt_ids))
            greedy, missing = run_greedy_checks(executor, len(setup.prompt_ids),
                                                spec.greedy_tokens)
            progress.remove_task(task)
        tests = []
        for role, tested in [("engine", engine)] + ([("control", control)] if control else []):
            task = progress.add_task(tested.name[:60], total=spec.samples * len(setup.prompt_ids))
            tests.append(audit_distribution(target, tested, setup.prompt_ids, setup.params,
                                            spec.samples, spec.alpha,
                                            lambda n, task=task: progress.advance(task, n),
                                            executor=executor, role=role))
        config["seconds"] = round(time.perf_counter() - start, 1)
        config["ran_on"] = executor.description
    finally:
        if hasattr(executor, "close"):
            executor.close()
    describe = describer(target.tokenizer.decode)
    result = AuditResult(config, greedy, tests[0], tests[1] if control else None,
                         missing=missing, describe=describe)
    return verdict(result, describe)


def _run_endpoint(spec: AuditSpec, progress: Progress) -> AuditResult:
    options, params, prompts = spec.endpoint, spec.params, list(spec.prompts)
    mode = options.mode
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is unknown: choose one of {', '.join(MODES)}")
    if options.against is None and options.against_body is None and mode != "reference":
        raise ValueError("B is missing: give against (the model with speculation off) or "
                         "against_body (the engine's per-request switch)")
    target = tokenizer = None
    if mode == "reference" or not options.ask_logprobs:
        if options.load_target is None:
            raise ValueError(f"{'reference mode' if mode == 'reference' else 'sampling without logprobs'} "
                             "needs a local copy of the served model (load_target)")
        task = progress.add_task(f"loading {options.local_model or 'the local model'} …",
                                 total=None)
        target = options.load_target()
        progress.remove_task(task)
        tokenizer = target.tokenizer
    common = dict(api_key=options.api_key or os.environ.get("OPENAI_API_KEY"),
                  chat=spec.chat, concurrency=options.concurrency, timeout=options.timeout,
                  max_retries=options.retries, samples_per_request=options.samples_per_request,
                  ask_token_ids=options.ask_token_ids, ask_logprobs=options.ask_logprobs,
                  tokenizer_encode=None if tokenizer is None else tokenizer.encode,
                  ids_only=mode == "reference", http_client=options.http_client)
    extra = dict(options.extra_body)
    a = Endpoint(options.url, model=options.model, extra_body=extra, name=f"A {options.url}",
                 **common)
    b = None
    if mode != "reference":
        b = Endpoint(options.against or options.url,
                     model=options.against_model or (None if options.against else a.model),
                     extra_body=extra | (options.against_body or {}),
                     name=f"B {options.against or options.url}"
                          + (f" {json.dumps(options.against_body)}" if options.against_body
                             else ""), seed_offset=1 << 29, **common)
    control_body = options.control_body or {"temperature": round(params.temperature * 1.25, 4)}
    control = Endpoint(options.url, model=a.model, extra_body=extra | control_body,
                       name=f"control: A with {json.dumps(control_body)}",
                       seed_offset=2 << 29, **common)
    prompt_ids = None
    if mode == "reference":
        prompt_ids = [prompt_tokens(target, p, spec.chat) for p in prompts]
    control_samples = options.control_samples or spec.samples
    config = {"mode": mode, "A": a.url, "A_model": a.model,
              "B": None if b is None else b.name.removeprefix("B "),
              "control": control.name.removeprefix("control: "), "extra_body": options.extra_body,
              "sampling (sent)": {name: getattr(params, name) for name in TRANSLATED},
              "samples_per_prompt": spec.samples,
              "control_samples_per_prompt": control_samples} | _common_config(spec) | {
              "concurrency": options.concurrency,
              "samples_per_request": options.samples_per_request,
              "local_model": options.local_model if tokenizer is not None else None,
              "prompts": list(spec.prompt_names or prompts)}
    describe = describer(None if tokenizer is None else tokenizer.decode)
    result = AuditResult(config, mode=mode, describe=describe)
    samples: list = []
    start = time.perf_counter()
    tokens = spec.greedy_tokens if mode != "greedy" else max(spec.greedy_tokens, 1)
    if tokens:
        task = progress.add_task("greedy", total=len(prompts))
        greedy_params = dataclasses.replace(params, temperature=0.0, top_p=1.0, top_k=0,
                                            min_p=0.0, seed=None, max_new_tokens=tokens)

        def ask(endpoint):
            return lambda i: endpoint.complete(prompts[i], greedy_params, top_logprobs=5)[0]

        other = ask(b) if b is not None else local_greedy(target, prompt_ids, greedy_params)
        result.greedy, answers, references = compare_greedy(
            ask(a), other, len(prompts), lambda n: progress.advance(task, n))
        progress.remove_task(task)
        if mode == "reference":
            result.model_check = model_check(result.greedy, answers, references)
    if mode != "greedy":
        engines = [a, b, control] if b is not None else [a, control]
        sizes = [spec.samples] * (len(engines) - 1) + [control_samples]
        result.samples_asked = sum(sizes) * len(prompts)
        task = progress.add_task("sampling " + ", ".join(
            ["A", "B", "control"] if b is not None else ["A", "control"]),
                                 total=result.samples_asked)
        before = draft_snapshot(a)
        samples, result.interrupted = draw_interleaved(
            engines, prompts, params, sizes, lambda n: progress.advance(task, n))
        drafted = drafted_since(a, before)
        result.samples_drawn = sum(len(s) for per in samples for s in per)
        progress.remove_task(task)
        task = progress.add_task("testing", total=None)
        if b is not None:
            reference = SampledReference(b.name, samples[1], params.max_new_tokens, spec.alpha,
                                         params.seed or 0)
            result.distribution = _test(a, reference, samples[0], spec.alpha, drafted)
            result.control = _test(control, reference, samples[2], spec.alpha,
                                   drafted_since(control, None))
            result.power = subsample_power(samples[2][0], samples[1][0], params.max_new_tokens,
                                           spec.alpha, seed=params.seed or 0)
        else:
            reference = ExactReference(target, prompt_ids, params)
            result.distribution = _test(a, reference, samples[0], spec.alpha, drafted)
            result.control = _test(control, reference, samples[1], spec.alpha,
                                   drafted_since(control, None))
        progress.remove_task(task)
    config["seconds"] = round(time.perf_counter() - start, 1)
    result.token_source = a.token_source
    sampled = [e for e in (a, b, control) if e is not None]
    result.failures = [f"{e.name}: {f}" for e in sampled for f in e.failures]
    result.requests = sum(e.requests for e in sampled)
    result.samples = {e.name: per_prompt for e, per_prompt in zip(sampled, samples)}
    return verdict(result, describe)


def _test(engine: Endpoint, reference, samples: Sequence[Sequence[tuple]], alpha: float,
          counts: tuple) -> DistributionTest:
    """``engine``'s samples of every prompt against ``reference``, decided at ``alpha``."""
    return distribution_test(engine.name, [reference.test_prompt(i, drawn)
                                           for i, drawn in enumerate(samples)],
                             alpha, counts, reference.name)
