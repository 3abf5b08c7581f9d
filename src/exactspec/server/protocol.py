"""The OpenAI API's request bodies and their translation to exactspec's: a body becomes its
prompts, :class:`~exactspec.sampling.SamplingParams` and ``n`` (:meth:`SamplingRequest.asked`,
:meth:`SamplingRequest.sampling_params`); the engine's
:class:`~exactspec.request.RequestError` becomes OpenAI's 400 body naming the API's field
(:meth:`SamplingRequest.request_error`). The way back, a
:class:`~exactspec.generator.GenerationResult` as a choice, is
:mod:`exactspec.server.responses`'.

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
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, field_validator

from exactspec.request import Prompt, RequestError
from exactspec.sampling import SamplingParams
from exactspec.server.errors import ServerError
from exactspec.server.structured_outputs import StructuredOutputs, constraint_of
from exactspec.speculation_length import POLICIES

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


class Asked(NamedTuple):
    """What a body asks of the engine, in its endpoint's fields.

    Attributes:
        prompts: one per choice set, as the engine takes them (text, token ids, or chat
            messages).
        max_tokens: the most tokens asked for (None: not said), under the field's name
            ``max_tokens_field``.
        default_max_tokens: when not said (None: the rest of the context after the longest
            prompt, :data:`CHAT_DEFAULT_MAX_TOKENS` when that is unknown).
        logprobs: top alternatives asked per token (0: the chosen token's logprob alone),
            None: none.
    """

    prompts: list[Prompt]
    max_tokens: int | None
    max_tokens_field: str
    default_max_tokens: int | None
    logprobs: int | None


class SamplingRequest(BaseModel):
    """The fields both endpoints share (OpenAI's names, then vLLM's extra ones); each
    endpoint's subclass adds its own and says what they ask (:meth:`asked`)."""

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

    @abstractmethod
    def asked(self) -> Asked:
        """What the body asks of the engine, in its endpoint's fields (the one thing each
        endpoint says of itself on the way in; :mod:`exactspec.server.responses` renders the
        way out)."""

    def check(self) -> None:
        """The API's rules between fields, checked before anything is tokenised.

        Raises:
            ServerError: 400 naming the field at fault.
        """
        if self.stream_options is not None and not self.stream:
            raise ServerError(400, "stream_options is only allowed with stream: true",
                              "stream_options")
        for field, asked in (("logprobs", self.asked().logprobs is not None),
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
        wanted = self.asked()
        asked, field = wanted.max_tokens, wanted.max_tokens_field
        longest = max(prompt_lengths)
        if context is not None and asked is not None and longest + asked > context:
            raise ServerError(400, f"{field} = {asked} is too large: the context holds "
                                   f"{context} tokens (max_model_len) and the prompt has "
                                   f"{longest}, so at most {context - longest} can be "
                                   "generated", field)
        room = None if context is None else context - longest
        max_tokens = asked or wanted.default_max_tokens or max(room or CHAT_DEFAULT_MAX_TOKENS, 1)
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
                logprobs=wanted.logprobs,
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

    def asked(self) -> Asked:
        return Asked([self.prompt] if self._single() else list(self.prompt), self.max_tokens,
                     "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS, self.logprobs)


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

    def asked(self) -> Asked:
        """The one prompt: the messages (``developer`` as ``system``), for the chat
        template; ``max_completion_tokens`` before ``max_tokens``, by default the rest of
        the context."""
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                    for m in self.messages]
        field = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
        return Asked([messages], getattr(self, field), field, None,
                     (self.top_logprobs or 0) if self.logprobs else None)
