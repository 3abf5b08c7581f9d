"""Sampling parameters and the logits → probabilities pipeline.

The exactness contract (DESIGN.md) says committed tokens follow the target's *processed*
distribution. This module defines that processing once, so the engine applies it
identically to the target at every verified position and to a draft model's logits.

Order of the steps (the order of Hugging Face transformers' logits warpers):
temperature → top-k → top-p → min-p → softmax.
Temperature 0 means greedy decoding: the token is ``argmax`` of the logits and no
probabilities are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Every field is validated on construction.

    Attributes:
        temperature: Softmax temperature; 0 means greedy (argmax). Must be ≥ 0 and finite.
        top_k: Keep the k most likely tokens; 0 disables. Must be ≥ 0.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose
            probability reaches top_p; 1.0 disables. Must lie in (0, 1].
        min_p: Drop tokens whose probability is below ``min_p × max probability``;
            0 disables. Must lie in [0, 1].
        seed: Seed of the random generator (an int ≥ 0), or None for a fresh random seed.
            The same seed gives the same output on the same backend and device.
        max_new_tokens: Most tokens to generate (tokens). Must be ≥ 1.
        stop: Strings that end generation at the token that completes the first one found.

    Raises:
        ValueError: naming the field, for any value outside the ranges above.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        _check(
            isinstance(self.temperature, (int, float))
            and math.isfinite(self.temperature)
            and self.temperature >= 0,
            "temperature", self.temperature, "a finite number ≥ 0 (0 = greedy)",
        )
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "an integer ≥ 0 (0 = disabled)")
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1, "top_p",
               self.top_p, "a number in (0, 1] (1 = disabled)")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1, "min_p",
               self.min_p, "a number in [0, 1] (0 = disabled)")
        _check(self.seed is None or (_is_int(self.seed) and self.seed >= 0), "seed",
               self.seed, "an integer ≥ 0 or None")
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               "max_new_tokens", self.max_new_tokens, "an integer ≥ 1")
        for s in self.stop:
            _check(isinstance(s, str) and s != "", "stop", s, "non-empty strings")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: tokens are the argmax, no randomness."""
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} = {value!r} is invalid: it must be {allowed}")


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (a random seed when None)."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


def check_finite(logits: torch.Tensor) -> None:
    """Raise ValueError if ``logits`` hold NaN or ±inf (a broken model or a bad dtype)."""
    if not bool(torch.isfinite(logits).all()):
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


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply the sampling pipeline: temperature → top-k → top-p → min-p → softmax.

    The input is never modified in place.

    Args:
        logits: ``[..., vocab]`` raw logits (any float dtype).
        params: sampling parameters with ``temperature > 0``.
    Returns:
        ``[..., vocab]`` float32 probabilities; filtered tokens have probability exactly 0.
        Each row keeps at least its most likely token.
    Raises:
        ValueError: if ``params`` is greedy (use :func:`greedy_tokens`).
    """
    if params.greedy:
        raise ValueError("logits_to_probs needs temperature > 0; greedy uses greedy_tokens")
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
    return scores.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Draw one token per row, by inverse CDF in float64 with one uniform per row.

    Exact for any non-negative weights (they need not sum to 1); a zero-weight token is
    never returned. Consumes exactly ``batch`` float64 uniforms from ``generator``.

    Args:
        probs: ``[batch, vocab]`` non-negative weights, each row with positive mass.
        generator: the random source.
    Returns:
        ``[batch]`` int64 token ids.
    """
    probs = probs.double()
    cdf = probs.cumsum(dim=-1)  # [batch, vocab]
    uniforms = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device,
                          generator=generator)
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1)
    # u·total can round up to total itself: fall back to the last token with mass.
    vocab = probs.shape[-1]
    last_with_mass = vocab - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(tokens, last_with_mass)
