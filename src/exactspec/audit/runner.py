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
The verdict, the same for every audit: :func:`exactspec.audit.result.verdict`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exactspec.audit.reference import ExactReference, PromptTest
from exactspec.audit.result import (DistributionTest, GreedyCheck, distribution_test,
                                    draft_snapshot, drafted_since)
from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.distributed import Executor, LocalExecutor, Missing
from exactspec.engines import Engine
from exactspec.generation_stats import GenerationStats
from exactspec.generator import SpeculativeGenerator
from exactspec.sampling import SamplingParams

Progress = Callable[[int], None]
"""Called with the number of samples just drawn."""


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
    and the engine's drafting figures for this unit alone (None: it reports none)."""

    samples: list[tuple[int, ...]]
    drafting: GenerationStats | None


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
                       executor: Executor | None = None, role: str = "engine"
                       ) -> DistributionTest:
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
    drafting, missing = None, []
    for unit, outcome in zip(units, chunks):
        if isinstance(outcome, Missing):
            missing.append(f"{engine.name}: prompt {unit[1]}, samples {unit[2] * chunk}–"
                           f"{unit[2] * chunk + unit[3] - 1}: {outcome.reason}")
            continue
        samples[unit[1]] += outcome.samples
        if outcome.drafting is not None:
            drafting = drafting or GenerationStats()
            drafting.add(outcome.drafting)
    fits = executor.map(fit_unit, [(index, drawn) for index, drawn in enumerate(samples)
                                   if drawn])
    tests = []
    for fit in fits:
        if isinstance(fit, Missing):
            missing.append(f"{engine.name}: the test of prompt {fit.unit[0]}: {fit.reason}")
        else:
            tests.append(fit)
    return distribution_test(engine.name, tests, alpha, drafting, missing=missing)


def sample_unit(setup: AuditSetup, role: str, index: int, chunk: int, size: int
                ) -> SampledChunk:
    """``size`` samples of prompt ``index`` from the engine of ``role``, seeded for chunk
    ``chunk`` (a unit of work of :func:`audit_distribution`)."""
    engine = setup.engines[role]
    seeded = dataclasses.replace(setup.params, seed=(setup.params.seed or 0) + 1000 * index
                                 + chunk)
    before = draft_snapshot(engine)
    samples = engine.sample(setup.prompt_ids[index], seeded, size)
    return SampledChunk(samples, drafted_since(engine, before))


def fit_unit(setup: AuditSetup, index: int, samples: list[tuple[int, ...]]) -> PromptTest:
    """The test of prompt ``index``'s samples against the exact probabilities (a unit of
    work of :func:`audit_distribution`)."""
    return ExactReference(setup.target, setup.prompt_ids, setup.params).test_prompt(index,
                                                                                   samples)
