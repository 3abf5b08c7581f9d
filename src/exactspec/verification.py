"""Verification: the rejection sampler that makes speculative decoding exact.

Source: Leviathan, Kalman & Matias, "Fast Inference from Transformers via Speculative
Decoding" (arXiv 2211.17192), Algorithm 1; Chen et al. (arXiv 2302.01318), Algorithm 2.

Glossary (docs/design.md):
    p  target probability (``target_probs``), q  draft probability (``draft_probs``).
    accepted token   a drafted token kept: drafted x_i is accepted with probability
                     min(1, p_i(x_i) / q_i(x_i)), in order, until the first rejection.
    recovered token  after the first rejection at position j, one token sampled from the
                     residual distribution normalize(max(0, p_j − q_j)).
    bonus token      when all k drafts are accepted, one token sampled from p_{k+1}.
Each row commits ``num_accepted + 1`` tokens: the accepted drafts, then one recovered or
bonus token. The committed tokens follow p exactly, whatever q is.

Edge cases handled here (the exactness contract):
    * q(x) = 0 for a drafted token: rejected, never a division (``u·q < p`` in float64).
    * p(x) = 0: never accepted (strict inequality), whatever u is.
    * residual mass 0 (p == q in floating point): sample from p instead.
    * point-mass proposers (greedy draft, n-gram lookup) pass ``draft_probs=None``: q is
      one-hot on the drafted token, so acceptance is ``u < p(x)`` and the residual is p with
      the drafted token removed.
    * k = 0: the bonus token is sampled from p_1, i.e. plain sampling.

Random numbers: the stochastic sampler draws exactly ``batch × k`` float64 uniforms for
acceptance, then ``batch`` float64 uniforms for the recovered/bonus tokens
(``sampling.sample_from_probs``, inverse CDF in float64). This fixed consumption lets the
tests replay it with a slow reference implementation and compare token for token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from exactspec.logits_pipeline import (LogitsPipeline, NoTokenAllowedError, check_finite,
                                       greedy_tokens)
from exactspec.sampling import sample_from_probs

PADDING_TOKEN_ID = -1
"""Fills the positions of ``output_token_ids`` after the last committed token."""


class VerificationResult(NamedTuple):
    """What one verification pass commits.

    Attributes:
        output_token_ids: ``[batch, k+1]`` int64: the accepted drafts, then the recovered or
            bonus token, then ``PADDING_TOKEN_ID`` (-1).
        num_accepted: ``[batch]`` int64: accepted drafted tokens per row, in 0..k.
        uniforms: ``[batch, k]`` float64: the acceptance uniforms the stochastic sampler
            drew (draft i accepted iff u·q < p); None for greedy verification.
    """

    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor
    uniforms: torch.Tensor | None = None


class TokenLogprob(NamedTuple):
    """One emitted token's log-probability under the target's processed distribution.

    Attributes:
        token_id: the emitted token.
        logprob: its natural-log probability (≤ 0; -inf cannot occur for a sampled token).
        top: the ``logprobs`` most likely tokens at that position as (token_id, logprob),
            most likely first.
    """

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class Verified(NamedTuple):
    """One cycle's verification.

    Attributes:
        committed: the tokens to commit: accepted drafts, then the recovered or bonus token.
        num_accepted: drafts accepted.
        logprobs: the committed tokens' :class:`TokenLogprob` (when asked), else None.
        processed: ``[k+1, vocab]`` the target's processed logits the verdict came from.
        target_probs: ``[k+1, vocab]`` their probabilities (p) when sampling; None when
            greedy.
        uniforms: ``[k]`` float64 acceptance uniforms of the stochastic verifier; None
            when greedy.
        path: for a tree (:func:`verify_tree`), the accepted nodes' rows of the scored
            block (ascending, root excluded); then ``processed`` and ``target_probs`` hold
            the rows of the root and that path only. None for a chain.
    """

    committed: list[int]
    num_accepted: int
    logprobs: list[TokenLogprob] | None
    processed: torch.Tensor
    target_probs: torch.Tensor | None
    uniforms: torch.Tensor | None
    path: list[int] | None = None


def rejection_sample(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None (point-mass proposer)
    target_probs: torch.Tensor,  # [batch, k+1, vocab]
    rng: torch.Generator,
) -> VerificationResult:
    """Stochastic verification (Leviathan et al. Algorithm 1, vectorised over batch and k).

    Args:
        draft_token_ids: ``[batch, k]`` drafted token ids, each in ``[0, vocab)``.
        draft_probs: ``[batch, k, vocab]`` the exact distributions the drafts were sampled
            from, or None for a point-mass proposer (q is one-hot on the drafted token).
        target_probs: ``[batch, k+1, vocab]`` the target's processed probabilities at the
            k drafted positions and the bonus position.
        rng: source of all randomness (on the tensors' device).
    Returns:
        :class:`VerificationResult`.
    Raises:
        ValueError: on inconsistent shapes. Drafted ids must lie in ``[0, vocab)``.
    """
    batch, k = _check_shapes(draft_token_ids, target_probs)
    if draft_probs is not None and draft_probs.shape != (batch, k, target_probs.shape[-1]):
        raise ValueError(
            f"draft_probs has shape {tuple(draft_probs.shape)}; expected "
            f"{(batch, k, target_probs.shape[-1])} (batch, k, vocab)"
        )
    device = target_probs.device
    uniforms = torch.rand((batch, k), dtype=torch.float64, device=device, generator=rng)

    positions = torch.arange(k + 1, device=device)
    drafted = draft_token_ids.unsqueeze(-1)
    p_drafted = target_probs[:, :k].gather(-1, drafted).squeeze(-1).double()  # [batch, k]
    if draft_probs is None:
        q_drafted = torch.ones_like(p_drafted)
    else:
        q_drafted = draft_probs.gather(-1, drafted).squeeze(-1).double()
    # u < p/q without dividing; q = 0 is a rejection, p = 0 can never pass the strict test.
    accepted = (q_drafted > 0) & (uniforms * q_drafted < p_drafted)  # [batch, k]
    num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [batch]

    final_probs = final_distribution(draft_token_ids, draft_probs, target_probs, num_accepted)
    final_tokens = sample_from_probs(final_probs, rng)  # [batch]
    rows = torch.arange(batch, device=device)

    drafted_padded = torch.cat([draft_token_ids, draft_token_ids.new_zeros(batch, 1)], dim=-1)
    output = torch.where(positions < num_accepted.unsqueeze(-1), drafted_padded,
                         torch.full_like(drafted_padded, PADDING_TOKEN_ID))
    output[rows, num_accepted] = final_tokens
    return VerificationResult(output, num_accepted, uniforms)


def final_distribution(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    draft_probs: torch.Tensor | None,  # [batch, k, vocab] or None (point-mass proposer)
    target_probs: torch.Tensor,  # [batch, k+1, vocab]
    num_accepted: torch.Tensor,  # [batch] int64
) -> torch.Tensor:
    """The distribution each row's final token is drawn from: after a rejection at position
    j = ``num_accepted`` (< k) the residual max(0, p_j − q_j), or p_j itself where the
    residual has no mass (p == q in floating point); after full acceptance p_{k+1} (the
    bonus token). Leviathan et al. 2022, Algorithm 1.

    Args:
        draft_token_ids: ``[batch, k]`` the drafted token ids.
        draft_probs: ``[batch, k, vocab]`` q, or None for a point-mass proposer (q one-hot
            on the drafted token: the residual is p without that token).
        target_probs: ``[batch, k+1, vocab]`` p at the k drafted positions and the bonus one.
        num_accepted: ``[batch]`` accepted drafts per row, in 0..k.
    Returns:
        ``[batch, vocab]`` float64 non-negative weights, not normalised (each row has mass
        when p does; :func:`~exactspec.sampling.sample_from_probs` draws from it as it is).
    """
    batch, k = draft_token_ids.shape
    rows = torch.arange(batch, device=target_probs.device)
    final_probs = target_probs[rows, num_accepted].double()  # [batch, vocab]
    if k == 0:
        return final_probs
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_final = torch.zeros_like(final_probs)
        q_final[rows, draft_token_ids[rows, at]] = 1.0
    else:
        q_final = draft_probs[rows, at].double()
    residual = (final_probs - q_final).clamp(min=0)
    has_mass = residual.sum(dim=-1, keepdim=True) > 0
    use_residual = (num_accepted < k).unsqueeze(-1) & has_mass
    return torch.where(use_residual, residual, final_probs)


def greedy_verify(
    draft_token_ids: torch.Tensor,  # [batch, k] int64
    target_token_ids: torch.Tensor,  # [batch, k+1] int64: the target's argmax per position
) -> VerificationResult:
    """Exact greedy verification: a draft is accepted iff it equals the target's argmax.

    The committed tokens are the target's argmax tokens up to and including the first
    mismatch (the recovered token) or the bonus position, so the output equals plain greedy
    decoding token for token (given batch-invariant kernels; docs/design.md, "Floating point is part of exactness").

    Args:
        draft_token_ids: ``[batch, k]`` drafted token ids.
        target_token_ids: ``[batch, k+1]`` greedy tokens of the target at each position.
    Returns:
        :class:`VerificationResult`.
    Raises:
        ValueError: on inconsistent shapes.
    """
    if target_token_ids.dim() != 2 or draft_token_ids.dim() != 2 or (
        target_token_ids.shape != (draft_token_ids.shape[0], draft_token_ids.shape[1] + 1)
    ):
        raise ValueError(
            f"greedy_verify needs draft_token_ids [batch, k] and target_token_ids "
            f"[batch, k+1]; got {tuple(draft_token_ids.shape)} and "
            f"{tuple(target_token_ids.shape)}"
        )
    k = draft_token_ids.shape[1]
    matches = draft_token_ids == target_token_ids[:, :k]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(k + 1, device=target_token_ids.device)
    output = target_token_ids.masked_fill(positions > num_accepted.unsqueeze(-1),
                                          PADDING_TOKEN_ID)
    return VerificationResult(output, num_accepted)


def greedy_accept_length(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """:func:`greedy_verify` for one sequence on host lists: the number of leading drafts
    (``[k]``) equal to the target's argmax tokens (``[k+1]``); the committed tokens are
    ``target_token_ids[:n + 1]``. Cheaper than tensor operations for one short row, which
    matters when a forward pass takes only milliseconds (llama.cpp)."""
    num_accepted = 0
    for draft, target in zip(draft_token_ids, target_token_ids):
        if draft != target:
            break
        num_accepted += 1
    return num_accepted


def _check_shapes(draft_token_ids: torch.Tensor, target_probs: torch.Tensor) -> tuple[int, int]:
    if draft_token_ids.dim() != 2 or target_probs.dim() != 3:
        raise ValueError(
            f"expected draft_token_ids [batch, k] and target_probs [batch, k+1, vocab]; got "
            f"{tuple(draft_token_ids.shape)} and {tuple(target_probs.shape)}"
        )
    batch, k = draft_token_ids.shape
    if target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs has shape {tuple(target_probs.shape)}; expected "
            f"({batch}, {k + 1}, vocab) for draft_token_ids of shape {(batch, k)}"
        )
    return batch, k


def verify(tokens: Sequence[int], draft_token_ids: list[int], draft_probs: torch.Tensor | None,
           logits: torch.Tensor, pipeline: LogitsPipeline, rng: torch.Generator | None,
           sampler=rejection_sample) -> Verified:
    """Verify one sequence's cycle: process every row of ``logits`` with its true history
    and commit the accepted drafts and the recovered or bonus token (Algorithm 1 above;
    greedy: the target's argmax while it agrees with the drafts).

    Args:
        tokens: the sequence so far (prompt + committed); ``logits`` scored
            ``[tokens[-1], *draft_token_ids]``.
        draft_token_ids: ``[k]`` the drafts.
        draft_probs: ``[k, vocab]`` q for each draft, or None for a point-mass proposer.
        logits: ``[k+1, vocab]`` the target's raw logits of that block, one forward pass.
        pipeline: the sequence's logits processing.
        rng: its random source (unused when greedy).
        sampler: the stochastic verifier (:func:`rejection_sample`; the audit's broken
            controls pass another).
    Returns:
        :class:`Verified`.
    Raises:
        ValueError: if ``logits`` holds NaN or infinity where a token could be chosen
            (:func:`~exactspec.logits_pipeline.check_finite`).
        NoTokenAllowedError: if every token is banned at a row the sequence reaches: row 0,
            or the row after an accepted draft (exactly where plain decoding raises). A
            row after a draft that is not committed decides nothing: in sampling its p is
            0, so the draft leading past it is rejected with certainty.
    """
    check_finite(logits)
    processed = pipeline.process(logits, tokens, draft_token_ids)  # [k+1, vocab]
    empty = pipeline.first_empty_row(processed)
    target_probs = uniforms = None
    if pipeline.params.greedy:
        target_token_ids = greedy_tokens(processed).tolist()  # one host sync
        committed = target_token_ids[: greedy_accept_length(draft_token_ids,
                                                            target_token_ids) + 1]
    else:
        draft_ids = torch.tensor([draft_token_ids], dtype=torch.long,
                                 device=logits.device)  # [1, k]
        target_probs = pipeline.probs(processed)  # [k+1, vocab]
        if empty is not None:  # p = 0 there: its draft is rejected, nothing drawn from it
            target_probs[empty:] = 0
        result = sampler(draft_ids, None if draft_probs is None else draft_probs.unsqueeze(0),
                         target_probs.unsqueeze(0), rng)
        committed = [t for t in result.output_token_ids[0].tolist() if t >= 0]  # one sync
        uniforms = None if result.uniforms is None else result.uniforms[0]
    if empty is not None and empty < len(committed):  # the sequence reached that row
        raise NoTokenAllowedError(len(tokens) - pipeline.num_prompt_tokens + empty,
                                  pipeline.params)
    committed_logprobs = None
    if pipeline.params.logprobs is not None:
        committed_logprobs = token_logprobs(pipeline, processed[: len(committed)], committed)
    return Verified(committed, len(committed) - 1, committed_logprobs, processed,
                    target_probs, uniforms)


def token_logprobs(pipeline: LogitsPipeline, processed: torch.Tensor,
                   token_ids: list[int]) -> list[TokenLogprob]:
    """Each token's logprob under ``processed`` (``[n, vocab]``, row i ↔ ``token_ids[i]``)
    and its ``pipeline.params.logprobs`` most likely alternatives."""
    logprobs = pipeline.logprobs(processed)  # [n, vocab]
    chosen = logprobs[torch.arange(len(token_ids)), torch.tensor(token_ids)].tolist()
    top_values, top_ids = logprobs.topk(pipeline.params.logprobs, dim=-1)
    return [TokenLogprob(token, value, list(zip(ids, values)))
            for token, value, ids, values in zip(token_ids, chosen, top_ids.tolist(),
                                                 top_values.tolist())]


def verify_tree(tokens: Sequence[int], draft_token_ids: list[int], parents: list[int],
                logits: torch.Tensor, pipeline: LogitsPipeline, rng: torch.Generator | None,
                sampler=rejection_sample) -> Verified:
    """Verify one sequence's token tree: walk it from the root, committing at each node the
    child the target's token matches, then the recovered or bonus token (SpecInfer,
    arXiv 2305.09781, §4, for drafts chosen deterministically).

    The children of a node are point-mass drafts (the tree is a function of the context
    only). Greedy: the target's argmax, accepted while a child equals it. Sampling: the
    first child c is verified by Algorithm 1 for a point-mass q (``sampler`` with k = 1:
    accepted with probability p(c)); when it is rejected, the recovered token is drawn
    from the residual, p without c, and if that token is another child, that child is
    accepted; a node without children gives the bonus token from p. The committed token
    is then c with probability p(c) and any other x with (1 − p(c)) · p(x) / (1 − p(c)) =
    p(x): each follows the target's processed p exactly, and the walk goes on from the
    child it matched (docs/design.md, "Token trees").

    Args:
        tokens: the sequence so far; ``logits`` scored the tree whose root is ``tokens[-1]``.
        draft_token_ids: ``[n]`` the tree's nodes (the root excluded).
        parents: ``[n]`` each node's parent: −1 for the root, else an earlier node.
        logits: ``[n + 1, vocab]`` the target's raw logits of ``[root, *nodes]`` (row 0 the
            root), from ``Backend.forward_tree``.
        pipeline, rng, sampler: as :func:`verify`.
    Returns:
        :class:`Verified` with ``path`` set.
    Raises:
        ValueError: as :func:`verify`.
    """
    check_finite(logits)
    children: dict[int, list[tuple[int, int]]] = {}  # row → [(token, row)] in order
    for node, (token, parent) in enumerate(zip(draft_token_ids, parents)):
        children.setdefault(parent + 1, []).append((token, node + 1))
    greedy = pipeline.params.greedy
    row, path, committed, processed_rows, probs_rows = 0, [], [], [], []
    while True:
        processed = pipeline.process(logits[row:row + 1], [*tokens, *committed])  # [1, vocab]
        if pipeline.first_empty_row(processed) is not None:  # a row on the committed path
            raise NoTokenAllowedError(len(tokens) - pipeline.num_prompt_tokens + len(committed),
                                      pipeline.params)
        processed_rows.append(processed)
        options = children.get(row, [])
        if greedy:
            token = int(greedy_tokens(processed)[0])
            match = next((child for drafted, child in options if drafted == token), None)
        else:
            p = pipeline.probs(processed)  # [1, vocab]
            probs_rows.append(p)
            token, match = _sample_children(options, p, rng, sampler)
        committed.append(token)
        if match is None:
            break
        path.append(match)
        row = match
    processed = torch.cat(processed_rows)
    committed_logprobs = (token_logprobs(pipeline, processed, committed)
                          if pipeline.params.logprobs is not None else None)
    return Verified(committed, len(path), committed_logprobs, processed,
                    torch.cat(probs_rows) if probs_rows else None, None, path)


def _sample_children(options: list[tuple[int, int]], p: torch.Tensor,
                     rng: torch.Generator | None, sampler) -> tuple[int, int | None]:
    """One node of :func:`verify_tree` when sampling: ``options`` its children ``(token,
    row)``, ``p`` ``[1, vocab]`` the target's probabilities there. Returns the committed
    token and the row of the child it is (None: a recovered or bonus token)."""
    if not options:  # a leaf: the bonus token from p
        none = torch.zeros((1, 0), dtype=torch.long, device=p.device)
        return int(sampler(none, None, p[None], rng).output_token_ids[0, 0]), None
    first, row = options[0]
    drafted = torch.tensor([[first]], device=p.device)
    result = sampler(drafted, None, torch.stack([p, p], 1), rng)  # [1, 2, vocab]
    token = int(result.output_token_ids[0, 0])
    return token, (row if int(result.num_accepted[0]) else dict(options).get(token))
