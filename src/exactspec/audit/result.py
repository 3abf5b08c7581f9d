"""What an audit found, and its one verdict: :class:`AuditResult` for every audit (local,
against the target's exact probabilities; or over HTTP, against a second engine's samples
or a local copy of the served model), the thresholds the verdict applies, and the drafting
counts an engine reports.

**The verdict** (:func:`verdict`) is ``NOT exact`` on any deviation: a rejected test of the
distribution test (Holm over every prompt and position, :func:`~exactspec.audit.stats.decide`),
a sampled continuation of probability 0 under the target, or a greedy divergence from the
reference decoding (plain decoding, or B; against a local copy of the served model a
divergence only fails the :class:`ModelCheck`). It is ``inconclusive`` when the audit
could not vouch for its own power or coverage: no control, or a control not caught; the
engine drafting fewer than :data:`MIN_DRAFTED_PER_SAMPLE` tokens per sample; parts not run
(a lost worker), sampling interrupted, more than :data:`MAX_FAILED_SHARE` of the requests
failed, or a local model that is not the served one. Otherwise ``exact``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exactspec.audit.endpoint import Symbol
from exactspec.audit.stats import Impossible, decide
from exactspec.audit.two_sample import PowerEstimate
from exactspec.generation_stats import GenerationStats

MIN_DRAFTED_PER_SAMPLE = 1
"""Fewer draft tokens than this per sample, on average, while sampling: speculation was
barely exercised, mostly plain decoding was tested, and the verdict is inconclusive."""
MAX_FAILED_SHARE = 0.1
"""More failed requests than this share of those sent make the verdict inconclusive."""
LOGPROB_TOLERANCE = 0.1
"""Largest difference (nats) between the endpoint's and the local model's log-probability
of a greedy token for the local model to count as the served one."""

Describe = Callable[[Sequence[Symbol]], str]
"""Tokens (ids, or texts where an API gives no ids) → how reports show them, quoted."""


def describer(decode: Callable[[list[int]], str] | None = None) -> Describe:
    """How reports show tokens: the ``repr`` of ``decode(ids)`` where every token is an id
    and ``decode`` (token ids → text) is given, else each token's ``repr``, space-separated
    (texts, :data:`~exactspec.audit.endpoint.END`)."""
    def describe(tokens: Sequence[Symbol]) -> str:
        tokens = list(tokens)
        if decode is not None and all(isinstance(t, int) for t in tokens):
            return repr(decode(tokens))
        return " ".join(map(repr, tokens))
    return describe


@dataclass
class GreedyCheck:
    """Greedy identity of one prompt against plain decoding on the target (the local
    audit); on a divergence, where, and the target's logits of both tokens there.

    Attributes:
        num_tokens: tokens plain decoding produced.
        position: the first divergence (0-based), None when identical.
        plain_token, engine_token: each side's token there (None: one side ended first).
        plain_logit, engine_logit: the target's logits of those tokens after the common
            prefix.
    """

    prompt_index: int
    identical: bool
    num_tokens: int
    position: int | None = None
    plain_token: int | None = None
    engine_token: int | None = None
    plain_logit: float | None = None
    engine_logit: float | None = None
    error = None  # a local check has no failed request (a lost worker is in ``missing``)

    def deviation(self, describe: Describe | None = None) -> str:
        """The divergence as the verdict states it."""
        return (f"greedy output of prompt {self.prompt_index} differs from plain decoding at "
                f"token {self.position}")


@dataclass
class GreedyComparison:
    """Greedy decoding of one prompt by A and by B (or the local model), over HTTP.

    Attributes:
        identical: the same tokens.
        num_tokens_a, num_tokens_b: tokens each returned.
        position: the first divergence (0-based), None when identical.
        token_a, token_b: each side's token there (id or text).
        logprob_a, logprob_b: each side's log-probability (nats) of its own token there.
        a_logprob_of_b, b_logprob_of_a: each side's log-probability of the other's token,
            where its top alternatives list it (None: not listed, or no logprobs).
        error: why the comparison could not be made (a failed request).
    """

    prompt_index: int
    identical: bool
    num_tokens_a: int = 0
    num_tokens_b: int = 0
    position: int | None = None
    token_a: Symbol | None = None
    token_b: Symbol | None = None
    logprob_a: float | None = None
    logprob_b: float | None = None
    a_logprob_of_b: float | None = None
    b_logprob_of_a: float | None = None
    error: str | None = None

    def deviation(self, describe: Describe | None = None) -> str:
        """The divergence as the verdict states it, with both sides' tokens and logprobs."""
        show = lambda token: (describe or describer())([token])
        return (f"greedy output of prompt {self.prompt_index} differs at token {self.position}: "
                f"{show(self.token_a)} (logprob {number(self.logprob_a)}) vs "
                f"{show(self.token_b)} (logprob {number(self.logprob_b)})")


@dataclass
class ModelCheck:
    """Is the local model the served one? (the endpoint audit against exact probabilities)

    Attributes:
        first_tokens_equal: prompts whose first greedy token is the same on both.
        num_prompts: prompts checked.
        max_logprob_difference: the largest |endpoint − local| log-probability (nats) of a
            greedy token before the first divergence (None: the API gave no logprobs).
        passed: both agree (see :data:`LOGPROB_TOLERANCE`).
    """

    first_tokens_equal: int
    num_prompts: int
    max_logprob_difference: float | None
    passed: bool


@dataclass
class DistributionTest:
    """The distribution test of one engine on every prompt, against a reference: the
    target's exact probabilities (one-sample tests,
    :class:`~exactspec.audit.reference.PromptTest`) or a second engine's samples
    (two-sample tests, :class:`~exactspec.audit.two_sample.PromptComparison`); decided by
    :func:`~exactspec.audit.stats.decide`.

    Attributes:
        engine: the tested engine's name.
        prompts: ``[prompts]`` each prompt's tests (Holm's decisions filled in).
        reference: None for the target's exact probabilities, else the name of the engine
            whose samples are the reference (B).
        level: the level of Holm's first step (alpha / number of tests), at which the
            detectable deviations are stated.
        drafted, accepted: draft tokens proposed and accepted while sampling these
            prompts only (None: the engine does not report them).
        drafted_per_position, accepted_per_position: ``[k]`` the same per position of a
            drafted block (0-based), or None.
        missing: parts not run (chunks or tests whose worker died twice), in words.
    """

    engine: str
    prompts: list
    reference: str | None = None
    level: float | None = None
    drafted: int | None = None
    accepted: int | None = None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    missing: list[str] = field(default_factory=list)

    @property
    def rejected(self) -> bool:
        return any(p.rejected for p in self.prompts)

    @property
    def num_samples(self) -> int:
        """The tested engine's samples, over every prompt."""
        return sum(p.num_samples for p in self.prompts)


def distribution_test(engine: str, prompts: list, alpha: float,
                      drafting: GenerationStats | None = None, reference: str | None = None,
                      missing: Sequence[str] = ()) -> DistributionTest:
    """Decide ``prompts`` (each prompt's undecided tests) at family-wise level ``alpha``
    (:func:`~exactspec.audit.stats.decide`) and gather them with the engine's ``drafting``
    figures while sampling them (None: not reported; empty per-position counts: None)."""
    level = decide(prompts, alpha)
    if drafting is None:
        return DistributionTest(engine, prompts, reference, level, missing=list(missing))
    return DistributionTest(engine, prompts, reference, level, drafting.drafted_tokens,
                            drafting.accepted_tokens, drafting.drafted_per_position or None,
                            drafting.accepted_per_position or None, missing=list(missing))


@dataclass
class AuditResult:
    """Everything an audit measured; ``verdict`` (``exact``, ``NOT exact`` or
    ``inconclusive``) and ``reasons`` filled by :func:`verdict`.

    Attributes:
        mode: ``local`` (an engine here against the target's exact probabilities), or over
            HTTP: ``two-sample`` (A against B's samples), ``reference`` (A against a local
            copy's exact probabilities) or ``greedy`` (A against B at temperature 0 only).
        config: what was audited and how, as the report lists it.
        greedy: greedy identity per prompt (:class:`GreedyCheck` against plain decoding,
            :class:`GreedyComparison` over HTTP).
        distribution: the engine's distribution test (None: greedy mode).
        control: the same test of a control that must be caught (a broken verifier, or A
            with a shifted temperature), None when none was run.
        power: both two-sample tests' power on the control's subsamples (two-sample mode).
        model_check: whether the local model is the served one (reference mode).
        token_source: where an endpoint's tokens came from
            (:data:`~exactspec.audit.endpoint.TOKEN_SOURCES`).
        missing: greedy checks not made (their worker died twice), in words.
        failures: requests that failed after their retries (never counted as samples).
        requests: requests sent.
        samples_drawn, samples_asked: over every engine sampled (0: not counted, a local
            audit draws all it asks or names what is missing).
        interrupted: Ctrl-C stopped sampling; what was drawn was tested.
        samples: engine name → ``[prompt][sample]`` the samples drawn over HTTP, for
            ``samples.json`` (not in :meth:`to_dict`; None: not kept).
        describe: how reports show tokens (not in :meth:`to_dict`; None: by id).
    """

    config: dict
    greedy: list = field(default_factory=list)
    distribution: DistributionTest | None = None
    control: DistributionTest | None = None
    mode: str = "local"
    power: PowerEstimate | None = None
    model_check: ModelCheck | None = None
    token_source: str | None = None
    missing: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    requests: int = 0
    samples_drawn: int = 0
    samples_asked: int = 0
    interrupted: bool = False
    verdict: str = ""
    reasons: list[str] = field(default_factory=list)
    samples: dict | None = field(default=None, repr=False, compare=False)
    describe: Describe | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict:
        """Every number, as ``audit.json`` holds it (without the samples)."""
        return {f.name: _plain(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name not in ("samples", "describe")}


def _plain(value):
    """``value`` with its dataclasses as dicts (as :func:`dataclasses.asdict`)."""
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return copy.deepcopy(value)


def verdict(result: AuditResult, describe: Describe | None = None) -> AuditResult:
    """Fill ``result.verdict`` and ``result.reasons`` (see module docstring); ``describe``
    names tokens in words (default: impossible continuations by id, greedy tokens by
    ``repr``). Returns ``result``."""
    deviations, doubts = [], []
    if result.mode != "reference":  # there, greedy decoding checks the model (model_check)
        for check in result.greedy:
            if check.error is not None:
                doubts.append(f"greedy prompt {check.prompt_index}: the request failed: "
                              f"{check.error}")
            elif not check.identical:
                deviations.append(check.deviation(describe))
    if result.model_check is not None and not result.model_check.passed:
        check = result.model_check
        doubts.append(f"the local model does not match the served one: first greedy token equal "
                      f"on {check.first_tokens_equal} of {check.num_prompts} prompts, largest "
                      f"logprob difference {number(check.max_logprob_difference)} (tolerance "
                      f"{LOGPROB_TOLERANCE}): give --model the served model's weights")
    tested = result.distribution
    if tested is not None:
        against = "the target's" if tested.reference is None else "B's"
        for prompt in tested.prompts:
            for impossible in getattr(prompt, "impossible", ()):
                deviations.append(f"prompt {prompt.prompt_index}: impossible continuation in "
                                  f"{impossible.count} of {prompt.num_samples} samples: "
                                  f"{describe_impossible(impossible, describe)}")
            deviations += [f"prompt {prompt.prompt_index}, token {p.position}: the next-token "
                           f"distribution deviates from {against} (p-value {p.p_value:.2e}, "
                           f"mean TV {p.tv:.3f})" for p in prompt.positions if p.rejected]
            for joint in prompt.joint_tests:
                if joint.rejected:
                    deviations.append(f"prompt {prompt.prompt_index}: the MMD test (Hamming "
                                      f"kernel) finds A's and B's samples differ (p-value "
                                      f"{joint.p_value:.2e})")
    missing = result.missing + [m for test in (result.distribution, result.control)
                                if test is not None for m in test.missing]
    if missing:
        doubts.append(f"{len(missing)} part(s) of the audit were not run, so it tested less "
                      f"than asked: {'; '.join(missing)}")
    if tested is not None:
        if result.control is None:
            doubts.append("no control was run, so the test's power is unchecked")
        elif not result.control.rejected:
            doubts.append(f"the control ({result.control.engine}) was not caught: the sample "
                          "size is too small to trust a pass")
        if tested.drafted is not None and tested.drafted < (MIN_DRAFTED_PER_SAMPLE
                                                             * tested.num_samples):
            doubts.append(f"the engine drafted {tested.drafted} tokens in {tested.num_samples} "
                          "samples: speculation was barely exercised, so mostly plain decoding "
                          "was tested" + (" (use --policy constant, prompts the proposer can "
                                          "match, or another proposer)"
                                          if result.mode == "local" else ""))
    if result.interrupted:
        doubts.append(f"interrupted: {result.samples_drawn} of {result.samples_asked} samples "
                      "drawn and tested")
    if len(result.failures) > MAX_FAILED_SHARE * max(1, result.requests):
        doubts.append(f"{len(result.failures)} of {result.requests} requests failed (see the "
                      "failed requests)")
    if tested is None:
        done = f"greedy outputs identical on all {len(result.greedy)} prompts"
    else:
        done = ("no deviation found, the control was caught, and drafts were verified"
                if tested.drafted is not None else "no deviation found and the control was "
                "caught (this engine does not report how much it drafted)")
    result.reasons = deviations or doubts or [done]
    result.verdict = "NOT exact" if deviations else "inconclusive" if doubts else "exact"
    return result


def verdict_line(result: AuditResult, quick: bool = False) -> str:
    """The audit's outcome in one sentence a newcomer can act on: for ``exact``, the largest
    deviation (total variation) this run could have missed at some tested token, so a
    coarse run says it is coarse (``quick``: how to make it finer); otherwise the first
    reason."""
    if result.verdict != "exact" or result.distribution is None:
        return f"verdict: {result.verdict}: {result.reasons[0]}"
    detectable = [p.detectable_tv for t in result.distribution.prompts for p in t.positions
                  if math.isfinite(p.detectable_tv)]
    if not detectable:
        return "verdict: exact (no position had enough samples to state a detectable deviation)"
    line = (f"verdict: exact at the power of this run: at every token tested, a deviation "
            f"above TV {max(detectable):.3f} from the "
            + ("target's" if result.distribution.reference is None else "reference's")
            + " distribution would have been caught (with probability 0.8)")
    if quick:
        line += "; --quick is coarse: raise --samples (e.g. 5000) for a statement near TV 0.05"
    return line


def describe_impossible(impossible: Impossible, describe: Describe | None = None) -> str:
    """E.g. ``after the prefix [12, 7] 'ab', token 3 'c': probability 0``, or ``at the
    first token, token 3 'c': probability 0`` (the texts where ``describe`` is given)."""
    def show(token_ids) -> str:
        return f"{list(token_ids)}" + (f" {describe(list(token_ids))}" if describe else "")

    token = "" if impossible.token is None else f", token {impossible.token}" + (
        f" {describe([impossible.token])}" if describe else "")
    where = (f"after the prefix {show(impossible.prefix)}" if impossible.prefix
             else "at the first token")
    return f"{where}{token}: {impossible.reason}"


def number(value: float | None) -> str:
    """A figure to 3 decimals, ``–`` for none."""
    return "–" if value is None else f"{value:.3f}"


def draft_snapshot(engine) -> GenerationStats | None:
    """A copy of an engine's drafting figures so far (``Engine.draft_stats``; None where it
    reports none), for :func:`drafted_since`."""
    return None if engine.draft_stats is None else engine.draft_stats.copy()


def drafted_since(engine, snapshot: GenerationStats | None) -> GenerationStats | None:
    """The drafting figures ``engine`` added since ``snapshot`` (:func:`draft_snapshot`;
    None: since it began), None where it reports none."""
    if engine.draft_stats is None:
        return None
    return engine.draft_stats.since(snapshot or GenerationStats())
