"""The exact reference: the target's processed next-token distribution after each sampled
prefix of a prompt's continuation, computed from its logits (no sampling).

p(· | prompt, x_<j) is the target's logits after ``prompt + x_<j`` passed through the
same :class:`~exactspec.logits_pipeline.LogitsPipeline` that decoding uses (penalties,
bans, temperature, top-k, top-p, min-p), with the true history. The logits are computed
as plain decoding computes them, one token per forward pass on the cached context: the
prefixes are visited depth first (sorted order), so each costs one single-token forward
and the cache is rolled back between branches, never re-encoded. The reference is then
plain decoding by construction, whether or not the backend scores a block of tokens
bit-identically to single tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.logits_pipeline import LogitsPipeline, NoTokenAllowedError


def next_token_probs(target: Backend, prompt_ids: Sequence[int], pipeline: LogitsPipeline,
                     prefixes: Sequence[tuple[int, ...]]) -> Iterator[tuple[tuple[int, ...],
                                                                             np.ndarray]]:
    """The exact next-token distribution after ``prompt_ids + prefix`` for each prefix.

    Args:
        target: the target backend (one sequence held while the generator runs).
        prompt_ids: ``[prompt_len]`` the prompt as the model sees it (non-empty).
        pipeline: built for ``prompt_ids`` and the audited sampling parameters.
        prefixes: continuations to score, sorted, every prefix of one listed before it
            (as :func:`~exactspec.audit.stats.fit_tree` passes them).
    Yields:
        ``(prefix, probs)``, ``probs`` ``[vocab]`` float64 summing to 1, in the order given.
    Raises:
        ValueError: if the prompt is empty or a prefix's parent was not listed before it.
    """
    if not prompt_ids:
        raise ValueError("the reference needs a non-empty prompt")
    prompt_ids = list(prompt_ids)
    sequence = new_sequence_id()
    try:
        target.prefill(sequence, prompt_ids[:-1])
        path: tuple[int, ...] | None = None  # the continuation in the cache after the prompt
        for prefix in prefixes:
            if not prefix:
                target.rollback(sequence, target.num_cached_tokens(sequence) - (len(prompt_ids) - 1))
                logits = forward_one(target, sequence, prompt_ids[-1:])
            else:
                if path is None or path[: len(prefix) - 1] != prefix[:-1]:
                    raise ValueError(f"prefix {prefix} comes before its parent: pass prefixes "
                                     "sorted and closed under taking prefixes")
                target.rollback(sequence, len(path) - (len(prefix) - 1))
                logits = forward_one(target, sequence, prefix[-1:])
            path = prefix
            processed = pipeline.process(logits, prompt_ids + list(prefix))
            if pipeline.first_empty_row(processed) is not None:
                raise NoTokenAllowedError(len(prefix))
            probs = pipeline.probs(processed)[0]
            probs = probs.double().cpu().numpy()
            yield prefix, probs / probs.sum()
    finally:
        target.release(sequence)
