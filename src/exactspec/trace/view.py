"""What both views of a trace (:mod:`~exactspec.trace.terminal`,
:mod:`~exactspec.trace.page`) show alike: each committed token's piece of the text, marked
when it has none of its own, and where a cycle boundary goes."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from exactspec.cycle_trace import CycleTrace
from exactspec.text import token_pieces

NO_TEXT = "∅"
"""Shown for a token without text of its own (EOS and other special tokens)."""
PARTIAL = "·"
"""Shown for a token that holds only the start of a character the next token completes."""


def shown_pieces(token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """:func:`~exactspec.text.token_pieces` for display (``[num_tokens]`` strings): a token
    with no share of the text shows as :data:`NO_TEXT` when it has no text at all (a special
    token) and as :data:`PARTIAL` when it starts a character that a later token completes."""
    return [piece or (NO_TEXT if decode([token]) == "" else PARTIAL)
            for token, piece in zip(token_ids, token_pieces(token_ids, decode))]


def at_boundary(trace: Sequence[CycleTrace], index: int) -> bool:
    """Whether a cycle boundary mark goes before cycle ``index``: where that cycle or the
    one before drafted (consecutive plain steps, one token each, are not separated)."""
    return index > 0 and bool(trace[index].drafts or trace[index - 1].drafts)
