"""Prompt lookup decoding: draft by copying what followed an earlier match of the last n-gram.

Source: Saxena, "Prompt Lookup Decoding" (2023); transformers' ``PromptLookupCandidateGenerator``
and vLLM's n-gram proposer follow the same idea. The context searched is the prompt and the
generated text. A drafted token is chosen deterministically, so q is a point mass
(``Proposal.probs`` is None) and verification stays exact at any temperature.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer, check_ngram_sizes
from exactspec.logits_pipeline import LogitsPipeline


class PromptLookupProposer(Proposer):
    """N-gram matching in the context.

    The longest suffix of the context of size max_ngram down to min_ngram that occurs
    earlier is looked up; the tokens that followed its most recent earlier occurrence are
    drafted (up to k of them). No match: an empty proposal (the cycle is plain decoding).

    Args:
        min_ngram: smallest n-gram size to match (tokens), ≥ 1.
        max_ngram: largest n-gram size to match (tokens), ≥ min_ngram.
    Raises:
        ValueError: naming the bad size.
    """

    drafts_for_free = True
    batchable = True

    def __init__(self, min_ngram: int = 2, max_ngram: int = 3) -> None:
        check_ngram_sizes(min_ngram, max_ngram, ("min_ngram", "max_ngram"))
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        context = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            # Windows start at 0..len-1-n, so each has at least one token after it and
            # the suffix itself is never its own match.
            windows = sliding_window_view(context[:-1], n)
            matches = np.flatnonzero((windows == context[-n:]).all(axis=1))
            if matches.size:
                start = int(matches[-1]) + n
                return Proposal(context[start:start + k].tolist())
        return EMPTY_PROPOSAL
