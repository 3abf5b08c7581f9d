"""The HTTP application: OpenAI's completions, chat completions and models endpoints, health
and Prometheus metrics, on FastAPI.

Request flow: the body is validated by its model (:mod:`exactspec.server.protocol`; a bad
field → 400 naming it) and the API's own rules (:meth:`SamplingRequest.check
<exactspec.server.protocol.SamplingRequest.check>`); then, off the event loop, its prompts
are tokenised and each prepared by the engine (:func:`~exactspec.request.prepare_request`,
whose :class:`~exactspec.request.RequestError` becomes a 400 naming the API's field); a
:class:`~exactspec.server.worker.Job` is queued on the
:class:`~exactspec.server.worker.EngineWorker` (a full queue → 503 at once), and its events
become either one JSON response or server-sent events
(:mod:`~exactspec.server.streaming`), rendered by the endpoint's
:mod:`~exactspec.server.responses`. A client that disconnects cancels its job.

The endpoints are module-level functions on one router; what they serve from lives in a
:class:`Serving` on ``app.state.serving``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable, Sequence

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from exactspec.backends.base import Backend
from exactspec.generator import SpeculativeGenerator
from exactspec.load_options import DEFAULT_MAX_BATCH_SIZE
from exactspec.proposers.base import Proposer
from exactspec.request import Request as EngineRequest
from exactspec.request import RequestError, prepare_request, prompt_tokens
from exactspec.server.metrics import ServerMetrics
from exactspec.server.protocol import (ChatCompletionRequest, CompletionRequest,
                                       SamplingRequest, ServerError, SpeculationOptions)
from exactspec.server.responses import (created, new_id, responses_for, speculation_figures,
                                        usage)
from exactspec.server.streaming import results, stream
from exactspec.server.worker import EngineWorker, Job, QueueFullError
from exactspec.speculation import Speculation, SpeculationSettings

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
"""Largest request body accepted (bytes); larger ones get 413."""


def create_app(target: Backend, proposer: Proposer | None, *, model_name: str,
               speculation: SpeculationSettings, api_key: str | Sequence[str] | None = None,
               max_queue: int = 64, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
               allow_batch_variance: bool = False,
               generator_factory: Callable[..., SpeculativeGenerator] = SpeculativeGenerator,
               ray_metrics: bool = False) -> FastAPI:
    """The server for one loaded ``target`` (and proposer), named ``model_name`` in the API.

    Args:
        speculation: the default num_speculative_tokens and policy (a request's
            ``speculation`` overrides).
        api_key: when set, ``/v1/*`` needs ``Authorization: Bearer <key>`` with this key or
            one of these keys (else 401). A request's *scope* is its key and its
            ``cache_salt``: only requests of one scope share what a proposer learns across
            requests (the suffix corpus), so clients cannot read each other's output
            through the drafts.
        max_queue: most requests waiting for the engine (beyond it: 503).
        max_request_bytes: largest request body (beyond it: 413).
        max_batch_size: most prompts decoded together, in one target forward per cycle
            (:class:`~exactspec.batching.BatchedGenerator`).
        allow_batch_variance: as :class:`~exactspec.generator.SpeculativeGenerator`.
        generator_factory: as :class:`~exactspec.server.worker.EngineWorker` (for testing
            audits only, ``serve --broken-verifier`` injects a wrong verifier here).
        ray_metrics: record every metric as a Ray Serve metric too (a replica of ``serve
            --replicas``: :mod:`exactspec.server.replicas`).
    Returns:
        the FastAPI application; ``app.state.worker`` is its
        :class:`~exactspec.server.worker.EngineWorker`.
    Raises:
        ValueError: if the default policy cannot run with ``proposer``, or a key is empty.
    """
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not key for key in api_keys):
        raise ValueError("an API key is empty: give a non-empty string")
    metrics = ServerMetrics(model_name, ray=ray_metrics)
    if proposer is not None and proposer.corpus is not None:
        metrics.watch_corpus(proposer.corpus)
    worker = EngineWorker(Speculation(target, proposer, speculation,
                                      allow_batch_variance=allow_batch_variance),
                          metrics, max_queue=max_queue, max_batch_size=max_batch_size,
                          generator_factory=generator_factory)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await asyncio.to_thread(worker.close)

    docs = not api_keys  # the interactive docs stay off behind a key
    app = FastAPI(title="exactspec", summary="Exact speculative decoding, OpenAI-compatible",
                  lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url=None, openapi_url="/openapi.json" if docs else None)
    app.state.worker = worker
    app.state.serving = Serving(target, worker, metrics, model_name, api_keys)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    app.add_middleware(Authentication, api_keys=api_keys)  # the outermost: before the body
    app.add_exception_handler(ServerError, server_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.include_router(router)
    return app


class Serving:
    """What the endpoints serve from: the target, its worker and metrics, the model's name
    in the API and the API keys; and the steps of a generation request."""

    def __init__(self, target: Backend, worker: EngineWorker, metrics: ServerMetrics,
                 model_name: str, api_keys: list[str]) -> None:
        self.target, self.worker, self.metrics = target, worker, metrics
        self.model_name, self.api_keys = model_name, api_keys

    def check_model(self, name: str) -> None:
        """Raises: ServerError 404 unless ``name`` is the served model's."""
        if name != self.model_name:
            raise ServerError(404, f"model {name!r} does not exist: this server serves "
                                   f"{self.model_name!r}", "model")

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": created(),
                "owned_by": "exactspec", "max_model_len": self.target.max_context_length}

    async def respond(self, body: SamplingRequest, request: Request, key: int | None):
        """Serve a completions or chat request: check, prepare, queue, answer (one JSON body,
        or a stream when ``body.stream``).

        Raises:
            ServerError: 400 for a request refused (by the API's rules or the engine), 404
                for another model, 503 when the queue is full.
        """
        self.check_model(body.model)
        body.check()
        prepared = await asyncio.to_thread(self.prepare, body)
        job = Job(prepared, self.speculation(body.speculation), asyncio.get_running_loop(),
                  scope=self.scope(key, body.cache_salt))
        try:
            self.worker.submit(job)
        except QueueFullError as error:
            raise ServerError(503, str(error), headers={"Retry-After": "1"}) from None
        render = responses_for(body)
        header = {"id": new_id(render.id_prefix), "object": render.response_object,
                  "created": created(), "model": self.model_name}
        decode = self.target.tokenizer.decode
        if body.stream:
            return StreamingResponse(stream(job, header, render, decode),
                                     media_type="text/event-stream")
        ordered = await results(job, request)
        return {**header, "choices": [render.choice(i, result, job.params, decode)
                                      for i, result in enumerate(ordered)],
                "usage": usage(ordered, job.prompt_lengths),
                "speculation": speculation_figures([result.stats for result in ordered])}

    def prepare(self, body: SamplingRequest) -> list[EngineRequest]:
        """The body's prompts as requests ready to decode, one per prompt, each tokenised
        once here (it takes time: run it off the event loop); the requests get the ids.

        Raises:
            ServerError: 400 naming the API's field, for what the engine refuses (the
                prompt, token ids outside the vocabulary, ...) or the body's parameters
                (:meth:`SamplingRequest.sampling_params
                <exactspec.server.protocol.SamplingRequest.sampling_params>`).
        """
        try:
            prompts = [prompt_tokens(self.target, prompt) for prompt in body.asked().prompts]
            params = body.sampling_params([len(p) for p in prompts],
                                          self.target.max_context_length)
            return [prepare_request(self.target, prompt, params, n=body.n)
                    for prompt in prompts]
        except RequestError as error:
            raise body.request_error(error) from None

    def speculation(self, request: SpeculationOptions | None) -> SpeculationSettings:
        """A request's speculation settings over the server's defaults.

        Raises:
            ServerError: 400 for speculation asked of a server without a proposer, or a
                policy the proposer cannot run.
        """
        request = request or SpeculationOptions()
        default = self.worker.speculation.settings
        has_proposer = self.worker.proposer is not None
        k = (default.num_speculative_tokens if request.num_speculative_tokens is None
             else request.num_speculative_tokens)
        if request.enabled is False:
            k = 0
        elif not has_proposer and (request.enabled or request.num_speculative_tokens):
            raise ServerError(400, "this server runs without a proposer (started with "
                                   "--proposer plain): speculation cannot be enabled",
                              "speculation")
        chosen = SpeculationSettings(k if has_proposer else 0, request.policy or default.policy)
        try:
            self.worker.generator(chosen)
        except ValueError as error:
            raise ServerError(400, f"speculation: {error}", "speculation.policy") from None
        return chosen

    def scope(self, key: int | None, salt: str | None) -> tuple[int | None, str | None] | None:
        """Whose earlier outputs a request may draft from: its key where several are
        configured, and its ``cache_salt``; None (the library's default scope) for
        neither."""
        key = key if len(self.api_keys) > 1 else None
        return None if key is None and salt is None else (key, salt)


def serving(request: Request) -> Serving:
    return request.app.state.serving


PROTECTED = ("/v1/", "/metrics")
"""Paths (prefixes) that need an API key when the server has any."""


class Authentication:
    """ASGI middleware: on :data:`PROTECTED` paths of a server with API keys, a request
    without ``Authorization: Bearer <key>`` naming one of them is answered 401 before its
    body is read or parsed; otherwise the key's index among the server's is kept in the
    request's state (``api_key_index``) for :func:`authorised`. Each key is compared in
    constant time."""

    def __init__(self, app, api_keys: Sequence[str]) -> None:
        self.app, self.api_keys = app, [key.encode() for key in api_keys]

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] != "http" or not self.api_keys
                or not scope["path"].startswith(PROTECTED)):
            return await self.app(scope, receive, send)
        scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
        given = given.strip() if scheme.lower() == b"bearer" else b""
        matches = [secrets.compare_digest(given, key) for key in self.api_keys]
        if not given or not any(matches):
            error = ServerError(401, "a valid API key is required: send the header "
                                     "'Authorization: Bearer <key>'",
                                headers={"WWW-Authenticate": "Bearer"})
            response = JSONResponse(error.body(), status_code=401, headers=error.headers)
            return await response(scope, receive, send)
        scope.setdefault("state", {})["api_key_index"] = matches.index(True)
        await self.app(scope, receive, send)


async def authorised(request: Request) -> int | None:
    """The index of the request's API key among the server's (None: no key needed), as
    :class:`Authentication` found it."""
    return getattr(request.state, "api_key_index", None)


router = APIRouter()


@router.get("/health")
async def health() -> dict:
    return {"status": "ok"}


@router.get("/metrics", dependencies=[Depends(authorised)])
async def prometheus_metrics(request: Request) -> Response:
    return Response(generate_latest(serving(request).metrics.registry),
                    media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/models", dependencies=[Depends(authorised)])
async def models(request: Request) -> dict:
    return {"object": "list", "data": [serving(request).model_card()]}


@router.get("/v1/models/{name:path}", dependencies=[Depends(authorised)])
async def model(name: str, request: Request) -> dict:
    serving(request).check_model(name)
    return serving(request).model_card()


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request,
                      key: int | None = Depends(authorised)):
    return await serving(request).respond(body, request, key)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request,
                           key: int | None = Depends(authorised)):
    return await serving(request).respond(body, request, key)


async def server_error(request: Request, error: ServerError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """A body its model refuses, as OpenAI's 400 naming the field (``param``: its dotted
    path, e.g. ``messages.0.role``)."""
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


async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
    return JSONResponse(ServerError(error.status_code, str(error.detail)).body(),
                        status_code=error.status_code)


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
