"""OpenAI's response bodies for a :class:`~exactspec.generator.GenerationResult`: one
renderer per endpoint (:class:`CompletionResponses`, :class:`ChatResponses`, chosen by
:func:`responses_for`) for its choices and streamed chunks, and the parts both share
(``finish_reason``, ``usage``, logprobs, exactspec's ``speculation`` figures).

Field names follow the OpenAI API reference; vLLM's ``stop_reason`` and, with
``return_token_ids``, ``prompt_token_ids`` and ``token_ids``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, ClassVar

from exactspec.generation_stats import GenerationStats
from exactspec.generator import GenerationResult, TokenLogprob
from exactspec.sampling import SamplingParams
from exactspec.server.protocol import ChatCompletionRequest, SamplingRequest
from exactspec.text import token_pieces

Decode = Callable[[list[int]], str]
"""A tokenizer's decode: token ids → text."""


class CompletionResponses:
    """How an endpoint answers ``body``: the response's ``object`` and ``id``, its choices
    and its streamed chunks. This class is ``/v1/completions``' (text per choice);
    :class:`ChatResponses` overrides what chat renders otherwise."""

    response_object: ClassVar[str] = "text_completion"
    """The response's ``object`` (streamed: :attr:`chunk_object`)."""
    chunk_object: ClassVar[str] = "text_completion"
    id_prefix: ClassVar[str] = "cmpl"
    """The response ``id``'s prefix."""
    opening_chunk: ClassVar[bool] = False
    """Whether a stream opens with a chunk per choice before any text (chat: the role)."""

    def __init__(self, body: SamplingRequest) -> None:
        self.body = body

    def choice(self, index: int, result: GenerationResult, params: SamplingParams,
               decode: Decode) -> dict:
        """One finished choice of the response (``params``: the request's)."""
        return {"index": index, "text": final_text(result)} | finish(result, params) | {
            "logprobs": None if result.logprobs is None
            else completion_logprobs(result.logprobs, decode)} | self.token_ids(result)

    def chunk_choice(self, index: int, text: str, params: SamplingParams,
                     result: GenerationResult | None = None, first: bool = False) -> dict:
        """One choice of a streamed chunk: ``text`` more, and with the choice's ``result``
        its finish (``first``: the opening chunk, chat's role)."""
        return {"index": index, "text": text, "logprobs": None} | finish(result, params)

    def token_ids(self, result: GenerationResult) -> dict:
        """vLLM's ``prompt_token_ids`` and ``token_ids`` of a choice, when asked."""
        if not self.body.return_token_ids:
            return {}
        return {"prompt_token_ids": list(result.prompt_token_ids),
                "token_ids": list(result.token_ids)}


class ChatResponses(CompletionResponses):
    """``/v1/chat/completions``' answers: a message per choice, deltas when streamed."""

    response_object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"
    opening_chunk = True

    def choice(self, index: int, result: GenerationResult, params: SamplingParams,
               decode: Decode) -> dict:
        return {"index": index, "message": {"role": "assistant", "content": final_text(result)}
                } | finish(result, params) | {"logprobs": None if result.logprobs is None
                                              else chat_logprobs(result.logprobs, decode)
                                              } | self.token_ids(result)

    def chunk_choice(self, index: int, text: str, params: SamplingParams,
                     result: GenerationResult | None = None, first: bool = False) -> dict:
        delta = ({"role": "assistant", "content": ""} if first else
                 {"content": text} if text or result is None else {})
        return {"index": index, "delta": delta, "logprobs": None} | finish(result, params)


def responses_for(body: SamplingRequest) -> CompletionResponses:
    """The renderer of ``body``'s endpoint."""
    chat = isinstance(body, ChatCompletionRequest)
    return (ChatResponses if chat else CompletionResponses)(body)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def final_text(result: GenerationResult) -> str:
    """The choice's text as OpenAI returns it: without the stop string that ended it (and
    anything its last token spelled after it): ``result.text[:result.stop_offset]``."""
    return result.text if result.stop_offset is None else result.text[:result.stop_offset]


def stop_reason(result: GenerationResult, params: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or the ``stop_token_ids`` entry that ended the
    choice, None otherwise (EOS, length)."""
    if isinstance(result.stop_reason, int) and result.stop_reason not in params.stop_token_ids:
        return None
    return result.stop_reason


def finish(result: GenerationResult | None, params: SamplingParams) -> dict[str, Any]:
    """A choice's ``finish_reason`` and ``stop_reason`` (both None while it runs)."""
    return {"finish_reason": result and result.finish_reason,
            "stop_reason": result and stop_reason(result, params)}


def speculation_figures(stats: list[GenerationStats]) -> dict[str, Any]:
    """The request's speculative figures over its choices: drafted and accepted tokens,
    acceptance rate, mean acceptance length, per-position counts (glossary of
    docs/design.md)."""
    total = GenerationStats.merged(stats)
    return {"num_speculative_tokens": total.num_speculative_tokens, "policy": total.policy,
            "cycles": total.cycles, "drafted_tokens": total.drafted_tokens,
            "accepted_tokens": total.accepted_tokens, "acceptance_rate": total.acceptance_rate,
            "mean_acceptance_length": total.mean_acceptance_length,
            "drafted_per_position": total.drafted_per_position,
            "accepted_per_position": total.accepted_per_position}


def usage(results: list[GenerationResult], prompt_lengths: list[int]) -> dict[str, int]:
    """OpenAI's usage: each prompt counted once, every choice's tokens counted."""
    completion = sum(len(r.token_ids) for r in results)
    prompt = sum(prompt_lengths)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


LOWEST_LOGPROB = -9999.0
"""A log-probability of -inf (a token outside top-k/top-p, or one a wrong engine produced)
as JSON writes it, which has no infinity (vLLM's convention)."""


def json_logprob(value: float) -> float:
    """``value``, with -inf (and anything lower) as :data:`LOWEST_LOGPROB`."""
    return max(value, LOWEST_LOGPROB)


def completion_logprobs(logprobs: list[TokenLogprob], decode) -> dict:
    """The completions API's ``logprobs`` object: tokens, token_logprobs, top_logprobs
    (token text → logprob), text_offset. A chosen token's text is its share of the output
    (:func:`~exactspec.text.token_pieces`: a character split over several tokens
    goes whole to the token that completes it), so the tokens join to the text."""
    tokens = token_pieces([lp.token_id for lp in logprobs], decode)
    offsets, offset = [], 0
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": [json_logprob(lp.logprob) for lp in logprobs],
            "top_logprobs": [{decode([t]): json_logprob(v) for t, v in lp.top}
                             for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(logprobs: list[TokenLogprob], decode) -> dict:
    """The chat API's ``logprobs`` object: ``content``, one entry per token with its text
    (its share of the output, as in :func:`completion_logprobs`), logprob, UTF-8 bytes and
    ``top_logprobs`` (alternatives decoded alone)."""
    def entry(text: str, value: float) -> dict:
        return {"token": text, "logprob": json_logprob(value),
                "bytes": list(text.encode("utf-8"))}

    pieces = token_pieces([lp.token_id for lp in logprobs], decode)
    return {"content": [entry(piece, lp.logprob)
                        | {"top_logprobs": [entry(decode([t]), v) for t, v in lp.top]}
                        for piece, lp in zip(pieces, logprobs)]}


def created() -> int:
    """The response's ``created`` field: Unix seconds."""
    return int(time.time())
