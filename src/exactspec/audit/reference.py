"""What an engine's samples are tested against (:class:`Reference`): the target's exact
probabilities (:class:`ExactReference`) or a second engine's samples
(:class:`SampledReference`).

The exact reference: the target's processed next-token distribution after each sampled
prefix of a prompt's continuation, computed from its logits (no sampling).

p(· | prompt, x_<j) is the target's logits after ``prompt + x_<j`` passed through the
same :class:`~exactspec.logits_pipeline.LogitsPipeline` that decoding uses (penalties,
bans, temperature, top-k, top-p, min-p), with the true history. The logits are computed
as plain decoding computes them, one token per forward pass on the cached context: the
prefixes are visited depth first (sorted order), so each costs one single-token forward
and the cache is rolled back between branches, never re-encoded. The reference is then
plain decoding by construction, whether or not the backend scores a block of tokens
bit-identically to single tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from exactspec.audit.endpoint import END, Symbol
from exactspec.audit.stats import Impossible, NodeFit, PositionFit, fit_tree
from exactspec.audit.two_sample import PromptComparison, compare_prompt, max_draws_for
from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.constraints import ConstraintViolation
from exactspec.logits_pipeline import LogitsPipeline, NoTokenAllowedError
from exactspec.request import logits_pipeline
from exactspec.sampling import SamplingParams


def next_token_probs(target: Backend, prompt_ids: Sequence[int], pipeline: LogitsPipeline,
                     prefixes: Sequence[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...],
                                                                             np.ndarray]]:
    """The exact next-token distribution after ``prompt_ids + prefix`` for each prefix.

    Args:
        target: the target backend (one sequence held while the generator runs).
        prompt_ids: ``[prompt_len]`` the prompt as the model sees it (non-empty).
        pipeline: built for ``prompt_ids`` and the audited sampling parameters.
        prefixes: continuations to score, sorted, every prefix of one listed before it
            (as :func:`~exactspec.audit.stats.fit_tree` passes them).
    Yields:
        ``(prefix, probs)``, ``probs`` ``[vocab]`` float64 summing to 1, in the order given;
        none for a prefix that breaks the sampling parameters' constraint (the test reports
        its last token as impossible) or its descendants: the constrained target has no
        distribution there.
    Raises:
        ValueError: if the prompt is empty or a prefix's parent was not listed before it.
    """
    if not prompt_ids:
        raise ValueError("the reference needs a non-empty prompt")
    prompt_ids = list(prompt_ids)
    sequence = new_sequence_id()
    try:
        target.prefill(sequence, prompt_ids[:-1])
        path: tuple[int, ...] | None = None  # the continuation in the cache after the prompt
        unreachable: set[tuple[int, ...]] = set()  # prefixes that break the constraint
        for prefix in prefixes:
            if prefix and prefix[:-1] in unreachable:
                unreachable.add(prefix)
                continue
            if not prefix:
                target.rollback(sequence, target.num_cached_tokens(sequence) - (len(prompt_ids) - 1))
                logits = forward_one(target, sequence, prompt_ids[-1:])
            else:
                if path is None or path[: len(prefix) - 1] != prefix[:-1]:
                    raise ValueError(f"prefix {prefix} comes before its parent: pass prefixes "
                                     "sorted and closed under taking prefixes")
                target.rollback(sequence, len(path) - (len(prefix) - 1))
                logits = forward_one(target, sequence, prefix[-1:])
            path = prefix
            try:
                processed = pipeline.process(logits, prompt_ids + list(prefix))
            except ConstraintViolation:  # the constraint's matcher cannot follow this prefix
                unreachable.add(prefix)
                continue
            if pipeline.first_empty_row(processed) is not None:
                raise NoTokenAllowedError(len(prefix), pipeline.params)
            probs = pipeline.probs(processed)[0]
            probs = probs.double().cpu().numpy()
            yield prefix, probs / probs.sum()
    finally:
        target.release(sequence)


@dataclass
class PromptTest:
    """The distribution test of one engine on one prompt against the exact probabilities:
    one test per position of the continuation (see :mod:`exactspec.audit.stats`).

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

    @property
    def joint_tests(self) -> list:
        """Tests of the whole prompt beside the positions': none against exact
        probabilities (the two-sample audit's MMD test)."""
        return []


def fit_prompt(target: Backend, prompt_ids: Sequence[int], params: SamplingParams,
               samples: Sequence[Sequence[int]], index: int = 0) -> PromptTest:
    """The per-position tests of one prompt's ``samples`` against the target's exact
    conditionals (undecided: :func:`~exactspec.audit.stats.decide` applies Holm)."""
    pipeline = logits_pipeline(target, params, list(prompt_ids))
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos
                                             else set(target.eos_token_ids))
    fit = fit_tree(samples, params.max_new_tokens, stop_ids,
                   lambda prefixes: next_token_probs(target, prompt_ids, pipeline, prefixes),
                   seed=index)
    return PromptTest(index, fit.num_samples, fit.positions, fit.impossible, fit.first)


class Reference(Protocol):
    """What an engine's samples are tested against, prompt by prompt: the target's exact
    probabilities (:class:`ExactReference`) or a second engine's samples
    (:class:`SampledReference`).

    Attributes:
        name: None for exact probabilities, else the engine whose samples it holds (B).
    """

    name: str | None

    def test_prompt(self, index: int, samples: Sequence[Sequence[Symbol]]):
        """The undecided tests of prompt ``index``'s ``samples`` (continuations, each
        at most ``max_new_tokens`` tokens; :data:`~exactspec.audit.endpoint.END` after one
        that stopped early, where the engine says so)."""
        ...


@dataclass
class ExactReference:
    """The target's exact processed conditionals (:func:`fit_prompt`, one-sample tests).

    Attributes:
        target: the target backend (a local copy of the served model, over HTTP).
        prompt_ids: ``[prompts][tokens]`` the prompts as the target sees them.
        params: the audited sampling parameters (``max_new_tokens``: m, the positions).
    """

    target: Backend
    prompt_ids: Sequence[Sequence[int]]
    params: SamplingParams
    name = None

    def test_prompt(self, index: int, samples: Sequence[Sequence[Symbol]]) -> PromptTest:
        """:func:`fit_prompt` of ``samples``, where :data:`~exactspec.audit.endpoint.END`
        becomes the target's first EOS id unless the sample already ends with an EOS.

        Raises:
            ValueError: a token is not an id (an API gave texts).
        """
        eos = set(self.target.eos_token_ids)
        as_ids = []
        for sample in samples:
            sample = list(sample)
            if sample and sample[-1] == END:
                sample.pop()
                if not sample or sample[-1] not in eos:
                    sample.append(self.target.eos_token_ids[0])
            as_ids.append(tuple(sample))
        return fit_prompt(self.target, self.prompt_ids[index], self.params, as_ids, index)


@dataclass
class SampledReference:
    """A second engine's samples (B's: the same model with speculation off), two-sample
    tests (:func:`~exactspec.audit.two_sample.compare_prompt`).

    Attributes:
        name: B's name.
        samples: ``[prompts][samples]`` B's continuations.
        num_tokens: m, the positions tested.
        alpha: the audit's family-wise level (sets the permutations drawn).
        seed: seeds the permutations and the bootstrap.
    """

    name: str
    samples: Sequence[Sequence[Sequence[Symbol]]]
    num_tokens: int
    alpha: float
    seed: int = 0

    def test_prompt(self, index: int, samples: Sequence[Sequence[Symbol]]) -> PromptComparison:
        max_draws = max_draws_for(self.alpha, len(self.samples) * (self.num_tokens + 1))
        return compare_prompt(samples, self.samples[index], self.num_tokens, max_draws, index,
                              self.seed)
