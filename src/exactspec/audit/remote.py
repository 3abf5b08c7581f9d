"""The audit of engines reached over HTTP (``exactspec audit --endpoint``): does the
deployed engine, with speculation on, sample what it samples with it off?

Three modes, each ending in a verdict (``exact``, ``NOT exact``, ``inconclusive``):

- **two-sample** (no local model): the same prompts and sampling parameters sent to A
  (speculation on) and B (off: another deployment, another engine, or the same endpoint
  with a per-request switch in B's body); per prompt and position, A's and B's conditional
  next-token distributions compared (:mod:`exactspec.audit.two_sample`), Holm over
  prompts and positions; greedy identity of A against B on the same prompts.
- **reference**: A's samples against the exact probabilities of a local copy of the
  served model (the local audit's one-sample test,
  :class:`~exactspec.audit.reference.ExactReference`), after a check that
  the local model is the served one: the first greedy token of every prompt equal, and
  where the API gives logprobs, the chosen tokens' log-probabilities within
  :data:`~exactspec.audit.result.LOGPROB_TOLERANCE` of the local ones.
- **greedy**: A against B at temperature 0, token for token, over many prompts; the first
  divergence of each is reported with both sides' log-probabilities of both tokens where
  the API gives them.

Every sampling run includes a control that must be caught: A with ``control_body``
(default: the temperature raised by a quarter) tested the same way; a control not caught
makes the verdict inconclusive. Samples of A, B and the control are drawn interleaved, a
chunk of each in turn, so that whatever drifts over the run drifts for all. Ctrl-C stops
sampling and tests what was drawn (the verdict is then inconclusive). The results, the
verdict and the report are every audit's (:mod:`exactspec.audit.result`,
:mod:`exactspec.audit.report`); :func:`exactspec.audit.run` runs the whole audit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from exactspec.audit.endpoint import END, Completion, Endpoint, EndpointError
from exactspec.audit.result import LOGPROB_TOLERANCE, GreedyComparison, ModelCheck
from exactspec.sampling import SamplingParams

"""The endpoint audit's modes (module docstring)."""
CHUNK = 50
"""Samples drawn from one engine before the next engine's turn."""

Progress = Callable[[int], None]


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




__all__ = ["CHUNK", "compare_greedy", "draw_interleaved", "greedy_comparison",
           "local_greedy", "model_check"]
