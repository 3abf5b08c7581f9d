"""Proposers named by a short spec string, for the command line and the benchmark:

    none                         no drafting (plain decoding)
    prompt-lookup[:ngram=2-3]    n-gram lookup in the context
    early-exit:L                 the target's first L layers (self-draft)
    draft:MODEL                  a smaller model on the same tokenizer (name, folder, .gguf)
"""

from __future__ import annotations

from collections.abc import Callable

from exactspec.backends.base import Backend
from exactspec.proposers.base import Proposer
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer

PROPOSER_SPECS = "none, prompt-lookup[:ngram=2-3], early-exit:L, draft:MODEL"


def parse_proposer(spec: str, target: Backend,
                   load_model: Callable[[str], Backend]) -> Proposer | None:
    """Build the proposer ``spec`` names (None for ``none``).

    Raises:
        ValueError: naming the bad spec and the allowed forms (or a bad layer count).
    """
    kind, _, arg = spec.partition(":")
    bad = ValueError(f"proposer {spec!r} is invalid: use one of {PROPOSER_SPECS}")
    if kind == "none" and not arg:
        return None
    if kind == "prompt-lookup":
        if not arg:
            return PromptLookupProposer()
        key, _, value = arg.partition("=")
        try:
            low, high = (int(n) for n in value.split("-"))
        except ValueError:
            raise bad from None
        if key != "ngram":
            raise bad
        return PromptLookupProposer(low, high)
    if kind == "early-exit" and arg:
        try:
            layers = int(arg)
        except ValueError:
            raise bad from None
        return EarlyExitProposer(target, layers)
    if kind == "draft" and arg:
        return DraftModelProposer(load_model(arg), target)
    raise bad
