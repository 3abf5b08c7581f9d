"""Sampling parameters and the sampling primitives: the seeded random number generator
and the exact draw from a distribution.

The exactness contract (docs/design.md) says committed tokens follow the target's *processed*
distribution; the whole chain that processes logits into that distribution (penalties, bias,
bans, then the warpers temperature → top-k → top-p → min-p) is
:mod:`exactspec.logits_pipeline`. Temperature 0 means greedy decoding: the token is
``argmax`` of the processed logits and no probabilities are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from exactspec.constraints import Constraint

MIN_TEMPERATURE = 1e-4
"""Smallest positive temperature: logits / temperature must stay finite in float32."""


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are chosen. Every field is validated on construction.

    Attributes:
        temperature: Softmax temperature; 0 means greedy (argmax). Otherwise at least
            ``MIN_TEMPERATURE`` (1e-4: smaller ones overflow float32 logits) and finite.
        top_k: Keep the k most likely tokens; 0 disables. Must be ≥ 0.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose
            probability reaches top_p; 1.0 disables. Must lie in (0, 1].
        min_p: Drop tokens whose probability is below ``min_p × max probability``;
            0 disables. Must lie in [0, 1].
        seed: Seed of the random number rng (an int ≥ 0), or None for a fresh random seed.
            The same seed gives the same output on the same backend and device.
        max_new_tokens: Most tokens to generate (tokens). Must be ≥ 1.
        min_new_tokens: EOS, stop token ids and stop strings are suppressed until this many
            tokens were generated. Must be ≥ 0 and ≤ max_new_tokens.
        stop: Strings that end generation at the token that completes the first one found.
        stop_token_ids: Token ids that end generation, besides the model's EOS.
        ignore_eos: Keep generating after the model's EOS token (it is not suppressed).
        repetition_penalty: transformers' definition: the logit of every token already in
            the prompt or the output is divided by it when positive, multiplied when
            negative. 1 disables; must lie in [0.01, 100].
        presence_penalty: OpenAI's definition: subtracted once from the logit of every
            token that occurs in the output so far. In [-2, 2]; 0 disables.
        frequency_penalty: OpenAI's definition: subtracted from a token's logit once per
            occurrence in the output so far. In [-2, 2]; 0 disables.
        logit_bias: token id → bias added to its logit (OpenAI's ``logit_bias``); biases
            in [-100, 100].
        bad_words: Strings never generated: each is banned as tokenised with and without a
            leading space (its last token is masked whenever the history ends with the rest).
        banned_token_ids: Token ids never generated.
        logprobs: Return, per generated token, its log-probability under the target's
            processed distribution and the top ``logprobs`` alternatives (0..20); None: off.
        constraint: What the output must match (structured output: a JSON schema, a regular
            expression, a grammar, choices; :class:`~exactspec.constraints.Constraint`);
            the processed distribution is masked to the tokens it allows. None: off. Not
            with ``ignore_eos`` (a complete output ends with EOS).

    Raises:
        ValueError: naming the field, for any value outside the ranges above.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    bad_words: tuple[str, ...] = ()
    banned_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        for name in ("stop", "bad_words", "stop_token_ids", "banned_token_ids"):
            value = getattr(self, name)
            if isinstance(value, str) and name in ("stop", "bad_words"):
                value = (value,)
            _check(isinstance(value, (list, tuple, set, frozenset)), name, value,
                   "a list" + (" of strings" if name in ("stop", "bad_words") else " of token ids"))
            object.__setattr__(self, name, tuple(value))
        _check(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias,
               "a dict of token id → bias")
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        _check(_is_number(self.temperature) and (self.temperature == 0
                                                 or self.temperature >= MIN_TEMPERATURE),
               "temperature", self.temperature,
               f"0 (greedy) or a finite number ≥ {MIN_TEMPERATURE} (smaller ones overflow float32)")
        _check(_is_int(self.top_k) and self.top_k >= 0, "top_k", self.top_k,
               "an integer ≥ 0 (0 = disabled)")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p",
               self.top_p, "a number in (0, 1] (1 = disabled)")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p",
               self.min_p, "a number in [0, 1] (0 = disabled)")
        _check(self.seed is None or (_is_int(self.seed) and 0 <= self.seed < 2**63), "seed",
               self.seed, "an integer in [0, 2**63) or None")
        _check(_is_int(self.max_new_tokens) and self.max_new_tokens >= 1,
               "max_new_tokens", self.max_new_tokens, "an integer ≥ 1")
        _check(_is_int(self.min_new_tokens) and 0 <= self.min_new_tokens <= self.max_new_tokens,
               "min_new_tokens", self.min_new_tokens,
               f"an integer in [0, max_new_tokens = {self.max_new_tokens}]")
        for name in ("stop", "bad_words"):
            for s in getattr(self, name):
                _check(isinstance(s, str) and s != "", name, s, "a list of non-empty strings")
        for name in ("stop_token_ids", "banned_token_ids"):
            for t in getattr(self, name):
                _check(_is_int(t) and t >= 0, name, t, "a list of token ids ≥ 0")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", self.ignore_eos, "True or False")
        _check(_is_number(self.repetition_penalty) and 0.01 <= self.repetition_penalty <= 100,
               "repetition_penalty", self.repetition_penalty, "a number in [0.01, 100] (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -2 <= value <= 2, name, value,
                   "a number in [-2, 2] (0 = off)")
        for token, bias in self.logit_bias.items():
            _check(_is_int(token) and token >= 0 and _is_number(bias) and -100 <= bias <= 100,
                   "logit_bias", {token: bias}, "token id (≥ 0) → bias in [-100, 100]")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= 20),
               "logprobs", self.logprobs, "None or an integer in [0, 20]")
        _check(self.constraint is None or isinstance(self.constraint, Constraint), "constraint",
               self.constraint, "None or a Constraint (e.g. Constraint.json_schema(...))")
        _check(self.constraint is None or not self.ignore_eos, "ignore_eos", self.ignore_eos,
               "False with a constraint (a complete structured output ends with EOS)")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0: tokens are the argmax, no randomness."""
        return self.temperature == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} = {value!r} is invalid: it must be {allowed}")


def make_rng(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded with ``seed`` (a random seed when None)."""
    rng = torch.Generator(device=device)
    if seed is None:
        rng.seed()
    else:
        rng.manual_seed(seed)
    return rng


def sample_from_probs(probs: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """Draw one token per row, by inverse CDF in float64 with one uniform per row.

    Exact for any non-negative weights (they need not sum to 1); a zero-weight token is
    never returned. Consumes exactly ``batch`` float64 uniforms from ``rng``.

    Args:
        probs: ``[batch, vocab]`` non-negative weights, each row with positive mass.
        rng: the random source.
    Returns:
        ``[batch]`` int64 token ids.
    """
    probs = probs.double()
    cdf = probs.cumsum(dim=-1)  # [batch, vocab]
    uniforms = torch.rand((probs.shape[0], 1), dtype=torch.float64, device=probs.device,
                          generator=rng)
    tokens = torch.searchsorted(cdf, uniforms * cdf[:, -1:], right=True).squeeze(-1)
    # u·total can round up to total itself: fall back to the last token with mass.
    vocab = probs.shape[-1]
    last_with_mass = vocab - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(tokens, last_with_mass)
