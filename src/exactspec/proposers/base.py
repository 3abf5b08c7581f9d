"""The ``Proposer`` protocol: what drafts tokens for the target to verify.

Modelled on transformers' ``CandidateGenerator`` (``get_candidates`` and the feedback hook
``update_candidate_strategy``), reduced to two calls.

Contract for ``propose(token_ids, k, pipeline, rng, min_confidence)``:
    requires  token_ids = prompt + committed tokens (the engine owns this list), k ≥ 1;
              pipeline = the sequence's :class:`~exactspec.logits_pipeline.LogitsPipeline`
              (a model proposer applies it to its own logits, so its q sees the same
              penalties, bans and filters as the target's p: better acceptance);
              rng = the sequence's random number generator (proposers that sample use it);
              min_confidence = the policy's threshold (only proposers that declare
              ``supports_min_confidence`` are given one above 0)
    returns   a :class:`Proposal` of at most k tokens (possibly none), and, unless the
              proposer is a point mass (greedy or n-gram), the exact distributions q the
              tokens were sampled from, over the *target's* vocabulary.

A proposer that runs a model of its own may also draft in steps (``drafts_in_steps``,
:meth:`Proposer.propose_steps`): a generator that yields each forward of its model as a
:class:`ModelStep` and is sent that forward's logits, so that batched decoding packs the
draft forwards of all its rows into one call per step (:mod:`exactspec.batching`), where one
sequence runs them one by one (:func:`run_alone`).
"""

from __future__ import annotations

from collections.abc import Generator, Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

from exactspec.backends.base import Backend, forward_one
from exactspec.logits_pipeline import LogitsPipeline, greedy_tokens
from exactspec.sampling import sample_from_probs


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens for one cycle.

    Attributes:
        token_ids: ``[n]`` drafted ids, ``n ≤ k``, in the target's vocabulary.
        probs: ``[n, target_vocab]`` the distribution each token was sampled from, or None
            when each token was chosen deterministically (q is one-hot on it).
        parents: ``[n]`` for a token tree (:mod:`exactspec.trees`): each node's parent, −1
            for a child of the last committed token, else an earlier node; its nodes are
            chosen deterministically (``probs`` None). None: a chain (token i follows
            token i − 1).
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None
    parents: list[int] | None = None

    @property
    def depth(self) -> int:
        """The most drafted tokens one cycle can accept (a chain's length, a tree's depth)."""
        if self.parents is None:
            return len(self.token_ids)
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)

    def __len__(self) -> int:
        return len(self.token_ids)


EMPTY_PROPOSAL = Proposal([])
T = TypeVar("T")


@dataclass(frozen=True)
class ModelStep:
    """One forward of a proposer's own model that a proposal in steps waits on
    (:meth:`Proposer.propose_steps`); it is sent back ``backend.forward([(sequence_id,
    token_ids)], num_logits=1)``'s logits, ``[1, backend.vocab_size]``.

    Attributes:
        backend: the proposer's model (a draft model's backend).
        sequence_id: the proposer's sequence in it.
        token_ids: ``[n ≥ 1]`` the tokens to add to that sequence's cache.
    """

    backend: Backend
    sequence_id: int
    token_ids: list[int]


ProposalSteps = Generator[ModelStep, torch.Tensor, Proposal]
"""A proposal in steps: yields :class:`ModelStep` s, is sent each one's ``[1, V]`` logits,
returns the :class:`Proposal`."""


def proposal_steps(proposer: Proposer, token_ids: Sequence[int], k: int,
                   pipeline: LogitsPipeline, rng: torch.Generator,
                   min_confidence: float = 0.0) -> ProposalSteps:
    """``proposer``'s proposal in steps where it ``drafts_in_steps``
    (:meth:`Proposer.propose_steps`), else its :meth:`Proposer.propose` (no step)."""
    if proposer.drafts_in_steps:
        return (yield from proposer.propose_steps(token_ids, k, pipeline, rng, min_confidence))
    return proposer.propose(token_ids, k, pipeline, rng, min_confidence)


def run_alone(steps: Generator[ModelStep, torch.Tensor, T]) -> T:
    """Run work in steps (a proposal, or a cycle's drafting) for one sequence: each
    :class:`ModelStep` is its own forward; returns what the generator returns."""
    logits = None
    while True:
        try:
            step = steps.send(logits)
        except StopIteration as stop:
            return stop.value
        logits = forward_one(step.backend, step.sequence_id, step.token_ids, num_logits=1)


class Corpus(Protocol):
    """Earlier outputs a proposer learns from across requests, kept apart by scope (see
    :meth:`Proposer.reset`); :class:`~exactspec.proposers.suffix.SuffixCorpus` is one.

    Attributes:
        num_tokens: output tokens kept now, all scopes together.
        max_tokens: the bound per scope (a scope's oldest outputs are evicted first).
        max_scopes: the most scopes held (the least recently used is evicted whole).
        num_scopes: scopes held now.
        num_ngrams: n-grams indexed (its memory grows with them).
    """

    max_tokens: int
    max_scopes: int

    @property
    def num_scopes(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_ngrams(self) -> int: ...

    def add(self, token_ids: Sequence[int], scope: Hashable = None) -> None:
        """Keep ``token_ids`` (one output) in ``scope``."""
        ...

    def clear(self) -> None:
        """Forget every output of every scope."""
        ...


@runtime_checkable
class Proposer(Protocol):
    """Drafts up to k tokens per cycle; learns how many were accepted. Proposers subclass
    it to inherit the defaults of the capabilities and the optional methods."""

    drafts_for_free: bool = False
    """Drafting runs no model and draws no random numbers, so the ``auto`` policy may peek at
    a draft it will not verify (:class:`~exactspec.speculation_length.AutoPolicy`)."""
    supports_min_confidence: bool = False
    """The proposer has probabilities of its own and stops drafting below ``min_confidence``
    (the ``confidence`` policy needs it)."""
    estimates_acceptance: bool = False
    """The confidence it compares with ``min_confidence`` estimates the probability that its
    whole draft so far is accepted (the product of its tokens' probabilities, EAGLE-2's
    value of a draft), so the ``auto`` policy sets ``min_confidence`` to the break-even
    probability of its measured costs (:class:`~exactspec.speculation_length.AutoPolicy`)."""
    drafts_trees: bool = False
    """Its proposals may be token trees (``Proposal.parents``): the target must score
    trees (``Backend.scores_trees``), and batched decoding, which packs chains, refuses it."""
    needs_target_features: bool = False
    """It drafts from the target's features of every context token but the last (the draft
    head), so it cannot continue a context extended by tokens the target has not scored:
    a cycle that begins with a constraint's forced tokens drafts those alone
    (:class:`~exactspec.proposers.forced.ForcedTokenProposer`)."""
    drafts_in_steps: bool = False
    """It runs a model of its own and :meth:`propose_steps` yields that model's forwards,
    so batched decoding packs them across rows: a batch drafts through
    :meth:`propose_steps` (a subclass that changes :meth:`propose` must change it too),
    one sequence through :meth:`propose`. False: :meth:`propose` everywhere."""
    batchable: bool = False
    """A copy per sequence (``copy.copy``), each ``reset`` on its own, drafts independently
    of the others (a draft model's copy in a sequence of its own, :meth:`reserve` making
    room), so batched decoding can give every row one
    (:class:`~exactspec.batching.BatchedGenerator`)."""

    corpus: Corpus | None = None
    """The earlier outputs the proposer learns from across requests (scoped, see
    :meth:`reset`), or None when it learns nothing across requests; the server reports its
    size and the bench refills it so that no question is drafted from its own answer."""

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        """Draft at most ``k`` tokens continuing ``token_ids`` (prompt + committed)."""
        ...

    def propose_steps(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                      rng: torch.Generator, min_confidence: float = 0.0) -> ProposalSteps:
        """:meth:`propose` in steps (module docstring): the same proposal, each forward of
        the proposer's own model yielded as a :class:`ModelStep` to be run by the caller
        (default: no model of its own, :meth:`propose` at once)."""
        return self.propose(token_ids, k, pipeline, rng, min_confidence)
        yield  # a generator that yields no step

    def reserve(self, num_sequences: int) -> None:
        """Batched decoding will give ``num_sequences`` copies of the proposer at once
        (see :attr:`batchable`): a proposer with a model of its own makes room for as many
        sequences in it (default: nothing to do).

        Raises:
            ValueError: beyond what its model can hold.
        """

    def release(self) -> None:
        """The sequence the proposer drafted for is gone (finished, cancelled or failed):
        free what it holds of it (a draft model's sequence; default: nothing)."""

    def num_forced(self, token_ids: Sequence[int], pipeline: LogitsPipeline) -> int:
        """How many tokens the next proposal after ``token_ids`` begins with that the
        request's constraint forces (:class:`~exactspec.proposers.forced.ForcedTokenProposer`):
        they cost nothing and are accepted with certainty, so the engine drafts them
        whatever k the policy chose, on top of it within num_speculative_tokens (default:
        0, none)."""
        return 0

    def follow(self, sequence_id: int) -> None:
        """The target's sequence (``Backend`` id) whose context the next proposals continue,
        told by the engine before a generation's first proposal: a proposer that reads the
        target's hidden features reads them there (default: ignored)."""

    def observe(self, num_accepted: int) -> None:
        """Feedback after verification: how many of the last proposal were accepted
        (default: ignored)."""

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        """A new generation starts: drop any state of the previous sequence (a draft
        model's KV cache). With ``reproducible`` (a seeded sampling run) the generation
        must draft the same whatever ran before, so nothing learnt from earlier
        generations may be used. ``scope`` says whose generations this one may learn from
        and teach: a proposer that learns across requests uses and feeds only what
        generations of the same scope wrote (the server's scope: API key and
        ``cache_salt``; None: the default scope). Default: nothing to drop."""

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """A sample is complete: ``token_ids`` = prompt + output, the prompt being the first
        ``num_prompt_tokens`` (for proposers that learn across requests, in the scope given
        to :meth:`reset`; default: ignored)."""


class Draw(NamedTuple):
    """One drafted token (:func:`draw_draft_token`).

    Attributes:
        token: its id.
        q: ``[target_vocab]`` the distribution it was drawn from, None when greedy (a
            point mass on it).
        confidence: the top processed probability (1.0 when none was asked for).
    """

    token: int
    q: torch.Tensor | None
    confidence: float


def draw_draft_token(logits: torch.Tensor, history: Sequence[int], pipeline: LogitsPipeline,
                     rng: torch.Generator, min_confidence: float = 0.0) -> Draw | None:
    """One drafted token from a model proposer's ``logits`` ``[1, target_vocab]`` (−inf where
    it cannot draft), after the request's logits pipeline over ``history`` (the context and
    the tokens drafted so far): the argmax when greedy, else a draw from q = the processed
    distribution. None (stop drafting) when no token is left or the top processed
    probability is below ``min_confidence``."""
    processed = pipeline.process(logits, history)
    if float(processed.max()) == float("-inf"):
        return None
    confidence = float(processed.softmax(-1).max()) if min_confidence else 1.0
    if confidence < min_confidence:
        return None
    if pipeline.params.greedy:
        return Draw(int(greedy_tokens(processed)[0]), None, confidence)
    q = pipeline.probs(processed)  # [1, target_vocab]
    return Draw(int(sample_from_probs(q, rng)[0]), q[0], confidence)


def check_ngram_sizes(low: int, high: int, names: tuple[str, str]) -> None:
    """The n-gram sizes a matching proposer takes, ``names`` = how its arguments are called.

    Raises:
        ValueError: unless ``low`` is an integer ≥ 1 and ``high`` an integer ≥ ``low``.
    """
    if not isinstance(low, int) or isinstance(low, bool) or low < 1:
        raise ValueError(f"{names[0]} = {low!r} is invalid: it must be an integer ≥ 1")
    if not isinstance(high, int) or isinstance(high, bool) or high < low:
        raise ValueError(f"{names[1]} = {high!r} is invalid: it must be an integer ≥ "
                         f"{names[0]} ({low})")
