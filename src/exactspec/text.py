"""Generated text: where stop strings occur, when generation stops, each token's share.

Stop conditions are checked on committed tokens one at a time, in order. A token that ends
generation (an EOS id, or the token that completes a stop string) is the last token
emitted: nothing after it is returned or counted. Text, token ids and counts are all cut at
that token, so the text is always ``decode(token_ids)``: it ends with the stop string (plus
whatever else the completing token spells). ``stop_reason`` says which stop matched and
``stop_offset`` where the stop string begins, so a caller can cut it off (OpenAI's API
returns the text before it).

Offsets are in characters of the decoded text (Python ``str`` indices). A character split
over several tokens decodes as U+FFFD (the replacement character) until the token that
completes it arrives; such a tail is never counted as searched or shown.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from exactspec.backends.base import Tokenizer

INCOMPLETE = "\ufffd"
"""What a tokenizer's decode shows for the start of a character whose bytes are not all
there yet (the Unicode replacement character)."""


def find_stop(text: str, stop_strings: Sequence[str], searched: int = 0) -> tuple[int, str] | None:
    """The earliest occurrence of any of ``stop_strings`` in ``text`` that ends after its
    first ``searched`` characters (one wholly inside them was seen by an earlier search).

    Args:
        text: the decoded output so far.
        stop_strings: the strings to look for (non-empty strings).
        searched: characters of ``text`` already searched (0: search it all).
    Returns:
        ``(offset, stop_string)``, offset the character index where it begins; of two
        occurrences at one offset the string that sorts first. None if there is none.
    """
    found = [(offset, stop) for stop in stop_strings
             if (offset := text.find(stop, max(0, searched - len(stop) + 1))) >= 0]
    return min(found) if found else None


class StopChecker:
    """Decides, after each committed token, whether generation has stopped.

    Args:
        tokenizer: to decode the output when stop strings are set.
        stop_token_ids: ids that end generation (EOS, stop token ids; may be empty).
        stop_strings: strings that end generation (may be empty).
        min_new_tokens: no stop applies while fewer tokens were generated; a stop string
            must then be completed by a token at or after that point.

    Attributes:
        stop_reason: the EOS id or stop string that ended generation, else None.
        stop_offset: where that stop string begins in the decoded output (characters of
            ``decode(token_ids[start:])``); None unless a stop string ended generation.
    """

    def __init__(self, tokenizer: Tokenizer, stop_token_ids: Iterable[int],
                 stop_strings: Sequence[str], min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.min_new_tokens = min_new_tokens
        self.stop_reason: int | str | None = None
        self.stop_offset: int | None = None
        self._searched = 0  # characters of the output already searched for stop strings

    def is_stop(self, token_ids: Sequence[int], start: int = 0) -> bool:
        """True if the last of ``token_ids`` ends generation; the generated tokens are
        ``token_ids[start:]`` (no copy unless stop strings are set: then the output is
        decoded whole, exact and cheap next to a forward pass)."""
        allowed = len(token_ids) - start >= self.min_new_tokens
        if allowed and token_ids[-1] in self.stop_token_ids:
            self.stop_reason = token_ids[-1]
            return True
        if self.stop_strings:
            text = self.tokenizer.decode(token_ids[start:])
            # Only occurrences that end in the newest token's text are new.
            found = find_stop(text, self.stop_strings, self._searched)
            # An incomplete character is searched again once complete.
            self._searched = len(text.rstrip(INCOMPLETE))
            if allowed and found:
                self.stop_offset, self.stop_reason = found
                return True
        return False


def token_pieces(token_ids: Sequence[int], decode: Callable[[list[int]], str]) -> list[str]:
    """Each token's share of ``decode(token_ids)``: the text it adds to the tokens before it,
    so that the pieces join to the text (a character split over several tokens comes out
    whole, with the token completing it; the tokens before get ``""``).

    Args:
        token_ids: ``[num_tokens]`` the tokens, in order.
        decode: the tokenizer's decode (token ids → text).
    Returns:
        ``[num_tokens]`` strings.
    """
    pieces, previous = [], ""
    for i in range(1, len(token_ids) + 1):
        text = decode(list(token_ids[:i]))
        if text.endswith(INCOMPLETE):  # an incomplete character: wait for the next token
            pieces.append("")
            continue
        pieces.append(text[len(previous):])
        previous = text
    if pieces and previous != decode(list(token_ids)):
        pieces[-1] += decode(list(token_ids))[len(previous):]
    return pieces
