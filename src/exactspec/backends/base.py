"""The ``Backend`` and ``Tokenizer`` protocols: what the engine needs from a runtime.

A backend owns one model and the KV caches of the sequences it holds, each by an id the
caller chooses (a lone generation is one sequence; batched decoding holds many). The engine
drives it with ``prefill`` (append tokens to a sequence's cache, no logits), ``forward``
(append tokens to one or more sequences in one forward pass and return their logits; a
token tree through ``forward_tree``/``forward_trees``) and, after verification, ``retain``
(keep the scored rows that were accepted: a chain's prefix or a tree's accepted path, and
drop the rest); ``rollback`` (drop positions from the end of a sequence's cache) is what a
chain's ``retain`` comes down to. The contract, in
the style of llama.cpp's ``common/speculative.h`` (one state per sequence):

    requires  forward([(id, ids)]): the sequence's cache holds the tokens before ``ids``
    returns   logits [len(ids), vocab]: row i is the next-token distribution after ids[i]
    ensures   the cache holds the previous tokens + ids
    rollback(id, n) requires 0 ≤ n ≤ num_cached_tokens(id) and ensures n fewer cached tokens.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from exactspec.trees import TreePaths

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

    def constraint_tokenizer(self, vocab_size: int, eos_token_ids: Sequence[int]):
        """The tokenizer as llguidance reads it (an ``llguidance.LLTokenizer``), for
        structured output (:mod:`exactspec.constraints`): ``vocab_size`` token slots (the
        logits' width), ``eos_token_ids`` allowed where a constraint is complete. Built
        once per arguments (about a second for a real vocabulary) and cached."""
        ...


FIRST_SEQUENCE_ID = 1 << 20
"""Where :func:`new_sequence_id` starts: ids below are free for callers who pick their own."""
_sequence_ids = itertools.count(FIRST_SEQUENCE_ID)


def new_sequence_id() -> int:
    """A sequence id no other caller of this function in this process gets (engines,
    proposers and batches sharing one backend never touch each other's sequences)."""
    return next(_sequence_ids)


class TargetTensors(NamedTuple):
    """The target's tensors a draft head reads (:class:`~exactspec.draft_head.model.DraftHead`),
    float32 on the CPU, as the backend computes with them (a quantised file's weights
    dequantised). ``embedding`` ``[vocab, h]`` (the input embedding), ``final_norm_weight``
    ``[h]`` (the final RMSNorm's weight), ``lm_head_weight`` ``[vocab, h]`` (the output
    projection; the embedding itself where they are tied), ``num_layers`` (decoder layers)."""

    embedding: torch.Tensor
    final_norm_weight: torch.Tensor
    lm_head_weight: torch.Tensor
    num_layers: int


@runtime_checkable
class Backend(Protocol):
    """One model with the KV caches of the sequences it holds, by id.

    Attributes:
        name: the runtime, as ``--backend`` names it (``transformers``, ``llama_cpp``):
            what peers and proposers that need one runtime's model check.
        tokenizer: the model's :class:`Tokenizer`.
        vocab_size: width of the logits (may exceed the tokenizer's size: padding).
        max_context_length: most positions a sequence may hold (tokens), or None.
        eos_token_ids: ids that end generation (may be empty).
        device: where logits are returned.
        description: the runtime in a few words, for summaries (e.g. "llama.cpp, 2 threads").
        batch_invariant: whether a block of tokens scored in one ``forward`` gets
            bit-identical logits to the same tokens scored one at a time, as measured on the
            loaded model by :func:`check_batch_invariance`. The engine refuses to
            speculate on a backend where it is False unless told to accept rounding
            differences.
        batch_variance_fix: what to tell a user whose backend is not batch-invariant.
        max_sequences: most sequences that can be held at once now (:meth:`reserve` may
            raise it).
        prefill_chunk_size: tokens :meth:`prefill` scores per forward pass; a prefill that
            continues a cache holding a multiple of it makes the very cache entries one
            call over all the tokens would have made (chunked prefill).
        sequences_invariant: whether a sequence scored in a ``forward`` with others gets
            bit-identical logits to scoring it alone, as measured on the loaded model by
            :func:`check_sequence_invariance` the first time it is read (after a
            :meth:`reserve` that changed the caches, again).
        provides_hidden_features: whether :meth:`record_hidden_features`,
            :meth:`hidden_features` and :meth:`target_tensors` work (a draft head needs
            them); False: they raise :class:`UnsupportedModelError`.
        scores_trees: whether :meth:`forward_tree` and :meth:`retain` take token trees
            (tree drafting needs them); False: they raise :class:`UnsupportedModelError`.
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
    max_sequences: int
    prefill_chunk_size: int
    provides_hidden_features: bool
    scores_trees: bool

    @property
    def sequences_invariant(self) -> bool: ...

    def reserve(self, num_sequences: int) -> None:
        """Make room for ``num_sequences`` sequences held at once (may allocate their caches).

        Raises:
            ValueError: beyond what the backend can hold (naming the limit), or when room
                cannot be made while sequences are held.
        """
        ...

    def prefill(self, sequence_id: int, token_ids: Sequence[int]) -> None:
        """Append ``token_ids`` (may be empty) to a sequence's cache, ``prefill_chunk_size``
        tokens per forward pass, no logits; a sequence not held is held from here.

        Raises:
            ValueError: if the sequence would exceed the context, or no more sequences
                can be held (naming ``max_sequences``).
        """
        ...

    def forward(self, rows: Sequence[tuple[int, Sequence[int]]],
                num_logits: int | None = None) -> list[torch.Tensor]:
        """Append each row's tokens (``(sequence_id, token_ids)``, at least one token each,
        each sequence at most once, each held) to its sequence's cache, all in one forward
        pass.

        Args:
            rows: the sequences to score and their new tokens.
            num_logits: return the logits of each row's last ``num_logits`` tokens only
                (None: all of them).
        Returns:
            one ``[num_logits or len(token_ids), vocab_size]`` float logits tensor per row,
            in order, on ``device``; row i of one is the next-token distribution after its
            token i.
        Raises:
            ValueError: for no rows, an empty row, a sequence not held, or a sequence that
                would exceed the context.
        """
        ...

    def forward_tree(self, sequence_id: int, token_ids: Sequence[int],
                     parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree to a sequence's cache in one forward pass (SpecInfer's tree
        attention, :mod:`exactspec.trees`): node i (``token_ids[i]``, at position cached +
        its depth) attends to the cache and to its own root-to-node path only, so its logits
        are bit for bit those of :meth:`forward` over that path (on a batch-invariant
        backend).

        Args:
            token_ids: ``[n]`` the nodes; node 0 is the root.
            parents: ``[n]`` each node's parent: −1 for node 0, an earlier node for the rest.
        Returns:
            ``[n, vocab_size]`` float logits on ``device``; row i is the next-token
            distribution after node i's path.
        Raises:
            UnsupportedModelError: if the backend cannot (``scores_trees``).
            ValueError: for a malformed tree, a sequence not held, or a path that would
                exceed the context.
        """
        ...

    def forward_trees(self, rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
                      ) -> list[torch.Tensor]:
        """:meth:`forward` of rows some of which are token trees (batched tree drafting):
        each ``(sequence_id, token_ids, parents)``, ``parents`` None for a chain or a tree's
        parents as :meth:`forward_tree` takes them. The native backend scores them all in
        one packed forward; the others may take one forward per tree (:func:`forward_trees_apart`).

        Returns:
            one ``[len(token_ids), vocab_size]`` float logits tensor per row, in order.
        Raises:
            UnsupportedModelError: for a tree if the backend cannot (``scores_trees``).
            ValueError: as :meth:`forward` and :meth:`forward_tree`.
        """
        ...

    def retain(self, sequence_id: int, num_rows: int, keep: Sequence[int]) -> None:
        """Of the last ``num_rows`` cached positions (a tree's nodes), keep the rows
        ``keep`` (ascending: an accepted path) as the sequence's last positions, in order,
        and drop the others (their recorded hidden features too).

        Raises:
            UnsupportedModelError: if the backend cannot (``scores_trees``) and ``keep`` is
                not a prefix of the rows (a prefix is a :meth:`rollback`).
            ValueError: if ``num_rows`` exceeds what the sequence holds, ``keep`` is not
                ascending within [0, num_rows), or the sequence is not held.
        """
        ...

    def rollback(self, sequence_id: int, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` positions of a sequence's cache.

        Raises:
            ValueError: if ``num_tokens`` is negative or exceeds what the sequence holds, or
                the sequence is not held.
        """
        ...

    def release(self, sequence_id: int) -> None:
        """Forget a sequence and its cache (no error if it is not held)."""
        ...

    def num_cached_tokens(self, sequence_id: int) -> int:
        """Tokens in a sequence's cache.

        Raises:
            ValueError: if the sequence is not held.
        """
        ...

    def record_hidden_features(self, layers: Sequence[int]) -> None:
        """From now on keep, for every position a sequence held from here on caches, the
        outputs of decoder ``layers`` (0-based) at that position, as the forward pass that
        cached it computed them (no extra forward; :meth:`rollback` drops them with the
        position).

        Raises:
            UnsupportedModelError: if the backend cannot (``provides_hidden_features``).
            ValueError: for layers outside the model, or other layers than an earlier call's.
        """
        ...

    def hidden_features(self, sequence_id: int, start: int) -> torch.Tensor:
        """``[num_cached_tokens − start, len(layers) · hidden]`` float32: the recorded layer
        outputs (concatenated in ``layers`` order) of the sequence's cached positions
        ``start`` … ``num_cached_tokens − 1``.

        Raises:
            UnsupportedModelError: if the backend cannot (``provides_hidden_features``).
            ValueError: if the sequence is not held, was cached before recording started,
                or ``start`` is outside [0, num_cached_tokens].
        """
        ...

    def target_tensors(self) -> TargetTensors:
        """The embedding, final norm and LM head a draft head reads, as this backend
        computes with them (:class:`TargetTensors`; made on first call, then kept).

        Raises:
            UnsupportedModelError: if the backend cannot (``provides_hidden_features``).
        """
        ...


def forward_trees_apart(backend: Backend,
                        rows: Sequence[tuple[int, Sequence[int], Sequence[int] | None]]
                        ) -> list[torch.Tensor]:
    """``Backend.forward_trees`` by one :meth:`~Backend.forward` of the chains and one
    :meth:`~Backend.forward_tree` per tree (for backends that do not pack trees)."""
    chains = [i for i, (_, _, parents) in enumerate(rows) if parents is None]
    logits: list[torch.Tensor | None] = [None] * len(rows)
    if chains:
        scored = backend.forward([(rows[i][0], rows[i][1]) for i in chains])
        for i, row_logits in zip(chains, scored):
            logits[i] = row_logits
    for i, (sequence_id, token_ids, parents) in enumerate(rows):
        if parents is not None:
            logits[i] = backend.forward_tree(sequence_id, token_ids, parents)
    return logits


def check_rows(rows: Sequence[tuple[int, Sequence[int]]], num_logits: int | None) -> None:
    """Raise ``ValueError`` unless ``forward``'s arguments are well formed: at least one row,
    a token in each, ``num_logits`` None or an integer ≥ 1."""
    if not rows or any(len(token_ids) == 0 for _, token_ids in rows):
        raise ValueError("forward needs at least one row and at least one token in each")
    if num_logits is not None and (isinstance(num_logits, bool) or not isinstance(num_logits, int)
                                   or num_logits < 1):
        raise ValueError(f"num_logits = {num_logits!r} is invalid: it must be None or an "
                         "integer ≥ 1")


def check_reserve(backend: Backend, num_sequences: int) -> None:
    """Raise ``ValueError`` unless ``num_sequences`` is an integer in [1,
    ``backend.max_sequences``] (``reserve`` of a backend whose caches grow as used)."""
    if (not isinstance(num_sequences, int) or isinstance(num_sequences, bool)
            or not 1 <= num_sequences <= backend.max_sequences):
        raise ValueError(f"{num_sequences!r} sequences cannot be reserved: this backend "
                         f"holds 1 to {backend.max_sequences}")


def check_tree(token_ids: Sequence[int], parents: Sequence[int]) -> TreePaths:
    """The :class:`~exactspec.trees.TreePaths` of ``forward_tree``'s arguments, or
    ``ValueError`` unless they are one tree rooted at node 0 with a parent per node."""
    if not token_ids or len(parents) != len(token_ids):
        raise ValueError(f"a tree needs at least one node and one parent per node; got "
                         f"{len(token_ids)} nodes and {len(parents)} parents")
    if parents[0] != -1 or -1 in parents[1:]:
        raise ValueError(f"parents {list(parents)} are invalid: node 0 is the one root (-1)")
    return TreePaths(list(parents))


def check_retain(num_rows: int, keep: Sequence[int], num_cached: int) -> list[int]:
    """``keep`` as a list, or ``ValueError`` unless ``retain``'s arguments are well formed
    for a sequence holding ``num_cached`` positions."""
    keep = [int(row) for row in keep]
    if not 0 <= num_rows <= num_cached or any(
            not 0 <= row < num_rows for row in keep) or sorted(set(keep)) != keep:
        raise ValueError(f"retain({num_rows}, {keep}) is invalid: keep ascending rows of the "
                         f"last num_rows ≤ {num_cached} positions")
    return keep


def check_context(backend: Backend, cached: int, adding: int, context: str = "model's") -> None:
    """Raise ``ValueError`` if a sequence holding ``cached`` tokens cannot take ``adding``
    more within ``backend.max_context_length`` (``context`` names whose, in the message)."""
    limit = backend.max_context_length
    if limit is not None and cached + adding > limit:
        raise ValueError(f"{cached + adding} tokens exceed the {context} context of {limit} "
                         "tokens")


def forward_one(backend: Backend, sequence_id: int, token_ids: Sequence[int],
                num_logits: int | None = None) -> torch.Tensor:
    """``backend.forward`` of one sequence: ``[num_logits or len(token_ids), vocab]``."""
    return backend.forward([(sequence_id, token_ids)], num_logits)[0]


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
    blocks. Holds no sequence afterwards."""
    token_ids = [(7 * i + 1) % backend.vocab_size for i in range(num_tokens + 1)]
    block_id, single_id = new_sequence_id(), new_sequence_id()
    try:
        backend.prefill(block_id, token_ids[:1])
        block = forward_one(backend, block_id, token_ids[1:])  # [num_tokens, vocab]
        backend.release(block_id)
        backend.prefill(single_id, token_ids[:1])
        start = time.perf_counter()
        singles = torch.cat([forward_one(backend, single_id, [token])
                             for token in token_ids[1:]])
        seconds_per_token = (time.perf_counter() - start) / num_tokens
    finally:
        backend.release(block_id)
        backend.release(single_id)
    return BatchInvarianceCheck(torch.equal(block, singles), seconds_per_token)


def check_sequence_invariance(backend: Backend) -> bool:
    """Score up to three sequences of different lengths together in one ``forward`` (rows
    of 3, 1 and 5 tokens; as many as the backend holds now) and each token of each alone,
    one token per forward, and compare bit for bit. Holds no sequence afterwards."""
    vocab = backend.vocab_size
    count = min(3, backend.max_sequences)
    prompts = [[(5 * i + 3 * j + 1) % vocab for j in range(length)]
               for i, length in enumerate((4, 1, 7))][:count]
    rows = [[(11 * i + 7 * j + 2) % vocab for j in range(length)]
            for i, length in enumerate((3, 1, 5))][:count]
    ids = [new_sequence_id() for _ in range(count)]
    try:
        for sequence_id, prompt in zip(ids, prompts):
            backend.prefill(sequence_id, prompt)
        together = backend.forward(list(zip(ids, rows)))
    finally:
        for sequence_id in ids:
            backend.release(sequence_id)
    invariant = True
    for sequence_id, prompt, row, logits in zip(ids, prompts, rows, together):
        try:
            backend.prefill(sequence_id, prompt)
            alone = torch.cat([forward_one(backend, sequence_id, [token]) for token in row])
        finally:
            backend.release(sequence_id)
        invariant = invariant and torch.equal(alone, logits)
    return invariant
