"""Forced tokens: where a request's structured-output constraint allows one continuation
only (a JSON key after ``{"``, the closing quote and colon, a fixed prefix), those tokens
are known before the target runs. :class:`ForcedTokenProposer` drafts them first, with
q = 1 (a point mass), then lets any other proposer continue after them. They are verified
like every draft: a truly forced token has masked p = 1 and is accepted; llguidance's
forced tokens are the canonical tokenization of the forced bytes, and where the constraint
also allows another tokenization of them, p < 1 and the usual rule decides (docs/exactness.md,
"Constraints").

The engine wraps a request's proposer in it whenever the request has a constraint
(:class:`~exactspec.generator.SequenceState`).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import (Proposal, ProposalSteps, Proposer, proposal_steps,
                                      run_alone)


class ForcedTokenProposer(Proposer):
    """The constraint's forced tokens, then ``inner``'s drafts after them.

    The engine drafts the forced tokens whatever k its policy chose (even at k = 0: they
    cost no model call and are accepted with certainty), the inner proposer's k after them,
    within num_speculative_tokens (:meth:`num_forced`, ``SampleDecoding.draft``).

    Args:
        inner: the proposer that continues after the forced tokens, or None (the proposer
            ``forced``: the forced tokens alone). Its capabilities are this proposer's; a
            tree proposer, or one that ``needs_target_features``, drafts in cycles without
            forced tokens, and cycles with forced tokens draft those alone.
    """

    def __init__(self, inner: Proposer | None = None) -> None:
        self.inner = inner
        if inner is None:
            self.drafts_for_free = self.batchable = True
        else:
            self.drafts_for_free = inner.drafts_for_free
            self.supports_min_confidence = inner.supports_min_confidence
            self.estimates_acceptance = inner.estimates_acceptance
            self.drafts_trees = inner.drafts_trees
            self.needs_target_features = inner.needs_target_features
            self.batchable = inner.batchable
            self.drafts_in_steps = inner.drafts_in_steps
            self.corpus = inner.corpus
        self._num_forced = 0  # of the last proposal
        self._inner_proposed = False  # whether the last proposal ended with inner's drafts

    def __copy__(self) -> ForcedTokenProposer:  # a batch row's copy has its own inner
        return ForcedTokenProposer(copy.copy(self.inner))

    def num_forced(self, token_ids: Sequence[int], pipeline: LogitsPipeline) -> int:
        return len(self._forced(token_ids, pipeline))

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        return run_alone(self.propose_steps(token_ids, k, pipeline, rng, min_confidence))

    def propose_steps(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                      rng: torch.Generator, min_confidence: float = 0.0) -> ProposalSteps:
        forced = self._forced(token_ids, pipeline)[:k]
        self._num_forced = len(forced)
        self._inner_proposed = self.inner is not None and not (len(forced) == k or (
            forced and (self.inner.drafts_trees or self.inner.needs_target_features)))
        if not self._inner_proposed:
            return Proposal(forced)
        if not forced:
            return (yield from proposal_steps(self.inner, token_ids, k, pipeline, rng,
                                              min_confidence))
        rest = yield from proposal_steps(self.inner, [*token_ids, *forced], k - len(forced),
                                         pipeline, rng, min_confidence)
        probs = rest.probs
        if probs is not None:
            point_mass = torch.zeros(len(forced), probs.shape[-1], dtype=probs.dtype,
                                     device=probs.device)
            point_mass[torch.arange(len(forced)), torch.tensor(forced)] = 1
            probs = torch.cat([point_mass, probs])
        return Proposal([*forced, *rest.token_ids], probs)

    @staticmethod
    def _forced(token_ids: Sequence[int], pipeline: LogitsPipeline) -> list[int]:
        """The tokens the constraint forces after ``token_ids`` (none without one)."""
        if pipeline.constraint is None:
            return []
        return pipeline.constraint.forced_tokens(token_ids[pipeline.num_prompt_tokens:])

    def follow(self, sequence_id: int) -> None:
        if self.inner is not None:
            self.inner.follow(sequence_id)

    def reserve(self, num_sequences: int) -> None:
        if self.inner is not None:
            self.inner.reserve(num_sequences)

    def release(self) -> None:
        if self.inner is not None:
            self.inner.release()

    def observe(self, num_accepted: int) -> None:
        if self._inner_proposed:
            self.inner.observe(max(0, num_accepted - self._num_forced))

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        if self.inner is not None:
            self.inner.reset(reproducible, scope)

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        if self.inner is not None:
            self.inner.end_sequence(token_ids, num_prompt_tokens)
