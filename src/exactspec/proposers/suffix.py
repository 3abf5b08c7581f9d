"""Suffix drafting: continue the longest suffix of the context that occurred before, with the
continuation seen most often after it, for as long as that continuation looks likely.

Source: Oliaro et al. 2024, "SuffixDecoding" (arXiv 2411.04975): continuations of the
matched suffix weighted by how often they followed it, each drafted token scored by its
frequency, the draft stopping when the product of the scores falls below a threshold;
Saxena 2023, "Prompt Lookup Decoding", for drafting from the request's own text.

The index (continuation counts for every n-gram of ``min_match``..``max_match`` tokens of
the prompt and the generated text) is updated incrementally: each new token adds one
entry per n-gram size, so a proposal costs O(k · max_match) dictionary lookups whatever the
context length (prompt lookup rescans the context every cycle). The index covers the
current sequence only and is emptied by :meth:`SuffixProposer.reset`, so a seeded
generation drafts the same whatever ran before.

The drafted tokens are a deterministic function of the context, so q is a point mass
(``Proposal.probs`` is None) and verification stays exact at any temperature. The score of
a drafted token (its estimated probability of being accepted) is

    s = count(continuation) / count(all continuations) · n / (n + 1)

for the longest n-gram n that matched: a frequency, shrunk where the match is short (one
earlier occurrence of a 1-token match is weak evidence, of an 8-token match strong). It
only decides how much to draft, never what is committed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer, check_ngram_sizes

DEFAULT_MATCH = (1, 8)
"""The n-gram sizes matched (MIN, MAX) when none are given."""
DEFAULT_MIN_PROBABILITY = 0.1
"""The draft stops once the product of its tokens' scores would fall below this."""


class SuffixProposer(Proposer):
    """Drafts the most frequent continuation of the longest earlier match of the context's
    suffix (see the module docstring).

    Args:
        min_match: shortest suffix matched (tokens), ≥ 1.
        max_match: longest suffix matched (tokens), ≥ min_match.
        min_probability: the draft stops before the token whose score would bring the
            product of the scores below this, in [0, 1) (0: draft k tokens while matches
            last). The ``confidence`` policy's ``min_confidence`` raises it.
    Raises:
        ValueError: naming the bad value.
    """

    drafts_for_free = True
    supports_min_confidence = True

    def __init__(self, min_match: int = DEFAULT_MATCH[0], max_match: int = DEFAULT_MATCH[1],
                 min_probability: float = DEFAULT_MIN_PROBABILITY) -> None:
        check_ngram_sizes(min_match, max_match, ("min_match", "max_match"))
        if not 0 <= min_probability < 1:
            raise ValueError(f"min_probability = {min_probability!r} is invalid: it must be in "
                             "[0, 1)")
        self.min_match, self.max_match = min_match, max_match
        self.min_probability = min_probability
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []  # the tokens indexed so far
        # n-gram → {next token: [times it followed, last position it followed at]}
        self._next: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        self._index(token_ids)
        threshold = max(self.min_probability, min_confidence)
        tail = list(token_ids[-self.max_match:])
        drafted: list[int] = []
        probability = 1.0
        while len(drafted) < k:
            found = self._continuation(tail)
            if found is None:
                break
            token, score = found
            if probability * score < threshold:
                break
            probability *= score
            drafted.append(token)
            tail = (tail + [token])[-self.max_match:]
        return Proposal(drafted) if drafted else EMPTY_PROPOSAL

    def _continuation(self, tail: list[int]) -> tuple[int, float] | None:
        """The most frequent continuation of the longest suffix of ``tail`` in the index
        (ties: the most recent), and its score; None when no suffix occurred before."""
        for n in range(min(self.max_match, len(tail)), self.min_match - 1, -1):
            followers = self._next.get(tuple(tail[-n:]))
            if followers:
                token, (count, _) = max(followers.items(), key=lambda item: item[1])
                total = sum(c for c, _ in followers.values())
                return token, count / total * n / (n + 1)
        return None

    def _index(self, token_ids: Sequence[int]) -> None:
        """Add the tokens of ``token_ids`` not indexed yet. The engine's record only grows
        between resets; anything else (a shorter or different sequence) is indexed anew."""
        done = len(self._tokens)
        if done > len(token_ids) or (done and token_ids[done - 1] != self._tokens[-1]):
            self.reset()
            done = 0
        tokens = self._tokens
        for i in range(done, len(token_ids)):
            token = int(token_ids[i])
            for n in range(self.min_match, min(self.max_match, i) + 1):
                followers = self._next.setdefault(tuple(tokens[i - n:i]), {})
                seen = followers.get(token)
                if seen is None:
                    followers[token] = [1, i]
                else:
                    seen[0] += 1
                    seen[1] = i
            tokens.append(token)
