"""Deliberately broken verifiers: the audit's power check runs the same test on them and
must reject. Each mimics a real mistake found in speculative decoding implementations.

Never use these to generate text: they change the output distribution.
"""

from __future__ import annotations

import dataclasses

import torch

from exactspec.constraints import Constraint, ConstraintMask, ConstraintViolation
from exactspec.generator import SpeculativeGenerator
from exactspec.sampling import sample_from_probs
from exactspec.verification import VerificationResult, rejection_sample


def accept_every_draft(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                       target_probs: torch.Tensor, rng: torch.Generator) -> VerificationResult:
    """Broken: keeps every drafted token (no acceptance test), then a bonus token from p.
    Shapes as :func:`~exactspec.verification.rejection_sample`."""
    batch, k = draft_token_ids.shape
    bonus = sample_from_probs(target_probs[:, k].double(), rng)  # [batch]
    output = torch.cat([draft_token_ids, bonus.unsqueeze(-1)], dim=-1)
    return VerificationResult(output, torch.full((batch,), k, dtype=torch.long))


def resample_without_residual(draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                              target_probs: torch.Tensor,
                              rng: torch.Generator) -> VerificationResult:
    """Broken: the right acceptance test, but after a rejection the token is drawn from p
    instead of the residual normalize(max(0, p − q)), so drafted tokens are over-produced.
    Shapes as :func:`~exactspec.verification.rejection_sample`."""
    result = rejection_sample(draft_token_ids, draft_probs, target_probs, rng)
    k = draft_token_ids.shape[1]
    rows = torch.nonzero(result.num_accepted < k).flatten()
    if len(rows):
        at = result.num_accepted[rows]
        result.output_token_ids[rows, at] = sample_from_probs(target_probs[rows, at].double(),
                                                              rng)
    return result


BROKEN_VERIFIERS = {"accept-all": accept_every_draft, "no-residual": resample_without_residual}
"""The broken controls by name (``exactspec audit --broken NAME``)."""


class _VerifiedPositionOnly(ConstraintMask):
    """Broken: masks only the position after the committed output, so drafted positions
    are judged against the unconstrained p (the bug the speculative decoding trackers
    report: vLLM #15554, SGLang #13019). A forbidden draft can then be committed; from
    there on the grammar is lost and nothing is masked."""

    lost = False

    def allowed(self, output, drafted, n):
        everything = torch.ones(n, self.vocab_size, dtype=torch.bool)
        if not self.lost:
            try:
                everything[0] = super().allowed(output, (), 1)[0]
            except ConstraintViolation:  # a forbidden token was committed
                self.lost = True
        return everything

    def forced_tokens(self, output):
        if not self.lost:
            try:
                return super().forced_tokens(output)
            except ConstraintViolation:
                self.lost = True
        return []


@dataclasses.dataclass(frozen=True)
class VerifiedPositionOnly(Constraint):
    """A constraint whose mask is :class:`_VerifiedPositionOnly` (see there)."""

    def mask(self, tokenizer, vocab_size):
        return _VerifiedPositionOnly(self, tokenizer, vocab_size)


class ConstraintControl:
    """An :class:`~exactspec.engines.Engine` like ``engine`` but whose requests' constraint
    masks the verified position only (:class:`_VerifiedPositionOnly`): the broken control
    of a constrained audit, correct verification otherwise. Requests without a constraint
    are left as they are."""

    def __init__(self, engine, name: str) -> None:
        self.engine, self.name, self.corpus = engine, name, engine.corpus

    @property
    def draft_stats(self):
        return self.engine.draft_stats

    def generate(self, prompts, params, *, at_once=False):
        return self.engine.generate(prompts, _broken(params), at_once=at_once)

    def sample(self, prompt_ids, params, num_samples):
        return self.engine.sample(prompt_ids, _broken(params), num_samples)


def _broken(params):
    """``params`` with its constraint masking the verified position only."""
    if params.constraint is None:
        return params
    return dataclasses.replace(params, constraint=VerifiedPositionOnly(
        params.constraint.kind, params.constraint.value))


class BrokenGenerator(SpeculativeGenerator):
    """A :class:`~exactspec.generator.SpeculativeGenerator` whose stochastic verification is
    one of :data:`BROKEN_VERIFIERS` (greedy verification is left correct)."""

    def __init__(self, *args, broken: str, **kwargs) -> None:
        if broken not in BROKEN_VERIFIERS:
            raise ValueError(f"broken control {broken!r} is unknown: choose one of "
                             f"{', '.join(BROKEN_VERIFIERS)}")
        super().__init__(*args, **kwargs)
        self.rejection_sampler = BROKEN_VERIFIERS[broken]
