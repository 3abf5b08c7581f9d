"""Suffix drafting: continue the longest suffix of the context that occurred before, with the
continuation seen most often after it, for as long as that continuation looks likely.

Source: Oliaro et al. 2024, "SuffixDecoding" (arXiv 2411.04975): continuations of the
matched suffix weighted by how often they followed it, each drafted token scored by its
frequency, the draft stopping when the product of the scores falls below a threshold;
Saxena 2023, "Prompt Lookup Decoding", for drafting from the request's own text.

The index (continuation counts for every n-gram of ``min_ngram``..``max_ngram`` tokens of
the prompt and the generated text) is updated incrementally: each new token adds one
entry per n-gram size, so a proposal costs O(k · max_ngram) dictionary lookups whatever the
context length (prompt lookup rescans the context every cycle). This index covers the
current sequence only and is emptied by :meth:`SuffixProposer.reset`.

Optionally a :class:`SuffixCorpus` adds what earlier generations wrote (SuffixDecoding's
global tree): their outputs, indexed the same way, shared by every proposer that holds it,
clearable, and kept apart by scope: a generation drafts only from outputs of its own scope
(``reset(scope=...)``), so requests of different scopes cannot read each other's output
through the drafts; each scope has its own token bound (its oldest outputs evicted first),
so that no scope's traffic changes another's drafts. For each
drafted token the request's own index and the corpus each propose a continuation and the
higher score wins. A seeded sampling run (``reset(reproducible=True)``) drafts from its own
text only, so that it samples the same whatever ran before.

The drafted tokens are a deterministic function of the context, so q is a point mass
(``Proposal.probs`` is None) and verification stays exact at any temperature. The score of
a drafted token (its estimated probability of being accepted) is

    s = count(continuation) / count(all continuations) · n / (n + 1)

for the longest n-gram n that matched: a frequency, shrunk where the match is short (one
earlier occurrence of a 1-token match is weak evidence, of an 8-token match strong). It
only decides how much to draft, never what is committed.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence

import torch

from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer, check_ngram_sizes
from exactspec.proposers.spec import DEFAULT_SUFFIX_NGRAM

DEFAULT_MIN_CONFIDENCE = 0.1
"""The draft stops once the product of its tokens' scores would fall below this."""


class _SuffixIndex:
    """n-gram → {next token: [times it followed, stamp of the last time]} for n-grams of
    ``min_ngram``..``max_ngram`` tokens."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.next: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def count(self, tokens: Sequence[int], start: int, stamp: int) -> None:
        """Count the continuation at each position ``start``..end of ``tokens``; the stamp
        of position i is ``stamp + i`` (higher = more recent, for ties)."""
        for i in range(start, len(tokens)):
            token = tokens[i]
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                followers = self.next.setdefault(tuple(tokens[i - n:i]), {})
                seen = followers.get(token)
                if seen is None:
                    followers[token] = [1, stamp + i]
                else:
                    seen[0] += 1
                    seen[1] = stamp + i

    def uncount(self, tokens: Sequence[int]) -> None:
        """Take back what :meth:`count` added for the whole of ``tokens``."""
        for i in range(1, len(tokens)):
            for n in range(self.min_ngram, min(self.max_ngram, i) + 1):
                key = tuple(tokens[i - n:i])
                followers = self.next[key]
                seen = followers[tokens[i]]
                seen[0] -= 1
                if not seen[0]:
                    del followers[tokens[i]]
                    if not followers:
                        del self.next[key]

    def best(self, tail: Sequence[int]) -> tuple[int, float] | None:
        """The most frequent continuation of the longest suffix of ``tail`` in the index
        (ties: the most recent) and its score; None when no suffix occurred before."""
        for n in range(min(self.max_ngram, len(tail)), self.min_ngram - 1, -1):
            followers = self.next.get(tuple(tail[-n:]))
            if followers:
                token, (count, _) = max(followers.items(), key=lambda item: item[1])
                total = sum(c for c, _ in followers.values())
                return token, count / total * n / (n + 1)
        return None


DEFAULT_CORPUS_TOKENS = 100_000
"""A corpus's default bound per scope (tokens of earlier outputs kept)."""
DEFAULT_CORPUS_SCOPES = 16
"""A corpus's default cap on the number of scopes held."""


class _Scope:
    """One scope's outputs (oldest first), their index and their token count."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.index = _SuffixIndex(min_ngram, max_ngram)
        self.outputs: deque[list[int]] = deque()
        self.num_tokens = 0


class SuffixCorpus:
    """Earlier generations' outputs, indexed for :class:`SuffixProposer` (SuffixDecoding's
    global suffix tree, as n-gram continuation counts), kept apart by *scope*. Thread-safe.

    A generation drafts only from the outputs of its own scope and adds its output to that
    scope alone, so that one client cannot learn another's output through what is drafted
    (an accepted draft, a response's acceptance counts or its timing would tell). Each scope
    has its own token budget, so one scope's volume never evicts another's outputs (a
    shared budget would let a client sense others' traffic through its own acceptance). A
    scope is any hashable value; None is the default scope. The server's scope of a request
    is its API key and its ``cache_salt`` (vLLM's request field for cache isolation).

    Args:
        max_tokens: most output tokens kept per scope; adding more evicts that scope's
            oldest outputs first.
        min_ngram, max_ngram: n-gram sizes indexed (as the proposer's).
        max_scopes: most scopes held; a new scope beyond it evicts the least recently used
            scope (drafted from or added to) whole. Memory is bounded by ``max_scopes ×
            max_tokens`` tokens' index.
    Raises:
        ValueError: naming the bad value.
    """

    def __init__(self, max_tokens: int = DEFAULT_CORPUS_TOKENS,
                 min_ngram: int = DEFAULT_SUFFIX_NGRAM[0],
                 max_ngram: int = DEFAULT_SUFFIX_NGRAM[1],
                 max_scopes: int = DEFAULT_CORPUS_SCOPES) -> None:
        for name, value in (("max_tokens", max_tokens), ("max_scopes", max_scopes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} = {value!r} is invalid: it must be an integer ≥ 1")
        check_ngram_sizes(min_ngram, max_ngram, ("min_ngram", "max_ngram"))
        self.max_tokens, self.max_scopes = max_tokens, max_scopes
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self._scopes: OrderedDict[Hashable, _Scope] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._stamp = 0

    def add(self, token_ids: Sequence[int], scope: Hashable = None) -> None:
        """Index one output (its last ``max_tokens`` tokens) in ``scope``, evicting that
        scope's oldest outputs until it keeps at most ``max_tokens``, and the least recently
        used scope when a new one would exceed ``max_scopes``."""
        tokens = [int(t) for t in token_ids][-self.max_tokens:]
        if len(tokens) < 2:
            return
        with self._lock:
            held = self._scopes.get(scope)
            if held is None:
                if len(self._scopes) >= self.max_scopes:
                    self._scopes.popitem(last=False)
                held = self._scopes[scope] = _Scope(self.min_ngram, self.max_ngram)
            self._scopes.move_to_end(scope)
            held.index.count(tokens, 1, self._stamp)
            self._stamp += len(tokens)
            held.outputs.append(tokens)
            held.num_tokens += len(tokens)
            while held.num_tokens > self.max_tokens:
                oldest = held.outputs.popleft()
                held.index.uncount(oldest)
                held.num_tokens -= len(oldest)

    def clear(self) -> None:
        """Forget every output of every scope."""
        with self._lock:
            self._scopes.clear()

    def best(self, tail: Sequence[int], scope: Hashable = None) -> tuple[int, float] | None:
        """As :meth:`_SuffixIndex.best`, over the outputs kept in ``scope``."""
        with self._lock:
            held = self._scopes.get(scope)
            if held is None:
                return None
            self._scopes.move_to_end(scope)
            return held.index.best(tail)

    def scope_tokens(self, scope: Hashable = None) -> int:
        """Output tokens kept in ``scope``."""
        with self._lock:
            held = self._scopes.get(scope)
            return 0 if held is None else held.num_tokens

    @property
    def num_tokens(self) -> int:
        """Output tokens kept, all scopes together."""
        with self._lock:
            return sum(held.num_tokens for held in self._scopes.values())

    @property
    def num_outputs(self) -> int:
        """Outputs kept, all scopes together."""
        with self._lock:
            return sum(len(held.outputs) for held in self._scopes.values())

    @property
    def num_scopes(self) -> int:
        """Scopes held."""
        return len(self._scopes)

    @property
    def num_ngrams(self) -> int:
        """Distinct n-grams indexed, summed over scopes (the index's size: each holds a
        small dict)."""
        with self._lock:
            return sum(len(held.index.next) for held in self._scopes.values())


class SuffixProposer(Proposer):
    """Drafts the most frequent continuation of the longest earlier match of the context's
    suffix (see the module docstring).

    Args:
        min_ngram: shortest suffix matched (tokens), ≥ 1.
        max_ngram: longest suffix matched (tokens), ≥ min_ngram.
        min_confidence: the draft stops before the token whose score would bring the
            product of the scores below this, in [0, 1) (0: draft k tokens while matches
            last). The ``confidence`` policy's own threshold (``propose``'s
            ``min_confidence``) raises it.
        corpus: earlier outputs to draft from as well (None: the request's own text only);
            every finished sample's output is added to it, in the generation's scope
            (:meth:`reset`), and only that scope's outputs are drafted from.
    Raises:
        ValueError: naming the bad value.
    """

    drafts_for_free = True
    batchable = True
    supports_min_confidence = True

    def __init__(self, min_ngram: int = DEFAULT_SUFFIX_NGRAM[0], max_ngram: int = DEFAULT_SUFFIX_NGRAM[1],
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE,
                 corpus: SuffixCorpus | None = None) -> None:
        check_ngram_sizes(min_ngram, max_ngram, ("min_ngram", "max_ngram"))
        if not 0 <= min_confidence < 1:
            raise ValueError(f"min_confidence = {min_confidence!r} is invalid: it must be in "
                             "[0, 1)")
        self.min_ngram, self.max_ngram = min_ngram, max_ngram
        self.min_confidence = min_confidence
        self.corpus = corpus
        self.reset()

    def reset(self, reproducible: bool = False, scope: Hashable = None) -> None:
        self._tokens: list[int] = []  # the tokens indexed so far
        self._index = _SuffixIndex(self.min_ngram, self.max_ngram)
        self._use_corpus = self.corpus is not None and not reproducible
        self._scope = scope

    def end_sequence(self, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        if self.corpus is not None:
            self.corpus.add(token_ids[num_prompt_tokens:], self._scope)

    def propose(self, token_ids: Sequence[int], k: int, pipeline: LogitsPipeline,
                rng: torch.Generator, min_confidence: float = 0.0) -> Proposal:
        self._update(token_ids)
        threshold = max(self.min_confidence, min_confidence)
        tail = list(token_ids[-self.max_ngram:])
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
            tail = (tail + [token])[-self.max_ngram:]
        return Proposal(drafted) if drafted else EMPTY_PROPOSAL

    def _continuation(self, tail: list[int]) -> tuple[int, float] | None:
        """The better-scored continuation of the request's own index and the corpus."""
        own = self._index.best(tail)
        if not self._use_corpus:
            return own
        shared = self.corpus.best(tail, self._scope)
        return shared if own is None or (shared is not None and shared[1] > own[1]) else own

    def _update(self, token_ids: Sequence[int]) -> None:
        """Index the tokens of ``token_ids`` not indexed yet. The engine's record only grows
        between resets; anything else (a shorter or different sequence, e.g. the next
        sample) is indexed anew."""
        done = len(self._tokens)
        if done > len(token_ids) or (done and token_ids[done - 1] != self._tokens[-1]):
            self._tokens, self._index = [], _SuffixIndex(self.min_ngram, self.max_ngram)
            done = 0
        self._tokens.extend(int(t) for t in token_ids[done:])
        self._index.count(self._tokens, max(done, 1), 0)
