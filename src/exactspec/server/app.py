"""The HTTP application: OpenAI's completions, chat completions and models endpoints, health
and Prometheus metrics, on FastAPI.

Request flow: the body is validated (:mod:`exactspec.server.protocol`; a bad field → 400
naming it), the prompt tokenised and checked against the context, a :class:`Job` queued on
the :class:`EngineWorker` (a full queue → 503 at once), then its events become either one
JSON response or server-sent events in OpenAI's chunk format ending with ``data: [DONE]``.
A client that disconnects cancels its job. Streamed text is held back while it could still
be the start of a stop string, so streamed and non-streamed text are equal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from exactspec.backends.base import Backend
from exactspec.batching import DEFAULT_MAX_BATCH_SIZE
from exactspec.engine import GenerationResult
from exactspec.logits_pipeline import outside_vocabulary
from exactspec.proposers.base import Proposer
from exactspec.proposers.suffix import SuffixProposer
from exactspec.sampling import SamplingParams
from exactspec.server.metrics import ServerMetrics
from exactspec.server.protocol import (COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest,
                                       CompletionRequest,
                                       SamplingRequest, ServerError, Speculation, chat_logprobs,
                                       completion_logprobs, created, new_id,
                                       speculation_figures, usage)
from exactspec.server.worker import (Cancelled, EngineWorker, Job, QueueFullError,
                                     SpeculationSettings)

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""Largest request body accepted (bytes); larger ones get 413."""
KEEPALIVE_SECONDS = 1.0
"""While a streamed request waits, an SSE comment this often (it also notices a client
that went away)."""


def create_app(target: Backend, proposer: Proposer | None, *, model_name: str,
               speculation: SpeculationSettings, api_key: str | Sequence[str] | None = None,
               max_queue: int = 64, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
               allow_batch_variance: bool = False) -> FastAPI:
    """The server for one loaded ``target`` (and drafter), named ``model_name`` in the API.

    Args:
        speculation: the default k_max and policy (a request's ``speculation`` overrides).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>`` with this key or
            one of these keys (else 401). A request's *scope* is its key and its
            ``cache_salt``: only requests of one scope share what a drafter learns across
            requests (the suffix corpus), so clients cannot read each other's output
            through the drafts.
        max_queue: most requests waiting for the engine (beyond it: 503).
        max_request_bytes: largest request body (beyond it: 413).
        max_batch_size: most prompts decoded together, in one target forward per cycle
            (:class:`~exactspec.batching.BatchedGenerator`).
    Raises:
        ValueError: if the default policy cannot run with ``proposer``, or a key is empty.
    """
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not key for key in api_keys):
        raise ValueError("an API key is empty: give a non-empty string")
    metrics = ServerMetrics(model_name)
    if isinstance(proposer, SuffixProposer) and proposer.corpus is not None:
        metrics.watch_corpus(proposer.corpus)
    worker = EngineWorker(target, proposer, speculation, metrics, max_queue=max_queue,
                          max_batch_size=max_batch_size,
                          allow_batch_variance=allow_batch_variance)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)

    docs = not api_keys  # the interactive docs stay off behind a key
    app = FastAPI(title="exactspec", summary="Exact speculative decoding, OpenAI-compatible",
                  lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.state.worker = worker
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    bearer = HTTPBearer(auto_error=False)

    async def authorised(credentials: HTTPAuthorizationCredentials | None = Depends(bearer)
                         ) -> int | None:
        """The index of the request's API key among the server's (None: no key needed)."""
        if not api_keys:
            return None
        given = b"" if credentials is None else credentials.credentials.encode()
        matches = [secrets.compare_digest(given, key.encode()) for key in api_keys]  # each
        if credentials is None or not any(matches):
            raise ServerError(401, "a valid API key is required: send the header "
                                   "'Authorization: Bearer <key>'",
                              headers={"WWW-Authenticate": "Bearer"})
        return matches.index(True)

    @app.exception_handler(ServerError)
    async def server_error(request: Request, error: ServerError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        if first.get("type") == "json_invalid":
            return JSONResponse(ServerError(400, "the request body is not valid JSON: "
                                                 f"{first.get('msg')} at character "
                                                 f"{first.get('loc', ('', '?'))[-1]}").body(),
                                status_code=400)
        path = [str(part) for part in first.get("loc", ()) if part != "body"]
        # a union's branch names (str, list[int], ...) are pydantic's, not the field's
        path = [part for part in path
                if part not in ("str", "int") and not part.startswith(("list[", "dict["))]
        message = first.get("msg", "invalid value").removeprefix("Value error, ")
        return JSONResponse(ServerError(400, f"{'.'.join(path) or 'body'}: {message}",
                                        ".".join(path) or None).body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(ServerError(error.status_code, str(error.detail)).body(),
                            status_code=error.status_code)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": created(),
                "owned_by": "exactspec", "max_model_len": target.max_context_length}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}", dependencies=[Depends(authorised)])
    async def model(name: str) -> dict:
        check_model(name)
        return model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request,
                          key: int | None = Depends(authorised)):
        check_model(body.model)
        prompts = [tokenise(prompt) for prompt in body.prompts()]
        if body.stream and body.logprobs is not None:
            raise ServerError(400, "logprobs with stream is not supported yet: ask for them "
                                   "without streaming", "logprobs")
        check_room(prompts, body.max_tokens, "max_tokens")
        params = body.sampling_params(body.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS,
                                      body.logprobs)

        def choice(index: int, result: GenerationResult, text: str) -> dict:
            return {"index": index, "text": text, "finish_reason": result.finish_reason,
                    "stop_reason": stop_reason(result, params),
                    "logprobs": None if result.logprobs is None else completion_logprobs(
                        result.logprobs, target.tokenizer.decode)}

        return await respond(request, body, key, prompts, params, "text_completion", "cmpl",
                             choice)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request,
                               key: int | None = Depends(authorised)):
        check_model(body.model)
        messages = [{"role": m.role if m.role != "developer" else "system", "content": m.text()}
                    for m in body.messages]
        try:
            prompt = target.tokenizer.apply_chat_template(messages)
        except ValueError as error:
            raise ServerError(400, f"messages: {error}", "messages") from None
        check_length(prompt, "messages")
        if body.stream and body.logprobs:
            raise ServerError(400, "logprobs with stream is not supported yet: ask for them "
                                   "without streaming", "logprobs")
        if body.top_logprobs is not None and not body.logprobs:
            raise ServerError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        check_room([prompt], body.max_completion_tokens or body.max_tokens,
                   "max_completion_tokens" if body.max_completion_tokens else "max_tokens")
        room = (target.max_context_length - len(prompt) if target.max_context_length
                else None)
        max_tokens = body.max_completion_tokens or body.max_tokens or max(room or 2048, 1)
        params = body.sampling_params(max_tokens, (body.top_logprobs or 0) if body.logprobs
                                      else None)

        def choice(index: int, result: GenerationResult, text: str) -> dict:
            return {"index": index, "message": {"role": "assistant", "content": text},
                    "finish_reason": result.finish_reason,
                    "stop_reason": stop_reason(result, params),
                    "logprobs": None if result.logprobs is None else chat_logprobs(
                        result.logprobs, target.tokenizer.decode)}

        return await respond(request, body, key, [prompt], params, "chat.completion",
                             "chatcmpl", choice)

    def check_model(name: str) -> None:
        if name != model_name:
            raise ServerError(404, f"model {name!r} does not exist: this server serves "
                                   f"{model_name!r}", "model")

    def check_length(prompt: list[int], field: str) -> None:
        limit = target.max_context_length
        if not prompt:
            raise ServerError(400, f"{field} is empty: give at least one token", field)
        if limit is not None and len(prompt) >= limit:
            raise ServerError(400, f"{field} has {len(prompt)} tokens; the context holds "
                                   f"{limit} (max_model_len), so at most {limit - 1} leave "
                                   "room for a generated token", field)

    def check_room(prompts: list[list[int]], max_tokens: int | None, field: str) -> None:
        """As vLLM: prompt + the asked ``max_tokens`` must fit the context."""
        limit = target.max_context_length
        longest = max(len(prompt) for prompt in prompts)
        if limit is not None and max_tokens is not None and longest + max_tokens > limit:
            raise ServerError(400, f"{field} = {max_tokens} is too large: the context holds "
                                   f"{limit} tokens (max_model_len) and the prompt has {longest}, "
                                   f"so at most {limit - longest} can be generated", field)

    def tokenise(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = target.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not 0 <= t < target.vocab_size]
            if bad:
                raise ServerError(400, f"prompt token ids {bad[:5]} are outside the vocabulary "
                                       f"[0, {target.vocab_size})", "prompt")
        check_length(ids, "prompt")
        return ids

    def scope(key: int | None, salt: str | None) -> tuple[int | None, str | None] | None:
        """Whose earlier outputs a request may draft from: its key where several are
        configured, and its ``cache_salt``; None (the library's default scope) for
        neither."""
        key = key if len(api_keys) > 1 else None
        return None if key is None and salt is None else (key, salt)

    def settings(request: Speculation | None) -> SpeculationSettings:
        request = request or Speculation()
        default = worker.default_speculation
        k = (default.num_speculative_tokens if request.num_speculative_tokens is None
             else request.num_speculative_tokens)
        if request.enabled is False:
            k = 0
        elif proposer is None and (request.enabled or request.num_speculative_tokens):
            raise ServerError(400, "this server runs without a drafter (started with "
                                   "--proposer none): speculation cannot be enabled",
                              "speculation")
        chosen = SpeculationSettings(k if proposer is not None else 0,
                                     request.policy or default.policy)
        try:
            worker.generator(chosen)
        except ValueError as error:
            raise ServerError(400, f"speculation: {error}", "speculation.policy") from None
        return chosen

    def check_token_ids(params) -> None:
        """Token ids named by the request lie in the vocabulary (else 400 before queueing)."""
        if (found := outside_vocabulary(params, target.vocab_size)) is not None:
            field, bad = found
            raise ServerError(400, f"{field}: token ids {bad[:5]} are outside the "
                                   f"vocabulary [0, {target.vocab_size})", field)

    async def respond(request: Request, body: SamplingRequest, key: int | None,
                      prompts: list[list[int]], params, kind: str, prefix: str,
                      choice: Callable[[int, GenerationResult, str], dict]):
        check_token_ids(params)
        job = Job(prompts, params, body.n, settings(body.speculation),
                  asyncio.get_running_loop(), scope=scope(key, body.cache_salt))
        try:
            worker.submit(job)
        except QueueFullError as error:
            raise ServerError(503, str(error), headers={"Retry-After": "1"}) from None
        header = {"id": new_id(prefix), "object": kind, "created": created(),
                  "model": model_name}
        decode = target.tokenizer.decode
        if body.stream:
            return StreamingResponse(stream(job, header, body, prompts, decode),
                                     media_type="text/event-stream")
        results: dict[int, GenerationResult] = {}
        async for event, index, value in events(job, request):
            if event == "result":
                results[index] = value
        ordered = [results[i] for i in sorted(results)]
        return {**header, "choices": [choice(i, r, final_text(r, decode))
                                      for i, r in enumerate(ordered)],
                "usage": usage(ordered, [len(p) for p in prompts]),
                "speculation": speculation_figures([r.stats for r in ordered])}

    return app


async def events(job: Job, request: Request | None = None,
                 keepalive: bool = False) -> AsyncIterator[tuple[str, int | None, Any]]:
    """A job's events until its end; cancels the job if the client goes away (checked every
    :data:`KEEPALIVE_SECONDS`, when ``request`` is given) or the consumer stops. With
    ``keepalive`` a ``("keepalive", None, None)`` event comes at each such interval.

    Raises:
        ServerError: 400 for a generation refused as invalid (e.g. a token id outside the
            vocabulary), 500 for any other failure.
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


def stop_reason(result: GenerationResult, params: SamplingParams) -> int | str | None:
    """vLLM's ``stop_reason``: the stop string or the ``stop_token_ids`` entry that ended the
    choice, None otherwise (EOS, length)."""
    if isinstance(result.stop_reason, int) and result.stop_reason not in params.stop_token_ids:
        return None
    return result.stop_reason


def final_text(result: GenerationResult, decode: Callable[[list[int]], str]) -> str:
    """The choice's text as OpenAI returns it: without the stop string that ended it (and
    anything its last token spelled after it)."""
    text = result.text
    if isinstance(result.stop_reason, str):
        before = len(decode(result.token_ids[:-1]).rstrip("\ufffd"))
        text = text[:text.find(result.stop_reason,
                               max(0, before - len(result.stop_reason) + 1))]
    return text


class StreamedChoice:
    """One choice's streamed text: the decoded tokens so far, less what is or could still
    become a stop string (text is sent only up to the first occurrence of one, and never
    the last ``len(stop) - 1`` characters), and less an incomplete UTF-8 character. The
    rest comes with the result (:meth:`rest`), cut as the non-streamed text is."""

    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str]) -> None:
        self.decode, self.stop = decode, stop
        self.hold_back = max((len(s) for s in stop), default=1) - 1
        self.token_ids: list[int] = []
        self.sent = 0

    def delta(self, token_ids: list[int]) -> str:
        self.token_ids += token_ids
        text = self.decode(self.token_ids).rstrip("\ufffd")
        ready = len(text) - self.hold_back
        for stop in self.stop:
            if (found := text.find(stop, max(0, self.sent - len(stop) + 1))) >= 0:
                ready = min(ready, found)
        ready = max(self.sent, ready)
        piece, self.sent = text[self.sent:ready], ready
        return piece

    def rest(self, result: GenerationResult) -> str:
        piece = final_text(result, self.decode)[self.sent:]
        self.sent += len(piece)
        return piece


async def stream(job: Job, header: dict, body: SamplingRequest, prompts: list[list[int]],
                 decode: Callable[[list[int]], str]) -> AsyncIterator[str]:
    """Server-sent events for ``job``: a chunk per cycle and choice, a last chunk per choice
    with its finish reason, then (with ``stream_options.include_usage``) usage in a chunk
    with no choices, then ``data: [DONE]``. The request's speculative figures ride on the
    last chunk before ``[DONE]``."""
    chat = header["object"] == "chat.completion"
    header = header | {"object": "chat.completion.chunk" if chat else "text_completion"}
    choices = [StreamedChoice(decode, job.params.stop) for _ in range(len(prompts) * body.n)]
    results: dict[int, GenerationResult] = {}

    def figures() -> dict:
        return speculation_figures([results[i].stats for i in sorted(results)])

    def chunk(index: int, text: str, finish: GenerationResult | None = None,
              first: bool = False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if first else
                     {"content": text} if text or finish is None else {})
            data = {"index": index, "delta": delta, "logprobs": None}
        else:
            data = {"index": index, "text": text, "logprobs": None}
        data |= {"finish_reason": finish and finish.finish_reason,
                 "stop_reason": finish and stop_reason(finish, job.params)}
        last = finish is not None and len(results) == len(choices) and not body.include_usage
        return sse(header | {"choices": [data]} | ({"speculation": figures()} if last else {}))

    try:
        if chat:
            for index in range(len(choices)):
                yield chunk(index, "", first=True)
        async for event, index, value in events(job, keepalive=True):
            if event == "keepalive":
                yield ": keep-alive\n\n"
            elif event == "tokens":
                if text := choices[index].delta(value):
                    yield chunk(index, text)
            else:  # result
                results[index] = value
                yield chunk(index, choices[index].rest(value), finish=value)
        if body.include_usage:  # OpenAI's usage chunk: no choices
            yield sse(header | {"choices": [], "speculation": figures(),
                                "usage": usage([results[i] for i in sorted(results)],
                                               [len(p) for p in prompts])})
    except ServerError as error:
        yield sse(error.body())
    finally:
        job.cancelled.set()  # the client went away (a no-op once the job ended)
    yield "data: [DONE]\n\n"


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class BodySizeLimit:
    """ASGI middleware: a request body over ``max_bytes`` (by its Content-Length, or counted
    as it arrives) is answered 413 before the application reads it."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = JSONResponse(ServerError(413, f"the request body is larger than "
                                                  f"{self.max_bytes} bytes").body(),
                                 status_code=413)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_large(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await too_large(scope, receive, send)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
