"""The exact reference: the target's processed probabilities of every likely m-token
continuation of a prompt, computed from its logits (no sampling).

P(x₁..x_m) = Π_j p(x_j | prompt, x_<j), each factor the target's logits at that position
passed through the same :class:`~exactspec.logits_pipeline.LogitsPipeline` that decoding
uses (penalties, bans, temperature, top-k, top-p, min-p). Prefixes are expanded depth first
while they are expected at least ``min_expected`` times in ``num_samples`` samples, so the
outcome bins are fixed by the reference alone, never by the samples (a data-chosen binning
would bias the test). A continuation ending with an EOS or stop token id stops there (stop strings are not
audited).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exactspec.audit.stats import MIN_EXPECTED
from exactspec.backends.base import Backend
from exactspec.logits_pipeline import LogitsPipeline

OTHER = ()
"""The outcome key of the pooled bin: every continuation not listed on its own."""


@dataclass
class Reference:
    """Exact probabilities of the listed continuations; ``OTHER`` holds the rest.

    Attributes:
        outcomes: continuation (tuple of ≤ m token ids) → exact probability; the key
            ``OTHER`` (the empty tuple) holds 1 − the sum of the others.
        num_forwards: target forward passes the enumeration took.
    """

    outcomes: dict[tuple[int, ...], float]
    num_forwards: int

    def key(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The outcome a sampled continuation falls in."""
        token_ids = tuple(token_ids)
        return token_ids if token_ids in self.outcomes else OTHER


def exact_reference(target: Backend, prompt_ids: Sequence[int], pipeline: LogitsPipeline,
                    num_tokens: int, num_samples: int,
                    min_expected: float = MIN_EXPECTED) -> Reference:
    """Enumerate the likely ``num_tokens``-token continuations of ``prompt_ids``.

    Args:
        target: the target backend (its cache is reset).
        prompt_ids: ``[prompt_len]`` the prompt as the model sees it.
        pipeline: built for ``prompt_ids`` and the audited sampling parameters.
        num_tokens: m, continuation length (≥ 1).
        num_samples: the sample size the bins are sized for.
    Raises:
        ValueError: if ``num_tokens`` < 1 or the prompt is empty.
    """
    if num_tokens < 1 or not prompt_ids:
        raise ValueError("the reference needs num_tokens ≥ 1 and a non-empty prompt")
    prompt_ids = list(prompt_ids)
    params = pipeline.params
    stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(target.eos_token_ids))
    target.prefill(prompt_ids[:-1])
    outcomes: dict[tuple[int, ...], float] = {}
    stack: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    forwards = 0
    while stack:
        prefix, prefix_prob = stack.pop()
        logits = target.forward([prompt_ids[-1], *prefix], num_logits=1)  # [1, vocab]
        target.rollback(len(prefix) + 1)
        forwards += 1
        history = prompt_ids + list(prefix)
        probs = pipeline.probs(pipeline.process(logits, history))[0].double()  # [vocab]
        support = torch.nonzero(probs > 0).flatten().tolist()
        for token, p in zip(support, probs[support].tolist()):
            outcome, prob = (*prefix, token), prefix_prob * p
            if prob * num_samples < min_expected:
                continue
            if len(outcome) == num_tokens or token in stop_ids:
                outcomes[outcome] = prob
            else:
                stack.append((outcome, prob))
    outcomes[OTHER] = max(0.0, 1.0 - sum(outcomes.values()))
    return Reference(outcomes, forwards)
