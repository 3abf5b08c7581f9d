"""Draft-model proposer: a smaller model on the same tokenizer drafts k tokens one by one.

Source: Leviathan et al. 2022 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318):
the draft samples x_i ~ q_i autoregressively; q_i is returned so that verification can use
min(1, p/q) and the residual. With temperature 0 the draft is greedy and q is a point mass.

Vocabularies: a draft whose logits are wider or narrower than the target's (padding rows
of the LM head differ) is mapped onto the target's vocabulary; ids beyond the shared
tokenizer's size are padding and never drafted. Genuinely different tokenizers are refused.

The draft keeps its own KV cache; before each proposal it is rolled back to the longest
common prefix with the engine's context, so rejected drafts never leak into the next cycle.
A new generation starts from an empty cache (:meth:`DraftModelProposer.reset`) filled by the
draft's prefill, so that what the draft computes, and a seeded output with it, does not
depend on what the cache held before.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from exactspec.backends.base import Backend, UnsupportedModelError, forward_one, new_sequence_id
from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer, draw_draft_token
from exactspec.logits_pipeline import LogitsPipeline, check_finite


class DraftModelProposer(Proposer):
    """Drafts with a second model (see module docstring).

    Args:
        draft: the draft model's backend.
        target: the target's backend (for its vocabulary and tokenizer).
    Raises:
        ValueError: if ``draft`` is ``target`` (they would share one KV cache).
        UnsupportedModelError: if the two tokenizers differ (a cross-tokenizer translator
            is not implemented yet).
    """

    supports_min_confidence = True
    """Drafting stops once the draft's top probability falls below ``min_confidence``: a
    draft-side rule, so exactness is unaffected."""

    def __init__(self, draft: Backend, target: Backend) -> None:
        if draft is target:
            raise ValueError("the draft must be a separate backend with its own KV cache; to "
                             "draft with the target's own weights, wrap its model in a second "
                             "backend")
        target_vocab = target.tokenizer.get_vocab()
        if draft.tokenizer.get_vocab() != target_vocab:
            raise UnsupportedModelError(
                "the draft model's tokenizer differs from the target's; drafting across "
                "different tokenizers is not supported yet: choose a draft from the target's "
                "model family (same tokenizer), or use prompt lookup")
        self.draft = draft
        self.target_vocab_size = target.vocab_size
        self.num_real_tokens = max(target_vocab.values()) + 1
        if self.num_real_tokens > min(draft.vocab_size, target.vocab_size):
            raise UnsupportedModelError(
                f"the tokenizer has {self.num_real_tokens} tokens but the draft's logits have "
                f"{draft.vocab_size} and the target's {target.vocab_size}")
        self.sequence_id = new_sequence_id()  # the draft's sequence this proposer uses
        self._cached: list[int] = []  # the tokens in its KV cache

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        if self.draft.max_context_length is not None:
            k = min(k, self.draft.max_context_length - len(token_ids))
        if k <= 0:
            return EMPTY_PROPOSAL
        pending = self._sync_cache(token_ids)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        for _ in range(k):
            logits = self._to_target_vocab(forward_one(self.draft, self.sequence_id, pending,
                                                       num_logits=1))  # [1, V]
            self._cached.extend(pending)
            draw = draw_draft_token(logits, [*token_ids, *drafted], pipeline, rng, min_confidence)
            if draw is None:
                break
            drafted.append(draw.token)
            if draw.q is not None:
                probs.append(draw.q)
            pending = [draw.token]
        return Proposal(drafted, torch.stack(probs) if probs else None)

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        self.draft.release(self.sequence_id)
        self._cached = []

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Free the draft's sequence (a slot and a KV cache) between generations; the next
        sample prefills it again."""
        self.reset()

    def _sync_cache(self, token_ids: Sequence[int]) -> list[int]:
        """Roll the draft cache back to its common prefix with ``token_ids`` (keeping at
        least the last token out of it), or prefill it when it is empty; return the tokens
        still to feed."""
        if not self._cached:
            self.draft.release(self.sequence_id)
            self.draft.prefill(self.sequence_id, token_ids[:-1])
            self._cached = list(token_ids[:-1])
            return list(token_ids[-1:])
        common = 0
        limit = min(len(self._cached), len(token_ids) - 1)
        while common < limit and self._cached[common] == token_ids[common]:
            common += 1
        self.draft.rollback(self.sequence_id, len(self._cached) - common)
        del self._cached[common:]
        return list(token_ids[common:])

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, draft_vocab]`` → ``[n, target_vocab]``; padding ids get -inf so they are
        never drafted."""
        check_finite(logits)
        mapped = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        mapped[:, : self.num_real_tokens] = logits[:, : self.num_real_tokens]
        return mapped
