"""The audit of engines reached over HTTP (``exactspec audit --endpoint``): does the
deployed engine, with speculation on, sample what it samples with it off?

Three modes, each ending in a verdict (``exact``, ``NOT exact``, ``inconclusive``):

- **two-sample** (no local model): the same prompts and sampling parameters sent to A
  (speculation on) and B (off: another deployment, another engine, or the same endpoint
  with a per-request switch in B's body); per prompt and position, A's and B's conditional
  next-token distributions compared (:mod:`exactspec.audit.two_sample`), Holm over
  prompts and positions; greedy identity of A against B on the same prompts.
- **reference**: A's samples against the exact probabilities of a local copy of the
  served model (the one-sample test of :mod:`exactspec.audit.runner`), after a check that
  the local model is the served one: the first greedy token of every prompt equal, and
  where the API gives logprobs, the chosen tokens' log-probabilities within
  :data:`LOGPROB_TOLERANCE` of the local ones.
- **greedy**: A against B at temperature 0, token for token, over many prompts; the first
  divergence of each is reported with both sides' log-probabilities of both tokens where
  the API gives them.

Every sampling run includes a control that must be caught: A with ``control_body``
(default: the temperature raised by a quarter) tested the same way; a control not caught
makes the verdict inconclusive. Samples of A, B and the control are drawn interleaved, a
chunk of each in turn, so that whatever drifts over the run drifts for all. Ctrl-C stops
sampling and tests what was drawn (the verdict is then inconclusive).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exactspec.audit.endpoint import (END, TOKEN_SOURCES, Completion, Endpoint, EndpointError,
                                      Symbol)
from exactspec.audit.runner import (EngineTest, decide as decide_reference, describe_impossible,
                                    fit_prompt)
from exactspec.audit.two_sample import (PowerEstimate, PromptComparison, compare_prompt,
                                        decide as decide_two_sample, max_draws_for)
from exactspec.sampling import SamplingParams

MODES = ("two-sample", "reference", "greedy")
LOGPROB_TOLERANCE = 0.1
"""Largest difference (nats) between the endpoint's and the local model's log-probability
of a greedy token for the local model to count as the served one."""
CHUNK = 50
"""Samples drawn from one engine before the next engine's turn."""

Progress = Callable[[int], None]


@dataclass
class GreedyComparison:
    """Greedy decoding of one prompt by A and by B (or the local model).

    Attributes:
        identical: the same tokens.
        num_tokens_a, num_tokens_b: tokens each returned.
        position: the first divergence (0-based), None when identical.
        token_a, token_b: each side's token there (id or text).
        logprob_a, logprob_b: each side's log-probability of its own token there.
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


@dataclass
class TwoSampleTest:
    """The two-sample tests of A against B on every prompt.

    Attributes:
        level: Holm's first-step level (the power's).
        drafted, accepted, drafted_per_position, accepted_per_position: A's drafting
            while sampling, from the responses (None: the engine does not say).
    """

    engine_a: str
    engine_b: str
    prompts: list[PromptComparison]
    level: float
    drafted: int | None = None
    accepted: int | None = None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None

    @property
    def rejected(self) -> bool:
        return any(p.rejected for p in self.prompts)


@dataclass
class ModelCheck:
    """Is the local model the served one? (reference mode)

    Attributes:
        first_tokens_equal: prompts whose first greedy token is the same on both.
        num_prompts: prompts checked.
        max_logprob_difference: the largest |endpoint − local| log-probability of a greedy
            token before the first divergence (None: the API gave no logprobs).
        passed: both agree (see :data:`LOGPROB_TOLERANCE`).
    """

    first_tokens_equal: int
    num_prompts: int
    max_logprob_difference: float | None
    passed: bool


@dataclass
class EndpointAudit:
    """Everything an endpoint audit measured; ``verdict`` and ``reasons`` as the local
    audit's (:class:`~exactspec.audit.runner.AuditResult`)."""

    mode: str
    config: dict
    greedy: list[GreedyComparison]
    two_sample: TwoSampleTest | None = None
    reference: EngineTest | None = None
    control: TwoSampleTest | EngineTest | None = None
    power: PowerEstimate | None = None
    model_check: ModelCheck | None = None
    token_source: str | None = None
    failures: list[str] = field(default_factory=list)
    requests: int = 0
    samples_drawn: int = 0
    samples_asked: int = 0
    interrupted: bool = False
    verdict: str = ""
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def control_name(self) -> str:
        control = self.control
        return control.engine_a if isinstance(control, TwoSampleTest) else control.engine


def draw_interleaved(engines: Sequence[Endpoint], prompts: Sequence[str | Sequence[int]],
                     params: SamplingParams, num_samples: Sequence[int], progress: Progress
                     ) -> tuple[list[list[list[tuple]]], bool]:
    """``num_samples[e]`` samples of every prompt from engine e, a chunk of :data:`CHUNK`
    from each in turn (an engine with fewer samples stops first); chunk c of prompt i seeded
    ``params.seed + 1000 i + c`` (each engine adds its ``seed_offset``).

    Returns:
        ``samples[engine][prompt]`` and whether Ctrl-C stopped the drawing (what was
        drawn before it is kept).
    """
    samples: list[list[list[tuple]]] = [[[] for _ in prompts] for _ in engines]
    try:
        for i, prompt in enumerate(prompts):
            for c, start in enumerate(range(0, max(num_samples), CHUNK)):
                seed = None if params.seed is None else params.seed + 1000 * i + c
                for e, engine in enumerate(engines):
                    size = min(CHUNK, num_samples[e] - start)
                    if size > 0:
                        samples[e][i] += engine.sample(
                            prompt, dataclasses.replace(params, seed=seed), size, progress)
    except KeyboardInterrupt:
        return samples, True
    return samples, False


def compare_greedy(a: Callable[[int], Completion], b: Callable[[int], Completion],
                   num_prompts: int, progress: Progress = lambda n: None
                   ) -> tuple[list[GreedyComparison], list[Completion | None],
                              list[Completion | None]]:
    """Greedy outputs of A and B (prompt index → its :class:`Completion`) token for token.

    Returns:
        the comparisons, and A's and B's completions (None where a request failed).
    Raises:
        EndpointError: a request was refused (the audit cannot go on).
    """
    comparisons, answers_a, answers_b = [], [], []
    for index in range(num_prompts):
        one = other = None
        try:
            one, other = a(index), b(index)
        except EndpointError as error:  # a failed request is reported, not fatal
            if error.refused:
                raise
            comparisons.append(GreedyComparison(index, False, error=str(error)))
        else:
            comparisons.append(greedy_comparison(index, one, other))
        answers_a.append(one)
        answers_b.append(other)
        progress(1)
    return comparisons, answers_a, answers_b


def greedy_comparison(index: int, a: Completion, b: Completion) -> GreedyComparison:
    """Where ``a`` and ``b`` first differ, with their log-probabilities there."""
    tokens_a = [t for t in a.tokens if t != END]
    tokens_b = [t for t in b.tokens if t != END]
    if tokens_a == tokens_b:
        return GreedyComparison(index, True, len(tokens_a), len(tokens_b))
    at = next((i for i, (x, y) in enumerate(zip(tokens_a, tokens_b)) if x != y),
              min(len(tokens_a), len(tokens_b)))
    comparison = GreedyComparison(index, False, len(tokens_a), len(tokens_b), at)
    if at < min(len(tokens_a), len(tokens_b)):
        comparison.token_a, comparison.token_b = tokens_a[at], tokens_b[at]
        comparison.logprob_a = _at(a.logprobs, at)
        comparison.logprob_b = _at(b.logprobs, at)
        comparison.a_logprob_of_b = _alternative(a, at, b)
        comparison.b_logprob_of_a = _alternative(b, at, a)
    return comparison


def _at(values: list | None, index: int):
    return values[index] if values is not None and index < len(values) else None


def _alternative(side: Completion, at: int, other: Completion) -> float | None:
    """``side``'s log-probability of ``other``'s token at ``at``, looked up by its text
    among ``side``'s top alternatives (None: not listed)."""
    top = _at(side.top_logprobs, at)
    text = _at(other.texts, at)
    return top.get(text) if top and text is not None else None


def local_greedy(target, prompt_ids: Sequence[Sequence[int]], params: SamplingParams,
                 top_logprobs: int = 5) -> Callable[[int], Completion]:
    """Plain greedy decoding of prompt i on the local ``target`` as a :class:`Completion`
    (ids, with logprobs and ``top_logprobs`` alternatives)."""
    from exactspec.generator import SpeculativeGenerator

    plain = SpeculativeGenerator(target, None)
    asked = dataclasses.replace(params, logprobs=top_logprobs)
    decode = target.tokenizer.decode

    def one(index: int) -> Completion:
        result = plain.generate(list(prompt_ids[index]), asked)
        tokens = tuple(result.token_ids) + ((END,) if result.finish_reason == "stop" else ())
        return Completion(tokens, result.text, result.finish_reason,
                          [lp.logprob for lp in result.logprobs],
                          [{decode([t]): v for t, v in lp.top} for lp in result.logprobs],
                          "local", [decode([t]) for t in result.token_ids])
    return one


def model_check(greedy: Sequence[GreedyComparison], endpoint: Sequence[Completion],
                local: Sequence[Completion]) -> ModelCheck:
    """Whether the local model is the served one (module docstring)."""
    first = sum(1 for c in greedy if c.error is None and (c.identical or c.position > 0))
    differences = []
    for comparison, e, lo in zip(greedy, endpoint, local):
        if e is None or lo is None or e.logprobs is None or lo.logprobs is None:
            continue
        upto = comparison.num_tokens_a if comparison.identical else comparison.position
        differences += [abs(x - y) for x, y in zip(e.logprobs[:upto], lo.logprobs[:upto])
                        if x is not None and y is not None]
    largest = max(differences) if differences else None
    passed = first == len(greedy) and (largest is None or largest <= LOGPROB_TOLERANCE)
    return ModelCheck(first, len(greedy), largest, passed)


def two_sample_test(a: Endpoint, b: Endpoint, samples_a: Sequence[Sequence[tuple]],
                    samples_b: Sequence[Sequence[tuple]], num_tokens: int, alpha: float,
                    seed: int, drafts_before: tuple | None = None) -> TwoSampleTest:
    """A's samples against B's, prompt by prompt, Holm over everything."""
    max_draws = max_draws_for(alpha, len(samples_a) * (num_tokens + 1))
    prompts = [compare_prompt(sa, sb, num_tokens, max_draws, i, seed)
               for i, (sa, sb) in enumerate(zip(samples_a, samples_b))]
    level = decide_two_sample(prompts, alpha)
    return TwoSampleTest(a.name, b.name, prompts, level, *drafting(a, drafts_before))


def reference_test(endpoint: Endpoint, target, prompt_ids: Sequence[Sequence[int]],
                   params: SamplingParams, samples: Sequence[Sequence[tuple]], alpha: float,
                   drafts_before: tuple | None = None) -> EngineTest:
    """The endpoint's samples against the local target's exact conditionals (the local
    audit's one-sample test); :data:`END` becomes the target's EOS where the sample does
    not end with one."""
    eos = set(target.eos_token_ids)
    tests = []
    for i, (ids, drawn) in enumerate(zip(prompt_ids, samples)):
        as_ids = []
        for sample in drawn:
            sample = list(sample)
            if sample and sample[-1] == END:
                sample.pop()
                if not sample or sample[-1] not in eos:
                    sample.append(target.eos_token_ids[0])
            as_ids.append(tuple(sample))
        tests.append(fit_prompt(target, ids, params, as_ids, i))
    level = decide_reference(tests, alpha)
    return EngineTest(endpoint.name, tests, *drafting(endpoint, drafts_before), level=level)


def drafting(endpoint: Endpoint, before: tuple | None) -> tuple:
    """The endpoint's (drafted, accepted, per position) since ``before``."""
    now = drafting_counts(endpoint)
    if before is None or now[0] is None:
        return now
    per = [[x - (y[i] if y and i < len(y) else 0) for i, x in enumerate(n)] if n else n
           for n, y in zip(now[2:], before[2:])]
    return (now[0] - (before[0] or 0), now[1] - (before[1] or 0), *per)


def drafting_counts(endpoint: Endpoint) -> tuple:
    return (endpoint.drafted, endpoint.accepted, list(endpoint.drafted_per_position or []) or None,
            list(endpoint.accepted_per_position or []) or None)


def verdict(result: EndpointAudit, describe_token: Callable[[Symbol], str] = repr
            ) -> EndpointAudit:
    """Fill ``verdict`` and ``reasons``: ``NOT exact`` on any deviation (a rejected test,
    an impossible continuation, a greedy divergence in two-sample or greedy mode);
    ``inconclusive`` when the control was not caught, the local model is not the served
    one, sampling was interrupted, drafting was barely exercised, or more than a tenth of
    the requests failed; else ``exact``."""
    deviations, doubts = [], []
    if result.mode != "reference":
        for c in result.greedy:
            if c.error is not None:
                doubts.append(f"greedy prompt {c.prompt_index}: the request failed: {c.error}")
            elif not c.identical:
                deviations.append(f"greedy output of prompt {c.prompt_index} differs at token "
                                  f"{c.position}: {describe_token(c.token_a)} "
                                  f"(logprob {_fmt(c.logprob_a)}) vs "
                                  f"{describe_token(c.token_b)} (logprob {_fmt(c.logprob_b)})")
    if result.model_check is not None and not result.model_check.passed:
        check = result.model_check
        doubts.append(f"the local model does not match the served one: first greedy token equal "
                      f"on {check.first_tokens_equal} of {check.num_prompts} prompts, largest "
                      f"logprob difference {_fmt(check.max_logprob_difference)} (tolerance "
                      f"{LOGPROB_TOLERANCE}): give --model the served model's weights")
    tested = result.two_sample or result.reference
    if result.two_sample is not None:
        samples = sum(prompt.num_a for prompt in result.two_sample.prompts)
        for prompt in result.two_sample.prompts:
            deviations += _rejected_positions(prompt.prompt_index, prompt.positions)
            if prompt.mmd.rejected:
                deviations.append(f"prompt {prompt.prompt_index}: the MMD test (Hamming kernel) "
                                  f"finds A's and B's samples differ (p-value "
                                  f"{prompt.mmd.p_value:.2e})")
    if result.reference is not None:
        samples = sum(prompt.num_samples for prompt in result.reference.prompts)
        for prompt in result.reference.prompts:
            deviations += [f"prompt {prompt.prompt_index}: impossible continuation in "
                           f"{impossible.count} samples: {describe_impossible(impossible)}"
                           for impossible in prompt.impossible]
            deviations += _rejected_positions(prompt.prompt_index, prompt.positions)
    if tested is not None:
        if result.control is None:
            doubts.append("no control was run, so the test's power is unchecked")
        elif not result.control.rejected:
            doubts.append(f"the control ({result.control_name()}) was not caught: the sample size "
                          "is too small to trust a pass")
        if tested.drafted is not None and tested.drafted < samples // 2:
            doubts.append(f"A drafted {tested.drafted} tokens in {samples} samples: speculation "
                          "was barely exercised")
    if result.interrupted:
        doubts.append(f"interrupted: {result.samples_drawn} of {result.samples_asked} samples "
                      "drawn and tested")
    if len(result.failures) * 10 > max(1, result.requests):
        doubts.append(f"{len(result.failures)} of {result.requests} requests failed (see the "
                      "failed requests)")
    done = {"two-sample": "A and B sample the same distribution at every tested token, greedy "
                          "outputs are identical, and the control was caught",
            "reference": "the endpoint samples the local model's exact distribution at every "
                         "tested token, and the control was caught",
            "greedy": f"greedy outputs identical on all {len(result.greedy)} prompts"}
    result.reasons = deviations or doubts or [done[result.mode]]
    result.verdict = "NOT exact" if deviations else "inconclusive" if doubts else "exact"
    return result


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"


def _rejected_positions(prompt_index: int, positions: Sequence) -> list[str]:
    """A deviation line for each rejected position test (one-sample or two-sample)."""
    return [f"prompt {prompt_index}, token {p.position}: the next-token distribution deviates "
            f"(p-value {p.p_value:.2e}, mean TV {p.tv:.3f})" for p in positions if p.rejected]


def verdict_line(result: EndpointAudit) -> str:
    """The outcome in one sentence, with the largest detectable TV for ``exact``."""
    if result.verdict != "exact":
        return f"verdict: {result.verdict}: {result.reasons[0]}"
    tested = result.two_sample or result.reference
    if tested is None:
        return f"verdict: exact: {result.reasons[0]}"
    detectable = [p.detectable_tv for t in tested.prompts for p in t.positions
                  if math.isfinite(p.detectable_tv)]
    if not detectable:
        return "verdict: exact (no position had enough samples to state a detectable deviation)"
    return (f"verdict: exact at the power of this run: at every token tested, a deviation above "
            f"TV {max(detectable):.3f} would have been caught (with probability 0.8)")


__all__ = ["EndpointAudit", "GreedyComparison", "MODES", "ModelCheck", "TOKEN_SOURCES",
           "TwoSampleTest", "compare_greedy", "draw_interleaved", "model_check",
           "reference_test", "two_sample_test", "verdict", "verdict_line"]
