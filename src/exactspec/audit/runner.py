"""The audit: greedy identity, the distribution test with Holm's correction, and the power
check on a broken control, ending in one verdict.

1. Greedy identity: the engine at temperature 0 against exactspec's plain decoding, token
   for token; the first divergence is reported with both tokens' logits.
2. Distribution test: per prompt, ``num_samples`` samples of the first m tokens; at each
   position, the next tokens drawn after each sampled prefix against the target's exact
   conditional (:mod:`exactspec.audit.reference`), chi-square tests summed per position
   (:mod:`exactspec.audit.stats`); Holm at ``alpha`` over every (prompt, position). A
   sampled continuation of probability 0 under the target fails at once.
3. Power check: the same test on a broken control (e.g. accept every draft) must reject;
   for each position the smallest mean deviation detected with power 0.8 in the least
   favourable direction is reported.
Verdict: ``exact`` only when nothing deviates, the control is caught and the engine
really drafted while sampling; ``NOT exact`` on any deviation; otherwise ``inconclusive``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exactspec.audit.reference import next_token_probs
from exactspec.audit.stats import Impossible, NodeFit, PositionFit, decide_family, fit_tree
from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.distributed import Executor, LocalExecutor, Missing
from exactspec.generator import SpeculativeGenerator
from exactspec.engines import Engine
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
    """The distribution test of one engine on one prompt: one test per position of the
    continuation (see :mod:`exactspec.audit.stats`).

    Attributes:
        prompt_index: which prompt.
        num_samples: continuations drawn.
        positions: ``[m]`` the per-position tests (Holm's decision in ``rejected``).
        impossible: continuations of probability 0 under the target (each one fails
            the audit).
        first: the first-token test (its bins, exact probabilities and counts: the plot).
    """

    prompt_index: int
    num_samples: int
    positions: list[PositionFit]
    impossible: list[Impossible]
    first: NodeFit | None

    @property
    def rejected(self) -> bool:
        return bool(self.impossible) or any(p.rejected for p in self.positions)


@dataclass
class EngineTest:
    """Every prompt's distribution test of one engine, and how much it drafted while
    sampling them (None when the engine does not report it).

    Attributes:
        drafted, accepted: draft tokens proposed and accepted in this phase only.
        drafted_per_position, accepted_per_position: ``[k]`` the same per draft position
            (position i of a block, 0-based).
        level: the level of Holm's first step (alpha / number of tests), at which the
            detectable deviations are stated.
    """

    engine: str
    prompts: list[PromptTest]
    drafted: int | None
    accepted: int | None
    drafted_per_position: list[int] | None = None
    accepted_per_position: list[int] | None = None
    level: float | None = None
    missing: list[str] = field(default_factory=list)

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
    missing: list[str] = field(default_factory=list)  # greedy checks not made (worker lost)
    verdict: str = ""
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class AuditSetup:
    """What an audit runs on, loaded once per process (with ``--ray``, once per worker).

    Attributes:
        target: the target model (the reference conditionals and plain decoding).
        engines: the engines tested, by role: ``engine`` and, when run, ``control``.
        prompt_ids: ``[prompts][tokens]`` the prompts, tokenised.
        params: the sampling parameters of the distribution test (seeded).
    """

    target: Backend
    engines: dict[str, Engine]
    prompt_ids: list[list[int]]
    params: SamplingParams


@dataclass
class SampledChunk:
    """One unit of the distribution test: ``samples`` of one prompt drawn with one seed,
    and the drafting counts of this unit alone (as :func:`_speculation_counts`)."""

    samples: list[tuple[int, ...]]
    counts: list


def check_greedy(target: Backend, engine: Engine, prompts: Sequence[Sequence[int]],
                 num_tokens: int) -> list[GreedyCheck]:
    """Compare the engine's greedy output with plain decoding on ``target``, here."""
    setup = AuditSetup(target, {"engine": engine}, [list(p) for p in prompts], SamplingParams())
    return run_greedy_checks(LocalExecutor(setup), len(prompts), num_tokens)[0]


def run_greedy_checks(executor: Executor, num_prompts: int, num_tokens: int
                      ) -> tuple[list[GreedyCheck], list[str]]:
    """Greedy identity of each prompt as units of work run by ``executor``
    (:mod:`exactspec.distributed`); returns the checks made, and which prompts could not
    be checked (their worker died twice), in words."""
    outcomes = executor.map(greedy_unit, [(index, num_tokens) for index in range(num_prompts)])
    return ([o for o in outcomes if not isinstance(o, Missing)],
            [f"greedy identity of prompt {o.unit[0]}: {o.reason}" for o in outcomes
             if isinstance(o, Missing)])


def greedy_unit(setup: AuditSetup, index: int, num_tokens: int) -> GreedyCheck:
    """Greedy identity of prompt ``index`` (a unit of work, :mod:`exactspec.distributed`)."""
    target, engine = setup.target, setup.engines["engine"]
    prompt_ids = setup.prompt_ids[index]
    plain = SpeculativeGenerator(target, None)
    params = SamplingParams(temperature=0.0, max_new_tokens=num_tokens)
    expected = plain.generate(list(prompt_ids), params).token_ids
    got = list(engine.sample(prompt_ids, params, 1)[0])
    if got == expected:
        return GreedyCheck(index, True, len(expected))
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                    min(len(expected), len(got)))
    check = GreedyCheck(index, False, len(expected), position)
    if position < min(len(expected), len(got)):
        context = list(prompt_ids) + expected[:position]
        sequence = new_sequence_id()
        try:
            target.prefill(sequence, context[:-1])
            logits = forward_one(target, sequence, context[-1:])[0]
        finally:
            target.release(sequence)
        check.plain_token, check.engine_token = expected[position], got[position]
        check.plain_logit = float(logits[check.plain_token])
        check.engine_logit = float(logits[check.engine_token])
    return check


def audit_distribution(target: Backend, engine: Engine, prompts: Sequence[Sequence[int]],
                       params: SamplingParams, num_samples: int, alpha: float,
                       progress: Progress = lambda n: None, chunk: int = 50, *,
                       executor: Executor | None = None, role: str = "engine") -> EngineTest:
    """Sample ``num_samples`` continuations of ``params.max_new_tokens`` tokens per prompt
    from ``engine`` and test each position of each prompt against the exact conditionals;
    Holm over every (prompt, position) test. The drafting counts are this phase's only.

    The work is split in units (:mod:`exactspec.distributed`): chunks of ``chunk`` samples,
    chunk c of prompt i seeded with ``params.seed + 1000 * i + c``, then one fit per prompt;
    ``executor`` runs them (default: here), on the engine of ``role`` in its state
    (:class:`AuditSetup`). Chunks whose worker died twice are named in ``missing``; the
    prompts are tested on the samples drawn.
    """
    executor = executor or LocalExecutor(AuditSetup(target, {role: engine},
                                                    [list(p) for p in prompts], params))
    units = [(role, index, c, min(chunk, num_samples - start))
             for index in range(len(prompts))
             for c, start in enumerate(range(0, num_samples, chunk))]
    chunks = executor.map(sample_unit, units, lambda i, result: progress(units[i][3]))
    samples: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    counts, missing = None, []
    for unit, outcome in zip(units, chunks):
        if isinstance(outcome, Missing):
            missing.append(f"{engine.name}: prompt {unit[1]}, samples {unit[2] * chunk}–"
                           f"{unit[2] * chunk + unit[3] - 1}: {outcome.reason}")
            continue
        samples[unit[1]] += outcome.samples
        counts = outcome.counts if counts is None else [
            None if a is None else _plus(a, b) for a, b in zip(counts, outcome.counts)]
    fits = executor.map(fit_unit, [(index, drawn) for index, drawn in enumerate(samples)
                                   if drawn])
    tests = []
    for fit in fits:
        if isinstance(fit, Missing):
            missing.append(f"{engine.name}: the test of prompt {fit.unit[0]}: {fit.reason}")
        else:
            tests.append(fit)
    level = decide(tests, alpha)
    counts = counts or [None] * 4
    return EngineTest(engine.name, tests, *counts, level=level, missing=missing)


def sample_unit(setup: AuditSetup, role: str, index: int, chunk: int, size: int
                ) -> SampledChunk:
    """``size`` samples of prompt ``index`` from the engine of ``role``, seeded for chunk
    ``chunk`` (a unit of work of :func:`audit_distribution`)."""
    engine = setup.engines[role]
    seeded = dataclasses.replace(setup.params, seed=(setup.params.seed or 0) + 1000 * index
                                 + chunk)
    before = _speculation_counts(engine)
    samples = engine.sample(setup.prompt_ids[index], seeded, size)
    after = _speculation_counts(engine)
    return SampledChunk(samples, [None if a is None else _minus(a, b)
                                  for a, b in zip(after, before)])


def fit_unit(setup: AuditSetup, index: int, samples: list[tuple[int, ...]]) -> PromptTest:
    """:func:`fit_prompt` of prompt ``index`` (a unit of work of :func:`audit_distribution`)."""
    return fit_prompt(setup.target, setup.prompt_ids[index], setup.params, samples, index)


def fit_prompt(target: Backend, prompt_ids: Sequence[int], params: SamplingParams,
               samples: Sequence[Sequence[int]], index: int = 0) -> PromptTest:
    """The per-position tests of one prompt's ``samples`` against the target's exact
    conditionals (undecided: :func:`decide` applies Holm)."""
    pipeline = LogitsPipeline(params, list(prompt_ids), target.vocab_size, target.eos_token_ids,
                              [], target.device)
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos
                                             else set(target.eos_token_ids))
    fit = fit_tree(samples, params.max_new_tokens, stop_ids,
                   lambda prefixes: next_token_probs(target, prompt_ids, pipeline, prefixes),
                   seed=index)
    return PromptTest(index, fit.num_samples, fit.positions, fit.impossible, fit.first)


def decide(tests: Sequence[PromptTest], alpha: float) -> float:
    """Holm at ``alpha`` over every position test of ``tests`` with something to test; fill
    each one's ``rejected`` and ``detectable_tv`` (at the level of Holm's first step,
    returned)."""
    return decide_family([p for test in tests for p in test.positions], alpha,
                         lambda position: position.num_tested)


def _speculation_counts(engine: Engine) -> list:
    return [copy.copy(getattr(engine, name)) for name in
            ("drafted", "accepted", "drafted_per_position", "accepted_per_position")]


def _minus(after, before):
    """``after - before`` for counts or lists of counts."""
    if isinstance(after, list):
        return [a - b for a, b in zip(after, before)]
    return after - before


def _plus(a, b):
    """``a + b`` for counts or lists of counts."""
    if isinstance(a, list):
        return [x + y for x, y in zip(a, b)]
    return a + b


def verdict(result: AuditResult, decode: Callable[[list[int]], str] | None = None) -> AuditResult:
    """Fill ``result.verdict`` and ``result.reasons`` (see module docstring); ``decode``
    (token ids → text) names impossible continuations in words."""
    deviations, doubts = [], []
    for check in result.greedy:
        if not check.identical:
            deviations.append(f"greedy output of prompt {check.prompt_index} differs from plain "
                              f"decoding at token {check.position}")
    for test in result.distribution.prompts:
        for impossible in test.impossible:
            deviations.append(f"prompt {test.prompt_index}: impossible continuation in "
                              f"{impossible.count} of {test.num_samples} samples: "
                              f"{describe_impossible(impossible, decode)}")
        for position in test.positions:
            if position.rejected:
                deviations.append(
                    f"prompt {test.prompt_index}, token {position.position}: the next-token "
                    f"distribution deviates from the target's (p-value {position.p_value:.2e}, "
                    f"mean TV = {position.tv:.3f})")
    missing = result.missing + result.distribution.missing + (
        result.control.missing if result.control else [])
    if missing:
        doubts.append(f"{len(missing)} part(s) of the audit were not run, so it tested less "
                      f"than asked: {'; '.join(missing)}")
    if result.control is None:
        doubts.append("no broken control was run, so the test's power is unchecked")
    elif not result.control.rejected:
        doubts.append(f"the broken control ({result.control.engine}) was not caught: the sample "
                      "size is too small to trust a pass")
    drafted = result.distribution.drafted
    samples = sum(p.num_samples for p in result.distribution.prompts)
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


def verdict_line(result: AuditResult, quick: bool = False) -> str:
    """The audit's outcome in one sentence a newcomer can act on: for ``exact``, the largest
    deviation (total variation) this run could have missed at some tested token, so a
    coarse run says it is coarse; otherwise the first reason."""
    if result.verdict != "exact":
        return f"verdict: {result.verdict}: {result.reasons[0]}"
    detectable = [p.detectable_tv for t in result.distribution.prompts for p in t.positions
                  if math.isfinite(p.detectable_tv)]
    if not detectable:
        return "verdict: exact (no position had enough samples to state a detectable deviation)"
    line = (f"verdict: exact at the power of this run: at every token tested, a deviation "
            f"above TV {max(detectable):.3f} from the target's distribution would have been "
            "caught (with probability 0.8)")
    if quick:
        line += "; --quick is coarse: raise --samples (e.g. 5000) for a statement near TV 0.05"
    return line


def describe_impossible(impossible: Impossible,
                        decode: Callable[[list[int]], str] | None = None) -> str:
    """E.g. ``after the prefix [12, 7] 'ab', token 3 'c': probability 0``, or ``at the
    first token, token 3 'c': probability 0``."""
    def show(token_ids) -> str:
        return f"{list(token_ids)}" + (f" {decode(list(token_ids))!r}" if decode else "")

    token = "" if impossible.token is None else f", token {impossible.token}" + (
        f" {decode([impossible.token])!r}" if decode else "")
    where = (f"after the prefix {show(impossible.prefix)}" if impossible.prefix
             else "at the first token")
    return f"{where}{token}: {impossible.reason}"
