"""The ``Backend`` and ``Tokenizer`` protocols: what the engine needs from a runtime.

A backend owns one model and the KV cache of one sequence. The engine drives it with
``prefill`` (fill the cache, no logits), ``forward`` (append tokens, return their logits)
and ``rollback`` (drop rejected positions from the end of the cache). The contract, in the
style of llama.cpp's ``common/speculative.h``:

    requires  forward(ids): the cache holds the tokens before ``ids``
    returns   logits [len(ids), vocab]: row i is the next-token distribution after ids[i]
    ensures   the cache holds the previous tokens + ids
    rollback(n) requires 0 ≤ n ≤ num_cached_tokens and ensures n fewer cached tokens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

PREFILL_CHUNK_SIZE = 512
"""Tokens a backend's prefill scores per forward pass (llama.cpp: its ``n_batch``), and so
the chunk batched decoding prefills a joining prompt in between decoding cycles."""


def chat_messages(prompt: str | Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """:meth:`Tokenizer.apply_chat_template`'s argument as a list of messages."""
    return ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
            else [dict(message) for message in prompt])


class UnsupportedModelError(ValueError):
    """A model that exactspec cannot run exactly (e.g. a KV cache that cannot roll back)."""


@runtime_checkable
class Tokenizer(Protocol):
    """Text ↔ token ids for one model."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``, with the model's usual special tokens (e.g. BOS) unless
        ``add_special_tokens`` is False."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of ``token_ids``, special tokens (EOS, ...) left out."""
        ...

    def apply_chat_template(self, prompt: str | Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation through the model's chat template, ready for the
        assistant's answer: ``prompt`` is one user turn (a string) or the messages
        (``{"role": ..., "content": ...}`` dicts, OpenAI's chat format).

        Raises:
            ValueError: if the model has no chat template.
        """
        ...

    def get_vocab(self) -> dict[str, int]:
        """Token string → id, for checking that a draft shares the target's tokenizer."""
        ...


@runtime_checkable
class Backend(Protocol):
    """One model with the KV cache of one sequence.

    Attributes:
        name: the runtime, as ``--backend`` names it (``transformers``, ``llama_cpp``):
            what peers and drafters that need one runtime's model check.
        tokenizer: the model's :class:`Tokenizer`.
        vocab_size: width of the logits (may exceed the tokenizer's size: padding).
        max_context_length: most positions the model supports (tokens), or None.
        eos_token_ids: ids that end generation (may be empty).
        device: where logits are returned.
        description: the runtime in a few words, for summaries (e.g. "llama.cpp, 2 threads").
        num_cached_tokens: tokens currently in the KV cache.
        batch_invariant: whether a block of tokens scored in one ``forward`` gets
            bit-identical logits to the same tokens scored one at a time, as measured on the
            loaded model by :func:`check_batch_invariance`. The engine refuses to
            speculate on a backend where it is False unless told to accept rounding
            differences.
        batch_variance_fix: what to tell a user whose backend is not batch-invariant.
        supports_batches: whether it is also a :class:`BatchBackend` (holds several
            sequences and scores them in one forward).
    """

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_context_length: int | None
    eos_token_ids: tuple[int, ...]
    device: torch.device
    description: str
    batch_invariant: bool
    batch_variance_fix: str
    supports_batches: bool

    @property
    def num_cached_tokens(self) -> int: ...

    def prefill(self, token_ids: Sequence[int]) -> None:
        """Empty the cache, then fill it with ``token_ids`` (may be empty); no logits."""
        ...

    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> torch.Tensor:
        """Append ``token_ids`` (at least one) to the cache in one forward pass.

        Args:
            token_ids: tokens to score.
            num_logits: return logits for only the last ``num_logits`` positions
                (None: all of them).
        Returns:
            ``[num_logits or len(token_ids), vocab_size]`` float logits on ``device``.
        """
        ...

    def rollback(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions from the cache.

        Raises:
            ValueError: if ``num_tokens`` is negative or exceeds ``num_cached_tokens``.
        """
        ...


@runtime_checkable
class BatchBackend(Backend, Protocol):
    """A backend that also holds any number of sequences by id, besides its own one, and
    scores several of them in one forward (batched decoding,
    :class:`~exactspec.batching.BatchedGenerator`). Row i of a batched forward must get
    bit-identical logits to scoring that sequence alone, whatever its companions.

    Attributes:
        max_sequences: most sequences that can be held now, besides the main one
            (:meth:`reserve_sequences` may raise it).
        prefill_chunk_size: tokens a prefill scores per forward pass, in :meth:`prefill`
            and :meth:`prefill_sequence` alike; :meth:`extend_sequence` continues a prefill
            from a multiple of it with the very cache entries one call would have made.
        sequences_invariant: whether it does, as measured on the loaded model by
            :func:`check_sequence_invariance` the first time it is read.
    """

    max_sequences: int
    prefill_chunk_size: int

    @property
    def sequences_invariant(self) -> bool: ...

    def reserve_sequences(self, num_sequences: int) -> None:
        """Make room for ``num_sequences`` sequences held at once (may allocate their caches).

        Raises:
            ValueError: beyond what the backend can hold (naming the limit), or when room
                cannot be made while sequences are held.
        """
        ...

    def prefill_sequence(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        """Hold a new sequence ``sequence_id`` (replacing one of that id) with ``token_ids``
        in its cache (may be empty); no logits."""
        ...

    def extend_sequence(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` to a sequence's cache as a prefill does (no logits), for
        chunked prefill: from a cache holding a multiple of ``prefill_chunk_size`` tokens,
        ``prefill_sequence(id, a)`` then ``extend_sequence(id, b)`` leaves bit for bit the
        cache ``prefill_sequence(id, a + b)`` leaves.

        Raises:
            ValueError: if the sequence is not held or would exceed the context.
        """
        ...

    def forward_sequences(self, rows: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """Append each row's tokens (``(sequence_id, token_ids)``, at least one token each,
        each sequence at most once) to its sequence's cache, all in one forward pass.

        Returns:
            one ``[len(token_ids), vocab_size]`` logits tensor per row, in order; row i of
            one is the next-token distribution after its token i.
        Raises:
            ValueError: for an empty row or a sequence not held.
        """
        ...

    def rollback_sequence(self, sequence_id: int, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions of a sequence's cache.

        Raises:
            ValueError: if ``num_tokens`` is negative or exceeds what the sequence holds, or
                the sequence is not held.
        """
        ...

    def release_sequence(self, sequence_id: int) -> None:
        """Forget a sequence (no error if it is not held)."""
        ...

    def cached_tokens(self, sequence_id: int) -> int:
        """Tokens in a sequence's cache."""
        ...


class BatchInvarianceCheck(NamedTuple):
    """What :func:`check_batch_invariance` found.

    Attributes:
        invariant: every logit of the block equals the single-token one bit for bit.
        seconds_per_token: mean seconds of the single-token forwards (a speed reference).
    """

    invariant: bool
    seconds_per_token: float


def check_batch_invariance(backend: Backend, num_tokens: int = 9) -> BatchInvarianceCheck:
    """Score ``num_tokens`` tokens in one ``forward`` and the same tokens one at a time after
    the same one-token prefix, and compare. 9 tokens reach the batched kernels llama.cpp
    builds switch to from 4 rows on and span two of the transformers backend's fixed-size
    blocks. Leaves the cache empty."""
    token_ids = [(7 * i + 1) % backend.vocab_size for i in range(num_tokens + 1)]
    backend.prefill(token_ids[:1])
    block = backend.forward(token_ids[1:])  # [num_tokens, vocab]
    backend.prefill(token_ids[:1])
    start = time.perf_counter()
    singles = torch.cat([backend.forward([token]) for token in token_ids[1:]])
    seconds_per_token = (time.perf_counter() - start) / num_tokens
    backend.prefill([])
    return BatchInvarianceCheck(torch.equal(block, singles), seconds_per_token)


def check_sequence_invariance(backend: BatchBackend) -> bool:
    """Score up to three sequences of different lengths together in one
    :meth:`~BatchBackend.forward_sequences` (rows of 3, 1 and 5 tokens; as many as the
    backend holds now, three where it holds none yet) and each token of each alone through the one-sequence
    API (``prefill`` + ``forward`` of one token), and compare bit for bit. Leaves no
    sequence held and the main cache empty."""
    vocab = backend.vocab_size
    if not backend.max_sequences:
        backend.reserve_sequences(3)
    count = min(3, backend.max_sequences)
    prompts = [[(5 * i + 3 * j + 1) % vocab for j in range(length)]
               for i, length in enumerate((4, 1, 7))][:count]
    rows = [[(11 * i + 7 * j + 2) % vocab for j in range(length)]
            for i, length in enumerate((3, 1, 5))][:count]
    ids = [-1, -2, -3][:count]  # ids no caller uses
    try:
        for sequence_id, prompt in zip(ids, prompts):
            backend.prefill_sequence(sequence_id, prompt)
        together = backend.forward_sequences(list(zip(ids, rows)))
    finally:
        for sequence_id in ids:
            backend.release_sequence(sequence_id)
    invariant = True
    for prompt, row, logits in zip(prompts, rows, together):
        backend.prefill(prompt)
        alone = torch.cat([backend.forward([token]) for token in row])
        invariant = invariant and torch.equal(alone, logits)
    backend.prefill([])
    return invariant
