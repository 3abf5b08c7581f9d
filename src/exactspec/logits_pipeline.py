"""The logits chain, whole: from a model's raw logits to the processed distribution that
committed tokens follow, applied identically at every verified position of one sequence.

Speculation scores k+1 positions in one pass; the exactness contract (docs/design.md) requires
each row to be processed exactly as plain decoding would process it at that position:
with the *true history* = prompt + committed tokens + the drafted tokens before it. (A
penalty that sees only the last accepted token is the classic bug this avoids.)

Order, for each row (plain decoding uses the same order, the same code):
    1. repetition_penalty      transformers' ``RepetitionPenaltyLogitsProcessor``: tokens
                               in prompt + output are divided (logit > 0) or multiplied
                               (logit ≤ 0) by the penalty.
    2. frequency / presence    OpenAI's definitions, over the output tokens only:
                               logit -= frequency × count + presence × (count > 0).
    3. logit_bias              added.
    4. bans                    banned_token_ids, bad words (the last token of a bad word is
                               masked when the history ends with the rest of it), and,
                               until min_new_tokens tokens exist, EOS and stop_token_ids.
    5. constraint              tokens the structured-output constraint forbids after the
                               output so far (``SamplingParams.constraint``,
                               :class:`~exactspec.constraints.ConstraintMask`).
    6. warpers                 temperature → top-k → top-p → min-p (the order of Hugging
                               Face transformers' logits warpers), then softmax
                               (:func:`warp_scores`, :func:`logits_to_probs`).
Greedy decoding takes the argmax after step 5 (:func:`greedy_tokens`). Raw logits are
never modified in place.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from exactspec.constraints import ConstraintMask
from exactspec.sampling import SamplingParams


def outside_vocabulary(params: SamplingParams, vocab_size: int) -> tuple[str, list[int]] | None:
    """The first field of ``params`` naming token ids ≥ ``vocab_size`` (logit_bias,
    banned_token_ids, stop_token_ids) and those ids; None when all fit."""
    for name, ids in (("logit_bias", params.logit_bias),
                      ("banned_token_ids", params.banned_token_ids),
                      ("stop_token_ids", params.stop_token_ids)):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            return name, bad
    return None


class NoTokenAllowedError(ValueError):
    """Every token is banned at a position the sequence reached (``logit_bias``,
    ``bad_words``, ``banned_token_ids``, ``min_new_tokens`` and a constraint together leave
    nothing, e.g. a constraint complete before ``min_new_tokens``, which allows only EOS):
    raised exactly where plain decoding would raise it, never for a drafted position that
    is not committed.

    Args:
        position: the output position (0 = the first generated token) with nothing allowed.
        params: the request's sampling parameters (the message names its constraint).
    """

    def __init__(self, position: int, params: SamplingParams) -> None:
        constraint = (f"the {params.constraint.describe()}, " if params.constraint is not None
                      else "")
        super().__init__(f"every token is banned at output position {position} ({constraint}"
                         "logit_bias, bad_words, banned_token_ids and min_new_tokens together "
                         "leave nothing)")
        self.position = position


class LogitsPipeline:
    """History-aware logits processing for one sequence (see module docstring).

    Args:
        params: the sampling parameters.
        prompt_token_ids: ``[prompt_len]`` the prompt (for repetition_penalty and to tell
            output tokens from prompt tokens).
        vocab_size: width of the logits.
        eos_token_ids: suppressed with stop_token_ids until min_new_tokens (unless ignore_eos).
        bad_words_ids: token sequences never to generate (from ``params.bad_words``).
        device: where the logits live.
        constraint: the tokens ``params.constraint`` allows (None: no constraint).
    Raises:
        ValueError: if a token id in logit_bias, banned_token_ids or stop_token_ids is
            outside the vocabulary.
    """

    def __init__(self, params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int,
                 eos_token_ids: Sequence[int] = (), bad_words_ids: Sequence[Sequence[int]] = (),
                 device: torch.device | str = "cpu",
                 constraint: ConstraintMask | None = None) -> None:
        self.params = params
        self.constraint = constraint
        self.num_prompt_tokens = len(prompt_token_ids)
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        if (found := outside_vocabulary(params, vocab_size)) is not None:
            name, bad = found
            raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary "
                             f"[0, {vocab_size})")
        self._penalised = (params.repetition_penalty != 1 or params.presence_penalty != 0
                           or params.frequency_penalty != 0)
        self._prompt_seen = None
        if params.repetition_penalty != 1:
            self._prompt_seen = self._counts(prompt_token_ids) > 0  # [vocab]
        self._bias = None
        if params.logit_bias:
            self._bias = torch.zeros(vocab_size, device=self.device)
            for token, bias in params.logit_bias.items():
                self._bias[token] = bias
        single = [seq[0] for seq in bad_words_ids if len(seq) == 1]
        self._banned = sorted(set(params.banned_token_ids) | set(single))
        self._bad_sequences = [list(seq) for seq in bad_words_ids if len(seq) > 1]
        suppressed = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self._suppressed_until_min = sorted(suppressed) if params.min_new_tokens else []
        self.is_identity = not (self._penalised or self._bias is not None or self._banned
                                or self._bad_sequences or self._suppressed_until_min
                                or constraint is not None)

    def process(self, logits: torch.Tensor, context: Sequence[int],
                drafted: Sequence[int] = ()) -> torch.Tensor:
        """Steps 1-5 for ``n`` consecutive positions.

        Args:
            logits: ``[n, vocab]`` raw logits; row i predicts the token after
                ``context + drafted[:i]``.
            context: prompt + committed tokens.
            drafted: ``[≥ n-1]`` drafted tokens (only the first n-1 are used).
        Returns:
            ``[n, vocab]`` processed logits (a new tensor unless nothing applies). A row
            where every token is banned is all −inf: whether that is an error depends on
            whether the row is reached (:meth:`first_empty_row`, :class:`NoTokenAllowedError`).
        """
        if self.is_identity:
            return logits
        n = logits.shape[0]
        drafted = list(drafted[: n - 1])
        scores = logits.float().clone()
        num_generated = len(context) - self.num_prompt_tokens
        if self._penalised:
            scores = self._apply_penalties(scores, context[self.num_prompt_tokens:], drafted)
        if self._bias is not None:
            scores += self._bias
        if self._banned:
            scores[:, self._banned] = -math.inf
        for i in range(n):
            for seq in self._bad_sequences:
                history_tail = (list(context[-len(seq):]) + drafted[:i])[-(len(seq) - 1):]
                if history_tail == seq[:-1]:
                    scores[i, seq[-1]] = -math.inf
        if self._suppressed_until_min:
            rows = [i for i in range(n) if num_generated + i < self.params.min_new_tokens]
            if rows:
                scores[torch.tensor(rows)[:, None], torch.tensor(self._suppressed_until_min)] = -math.inf
        if self.constraint is not None:
            allowed = self.constraint.allowed(context[self.num_prompt_tokens:], drafted, n)
            scores.masked_fill_(~allowed.to(scores.device), -math.inf)
        return scores

    def first_empty_row(self, processed: torch.Tensor) -> int | None:
        """The first row of :meth:`process`'s ``[n, vocab]`` output where every token is
        banned, or None. Plain decoding raises only on reaching such a row; a verified row
        after a drafted token is reached only if that draft is committed (docs/exactness.md,
        "A position with no allowed token")."""
        if self.is_identity:
            return None
        empty = torch.isneginf(processed).all(dim=-1)
        return int(empty.to(torch.uint8).argmax()) if bool(empty.any()) else None

    def probs(self, processed: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` processed logits → ``[n, vocab]`` sampling distribution (step 5)."""
        return logits_to_probs(processed, self.params)

    def logprobs(self, processed: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` log-probabilities of the processed distribution: after the warpers
        when sampling (filtered tokens at -inf), of the step-4 logits when greedy."""
        scores = processed.float() if self.params.greedy else warp_scores(processed, self.params)
        return torch.log_softmax(scores, dim=-1)

    def _apply_penalties(self, scores: torch.Tensor, output: Sequence[int],
                         drafted: list[int]) -> torch.Tensor:
        n, vocab = scores.shape
        counts = self._counts(output).expand(n, vocab).clone()  # [n, vocab]
        if drafted:
            # Row i also counts drafted[:i]: an exclusive cumulative sum of one-hot drafts.
            one_hot = torch.nn.functional.one_hot(
                torch.tensor(drafted, device=self.device), vocab).to(counts.dtype)
            counts[1:] += one_hot.cumsum(dim=0)
        params = self.params
        if params.repetition_penalty != 1:
            seen = (counts > 0) | self._prompt_seen
            penalised = torch.where(scores > 0, scores / params.repetition_penalty,
                                    scores * params.repetition_penalty)
            scores = torch.where(seen, penalised, scores)
        if params.frequency_penalty or params.presence_penalty:
            scores = (scores - params.frequency_penalty * counts
                      - params.presence_penalty * (counts > 0).float())
        return scores

    def _counts(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self.device)
        return torch.bincount(ids, minlength=self.vocab_size).float()


def check_finite(logits: torch.Tensor) -> None:
    """Raise ValueError if ``logits`` hold NaN or ±inf (a broken model or a bad dtype).

    The sum is finite whenever every element is (barring overflow, which the element-wise
    check then clears), and costs a tenth of ``isfinite(...).all()`` on a 49k vocabulary.
    """
    if not math.isfinite(float(logits.sum())) and not bool(torch.isfinite(logits).all()):
        raise ValueError(
            "the model produced non-finite logits (NaN or inf); exact sampling is impossible. "
            "Check the model file and try --dtype float32."
        )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Greedy choice: ``argmax`` over the last axis (first index wins a tie).

    Args:
        logits: ``[..., vocab]`` raw logits.
    Returns:
        ``[...]`` int64 token ids.
    """
    return logits.argmax(dim=-1)


def warp_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature → top-k → top-p → min-p: scaled logits with filtered tokens at -inf.

    The input is never modified in place.

    Args:
        logits: ``[..., vocab]`` logits (any float dtype).
        params: sampling parameters with ``temperature > 0``.
    Returns:
        ``[..., vocab]`` float32 scores; ``softmax`` of them is the sampling distribution.
        Each row keeps at least its most likely token.
    Raises:
        ValueError: if ``params`` is greedy (use :func:`greedy_tokens`).
    """
    if params.greedy:
        raise ValueError("warping needs temperature > 0; greedy uses greedy_tokens")
    scores = logits.float() / params.temperature
    vocab = scores.shape[-1]
    if 0 < params.top_k < vocab:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth_best, -math.inf)
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose total mass is ≤ 1 - top_p; the top token always stays.
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    if params.min_p > 0:
        probs = scores.softmax(dim=-1)
        threshold = params.min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < threshold, -math.inf)
    return scores


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution: ``softmax(warp_scores(logits, params))``.

    Args:
        logits: ``[..., vocab]`` logits (after any history-dependent processing).
        params: sampling parameters with ``temperature > 0``.
    Returns:
        ``[..., vocab]`` float32 probabilities; filtered tokens have probability exactly 0.
    Raises:
        ValueError: if ``params`` is greedy.
    """
    return warp_scores(logits, params).softmax(dim=-1)
