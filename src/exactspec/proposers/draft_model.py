"""Draft-model proposer: a smaller model on the same tokenizer drafts k tokens one by one.

Source: Leviathan et al. 2022 (arXiv 2211.17192) and Chen et al. 2023 (arXiv 2302.01318):
the draft samples x_i ~ q_i autoregressively; q_i is returned so that verification can use
min(1, p/q) and the residual. With temperature 0 the draft is greedy and q is a point mass.

Vocabularies: a draft whose logits are wider or narrower than the target's (padding rows
of the LM head differ) is mapped onto the target's vocabulary; ids beyond the shared
tokenizer's size are padding and never drafted. Genuinely different tokenizers are refused.
On the native backend the draft scores only a draft vocabulary by default (the tokens its
target writes most, :mod:`exactspec.proposers.draft_vocabulary`; exact, q is zero outside
it), where a table for the tokenizer is shipped.

Greedy drafting under a request that changes no logit (no penalty, bias, ban or
constraint) takes the draft's argmax straight from its logits: no full-vocabulary tensor
is built per drafted token (the confidence policy's stop, ``min_confidence``, is the
softmax maximum of the same logits).

The draft keeps its own KV cache; before each proposal it is rolled back to the longest
common prefix with the engine's context, so rejected drafts never leak into the next cycle.
A new generation starts from an empty cache (:meth:`DraftModelProposer.reset`) filled by the
draft's prefill, so that what the draft computes, and a seeded output with it, does not
depend on what the cache held before.

In a batch each row's copy holds a sequence of its own in the one draft model, and the rows'
draft forwards are packed, one forward of the draft per drafted position
(:meth:`DraftModelProposer.propose_steps`, :mod:`exactspec.batching`): a row's logits are
its own alone where the draft's backend is ``sequences_invariant`` (else each row's step
runs alone), so its drafts, and a seeded row's output, do not depend on its companions.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np
import torch

from exactspec.backends.base import Backend, UnsupportedModelError, new_sequence_id
from exactspec.proposers.base import (EMPTY_PROPOSAL, ModelStep, Proposal, ProposalSteps, Proposer,
                                      draw_draft_token, run_alone)
from exactspec.proposers.draft_vocabulary import draft_vocabulary
from exactspec.logits_pipeline import LogitsPipeline, check_finite

DEFAULT_DRAFT_VOCAB_SIZE = 32768
"""The draft vocabulary's size where the draft runs on the native backend and a table fits
the tokenizer (chosen by measurement: docs/design.md, "Draft vocabularies and weights")."""
DEFAULT_DRAFT_WEIGHTS = "q4_0"
"""What a draft model's weights of more than 6 bits are converted to by default
(``draft:…:weights=``; :func:`exactspec.proposers.build.load_draft`; chosen by measurement:
docs/design.md, "Draft vocabularies and weights")."""


class DraftModelProposer(Proposer):
    """Drafts with a second model (see module docstring).

    Args:
        draft: the draft model's backend.
        target: the target's backend (for its vocabulary and tokenizer).
        draft_vocabulary: the tokens the draft scores and may draft: None,
            :data:`DEFAULT_DRAFT_VOCAB_SIZE` of them where the draft can restrict its logits
            (native backend) and a table fits the tokenizer, else all; ``"all"``: the whole
            vocabulary; N: the N its target writes most (the shipped table); or the token
            ids themselves.
    Attributes:
        draft_token_ids: ``[Vd]`` the target's token id of each column of the draft's
            logits (ascending), or None: column i is token i.
    Raises:
        ValueError: if ``draft`` is ``target`` (they would share one KV cache), or for a bad
            ``draft_vocabulary``.
        UnsupportedModelError: if the two tokenizers differ (a cross-tokenizer translator
            is not implemented yet), or a draft vocabulary is asked for where the draft's
            backend cannot restrict its logits, or a size N where no table fits the
            tokenizer.
    """

    supports_min_confidence = True
    """Drafting stops once the draft's top probability falls below ``min_confidence``: a
    draft-side rule, so exactness is unaffected."""
    drafts_in_steps = batchable = True
    """Each copy drafts in a sequence of its own in the shared draft model (``__copy__``);
    batched decoding packs the rows' draft forwards (``propose_steps``)."""

    def __init__(self, draft: Backend, target: Backend,
                 draft_vocabulary: int | str | Sequence[int] | None = None) -> None:
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
        if self.num_real_tokens > min(getattr(draft, "whole_vocab_size", draft.vocab_size),
                                      target.vocab_size):
            raise UnsupportedModelError(
                f"the tokenizer has {self.num_real_tokens} tokens but the draft's logits have "
                f"{draft.vocab_size} and the target's {target.vocab_size}")
        self.draft_token_ids = self._restrict(draft, target, draft_vocabulary)
        self.sequence_id = new_sequence_id()  # the draft's sequence this proposer uses
        self._cached: list[int] = []  # the tokens in its KV cache

    def _restrict(self, draft: Backend, target: Backend,
                  vocabulary: int | str | Sequence[int] | None) -> torch.Tensor | None:
        """The draft vocabulary (see the class docstring), set on the draft's backend."""
        size = vocabulary if isinstance(vocabulary, int) and not isinstance(vocabulary, bool) else None
        if vocabulary == "all" or (size is not None and size >= self.num_real_tokens):
            return None
        restrict = getattr(draft, "restrict_logits", None)
        if vocabulary is None or size is not None:
            ids = draft_vocabulary(target.tokenizer, size or DEFAULT_DRAFT_VOCAB_SIZE,
                                   target.eos_token_ids) if restrict else None
            if ids is None and vocabulary is None:
                return None
            if ids is None and restrict is not None:
                raise UnsupportedModelError(
                    f"vocab = {size} needs a token-frequency table for this tokenizer; "
                    "exactspec ships one for Qwen2.5's (scripts/draft_vocabulary.py makes one), "
                    "or leave vocab out")
        elif isinstance(vocabulary, str):
            raise ValueError(f"vocab = {vocabulary!r} is invalid: give a number of tokens, "
                             "'all' or the token ids")
        else:
            ids = np.array(sorted(set(int(t) for t in vocabulary)), dtype=np.int64)
            if not ids.size or ids[0] < 0 or ids[-1] >= self.num_real_tokens:
                raise ValueError(f"a draft vocabulary holds token ids in [0, "
                                 f"{self.num_real_tokens}); got {len(ids)} ids")
        if restrict is None:
            raise UnsupportedModelError(
                "a draft vocabulary needs the native backend for the draft model (its logits "
                "restricted to the vocabulary's rows); or leave vocab out")
        restrict(ids.tolist())
        return torch.from_numpy(ids)

    @property
    def description(self) -> str:
        """The draft in words: its backend's description and its draft vocabulary, e.g.
        ``native avx512 kernels, F32, Q4_0 weights, int8 activations; draft vocabulary
        32768``."""
        vocabulary = ("whole vocabulary" if self.draft_token_ids is None
                      else f"draft vocabulary {len(self.draft_token_ids)}")
        return f"{getattr(self.draft, 'description', type(self.draft).__name__)}; {vocabulary}"

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        return run_alone(self.propose_steps(token_ids, k, pipeline, rng, min_confidence))

    def propose_steps(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                      rng: torch.Generator, min_confidence: float = 0.0) -> ProposalSteps:
        """:meth:`propose` with each draft forward (one token, its ``[1, Vd]`` logits)
        yielded as a :class:`~exactspec.proposers.base.ModelStep`; the rollback and the
        prefill of the draft's cache run here (:meth:`_sync_cache`)."""
        if self.draft.max_context_length is not None:
            k = min(k, self.draft.max_context_length - len(token_ids))
        if k <= 0:
            return EMPTY_PROPOSAL
        pending = self._sync_cache(token_ids)
        drafted: list[int] = []
        probs: list[torch.Tensor] = []
        argmax = pipeline.params.greedy and pipeline.is_identity
        for _ in range(k):
            logits = yield ModelStep(self.draft, self.sequence_id, pending)  # [1, Vd]
            self._cached.extend(pending)
            if argmax:  # the draw's greedy choice, without the full-vocabulary tensor
                check_finite(logits)
                real = logits[0, :self.num_real_tokens]
                if min_confidence and float(real.softmax(-1).max()) < min_confidence:
                    break
                column = int(real.argmax())
                token = column if self.draft_token_ids is None else int(self.draft_token_ids[column])
                drafted.append(token)
                pending = [token]
                continue
            draw = draw_draft_token(self._to_target_vocab(logits), [*token_ids, *drafted],
                                    pipeline, rng, min_confidence)
            if draw is None:
                break
            drafted.append(draw.token)
            if draw.q is not None:
                probs.append(draw.q)
            pending = [draw.token]
        return Proposal(drafted, torch.stack(probs) if probs else None)

    def __copy__(self) -> DraftModelProposer:
        """A batch row's copy: the same draft model, a sequence of its own in it."""
        row = object.__new__(type(self))
        row.__dict__.update(self.__dict__)
        row.sequence_id, row._cached = new_sequence_id(), []
        return row

    def reserve(self, num_sequences: int) -> None:
        """Room for ``num_sequences`` rows in the draft model; whether its packed forward
        scores each row as alone (``sequences_invariant``, which the packing reads) is
        measured now, while the rows hold none of its sequences."""
        self.draft.reserve(num_sequences)
        self.draft.sequences_invariant

    def release(self) -> None:
        self.draft.release(self.sequence_id)
        self._cached = []

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        self.release()

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """Free the draft's sequence (a slot and a KV cache) between generations; the next
        sample prefills it again."""
        self.release()

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
        """``[n, Vd]`` → ``[n, target_vocab]``; padding ids and tokens outside the draft
        vocabulary get -inf so they are never drafted."""
        check_finite(logits)
        mapped = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))
        if self.draft_token_ids is None:
            mapped[:, : self.num_real_tokens] = logits[:, : self.num_real_tokens]
        else:
            mapped[:, self.draft_token_ids] = logits
        return mapped
