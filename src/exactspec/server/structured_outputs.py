"""Structured output as the APIs ask for it: OpenAI's ``response_format`` or vLLM's
``structured_outputs``, as a :class:`~exactspec.constraints.Constraint`
(:func:`constraint_of`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from exactspec.constraints import Constraint
from exactspec.server.errors import ServerError


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
