"""What one cycle did, token by token: the record behind ``generate --show`` and ``--trace``.

The engine writes it (this module sits below the engine); :mod:`exactspec.trace` shows it
(above the engine). Recorded only when asked (``SpeculativeGenerator.generate(...,
trace=True)``): the engine then hands each cycle's proposal, processed logits and verdict
to :func:`trace_cycle`; otherwise nothing here runs. The figures are the verifier's own (docs/design.md glossary;
Leviathan et al. 2022, Algorithm 1): for drafted token x_i, p = the target's processed
probability p_i(x_i), q = the draft's q_i(x_i) (1 for point-mass proposers such as n-gram
lookup), acceptance probability min(1, p/q), the uniform u the verifier drew (accepted iff
u·q < p), and after a rejection the residual normalize(max(0, p − q)) the recovered token
was drawn from. Greedy cycles record the target's argmax at each position instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import torch

from exactspec.logits_pipeline import greedy_tokens
from exactspec.verification import final_distribution

TokenKind = Literal["accepted", "recovered", "bonus", "plain"]
"""How a committed token came about: an accepted draft; the replacement after the first
rejection; the extra token after every draft was accepted; a cycle with no drafts."""
TOP_TOKENS = 5
"""How many of the residual's (or the final distribution's) most likely tokens are kept."""


@dataclass
class DraftVerdict:
    """One drafted token under verification.

    Attributes:
        token_id: the drafted token.
        p: the target's processed probability of it (greedy: None).
        q: the draft's probability of it (1.0 for a point-mass proposer; greedy: None).
        acceptance_probability: min(1, p/q), 0 when q = 0 (greedy: None).
        uniform: the verifier's uniform u in [0, 1); accepted iff u·q < p (greedy: None).
        target_token_id: greedy only: the target's argmax at this position.
        verdict: ``accepted``, ``rejected``, ``forbidden`` (rejected with certainty: the
            processed logits mask it out at its position — a structured-output constraint
            or a ban), ``not reached`` (after a rejection), or ``past the stop`` (after the
            token that ended generation: neither committed nor counted).
    """

    token_id: int
    p: float | None
    q: float | None
    acceptance_probability: float | None
    uniform: float | None
    target_token_id: int | None
    verdict: Literal["accepted", "rejected", "forbidden", "not reached", "past the stop"]


@dataclass
class CycleTrace:
    """One cycle: drafts, their verdicts, and the committed tokens.

    Attributes:
        index: the cycle's number in the generation (0-based).
        position: tokens generated before this cycle.
        chosen_k: the policy's k for this cycle (the proposer may have proposed fewer).
        drafts: one :class:`DraftVerdict` per drafted token, in order.
        committed: ``[(token_id, kind)]`` the tokens this cycle emitted (cut at a stop).
        final_top: the top :data:`TOP_TOKENS` (token_id, probability) of the distribution
            the last committed token was drawn from: the residual after a rejection, else
            the target's p (greedy: its top processed probabilities).
        greedy: whether verification was greedy (argmax matches) or stochastic.
        draft_seconds: the cycle's drafting time (seconds; 0 when nothing was drafted).
        verify_seconds: its verification time: the target's forward over the block and
            the rejection sampling (seconds), so that one slow cycle can be found.
    """

    index: int
    position: int
    chosen_k: int
    drafts: list[DraftVerdict]
    committed: list[tuple[int, TokenKind]]
    final_top: list[tuple[int, float]] = field(default_factory=list)
    greedy: bool = True
    draft_seconds: float | None = None
    verify_seconds: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def token_kinds(num_drafted: int, num_accepted: int, num_committed: int) -> list[TokenKind]:
    """The kinds of a cycle's committed tokens, cut to ``num_committed`` (a stop may have
    cut the cycle): ``num_accepted`` accepted drafts, then one recovered token after a
    rejection, a bonus token after full acceptance, or a plain step without drafts."""
    last: TokenKind = ("plain" if num_drafted == 0 else
                       "bonus" if num_accepted == num_drafted else "recovered")
    return (["accepted"] * num_accepted + [last])[:num_committed]


def trace_cycle(index: int, position: int, chosen_k: int, draft_token_ids: list[int],
                draft_probs: torch.Tensor | None, processed: torch.Tensor,
                target_probs: torch.Tensor | None, uniforms: torch.Tensor | None,
                committed: list[int], num_accepted: int, draft_seconds: float | None = None,
                verify_seconds: float | None = None) -> CycleTrace:
    """Build one cycle's trace from what the verifier saw.

    Args:
        draft_token_ids: ``[k]`` the drafts.
        draft_probs: ``[k, vocab]`` q, or None for a point-mass proposer.
        processed: ``[k+1, vocab]`` the target's processed logits, row i for position i.
        target_probs: ``[k+1, vocab]`` p, the verifier's probabilities (None: greedy).
        uniforms: ``[k]`` float64, the verifier's acceptance uniforms (None when greedy).
        committed: the tokens the cycle emitted.
        num_accepted: drafts accepted by verification.
        draft_seconds, verify_seconds: the cycle's timings (:class:`CycleTrace`).
    """
    k = len(draft_token_ids)
    greedy = target_probs is None
    kinds = token_kinds(k, num_accepted, len(committed))
    verdicts = ["accepted"] * num_accepted + ["rejected"] * (num_accepted < k) + [
        "not reached"] * max(0, k - num_accepted - 1)
    if num_accepted < k and processed[num_accepted, draft_token_ids[num_accepted]] == -math.inf:
        verdicts[num_accepted] = "forbidden"
    if len(committed) < num_accepted + 1:  # a stop cut the cycle: what follows it is moot
        verdicts[len(committed):] = ["past the stop"] * (k - len(committed))
    drafts: list[DraftVerdict] = []
    if greedy:
        argmax = greedy_tokens(processed).tolist()
        scores = torch.softmax(processed[num_accepted].double(), dim=-1)
        final_top = _top(scores)
        for i, token in enumerate(draft_token_ids):
            drafts.append(DraftVerdict(token, None, None, None, None, argmax[i], verdicts[i]))
    else:
        p = target_probs  # [k+1, vocab]
        rows = torch.arange(k)
        q = (torch.ones(k, dtype=torch.float64) if draft_probs is None
             else draft_probs[rows, draft_token_ids].double())
        p_drafted = p[rows, draft_token_ids].double()
        for i, token in enumerate(draft_token_ids):
            p_i, q_i = float(p_drafted[i]), float(q[i])
            drafts.append(DraftVerdict(token, p_i, q_i, min(1.0, p_i / q_i) if q_i > 0 else 0.0,
                                       None if uniforms is None else float(uniforms[i]), None,
                                       verdicts[i]))
        final = final_distribution(
            torch.tensor([draft_token_ids], dtype=torch.long, device=p.device).view(1, k),
            None if draft_probs is None else draft_probs.unsqueeze(0), p.unsqueeze(0),
            torch.tensor([num_accepted], device=p.device))[0]
        final_top = _top(final / final.sum())
    return CycleTrace(index, position, chosen_k, drafts, list(zip(committed, kinds)),
                      final_top, greedy, draft_seconds, verify_seconds)


def _top(probs: torch.Tensor) -> list[tuple[int, float]]:
    values, ids = probs.topk(min(TOP_TOKENS, probs.shape[-1]))
    return [(int(t), float(v)) for t, v in zip(ids, values) if v > 0]
