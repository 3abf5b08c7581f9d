"""A matcher first, a model where it has no match: ``MATCHER+MODEL`` (e.g. ``suffix+head``).

Suffix drafting and prompt lookup cost almost nothing and draft long runs where the text
repeats, but have no draft in most cycles of open-ended text; a model proposer (a draft
head, a draft model) drafts every cycle but costs a model call and is accepted less where
the text repeats. :class:`FallbackProposer` asks the matcher first and the model only in
the cycles where the matcher drafted nothing, so each cycle drafts with the one that has
something to say. Source: ArcticInference's hybrid of suffix decoding with a model
speculator (Snowflake 2025, ``docs/suffix-decoding.rst``, "Combining with Arctic
Speculator"), which takes suffix decoding's draft when its score is high enough and the
model's otherwise; here the matcher's own threshold (``SuffixProposer.min_confidence``)
decides, and any draft it makes is taken.

Exactness: which proposer drafts is a function of the context alone (whether the matcher
matches), never of a random draw, and each proposal carries its own q (a matcher's is a
point mass, ``Proposal.probs`` None; a model's is the distribution it sampled from), so
verification keeps the target's distribution exactly whichever drafted
(docs/exactness.md).
"""

from __future__ import annotations

import copy
from collections.abc import Hashable, Sequence

import torch

from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import (Proposal, ProposalSteps, Proposer, proposal_steps,
                                      run_alone)


class FallbackProposer(Proposer):
    """``matcher``'s draft when it has one, else ``model``'s.

    Capabilities: the model's (``supports_min_confidence``, ``estimates_acceptance``,
    ``drafts_trees``: the policy's confidence threshold is the model's to apply, the
    matcher keeping its own), ``needs_target_features`` where either part does, batchable
    when both are, ``drafts_in_steps`` where the model does, and never ``drafts_for_free``
    (a peek may run the model). The corpus, if any, is the matcher's (suffix's).

    Args:
        matcher: a proposer that drafts only where the context matches (prompt lookup,
            suffix).
        model: the proposer for the other cycles (a draft head, a draft model).
    """

    def __init__(self, matcher: Proposer, model: Proposer) -> None:
        self.matcher, self.model = matcher, model
        self.supports_min_confidence = model.supports_min_confidence
        self.estimates_acceptance = model.estimates_acceptance
        self.drafts_trees = model.drafts_trees
        self.needs_target_features = (matcher.needs_target_features
                                      or model.needs_target_features)
        self.batchable = matcher.batchable and model.batchable
        self.drafts_in_steps = model.drafts_in_steps
        self.corpus = matcher.corpus
        self.last_proposer: Proposer | None = None
        """The part that made the last proposal (None before any)."""

    def __copy__(self) -> FallbackProposer:  # a batch row's copy has its own parts
        return FallbackProposer(copy.copy(self.matcher), copy.copy(self.model))

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        return run_alone(self.propose_steps(token_ids, k, pipeline, rng, min_confidence))

    def propose_steps(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                      rng: torch.Generator, min_confidence: float = 0.0) -> ProposalSteps:
        proposal = self.matcher.propose(token_ids, k, pipeline, rng)
        self.last_proposer = self.matcher
        if not proposal.token_ids:
            proposal = yield from proposal_steps(self.model, token_ids, k, pipeline, rng,
                                                 min_confidence)
            self.last_proposer = self.model
        return proposal

    def follow(self, sequence_id: int) -> None:
        self.matcher.follow(sequence_id)
        self.model.follow(sequence_id)

    def reserve(self, num_sequences: int) -> None:
        self.matcher.reserve(num_sequences)
        self.model.reserve(num_sequences)

    def release(self) -> None:
        self.matcher.release()
        self.model.release()

    def observe(self, num_accepted: int) -> None:
        if self.last_proposer is not None:
            self.last_proposer.observe(num_accepted)

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        self.last_proposer = None
        self.matcher.reset(reproducible, scope)
        self.model.reset(reproducible, scope)

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.matcher.end_sequence(token_ids, num_prompt_tokens)
        self.model.end_sequence(token_ids, num_prompt_tokens)
