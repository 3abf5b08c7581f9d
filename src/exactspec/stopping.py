"""Stop conditions, checked on committed tokens one at a time, in order.

A token that ends generation (an EOS id, or the token that completes a stop string) is the
last token emitted: nothing after it is returned or counted. Text, token ids and counts
are all cut at that token, so the text is always ``decode(token_ids)``: it ends with the
stop string (plus whatever else the completing token spells). ``stop_reason`` says which
stop matched, so a caller can strip it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from exactspec.backends.base import Tokenizer


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
    """

    def __init__(self, tokenizer: Tokenizer, stop_token_ids: Iterable[int],
                 stop_strings: Sequence[str], min_new_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stop_token_ids = frozenset(stop_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.min_new_tokens = min_new_tokens
        self.stop_reason: int | str | None = None
        self._checked_chars = 0  # text length already searched for stop strings

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
            found = [(i, s) for s in self.stop_strings
                     if (i := text.find(s, max(0, self._checked_chars - len(s) + 1))) >= 0]
            # A character split over several tokens decodes as U+FFFD until complete:
            # search it again next time.
            self._checked_chars = len(text.rstrip("\ufffd"))
            if allowed and found:
                self.stop_reason = min(found)[1]
                return True
        return False
