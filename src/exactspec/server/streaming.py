"""A job's events as one response or as server-sent events.

:func:`events` reads a job's events (cancelling it when the client goes away);
:func:`stream` turns them into OpenAI's chunks, ending with ``data: [DONE]``. Streamed text
is held back while it could still be the start of a stop string (:class:`StreamedChoice`),
so that a stream's concatenation equals the non-streamed text.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request

from exactspec.generator import GenerationResult
from exactspec.server.errors import ServerError
from exactspec.server.responses import (CompletionResponses, Decode, final_text,
                                        speculation_figures, usage)
from exactspec.server.worker import Cancelled, Job
from exactspec.text import INCOMPLETE, find_stop

KEEPALIVE_SECONDS = 1.0
"""While a streamed request waits, an SSE comment this often (it also notices a client
that went away)."""


async def events(job: Job, request: Request | None = None,
                 keepalive: bool = False) -> AsyncIterator[tuple[str, int | None, Any]]:
    """A job's events until its end; cancels the job if the client goes away (checked every
    :data:`KEEPALIVE_SECONDS`, when ``request`` is given) or the consumer stops. With
    ``keepalive`` a ``("keepalive", None, None)`` event comes at each such interval.

    Raises:
        ServerError: 400 for a generation refused as invalid (e.g. a token id outside the
            vocabulary), 503 when it was cancelled (the server shuts down), 500 for any
            other failure.
    """
    loop = asyncio.get_running_loop()
    checked = loop.time()
    try:
        while True:
            try:
                event = await asyncio.wait_for(job.events.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                event = None
            if loop.time() - checked >= KEEPALIVE_SECONDS:
                checked = loop.time()
                if request is not None and await request.is_disconnected():
                    return
                if keepalive and event is None:
                    yield "keepalive", None, None
            if event is None:
                continue
            kind, _, value = event
            if kind == "end":
                return
            if kind == "error":
                if isinstance(value, Cancelled):
                    raise ServerError(503, str(value))
                raise ServerError(400 if isinstance(value, ValueError) else 500,
                                  f"generation failed: {value}")
            yield event
    finally:
        job.cancelled.set()  # a no-op once the job ended


async def results(job: Job, request: Request) -> list[GenerationResult]:
    """Every choice's result, in order (errors as :func:`events`)."""
    finished: dict[int, GenerationResult] = {}
    async for event, index, value in events(job, request):
        if event == "result":
            finished[index] = value
    return [finished[i] for i in sorted(finished)]


class StreamedChoice:
    """One choice's streamed text: the decoded tokens so far, less what is or could still
    become a stop string (text is sent only up to the first occurrence of one, found as the
    engine finds it, :func:`~exactspec.text.find_stop`, and never the last
    ``len(stop) - 1`` characters), and less an incomplete character. The rest comes with
    the result (:meth:`rest`), cut as the non-streamed text is
    (:func:`~exactspec.server.responses.final_text`)."""

    def __init__(self, decode: Decode, stop: Sequence[str]) -> None:
        self.decode, self.stop = decode, stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = 0  # characters sent

    def delta(self, token_ids: list[int]) -> str:
        """The text to send after ``token_ids`` more (possibly ``""``)."""
        self.token_ids += token_ids
        text = self.decode(self.token_ids).rstrip(INCOMPLETE)
        ready = len(text) - self.hold_back
        if (found := find_stop(text, self.stop, self.sent)) is not None:
            ready = min(ready, found[0])
        ready = max(self.sent, ready)
        piece, self.sent = text[self.sent:ready], ready
        return piece

    def rest(self, result: GenerationResult) -> str:
        """What is left to send of the finished choice."""
        piece = final_text(result)[self.sent:]
        self.sent += len(piece)
        return piece


async def stream(job: Job, header: dict, render: CompletionResponses, decode: Decode
                 ) -> AsyncIterator[str]:
    """Server-sent events for ``job``: a chunk per cycle and choice, a last chunk per choice
    with its finish reason, then (with ``stream_options.include_usage``) usage in a chunk
    with no choices, then ``data: [DONE]``. The request's speculative figures ride on the
    last chunk before ``[DONE]``. An error is sent as OpenAI's error body."""
    header = header | {"object": render.chunk_object}
    include_usage = render.body.include_usage
    choices = [StreamedChoice(decode, job.params.stop) for _ in range(job.num_choices)]
    finished: dict[int, GenerationResult] = {}

    def figures() -> dict:
        return speculation_figures([finished[i].stats for i in sorted(finished)])

    def chunk(index: int, text: str, result: GenerationResult | None = None,
              first: bool = False) -> str:
        data = render.chunk_choice(index, text, job.params, result, first)
        last = result is not None and len(finished) == len(choices) and not include_usage
        return sse(header | {"choices": [data]} | ({"speculation": figures()} if last else {}))

    try:
        if render.opening_chunk:
            for index in range(len(choices)):
                yield chunk(index, "", first=True)
        async for event, index, value in events(job, keepalive=True):
            if event == "keepalive":
                yield ": keep-alive\n\n"
            elif event == "tokens":
                if text := choices[index].delta(value):
                    yield chunk(index, text)
            else:  # result
                finished[index] = value
                yield chunk(index, choices[index].rest(value), value)
        if include_usage:  # OpenAI's usage chunk: no choices
            yield sse(header | {"choices": [], "speculation": figures(),
                                "usage": usage([finished[i] for i in sorted(finished)],
                                               job.prompt_lengths)})
    except ServerError as error:
        yield sse(error.body())
    finally:
        job.cancelled.set()  # the client went away (a no-op once the job ended)
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    """One server-sent event carrying ``data`` as JSON."""
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"
