"""An engine reached over an OpenAI-compatible HTTP API, as the audit samples it: exactspec
serve, vLLM, SGLang, TGI, llama.cpp's ``llama-server``, llama-cpp-python's server, Ollama.
:class:`Endpoint` is an :class:`~exactspec.engines.Engine` (``sample``, ``generate``, the
drafting counts); its prompts may be text, sent as is, as well as token ids.

Requests go through the ``openai`` client (its timeouts, and retries with exponential
back-off on connection errors, 408, 409, 429 and 5xx), at most ``concurrency`` at a time.
A request that still fails is recorded in :attr:`Endpoint.failures` and never counted as a
sample; a refusal (400, 401, 404, 422: the request itself is wrong) stops the audit with
the server's message.

**What a sample is.** The generated tokens, read in this order of preference:

1. ``token_ids`` of the choice (vLLM's and exactspec's ``return_token_ids``, asked for on
   every request unless ``ask_token_ids=False``): the token ids themselves;
2. the ``logprobs`` tokens (asked for on every request, with one alternative): one entry
   per generated token; its id where the entry has one (llama.cpp's ``llama-server``
   gives ``id``; vLLM's ``return_tokens_as_token_ids`` writes ``token_id:N``), else its
   text, which names the token in a two-sample test (the same function of the output on
   both sides) but not for a reference;
3. the text, re-tokenised with the served model's tokenizer when one is given.

:attr:`Endpoint.token_source` says which one the samples came from. A choice that stopped
(``finish_reason`` ``stop``) before ``max_tokens`` ends with :data:`END` (after its EOS id,
where the engine returns one), so that where a sample ends is itself an outcome.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from exactspec.engines import Generation, one_after_another
from exactspec.generation_stats import GenerationStats
from exactspec.sampling import SamplingParams

END = "<end>"
"""The symbol after the last token of a choice that stopped (EOS or stop string)."""
SEED_SPACE = 2**31
"""Request seeds stay below this (llama.cpp's are 32-bit, all ones meaning random)."""
TOKEN_SOURCES = {"token_ids": "token ids returned by the API (return_token_ids)",
                 "logprob_ids": "token ids from the logprobs (token_id:N)",
                 "logprob_text": "the text of each token from the logprobs",
                 "text": "the text, re-tokenised with the local tokenizer"}
"""Where samples came from (:attr:`Endpoint.token_source`), as the report says it."""
REFUSALS = (400, 401, 403, 404, 422)
"""HTTP statuses that mean the request itself is wrong: the audit stops on them."""
MAX_FAILURES_IN_A_ROW = 20
"""Requests failing one after another before the audit stops (the endpoint is down)."""

Symbol = Hashable
"""A token: its id, or its text where the API gives no ids (or :data:`END`)."""


class EndpointError(Exception):
    """A request failed: the endpoint refused it (the message is the server's), could not be
    reached, or answered what the audit cannot read.

    Attributes:
        status: the HTTP status, None when there was no answer.
    """

    def __init__(self, message: str, status: int | None = None, fatal: bool = False) -> None:
        super().__init__(message)
        self.status, self.fatal = status, fatal

    @property
    def refused(self) -> bool:
        """Whether the audit cannot go on: the request itself is wrong (:data:`REFUSALS`),
        or the answers cannot be read as samples; retrying cannot help."""
        return self.fatal or self.status in REFUSALS


@dataclass
class Completion:
    """One choice of a response.

    Attributes:
        tokens: ``[num_tokens]`` the generated tokens (ids or texts, see module docstring),
            then :data:`END` when the choice stopped before ``max_tokens``.
        text: the choice's text.
        finish_reason: ``stop`` or ``length`` (as the API said).
        logprobs: ``[num_tokens]`` each generated token's log-probability (natural log),
            or None when the API gave none.
        top_logprobs: ``[num_tokens]`` the alternatives per token, text → logprob, or None.
        source: a key of :data:`TOKEN_SOURCES`.
        texts: ``[num_tokens]`` each token's text from the logprobs (None: none given).
    """

    tokens: tuple[Symbol, ...]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None
    top_logprobs: list[dict[str, float]] | None
    source: str
    texts: list[str] | None = None


@dataclass
class Endpoint:
    """An engine behind ``url`` (the API's base, e.g. ``http://127.0.0.1:8000/v1``), as an
    :class:`~exactspec.engines.Engine` (``corpus`` is None: what the server remembers is
    out of reach).

    Attributes:
        url: the base URL (``/v1`` is added when the path has none).
        model: the served model's name in the API (None: the first of ``GET /models``).
        api_key: sent as ``Authorization: Bearer``.
        extra_body: fields added to every request body (the engine's own: speculation
            settings, ``repeat_penalty`` ...); they override the audit's fields.
        chat: use ``/chat/completions`` with the prompt as one user message (default:
            ``/completions`` with the prompt as text).
        tokenizer_encode: text → token ids, to re-tokenise the text of APIs that give no
            ids (None: such an API is refused where ids are needed).
        ids_only: samples must be token ids (a reference test): where the API gives none,
            the text is re-tokenised rather than the logprobs' token texts used.
        concurrency: most requests in flight.
        timeout: seconds per request.
        max_retries: retries per request (the openai client's, with back-off).
        samples_per_request: choices asked per request (the API's ``n``; 1 for engines
            that ignore it, e.g. llama-cpp-python's server).
        seed_offset: added to every request's seed, so that two sample sets drawn with the
            same audit seed (A, B, the control) are independent.
        ask_token_ids: send ``return_token_ids: true`` (off for servers refusing
            unknown fields).
        ask_logprobs: ask for logprobs when sampling (off where they are costly, e.g.
            llama-cpp-python's server computes them over the whole vocabulary in Python:
            tokens then come from the ids, or the re-tokenised text).
        name: how reports call it.
        http_client: the ``httpx.Client`` requests go through (None: the openai client's
            own; tests pass one with a mock transport).
        requests: requests sent (each after its retries).
        failures: one line per request that failed after its retries.
        token_source: where the samples' tokens came from (key of :data:`TOKEN_SOURCES`),
            None before the first sample.
        draft_stats: drafted and accepted tokens (in total and per position) summed from the
            responses' ``speculation`` figures (exactspec serve) or, for requests of one
            choice, ``timings.draft_n`` and ``draft_n_accepted`` (llama-server, which
            reports one choice's only), None where none came.
    """

    url: str
    model: str | None = None
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    chat: bool = False
    tokenizer_encode: Callable[[str], list[int]] | None = None
    ids_only: bool = False
    concurrency: int = 4
    timeout: float = 120.0
    max_retries: int = 3
    samples_per_request: int = 1
    seed_offset: int = 0
    ask_token_ids: bool = True
    ask_logprobs: bool = True
    name: str = ""
    http_client: object | None = None
    requests: int = 0
    failures: list[str] = field(default_factory=list)
    token_source: str | None = None
    draft_stats: GenerationStats | None = None
    corpus = None

    def __post_init__(self) -> None:
        import openai

        if self.concurrency < 1 or self.samples_per_request < 1:
            raise ValueError(f"concurrency {self.concurrency} and samples per request "
                             f"{self.samples_per_request} must be ≥ 1")
        base = self.url.rstrip("/")
        if not base.split("://", 1)[-1].count("/"):
            base += "/v1"
        self.url = base
        self.name = self.name or base
        self._client = openai.OpenAI(base_url=base, api_key=self.api_key or "none",
                                     timeout=self.timeout, max_retries=self.max_retries,
                                     http_client=self.http_client)
        self._lock = threading.Lock()
        self._failing = 0  # requests failed in a row
        if self.model is None:
            self.model = self._first_model()

    def _first_model(self) -> str:
        import openai

        try:
            models = list(self._client.models.list())
        except openai.APIError as error:
            if getattr(error, "status_code", None) is None:
                raise EndpointError(f"cannot reach {self.url}: {describe(error)}",
                                    fatal=True) from None
            raise EndpointError(f"{self.url}/models: {describe(error)}: give the model's name "
                                "(--endpoint-model)", fatal=True) from None
        if not models:
            raise EndpointError(f"{self.url}/models lists no model: give the model's name "
                                "(--endpoint-model)")
        return models[0].id

    def body(self, params: SamplingParams, seed: int | None, n: int, top_logprobs: int = 1
             ) -> dict:
        """The request's fields other than the prompt: OpenAI's, vLLM's ``top_k``,
        ``min_p`` and ``return_token_ids``, then :attr:`extra_body`.

        Raises:
            ValueError: for a parameter the audit cannot send (penalties, bans, stops).
        """
        untranslated = [name for name, value in vars(params).items()
                        if name not in TRANSLATED and value != getattr(SamplingParams(), name)]
        if untranslated:
            raise ValueError(f"the endpoint audit sends temperature, top_p, top_k, min_p, "
                             f"seed and max_tokens; {', '.join(untranslated)} cannot be sent "
                             "(put an engine's own field in --extra-body)")
        body = {"max_tokens": params.max_new_tokens, "temperature": params.temperature,
                "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p, "n": n}
        if seed is not None:
            body["seed"] = seed
        if top_logprobs > 1 or self.ask_logprobs:
            body |= ({"logprobs": True, "top_logprobs": top_logprobs} if self.chat
                     else {"logprobs": top_logprobs})
        if self.ask_token_ids:
            body["return_token_ids"] = True
        return body | self.extra_body

    def complete(self, prompt: str | Sequence[int], params: SamplingParams,
                 seed: int | None = None, n: int = 1, top_logprobs: int = 1
                 ) -> list[Completion]:
        """One request: ``n`` choices continuing ``prompt`` (text, or token ids for the
        completions API).

        Raises:
            EndpointError: the server refused the request, or it failed after its retries.
        """
        import openai

        body = self.body(params, seed, n, top_logprobs)
        with self._lock:
            self.requests += 1
        try:
            if self.chat:
                if not isinstance(prompt, str):
                    raise ValueError("the chat API takes the prompt as text")
                response = self._client.chat.completions.with_raw_response.create(
                    model=self.model, messages=[{"role": "user", "content": prompt}],
                    extra_body=body)
            else:
                response = self._client.completions.with_raw_response.create(
                    model=self.model, prompt=prompt if isinstance(prompt, str) else list(prompt),
                    extra_body=body)
        except openai.APIError as error:
            raise EndpointError(describe(error), getattr(error, "status_code", None)) from None
        try:
            data = json.loads(response.text)
            if not isinstance(data, dict):
                raise ValueError(f"the body is a JSON {type(data).__name__}, not an object")
            choices = data.get("choices")
            if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
                raise ValueError("the body has no list of choices (objects) under 'choices'")
            choices = sorted(choices, key=lambda c: c.get("index", 0))
            if len(choices) != n:
                raise EndpointError(f"asked for n = {n} choices, got {len(choices)}: this "
                                    "engine ignores n (use --samples-per-request 1)", fatal=True)
            completions = [self._completion(choice, params.max_new_tokens) for choice in choices]
        except (ValueError, TypeError, KeyError, AttributeError) as error:
            raise EndpointError(f"unreadable answer: {error}") from None
        self._count_drafts(data.get("speculation"))
        timings = data.get("timings")
        if n == 1 and isinstance(timings, dict) and "draft_n" in timings:  # llama-server's
            self._count_drafts({"drafted_tokens": timings["draft_n"],
                                "accepted_tokens": timings.get("draft_n_accepted", 0)})
        return completions

    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        """One continuation of each prompt, one request each (seeded ``params.seed``, no
        logprobs asked beyond :attr:`ask_logprobs`), timed by the client: ``seconds`` from
        sending the request to its answer.

        Args:
            at_once: send the requests together, at most :attr:`concurrency` in flight;
                False: one after another.
        Returns:
            ``[num_requests]`` :class:`~exactspec.engines.Generation`, in order; its
            ``token_ids`` are the choice's tokens without :data:`END` (texts where the API
            gives no ids, see the module docstring); ``stats`` None.
        Raises:
            EndpointError: a request failed or was refused.
            ValueError: for a parameter the audit cannot send.
        """
        def one(prompt) -> Generation:
            start = time.perf_counter()
            completion = self.complete(prompt, params, params.seed)[0]
            seconds = time.perf_counter() - start
            return Generation([t for t in completion.tokens if t != END], seconds, seconds)

        if not at_once:
            return one_after_another(one, prompts)
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(self.concurrency) as pool:
            futures = [pool.submit(lambda p: (one(p), time.perf_counter() - start), prompt)
                       for prompt in prompts]
            return [dataclasses.replace(g, latency=latency)
                    for g, latency in (f.result() for f in futures)]

    def sample(self, prompt: str | Sequence[int], params: SamplingParams, num_samples: int,
               progress: Callable[[int], None] = lambda n: None) -> list[tuple[Symbol, ...]]:
        """``num_samples`` continuations of ``prompt`` with ``params``, requests in parallel;
        request r is seeded ``((params.seed · 64 + r) · samples_per_request + seed_offset)
        mod 2**31`` (no seed when ``params.seed`` is None): seeds n apart, so that an engine
        seeding choice i of a request with seed + i (llama-server) never repeats a sample. Failed requests are recorded in :attr:`failures` and left
        out, so fewer samples may come back. On Ctrl-C the requests not yet sent are
        dropped and KeyboardInterrupt goes on to the caller.

        Raises:
            EndpointError: the server refused a request (the audit cannot go on).
        """
        per = self.samples_per_request
        sizes = [min(per, num_samples - start) for start in range(0, num_samples, per)]
        if len(sizes) > 64:
            raise ValueError(f"{num_samples} samples in one call: at most {64 * per}")

        def request(r: int) -> list[Completion]:
            seed = None if params.seed is None else ((params.seed * 64 + r) * per
                                                      + self.seed_offset) % SEED_SPACE
            return self.complete(prompt, params, seed, sizes[r])

        answers: dict[int, list[Completion]] = {}
        pool = concurrent.futures.ThreadPoolExecutor(self.concurrency)
        futures = {pool.submit(request, r): r for r in range(len(sizes))}
        try:
            for future in concurrent.futures.as_completed(futures):
                r = futures[future]
                try:
                    answers[r] = future.result()
                except EndpointError as error:
                    if error.refused:
                        raise
                    self.failures.append(f"seed {params.seed} request {r} ({sizes[r]} samples): "
                                         f"{error}")
                    self._failing += 1
                    if self._failing >= MAX_FAILURES_IN_A_ROW:
                        raise EndpointError(f"{self.name}: {self._failing} requests failed in "
                                            f"a row, the last with: {error}", fatal=True) from None
                    continue
                self._failing = 0
                self._check_source(answers[r])
                progress(len(answers[r]))
        finally:  # on Ctrl-C or a refusal, requests not sent are dropped
            pool.shutdown(wait=False, cancel_futures=True)
        return [c.tokens for r in sorted(answers) for c in answers[r]]

    def _check_source(self, completions: Sequence[Completion]) -> None:
        """Every sample's tokens must come from one source (:data:`TOKEN_SOURCES`)."""
        for completion in completions:
            if self.token_source is None:
                self.token_source = completion.source
            elif completion.source != self.token_source:
                raise EndpointError(f"{self.name}: a sample's tokens came from "
                                    f"{TOKEN_SOURCES[completion.source]}, earlier ones from "
                                    f"{TOKEN_SOURCES[self.token_source]}", fatal=True)

    def _completion(self, choice: dict, max_tokens: int) -> Completion:
        text = choice.get("text")
        if text is None:
            text = (choice.get("message") or {}).get("content") or ""
        logprobs, top, pieces = _logprobs(choice.get("logprobs"))
        if choice.get("token_ids") is not None:
            tokens, source = tuple(_token_id(t) for t in choice["token_ids"]), "token_ids"
        elif pieces is not None and pieces and all(isinstance(p, str) and p.startswith("token_id:")
                                                   for p in pieces):
            tokens, source = tuple(_token_id(p.split(":", 1)[1]) for p in pieces), "logprob_ids"
        elif pieces is not None and (pieces or not text) and not self.ids_only:
            tokens, source = tuple(pieces), "logprob_text"
        elif self.tokenizer_encode is not None:
            tokens, source = tuple(self.tokenizer_encode(text)), "text"
        else:
            raise EndpointError("the endpoint returned no token ids"
                                + ("" if self.ids_only else " nor per-token logprobs")
                                + ": a local model's tokenizer is needed to re-tokenise the text")
        finish = choice.get("finish_reason")
        if finish == "stop" and len(tokens) < max_tokens:
            tokens += (END,)
        return Completion(tokens, text, finish, logprobs, top, source, pieces)

    def _count_drafts(self, figures: dict | None) -> None:
        """Add a response's ``speculation`` figures (exactspec serve's) to the counts; figures
        that are not counts (integers ≥ 0) are left out."""
        if not isinstance(figures, dict) or not all(
                _is_count(figures.get(name)) for name in ("drafted_tokens", "accepted_tokens")):
            return
        def per_position(name: str) -> list[int]:
            value = figures.get(name)
            return value if isinstance(value, list) and all(map(_is_count, value)) else []

        drafted, accepted = per_position("drafted_per_position"), per_position("accepted_per_position")
        k = max(len(drafted), len(accepted))
        response = GenerationStats(
            num_speculative_tokens=k, drafted_tokens=figures["drafted_tokens"],
            accepted_tokens=figures["accepted_tokens"],
            drafted_per_position=drafted + [0] * (k - len(drafted)),
            accepted_per_position=accepted + [0] * (k - len(accepted)))
        with self._lock:
            if self.draft_stats is None:
                self.draft_stats = GenerationStats()
            self.draft_stats.add(response)


def _token_id(value) -> int:
    """A token id from an answer: an integer ≥ 0, or its decimal string (``token_id:N``).

    Raises:
        ValueError: for anything else (a float, a boolean, a word).
    """
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    if not _is_count(value):
        raise ValueError(f"a token id is {value!r}, not an integer ≥ 0")
    return value


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


TRANSLATED = ("temperature", "top_p", "top_k", "min_p", "seed", "max_new_tokens")
"""The SamplingParams fields the endpoint audit sends."""


def _logprobs(entry: dict | None) -> tuple[list[float] | None, list[dict] | None,
                                           list[str] | None]:
    """(chosen logprobs, top alternatives, token texts) of a choice's ``logprobs``, in the
    completions API's shape (``tokens``, ``token_logprobs``, ``top_logprobs``) or the chat
    API's (``content``: ``token``, ``logprob``, ``top_logprobs``)."""
    if not entry:
        return None, None, None
    if "content" in entry:
        content = entry.get("content") or []
        return ([c.get("logprob") for c in content],
                [{t["token"]: t["logprob"] for t in c.get("top_logprobs") or []}
                 for c in content],
                [f"token_id:{c['id']}" if "id" in c else c.get("token") for c in content])
    return (entry.get("token_logprobs"), entry.get("top_logprobs"), entry.get("tokens"))


def describe(error) -> str:
    """An openai client error as ``STATUS: the server's message`` (or the connection error)."""
    status = getattr(error, "status_code", None)
    body = getattr(error, "body", None)
    message = (body.get("message") if isinstance(body, dict) and "message" in body
               else body.get("error", {}).get("message") if isinstance(body, dict)
               and isinstance(body.get("error"), dict) else None) or str(error)
    return f"{status}: {message}" if status else f"{type(error).__name__}: {message}"
