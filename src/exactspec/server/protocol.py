"""The OpenAI API's request and response bodies, and their translation to and from
exactspec's: a body becomes its prompts, :class:`~exactspec.sampling.SamplingParams` and
``n`` (:meth:`SamplingRequest.prompts`, :meth:`SamplingRequest.sampling_params`); the
engine's :class:`~exactspec.request.RequestError` becomes OpenAI's 400 body naming the API's
field (:meth:`SamplingRequest.request_error`); a :class:`~exactspec.generator.GenerationResult`
becomes a choice (:meth:`SamplingRequest.choice`, :meth:`SamplingRequest.chunk_choice`).

The engine checks what it serves (prompt, vocabulary, context, ``n``, token ids); what is
checked here is the API's own policy: fields that exclude each other, this server's limits,
and (as vLLM) a prompt plus the asked ``max_tokens`` fitting the context.

Field names and meanings follow the OpenAI API reference (``/v1/completions``,
``/v1/chat/completions``) and vLLM's extra sampling parameters (``top_k``, ``min_p``,
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``bad_words``).
vLLM's ``cache_salt`` scopes what a request may draft from earlier requests' outputs.
vLLM's ``return_token_ids`` adds each choice's ``prompt_token_ids`` and ``token_ids`` (the
generated ids, ending with the EOS that ended it) to a response. exactspec adds
``banned_token_ids`` and ``speculation`` (per-request speculation settings) to requests and
``speculation`` (the request's figures) to responses.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exactspec.constraints import Constraint
from exactspec.generation_stats import GenerationStats
from exactspec.generator import GenerationResult, TokenLogprob
from exactspec.request import Prompt, RequestError
from exactspec.sampling import SamplingParams
from exactspec.speculation_length import POLICIES
from exactspec.text import token_pieces

MAX_N = 16
"""Most choices one request may ask for (``n``)."""
MAX_PROMPTS = 16
"""Most prompts one completions request may batch."""
MAX_NUM_SPECULATIVE_TOKENS = 16
"""Largest per-request ``speculation.num_speculative_tokens``."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions`` (chat defaults to the context)."""
CHAT_DEFAULT_MAX_TOKENS = 2048
"""Chat's ``max_completion_tokens`` when neither it nor the context length is known."""
Decode = Callable[[list[int]], str]
"""A tokenizer's decode: token ids → text."""


class ServerError(Exception):
    """An error answered with OpenAI's error body.

    Args:
        status: the HTTP status (400 bad request, 401, 404 unknown model, 413, 503 busy).
        message: what is wrong, naming the value and what is allowed.
        param: the request field at fault, if one is.
        headers: extra response headers (``WWW-Authenticate``, ``Retry-After``).
    """

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.headers = headers

    def body(self) -> dict:
        """``{"error": {"message", "type", "param", "code"}}`` as OpenAI answers."""
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.status}}


class SpeculationOptions(BaseModel):
    """Per-request speculation settings; a field left out takes the server's default.

    Attributes:
        enabled: False decodes this request plainly (no proposer).
        num_speculative_tokens: the most tokens drafted per cycle (0 = plain).
        policy: how k is chosen each cycle (auto, constant, heuristic, confidence).
    """

    model_config = ConfigDict(extra="forbid", strict=True)
    enabled: bool | None = None
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_NUM_SPECULATIVE_TOKENS)] | None = None
    policy: Literal[*POLICIES] | None = None  # type: ignore[valid-type]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of its fields."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None


RESPONSE_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                        "json_schema": ("type", "json_schema")}
"""OpenAI's ``response_format`` types and the keys each takes."""
JSON_SCHEMA_KEYS = ("name", "description", "schema", "strict")
"""The keys of OpenAI's ``response_format.json_schema``."""


def _known_keys(field: str, given: Mapping[str, Any], allowed: Sequence[str]) -> None:
    """Raise a 400 naming ``field``'s keys outside ``allowed``."""
    unknown = [key for key in given if key not in allowed]
    if unknown:
        raise ServerError(400, f"{field} has unknown keys {', '.join(map(repr, unknown))}: "
                               f"it takes {', '.join(allowed)}", field.split(".")[0])


def constraint_of(response_format: Mapping[str, Any] | None,
                  structured_outputs: StructuredOutputs | None) -> Constraint | None:
    """The :class:`~exactspec.constraints.Constraint` OpenAI's ``response_format``
    (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"schema":
    ...}}``; ``text``: none) or vLLM's ``structured_outputs`` asks for (None: neither).

    Raises:
        ServerError: 400 naming the field: both given, an unknown type, several
            ``structured_outputs`` fields, a schema, regex or grammar the engine cannot
            match (the message names the construct).
    """
    if response_format is not None and structured_outputs is not None:
        raise ServerError(400, "response_format and structured_outputs both constrain the "
                               "output: give one of them", "response_format")
    try:
        if structured_outputs is not None:
            given = {name: value for name, value in structured_outputs.model_dump().items()
                     if value is not None}
            if len(given) != 1:
                raise ServerError(400, "structured_outputs takes exactly one of json, regex, "
                                       f"grammar, choice (given: {', '.join(given) or 'none'})",
                                  "structured_outputs")
            (name, value), = given.items()
            return {"json_": Constraint.json_schema, "regex": Constraint.regex,
                    "grammar": Constraint.grammar, "choice": Constraint.choice}[name](value)
        if response_format is None:
            return None
        kind = response_format.get("type")
        if kind not in RESPONSE_FORMAT_KEYS:
            raise ServerError(400, f"response_format type {kind!r} is invalid: text, "
                                   "json_object or json_schema", "response_format")
        _known_keys("response_format", response_format, RESPONSE_FORMAT_KEYS[kind])
        if kind == "text":
            return None
        if kind == "json_object":
            return Constraint.json_object()
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema"), Mapping):
            raise ServerError(400, "response_format json_schema needs \"json_schema\": "
                                   "{\"name\": ..., \"schema\": {...}}", "response_format")
        _known_keys("response_format.json_schema", spec, JSON_SCHEMA_KEYS)
        return Constraint.json_schema(dict(spec["schema"]))
    except ValueError as error:
        field = "response_format" if structured_outputs is None else "structured_outputs"
        raise ServerError(400, f"{field}: {error}", field) from None


class SamplingRequest(BaseModel):
    """The fields both endpoints share (OpenAI's names, then vLLM's extra ones), and what
    each endpoint's subclass says of itself: its prompts, its ``max_tokens`` and
    ``logprobs`` fields, the shape of its choices."""

    response_object: ClassVar[str]
    """The response's ``object`` (streamed: :attr:`chunk_object`)."""
    chunk_object: ClassVar[str]
    id_prefix: ClassVar[str]
    """The response ``id``'s prefix."""
    opening_chunk: ClassVar[bool] = False
    """Whether a stream opens with a chunk per choice before any text (chat: the role)."""
    engine_fields: ClassVar[Mapping[str, str]] = {}
    """The API's names for the fields the engine names (:attr:`RequestError.field
    <exactspec.request.RequestError.field>`) where they differ."""

    # strict: numbers are numbers, booleans booleans, strings strings ("0", true and 1.0
    # are not read as 0, 1 and 1); an unknown field is a 400
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-2**63, lt=2**63)] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # a hint (OpenAI: the end user, for abuse monitoring)
    # vLLM's extra sampling parameters
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # structured output: OpenAI's response_format, or vLLM's structured_outputs
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    # exactspec's
    banned_token_ids: list[int] | None = None
    speculation: SpeculationOptions | None = None
    # vLLM's cache isolation: only requests with the same salt (and API key) share what the
    # suffix proposer's corpus learnt from earlier outputs
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    # vLLM's: each choice carries its prompt's and its own token ids
    return_token_ids: bool = False

    def prompts(self) -> list[Prompt]:
        """The prompts, one per choice set, as the engine takes them (text, token ids, or
        chat messages)."""
        raise NotImplementedError

    def asked_max_tokens(self) -> tuple[int | None, str]:
        """The most tokens the request asks for (None: not said) and its field's name."""
        raise NotImplementedError

    def default_max_tokens(self, room: int | None) -> int:
        """``max_tokens`` when the request does not say, for ``room`` tokens left in the
        context after the longest prompt (None: no limit known)."""
        raise NotImplementedError

    def asked_logprobs(self) -> int | None:
        """Top alternatives asked per token (0: the chosen token's logprob alone), or None."""
        raise NotImplementedError

    def check(self) -> None:
        """The API's rules between fields, checked before anything is tokenised.

        Raises:
            ServerError: 400 naming the field at fault.
        """
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed with stream: true",
                              "stream_options")
        for field, asked in (("logprobs", self.asked_logprobs() is not None),
                             ("return_token_ids", self.return_token_ids)):
            if self.stream and asked:
                raise ServerError(400, f"{field} with stream is not supported yet: ask for "
                                       "them without streaming", field)

    def sampling_params(self, prompt_lengths: Sequence[int], context: int | None
                        ) -> SamplingParams:
        """The request as :class:`SamplingParams` for prompts of ``prompt_lengths`` tokens
        in a context of ``context`` tokens (None: unbounded). Temperature defaults to 1 as
        in OpenAI's API; ``top_k`` -1 or 0 disables it, as in vLLM; a negative ``seed``
        (OpenAI takes any int64) maps to ``seed + 2**63``.

        Raises:
            ServerError: 400 naming the field: an asked ``max_tokens`` that does not fit
                the context after the longest prompt (as vLLM), or a value SamplingParams
                refuses (named as OpenAI names it).
        """
        asked, field = self.asked_max_tokens()
        longest = max(prompt_lengths)
        if context is not None and asked is not None and longest + asked > context:
            raise ServerError(400, f"{field} = {asked} is too large: the context holds "
                                   f"{context} tokens (max_model_len) and the prompt has "
                                   f"{longest}, so at most {context - longest} can be "
                                   "generated", field)
        max_tokens = asked or self.default_max_tokens(None if context is None
                                                      else context - longest)
        logit_bias = {}
        for token, bias in (self.logit_bias or {}).items():
            if not CANONICAL_TOKEN_ID.fullmatch(token):
                raise ServerError(400, f"logit_bias key {token!r} is not a token id: keys are "
                                       "token ids in decimal (ASCII digits, no sign, spaces "
                                       "or leading zeros), e.g. \"50256\"", "logit_bias")
            logit_bias[int(token)] = bias
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed
        if seed is not None and -2**63 <= seed < 0:  # OpenAI takes any int64
            seed += 2**63
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k, min_p=self.min_p,
                seed=seed, max_new_tokens=max_tokens, min_new_tokens=self.min_tokens,
                stop=tuple(stop), stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=self.ignore_eos, repetition_penalty=self.repetition_penalty,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, logit_bias=logit_bias,
                bad_words=tuple(self.bad_words or ()),
                banned_token_ids=tuple(self.banned_token_ids or ()),
                logprobs=self.asked_logprobs(),
                constraint=constraint_of(self.response_format, self.structured_outputs))
        except ValueError as error:
            field = str(error).removeprefix("SamplingParams.").split(" ", 1)[0]
            message = str(error).removeprefix("SamplingParams.")
            for ours, theirs in OPENAI_NAMES.items():
                message = message.replace(ours, theirs)
            raise ServerError(400, message, OPENAI_NAMES.get(field, field)) from None

    def request_error(self, error: RequestError) -> ServerError:
        """The engine's refusal of this request as OpenAI's 400, naming the API's field."""
        return ServerError(400, str(error), self.engine_fields.get(error.field, error.field))

    def choice(self, index: int, result: GenerationResult, params: SamplingParams,
               decode: Decode) -> dict:
        """One finished choice of the response (``params``: the request's, as
        :meth:`sampling_params` made them)."""
        raise NotImplementedError

    def token_ids(self, result: GenerationResult) -> dict:
        """vLLM's ``prompt_token_ids`` and ``token_ids`` of a choice, when asked."""
        if not self.return_token_ids:
            return {}
        return {"prompt_token_ids": list(result.prompt_token_ids),
                "token_ids": list(result.token_ids)}

    def chunk_choice(self, index: int, text: str, params: SamplingParams,
                     result: GenerationResult | None = None, first: bool = False) -> dict:
        """One choice of a streamed chunk: ``text`` more, and with the choice's ``result``
        its finish (``first``: the opening chunk, chat's role)."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


CANONICAL_TOKEN_ID = re.compile(r"0|[1-9][0-9]*", re.ASCII)
"""A ``logit_bias`` key: a token id as OpenAI writes it, so that two keys never name one
token ("5" and "05", " 5" or "٥" would)."""
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
"""SamplingParams fields whose OpenAI/vLLM name differs."""


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of token ids, or a list of
    either (one choice set per prompt). ``logprobs`` (0..5 in OpenAI's API, 0..20 here) asks
    for that many top alternatives per token."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # None: 16, OpenAI's default
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    response_object = chunk_object = "text_completion"
    id_prefix = "cmpl"

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value, info):
        if value is not None and value is not False:
            raise ValueError(f"{info.field_name} is not supported by exactspec")
        return value

    @field_validator("best_of")
    @classmethod
    def _one_best_of(cls, value):
        if value is not None and value != 1:
            raise ValueError(f"best_of = {value} is not supported by exactspec: only 1 (or "
                             "null), one sample per choice")
        return value

    def _single(self) -> bool:
        return isinstance(self.prompt, str) or bool(self.prompt and isinstance(self.prompt[0], int))

    def check(self) -> None:
        """As :meth:`SamplingRequest.check`, and 1 to :data:`MAX_PROMPTS` prompts."""
        if not self._single() and not 1 <= len(self.prompt) <= MAX_PROMPTS:
            raise ServerError(400, f"prompt holds {len(self.prompt)} prompts; give 1 to "
                                   f"{MAX_PROMPTS}", "prompt")
        super().check()

    def prompts(self) -> list[str | list[int]]:
        return [self.prompt] if self._single() else list(self.prompt)

    def asked_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def default_max_tokens(self, room: int | None) -> int:
        return COMPLETIONS_DEFAULT_MAX_TOKENS

    def asked_logprobs(self) -> int | None:
        return self.logprobs

    def choice(self, index: int, result: GenerationResult, params: SamplingParams,
               decode: Decode) -> dict:
        return {"index": index, "text": final_text(result)} | finish(result, params) | {
            "logprobs": None if result.logprobs is None
            else completion_logprobs(result.logprobs, decode)} | self.token_ids(result)

    def chunk_choice(self, index: int, text: str, params: SamplingParams,
                     result: GenerationResult | None = None, first: bool = False) -> dict:
        return {"index": index, "text": text, "logprobs": None} | finish(result, params)


class ChatMessage(BaseModel):
    """One message; ``content`` is text, a list of text parts, or null (an assistant turn
    without text). The fields of OpenAI's messages that exactspec cannot pass to the chat
    template (``name``, an assistant's ``tool_calls``, ``function_call``, ``refusal``,
    ``audio``) are accepted only empty, as SDKs echo them back; any value is a 400."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    function_call: dict[str, Any] | None = None
    refusal: str | None = None
    audio: dict[str, Any] | None = None
    annotations: list[Any] | None = None

    @field_validator("name", "tool_calls", "function_call", "refusal", "audio")
    @classmethod
    def _empty(cls, value, info):
        if value:
            raise ValueError(f"{info.field_name} is not supported by exactspec: the chat "
                             "template gets each message's role and content only")
        return value

    @field_validator("role")
    @classmethod
    def _known_role(cls, role: str) -> str:
        if role not in ("system", "developer", "user", "assistant"):
            raise ValueError(f"role {role!r} is not supported: use system, developer, user or "
                             "assistant (exactspec serves no tools or functions)")
        return role

    @field_validator("content")
    @classmethod
    def _text_parts(cls, content):
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported: "
                                 "only text parts ({\"type\": \"text\", \"text\": ...})")
        return content

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part["text"] for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template.
    ``max_completion_tokens`` (or the older ``max_tokens``) defaults to the rest of the
    context; ``logprobs`` is a bool and ``top_logprobs`` (0..20) the alternatives."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # OpenAI fields that SDKs send by default and that change nothing here when they ask
    # for nothing; any value that would ask for something is refused (400), never ignored
    tools: list[Any] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None  # a hint
    store: bool | None = None
    metadata: dict[str, Any] | None = None  # a hint (tags for stored completions)
    service_tier: str | None = None

    response_object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl"
    opening_chunk = True
    engine_fields = {"prompt": "messages"}

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools):
        if tools:
            raise ValueError("tools are not supported by exactspec")
        return tools

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, choice):
        if choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by exactspec (no tools)")
        return choice

    @field_validator("store")
    @classmethod
    def _not_stored(cls, store):
        if store:
            raise ValueError("store: true is not supported by exactspec (nothing is stored)")
        return store

    @field_validator("service_tier")
    @classmethod
    def _one_tier(cls, tier):
        if tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {tier!r} is not supported: exactspec has one tier "
                             "(auto or default)")
        return tier

    def check(self) -> None:
        """As :meth:`SamplingRequest.check`, and ``top_logprobs`` only with ``logprobs``."""
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise ServerError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def prompts(self) -> list[list[dict[str, str]]]:
        """The one prompt: the messages (``developer`` as ``system``), for the chat
        template."""
        return [[{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                 for m in self.messages]]

    def asked_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def default_max_tokens(self, room: int | None) -> int:
        """The rest of the context (:data:`CHAT_DEFAULT_MAX_TOKENS` when unknown)."""
        return max(room or CHAT_DEFAULT_MAX_TOKENS, 1)

    def asked_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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
