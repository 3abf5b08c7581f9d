"""Stop conditions, checked on committed tokens one at a time, in order.

A token that ends generation (an EOS id, or the token that completes a stop string) is the
last token emitted: nothing after it is returned or counted. The text is cut before the
stop string (OpenAI's convention); the EOS token stays in ``token_ids`` but, being a
special token, not in the text.
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
    """

    def __init__(self, tokenizer: Tokenizer, eos_token_ids: Sequence[int],
                 stop_strings: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_strings = tuple(stop_strings)
        self._text_end: int | None = None  # where a stop string starts in the text

    def is_stop(self, output_token_ids: Sequence[int]) -> bool:
        """True if the last of ``output_token_ids`` (the generated tokens so far) ends
        generation. Decodes the whole output when stop strings are set (exact, and cheap
        next to a forward pass)."""
        if output_token_ids[-1] in self.eos_token_ids:
            return True
        if self.stop_strings:
            text = self.tokenizer.decode(output_token_ids)
            found = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
            if found:
                self._text_end = min(found)
                return True
        return False

    def text(self, output_token_ids: Sequence[int]) -> str:
        """The output's text, cut before the stop string if one ended generation."""
        return self.tokenizer.decode(output_token_ids)[: self._text_end]
