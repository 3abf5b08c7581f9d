"""A request made ready to decode: the one place where a prompt and its sampling parameters
are checked and turned into what the decoding loop needs.

Both engines start a request here (:class:`~exactspec.generator.SpeculativeGenerator` for one
sequence, :class:`~exactspec.batching.BatchedGenerator` for many), and so does the server,
before it queues a job: every check of a request (its prompt, ``n``, the token ids its
sampling parameters name) lives in :func:`prepare_request`, and each failure is a
:class:`RequestError` naming the field at fault, which the server turns into OpenAI's 400
body.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from exactspec.backends.base import Backend, Tokenizer
from exactspec.logits_pipeline import LogitsPipeline, outside_vocabulary
from exactspec.sampling import SamplingParams, make_rng

Prompt = str | Sequence[int] | Sequence[Mapping[str, str]]
"""A text, ``[prompt_len]`` token ids, or chat messages (``{"role", "content"}`` dicts)."""


class RequestError(ValueError):
    """A request the engine cannot serve as given.

    Attributes:
        field: the parameter at fault as the engine names it (``prompt``, ``n``,
            ``logit_bias``, ``banned_token_ids``, ``stop_token_ids``, ``params``).
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # picklable (raised on a Ray worker, re-raised in the driver)
        return type(self), (self.field, str(self))


@dataclass
class Request:
    """A request ready to decode (made by :func:`prepare_request`).

    Attributes:
        prompt_token_ids: ``[prompt_len]`` the prompt as the model sees it (chat template
            applied), at least one token and room for one generated token in the context.
        params: its sampling parameters.
        pipeline: its logits processing (:class:`~exactspec.logits_pipeline.LogitsPipeline`).
        rng: its random source, seeded from ``params.seed`` (random without one).
        n: samples to draw from the prompt (≥ 1), decoded one after another on ``rng``.
        timed: greedy or unseeded, so its drafting may depend on what ran before
            (measured costs, a corpus of earlier outputs); a seeded sampling request is not,
            so that its output is reproducible (see
            :meth:`~exactspec.speculation_length.SpeculationLengthPolicy.reset`).
        start: ``time.perf_counter()`` when it was prepared: TTFT and total seconds count
            from here when the engine prepares it itself; a request prepared elsewhere and
            queued (the server's) counts from when it is submitted to the batch.
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    pipeline: LogitsPipeline = field(repr=False)
    rng: torch.Generator = field(repr=False)
    n: int = 1
    timed: bool = True
    start: float = 0.0


def prepare_request(target: Backend, prompt: Prompt, params: SamplingParams | None = None, *,
                    n: int = 1, chat: bool = False) -> Request:
    """Check a request against ``target`` and build its :class:`Request`.

    Args:
        target: the backend that will decode it (tokenizer, vocabulary, context, EOS).
        prompt: text (wrapped in the chat template as one user turn when ``chat``), chat
            messages (always through the chat template), or token ids used as they are.
        params: sampling parameters (default: greedy, 128 new tokens).
        n: samples of the prompt (an integer ≥ 1).
        chat: wrap a text prompt in the model's chat template.
    Returns:
        the :class:`Request`.
    Raises:
        RequestError: for ``n`` < 1, an empty prompt, token ids outside the vocabulary,
            a prompt that fills the context (no room for a token), ``chat`` with token ids,
            a model without a chat template, or sampling parameters naming token ids
            outside the vocabulary (the field named in each case).
        TypeError: if ``params`` is not a :class:`SamplingParams`.
    """
    start = time.perf_counter()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise RequestError("n", f"n = {n!r} is invalid: it must be an integer ≥ 1")
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, not {type(params).__name__}")
    prompt_token_ids = prompt_tokens(target, prompt, chat)
    if (found := outside_vocabulary(params, target.vocab_size)) is not None:
        name, bad = found
        raise RequestError(name, f"{name} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {target.vocab_size})")
    pipeline = logits_pipeline(target, params, prompt_token_ids)
    return Request(prompt_token_ids, params, pipeline, make_rng(params.seed, target.device), n,
                   timed=params.greedy or params.seed is None, start=start)


def prompt_tokens(target: Backend, prompt: Prompt, chat: bool = False) -> list[int]:
    """``prompt`` as token ids, checked against the vocabulary and the context (see
    :func:`prepare_request`; its errors name the field ``prompt``)."""
    tokenizer = target.tokenizer
    if isinstance(prompt, str) or (len(prompt) > 0 and isinstance(prompt[0], Mapping)):
        if isinstance(prompt, str) and not chat:
            token_ids = tokenizer.encode(prompt)
        else:
            try:
                token_ids = tokenizer.apply_chat_template(prompt)
            except ValueError as error:
                raise RequestError("prompt", str(error)) from None
    else:
        if chat:
            raise RequestError("prompt", "chat=True needs a text prompt, not token ids")
        try:
            token_ids = [operator.index(t) for t in prompt]
        except TypeError:
            raise RequestError("prompt", "prompt token ids must be integers") from None
    if not token_ids:
        raise RequestError("prompt", "the prompt is empty: give at least one token")
    vocab = target.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError("prompt", f"prompt token ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {vocab})")
    limit = target.max_context_length
    if limit is not None and len(token_ids) >= limit:
        raise RequestError("prompt", f"the prompt has {len(token_ids)} tokens; the context holds "
                                     f"{limit} (the model's, or max_model_len where set), so a "
                                     f"prompt may have at most {limit - 1} to leave room for a "
                                     "generated token")
    return token_ids


def logits_pipeline(target: Backend, params: SamplingParams,
                    prompt_token_ids: Sequence[int]) -> LogitsPipeline:
    """The logits chain of a request of ``params`` on ``target`` (its bad words tokenised,
    its constraint matched with the target's tokenizer): what the engine verifies with and
    the audit's exact reference computes with.

    Raises:
        RequestError: for token ids outside the vocabulary (the field named), or a
            constraint the tokenizer cannot match or a model without an EOS token
            (``constraint``).
    """
    constraint = None
    if params.constraint is not None:
        if not target.eos_token_ids:
            raise RequestError("constraint", "structured output needs a model with an EOS "
                                             "token (a complete output ends with it)")
        try:
            tokenizer = target.tokenizer.constraint_tokenizer(target.vocab_size,
                                                              tuple(target.eos_token_ids))
        except Exception as error:  # noqa: BLE001 (llguidance's readers raise their own)
            raise RequestError("constraint", "structured output cannot read this model's "
                                             f"tokenizer (llguidance): {error}") from None
        try:
            constraint = params.constraint.mask(tokenizer, target.vocab_size)
        except ValueError as error:
            raise RequestError("constraint", str(error)) from None
    try:
        return LogitsPipeline(params, prompt_token_ids, target.vocab_size, target.eos_token_ids,
                              bad_words_ids(target.tokenizer, params.bad_words), target.device,
                              constraint)
    except ValueError as error:
        raise RequestError("params", str(error)) from None


def bad_words_ids(tokenizer: Tokenizer, bad_words: Sequence[str]) -> list[list[int]]:
    """Each of ``bad_words`` as tokenised alone and after a space (no special tokens)."""
    variants = {tuple(tokenizer.encode(text, add_special_tokens=False))
                for word in bad_words for text in (word, " " + word)}
    return [list(ids) for ids in variants if ids]
