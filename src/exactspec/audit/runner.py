"""The audit: greedy identity, the distribution test with Holm's correction, and the power
check on a broken control, ending in one verdict.

1. Greedy identity: the engine at temperature 0 against exactspec's plain decoding, token
   for token; the first divergence is reported with both tokens' logits.
2. Distribution test: per prompt, ``num_samples`` samples of the first m tokens against
   the exact reference (:mod:`exactspec.audit.reference`), G-test over bins fixed by the
   reference; p-values combined over prompts with Holm at ``alpha``.
3. Power check: the same test on a broken control (e.g. accept every draft) must reject;
   the smallest total-variation deviation each sample size detects is reported.
Verdict: ``exact`` only when nothing deviates, the control is caught and the engine
really drafted while sampling; ``NOT exact`` on any deviation; otherwise ``inconclusive``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exactspec.audit.engines import EngineUnderTest
from exactspec.audit.reference import OTHER, exact_reference
from exactspec.audit.stats import FitResult, detectable_tv, goodness_of_fit, holm, pool_bins
from exactspec.backends.base import Backend
from exactspec.engine import SpeculativeGenerator
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.sampling import SamplingParams

Progress = Callable[[int], None]
"""Called with the number of samples just drawn."""


@dataclass
class GreedyCheck:
    """Greedy identity for one prompt; on a divergence, where and how close it was."""

    prompt_index: int
    identical: bool
    num_tokens: int
    position: int | None = None
    plain_token: int | None = None
    engine_token: int | None = None
    plain_logit: float | None = None
    engine_logit: float | None = None


@dataclass
class PromptTest:
    """The distribution test of one engine on one prompt.

    Attributes:
        outcomes: ``[bins]`` the outcome bins, most probable first; a bin is a list of
            continuations (token-id tuples), ``[]`` standing for "every other continuation".
        exact: ``[bins]`` exact probability of each bin.
        counts: ``[bins]`` samples that fell in each bin.
        fit: the G-test and total-variation distance.
        detectable_tv: the smallest deviation this sample size detects with power 0.8.
        rejected: whether Holm's procedure rejects this prompt at the audit's alpha.
    """

    prompt_index: int
    outcomes: list[list[tuple[int, ...]]]
    exact: list[float]
    counts: list[int]
    fit: FitResult
    detectable_tv: float
    rejected: bool = False


@dataclass
class EngineTest:
    """Every prompt's distribution test of one engine, and how much it drafted while
    sampling them (None when the engine does not report it).

    Attributes:
        drafted, accepted: draft tokens proposed and accepted in this phase only.
        drafted_per_position, accepted_per_position: ``[k]`` the same per draft position
            (position i of a block, 0-based).
    """

    engine: str
    prompts: list[PromptTest]
    drafted: int | None
    accepted: int | None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None

    @property
    def rejected(self) -> bool:
        return any(p.rejected for p in self.prompts)


@dataclass
class AuditResult:
    """Everything the audit measured; ``verdict`` is ``exact``, ``NOT exact`` or
    ``inconclusive`` and ``reasons`` says why."""

    config: dict
    greedy: list[GreedyCheck]
    distribution: EngineTest
    control: EngineTest | None
    verdict: str = ""
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def check_greedy(target: Backend, engine: EngineUnderTest, prompts: Sequence[Sequence[int]],
                 num_tokens: int) -> list[GreedyCheck]:
    """Compare the engine's greedy output with plain decoding on ``target``."""
    plain = SpeculativeGenerator(target, None)
    params = SamplingParams(temperature=0.0, max_new_tokens=num_tokens)
    checks = []
    for index, prompt_ids in enumerate(prompts):
        expected = plain.generate(list(prompt_ids), params).token_ids
        got = list(engine.sample(prompt_ids, params, 1)[0])
        if got == expected:
            checks.append(GreedyCheck(index, True, len(expected)))
            continue
        position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                        min(len(expected), len(got)))
        check = GreedyCheck(index, False, len(expected), position)
        if position < min(len(expected), len(got)):
            context = list(prompt_ids) + expected[:position]
            target.prefill(context[:-1])
            logits = target.forward(context[-1:], num_logits=1)[0]
            check.plain_token, check.engine_token = expected[position], got[position]
            check.plain_logit = float(logits[check.plain_token])
            check.engine_logit = float(logits[check.engine_token])
        checks.append(check)
    return checks


def audit_distribution(target: Backend, engine: EngineUnderTest, prompts: Sequence[Sequence[int]],
                      params: SamplingParams, num_samples: int, alpha: float,
                      progress: Progress = lambda n: None, chunk: int = 50) -> EngineTest:
    """Sample ``num_samples`` continuations of ``params.max_new_tokens`` tokens per prompt
    from ``engine`` and test each prompt against the exact reference; Holm over prompts.
    The drafting counts are this phase's only.

    Seeds: chunk c of prompt i uses seed ``params.seed + 1000 * i + c``.
    """
    before = _speculation_counts(engine)
    tests = []
    for index, prompt_ids in enumerate(prompts):
        pipeline = LogitsPipeline(params, list(prompt_ids), target.vocab_size,
                                  target.eos_token_ids, [], target.device)
        reference = exact_reference(target, prompt_ids, pipeline, params.max_new_tokens,
                                    num_samples)
        counts: Counter = Counter()
        for c, start in enumerate(range(0, num_samples, chunk)):
            size = min(chunk, num_samples - start)
            seeded = dataclasses.replace(params, seed=(params.seed or 0) + 1000 * index + c)
            counts.update(reference.key(s) for s in engine.sample(prompt_ids, seeded, size))
            progress(size)
        tests.append(_fit(index, reference.outcomes, counts, num_samples, alpha, len(prompts)))
    for test, rejected in zip(tests, holm([t.fit.p_value for t in tests], alpha)):
        test.rejected = rejected
    after = _speculation_counts(engine)
    counts = [None if a is None else _minus(a, b) for a, b in zip(after, before)]
    return EngineTest(engine.name, tests, *counts)


def _speculation_counts(engine: EngineUnderTest) -> list:
    return [copy.copy(getattr(engine, name)) for name in
            ("drafted", "accepted", "drafted_per_position", "accepted_per_position")]


def _minus(after, before):
    """``after - before`` for counts or lists of counts."""
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before)]
    return after - before


def _fit(index: int, outcomes: dict, counts: Counter, num_samples: int, alpha: float,
         num_prompts: int) -> PromptTest:
    """Pool the reference's outcomes into bins and run the G-test."""
    keys = list(outcomes)
    bins = pool_bins([outcomes[k] for k in keys], num_samples)
    num_bins = int(bins.max()) + 1
    grouped: list[list[tuple[int, ...]]] = [[] for _ in range(num_bins)]
    exact, observed = [0.0] * num_bins, [0] * num_bins
    for key, b in zip(keys, bins):
        grouped[b].append(key)
        exact[b] += outcomes[key]
        observed[b] += counts.get(key, 0)
    fit = goodness_of_fit(observed, exact, seed=index)
    # Holm's first step compares the smallest p-value with alpha / number of prompts.
    detectable = detectable_tv(exact, num_samples, alpha / num_prompts)
    return PromptTest(index, [sorted(g, key=lambda k: k == OTHER) for g in grouped], exact,
                      observed, fit, detectable)


def verdict(result: AuditResult) -> AuditResult:
    """Fill ``result.verdict`` and ``result.reasons`` (see module docstring)."""
    deviations, doubts = [], []
    for check in result.greedy:
        if not check.identical:
            deviations.append(f"greedy output of prompt {check.prompt_index} differs from plain "
                              f"decoding at token {check.position}")
    for test in result.distribution.prompts:
        if test.rejected:
            deviations.append(f"prompt {test.prompt_index}: samples deviate from the exact "
                              f"distribution (p = {test.fit.p_value:.2e}, TV = {test.fit.tv:.3f})")
    if result.control is None:
        doubts.append("no broken control was run, so the test's power is unchecked")
    elif not result.control.rejected:
        doubts.append(f"the broken control ({result.control.engine}) was not caught: the sample "
                      "size is too small to trust a pass")
    drafted, samples = result.distribution.drafted, sum(
        p.fit.num_samples for p in result.distribution.prompts)
    if drafted is not None and drafted < samples:
        doubts.append(f"the engine drafted {drafted} tokens in {samples} samples: speculation was "
                      "barely exercised, so mostly plain decoding was tested (use --policy "
                      "constant, prompts the proposer can match, or another proposer)")
    result.reasons = deviations or doubts or [
        "no deviation found, the broken control was caught, and drafts were verified"
        if drafted is not None else "no deviation found and the broken control was caught "
        "(this engine does not report how much it drafted)"]
    result.verdict = "NOT exact" if deviations else "inconclusive" if doubts else "exact"
    return result
