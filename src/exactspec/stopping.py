"""Stop conditions, checked on committed tokens one at a time, in order.

A token that ends generation (an EOS id, or the token that completes a stop string) is the
last token emitted: nothing after it is returned or counted. Text, token ids and counts
are all cut at that token, so the text is always ``decode(token_ids)``: it ends with the
stop string (plus whatever else the completing token spells). ``stop_reason`` says which
stop matched, so a caller can strip it.
"""

from __future__ import annotations

from collections.abc import Sequence

from exactspec.backends.base import Tokenizer


class StopChecker:
    """Decides, after each committed token, whether generation has stopped.

    Args:
        tokenizer: to decode the output when stop strings are set.
        eos_token_ids: ids that end generation (may be empty: no EOS).
        stop_strings: strings that end generation (may be empty).

    Attributes:
        stop_reason: the EOS id or stop string that ended generation, else None.
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self.stop_reason: int | str | None = None

    def is_stop(self, output_token_ids: Sequence[int]) -> bool:
        """True if the last of ``output_token_ids`` (the generated tokens so far) ends
        generation. Decodes the whole output when stop strings are set (exact, and cheap
        next to a forward pass)."""
        if output_token_ids[-1] in self.eos_token_ids:
            self.stop_reason = output_token_ids[-1]
            return True
        if self.stop_strings:
            text = self.tokenizer.decode(output_token_ids)
            found = [(text.find(s), s) for s in self.stop_strings if s in text]
            if found:
                self.stop_reason = min(found)[1]
                return True
        return False
