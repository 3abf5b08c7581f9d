"""Structured output: a :class:`Constraint` on what may be generated (a JSON schema, any JSON
object, a regular expression, a Lark grammar, one of fixed choices) and
:class:`ConstraintMask`, the tokens it allows after a sequence's output so far.

The constrained target distribution at each position is the processed p with every token
the constraint forbids after the *true* output prefix set to probability 0
(:class:`~exactspec.logits_pipeline.LogitsPipeline`, step 5). Verification masks each
drafted position with the state its own prefix reaches, so a forbidden draft has p = 0 and
is rejected with certainty, the recovered token comes from the masked residual, and the
bonus token is masked too: speculation leaves the constrained distribution exactly as
plain decoding draws it (docs/exactness.md, "Constraints").

Grammars are compiled and matched by llguidance (Microsoft's Rust engine behind
``guidance``, also used by vLLM, SGLang and llama.cpp; docs/design.md, "Structured output"):
its matcher advances token by token and rolls back, which is what speculation needs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import llguidance
import llguidance.gbnf_to_lark
import numpy as np
import torch

KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
"""What a :class:`Constraint` may be."""


class ConstraintViolation(ValueError):
    """An output the constraint forbids was asked about: it was not generated under it."""


@dataclass(frozen=True)
class Constraint:
    """What the output must match (OpenAI's ``response_format``, vLLM's
    ``structured_outputs``). Build one with the class methods.

    Attributes:
        kind: one of :data:`KINDS`.
        value: the JSON schema as JSON text (``json_schema``), the regular expression
            (``regex``), the Lark grammar (``grammar``), the choices (``choice``: a tuple of
            strings), None for ``json_object``.
    """

    kind: str
    value: str | tuple[str, ...] | None = None

    @classmethod
    def json_schema(cls, schema: dict | str) -> Constraint:
        """Output that is JSON valid against ``schema`` (a dict, or its JSON text), its
        properties generated in the order the schema writes them (as OpenAI and vLLM do)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as error:
                raise ValueError(f"the JSON schema is not valid JSON: {error}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"a JSON schema is a JSON object, not {type(schema).__name__}")
        return _checked(cls("json_schema", json.dumps(schema)))  # properties in the order written

    @classmethod
    def json_object(cls) -> Constraint:
        """Output that is any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Output that matches ``pattern`` whole (llguidance's regular expressions: Rust
        ``regex`` syntax, no look-around or backreferences)."""
        return _checked(cls("regex", pattern))

    @classmethod
    def grammar(cls, lark: str) -> Constraint:
        """Output that the Lark grammar ``lark`` derives from its ``start`` rule
        (llguidance's Lark dialect; a GBNF grammar is converted)."""
        if "::=" in lark:  # GBNF (llama.cpp's format)
            try:
                lark = llguidance.gbnf_to_lark.gbnf_to_lark(lark)
            except Exception as error:  # noqa: BLE001 (the converter's errors are its own)
                raise ValueError(f"the GBNF grammar could not be converted: {error}") from None
        return _checked(cls("grammar", lark))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> Constraint:
        """Output that is exactly one of ``choices`` (vLLM's ``choice``)."""
        choices = tuple(choices)
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"choices {list(choices)!r} are invalid: give one or more "
                             "non-empty strings")
        return _checked(cls("choice", choices))

    def to_grammar(self) -> str:
        """The constraint as an llguidance grammar (the JSON text ``LLMatcher`` takes)."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(self.value)
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.value)
        if self.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(self.value)
        if self.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in self.value))
        raise ValueError(f"constraint kind {self.kind!r} is invalid: choose one of "
                         f"{', '.join(KINDS)}")

    def mask(self, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> ConstraintMask:
        """A sequence's :class:`ConstraintMask` of this constraint (arguments as its)."""
        return ConstraintMask(self, tokenizer, vocab_size)

    def __str__(self) -> str:
        return self.describe()

    def describe(self) -> str:
        """One line for messages and configs."""
        if self.kind == "choice":
            return "choice " + " | ".join(self.value)
        if self.value is None:
            return self.kind
        text = self.value if len(self.value) <= 60 else self.value[:57] + "..."
        return f"{self.kind} {text}"


def _checked(constraint: Constraint) -> Constraint:
    """``constraint`` if llguidance compiles it; else ValueError naming the construct."""
    try:
        grammar = constraint.to_grammar()
    except Exception as error:  # noqa: BLE001 (llguidance raises ValueError or its own)
        raise ValueError(f"the {constraint.kind.replace('_', ' ')} is not supported: "
                         f"{error}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"the {constraint.kind.replace('_', ' ')} is not supported: "
                         + "; ".join(messages))
    return constraint


class ConstraintMask:
    """The tokens a :class:`Constraint` allows after any output of one sequence: an
    llguidance matcher kept at the last output asked about (rolled back and advanced to
    each new one; drafted tokens are consumed for their rows' masks and rolled back).

    Args:
        constraint: the constraint.
        tokenizer: the target's tokenizer as llguidance's ``LLTokenizer``
            (:meth:`~exactspec.backends.base.Tokenizer.constraint_tokenizer`), whose EOS
            tokens are allowed exactly where the constraint is complete.
        vocab_size: width of the logits (≥ the tokenizer's tokens; the rest are forbidden).
    Raises:
        ValueError: if the grammar does not compile for this tokenizer.
    """

    def __init__(self, constraint: Constraint, tokenizer: llguidance.LLTokenizer,
                 vocab_size: int) -> None:
        self.constraint, self.vocab_size = constraint, vocab_size
        self._matcher = llguidance.LLMatcher(tokenizer, constraint.to_grammar(), log_level=0)
        if self._matcher.is_error():
            raise ValueError(f"the {constraint.kind.replace('_', ' ')} is not supported: "
                             f"{_first_line(self._matcher.get_error())}")
        self._output: list[int] = []  # the output the matcher stands after
        self._pushed: list[bool] = []  # per token of it: whether the matcher took it
        self._forced: list[int] | None = None  # forced_tokens at this state, once computed

    def allowed(self, output: Sequence[int], drafted: Sequence[int], n: int) -> torch.Tensor:
        """``[n, vocab_size]`` bool: the tokens allowed after ``output + drafted[:i]`` in row
        i. A row after a drafted token the constraint forbids is never reached (that draft
        has p = 0 and is rejected with certainty); it repeats the row before it.

        Raises:
            ConstraintViolation: if ``output`` itself breaks the constraint (it was not
                generated under it).
            ValueError: if no token of the vocabulary continues the output.
        """
        self._advance_to(output)
        rows = [self._mask()]
        consumed = 0
        for token in drafted[: n - 1]:
            if not (0 <= token < self.vocab_size and rows[-1][token]):
                break
            self._consume(token)
            consumed += 1
            rows.append(self._mask())
        self._rollback(consumed)
        rows += [rows[-1]] * (n - len(rows))
        return torch.stack(rows)

    def forced_tokens(self, output: Sequence[int]) -> list[int]:
        """The tokens the constraint forces after ``output`` (the canonical tokenization of
        the bytes it allows alone; empty where it allows a choice), for drafting."""
        self._advance_to(output)
        if self._forced is None:
            self._forced = [] if self._matcher.is_stopped() else list(
                self._matcher.compute_ff_tokens())
        return list(self._forced)

    def _advance_to(self, output: Sequence[int]) -> None:
        known = self._output
        common = (len(known) if list(output[:len(known)]) == known  # the usual case: more
                  else _common_prefix(known, output))  # another sample, another branch
        self._rollback(len(known) - common)
        for token in output[common:]:
            self._consume(token)

    def _consume(self, token: int) -> None:
        """Advance past ``token``. Once the constraint is complete and stopped, the matcher
        takes no more tokens (an EOS there is not recorded), so each token remembers
        whether it was pushed."""
        pushed = not self._matcher.is_stopped()
        if (not pushed and not self._mask()[token]) or (pushed and (  # stopped: EOS only
                self._matcher.validate_tokens([token]) != 1  # checked first: no error state
                or not self._matcher.consume_token(token))):
            raise ConstraintViolation(
                f"token {token} breaks the {self.constraint.describe()} "
                f"({_first_line(self._matcher.get_error())}): this output was not generated "
                "under it")
        self._output.append(token)
        self._pushed.append(pushed)
        self._forced = None

    def _rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens consumed."""
        if num_tokens <= 0:
            return
        pushed = sum(self._pushed[-num_tokens:])
        del self._output[-num_tokens:], self._pushed[-num_tokens:]
        self._forced = None
        if pushed and not self._matcher.rollback(pushed):  # past what it keeps: replay
            self._matcher.reset()
            self._matcher.consume_tokens([t for t, p in zip(self._output, self._pushed) if p])

    def _mask(self) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens allowed at the matcher's state."""
        bitmask = self._matcher.compute_bitmask()  # little-endian 32-bit words, bit i = token i
        if self._matcher.is_error():  # e.g. no token of this vocabulary continues the output
            raise ValueError(f"the {self.constraint.describe()} cannot be continued: "
                             f"{_first_line(self._matcher.get_error())}")
        bits = torch.from_numpy(np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8),
                                              bitorder="little").view(np.bool_))
        if bits.numel() >= self.vocab_size:
            return bits[: self.vocab_size]
        return torch.cat([bits, bits.new_zeros(self.vocab_size - bits.numel())])


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _first_line(message: str) -> str:
    """llguidance's message without its backtrace and state dump."""
    return message.strip().splitlines()[0] if message.strip() else "no reason given"
